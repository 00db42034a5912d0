"""Replicated data parallelism: every device holds everything, gradients are averaged."""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..model import model_loss
from . import AXIS, Context, Variant, register


@register(order=50)
def variant_data_parallel(ctx: Context) -> Variant:
    """`jax.shard_map` with parameters and AdamW state replicated, gradients `pmean`."""
    mesh = jax.make_mesh(
        (len(ctx.devices),),
        (AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=ctx.devices,
    )
    loss = model_loss(ctx.cfg)
    opt = ctx.opt

    def body(params, opt_state, tokens):
        # Varying copies, so that autodiff leaves each device's gradient local (no
        # implicit psum) and the pmean below is the one all-reduce.
        local = jax.tree.map(lambda x: jax.lax.pcast(x, (AXIS,), to="varying"), params)
        value, grads = jax.value_and_grad(loss)(local, tokens)
        grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(value, AXIS)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=((P(), P()), P())
    )

    def step(train_state, tokens):
        return mapped(*train_state, tokens)

    replicated = NamedSharding(mesh, P())
    params = jax.device_put(ctx.params, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    return Variant(
        "replicated DP",
        jax.jit(step),
        (params, opt_state),
        (jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS))),),
        len(ctx.devices),
        "shard_map, params P(), grads pmean, replicated AdamW",
    )
