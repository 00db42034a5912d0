"""funshard as FSDP2 is used: one `fs.fully_shard` unit per block (variants 1 and 2)."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

from ..model import Config, lm_loss, make_block, root_of
from . import AXIS, Context, Variant, register, train_step


def funshard_loss(cfg: Config, reshard_after_forward: bool) -> Callable:
    """The per-device loss of variants 1 and 2, a fresh function object on every call.

    One `fs.fully_shard` unit per block; the root's parameters (embeddings, final
    LayerNorm, head) are gathered by `fs.unshard`. Fresh, so that a probe jitting it
    again hits no cache keyed on the function.
    """
    unit = fs.fully_shard(make_block(cfg.heads), reshard_after_forward=reshard_after_forward)

    def loss_fn(state, tokens):  # per device, on its local batch slice
        root = fs.unshard(root_of(state))
        return lm_loss(root, state["blocks"], tokens, unit)

    return loss_fn


def build_funshard(ctx: Context, reshard_after_forward: bool) -> Variant:
    """funshard on `ctx.devices`: one `fs.fully_shard` unit per block.

    The probes rebuild this variant on other batches and device counts.
    """
    mesh = fs.make_mesh(devices=ctx.devices)
    loss_fn = funshard_loss(ctx.cfg, reshard_after_forward)
    step = train_step(fs.value_and_grad(loss_fn), ctx.opt)
    state = fs.shard(ctx.params, mesh)
    opt_state = ctx.opt.init(state)
    tokens = jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS)))
    return Variant(
        f"funshard reshard={reshard_after_forward}",
        jax.jit(step),
        (state, opt_state),
        (tokens,),
        len(ctx.devices),
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
