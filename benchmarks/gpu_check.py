"""GPU check: funshard and torch_frontend on ONE GPU, against plain JAX, FSDP2 and torch.

One command, at most 8 minutes on one GPU (world size 1), from the repository root:

    python benchmarks/gpu_check.py --out-json gpu_check.json --out-md gpu_check.md

On a machine without a GPU it exits at once (status 2) saying so; `--cpu-smoke` runs
the same code on CPU with tiny models in seconds (a check of the script, not a
measurement). Parts, each in a process of its own with its own time budget; a part
that fails or runs out of time records its error in the table and the run goes on:

1. `probe`: JAX's backend and device, torch's CUDA.
2. `dlpack`: torch CUDA tensors -> JAX and back through torch_frontend's bridge, each
   crossing checked for no copy (pointer equality), and timed.
3. `tests`: the GPU test subset, `pytest -m gpu tests/test_gpu.py` (JAX_PLATFORMS=cuda).
4. `jax-plain` / `jax-funshard`: a bf16 GPT of about 1B parameters (fp32 master
   weights, AdamW), one training step compiled and timed: plain JAX (parameters cast
   to bf16 in the loss) and funshard (`fs.fully_shard` per block, `param_dtype`
   bf16, `reduce_dtype` f32). Step time, FLOPs from `compiled.cost_analysis()`, MFU
   against the GPU's peak bf16 TFLOPS (`PEAK_BF16_TFLOPS`, or `--peak-tflops`), and
   peak memory (`memory_stats()["peak_bytes_in_use"]`, one process per variant).
5. `torch-plain` / `torch-fsdp2` / `torch-frontend`: a torch GPT (fp32, TF32 matmuls),
   the same weights and batches: plain torch, FSDP2 (`fully_shard` per block, NCCL)
   and torch_frontend (its collectives on JAX). Per-step losses (compared), step
   time, and peak `torch.cuda.max_memory_allocated` (plus JAX's peak for the frontend,
   whose gathered parameters live in JAX's memory).

Targets (GPU only): funshard step <= 1.05x plain JAX; torch_frontend <= 1.1x FSDP2;
MFU of the 1B bf16 step >= 35% on an H100/H200-class GPU.

The code lives in the `gpu_bench/` package beside this file (see its `__init__.py`);
this script is its entry point, and each part's process runs it again with `--part`.
"""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    # benchmarks/: the package, also when this file is loaded by path (the tests do)
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_bench.cli import EXIT_NO_GPU, main, no_gpu_reason
from gpu_bench.measure import PEAK_BF16_TFLOPS, mfu, peak_tflops

__all__ = ["EXIT_NO_GPU", "PEAK_BF16_TFLOPS", "main", "mfu", "no_gpu_reason", "peak_tflops"]

if __name__ == "__main__":
    sys.exit(main())
