"""Model axes per leaf: which dims tensor or expert parallelism splits, and the data axes
that are left to FSDP.

A mesh's data axes are the ones `fs.shard` is told to shard and replicate over; every
other axis (`tensor`, `expert`, ...) is a model axis. A leaf names its model axes per dim
with a `PartitionSpec` (or carries them in its `NamedSharding`); its own data axes are
the state's minus its model axes, so an expert stack split over `expert` is FSDP-sharded
over the rest while dense leaves use `expert` as a data axis (FSDP2's per-parameter mesh;
torchtitan's dense and sparse views of the same devices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from funshard import _text, comm, errors


@dataclasses.dataclass(frozen=True)
class LeafAxes:
    """The mesh axes of one leaf: model axes per dim, and its own data axes."""

    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    model_axes: tuple[tuple[str, ...], ...] = ()


def _spec_entries(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    entries = [comm.as_axes(e) if e is not None else () for e in tuple(spec)]
    return entries + [()] * (ndim - len(entries))


def _not_a_spec(path, spec) -> str:
    return (
        f"{_text.where('shard', path)}: model_spec gives {spec!r} ({type(spec).__name__}); "
        "expected a jax.sharding.PartitionSpec naming the model axes per dim (e.g. "
        "P(None, 'tensor')) or None."
    )


def _spec_too_long(path, spec, ndim: int) -> str:
    return (
        f"{_text.where('shard', path)} has {ndim} dims but its model spec {spec} names "
        f"{len(tuple(spec))}; give at most one entry per dim."
    )


def _unknown_model_axis(path, axis, mesh: Mesh) -> str:
    return (
        f"{_text.where('shard', path)}: model axis {axis!r} is not an axis of the mesh (its "
        f"axes are {tuple(mesh.axis_names)}); name one of those, or build the mesh with it "
        "(e.g. jax.make_mesh((4, 2), ('fsdp', 'tensor')))."
    )


def _axis_twice(path, spec) -> str:
    return (
        f"{_text.where('shard', path)}: its model spec {spec} names a mesh axis more than "
        "once; each model axis splits one dim."
    )


def _not_divisible(path, shape, d: int, axes, size: int) -> str:
    return (
        f"{_text.where('shard', path)} has size {shape[d]} on dim {d}, which its model axes "
        f"{axes} ({size} devices) do not divide; model axes split a dim evenly (only FSDP "
        "pads). Choose a size the model axes divide, or split another dim."
    )


def _no_data_axis(path, spec, shard_axes) -> str:
    return (
        f"{_text.where('shard', path)}: its model spec {spec} uses every shard axis "
        f"{shard_axes} as a model axis, which leaves nothing to FSDP-shard it over (an axis "
        "cannot be both a data and a model axis of one leaf). Add a data axis to the mesh "
        "(e.g. ('fsdp', 'expert')) and shard over it."
    )


def _would_drop(path, sharding, spec) -> str:
    return (
        f"{_text.where('shard', path)} is already split over mesh axes {sharding.spec} "
        f"(a NamedSharding), which fs.shard would drop: model_spec gives {spec}. Pass the "
        "spec the array carries (or None to keep it), or jax.device_put it to the spec "
        "you mean first."
    )


def _other_mesh(path, sharding, mesh: Mesh) -> str:
    return (
        f"{_text.where('shard', path)} is split over mesh axes {sharding.spec} of a mesh "
        f"with axes {dict(sharding.mesh.shape)}, which are not all axes of this mesh "
        f"({dict(mesh.shape)}); fs.shard would drop that split. Shard it on the mesh it "
        "lives on, or pass a full (unsplit) array."
    )


def replicated_model_leaf(path, axes: LeafAxes) -> str:
    """The message for a placement that replicates a leaf split over model axes."""
    return (
        f"{_text.where('shard', path)} is split over model axes {axes.model_axes} but its "
        "placement is fs.Replicate(); a model-split leaf is always FSDP-sharded. Return "
        "fs.Shard(dim) (or None) for it."
    )


def _carried_spec(path, x, mesh: Mesh, data_axes: tuple[str, ...]) -> PartitionSpec | None:
    """The model axes an array's own `NamedSharding` splits it over, if any."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return None
    named = [a for e in tuple(sharding.spec) if e is not None for a in comm.as_axes(e)]
    if not named:
        return None
    if any(a not in mesh.axis_names for a in named):
        raise errors.ShardingValueError(_other_mesh(path, sharding, mesh))
    entries = [
        tuple(a for a in comm.as_axes(e) if a not in data_axes) if e is not None else ()
        for e in tuple(sharding.spec)
    ]
    if not any(entries):
        return None  # split over data axes only: FSDP reshards it, nothing is dropped
    return PartitionSpec(*(e if e else None for e in entries))


def _spec_function(model_spec: Any, params: Any) -> Callable[[Any, Any], Any]:
    """`model_spec` (None, a function, or a pytree prefix of specs) as `(path, x) -> spec`."""
    if model_spec is None:
        return lambda path, x: None
    if callable(model_spec) and not isinstance(model_spec, PartitionSpec):
        return model_spec

    def is_spec(v) -> bool:
        return v is None or isinstance(v, PartitionSpec)

    specs, treedef = jax.tree_util.tree_flatten_with_path(model_spec, is_leaf=is_spec)
    try:
        subtrees = treedef.flatten_up_to(params)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as exc:
        raise errors.ShardingValueError(
            f"shard: model_spec does not match the structure of params ({exc}); pass a "
            "pytree prefix of params with a PartitionSpec or None per subtree, or a "
            "function (path, array) -> PartitionSpec | None."
        ) from exc
    by_path: dict[str, Any] = {}
    for (prefix, spec), subtree in zip(specs, subtrees, strict=True):
        for sub, _ in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            by_path[jax.tree_util.keystr((*prefix, *sub))] = spec
    return lambda path, x: by_path.get(jax.tree_util.keystr(tuple(path)))


def leaf_axes(
    params: Any,
    mesh: Mesh,
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...],
    model_spec: Any,
) -> Callable[[Any, Any], LeafAxes]:
    """`(path, x) -> LeafAxes` for `fs.shard`: each leaf's model axes, validated, and the
    data axes left for it."""
    spec_of = _spec_function(model_spec, params)
    data_axes = (*replicate_axes, *shard_axes)

    def axes(path, x) -> LeafAxes:
        plain = LeafAxes(shard_axes, replicate_axes)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return plain
        given = spec_of(path, x)
        if given is not None and not isinstance(given, PartitionSpec):
            raise errors.ShardingTypeError(_not_a_spec(path, given))
        carried = _carried_spec(path, x, mesh, data_axes)
        if (
            given is not None
            and carried is not None
            and _spec_entries(given, x.ndim) != _spec_entries(carried, x.ndim)
        ):
            raise errors.ShardingValueError(_would_drop(path, x.sharding, given))
        spec = given if given is not None else carried
        if spec is None or not any(_spec_entries(spec, x.ndim)):
            return plain
        return _validated(path, x, mesh, spec, shard_axes, replicate_axes)

    return axes


def _validated(path, x, mesh: Mesh, spec, shard_axes, replicate_axes) -> LeafAxes:
    if len(tuple(spec)) > x.ndim:
        raise errors.ShardingValueError(_spec_too_long(path, spec, x.ndim))
    entries = _spec_entries(spec, x.ndim)
    named = [a for axes in entries for a in axes]
    for axis in named:
        if axis not in mesh.axis_names:
            raise errors.ShardingValueError(_unknown_model_axis(path, axis, mesh))
    if len(set(named)) != len(named):
        raise errors.ShardingValueError(_axis_twice(path, spec))
    for d, axes in enumerate(entries):
        size = comm.axes_size(mesh, axes)
        if x.shape[d] % size:
            raise errors.ShardingValueError(_not_divisible(path, x.shape, d, axes, size))
    own_shard = tuple(a for a in shard_axes if a not in named)
    if not own_shard:
        raise errors.ShardingValueError(_no_data_axis(path, spec, shard_axes))
    own_replicate = tuple(a for a in replicate_axes if a not in named)
    return LeafAxes(own_shard, own_replicate, tuple(entries))
