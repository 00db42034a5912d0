"""Collectives only: variant 1's all-gathers and reduce-scatters and nothing else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

from ..model import unit_local_elements
from . import AXIS, Context, Variant, register


@register(order=80)
def variant_collectives_only(ctx: Context) -> Variant:
    """Only the communication of variant 1.

    For each unit, its f32 shard buffer of the same size funshard gathers is
    all-gathered (twice for each block: forward and the backward re-gather; once for the
    root), then a same-size full buffer is reduce-scattered; plus the scalar all-reduce
    of the loss. Each second gather is tied to the first one's result so XLA cannot
    merge them (as funshard does).
    """
    n = len(ctx.devices)
    mesh = fs.make_mesh(devices=ctx.devices)
    sizes = unit_local_elements(ctx.params, n)

    def body(buffers):
        out = []
        for u, buf in enumerate(buffers):
            full = jax.lax.all_gather(buf, AXIS, axis=0, tiled=True)
            if u > 0:  # blocks: reshard_after_forward=True gathers again for backward
                again = jnp.where(full[0] == full[0], buf, jnp.zeros_like(buf))
                full = jax.lax.all_gather(again, AXIS, axis=0, tiled=True)
            out.append(jax.lax.psum_scatter(full, AXIS, scatter_dimension=0, tiled=True) / n)
        return out, jax.lax.psum(buffers[0][0], AXIS)

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([P(AXIS)] * len(sizes),),
        out_specs=([P(AXIS)] * len(sizes), P()),
    )
    sharding = NamedSharding(mesh, P(AXIS))
    buffers = [jax.device_put(np.full((n * s,), 0.5, np.float32), sharding) for s in sizes]
    return Variant(
        "collectives only",
        jax.jit(mapped),
        buffers,
        (),
        n,
        "variant 1's AG/RS byte counts (f32), no compute",
        has_loss=False,
    )
