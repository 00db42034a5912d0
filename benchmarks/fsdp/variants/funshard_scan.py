"""funshard with the blocks stacked on a layer axis and run by `fs.scan`."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

from ..model import lm_loss, make_block, root_of
from . import AXIS, Context, Variant, register, train_step


@register(order=30)
def variant_funshard_scan(ctx: Context) -> Variant:
    """`fs.scan` over the stacked blocks (prefetching each layer's gather inside the
    loop); the root as in variant 1."""
    mesh = fs.make_mesh(devices=ctx.devices)
    block = make_block(ctx.cfg.heads)

    def loss_fn(state, tokens):  # per device, on its local batch slice
        root = fs.unshard(state["root"])
        return lm_loss(root, [state["blocks"]], tokens, lambda stack, h: fs.scan(block, stack, h))

    step = train_step(fs.value_and_grad(loss_fn), ctx.opt)
    blocks = ctx.params["blocks"]
    stacked = {k: np.stack([b[k] for b in blocks]) for k in blocks[0]}
    state = {
        "root": fs.shard(root_of(ctx.params), mesh),
        "blocks": fs.shard(stacked, mesh, stacked=True),
    }
    opt_state = ctx.opt.init(state)
    tokens = jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS)))
    return Variant(
        "funshard fs.scan",
        jax.jit(step),
        (state, opt_state),
        (tokens,),
        len(ctx.devices),
        "blocks stacked, fs.scan (reshard_after_forward=True, prefetch in the loop); root "
        "via fs.unshard",
    )
