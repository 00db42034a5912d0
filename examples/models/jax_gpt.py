"""The GPT as pure JAX functions of parameter dicts: the benchmarks' JAX models.

A block's parameters are one dict (`ln1_g`, `ln1_b`, `qkv`, `qkv_b`, `proj`, `proj_b`,
`ln2_g`, `ln2_b`, `ff1`, `ff1_b`, `ff2`, `ff2_b`) and every matmul is written `x @ w`
(the orientation in which funshard keeps no derived copy of a gathered weight). The
root's (`embed`, `pos`, `lnf_g`, `lnf_b`, `head`) surround the blocks in `lm_loss`. How
the parameters are drawn stays with each benchmark (host numpy, or `jax.random` on the
device for a model too large for the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def layer_norm(x, g, b):
    """LayerNorm over the last axis, computed in f32 and cast back to `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g + b


def _einsum_attention(x, qkv_w, qkv_b, heads: int):
    """Causal attention written out: scores, mask, f32 softmax, weighted values."""
    b, t, d = x.shape
    hd = d // heads
    q, k, v = jnp.split(x @ qkv_w + qkv_b, 3, axis=-1)
    q, k, v = (a.reshape(b, t, heads, hd) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)


def _fused_attention(x, qkv_w, qkv_b, heads: int):
    """Causal attention by `jax.nn.dot_product_attention` (a fused kernel on GPUs)."""
    b, t, d = x.shape
    qkv = (x @ qkv_w + qkv_b).reshape(b, t, 3, heads, d // heads)
    o = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
    return o.reshape(b, t, d)


def make_block(heads: int, fused_attention: bool = False) -> Callable:
    """Returns `block(p, h)`: one pre-LN transformer block, every matmul as `x @ w`.

    Args:
      heads: attention heads.
      fused_attention: attend with `jax.nn.dot_product_attention` instead of the
        written-out einsum form (the same function, another program).
    """
    attention = _fused_attention if fused_attention else _einsum_attention

    def block(p, h):
        x = layer_norm(h, p["ln1_g"], p["ln1_b"])
        h = h + attention(x, p["qkv"], p["qkv_b"], heads) @ p["proj"] + p["proj_b"]
        x = layer_norm(h, p["ln2_g"], p["ln2_b"])
        return h + jax.nn.gelu(x @ p["ff1"] + p["ff1_b"]) @ p["ff2"] + p["ff2_b"]

    return block


def lm_loss(root: dict, blocks, tokens, apply_block: Callable) -> jax.Array:
    """Mean next-token cross-entropy (f32) of `tokens` (rows, seq).

    Args:
        root: the root's parameters (`embed`, `pos`, `lnf_g`, `lnf_b`, `head`).
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
