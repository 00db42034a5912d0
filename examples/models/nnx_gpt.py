"""The GPT in Flax nnx: `examples/train_lm.py`'s model.

Embeddings, `depth` pre-norm blocks (causal self-attention, a 4x tanh-GELU MLP), a
final LayerNorm and the head; with `scan=True` the blocks are stacked on a leading layer
axis and run by `fs.scan` once sharded (`fs.shard(..., stacked=True)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import funshard as fs

from . import VOCAB, ModelConfig


class Embedding(nnx.Module):
    """Token and learned position embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(VOCAB, cfg.width, rngs=rngs)
        self.positions = nnx.Embed(cfg.context, cfg.width, rngs=rngs)

    def __call__(self, tokens):
        return self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.norm1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, rngs=rngs)
        self.proj = nnx.Linear(cfg.width, cfg.width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.up = nnx.Linear(cfg.width, 4 * cfg.width, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.width, cfg.width, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Head(nnx.Module):
    """Final LayerNorm and the projection to next-byte logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.out = nnx.Linear(cfg.width, VOCAB, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h))


class ScannedBlocks(nnx.Module):
    """The blocks stacked on a leading layer axis, run by `fs.scan` (one program for any depth).

    Built from the same per-block initialisation as `GPT`'s list of blocks, so `--scan`
    trains the same model from the same start.
    """

    def __init__(self, blocks: list[Block]):
        graphdef = nnx.graphdef(blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
        self.layers = nnx.merge(graphdef, stacked)

    def __call__(self, h):
        graphdef, stacked = nnx.split(self.layers)

        def layer(params, h):
            return nnx.merge(graphdef, params)(h)

        if any(isinstance(x, fs.Sharded) for x in jax.tree.leaves(stacked, is_leaf=_is_sharded)):
            return fs.scan(layer, stacked, h)
        # Unsharded weights (sampling on one device): a plain scan over the layers.
        return jax.lax.scan(lambda h, p: (layer(p, h), None), h, stacked)[0]


class GPT(nnx.Module):
    """A byte-level GPT: embeddings, `depth` blocks, head."""

    def __init__(self, cfg: ModelConfig, *, scan: bool = False, rngs: nnx.Rngs):
        self.embed = Embedding(cfg, rngs=rngs)
        blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.depth)]
        self.blocks = ScannedBlocks(blocks) if scan else nnx.List(blocks)
        self.head = Head(cfg, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        if isinstance(self.blocks, ScannedBlocks):
            h = self.blocks(h)
        else:
            for block in self.blocks:
                h = block(h)
        return self.head(h)


def _is_sharded(x) -> bool:
    """Keeps `fs.Sharded` whole when flattening a tree (its logical shape is metadata)."""
    return isinstance(x, fs.Sharded)
