"""funshard as FSDP2 is used: one `fs.fully_shard` unit per block (variants 1 and 2)."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

from ..model import lm_loss, make_block, root_of
from . import AXIS, Context, Variant, register, train_step


def build_funshard(ctx: Context, reshard_after_forward: bool) -> Variant:
    """funshard on `ctx.devices`: one `fs.fully_shard` unit per block.

    The root's parameters (embeddings, final LayerNorm, head) are gathered by
    `fs.unshard`. The probes rebuild this variant on other batches and device counts.
    """
    mesh = fs.make_mesh(devices=ctx.devices)
    unit = fs.fully_shard(make_block(ctx.cfg.heads), reshard_after_forward=reshard_after_forward)

    def loss_fn(state, tokens):  # per device, on its local batch slice
        root = fs.unshard(root_of(state))
        return lm_loss(root, state["blocks"], tokens, unit)

    step = train_step(fs.value_and_grad(loss_fn), ctx.opt)
    state = fs.shard(ctx.params, mesh)
    opt_state = ctx.opt.init(state)
    tokens = jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS)))
    return Variant(
        f"funshard reshard={reshard_after_forward}", jax.jit(step), (state, opt_state),
        (tokens,), len(ctx.devices),
        "fully_shard per block; root (embed, pos, final LN, head) via fs.unshard",
    )


@register(order=10)
def variant_funshard_reshard(ctx: Context) -> Variant:
    """Variant 1 (the baseline): `reshard_after_forward=True`."""
    return build_funshard(ctx, True)


@register(order=20)
def variant_funshard_keep(ctx: Context) -> Variant:
    """Variant 2: `reshard_after_forward=False`."""
    return build_funshard(ctx, False)
