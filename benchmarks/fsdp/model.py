"""The benchmark's model: a GPT-style decoder, and the sizes of its FSDP units.

Learned token and positional embeddings, pre-LN blocks (causal multi-head attention, 4x
GELU MLP), a final LayerNorm and an untied head; the loss is the mean next-token
cross-entropy in f32. Block parameters are a Python list of per-block dicts and every
matmul is written `x @ w` (the orientation in which funshard keeps no derived copy of a
gathered weight).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

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
            "ln1_g": ones(d), "ln1_b": zeros(d),
            "qkv": dense((d, 3 * d)), "qkv_b": zeros(3 * d),
            "proj": dense((d, d), out_scale), "proj_b": zeros(d),
            "ln2_g": ones(d), "ln2_b": zeros(d),
            "ff1": dense((d, f)), "ff1_b": zeros(f),
            "ff2": dense((f, d), out_scale), "ff2_b": zeros(d),
        }
        for _ in range(cfg.blocks)
    ]
    return {
        "embed": normal((v, d), 0.02),
        "pos": normal((t, d), 0.02),
        "blocks": blocks,
        "lnf_g": ones(d), "lnf_b": zeros(d),
        "head": dense((d, v)),
    }


def layer_norm(x, g, b):
    """LayerNorm over the last axis, computed in f32 and cast back to `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g + b


def make_block(heads: int) -> Callable:
    """Returns `block(p, h)`: one pre-LN transformer block, every matmul as `x @ w`."""

    def block(p, h):
        b, t, d = h.shape
        hd = d // heads
        x = layer_norm(h, p["ln1_g"], p["ln1_b"])
        q, k, v = jnp.split(x @ p["qkv"] + p["qkv_b"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, hd) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
        h = h + o @ p["proj"] + p["proj_b"]
        x = layer_norm(h, p["ln2_g"], p["ln2_b"])
        return h + jax.nn.gelu(x @ p["ff1"] + p["ff1_b"]) @ p["ff2"] + p["ff2_b"]

    return block


def lm_loss(root: dict, blocks, tokens, apply_block: Callable) -> jax.Array:
    """Mean next-token cross-entropy (f32) of `tokens` (rows, seq).

    Args:
        root: the root unit's parameters (`ROOT_KEYS`).
        blocks: the per-block parameters, each passed to `apply_block` in turn.
        tokens: int token ids, (rows, seq).
        apply_block: `apply_block(p, h) -> h`, e.g. `make_block(heads)` or a funshard unit.

    Returns:
        The scalar loss.
    """
    t = tokens.shape[1]
    h = root["embed"][tokens] + root["pos"][None, :t]
    for p in blocks:
        h = apply_block(p, h)
    logits = layer_norm(h, root["lnf_g"], root["lnf_b"]) @ root["head"]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


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
