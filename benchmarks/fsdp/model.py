"""The benchmark's model: a GPT-style decoder, its parameters, and the sizes of its FSDP units.

The model itself is `examples/models/jax_gpt.py` (the examples' and benchmarks' one
source): learned token and positional embeddings, pre-LN blocks (causal multi-head
attention written out, 4x GELU MLP), a final LayerNorm and an untied head; the loss is
the mean next-token cross-entropy in f32. Block parameters are a Python list of
per-block dicts and every matmul is written `x @ w` (the orientation in which funshard
keeps no derived copy of a gathered weight).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

_ROOT = str(Path(__file__).resolve().parents[2])  # the repository: examples.models
if _ROOT not in sys.path:
    sys.path.append(_ROOT)

from examples.models.jax_gpt import lm_loss, make_block  # noqa: E402  (the variants)

# The root unit: everything outside the blocks, gathered once per step by fs.unshard.
ROOT_KEYS = ("embed", "pos", "lnf_g", "lnf_b", "head")


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape and the global batch."""

    blocks: int = 8
    width: int = 512
    heads: int = 8
    vocab: int = 4096
    seq: int = 128
    batch: int = 16
    mlp: int = 4

    @property
    def ff(self) -> int:
        return self.mlp * self.width


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Full f32 parameters (host numpy): root leaves plus a Python list of per-block dicts.

    Drawn with numpy, so that building them compiles nothing.
    """
    d, f, v, t = cfg.width, cfg.ff, cfg.vocab, cfg.seq
    rng = np.random.default_rng(seed)

    def normal(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def dense(shape, scale=1.0):
        return normal(shape, scale / math.sqrt(shape[0]))

    def ones(k):
        return np.ones((k,), np.float32)

    def zeros(k):
        return np.zeros((k,), np.float32)

    out_scale = 1.0 / math.sqrt(2 * cfg.blocks)
    blocks = [
        {
            "ln1_g": ones(d),
            "ln1_b": zeros(d),
            "qkv": dense((d, 3 * d)),
            "qkv_b": zeros(3 * d),
            "proj": dense((d, d), out_scale),
            "proj_b": zeros(d),
            "ln2_g": ones(d),
            "ln2_b": zeros(d),
            "ff1": dense((d, f)),
            "ff1_b": zeros(f),
            "ff2": dense((f, d), out_scale),
            "ff2_b": zeros(d),
        }
        for _ in range(cfg.blocks)
    ]
    return {
        "embed": normal((v, d), 0.02),
        "pos": normal((t, d), 0.02),
        "blocks": blocks,
        "lnf_g": ones(d),
        "lnf_b": zeros(d),
        "head": dense((d, v)),
    }


def root_of(params: dict) -> dict:
    """The root unit's parameters: everything but the blocks."""
    return {k: params[k] for k in ROOT_KEYS}


def model_loss(cfg: Config) -> Callable:
    """Returns `loss(params, tokens)` on the whole parameter tree, for plain JAX."""
    block = make_block(cfg.heads)
    return lambda params, tokens: lm_loss(root_of(params), params["blocks"], tokens, block)


# --------------------------------------------------------------------------------------
# FSDP units: what funshard gathers and scatters for this model
# --------------------------------------------------------------------------------------


def shard_rows(x, n: int) -> int:
    """Rows of `x`'s dim 0 that each of `n` devices holds (ceil: the last is padded)."""
    return -(-x.shape[0] // n)


def unit_local_elements(params: dict, n: int) -> list[int]:
    """Elements of each FSDP unit's local shard buffer (root first, then each block)."""

    def local(tree):
        return sum(shard_rows(x, n) * math.prod(x.shape[1:]) for x in jax.tree.leaves(tree))

    return [local(root_of(params))] + [local(b) for b in params["blocks"]]


def gathered_unit_bytes(params: dict, n: int) -> list[int]:
    """Bytes of each unit's gathered (padded, full) f32 buffer: root first, then blocks."""
    return [n * e * 4 for e in unit_local_elements(params, n)]


def ideal_comm(params: dict, n: int, reshard: bool) -> float:
    """AG+RS bytes one device moves (ring) in the schedule funshard's step asks for.

    The root (fs.unshard, kept through backward) is gathered once and reduce-scattered
    once; each block 2 gathers + 1 reduce-scatter with reshard_after_forward=True, else
    1 + 1.
    """
    units = gathered_unit_bytes(params, n)
    per_block = 3 if reshard else 2
    return (n - 1) / n * (2 * units[0] + per_block * sum(units[1:]))
