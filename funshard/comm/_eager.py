"""Eager collectives, outside a step: every collective funshard runs on concrete arrays.

`unshard` outside a step and the torch frontend's hooks call these; nothing else in
the package communicates eagerly. Each runs the collectives of `_lowering` (the very
functions the training step runs per device) in a jitted `shard_map`, compiled once per
mesh and layout, on global arrays. A frontend that holds process-local buffers (a torch
rank holds its one shard) wraps them first with `global_array`, without a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from funshard import _jax_compat, errors
from funshard.comm import _lowering, _mesh
from funshard.comm._custom import AllGather

dlpack_import = _jax_compat.dlpack_import
backends_started = _jax_compat.backends_started

Blocks = Any  # a jax.Array or numpy array, or a sequence of them: one per local device


@functools.cache
def _local_devices(mesh: Mesh) -> tuple[jax.Device, ...]:
    """This process's devices of `mesh`, in the mesh's order."""
    return tuple(d for d in mesh.devices.flat if d.process_index == jax.process_index())


@functools.cache
def _sharding(mesh: Mesh, axes: tuple[str, ...], dim: int) -> NamedSharding:
    # Cached: the torch frontend wraps a block per parameter group per call, and a
    # NamedSharding costs as much to build as the wrapping itself.
    return NamedSharding(mesh, _mesh.spec(axes, dim))


def _on(block: Any, device: jax.Device) -> jax.Array:
    """`block` on `device`: as it is when already there (no copy), else copied there."""
    if isinstance(block, jax.Array) and block.sharding.device_set == {device}:
        # device_put would return an alias too, at many times the cost of this check
        # (docs/benchmarks_design.md).
        return block
    return jax.device_put(block, device)


def _per_device(blocks: Blocks, mesh: Mesh) -> list[jax.Array]:
    """`blocks` as one array per local device of `mesh`, each placed on its device.

    Raises:
      TypeError: a block is traced.
      ValueError: the number of blocks is not the number of local devices.
    """
    local = _local_devices(mesh)
    arrays = [blocks] if isinstance(blocks, (jax.Array, np.ndarray)) else list(blocks)
    if any(isinstance(a, jax.core.Tracer) for a in arrays):
        raise errors.ShardingTypeError(_traced_block())
    if len(arrays) != len(local):
        raise errors.ShardingValueError(_block_count(len(arrays), len(local)))
    return [_on(a, d) for a, d in zip(arrays, local, strict=True)]


def _traced_block() -> str:
    return (
        "funshard.comm: the eager collectives take concrete process-local buffers and run "
        "outside jax.jit and other transforms, but got a traced value. Inside a jitted "
        "step, gather with fs.unshard (or a fs.fully_shard unit) instead."
    )


def _block_count(got: int, local: int) -> str:
    return (
        f"funshard.comm: got {got} block(s) for a process that holds {local} device(s) "
        "of the mesh; pass one block per local device, in the mesh's device order."
    )


def global_array(blocks: Blocks, mesh: Mesh, axes: tuple[str, ...], dim: int = 0) -> jax.Array:
    """This process's blocks as their part of one global array split over `axes` on `dim`.

    No data moves: a block already on its device is not copied, so the result aliases
    it (the torch frontend's DLPack imports stay views of torch's memory). This is how
    process-local buffers enter `eager_all_gather` and the reduce-scatters.

    Args:
      blocks: this process's block (or one per local device of `mesh`, in its order),
        the same shape on every device.
      mesh: the mesh.
      axes: the mesh axes `dim` is split over (replicated over the others).
      dim: the split dimension.

    Returns:
      The global array, `axes`' size times a block's size on `dim`.

    Raises:
      TypeError: a block is traced (use `fs.unshard` inside a step).
      ValueError: the number of blocks is not the number of local devices.
    """
    axes = tuple(axes)
    arrays = _per_device(blocks, mesh)
    shape = list(arrays[0].shape)
    shape[dim] *= _mesh.axes_size(mesh, axes)
    return jax.make_array_from_single_device_arrays(
        tuple(shape), _sharding(mesh, axes, dim), arrays
    )


def _run(fn: Any, *args: jax.Array) -> Any:
    """`fn(*args)`; after a call that compiled, JAX's lowered modules are dropped.

    Later calls run the compiled program the jitted function keeps; the lowered module
    JAX also keeps is never read again (`_jax_compat.drop_lowered_modules`). For
    torch_frontend, which compiles one gather and one reduce-scatter per group shape,
    they held 3.9 MiB at the 10.9M benchmark model (docs/torch.md).
    """
    before = _jax_compat.compiled_count(fn)
    out = fn(*args)
    if before is not None and _jax_compat.compiled_count(fn) != before:
        _jax_compat.drop_lowered_modules()
    return out


@functools.cache
def _gather_fn(
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    rows: tuple[int, ...],
    dims: tuple[int, ...],
    in_specs: tuple[PartitionSpec, ...] | None = None,
    out_specs: tuple[PartitionSpec, ...] | None = None,
    custom: AllGather | None = None,
    unit: str = "unshard",
):
    """The compiled gather of `eager_all_gather` for one mesh and layout."""

    def body(*blocks):
        # "invarying": the result is replicated, and nothing differentiates it here.
        fulls = _lowering.all_gather_blocks(
            blocks, shard_axes, dims=dims, to="invarying", custom=custom, unit=unit
        )
        return tuple(
            jax.lax.slice_in_dim(f, 0, r, axis=d) for f, r, d in zip(fulls, rows, dims, strict=True)
        )

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs or tuple(_mesh.spec(shard_axes, d) for d in dims),
        out_specs=out_specs or (PartitionSpec(),) * len(rows),
        # A user's gather returns what `jax.lax.all_gather` types as varying; the values
        # are the same on every device, which JAX's type check cannot see.
        check_vma=custom is None,
    )
    return jax.jit(mapped)


def eager_all_gather(
    datas: Sequence[jax.Array],
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    rows: Sequence[int] | None = None,
    dims: Sequence[int] | None = None,
    specs: Sequence[tuple[PartitionSpec, PartitionSpec]] | None = None,
    custom: AllGather | None = None,
    unit: str = "unshard",
) -> list[jax.Array]:
    """All-gathers padded global arrays, each split over `shard_axes`, into replicated ones.

    One compiled program (cached per mesh and layout) and one collective for all of
    `datas`; the same `all_gather_blocks` as the training step runs inside it.

    Args:
      datas: padded global arrays (`Sharded.data`, or `global_array` of process-local
        blocks), each split over `shard_axes` on its entry of `dims`.
      mesh: their mesh.
      shard_axes: the axes they are split over.
      rows: logical size of each leaf's sharded dimension (the padding is cut off);
        defaults to the padded size.
      dims: the sharded dimension of each leaf (default: all 0).
      specs: for arrays also split over model axes, each one's `(spec of the padded
        array, spec of the result)`: the gather then runs within each model block, and
        `rows` is a model block's logical size.
      custom: a unit's own all-gather, run in place of the default.
      unit: the unit's name, for a custom all-gather's errors.

    Returns:
      Replicated arrays (split over their model axes only, with `specs`), one per leaf.
    """
    if not datas:
        return []
    dims = (0,) * len(datas) if dims is None else tuple(dims)
    if rows is None:
        rows = tuple(x.shape[d] for x, d in zip(datas, dims, strict=True))
    in_specs = out_specs = None
    if specs is not None:
        in_specs = tuple(s for s, _ in specs)
        out_specs = tuple(s for _, s in specs)
    mesh = _mesh.in_context(mesh)
    fn = _gather_fn(mesh, tuple(shard_axes), tuple(rows), dims, in_specs, out_specs, custom, unit)
    return list(_run(fn, *datas))


def _out_axes(
    shard_axes: tuple[str, ...], replicate_axes: tuple[str, ...], all_reduce: bool
) -> tuple[str, ...]:
    """The axes a reduce-scatter's result is split over."""
    # Without the all-reduce, each replica keeps its own partial sum: the result differs
    # along the replicate axes too.
    return shard_axes if all_reduce else (*replicate_axes, *shard_axes)


@functools.cache
def _reduce_scatter_fn(
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...],
    dims: tuple[int, ...],
    all_reduce: bool,
):
    """The compiled reduce-scatter of `eager_reduce_scatter` for one mesh and layout."""
    summed_over = replicate_axes if all_reduce else ()
    out_axes = _out_axes(shard_axes, replicate_axes, all_reduce)

    def body(*stacked):
        fulls = [s.reshape(s.shape[1:]) for s in stacked]
        return tuple(_lowering.reduce_scatter_blocks(fulls, shard_axes, summed_over, dims=dims))

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(_mesh.spec((*replicate_axes, *shard_axes)),) * len(dims),
        out_specs=tuple(_mesh.spec(out_axes, d) for d in dims),
    )
    return jax.jit(mapped)


def eager_reduce_scatter(
    stacked: Sequence[jax.Array],
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    dims: Sequence[int] | None = None,
    all_reduce: bool = True,
) -> list[jax.Array]:
    """Sums every device's full-size contribution to each leaf and scatters the sum.

    One compiled program (cached per mesh and layout); the same
    `reduce_scatter_blocks` as the training step's backward runs inside it.

    Args:
      stacked: for each leaf, an array of shape `(W, ...)` split over all
        data-parallel axes (`replicate_axes + shard_axes`, W devices), whose block on
        device d is that device's padded full-size contribution (a gradient computed
        by torch on that rank: `global_array` of it with a leading axis of 1), its
        scattered dimension `N * r` long.
      mesh: the mesh.
      shard_axes: axes to scatter over (N devices).
      replicate_axes: axes to all-reduce over (HSDP).
      dims: the dimension each leaf is scattered on, in the leaf's own shape
        (default: all 0).
      all_reduce: False skips the all-reduce over `replicate_axes` (FSDP2's
        `set_requires_all_reduce(False)`): each replica keeps its own partial sum.

    Returns:
      For each leaf, the summed padded array split over `shard_axes` on its dim
      (with `all_reduce=False`, over `replicate_axes + shard_axes`: one partial sum
      per replica).
    """
    if not stacked:
        return []
    dims = (0,) * len(stacked) if dims is None else tuple(dims)
    fn = _reduce_scatter_fn(
        _mesh.in_context(mesh), tuple(shard_axes), tuple(replicate_axes), dims, bool(all_reduce)
    )
    return list(_run(fn, *stacked))


@functools.cache
def _row_sum_fn(
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...],
    leaves: int,
    all_reduce: bool,
):
    """The compiled reduce-scatter of `eager_reduce_scatter_rows` for one mesh and layout."""
    summed_over = replicate_axes if all_reduce else ()
    n = _mesh.axes_size(mesh, shard_axes)

    def body(*rows):
        mine = [r.reshape(r.shape[1:]) for r in rows]
        per_leaf = [mine[leaf * n : (leaf + 1) * n] for leaf in range(leaves)]
        return tuple(_lowering.reduce_scatter_rows(per_leaf, shard_axes, summed_over))

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(_mesh.spec((*replicate_axes, *shard_axes)),) * (leaves * n),
        out_specs=(_mesh.spec(_out_axes(shard_axes, replicate_axes, all_reduce)),) * leaves,
    )
    return jax.jit(mapped)


def eager_reduce_scatter_rows(
    rows: Sequence[Sequence[jax.Array]],
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    all_reduce: bool = True,
) -> list[jax.Array]:
    """`eager_reduce_scatter` of flat leaves whose rows are given apart, by collective permutes.

    For CPU collectives over gloo (`funshard.comm.reduce_scatter_by_permutes`), where a
    reduce-scatter is N - 1 collective permutes: given as separate arrays, the rows a
    device sends are read in place, where `eager_reduce_scatter` copies each out of its
    slab first. A caller whose rows are views of one buffer (torch_frontend's flat
    gradients, their rows 64-byte aligned so that DLPack imports them without a copy)
    saves that copy.

    Args:
      rows: for each leaf, N arrays of shape `(W, cols)` split over all data-parallel
        axes (W devices). On device i, the block of `rows[leaf][k]` is its contribution
        to the result of device i + k (mod N) on the shard axes.
      mesh: the mesh.
      shard_axes: axes to scatter over (N devices).
      replicate_axes: axes to all-reduce over (HSDP).
      all_reduce: False skips the all-reduce over `replicate_axes`.

    Returns:
      For each leaf, the sums split over `shard_axes`, shape `(N * cols,)` (with
      `all_reduce=False`, over `replicate_axes + shard_axes`: one partial sum per
      replica). Device i's block adds its own row first, then those of devices i-1,
      i-2, ... (mod N).

    Raises:
      ValueError: a leaf does not have one row per device of `shard_axes`.
    """
    if not rows:
        return []
    shard_axes = tuple(shard_axes)
    n = _mesh.axes_size(mesh, shard_axes)
    for leaf, parts in enumerate(rows):
        if len(parts) != n:
            raise errors.ShardingValueError(_row_count(leaf, len(parts), shard_axes, n))
    fn = _row_sum_fn(
        _mesh.in_context(mesh), shard_axes, tuple(replicate_axes), len(rows), bool(all_reduce)
    )
    return list(_run(fn, *(r for parts in rows for r in parts)))


def _row_count(leaf: int, got: int, shard_axes: tuple[str, ...], n: int) -> str:
    return (
        f"eager_reduce_scatter_rows: leaf {leaf} has {got} rows; the shard axes "
        f"{shard_axes} have {n} devices, and each device gives one row per device (its "
        "own first)."
    )
