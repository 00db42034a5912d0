"""JAX automatic sharding, "FSDP by annotation": plain `jax.jit` with sharded inputs."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..model import model_loss
from . import AXIS, Context, Variant, register, train_step


@register(order=40)
def variant_auto(ctx: Context) -> Variant:
    """Parameters and Adam state `P('fsdp')` on dim 0 where the device count divides it
    (else replicated), the batch `P('fsdp')`; XLA chooses the collectives."""
    n = len(ctx.devices)
    mesh = jax.make_mesh(
        (n,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=ctx.devices
    )

    def sharding(x):
        split = getattr(x, "ndim", 0) >= 1 and x.shape[0] % n == 0
        return NamedSharding(mesh, P(AXIS) if split else P())

    params = jax.device_put(ctx.params, jax.tree.map(sharding, ctx.params))
    opt_state = ctx.opt.init(params)
    opt_state = jax.device_put(opt_state, jax.tree.map(sharding, opt_state))
    state_sh = jax.tree.map(sharding, (params, opt_state))
    batch_sh = NamedSharding(mesh, P(AXIS))
    step = train_step(jax.value_and_grad(model_loss(ctx.cfg)), ctx.opt)
    jitted = jax.jit(
        step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, NamedSharding(mesh, P()))
    )
    return Variant(
        "jax auto-sharding",
        jitted,
        (params, opt_state),
        (jax.device_put(ctx.tokens, batch_sh),),
        n,
        "plain jit; params/Adam P('fsdp') on dim 0 where divisible, else replicated",
    )
