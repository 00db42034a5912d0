"""Torch benchmark: torch_frontend against FSDP2, DDP and funshard's JAX step, in ONE run.

Run from the repository root (2 processes on gloo, this machine's CPUs):

    python benchmarks/bench_torch.py                       # the 4 x 1024 GPT (10-15 min here)
    python benchmarks/bench_torch.py --quick               # tiny model, 3 steps (smoke run)
    python benchmarks/bench_torch.py --preset nano-10.8m --rss   # nanoGPT's 6 x 384, and
                                                           # each process's peak RSS
    python benchmarks/bench_torch.py --out-md result.md --out-json result.json
    python benchmarks/bench_torch.py --preset nano-0.8m --alone-repeats 5   # and each variant
                                                           # timed in jobs of its own

One torchrun job (`torch_bench/worker.py`, 2 ranks) builds every variant on the same
model (`torch_bench/model.py`: a 4-block, width-1024 byte-level GPT), the same initial
weights and the same batches of the bundled corpus, then runs them interleaved (round r
runs step r of every variant, each after a barrier):

1. torch_frontend, fully_shard per block then the root, reshard_after_forward=True
2. PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on gloo, the same, True
3. / 4. the same two with reshard_after_forward=False
5. DistributedDataParallel on gloo
6. funshard's JAX step on the same 2 processes (`fs.distributed` mesh,
   `fs.value_and_grad`, `fs.fully_shard` per block), the same model in JAX
7. one process alone: plain torch on rank 0 with the whole global batch
8. the compute floor: plain torch on one rank's rows, nothing communicated

Every rank computes with one thread (torch and XLA), as 2 ranks share 2 cores. Reported:
median step time (the slower rank's, over the timed steps) and its ratio to PyTorch
FSDP2 measured in the same run; bytes each rank sent per step (`/proc/self/io` wchar:
gloo writes its sockets with writev); per-rank state (parameters + optimizer state) and
the step's peak resident memory above the resident memory at its start (VmHWM);
losses, with the frontend's checked against FSDP2's step by step. With
`--profile-steps N` (default 5) the frontend then runs N more steps with its bridge
calls timed (`torch_bench/measure.py`).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: torch_bench

from torch_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
