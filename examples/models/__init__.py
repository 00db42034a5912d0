"""The models of the examples and the benchmarks: one source for each.

The package itself needs no framework; each module imports only its own:

* `jax_gpt`: the GPT as pure JAX functions of parameter dicts (`benchmarks/fsdp/`,
  `benchmarks/gpu_check.py`, `benchmarks/torch_bench/`).
* `nnx_gpt`: the same GPT in Flax nnx (`examples/train_lm.py`).
* `torch_gpt`: the same GPT in plain PyTorch (`examples/train_torch.py`,
  `benchmarks/torch_bench/`, `benchmarks/gpu_check.py`).

Every one is a byte-level (by default) GPT: token and learned position embeddings,
pre-norm blocks (causal multi-head attention, a 4x tanh-GELU MLP), a final LayerNorm and
an untied head. Scripts in `examples/` import it as `models`; the benchmarks put the
repository root on `sys.path` and import `examples.models`.
"""

from __future__ import annotations

import dataclasses

VOCAB = 256  # byte-level tokens: no tokenizer to ship or download


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of the examples' GPT; checkpoints fit only the shape that wrote them."""

    width: int = 128
    depth: int = 3
    heads: int = 4
    context: int = 64


TINY = ModelConfig(width=32, depth=2, heads=2, context=32)  # `--tiny`: for smoke tests
