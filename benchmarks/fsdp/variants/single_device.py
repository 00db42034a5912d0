"""One device, the whole batch: plain `jax.jit`, no sharding at all."""

from __future__ import annotations

import jax

from ..model import model_loss
from . import Context, Variant, register, train_step


@register(order=60)
def variant_single(ctx: Context) -> Variant:
    """The whole step on `ctx.devices[0]`."""
    device = ctx.devices[0]
    step = train_step(jax.value_and_grad(model_loss(ctx.cfg)), ctx.opt)
    params = jax.device_put(ctx.params, device)
    opt_state = jax.device_put(ctx.opt.init(params), device)
    return Variant(
        "single device",
        jax.jit(step),
        (params, opt_state),
        (jax.device_put(ctx.tokens, device),),
        1,
        "plain jit on devices[0], whole batch",
    )
