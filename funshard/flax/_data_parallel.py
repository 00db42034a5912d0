"""What a Flax unit changes about its module inside a step, so that the sharded model
computes what the unsharded one computes on the whole batch.

- BatchNorm: a device sees only its slice of the batch, so statistics computed from it
  alone would differ from the unsharded model's (and each device would keep its own
  running averages). Inside a step, every BatchNorm whose `axis_name` is None (or names
  axes the step does not bind, e.g. the `pmap` axis 'batch' of Flax's examples)
  averages its batch moments over the data-parallel axes instead: SyncBatchNorm, equal
  to BatchNorm on the global batch.
- RNG keys: every device holds the same replicated key, so dropout would draw the same
  mask for every device's slice. The outermost unit folds the device's index over the
  data axes into each key it reads, for that call only (the keys in the state do not
  change; counts advance as usual).
- The mesh: a mesh left set by `jax.set_mesh` that is not the state's makes the step's
  `shard_map` fail with JAX's mesh-mismatch error; it is named here instead.
"""

from __future__ import annotations

from typing import Any

import jax

from funshard import core, errors


def step_axes() -> tuple[str, ...] | None:
    """The running step's data-parallel axes, or None outside `fs.value_and_grad`."""
    ctx = core.current_step()
    return None if ctx is None else ctx.dp_axes


def is_outermost() -> bool:
    """Whether a unit called now is the outermost one of a step (no unit around it)."""
    return core.current_step() is not None and not core.in_unit()


def _bound(axis_name: Any) -> bool:
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    try:
        for name in names:
            jax.lax.axis_size(name)
    except NameError:
        return False
    return True


def names_axes_of(axis_name: Any, mesh) -> bool:
    """Whether `axis_name` (a name or a tuple of them) names axes of `mesh` only."""
    if axis_name is None:
        return False
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    return all(name in mesh.axis_names for name in names)


def batch_axis_name(axis_name: Any, dp_axes: tuple[str, ...] | None) -> Any:
    """The `axis_name` a BatchNorm computes its statistics with inside a step.

    The data axes where the module's own is None or not bound in this trace; the
    module's own otherwise (e.g. 'fsdp', or an axis of an enclosing `vmap`). Outside a
    step (`dp_axes` None) an unbound name becomes None.
    """
    if axis_name is None or not _bound(axis_name):
        return dp_axes
    return axis_name


def device_index(dp_axes: tuple[str, ...]) -> jax.Array:
    """This device's position over the data-parallel axes (0 .. world - 1)."""
    return jax.lax.axis_index(dp_axes)


def fold_in(key: jax.Array, index: jax.Array) -> jax.Array:
    """`jax.random.fold_in` of every key of a (possibly shaped) typed key array (the
    root's own fold for the step's key arguments)."""
    return core.fold_in_key(key, index)


def check_no_other_mesh(fn: str, mesh) -> None:
    """Raises if `jax.set_mesh` left a mesh set that is not `mesh`.

    Raises:
      errors.ShardingValueError: (a ValueError) naming both meshes.
    """
    context = jax.sharding.get_abstract_mesh()
    if context.empty or context == mesh.abstract_mesh:
        return
    raise errors.ShardingValueError(_other_mesh_set(fn, context, mesh))


def _other_mesh_set(fn: str, context, mesh) -> str:
    return (
        f"{fn}: a mesh is set with jax.set_mesh ({_mesh_text(context)}) that is not the "
        f"mesh of the sharded state ({_mesh_text(mesh)}), so JAX would refuse the step's "
        "shard_map with a mesh-mismatch error. funshard places every array itself: remove "
        "the jax.set_mesh call (Flax's tutorials set one for automatic sharding), or set "
        "this mesh instead (`with jax.set_mesh(mesh): ...`)."
    )


def _mesh_text(mesh) -> str:
    axes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"axes {axes}" if axes else "no axes"
