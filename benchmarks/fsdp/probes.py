"""Programs the run only compiles and reads, never executes.

Plain `jax.grad` of one device's batch slice on one device (its temp bytes are the
activation term of the memory target), variant 1 with twice the batch (temp-byte growth
with the batch, for comparison) and variant 1 on fewer devices (the scaling table).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .model import ideal_comm, model_loss
from .variants import Context, Variant
from .variants.funshard_units import build_funshard


def plain_grad_program(ctx: Context):
    """Plain JAX's forward+backward for ONE device's batch slice, lowered on one device.

    Parameters are arguments and gradients outputs, so its temp bytes are what XLA keeps
    besides parameters and gradients when nothing is sharded (the activation term of the
    memory target).
    """
    n = len(ctx.devices)
    device = ctx.devices[0]
    grad = jax.jit(jax.grad(model_loss(ctx.cfg)))
    params = jax.device_put(ctx.params, device)
    local = jax.device_put(ctx.tokens[: ctx.tokens.shape[0] // n], device)
    return grad.lower(params, local)


def double_batch_variant(ctx: Context) -> Variant:
    """Variant 1 with every device's batch slice doubled.

    temp(this) - temp(variant 1) is how the temp bytes grow with the batch: activations
    grow with the rows, parameter, gradient and optimizer buffers do not (but XLA's
    schedule changes too, so this is not a clean activation measure; the memory target
    uses `plain_grad_program`).
    """
    double = dataclasses.replace(ctx, tokens=np.concatenate([ctx.tokens, ctx.tokens]))
    v = build_funshard(double, True)
    v.name = "activation probe: funshard reshard=True, 2x batch"
    return v


def scaling_variants(ctx: Context, counts: list[int]) -> list[Variant]:
    """funshard (reshard_after_forward=True) on the first N devices, for each N."""
    out = []
    for n in counts:
        v = build_funshard(dataclasses.replace(ctx, devices=ctx.devices[:n]), True)
        v.name = f"scaling N={n}"
        out.append(v)
    return out


def scaling_row(ctx: Context, facts: dict) -> dict:
    """One row of the scaling table from a program's `measure.static_facts`."""
    n = facts["devices"]
    return {
        "n": n,
        "state_bytes": facts["state_bytes"],
        "ag": facts["by_kind"]["all-gather"],
        "rs": facts["by_kind"]["reduce-scatter"],
        "temp": facts["temp"],
        "ideal_comm": ideal_comm(ctx.params, n, True),
    }
