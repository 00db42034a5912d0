"""`fully_shard`: the functional form of FSDP2's `fully_shard(module)`.

With `reshard_after_forward=True` the unit is a `custom_vjp` whose forward runs
`jax.vjp` of the unit on the gathered parameters and keeps every residual EXCEPT the
gathered parameters themselves; the backward re-gathers them from the local shards
and resumes the saved vjp. Activations are saved as usual, so nothing of the unit's
forward is recomputed. Each gather is tied by a data dependency to the value it must
wait for (the unit's input forward, the incoming cotangent backward): that keeps XLA
from hoisting every gather to the program start and from merging the backward
re-gather with the forward gather, either of which would keep all parameters alive.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import tree_unflatten

from funshard import _context, _errors, _gather, _jax_compat, _lowering
from funshard._policy import MixedPrecisionPolicy
from funshard._shard import common_mesh, sharded_leaves, unshard_as
from funshard._sharded import Sharded, is_sharded
from funshard._tree import split_arrays


def _unit_policy(paths, items) -> MixedPrecisionPolicy | None:
    found = {}
    for path, x in zip(paths, items):
        if isinstance(x, Sharded):
            found.setdefault(x.mp_policy, path)
    if len(found) > 1:
        raise ValueError(_errors.mixed_policies("fully_shard", [(p, k) for k, p in found.items()]))
    return next(iter(found), None)


def _cast_floating(tree: Any, dtype) -> Any:
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
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and x.size]
    floating = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    return (floating or leaves or [None])[0]


def _keep_group(layout, k: int) -> tuple[str, ...]:
    """The trailing shard axes spanning k devices (the hpZ group), or a clear error."""
    axes = layout.shard_axes
    sizes = [jax.lax.axis_size(a) for a in axes]
    for start in range(len(axes) - 1, 0, -1):
        if int(np.prod(sizes[start:])) == k:
            return axes[start:]
    raise ValueError(_errors.hpz_group_mismatch(k, axes, sizes))


def drop_gathered(vjp_fn, fulls, saved: dict) -> list:
    """The residuals of `vjp_fn` with the gathered `fulls` among them left out (None).

    Records in `saved` (a trace-time dict, not a residual) the residuals' structure and
    which slot each left-out one came from, for `resume`.
    """
    residuals, saved["treedef"] = _jax_compat.vjp_residuals(vjp_fn)
    slot_of = {id(f): k for k, f in enumerate(fulls)}
    saved["slots"] = [slot_of.get(id(r)) for r in residuals]
    return [None if s is not None else r for r, s in zip(residuals, saved["slots"])]


def resume(saved: dict, kept: list, fulls) -> Callable:
    """The vjp function again, with re-gathered `fulls` put back into their slots."""
    residuals = [k if s is None else fulls[s] for k, s in zip(kept, saved["slots"])]
    return _jax_compat.vjp_from_residuals(saved["treedef"], residuals)


def _resharded_call(
    fn: Callable, params: Any, args: tuple, group_size: int | None, param_dtype, name: str
):
    """Runs `fn(unshard(params), *args)` without keeping the gathered params for backward.

    With `group_size` k (hpZ), each device keeps 1/k of the gathered parameters and the
    backward gathers within its group of k devices only.
    """
    paths, items, treedef = sharded_leaves("fully_shard", params)
    idx = [i for i, x in enumerate(items) if isinstance(x, Sharded)]
    layout = _gather.layout_of([items[i] for i in idx], name=name)
    datas = tuple(items[i].data for i in idx)
    accumulators = _gather.accumulators_for([items[i] for i in idx])
    deferred = None if accumulators is None else tuple(a is not None for a in accumulators)
    others = [None if isinstance(x, Sharded) else x for x in items]
    group = _keep_group(layout, group_size) if group_size else None

    # Trace-time static facts the backward needs (they cannot travel as residuals).
    saved: dict[str, Any] = {}
    # custom_vjp takes and returns arrays only: other leaves of the operands and of
    # the output stay static.
    operand_arrays, rebuild_operands = split_arrays((others, args))

    def run(fulls, operand_arrays):
        operands = rebuild_operands(operand_arrays)
        # Replicated (unsharded) parameters of the unit compute in param_dtype too.
        merged = list(_cast_floating(operands[0], param_dtype))
        for i, full in zip(idx, fulls):
            merged[i] = full
        with _context.unit_body():
            out = fn(tree_unflatten(treedef, merged), *operands[1])
        out_arrays, saved["rebuild_out"] = split_arrays(out)
        return out_arrays

    @jax.custom_vjp
    def unit(datas, accumulators, operand_arrays):
        return run(_gather.gather_values(datas, layout), operand_arrays)

    def unit_fwd(datas, accumulators, operand_arrays):
        dependency = dependency_of(operand_arrays)
        if group is None:
            fulls, source = _gather.gather_values(datas, layout, dependency), datas
        else:
            fulls, part = _gather.gather_values(datas, layout, dependency, group)
            source = datas if part is None else part  # None: nothing to gather at all
        saved["regroup"] = source is not datas
        out, vjp_fn = jax.vjp(run, fulls, operand_arrays)
        kept = drop_gathered(vjp_fn, fulls, saved)
        return out, (source, kept)

    def unit_bwd(res, ct):
        source, kept = res
        if saved["regroup"]:
            fulls = _gather.regather_values(source, layout, group, dependency_of(ct))
        else:
            fulls = _gather.gather_values(source, layout, dependency_of(ct))
        ct_fulls, ct_operands = resume(saved, kept, fulls)(ct)
        ct_datas, ct_accumulators = _gather.backward_values(ct_fulls, layout, deferred)
        return ct_datas, ct_accumulators, ct_operands

    unit.defvjp(unit_fwd, unit_bwd)
    out = unit(datas, accumulators, operand_arrays)  # traces `run`, which records its output
    return saved["rebuild_out"](out)


def fully_shard(
    fn: Callable, *, reshard_after_forward: bool | int = True, name: str | None = None
) -> Callable:
    """Makes `fn(params, *args)` a sharded unit: `fn(sharded_params, *args)`.

    The functional form of FSDP2's `fully_shard(module)`. On entry the unit's
    parameters are all-gathered (one collective for the unit, in the policy's
    `param_dtype`); floating inputs are cast to `param_dtype` when the policy says
    `cast_forward_inputs`, and floating outputs to `output_dtype`.

    Args:
      fn: the unit, taking the full parameters first.
      reshard_after_forward: True frees the gathered parameters after the forward pass
        and all-gathers them again for backward (less memory, one more all-gather);
        activations are still saved, the unit's forward is not recomputed. False keeps
        the gathered parameters from forward to backward (no backward all-gather). An
        int k (FSDP2's hpZ) keeps 1/k of them on each device, so the backward
        all-gather runs within groups of k devices only; the parameters must be sharded
        over axes ending in axes of k devices (e.g. `shard_axis=("fsdp_outer",
        "fsdp_inner")`). k = 1 is False, k = the shard count is True.
      name: the unit's label (default: `fn.__name__`). Its collectives appear as
        `funshard/<name>/all_gather` and `funshard/<name>/reduce_scatter` in
        `jax.profiler` traces and in the compiled program's metadata.

    Returns:
      The unit taking sharded parameters. Outside `funshard.value_and_grad` it gathers
      to replicated parameters and runs `fn` (e.g. for evaluation).

    Raises:
      TypeError: `reshard_after_forward` is not a bool or int.
      ValueError: `reshard_after_forward` is an int below 1; the parameters have no
        `Sharded` leaves, or mix meshes or policies; or units are nested (`fn` is
        already a unit, or a unit is called with parameters another unit gathered).
        Pass an inner unit's sharded parameters as an argument instead: the outer
        unit then gathers only its own, as in FSDP2.
    """
    check_reshard_after_forward("fully_shard", reshard_after_forward)
    label = name if name is not None else getattr(fn, "__name__", "unit")
    if not isinstance(label, str) or not label:
        raise TypeError(_errors.bad_unit_name(label))
    if getattr(fn, "_funshard_unit", False):
        raise ValueError(_errors.nested_units("fully_shard(fully_shard(fn))"))

    @functools.wraps(fn)
    def wrapped(params, *args):
        paths, items, _ = sharded_leaves("fully_shard", params)
        if common_mesh("fully_shard", paths, items) is None:
            if _context.in_unit():
                raise ValueError(_errors.nested_units("a unit called inside another unit"))
            raise ValueError(_errors.no_sharded("fully_shard"))
        policy = _unit_policy(paths, items)
        if policy is not None and policy.cast_forward_inputs:
            args = _cast_floating(args, policy.param_dtype)
        group_size = _group_size(reshard_after_forward, items)
        ctx = _context.current()
        if ctx is not None and group_size != 1:
            out = _resharded_call(fn, params, args, group_size, _param_dtype(policy), label)
        else:
            full = _cast_floating(unshard_as(params, label), _param_dtype(policy))
            with _context.unit_body():
                out = fn(full, *args)
        if ctx is not None:
            # Unit outputs (and, by transposition, their cotangents) become fusion
            # boundaries, as module outputs are in eager frameworks.
            out = _lowering.materialize(out, ctx.dp_axes)
        return _cast_floating(out, None if policy is None else policy.output_dtype)

    wrapped._funshard_unit = True
    return wrapped


def check_reshard_after_forward(fn: str, value) -> None:
    """FSDP2's `reshard_after_forward: bool | int` (an int k >= 1), or a clear error."""
    if not isinstance(value, int):
        raise TypeError(_errors.bad_reshard_after_forward(fn, value))
    if not isinstance(value, bool) and value < 1:
        raise ValueError(_errors.bad_reshard_after_forward(fn, value))


def _group_size(reshard_after_forward: bool | int, items) -> int | None:
    """1: keep the gathered params; None: reshard fully; k: hpZ over groups of k."""
    if isinstance(reshard_after_forward, bool):
        return None if reshard_after_forward else 1
    n = next(x.num_shards for x in items if isinstance(x, Sharded))
    if n % reshard_after_forward:
        raise ValueError(_errors.hpz_not_divisor(reshard_after_forward, n))
    return None if reshard_after_forward == n else reshard_after_forward


def _param_dtype(policy: MixedPrecisionPolicy | None):
    return None if policy is None else policy.param_dtype
