"""Device meshes and the data-parallel axes funshard shards and reduces over."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from funshard import errors

SHARD_AXIS = "fsdp"
REPLICATE_AXIS = "replicate"

# A child of "funshard": silent unless the application configures logging (docs/concepts.md).
logger = logging.getLogger(__name__)


def _mesh_bad_replicate(replicate, n: int) -> str:
    return (
        f"make_mesh: replicate={replicate!r} must be a positive integer dividing the "
        f"number of devices ({n}); e.g. make_mesh(replicate=2) on 8 devices gives 2 "
        "replicas of a 4-way sharded model."
    )


def make_mesh(replicate: int | None = None, *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh funshard trains on.

    Args:
      replicate: `None` for plain FSDP: a 1-D mesh with axis "fsdp" over all devices.
        An integer k builds the HSDP mesh ("replicate", "fsdp") of shape (k, n // k):
        parameters are sharded within each group of n // k devices and replicated
        across the k groups.
      devices: the devices to use, in mesh order; defaults to `jax.devices()`.

    Returns:
      A `jax.sharding.Mesh` whose axes are of type `Auto`, so that plain `jax.jit`
      code (evaluation, data loading) runs on it without explicit-sharding type errors.

    Raises:
      ValueError: `devices` is empty or lists a device twice, or `replicate` is not a
        positive divisor of the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    _check_devices(devices)
    n = len(devices)
    shape: tuple[int, ...]
    names: tuple[str, ...]
    if replicate is None:
        shape, names = (n,), (SHARD_AXIS,)
    else:
        valid = isinstance(replicate, int) and not isinstance(replicate, bool)
        if not valid or replicate < 1 or n % replicate:
            raise errors.ShardingValueError(_mesh_bad_replicate(replicate, n))
        shape, names = (replicate, n // replicate), (REPLICATE_AXIS, SHARD_AXIS)
    grid = np.asarray(devices, dtype=object).reshape(shape)
    mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", _describe_mesh(mesh))
    return mesh


def _describe_mesh(mesh: Mesh) -> str:
    platforms = sorted({d.platform for d in mesh.devices.flat})
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    kind = "HSDP" if REPLICATE_AXIS in mesh.axis_names else "FSDP"
    return (
        f"make_mesh: {kind} mesh ({axes}) over {mesh.devices.size} {'/'.join(platforms)} "
        f"devices of {len({d.process_index for d in mesh.devices.flat})} process(es)"
    )


def _mesh_no_devices() -> str:
    return (
        "make_mesh: devices is empty; pass at least one device, e.g. "
        "devices=jax.devices()[:4], or leave it out to use every device."
    )


def _mesh_repeated_devices(positions) -> str:
    listing = "; ".join(f"{d} at positions {at}" for d, at in positions.items())
    return (
        f"make_mesh: devices lists the same device more than once ({listing}); each device "
        "holds exactly one shard. Pass distinct devices, e.g. devices=jax.devices()[:n]."
    )


def _check_devices(devices: list) -> None:
    # A mesh with no device cannot hold a shard, and a repeated device would hold two
    # shards of one array: XLA rejects it only later, deep inside the first program.
    if not devices:
        raise errors.ShardingValueError(_mesh_no_devices())
    positions: dict = {}
    for i, d in enumerate(devices):
        positions.setdefault(d, []).append(i)
    repeated = {d: where for d, where in positions.items() if len(where) > 1}
    if repeated:
        raise errors.ShardingValueError(_mesh_repeated_devices(repeated))


def as_axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _not_a_mesh(fn: str, mesh) -> str:
    return (
        f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one "
        "with fs.make_mesh()."
    )


def _unknown_axis(fn: str, axis: str, mesh_axes: Sequence[str], role: str) -> str:
    return (
        f"{fn}: {role} {axis!r} is not an axis of the mesh (its axes are "
        f"{tuple(mesh_axes)}); pass one of those names, or build the mesh with "
        "fs.make_mesh()."
    )


def _axes_overlap(fn: str, shard_axes, replicate_axes) -> str:
    return (
        f"{fn}: shard_axis {shard_axes} and replicate_axis {replicate_axes} must be "
        "non-empty and disjoint; name different mesh axes, e.g. shard_axis='fsdp', "
        "replicate_axis='replicate'."
    )


def resolve_axes(
    fn: str, mesh: Mesh, shard_axis, replicate_axis
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validates and normalises the shard / replicate axis names against `mesh`.

    `replicate_axis=None` means the mesh's "replicate" axis if it has one.
    """
    if not isinstance(mesh, Mesh):
        raise errors.ShardingTypeError(_not_a_mesh(fn, mesh))
    shard_axes = as_axes(shard_axis)
    replicate_axes: tuple[str, ...]
    if replicate_axis is None:
        replicate_axes = (REPLICATE_AXIS,) if REPLICATE_AXIS in mesh.axis_names else ()
    else:
        replicate_axes = as_axes(replicate_axis)
    for role, axes in (("shard_axis", shard_axes), ("replicate_axis", replicate_axes)):
        for axis in axes:
            if axis not in mesh.axis_names:
                raise errors.ShardingValueError(_unknown_axis(fn, axis, mesh.axis_names, role))
    if not shard_axes or set(shard_axes) & set(replicate_axes):
        raise errors.ShardingValueError(_axes_overlap(fn, shard_axes, replicate_axes))
    return shard_axes, replicate_axes


def axes_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """Number of devices along `axes` of `mesh`."""
    return math.prod(mesh.shape[a] for a in axes)


def spec(axes: tuple[str, ...], dim: int = 0) -> PartitionSpec:
    """A spec that splits `dim` over `axes` (or replicates for no axes)."""
    if not axes:
        return PartitionSpec()
    return PartitionSpec(*([None] * dim), axes[0] if len(axes) == 1 else axes)


def has_explicit_axes(mesh: Mesh | AbstractMesh) -> bool:
    """Whether any axis of `mesh` is `Explicit` (`jax.make_mesh`'s default since jax 0.7).

    On such axes an array's type carries its sharding: `jax.shard_map` takes only inputs
    whose type matches its `in_specs`, and `with_sharding_constraint` may not name them.
    """
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """`x` laid out as `sharding`, as the partitioner's annotation where it is traced.

    On `Auto` axes this is `with_sharding_constraint`; on `Explicit` axes, where the layout
    is part of the type, `jax.sharding.reshard` (the same placement, typed).
    """
    if has_explicit_axes(sharding.mesh):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def place_for_map(mesh: Mesh, tree: Any, spec_of: PartitionSpec) -> Any:
    """Every array of `tree` retyped to `spec_of` on `mesh` where `mesh` has explicit axes.

    `jax.shard_map` over `Explicit` axes refuses an input whose type holds another layout
    (a plain host batch is typed replicated; a batch resharded for another axis), where on
    `Auto` axes it would move the data itself. Resharding first gives both kinds of mesh the
    same program: the step's own split of the batch. On `Auto` meshes `tree` is returned
    unchanged, so their compiled programs stay as they were.
    """
    if not has_explicit_axes(mesh):
        return tree
    sharding = NamedSharding(mesh, spec_of)
    return jax.tree.map(lambda x: jax.sharding.reshard(jnp.asarray(x), sharding), tree)


def in_context(mesh: Mesh) -> Mesh:
    """`mesh` with the axis types of the mesh set around the call, where only they differ.

    Inside `jax.sharding.auto_axes` (or `explicit_axes`) JAX sets the same mesh with other
    axis types as the context, and a `jax.shard_map` must name that one: a unit's gather
    outside a step, in an evaluation written as JAX asks on `Explicit` axes, runs there.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or tuple(context.axis_types) == tuple(mesh.axis_types):
        return mesh
    if dict(context.shape) != dict(mesh.shape):
        return mesh  # another mesh: the shard_map names it in its own error
    return Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(context.axis_types))
