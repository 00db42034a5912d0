"""The GPT in Flax nnx: `examples/train_lm.py`'s model.

Embeddings, `depth` pre-norm blocks (causal self-attention, a 4x tanh-GELU MLP), a
final LayerNorm and the head; with `scan=True` the blocks are stacked on a leading layer
axis and run by `fs.scan` once sharded (`fs.shard(..., stacked=True)`).

The blocks are written as Megatron splits them over a `tensor` mesh axis: q, k, v and
the MLP's first layer column-parallel, the two output projections row-parallel; with
`experts=E` each block's MLP is a top-2 mixture of `E` experts, which an `expert` mesh
axis splits (GShard). `model_spec` says which dims of each parameter those axes split
(`fs.shard(..., model_spec=...)`). Inside a step each device then holds its model block
(its heads, its MLP columns, its experts), and the same code runs the whole model when
the weights are whole (one device, evaluation outside the step, no model axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import funshard as fs

from . import VOCAB, ModelConfig

TENSOR = "tensor"  # the mesh axis tensor parallelism splits the blocks over
EXPERT = "expert"  # the mesh axis expert parallelism splits the experts over
TOP_K = 2  # experts per token


class Embedding(nnx.Module):
    """Token and learned position embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(VOCAB, cfg.width, rngs=rngs)
        self.positions = nnx.Embed(cfg.context, cfg.width, rngs=rngs)

    def __call__(self, tokens):
        return self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP (or `MoE`).

    Tensor-parallel as in Megatron: with the weights split as `model_spec` says, a
    device computes its heads' q, k, v and its columns of the MLP's first layer with no
    communication, and the row-parallel output projections sum their partial products
    over `tensor` (`fs.row_parallel`).
    """

    def __init__(self, cfg: ModelConfig, *, experts: int = 0, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.norm1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        # Output (width, 3): q, k and v of each column side by side, the columns grouped
        # by head, so that splitting dim 1 gives a device whole heads of all three.
        self.qkv = nnx.LinearGeneral(cfg.width, (cfg.width, 3), kernel_init=_qkv_init, rngs=rngs)
        self.proj = nnx.Linear(cfg.width, cfg.width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        if experts:
            self.moe = MoE(cfg.width, experts, rngs=rngs)
        else:
            self.up = nnx.Linear(cfg.width, 4 * cfg.width, rngs=rngs)
            self.down = nnx.Linear(4 * cfg.width, cfg.width, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = jnp.einsum("btd,dhq->bthq", self.norm1(x), self.qkv.kernel[...]) + self.qkv.bias[...]
        width = qkv.shape[2]  # d, or this device's heads' share of it under `tensor`
        heads = self.heads * width // d
        q, k, v = (qkv[..., i].reshape(b, t, heads, d // self.heads) for i in range(3))
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + _row_parallel(attended.reshape(b, t, width), self.proj)
        if hasattr(self, "moe"):
            return x + self.moe(self.norm2(x))
        up = fs.column_parallel(self.norm2(x), self.up.kernel[...], self.up.bias[...])
        return x + _row_parallel(jax.nn.gelu(up), self.down)


def _qkv_init(key, shape, dtype=jnp.float32):
    """`nnx.Linear(width, 3 * width)`'s draws, its [q | k | v] columns moved side by side
    into `(width, width, 3)`: the examples' other GPTs' model (`jax_gpt`, `torch_gpt`)
    from the same start. `shape` is the flattened kernel's, `(width, 3 * width)`."""
    width = shape[0]
    kernel = nnx.initializers.lecun_normal()(key, (width, 3 * width), dtype)
    return kernel.reshape(width, 3, width).transpose(0, 2, 1).reshape(shape)


def _row_parallel(x, linear: nnx.Linear):
    """`linear` applied to `x`; its partial products summed over `tensor` if it holds
    only this device's rows."""
    kernel, bias = linear.kernel[...], linear.bias[...]
    if kernel.shape[0] == linear.in_features:  # the whole weight
        return x @ kernel + bias
    return fs.row_parallel(x, kernel, bias, axis=TENSOR)


class MoE(nnx.Module):
    """A top-2 mixture of 4x tanh-GELU MLPs, stacked on a leading expert axis.

    No token is dropped (each expert has room for every routed token) and there is no
    auxiliary load-balancing loss: the layer computes exactly what a dense evaluation of
    the chosen experts does. With the stack split over `expert`, tokens travel to their
    experts' devices and back with one `all_to_all` each way (`fs.expert_dispatch`,
    `fs.expert_combine`).
    """

    def __init__(self, width: int, experts: int, *, rngs: nnx.Rngs):
        self.experts = experts
        self.router = nnx.Linear(width, experts, use_bias=False, rngs=rngs)
        init = jax.nn.initializers.lecun_normal(batch_axis=0)  # per expert, as nnx.Linear
        self.up = nnx.Param(init(rngs.params(), (experts, width, 4 * width)))
        self.up_bias = nnx.Param(jnp.zeros((experts, 4 * width)))
        self.down = nnx.Param(init(rngs.params(), (experts, 4 * width, width)))
        self.down_bias = nnx.Param(jnp.zeros((experts, width)))

    def __call__(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        index, weights = fs.route_top_k(tokens @ self.router.kernel[...], TOP_K)
        if self.up.shape[0] == self.experts:  # every expert here: evaluate them densely
            gates = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(index, self.experts))
            out = jnp.einsum(
                "te,etd->td",
                gates,
                self._mlp(jnp.broadcast_to(tokens, (self.experts, *tokens.shape))),
            )
        else:
            routed, mask = fs.expert_dispatch(tokens, index, self.experts, axis=EXPERT)
            out = fs.expert_combine(self._mlp(routed), mask, weights, axis=EXPERT)
        return out.reshape(x.shape)

    def _mlp(self, x):
        """Each expert's MLP on its own tokens, `(experts, tokens, width)`."""
        h = jnp.einsum("etd,edf->etf", x, self.up[...]) + self.up_bias[...][:, None]
        return (
            jnp.einsum("etf,efd->etd", jax.nn.gelu(h), self.down[...])
            + self.down_bias[...][:, None]
        )


def model_spec(mesh_axes, *, stacked: bool = False):
    """`fs.shard`'s `model_spec` for this model: the mesh axes that split each parameter.

    Column-parallel weights (q, k and v by heads; the MLP's first layer) are split over
    `tensor` on their output dim, row-parallel ones (the output projections) on their
    input dim, and the expert stacks over `expert` on their leading dim. Everything else
    (embeddings, norms, the row-parallel biases, the router, the head) has no model
    axis: it is replicated over those and FSDP-sharded over the data axes.

    Args:
      mesh_axes: the mesh's axis names; `tensor` and `expert` split only where present.
      stacked: the blocks are stacked on a leading layer axis (`scan=True`).

    Returns:
      A function `(path, parameter) -> PartitionSpec | None`.
    """
    tensor = TENSOR if TENSOR in mesh_axes else None
    expert = EXPERT if EXPERT in mesh_axes else None
    by_name = {
        ("qkv", "kernel"): (None, tensor),
        ("qkv", "bias"): (tensor,),
        ("up", "kernel"): (None, tensor),
        ("up", "bias"): (tensor,),
        ("proj", "kernel"): (tensor, None),
        ("down", "kernel"): (tensor, None),
        ("moe", "up"): (expert,),
        ("moe", "up_bias"): (expert,),
        ("moe", "down"): (expert,),
        ("moe", "down_bias"): (expert,),
    }

    def spec(path, leaf):
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        names = [n for n in names if n != "value"]  # nnx.Variable's own attribute
        entries = by_name.get(tuple(names[-2:]))
        if entries is None or not any(entries):
            return None
        return P(*((None,) if stacked else ()), *entries)

    return spec


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
    """A byte-level GPT: embeddings, `depth` blocks, head; `experts` > 0 puts a
    mixture of that many experts in place of each block's MLP."""

    def __init__(self, cfg: ModelConfig, *, scan: bool = False, experts: int = 0, rngs: nnx.Rngs):
        self.embed = Embedding(cfg, rngs=rngs)
        blocks = [Block(cfg, experts=experts, rngs=rngs) for _ in range(cfg.depth)]
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
