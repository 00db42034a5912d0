"""What a Flax unit changes about its module inside a step, so that the sharded model
computes what the unsharded one computes on the whole batch.

- BatchNorm: a device sees only its slice of the batch, so statistics computed from it
  alone would differ from the unsharded model's (and each device would keep its own
  running averages). Inside a step, every BatchNorm whose `axis_name` is None (or names
  axes the step does not bind, e.g. the `pmap` axis 'batch' of Flax's examples)
  averages its batch moments over the data-parallel axes instead: SyncBatchNorm, equal
  to BatchNorm on the global batch.
- RNG keys: nothing. They stay replicated, and the root (`fs.value_and_grad`) makes
  every draw that scales with the batch (a Dropout's mask) this device's rows of the
  draw on the global batch (funshard/core/_random.py): the unsharded model's masks.
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
