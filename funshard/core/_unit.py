"""A unit: the one place funshard defines how a function's sharded parameters are
gathered for it and how their gradients are reduced after it.

`fs.fully_shard`, `fs.scan` and the frontends are thin callers of this module:

- `prepare` is every unit's prologue: the parameters split into `Sharded` leaves and the
  rest, their one mesh and one policy, the forward-input cast, the nesting check;
- `Residuals` is the typed trace-time record of a unit's backward: which of `jax.vjp`'s
  residuals were the gathered parameters (left out of the saved residuals and gathered
  again in the backward pass: FSDP2's `reshard_after_forward`, no recomputation);
- `call_resharded` is the custom_vjp of one unit call, `call_scanned` that of a stack of
  layers under `lax.scan`.

Each gather is tied by a data dependency to the value it must wait for (the unit's input
forward, the incoming cotangent backward): that keeps XLA from hoisting every gather to the
program start and from merging the backward re-gather with the forward gather, either of
which would keep all parameters alive.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _jax_compat, _text, comm, errors
from funshard._custom_vjp import filter_custom_vjp
from funshard.core import _context, _record, _tree
from funshard.core._options import check_reshard_after_forward as check_reshard_after_forward
from funshard.core._policy import MixedPrecisionPolicy, param_dtype_for
from funshard.core._residuals import recompute_elementwise
from funshard.core._sharded import Sharded, is_sharded

# A child of "funshard": silent unless the application configures logging (docs/concepts.md).
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class UnitParams:
    """A unit's parameters as the unit sees them on entry (see `prepare`)."""

    parts: _tree.Partition  # the params tree, `Sharded` leaves selected
    paths: list
    policy: MixedPrecisionPolicy | None

    @property
    def sharded(self) -> list[Sharded]:
        return self.parts.selected

    @property
    def param_dtype(self):
        return None if self.policy is None else self.policy.param_dtype

    @property
    def output_dtype(self):
        return None if self.policy is None else self.policy.output_dtype


def prepare(fn: str, params: Any) -> UnitParams:
    """Splits a unit's parameters; checks they share one mesh and one policy."""
    paths, items, _ = _tree.sharded_leaves(params)
    if _tree.common_mesh(fn, paths, items) is None:
        if _context.in_unit():
            raise errors.ShardingValueError(_text.nested_units("a unit called inside another unit"))
        raise errors.ShardingValueError(_text.no_sharded(fn))
    return UnitParams(_tree.partition(params), paths, policy_of(fn, paths, items))


def log_plan(fn: str, name: str, unit: UnitParams, reshard_after_forward: bool | int) -> None:
    """One debug record for a unit about to run: what it gathers, by key path and bytes.

    Built only when the "funshard" logger wants debug records; inside a step it is
    written once per trace of the step, not per device or per run.
    """
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s", _describe_plan(fn, name, unit, reshard_after_forward))


def _describe_plan(fn: str, name: str, unit: UnitParams, reshard_after_forward: bool | int) -> str:
    entries = []
    total = 0
    for i in unit.parts.positions:
        leaf = unit.parts.items[i]
        dtype = np.dtype(param_dtype_for(leaf.mp_policy, np.dtype(leaf.dtype)))
        size = math.prod(leaf.shape) * dtype.itemsize
        total += size
        entries.append(f"{_text.leaf_name(unit.paths[i])} {leaf.shape} {dtype.name} {size:,} B")
    where = "in a step" if _context.current() is not None else "outside a step"
    if fn != "fully_shard":
        where += ", layer by layer"  # a scanned stack: each layer's slice in turn
    first = unit.sharded[0]
    return (
        f"{fn} {name!r} ({where}, reshard_after_forward={reshard_after_forward}): gathers "
        f"{_text.counted(len(entries), 'sharded leaf', 'sharded leaves')}, {total:,} bytes, "
        f"over mesh axes {first.shard_axis}: " + ", ".join(entries)
    )


def policy_of(fn: str, paths, items) -> MixedPrecisionPolicy | None:
    found: dict = {}
    for path, x in zip(paths, items, strict=True):
        if isinstance(x, Sharded):
            found.setdefault(x.mp_policy, path)
    if len(found) > 1:
        raise errors.ShardingValueError(_mixed_policies(fn, [(p, k) for k, p in found.items()]))
    return next(iter(found), None)


def _mixed_policies(fn: str, paths_and_policies) -> str:
    listing = "\n".join(f"  {_text.leaf_name(p)}: {pol}" for p, pol in paths_and_policies)
    return (
        f"{fn}: the unit's parameters carry different mixed-precision policies:\n"
        f"{listing}\nShard all parameters of one unit with the same mp_policy."
    )


def cast_inputs(unit: UnitParams, args: Any) -> Any:
    """`args` cast to `param_dtype` when the policy says `cast_forward_inputs`."""
    if unit.policy is not None and unit.policy.cast_forward_inputs:
        return cast_floating(args, unit.policy.param_dtype)
    return args


def cast_floating(tree: Any, dtype) -> Any:
    """Floating arrays of `tree` cast to `dtype` (None: unchanged)."""
    if dtype is None:
        return tree

    def cast(x):
        # Sharded arguments (another unit's parameters, passed through) keep their dtype.
        if isinstance(x, Sharded) or not hasattr(x, "dtype"):
            return x
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, tree, is_leaf=is_sharded)


def dependency_of(tree: Any):
    """A non-empty array of `tree` a gather can be tied to (floating first), or None.

    Any dtype will do (`_lowering.tie_to` reads it as a predicate that is always true),
    so a unit whose only inputs are integer token ids is still tied to them.
    """
    leaves = jax.tree.leaves(tree)
    index = _preferred_dependency(leaves, set())
    return None if index is None else leaves[index]


def _preferred_dependency(arrays: list, excluded: set[int]) -> int | None:
    """The index of the array a unit's forward gather should wait for, or None.

    The gather must wait for something computed from this microbatch, or XLA hoists it
    out of the microbatch loop (or to the program start): so never another unit's
    sharded parameters (positions in `excluded`), and values that vary over the mesh
    axes (the batch) before replicated ones (RNG counters), floating before integer.
    """
    candidates = [
        i for i, x in enumerate(arrays) if i not in excluded and isinstance(x, jax.Array) and x.size
    ]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda i: (
            not _jax_compat.varying_axes(arrays[i]),
            not _tree.is_inexact_array(arrays[i]),
        ),
    )


def group_size(reshard_after_forward: bool | int, sharded: list[Sharded]) -> int | None:
    """1: keep the gathered params; None: reshard fully; k: hpZ over groups of k."""
    if isinstance(reshard_after_forward, bool):
        return None if reshard_after_forward else 1
    n = sharded[0].num_shards
    check_reshard_after_forward("fully_shard", reshard_after_forward, n)
    return None if reshard_after_forward == n else reshard_after_forward


def _keep_group(layout: comm.GroupLayout, k: int) -> tuple[str, ...]:
    """The trailing shard axes spanning k devices (the hpZ group), or a clear error."""
    axes = layout.shard_axes
    sizes = [jax.lax.axis_size(a) for a in axes]
    for start in range(len(axes) - 1, 0, -1):
        if int(np.prod(sizes[start:])) == k:
            return axes[start:]
    raise errors.ShardingValueError(_hpz_group_mismatch(k, axes, sizes))


def _hpz_group_mismatch(k: int, axes, sizes) -> str:
    return (
        f"fully_shard: reshard_after_forward={k} needs the parameters' shard axes {axes} "
        f"(sizes {tuple(sizes)}) to end in axes spanning exactly {k} devices, e.g. shard "
        f"over ('fsdp_outer', 'fsdp_inner') with an inner axis of size {k}."
    )


@dataclasses.dataclass
class Residuals:
    """What a unit's backward needs to know about its forward, recorded at trace time.

    Static structure cannot travel as custom_vjp residuals (those are arrays), so it
    lives here, in the closure of the unit's forward and backward.

    Attributes:
      treedef: the structure of the forward's `jax.vjp` function.
      slots: for each of its residuals, the index of the gathered parameter it is (left
        out of the saved residuals, re-gathered in backward), or None (saved).
      regroup: the backward gathers from hpZ parts, within groups (not from shards).
      rebuild_out: puts the unit's static (non-array) outputs back around its arrays.
    """

    treedef: Any = None
    slots: list = dataclasses.field(default_factory=list)
    regroup: bool = False
    rebuild_out: Callable | None = None

    def drop_gathered(self, vjp_fn: Callable, fulls) -> list:
        """The residuals of `vjp_fn`, with the gathered `fulls` among them left out (None)."""
        residuals, self.treedef = _jax_compat.vjp_residuals(vjp_fn)
        slot_of = {id(f): k for k, f in enumerate(fulls)}
        self.slots = [slot_of.get(id(r)) for r in residuals]
        return [None if s is not None else r for r, s in zip(residuals, self.slots, strict=True)]

    def resume(self, kept: list, fulls) -> Callable:
        """The vjp function again, with re-gathered `fulls` put back into their slots."""
        residuals = [k if s is None else fulls[s] for k, s in zip(kept, self.slots, strict=True)]
        return _jax_compat.vjp_from_residuals(self.treedef, residuals)


def call_resharded(
    fn: Callable,
    unit: UnitParams,
    args: tuple,
    group: int | None,
    name: str,
    collectives: tuple = (None, None),
):
    """`fn(gathered params, *args)` without keeping the gathered params for backward.

    One custom_vjp call: the forward gathers (one collective), runs `jax.vjp` of `fn`
    and saves its residuals except the gathered parameters; the backward gathers them
    again (from the local shards, or with `group` k (hpZ) from the 1/k parts each device
    kept, within its group of k devices), resumes the vjp and reduce-scatters.
    `collectives` is the unit's own `(all_gather, reduce_scatter)`, None for the default.
    """
    sharded = unit.sharded
    layout = comm.with_collectives(_context.layout_of(sharded, name=name), *collectives)
    _record.unit(name, layout, True if group is None else group, None)
    datas = tuple(x.data for x in sharded)
    accumulators = _context.accumulators_for(sharded)
    deferred = None if accumulators is None else tuple(a is not None for a in accumulators)
    keep_group = _keep_group(layout, group) if group else None
    record = Residuals()
    # jax.vjp takes and returns arrays only: the other leaves stay static.
    operand_arrays, rebuild_operands = _tree.split_arrays((unit.parts.others, args))
    # Positions, computed here and now (static ints): identities do not survive traces.
    in_sharded = {
        id(x)
        for leaf in _tree.sharded_leaves(args)[1]
        if is_sharded(leaf)
        for x in jax.tree.leaves(leaf)
    }
    dependency_index = _preferred_dependency(
        operand_arrays, {i for i, x in enumerate(operand_arrays) if id(x) in in_sharded}
    )

    def traced(fulls, operand_arrays):
        others, call_args = rebuild_operands(operand_arrays)
        # Replicated (unsharded) parameters of the unit compute in param_dtype too.
        params = unit.parts.combine(fulls, cast_floating(others, unit.param_dtype))
        with _context.unit_body():
            out = fn(params, *call_args)
        out_arrays, record.rebuild_out = _tree.split_arrays(out)
        return out_arrays

    # The unit saves what plain JAX's fused program keeps (see _residuals). Not with hpZ:
    # there it raised the temp above reshard_after_forward=False's on
    # tests/test_reshard_policies.py's model (124.6 against 118.1 KB; 106.4 without),
    # for a reason not yet read out of XLA's buffer assignment.
    run = recompute_elementwise(traced) if keep_group is None else traced

    @filter_custom_vjp
    def call(datas, accumulators, operand_arrays):
        return run(comm.gather_values(datas, layout), operand_arrays)

    def call_fwd(datas, accumulators, operand_arrays):
        dependency = None if dependency_index is None else operand_arrays[dependency_index]
        if keep_group is None:
            fulls, source = comm.gather_values(datas, layout, dependency), datas
        else:
            fulls, part = comm.gather_values(datas, layout, dependency, keep_group)
            source = datas if part is None else part  # None: nothing to gather at all
        record.regroup = source is not datas
        out, vjp_fn = jax.vjp(run, fulls, operand_arrays)
        return out, (source, record.drop_gathered(vjp_fn, fulls))

    def call_bwd(residuals, ct):
        source, kept = residuals
        if record.regroup:
            fulls = comm.regather_values(source, layout, keep_group, dependency_of(ct))
        else:
            fulls = comm.gather_values(source, layout, dependency_of(ct))
        ct_fulls, ct_operands = record.resume(kept, fulls)(ct)
        ct_datas, ct_accumulators = comm.backward_values(ct_fulls, layout, deferred)
        return ct_datas, ct_accumulators, ct_operands

    call.defvjp(call_fwd, call_bwd)
    out = call(datas, accumulators, operand_arrays)  # traces `run`, which records its output
    assert record.rebuild_out is not None, "calling the unit traced `run`"
    return record.rebuild_out(out)


def _vary_like(carry, new_carry):
    """`carry` cast to vary over every mesh axis its counterpart in `new_carry` varies
    over (None if nothing is missing): the type a loop's carry needs when it starts
    from a constant and accumulates this device's values."""
    leaves, treedef = jax.tree.flatten(carry)
    missing = [
        _jax_compat.aval_varying_axes(new) - _jax_compat.aval_varying_axes(jax.typeof(old))
        for old, new in zip(leaves, jax.tree.leaves(new_carry), strict=True)
    ]
    if not any(missing):
        return None
    cast = [comm.vary(jnp.asarray(x), sorted(m)) for x, m in zip(leaves, missing, strict=True)]
    return jax.tree.unflatten(treedef, cast)


def _layer_closure(run_layer: Callable, layer_types, carry):
    """(`run_layer` with the traced values it closes over as trailing arguments, those
    values, `carry` typed as the layers leave it).

    A layer may close over values the step differentiates (a parameter gathered outside
    the scan, an encoder output read by cross-attention): inside the unit's custom_vjp
    they must be explicit inputs, whose gradients the backward pass sums over the
    layers. `layer_types` are one layer's (gathered parameters, other per-layer leaves).
    """
    for _ in range(len(jax.tree.leaves(carry)) + 1):  # each cast can only add axes
        new_carry = jax.eval_shape(run_layer, *layer_types, carry)[0]
        cast = _vary_like(carry, new_carry)
        if cast is None:
            break
        carry = cast
    layer_fn, consts = jax.closure_convert(run_layer, *layer_types, carry)
    return layer_fn, tuple(consts), carry


def call_scanned(
    fn: Callable,
    unit: UnitParams,
    carry,
    reshard_after_forward: bool,
    name: str,
    collectives: tuple = (None, None),
):
    """`carry, y = fn(carry, layer)` over a stack of sharded layers, one custom_vjp.

    `fn` follows `jax.lax.scan`'s convention, and so does the result: the final carry
    and the per-layer outputs `y` stacked on a new leading axis. The forward is a
    `lax.scan` carrying a double buffer (this layer's gathered parameters and the next
    layer's, gathered before this layer computes); the backward is a reverse `lax.scan`
    that re-gathers each layer (prefetching the previous one) and reduce-scatters its
    gradient as soon as the layer is done. The stack's other leaves (replicated
    per-layer values, extra per-layer inputs) are sliced per layer like `lax.scan`'s xs
    and, if floating, cast to `param_dtype`. Values `fn` closes over are inputs of the
    custom_vjp (see `_layer_closure`), carried through both loops. `collectives` is
    the unit's own `(all_gather, reduce_scatter)`, run per layer.
    """
    sharded = unit.sharded
    datas = tuple(x.data for x in sharded)
    if _context.accumulators_for(sharded) is not None:
        raise errors.UnsupportedError(_scan_deferred_sync_unsupported())
    stack = comm.with_collectives(_context.layout_of(sharded, name=f"scan/{name}"), *collectives)
    layout = stack.layer()
    others = unit.parts.others
    layers = datas[0].shape[0]
    _record.unit(f"scan/{name}", stack, reshard_after_forward, layers)
    record = Residuals()

    def gather_layer(datas, i, dependency):
        blocks = [jax.lax.dynamic_index_in_dim(d, i, keepdims=False) for d in datas]
        return tuple(comm.gather_values(blocks, layout, dependency))

    def prefetch(datas, pred, i, dependency, current):
        # The other branch hands back the current buffer: same type, no communication.
        return jax.lax.cond(pred, lambda: gather_layer(datas, i, dependency), lambda: current)

    def run_layer(gathered, others_i, h):
        # Replicated per-layer values compute in param_dtype too, as in `call_resharded`
        # and as outside a step (where the whole gathered stack is cast).
        layer = unit.parts.combine(gathered, cast_floating(others_i, unit.param_dtype))
        with _context.unit_body():
            return fn(h, layer)

    layer_types = jax.eval_shape(
        lambda: (gather_layer(datas, 0, None), jax.tree.map(lambda x: x[0], others))
    )
    layer_fn, consts, carry = _layer_closure(run_layer, layer_types, carry)

    # The loop's residuals, as a fused program of units would keep them (see _residuals).
    saving_fn = recompute_elementwise(lambda g, o, h, k: layer_fn(g, o, h, *k))

    def known(gathered, consts) -> tuple:
        # The residuals saved once, not per layer: the gathered parameters (re-gathered
        # in backward unless kept) and the closed-over values.
        return (tuple(gathered) if reshard_after_forward else ()) + tuple(consts)

    @filter_custom_vjp
    def run(datas, others, carry, consts):
        def body(h, xs):
            return layer_fn(gather_layer(datas, xs[0], None), xs[1], h, *consts)

        return jax.lax.scan(body, carry, (jnp.arange(layers), others))

    def run_fwd(datas, others, carry, consts):
        def body(c, xs):
            h, current, consts = c
            i, others_i = xs
            upcoming = prefetch(
                datas, i + 1 < layers, jnp.minimum(i + 1, layers - 1), dependency_of(h), current
            )
            (h, y), vjp_fn = jax.vjp(saving_fn, current, others_i, h, consts)
            kept = record.drop_gathered(vjp_fn, known(current, consts))
            return (h, upcoming, consts), (kept, y)

        first = gather_layer(datas, 0, dependency_of(carry))
        (h, _, _), (kept, ys) = jax.lax.scan(
            body, (carry, first, consts), (jnp.arange(layers), others)
        )
        return (h, ys), (datas, kept, consts)

    def run_bwd(res, ct):
        datas, kept, consts = res
        ct_carry, ct_ys = ct

        def body(c, xs):
            ct_h, current, ct_consts = c
            i, kept_i, ct_y = xs
            if reshard_after_forward:
                dependency = dependency_of((ct_h, ct_y))
                previous = prefetch(datas, i > 0, jnp.maximum(i - 1, 0), dependency, current)
            else:
                previous = current  # every layer's parameters were kept: nothing to gather
            ct_g, ct_others, ct_h, ct_k = record.resume(kept_i, known(current, consts))(
                (ct_h, ct_y)
            )
            ct_blocks = comm.backward_values(ct_g, layout, None)[0]
            ct_consts = tuple(a + b for a, b in zip(ct_consts, ct_k, strict=True))
            return (ct_h, previous, ct_consts), (ct_blocks, ct_others)

        if reshard_after_forward:
            last = gather_layer(datas, layers - 1, dependency_of(ct))
        else:
            last = tuple(jnp.zeros(leaf.shape, leaf.gather_dtype) for leaf in layout.leaves)
        zeros = tuple(
            comm.vary(jnp.zeros_like(k), sorted(_jax_compat.varying_axes(k))) for k in consts
        )
        (ct_carry, _, ct_consts), (ct_datas, ct_others) = jax.lax.scan(
            body, (ct_carry, last, zeros), (jnp.arange(layers), kept, ct_ys), reverse=True
        )
        return ct_datas, ct_others, ct_carry, ct_consts

    run.defvjp(run_fwd, run_bwd)
    return run(datas, others, carry, consts)


def _scan_deferred_sync_unsupported() -> str:
    return (
        "scan: gradient accumulation without per-microbatch sync is not supported for "
        "scanned stacks yet; use sync_every_microbatch=True."
    )
