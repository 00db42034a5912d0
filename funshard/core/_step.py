"""The training root: `value_and_grad` / `grad` over a sharded state and a global batch."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jax.tree_util import tree_flatten_with_path

from funshard.core import _callbacks, _context, _tree
from funshard import _errors, _jax_compat
from funshard import comm
from funshard.core import _in_step
from funshard.core._tree import common_mesh, is_inexact_array, sharded_leaves, split_arrays
from funshard.core._sharded import Sharded, is_array, is_sharded


def _dp_axes(paths, items) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(replicate axes, shard axes) shared by every `Sharded` leaf of the state."""
    axes = None
    for path, x in zip(paths, items, strict=True):
        if not isinstance(x, Sharded):
            continue
        these = (x.replicate_axis, x.shard_axis)
        if axes is None:
            axes = these
        elif these != axes:
            raise ValueError(_errors.mixed_axes(path, these, axes))
    return axes  # type: ignore[return-value]


def _check_batch(batch: Any, world: int, dp_axes, microbatches: int = 1) -> None:
    rows, not_arrays, scalars = [], [], []
    for path, leaf in tree_flatten_with_path(batch)[0]:
        if not is_array(leaf):
            if not isinstance(leaf, (int, float, complex, bool)):
                not_arrays.append(_errors.batch_not_array(path, leaf))
                continue
            leaf = np.asarray(leaf)
        if leaf.ndim == 0:
            scalars.append(_errors.batch_scalar(path))
        else:
            rows.append((path, leaf.shape[0]))
    # Every bad leaf at once, as jax.shard_map reports its specs.
    if not_arrays:
        raise TypeError(_errors.joined(not_arrays + scalars))
    if scalars:
        raise ValueError(_errors.joined(scalars))
    if len({r for _, r in rows}) > 1:
        raise ValueError(_errors.batch_ragged(rows))
    for path, size in rows[:1]:
        if size == 0:
            raise ValueError(_errors.batch_empty(path))
        if size % world:
            raise ValueError(_errors.batch_not_divisible(path, size, world, dp_axes))
        if size % (world * microbatches):
            raise ValueError(_errors.batch_not_microbatchable(path, size, world, microbatches))


def _is_differentiable(x) -> bool:
    return is_inexact_array(x)


def varying_axes(x, dp_axes) -> tuple[str, ...]:
    """The data-parallel axes `x` still varies over (its shard_map type)."""
    varying = _jax_compat.varying_axes(x)
    return tuple(a for a in dp_axes if a in varying)


def _reduce_aux(aux: Any, dp_axes) -> Any:
    """Combines per-device aux values into one value for the whole step.

    Scalars that still vary over the devices are averaged (floating) or summed (other
    dtypes); arrays are per-example values, gathered along dim 0 in global batch order.
    Values the loss function already reduced (invariant over the data axes) are kept.
    """

    def reduce(x):
        axes = varying_axes(x, dp_axes)
        if not axes:
            return x
        if x.ndim == 0:
            if is_inexact_array(x):
                return jax.lax.pmean(x, axes)
            return jax.lax.psum(x, axes)
        x = comm.vary(x, dp_axes)
        return jax.lax.all_gather(x, dp_axes, axis=0, tiled=True, to="invarying")

    return jax.tree.map(reduce, aux)


@dataclasses.dataclass(frozen=True)
class _StatePlan:
    """How the state's leaves enter the per-device program: the traced ones (`Sharded`
    leaves and arrays) selected, with the shard_map spec of each."""

    parts: _tree.Partition
    specs: list[PartitionSpec]

    @property
    def items(self) -> tuple:
        return self.parts.items

    @property
    def dynamic(self) -> tuple[int, ...]:
        return self.parts.positions

    def dynamic_values(self) -> list:
        return [x.data if isinstance(x, Sharded) else x for x in self.parts.selected]

    def rebuild(self, values, step_meta: dict | None = None) -> Any:
        """The tree with `values` in its dynamic positions.

        With `step_meta` (position -> the `StepLeaf` fields) the `Sharded` leaves
        become the running step's `StepLeaf`s.
        """
        new = [
            _leaf_with(item, v, None if step_meta is None else step_meta.get(pos))
            for pos, (item, v) in enumerate(zip(self.parts.selected, values, strict=True))
        ]
        return self.parts.combine(new)


def _leaf_with(item, value, step_fields: dict | None):
    """`item` holding `value`: a plain value, a `Sharded` leaf, or the step's `StepLeaf`."""
    if not isinstance(item, Sharded):
        return value
    if step_fields is None:
        return dataclasses.replace(item, data=value)
    fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(Sharded)}
    return _context.StepLeaf(**{**fields, "data": value}, **step_fields)


def _plan(items, treedef) -> _StatePlan:
    parts = _tree.Partition(
        tuple(items), treedef,
        tuple(i for i, x in enumerate(items) if isinstance(x, Sharded) or is_array(x)),
    )
    specs = [
        comm.spec(x.shard_axis, x.dim) if isinstance(x, Sharded) else PartitionSpec()
        for x in parts.selected
    ]
    return _StatePlan(parts, specs)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The root's static choices (see `value_and_grad`)."""

    has_aux: bool
    divide_factor: float | None
    microbatches: int
    sync_every_microbatch: bool
    all_reduce_every_microbatch: bool


def _trainable_flags(trainable: Any, state: Any) -> list[bool]:
    if trainable is None:
        return [True] * len(jax.tree.leaves(state, is_leaf=is_sharded))
    try:
        expanded = jax.tree.map(
            lambda flag, sub: jax.tree.map(lambda _: bool(flag), sub, is_leaf=is_sharded),
            trainable,
            state,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as exc:
        raise ValueError(_errors.trainable_mismatch(exc)) from exc
    return jax.tree.leaves(expanded, is_leaf=is_sharded)


def _accumulator(item: Sharded, dp_axes):
    dtype = _in_step.layout_of([item]).leaves[0].reduce_dtype
    return comm.vary(jnp.zeros(item.shape, dtype), dp_axes)


def _split_output(out, has_aux: bool):
    """(loss, aux) from what the loss function returned, or a clear error."""
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(_errors.aux_expected(out))
        loss, aux = out
    else:
        if isinstance(out, (tuple, list)):
            raise TypeError(_errors.aux_unexpected(len(out)))
        loss, aux = out, None
    if not (hasattr(loss, "dtype") and jnp.ndim(loss) == 0
            and jnp.issubdtype(loss.dtype, jnp.floating)):
        raise TypeError(_errors.loss_not_scalar(loss))
    sharded_aux = [p for p, x in tree_flatten_with_path(aux, is_leaf=is_sharded)[0]
                   if isinstance(x, Sharded)]
    if sharded_aux:
        raise TypeError(_errors.sharded_aux(sharded_aux))
    return loss, aux


@dataclasses.dataclass(frozen=True)
class _Routes:
    """Where each traced state value's gradient goes in one step (by position)."""

    sharded: list[bool]
    wanted: list[bool]  # floating and trainable
    deferred: list[int]  # gradient to a full-size accumulator, reduced after the loop
    diff: list[int]  # gradient by autodiff (through the unit's reduce-scatter)


def _routes(plan, values, trainable, opts: _Options) -> _Routes:
    sharded = [isinstance(plan.items[i], Sharded) for i in plan.dynamic]
    wanted = [_is_differentiable(v) and t for v, t in zip(values, trainable, strict=True)]
    defer = not opts.sync_every_microbatch
    deferred = [i for i, w in enumerate(wanted) if w and sharded[i] and defer]
    diff = [i for i, w in enumerate(wanted) if w and i not in deferred]
    return _Routes(sharded, wanted, deferred, diff)


def _local_value_and_grad(loss_fn, opts: _Options, plan, ctx, values, batch, args, routes):
    """One microbatch on this device: (loss, aux, grads by position, deferred sums)."""
    sharded, wanted, deferred, diff = routes.sharded, routes.wanted, routes.deferred, routes.diff

    def local_loss(diff_values, accumulators):
        merged = list(values)
        for i, v in zip(diff, diff_values, strict=True):
            merged[i] = v
        accumulator_of = dict(zip(deferred, accumulators, strict=True))
        step_meta = {
            i: dict(frozen=not wanted[i], accumulator=accumulator_of.get(i),
                    skip_replicate_reduce=ctx.skip_replicate_reduce)
            for i, s in enumerate(sharded) if s
        }
        with _context.inside(ctx):
            out = loss_fn(plan.rebuild(merged, step_meta), batch, *args)
        return _split_output(out, opts.has_aux)

    accumulators = [_accumulator(plan.items[plan.dynamic[i]], ctx.dp_axes) for i in deferred]
    (loss, aux), (diff_grads, deferred_grads) = jax.value_and_grad(
        local_loss, argnums=(0, 1), has_aux=True
    )([values[i] for i in diff], accumulators)
    grads = dict(zip(diff, diff_grads, strict=True))
    return loss, aux, grads, dict(zip(deferred, deferred_grads, strict=True))


def _zero_sums(plan, values, routes: _Routes, dp_axes) -> tuple[dict, dict]:
    """Zero gradients and deferred sums, typed (varying axes) as autodiff returns them.

    A cotangent has its primal's type: a state value's gradient varies where the value
    does, a deferred sum where its accumulator does.
    """
    grads = {
        i: comm.vary(jnp.zeros_like(values[i]), varying_axes(values[i], dp_axes))
        for i in routes.diff
    }
    sums = {i: _accumulator(plan.items[plan.dynamic[i]], dp_axes) for i in routes.deferred}
    return grads, sums


def _over_microbatches(one, local_batch, k: int, zeros: tuple[dict, dict]):
    """(losses, auxes, grads, sums) of `one(microbatch)` summed over `k` microbatches.

    A `lax.scan` over the microbatches: the program (and its compile time) stays the
    size of one microbatch's step whatever `k`, with the same collectives per
    microbatch inside the loop. Losses and aux values come back stacked on a leading
    microbatch axis.
    """
    split = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), local_batch)

    def body(carry, microbatch):
        grads, sums = carry
        loss, aux, g, s = one(microbatch)
        return (_add(grads, g), _add(sums, s)), (loss, aux)

    (grads, sums), (losses, auxes) = jax.lax.scan(body, zeros, split)
    return losses, auxes, grads, sums


def _add(total: dict, new: dict) -> dict:
    out = dict(total)
    for i, g in new.items():
        out[i] = out[i] + g if i in out else g
    return out


def _combine_microbatches(stacked: Any) -> Any:
    """Per-microbatch aux values (stacked on axis 0) as one: scalars averaged (floating)
    or summed, arrays (per-example values) concatenated in batch order."""
    def combine(x):
        if x.ndim > 1:
            return x.reshape(-1, *x.shape[2:])
        return x.mean(0) if is_inexact_array(x) else x.sum(0)

    return jax.tree.map(combine, stacked)


def _reduce_deferred(plan, sums: dict, ctx) -> dict:
    """Reduce-scatters the accumulated unreduced gradients: one collective per dtype."""
    if not sums:
        return {}
    order = sorted(sums)
    items = [plan.items[plan.dynamic[i]] for i in order]
    layout = _in_step.layout_of(items, ctx.skip_replicate_reduce, name="root")
    reduced = comm.reduce_values([sums[i] for i in order], layout)
    return dict(zip(order, reduced, strict=True))


def _grad_scale(opts: _Options, world: int, loss_world: int) -> float:
    """What the summed per-device gradients are multiplied by.

    A loss that still varies over `loss_world` devices is a per-device mean: their sum
    over devices divided by `loss_world` is the gradient of the global mean. A loss the
    user already reduced (psum / pmean: invariant, loss_world = 1) needs no division.
    `gradient_divide_factor` f means "sum of per-device-mean gradients / f" in both
    cases, hence the `world / loss_world` correction.
    """
    if opts.divide_factor is None:
        scale = 1.0 / loss_world
    else:
        scale = (world / loss_world) / opts.divide_factor
    return scale / opts.microbatches


def _finish_grads(plan, values, grads: dict, opts: _Options, scale: float, replicate_axes):
    """Every position's gradient: scaled, HSDP-reduced if postponed, zeros elsewhere."""
    out = []
    for i, v in enumerate(values):
        if i not in grads:
            out.append(jnp.zeros(v.shape, v.dtype))
            continue
        g = grads[i]
        postponed = not opts.all_reduce_every_microbatch and replicate_axes
        if postponed and isinstance(plan.items[plan.dynamic[i]], Sharded):
            g = jax.lax.psum(g, replicate_axes)
        out.append((g * scale).astype(v.dtype))
    return out


def _as_arrays(items: list) -> list:
    """Python numbers in the state as arrays, exactly as `jax.jit` would trace them.

    Under jit a Python float leaf is a traced float32 (differentiable) and an int a
    traced int32; converting them here makes an un-jitted step behave the same.
    """
    return [
        jnp.asarray(x) if isinstance(x, (bool, int, float, complex)) else x for x in items
    ]


def _check_state_leaves(paths, items, flags) -> None:
    """Non-floating leaves have no gradient, but an optimizer would still change them."""
    bad = [
        (path, str(x.dtype))
        for path, x, trainable in zip(paths, items, flags, strict=True)
        if trainable and (isinstance(x, Sharded) or is_array(x))
        and not is_inexact_array(x)
    ]
    if bad:
        raise TypeError(_errors.non_float_leaves("value_and_grad", bad))


def _check_context_mesh(mesh) -> None:
    # A mesh left set by `jax.set_mesh` (Flax's tutorials set one) makes JAX refuse the
    # root's shard_map with a message that names neither; name both here.
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != mesh.abstract_mesh:
        raise ValueError(_errors.other_mesh_set("value_and_grad", context, mesh))


def value_and_grad(
    loss_fn: Callable,
    *,
    has_aux: bool = False,
    trainable: Any = None,
    microbatches: int = 1,
    sync_every_microbatch: bool = True,
    all_reduce_every_microbatch: bool = True,
    gradient_divide_factor: float | None = None,
) -> Callable:
    """Turns a per-device loss into the FSDP training root.

    `loss_fn(state, batch, *args)` runs on every device under `jax.shard_map`: `state`
    holds this device's shards (call `funshard.unshard` or a `funshard.fully_shard` unit
    on it), `batch` is this device's slice of the global batch (leading dimension split
    over every data-parallel axis), `args` are replicated. It returns the mean loss over
    its local slice, or a loss it already reduced over the devices with `jax.lax.psum`
    / `pmean` (e.g. summed token losses over the summed token count), which is then
    neither averaged nor divided again (and, with `has_aux`, an auxiliary pytree).

    Args:
      loss_fn: the per-device loss function.
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      trainable: optional pytree prefix of the state with a bool per leaf or subtree.
        Frozen leaves are still gathered for the forward pass but get zero gradients
        and no gradient communication at all (non-floating leaves are always frozen).
      microbatches: split each device's batch slice into this many microbatches and
        accumulate their gradients (FSDP2 gradient accumulation); the result equals the
        full-batch gradient.
      sync_every_microbatch: True reduce-scatters every microbatch's gradients (less
        memory: only shards are accumulated). False accumulates unreduced full-size
        gradients in `reduce_dtype` and reduce-scatters once after the last microbatch
        (less communication), like FSDP2's `set_requires_gradient_sync(False)`.
      all_reduce_every_microbatch: HSDP only. False postpones the all-reduce over the
        replicate axis to after the last microbatch, like FSDP2's
        `set_requires_all_reduce(False)`.
      gradient_divide_factor: the gradients' sum over the data-parallel devices is
        divided by this (default: the data-parallel world size, giving the gradient of
        the global mean loss; 1.0 gives the plain sum, FSDP2's sum reduction).

    Returns:
      A function `(state, batch, *args) -> (loss, grads)` (or `((loss, aux), grads)`)
      where `loss` is the mean over the global batch (or the already-reduced loss as
      returned), and `grads` is `jax.grad` of that loss with the structure and sharding
      of `state` (dtype of the sharded parameters): reduce-scattered over the shard
      axis, all-reduced over the replicate axis (HSDP) and divided by
      `gradient_divide_factor`. Aux scalars that vary over the devices are averaged
      (floating) or summed (other dtypes), aux arrays are per-example values gathered
      along dim 0 in global batch order, and aux values already equal on every device
      are returned as they are. Frozen leaves get zero gradients; Python numbers in the
      state are traced as `jax.jit` would (a float trains as a float32 scalar);
      other non-array leaves are carried over unchanged.

    Raises:
      ValueError: `microbatches` is not an int >= 1 or `gradient_divide_factor` is
        not positive (raised at once); the state has no `Sharded` leaves or mixes
        meshes or axes, the global batch size is not a multiple of the data-parallel
        world size times `microbatches`, batch leaves have different leading sizes, or
        `trainable` does not fit the state.
      TypeError: the state has integer or bool leaves (they have no gradient, yet an
        optimizer would change them) that `trainable` does not mark False; the loss
        function's output does not match `has_aux`, its loss is not a floating
        scalar, or its aux holds `Sharded` leaves.
    """
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(_errors.microbatches_invalid(microbatches))
    if gradient_divide_factor is not None and not gradient_divide_factor > 0:
        raise ValueError(_errors.gradient_divide_factor_invalid(gradient_divide_factor))
    opts = _Options(
        has_aux, gradient_divide_factor, microbatches, sync_every_microbatch,
        all_reduce_every_microbatch,
    )

    @functools.wraps(loss_fn)
    def step(state, batch, *args):
        _jax_compat.check()
        _callbacks.warn_outer_callbacks("fs.value_and_grad")
        paths, items, treedef = sharded_leaves(state)
        mesh = common_mesh("value_and_grad", paths, items)
        if mesh is None:
            raise ValueError(_errors.no_sharded("value_and_grad"))
        _check_context_mesh(mesh)
        items = _as_arrays(items)
        replicate_axes, shard_axes = _dp_axes(paths, items)
        dp_axes = (*replicate_axes, *shard_axes)
        world = comm.axes_size(mesh, dp_axes)
        _check_batch(batch, world, dp_axes, opts.microbatches)
        flags = _trainable_flags(trainable, state)
        _check_state_leaves(paths, items, flags)
        plan = _plan(items, treedef)
        trainable_values = [flags[i] for i in plan.dynamic]
        arg_values, rebuild_args = split_arrays(args)
        ctx = _context.StepContext(
            mesh, dp_axes, skip_replicate_reduce=not opts.all_reduce_every_microbatch
        )

        def body(values, local_batch, arg_values):
            args = rebuild_args(arg_values)
            if not opts.all_reduce_every_microbatch:
                # Typed as varying over the replicate axes, the shards' gradients are not
                # all-reduced by autodiff; the root all-reduces them once at the end.
                values = [
                    comm.vary(v, replicate_axes)
                    if isinstance(plan.items[plan.dynamic[i]], Sharded) else v
                    for i, v in enumerate(values)
                ]
            routes = _routes(plan, values, trainable_values, opts)

            callbacks = []  # whether the user's step has host callbacks (trace time)

            def one(microbatch):
                out, found = _callbacks.deferring_errors(
                    lambda mb: _local_value_and_grad(
                        loss_fn, opts, plan, ctx, values, mb, args, routes
                    )
                )(microbatch)
                callbacks.append(found)
                return out

            if opts.microbatches == 1:
                loss, aux, grads, sums = one(local_batch)
            else:
                losses, auxes, grads, sums = _over_microbatches(
                    one, local_batch, opts.microbatches,
                    _zero_sums(plan, values, routes, dp_axes),
                )
                loss, aux = jnp.mean(losses), _combine_microbatches(auxes)
            grads = _add(grads, _reduce_deferred(plan, sums, ctx))
            # A loss already reduced over some data axes (psum / pmean in the loss
            # function) is not averaged over them again, nor are its gradients.
            loss_axes = varying_axes(loss, dp_axes)
            scale = _grad_scale(opts, world, comm.axes_size(mesh, loss_axes))
            grads = _finish_grads(plan, values, grads, opts, scale, replicate_axes)
            if loss_axes:
                loss = jax.lax.pmean(loss, loss_axes)
            aux = _reduce_aux(aux, dp_axes)
            if any(callbacks):
                _callbacks.raise_pending((loss, aux, grads))
            return loss, aux, grads

        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(plan.specs, comm.spec(dp_axes), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), plan.specs),
        )
        loss, aux, grads = mapped(plan.dynamic_values(), batch, arg_values)
        grads = plan.rebuild(grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    return step


def grad(loss_fn: Callable, *, has_aux: bool = False, **options) -> Callable:
    """Like `value_and_grad`, returning only the gradients (and aux with `has_aux`).

    Args:
      loss_fn: the per-device loss function (see `value_and_grad`).
      has_aux: whether `loss_fn` returns `(loss, aux)`.
      **options: the other keyword options of `value_and_grad`.

    Returns:
      A function `(state, batch, *args) -> grads` (or `(grads, aux)`).
    """
    vg = value_and_grad(loss_fn, has_aux=has_aux, **options)

    @functools.wraps(loss_fn)
    def step(state, batch, *args):
        out, grads = vg(state, batch, *args)
        return (grads, out[1]) if has_aux else grads

    return step
