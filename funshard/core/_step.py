"""The training root: `value_and_grad` / `grad` over a sharded state and a global batch.

A step reads its state once, outside the per-device program (`_read_state`: the mesh,
the data-parallel axes and one `LeafRoute` per leaf, the records `fs.plan` reads too);
`_per_device` is the program `jax.shard_map` runs on each device, and `_microbatch`
differentiates the loss on one microbatch there. The traced values travel as one list,
in the order of the routes' `position`s; gradients and deferred sums are dicts keyed by
those positions.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jax.tree_util import tree_flatten_with_path

from funshard import _jax_compat, _py_compat, _text, comm, errors
from funshard.core import _callbacks, _context, _control_flow, _random, _record, _tree
from funshard.core._batch import check_batch
from funshard.core._options import RootOptions, root_options, trainable_flags
from funshard.core._routes import LeafRoute, leaf_routes, state_axes
from funshard.core._sharded import Sharded, is_key, is_sharded
from funshard.core._tree import common_mesh, is_inexact_array, sharded_leaves, split_arrays

# A child of "funshard": silent unless the application configures logging (docs/concepts.md).
logger = logging.getLogger(__name__)

# ---- the state, read once before the per-device program -------------------------------


@dataclasses.dataclass(frozen=True)
class _Root:
    """What a step knows about its state before it traces the loss (all static).

    Attributes:
      opts: the root's options.
      items: the state's leaves (`Sharded` nodes whole), Python numbers as arrays.
      treedef: the state's structure.
      routes: one `LeafRoute` per item.
      mesh: the mesh of every `Sharded` leaf.
      replicate_axes: the HSDP replicate axes (may be empty).
      shard_axes: the axes the parameters are sharded over.
    """

    opts: RootOptions
    items: tuple
    treedef: Any
    routes: tuple[LeafRoute, ...]
    mesh: Mesh
    replicate_axes: tuple[str, ...]
    shard_axes: tuple[str, ...]

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Every data-parallel axis (replicate then shard): the batch is split over them."""
        return (*self.replicate_axes, *self.shard_axes)

    @property
    def world(self) -> int:
        """Devices the batch is split over."""
        return comm.axes_size(self.mesh, self.dp_axes)

    @functools.cached_property
    def ctx(self) -> _context.StepContext:
        """What the units and `unshard` read of the running step."""
        return _context.StepContext(
            self.mesh,
            self.dp_axes,
            skip_replicate_reduce=not self.opts.all_reduce_every_microbatch,
        )

    @property
    def traced(self) -> list[tuple[LeafRoute, Any]]:
        """(route, item) of every traced leaf, in the order of their positions."""
        return [(r, x) for r, x in zip(self.routes, self.items, strict=True) if r.traced]

    @property
    def specs(self) -> list[PartitionSpec]:
        """The shard_map spec of each traced value."""
        return [x.spec if r.sharded else PartitionSpec() for r, x in self.traced]

    def values(self) -> list:
        """The traced values: `Sharded` leaves' padded arrays, and the arrays."""
        return [x.data if r.sharded else x for r, x in self.traced]

    def rebuild(self, values, accumulators: dict | None = None) -> Any:
        """The state with `values` (by position) in its traced leaves.

        With `accumulators` (position -> a deferred gradient's accumulator) the `Sharded`
        leaves become the running step's `StepLeaf`s.
        """
        leaves = []
        for r, x in self.traced:
            value = values[r.position]
            if not r.sharded:
                leaves.append(value)
            elif accumulators is None:
                leaves.append(dataclasses.replace(x, data=value))
            else:
                leaves.append(_step_leaf(self, r, x, value, accumulators.get(r.position)))
        positions = tuple(i for i, r in enumerate(self.routes) if r.traced)
        return _tree.Partition(self.items, self.treedef, positions).combine(leaves)


def _step_leaf(root: _Root, route: LeafRoute, item: Sharded, value, accumulator):
    """`item` holding `value` as the loss function sees it inside the step."""
    fields = {f.name: getattr(item, f.name) for f in dataclasses.fields(Sharded)}
    return _context.StepLeaf(
        **{**fields, "data": value},
        frozen=not route.wanted,
        accumulator=accumulator,
        skip_replicate_reduce=root.ctx.skip_replicate_reduce,
    )


def _read_state(state, batch, trainable, opts: RootOptions) -> _Root:
    """The state's static facts, every problem with it (or with the batch) raised here."""
    paths, items, treedef = sharded_leaves(state)
    mesh = common_mesh("value_and_grad", paths, items)
    if mesh is None:
        raise errors.ShardingValueError(_text.no_sharded("value_and_grad"))
    _check_context_mesh(mesh)
    items = _as_arrays(items)
    axes = state_axes("value_and_grad", paths, items)
    assert axes is not None, "common_mesh found a Sharded leaf"
    replicate_axes, shard_axes = axes
    dp_axes = (*replicate_axes, *shard_axes)
    check_batch(batch, comm.axes_size(mesh, dp_axes), dp_axes, opts.microbatches)
    flags = trainable_flags("value_and_grad", trainable, state)
    routes = leaf_routes(paths, items, flags, sync_every_microbatch=opts.sync_every_microbatch)
    _check_trainable_leaves(routes, items)
    return _Root(opts, tuple(items), treedef, routes, mesh, replicate_axes, shard_axes)


def _log_root(root: _Root) -> None:
    """One debug record per trace of a step: the root's state, each sharded leaf (gathered
    by the units or `unshard`) by key path with its full and per-device bytes."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", _describe_root(root))


def _describe_root(root: _Root) -> str:
    sharded, full, local = [], 0, 0
    for r, x in zip(root.routes, root.items, strict=True):
        if not r.sharded:
            continue
        size = math.prod(x.shape) * x.dtype.itemsize
        full += size
        local += math.prod(x.local_shape) * x.dtype.itemsize
        frozen = "" if r.wanted else " frozen"
        sharded.append(f"{_text.leaf_name(r.path)} {x.shape} {x.dtype.name}{frozen} {size:,} B")
    others = sum(r.traced and not r.sharded for r in root.routes)
    axes = ", ".join(f"{name}={size}" for name, size in root.mesh.shape.items())
    return (
        f"value_and_grad: root on mesh ({axes}), batch split over {root.dp_axes}, "
        f"microbatches={root.opts.microbatches}: "
        f"{_text.counted(len(sharded), 'sharded leaf', 'sharded leaves')}, {full:,} bytes in "
        f"full, {local:,} per device; "
        f"{_text.counted(others, 'replicated array leaf', 'replicated array leaves')}: "
        + ", ".join(sharded)
    )


def _as_arrays(items: list) -> list:
    """Python numbers in the state as arrays, exactly as `jax.jit` would trace them.

    Under jit a Python float leaf is a traced float32 (differentiable) and an int a
    traced int32; converting them here makes an un-jitted step behave the same.
    """
    return [jnp.asarray(x) if isinstance(x, (bool, int, float, complex)) else x for x in items]


def _check_context_mesh(mesh) -> None:
    # A mesh left set by `jax.set_mesh` (Flax's tutorials set one) makes JAX refuse the
    # root's shard_map with a message that names neither; name both here.
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context != mesh.abstract_mesh:
        raise errors.ShardingValueError(_other_mesh_set("value_and_grad", context, mesh))


def _other_mesh_set(fn: str, context, mesh) -> str:
    def text(m) -> str:
        return ", ".join(f"{name}={size}" for name, size in m.shape.items()) or "no axes"

    return (
        f"{fn}: a mesh is set with jax.set_mesh ({text(context)}, axis types "
        f"{tuple(t.name for t in context.axis_types)}) that is not the mesh of the sharded "
        f"state ({text(mesh)}), and JAX would refuse the step's shard_map. funshard places "
        "every array itself: remove the jax.set_mesh call (Flax's tutorials set one for "
        "automatic sharding), or set the state's own mesh (`with jax.set_mesh(mesh):`)."
    )


def _check_trainable_leaves(routes, items) -> None:
    """Non-floating leaves have no gradient, but an optimizer would still change them."""
    bad = [
        (r.path, str(x.dtype))
        for r, x in zip(routes, items, strict=True)
        if r.traced and r.trainable and not r.differentiable
    ]
    if bad:
        raise errors.ShardingTypeError(_non_float_leaves("value_and_grad", bad))


def _non_float_leaves(fn: str, bad) -> str:
    listing = "\n".join(f"  {_text.leaf_name(p)}: {d}" for p, d in bad)
    return (
        f"{fn}: the state has leaves that are not floating point, so they have no "
        f"gradient:\n{listing}\nAn optimizer would still change them (e.g. optax.adamw's "
        "weight decay, truncated to the integer dtype). Keep them out of the state "
        "(pass them as an extra argument), or mark them trainable=False (e.g. "
        "value_and_grad(..., trainable={'step': False})) and keep the optimizer off them "
        "with optax.masked(opt, mask); see docs/concepts.md."
    )


# ---- the per-device program -------------------------------------------------------------


def _per_device(loss_fn, root: _Root, rebuild_args, values, local_batch, arg_values):
    """The step on one device: (loss, aux, gradients by position), all reduced."""
    args = rebuild_args(arg_values)
    opts = root.opts
    if not opts.all_reduce_every_microbatch:
        # Typed as varying over the replicate axes, the shards' gradients are not
        # all-reduced by autodiff; the root all-reduces them once at the end.
        values = [
            comm.vary(v, root.replicate_axes) if r.sharded else v
            for (r, _), v in zip(root.traced, values, strict=True)
        ]

    callbacks = []  # whether the user's step has host callbacks (trace time)

    def one(microbatch, index=None):
        def run(mb):
            return _microbatch(loss_fn, root, values, mb, args)

        (loss, aux, grads, sums), found = _callbacks.deferring_errors(
            run,
            inspect=_control_flow.check,
            evaluate=_draws_for(root, run, microbatch, index),
        )(microbatch)
        callbacks.append(found)
        return loss, aux, grads, sums

    if opts.microbatches == 1:
        loss, aux, grads, sums = one(local_batch)
    else:
        losses, auxes, grads, sums = _over_microbatches(
            one, local_batch, opts.microbatches, _zero_sums(root, values)
        )
        loss, aux = jnp.mean(losses), _combine_microbatches(auxes)
    grads = _add(grads, _reduce_deferred(root, sums))
    _check_model_invariant(loss, root)
    # A loss already reduced over some data axes (psum / pmean in the loss function) is
    # not averaged over them again, nor are its gradients.
    loss_axes = varying_axes(loss, root.dp_axes)
    scale = _grad_scale(opts, root.world, comm.axes_size(root.mesh, loss_axes))
    grads = _finish_grads(root, values, grads, scale)
    if loss_axes:
        loss = jax.lax.pmean(loss, loss_axes)
    aux = _reduce_aux(aux, root.dp_axes)
    if any(callbacks):
        _callbacks.raise_pending((loss, aux, grads))
    return loss, aux, grads


def _check_model_invariant(loss, root: _Root) -> None:
    """Refuses a loss that still differs between the devices of a model axis.

    Tensor- and expert-parallel devices hold parts of one model, so their losses must
    agree: a loss varying over a model axis is a partial result (a row-parallel
    output without its `psum`, logits split over `tensor` without their gather), and
    averaging it would be a silent wrong number.
    """
    model = [a for a in root.mesh.axis_names if a not in root.dp_axes]
    varying = [a for a in _jax_compat.varying_axes(loss) if a in model]
    if varying:
        raise errors.ShardingValueError(_loss_varies_over_model(tuple(varying)))


def _loss_varies_over_model(axes: tuple[str, ...]) -> str:
    return (
        f"value_and_grad: the loss still differs between the devices of the model axes "
        f"{axes}: it is a partial result of a model split over them (a row-parallel "
        f"output without jax.lax.psum over {axes[0]!r}, or logits still split over it). "
        "Combine it over those axes before the loss: fs.row_parallel (a psum of the "
        "row-parallel matmul's output), fs.gather_columns of split logits, or "
        "jax.lax.psum / pmax written in the loss (see docs/parallelism.md)."
    )


def _draws_for(root: _Root, run, microbatch, microbatch_index):
    """How a microbatch's traced program runs: with its random draws those of plain JAX
    on the global batch (`_random`), unless `per_device_keys=False`.

    The batch is split over the data axes (device-major, as `comm.spec(dp_axes)`
    places it), then each device's rows into consecutive microbatches: microbatch `m`
    of device `d` is block `d * microbatches + m` of the global batch's equal blocks.
    """
    if not root.opts.per_device_keys:
        return None
    block = jax.lax.axis_index(root.dp_axes) * root.opts.microbatches
    if microbatch_index is not None:
        block = block + microbatch_index
    return _random.global_draws(
        run, microbatch, root.dp_axes, block, root.world * root.opts.microbatches
    )


def _microbatch(loss_fn, root: _Root, values, batch, args):
    """One microbatch on this device: (loss, aux, gradients, deferred sums).

    Autodiff differentiates the loss with respect to the values whose gradient it
    computes (`by_autodiff`) and to one full-size accumulator per deferred leaf, whose
    gradient is that leaf's unreduced cotangent. Both come back keyed by position.
    """
    diff = [r for r, _ in root.traced if r.by_autodiff]
    deferred = [(r, x) for r, x in root.traced if r.deferred]

    def local_loss(diff_values, accumulators):
        merged = list(values)
        for r, v in zip(diff, diff_values, strict=True):
            assert r.position is not None, "a leaf autodiff differentiates is traced"
            merged[r.position] = v
        by_position = {r.position: a for (r, _), a in zip(deferred, accumulators, strict=True)}
        with _context.inside(root.ctx), _record.loss_trace():
            out = loss_fn(root.rebuild(merged, by_position), batch, *args)
        return _split_output(out, root.opts.has_aux)

    accumulators = [_accumulator(x, root.dp_axes) for _, x in deferred]
    (loss, aux), (diff_grads, sums) = jax.value_and_grad(local_loss, argnums=(0, 1), has_aux=True)(
        [values[r.position] for r in diff], accumulators
    )
    grads = {r.position: g for r, g in zip(diff, diff_grads, strict=True)}
    return loss, aux, grads, {r.position: s for (r, _), s in zip(deferred, sums, strict=True)}


def _accumulator(item: Sharded, dp_axes):
    dtype = _context.layout_of([item]).leaves[0].reduce_dtype
    return comm.vary(jnp.zeros(item.block_shape, dtype), (*dp_axes, *item.model_axis_names))


def _split_output(out, has_aux: bool):
    """(loss, aux) from what the loss function returned, or a clear error."""
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise errors.ShardingTypeError(_aux_expected(out))
        loss, aux = out
    else:
        if isinstance(out, (tuple, list)):
            raise errors.ShardingTypeError(_aux_unexpected(len(out)))
        loss, aux = out, None
    if not (
        hasattr(loss, "dtype") and jnp.ndim(loss) == 0 and jnp.issubdtype(loss.dtype, jnp.floating)
    ):
        raise errors.ShardingTypeError(_loss_not_scalar(loss))
    sharded_aux = [
        p for p, x in tree_flatten_with_path(aux, is_leaf=is_sharded)[0] if isinstance(x, Sharded)
    ]
    if sharded_aux:
        raise errors.ShardingTypeError(_sharded_aux(sharded_aux))
    return loss, aux


def _aux_expected(out) -> str:
    what = f"a {type(out).__name__}"
    if isinstance(out, (tuple, list)):
        what += f" of {len(out)} elements"
    return (
        f"value_and_grad: has_aux=True but the loss function returned {what}; with "
        "has_aux=True it must return a pair (loss, aux). Return (loss, aux), or pass "
        "has_aux=False."
    )


def _aux_unexpected(count: int) -> str:
    return (
        f"value_and_grad: the loss function returned a tuple of {count} elements but "
        "has_aux=False; return the scalar loss alone, or return (loss, aux) and pass "
        "has_aux=True."
    )


def _loss_not_scalar(loss) -> str:
    shape = getattr(loss, "shape", None)
    dtype = getattr(loss, "dtype", type(loss).__name__)
    return (
        f"value_and_grad: the loss must be a floating scalar, got shape {shape} dtype "
        f"{dtype}. Reduce it over the local batch (e.g. jnp.mean) and return a float; "
        "return other values as aux (has_aux=True)."
    )


def _sharded_aux(paths) -> str:
    listing = ", ".join(_text.leaf_name(p) for p in paths)
    return (
        f"value_and_grad: aux holds fs.Sharded leaves ({listing}): inside the step they "
        "are this device's local blocks. Return fs.unshard(...) of them, or read them from "
        "the state outside the step."
    )


def _zero_sums(root: _Root, values) -> tuple[dict, dict]:
    """Zero gradients and deferred sums, typed (varying axes) as autodiff returns them.

    A cotangent has its primal's type: a state value's gradient varies where the value
    does, a deferred sum where its accumulator does.
    """
    grads = {}
    for r, _ in root.traced:
        if r.by_autodiff:
            v = values[r.position]
            grads[r.position] = comm.vary(jnp.zeros_like(v), varying_axes(v, root.mesh.axis_names))
    sums = {r.position: _accumulator(x, root.dp_axes) for r, x in root.traced if r.deferred}
    return grads, sums


def _over_microbatches(one, local_batch, k: int, zeros: tuple[dict, dict]):
    """(losses, auxes, grads, sums) of `one(microbatch)` summed over `k` microbatches.

    A `lax.scan` over the microbatches: the program (and its compile time) stays the
    size of one microbatch's step whatever `k`, with the same collectives per
    microbatch inside the loop. Losses and aux values come back stacked on a leading
    microbatch axis.
    """
    split = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), local_batch)

    def body(carry, indexed):
        grads, sums = carry
        loss, aux, g, s = one(*indexed)
        return (_add(grads, g), _add(sums, s)), (loss, aux)

    (grads, sums), (losses, auxes) = jax.lax.scan(body, zeros, (split, jnp.arange(k)))
    return losses, auxes, grads, sums


def _add(total: dict, new: dict) -> dict:
    out = dict(total)
    for i, g in new.items():
        out[i] = out[i] + g if i in out else g
    return out


def _combine_microbatches(stacked: Any) -> Any:
    """Per-microbatch aux values (stacked on axis 0) as one: scalars averaged (floating)
    or summed, arrays (per-example values) concatenated in batch order, PRNG keys (RNG
    streams written back) the last microbatch's."""

    def combine(x):
        if is_key(x):
            return x[-1]
        if x.ndim > 1:
            return x.reshape(-1, *x.shape[2:])
        return x.mean(0) if is_inexact_array(x) else x.sum(0)

    return jax.tree.map(combine, stacked)


def _reduced_layout(root: _Root) -> comm.GroupLayout | None:
    """The layout of every sharded leaf whose gradient the step reduces (for
    `funshard.check`), or None when it reduces none."""
    leaves = [x for r, x in root.traced if r.sharded and r.wanted]
    if not leaves:
        return None
    return _context.layout_of(leaves, not root.opts.all_reduce_every_microbatch, name="root")


def _reduce_deferred(root: _Root, sums: dict) -> dict:
    """Reduce-scatters the accumulated unreduced gradients: one collective per dtype."""
    if not sums:
        return {}
    order = sorted(sums)
    item_at = {r.position: x for r, x in root.traced}
    layout = _context.layout_of(
        [item_at[i] for i in order], root.ctx.skip_replicate_reduce, name="root"
    )
    reduced = comm.reduce_values([sums[i] for i in order], layout)
    return dict(zip(order, reduced, strict=True))


def _grad_scale(opts: RootOptions, world: int, loss_world: int) -> float:
    """What the summed per-device gradients are multiplied by.

    A loss that still varies over `loss_world` devices is a per-device mean: their sum
    over devices divided by `loss_world` is the gradient of the global mean. A loss the
    user already reduced (psum / pmean: invariant, loss_world = 1) needs no division.
    `gradient_divide_factor` f means "sum of per-device-mean gradients / f" in both
    cases, hence the `world / loss_world` correction.
    """
    if opts.gradient_divide_factor is None:
        scale = 1.0 / loss_world
    else:
        scale = (world / loss_world) / opts.gradient_divide_factor
    return scale / opts.microbatches


def _finish_grads(root: _Root, values, grads: dict, scale: float) -> list:
    """Every traced value's gradient: scaled, HSDP-reduced if postponed, else zeros."""
    postponed = not root.opts.all_reduce_every_microbatch and root.replicate_axes
    out = []
    for r, _ in root.traced:
        v = values[r.position]
        if r.position not in grads:
            out.append(jnp.zeros(v.shape, v.dtype))
            continue
        g = grads[r.position]
        if postponed and r.sharded:
            # Named as a unit's HSDP all-reduce is, for profiles and `funshard.check`.
            with jax.named_scope("funshard/root/reduce_scatter"):
                g = jax.lax.psum(g, root.replicate_axes)
        out.append((g * scale).astype(v.dtype))
    return out


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


# ---- the public functions ---------------------------------------------------------------


def value_and_grad(
    loss_fn: Callable,
    *,
    has_aux: bool = False,
    trainable: Any = None,
    microbatches: int = 1,
    sync_every_microbatch: bool = True,
    all_reduce_every_microbatch: bool = True,
    gradient_divide_factor: float | None = None,
    per_device_keys: bool = True,
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
      per_device_keys: True (default) gives random draws plain JAX's numbers on the
        global batch: a draw from a key that is the same on every device whose shape
        scales with the batch (a dropout mask) becomes this device's rows of the draw
        of the global shape, found by tracing the loss again on twice the rows; other
        draws (a scalar, parameter-shaped noise) are the same on every device. So the
        numbers depend on the key and each example's index only, not on the mesh or
        `microbatches`. False draws as the loss writes them on each device's rows
        (every device then draws the same numbers for its own rows).

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
        not positive (raised at once, as is the TypeError of a `sync_every_microbatch`
        or `all_reduce_every_microbatch` that is not a bool); the state has no
        `Sharded` leaves or mixes meshes or axes, the global batch size is not a
        multiple of the data-parallel world size times `microbatches`, batch leaves
        have different leading sizes, or `trainable` does not fit the state; a `cond` /
        `switch` / `while_loop` whose predicate differs between devices guards a unit or
        another collective; a random draw changes shape with the batch other than
        along one dimension (see `per_device_keys`).
      TypeError: the state has integer or bool leaves (they have no gradient, yet an
        optimizer would change them) that `trainable` does not mark False; the loss
        function's output does not match `has_aux`, its loss is not a floating
        scalar, or its aux holds `Sharded` leaves.
    """
    opts = root_options(
        "value_and_grad",
        microbatches=microbatches,
        sync_every_microbatch=sync_every_microbatch,
        all_reduce_every_microbatch=all_reduce_every_microbatch,
        gradient_divide_factor=gradient_divide_factor,
        has_aux=has_aux,
        per_device_keys=per_device_keys,
    )

    @functools.wraps(loss_fn)
    def step(state, batch, *args):
        _jax_compat.check()
        _py_compat.check()
        _callbacks.warn_outer_callbacks("fs.value_and_grad")
        comm.same_state("value_and_grad", state)  # multi-process jobs only
        root = _read_state(state, batch, trainable, opts)
        _log_root(root)
        arg_values, rebuild_args = split_arrays(args)
        mapped = jax.shard_map(
            functools.partial(_per_device, loss_fn, root, rebuild_args),
            mesh=root.mesh,
            in_specs=(root.specs, comm.spec(root.dp_axes), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), root.specs),
        )
        values = [
            comm.place_for_map(root.mesh, v, s)
            for v, s in zip(root.values(), root.specs, strict=True)
        ]
        batch = comm.place_for_map(root.mesh, batch, comm.spec(root.dp_axes))
        arg_values = comm.place_for_map(root.mesh, arg_values, PartitionSpec())
        with _record.step(opts, root.mesh, _reduced_layout(root) if _record.active() else None):
            loss, aux, grads = mapped(values, batch, arg_values)
        grads = root.rebuild(grads)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    vars(step)["_funshard_value_and_grad"] = True  # `funshard.check` knows a bare step
    return step


def grad(loss_fn: Callable, *, has_aux: bool = False, **options: Any) -> Callable:
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
