"""The training root: `value_and_grad` / `grad` over a sharded state and a global batch."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jax.tree_util import tree_flatten_with_path, tree_unflatten

from funshard import _context, _errors, _mesh
from funshard._shard import common_mesh, sharded_leaves
from funshard._sharded import Sharded, is_array


def _dp_axes(paths, items) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(replicate axes, shard axes) shared by every `Sharded` leaf of the state."""
    axes = None
    for path, x in zip(paths, items):
        if not isinstance(x, Sharded):
            continue
        these = (x.replicate_axis, x.shard_axis)
        if axes is None:
            axes = these
        elif these != axes:
            raise ValueError(
                f"{_errors.where('value_and_grad', path)} is sharded over {these[1]} "
                f"(replicated over {these[0]}) but other leaves over {axes[1]} (replicated "
                f"over {axes[0]}); shard the whole state with one shard_axis/replicate_axis."
            )
    return axes  # type: ignore[return-value]


def _check_batch(batch: Any, world: int, dp_axes) -> None:
    for path, leaf in tree_flatten_with_path(batch)[0]:
        if not is_array(leaf):
            if not isinstance(leaf, (int, float, complex, bool)):
                raise TypeError(_errors.batch_not_array(path, leaf))
            leaf = np.asarray(leaf)
        if leaf.ndim == 0:
            raise ValueError(_errors.batch_scalar(path))
        if leaf.shape[0] == 0:
            raise ValueError(_errors.batch_empty(path))
        if leaf.shape[0] % world:
            raise ValueError(_errors.batch_not_divisible(path, leaf.shape[0], world, dp_axes))


def _is_differentiable(x) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _split_static(tree: Any):
    """Array leaves (traced through the step) and a function rebuilding the tree."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    dynamic = [i for i, x in enumerate(leaves) if is_array(x)]

    def rebuild(values):
        out = list(leaves)
        for i, v in zip(dynamic, values):
            out[i] = v
        return tree_unflatten(treedef, out)

    return [leaves[i] for i in dynamic], rebuild


def _reduce_aux(aux: Any, dp_axes) -> Any:
    def reduce(x):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, dp_axes)
        return jax.lax.psum(x, dp_axes)

    return jax.tree.map(reduce, aux)


@dataclasses.dataclass(frozen=True)
class _StatePlan:
    """How the state's leaves enter the per-device program."""

    items: list
    treedef: Any
    dynamic: list[int]  # indices of items that are traced (Sharded or array)
    specs: list[PartitionSpec]

    def dynamic_values(self) -> list:
        return [
            self.items[i].data if isinstance(self.items[i], Sharded) else self.items[i]
            for i in self.dynamic
        ]

    def rebuild(self, values) -> Any:
        out = list(self.items)
        for i, v in zip(self.dynamic, values):
            item = self.items[i]
            out[i] = dataclasses.replace(item, data=v) if isinstance(item, Sharded) else v
        return tree_unflatten(self.treedef, out)


def _plan(items, treedef) -> _StatePlan:
    dynamic, specs = [], []
    for i, x in enumerate(items):
        if isinstance(x, Sharded):
            dynamic.append(i)
            specs.append(_mesh.spec(x.shard_axis))
        elif is_array(x):
            dynamic.append(i)
            specs.append(PartitionSpec())
    return _StatePlan(items, treedef, dynamic, specs)


def _local_value_and_grad(loss_fn, has_aux, plan: _StatePlan, values, batch, args):
    diff = [i for i, v in enumerate(values) if _is_differentiable(v)]

    def local_loss(diff_values):
        merged = list(values)
        for i, v in zip(diff, diff_values):
            merged[i] = v
        out = loss_fn(plan.rebuild(merged), batch, *args)
        return out if has_aux else (out, None)

    (loss, aux), diff_grads = jax.value_and_grad(local_loss, has_aux=True)(
        [values[i] for i in diff]
    )
    grads = [jnp.zeros_like(v) for v in values]
    for i, g in zip(diff, diff_grads):
        grads[i] = g
    return loss, aux, grads


def value_and_grad(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
    """Turns a per-device loss into the FSDP training root.

    `loss_fn(state, batch, *args)` runs on every device under `jax.shard_map`: `state`
    holds this device's shards (call `funshard.unshard` or a `funshard.fully_shard` unit
    on it), `batch` is this device's slice of the global batch (leading dimension split
    over every data-parallel axis), `args` are replicated. It returns the mean loss over
    its local slice (and, with `has_aux`, an auxiliary pytree).

    Args:
      loss_fn: the per-device loss function.
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Returns:
      A function `(state, batch, *args) -> (loss, grads)` (or `((loss, aux), grads)`)
      where `loss` is the mean over the global batch, `aux` floating leaves are averaged
      and other leaves summed over the data-parallel world, and `grads` has the
      structure and sharding of `state` (dtype of the sharded parameters), equal to the
      gradient of the global mean loss: reduce-scattered over the shard axis,
      all-reduced over the replicate axis (HSDP) and divided by the data-parallel world
      size (FSDP2's default). Non-floating leaves get zero gradients, non-array leaves
      are carried over unchanged.

    Raises:
      ValueError: the state has no `Sharded` leaves or mixes meshes or axes, or the
        global batch size is not a multiple of the data-parallel world size.
    """

    @functools.wraps(loss_fn)
    def step(state, batch, *args):
        paths, items, treedef = sharded_leaves("value_and_grad", state)
        mesh = common_mesh("value_and_grad", paths, items)
        if mesh is None:
            raise ValueError(_errors.no_sharded("value_and_grad"))
        replicate_axes, shard_axes = _dp_axes(paths, items)
        dp_axes = (*replicate_axes, *shard_axes)
        world = _mesh.axes_size(mesh, dp_axes)
        _check_batch(batch, world, dp_axes)
        plan = _plan(items, treedef)
        arg_values, rebuild_args = _split_static(args)
        ctx = _context.StepContext(mesh, dp_axes)

        def body(values, local_batch, arg_values):
            with _context.inside(ctx):
                loss, aux, grads = _local_value_and_grad(
                    loss_fn, has_aux, plan, values, local_batch, rebuild_args(arg_values)
                )
            grads = [g / world if _is_differentiable(g) else g for g in grads]
            return jax.lax.pmean(loss, dp_axes), _reduce_aux(aux, dp_axes), grads

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(plan.specs, _mesh.spec(dp_axes), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), plan.specs),
        )
        loss, aux, grads = mapped(plan.dynamic_values(), batch, arg_values)
        grads = plan.rebuild(grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return step


def grad(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
    """Like `value_and_grad`, returning only the gradients (and aux with `has_aux`).

    Args:
      loss_fn: the per-device loss function (see `value_and_grad`).
      has_aux: whether `loss_fn` returns `(loss, aux)`.

    Returns:
      A function `(state, batch, *args) -> grads` (or `(grads, aux)`).
    """
    vg = value_and_grad(loss_fn, has_aux=has_aux)

    @functools.wraps(loss_fn)
    def step(state, batch, *args):
        out, grads = vg(state, batch, *args)
        return (grads, out[1]) if has_aux else grads

    return step
