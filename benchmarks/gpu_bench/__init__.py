"""The GPU check as a package; `benchmarks/gpu_check.py` is its entry point.

Modules, one concern each:

* `config`: the GPT shapes (the 1B bf16 JAX model, the torch model, their tiny
  `--cpu-smoke` forms), the targets and each part's time budget.
* `measure`: timing a step, FLOPs and peak memory read from JAX, the GPU's bf16 peak by
  its name, MFU.
* `jax_step`: the `jax-plain` / `jax-funshard` parts (one training step of the 1B GPT).
* `torch_step`: the `torch-plain` / `torch-fsdp2` / `torch-frontend` parts.
* `parts`: the `probe`, `dlpack` and `tests` parts, the registry of every part by name,
  and the environment each part's process gets.
* `report`: the targets' evaluation and the Markdown table.
* `cli`: flags, running each part in a process of its own within its budget, the order
  of a run.

Nothing here imports JAX or torch at module level: `--cpu-smoke` chooses JAX's platform
before JAX starts, and each part imports what it needs in its own process.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # examples.models: the model of every part
