"""Eager collectives over process-local buffers: the comm layer's API for frontends.

A process holds one block per device it owns on the mesh (a torch rank: one). These
functions wrap those blocks into the global arrays JAX's collectives take, run the same
compiled `shard_map` collectives as the training step (`_lowering.eager_all_gather`,
`eager_reduce_scatter`, cached per mesh and layout), and hand back this process's part.
They never see a training step.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from funshard import _jax_compat, errors
from funshard.comm import _lowering, _mesh

dlpack_import = _jax_compat.dlpack_import
backends_started = _jax_compat.backends_started

Blocks = Any  # a jax.Array, or a sequence of them: one per local device of the mesh


def _per_device(blocks: Blocks, mesh: Mesh) -> list[jax.Array]:
    """`blocks` as one array per local device of `mesh`, each placed on its device."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    arrays = [blocks] if isinstance(blocks, (jax.Array, np.ndarray)) else list(blocks)
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        raise errors.ShardingTypeError(_traced_block())
    if len(arrays) != len(local):
        raise errors.ShardingValueError(
            f"funshard.comm: got {len(arrays)} block(s) for a process that holds "
            f"{len(local)} device(s) of the mesh; pass one block per local device, in the "
            "mesh's device order.")
    return [jax.device_put(a, d) for a, d in zip(arrays, local, strict=True)]


def _traced_block() -> str:
    return (
        "funshard.comm: the eager collectives take concrete process-local buffers and run "
        "outside jax.jit and other transforms, but got a traced value. Inside a jitted "
        "step, gather with fs.unshard (or a fs.fully_shard unit) instead."
    )


def global_array(blocks: Blocks, mesh: Mesh, axes: tuple[str, ...], dim: int = 0) -> jax.Array:
    """This process's blocks as their part of one global array split over `axes` on `dim`.

    No data moves: each block stays where it is (a block already on its device is not
    copied), so the result aliases them.

    Args:
      blocks: this process's block (or one per local device of `mesh`, in its order).
      mesh: the mesh.
      axes: the mesh axes `dim` is split over (replicated over the others).
      dim: the split dimension.

    Returns:
      The global array, of `axes`' size times the block's size on `dim`.

    Raises:
      ValueError: the number of blocks is not the number of local devices.
    """
    arrays = _per_device(blocks, mesh)
    shape = list(arrays[0].shape)
    shape[dim] *= _mesh.axes_size(mesh, tuple(axes))
    sharding = NamedSharding(mesh, _mesh.spec(tuple(axes), dim))
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


def _local(x: jax.Array) -> jax.Array:
    return x.addressable_shards[0].data


def all_gather(
    blocks: Sequence[Blocks],
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    *,
    rows: Sequence[int] | None = None,
    dims: Sequence[int] | None = None,
) -> list[jax.Array]:
    """All-gathers each leaf's process-local blocks into its full array, in one collective.

    Args:
      blocks: per leaf, this process's padded block (or one per local device).
      mesh: the mesh.
      shard_axes: the axes the leaves are split over.
      rows: each leaf's logical size on its split dimension (padding cut off);
        defaults to the padded size.
      dims: each leaf's split dimension (default: all 0).

    Returns:
      Per leaf, the full array on this process's first device of the mesh.
    """
    dims = (0,) * len(blocks) if dims is None else tuple(dims)
    datas = [global_array(b, mesh, shard_axes, d) for b, d in zip(blocks, dims, strict=True)]
    fulls = _lowering.eager_all_gather(datas, mesh, tuple(shard_axes), rows=rows, dims=dims)
    return [_local(f) for f in fulls]


def _stacked(contributions: Blocks, mesh: Mesh, axes: tuple[str, ...]) -> jax.Array:
    """Per-device contributions stacked on a new leading axis split over `axes`."""
    arrays = [a[None] for a in _per_device(contributions, mesh)]
    return global_array(arrays, mesh, axes, 0)


def reduce_scatter(
    fulls: Sequence[Blocks],
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    *,
    dims: Sequence[int] | None = None,
    all_reduce: bool = True,
) -> list[jax.Array]:
    """Sums every device's full-size contribution of each leaf and scatters the sum.

    Args:
      fulls: per leaf, this process's contribution (or one per local device), padded on
        its dimension to a multiple of the shard count.
      mesh: the mesh.
      shard_axes: the axes the sum is scattered over.
      replicate_axes: HSDP axes the scattered sums are also summed over.
      dims: each leaf's scattered dimension (default: all 0).
      all_reduce: False skips the sum over `replicate_axes` (each replica keeps its own).

    Returns:
      Per leaf, this process's block of the sum (its first device's).
    """
    dims = (0,) * len(fulls) if dims is None else tuple(dims)
    dp_axes = (*replicate_axes, *shard_axes)
    stacked = [_stacked(f, mesh, dp_axes) for f in fulls]
    sums = _lowering.eager_reduce_scatter(
        stacked, mesh, tuple(shard_axes), tuple(replicate_axes), dims, all_reduce)
    return [_local(s) for s in sums]


@functools.lru_cache(maxsize=None)
def _all_reduce_fn(mesh: Mesh, axes: tuple[str, ...], count: int):
    # Stacked over every mesh axis, so that values may differ along the axes not summed.
    every = tuple(mesh.axis_names)

    def body(*stacked):
        return tuple(jax.lax.psum(s, axes) for s in stacked)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(_mesh.spec(every),) * count,
                           out_specs=(_mesh.spec(every),) * count)
    return jax.jit(mapped)


def all_reduce(values: Sequence[Blocks], mesh: Mesh, axes: tuple[str, ...]) -> list[jax.Array]:
    """Sums each leaf's process-local values over the devices of `axes` (all-reduce).

    Args:
      values: per leaf, this process's value (or one per local device); same shape on
        every device.
      mesh: the mesh.
      axes: the axes to sum over (values may differ along the others).

    Returns:
      Per leaf, the sum, on this process's first device of the mesh.
    """
    every = tuple(mesh.axis_names)
    stacked = [_stacked(v, mesh, every) for v in values]
    sums = _all_reduce_fn(mesh, tuple(axes), len(values))(*stacked)
    return [_local(s)[0] for s in sums]
