"""The torch benchmark as a package; `benchmarks/bench_torch.py` is its entry point.

Modules, one concern each:

* `model`: the GPT (plain PyTorch) and the same model in JAX for funshard's step.
* `variants`: one builder per way of training it (torch_frontend, PyTorch FSDP2, DDP,
  funshard's JAX step, one process alone).
* `measure`: per-step wall time, bytes written to sockets, peak resident memory, and
  the frontend's profile (time inside its bridge calls).
* `worker`: one rank of the torchrun job; runs every variant, interleaved.
* `jobs`: starting that job under torchrun, reading its ranks' results back, and the
  machine it ran on.
* `isolated`: the jobs of one variant each (`--alone-repeats`, `--rss`, `--compile`)
  and their tables.
* `report`: the results aggregated over the ranks, the checks, the tables.
* `page`: the Markdown page.
* `cli`: the flags and the order of a run (the JSON result too).
* `grad_probe`: a torchrun script of its own comparing the frontend's gradients with
  FSDP2's bit for bit, step by step (with or without the frontend's prefetches).
* `collective_probe`: funshard's eager reduce-scatter and all-gather alternating on 2
  ranks, every result checked against numpy (no torch).

The worker imports nothing from here at module level that starts JAX: torchrun's
environment has to reach `torch_frontend.init_distributed()` first.
"""
