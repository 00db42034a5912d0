"""The communication-free floor: one FSDP device's work, alone, without collectives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ..model import model_loss, shard_rows
from . import Context, Variant, register


@register(order=70)
def variant_floor(ctx: Context) -> Variant:
    """What ONE FSDP device computes, on one device, with every collective removed.

    Forward + backward on the local batch slice (global batch / N rows) with the full,
    unsharded parameters as inputs (the gathers' results, for free). Each full-size
    gradient is then reduced to its 1/N shard locally: zero-padded to N * ceil(dim0/N)
    rows and summed over its N row chunks, the arithmetic a reduce-scatter does, without
    communication (a bare slice would let XLA skip part of the gradient computation).
    AdamW then updates 1/N of the parameters (the first ceil(dim0/N) rows of each leaf)
    and its state. The full parameters are constant inputs; only the shards train.
    """
    n = len(ctx.devices)
    device = ctx.devices[0]
    loss = model_loss(ctx.cfg)
    opt = ctx.opt

    def scatter_locally(g):
        rows = shard_rows(g, n)
        g = jnp.pad(g, [(0, n * rows - g.shape[0])] + [(0, 0)] * (g.ndim - 1))
        return g.reshape(n, rows, *g.shape[1:]).sum(0) / n

    def step(train_state, full, tokens):
        shards, opt_state = train_state
        value, grads = jax.value_and_grad(loss)(full, tokens)
        grads = jax.tree.map(scatter_locally, grads)
        updates, opt_state = opt.update(grads, opt_state, shards)
        return (optax.apply_updates(shards, updates), opt_state), value

    full = jax.device_put(ctx.params, device)
    shards = jax.device_put(jax.tree.map(lambda x: x[: shard_rows(x, n)], ctx.params), device)
    opt_state = jax.device_put(opt.init(shards), device)
    local = ctx.tokens[: ctx.tokens.shape[0] // n]
    return Variant(
        "comm-free floor (1 device)",
        jax.jit(step),
        (shards, opt_state),
        (full, jax.device_put(local, device)),
        1,
        f"one device's work: batch/{n} rows, full params, grads summed over row chunks, "
        f"AdamW on 1/{n}",
    )
