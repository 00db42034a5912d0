"""`fully_shard`: the functional form of FSDP2's `fully_shard(module)`.

A thin caller of `funshard.core._unit`, where a unit's gather, re-gather and reduce-scatter
are defined once for every caller (see that module's docstring for how the backward
re-gathers parameters without recomputing the forward).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from funshard import _text, comm, errors
from funshard.core import _context, _unit
from funshard.core._shard import unshard_as


def _bad_unit_name(name) -> str:
    return (
        f"fully_shard: name must be a non-empty string (the unit's label in profiles and "
        f"HLO metadata), got {name!r}; pass e.g. name='block3', or leave it out to use "
        "the function's name."
    )


def fully_shard(
    fn: Callable,
    *,
    reshard_after_forward: bool | int = True,
    name: str | None = None,
    all_gather: comm.AllGather | None = None,
    reduce_scatter: comm.ReduceScatter | None = None,
) -> Callable:
    """Makes `fn(params, *args)` a sharded unit: `fn(sharded_params, *args)`.

    The functional form of FSDP2's `fully_shard(module)`. On entry the unit's
    parameters are all-gathered (one collective for the unit, in the policy's
    `param_dtype`); floating inputs are cast to `param_dtype` when the policy says
    `cast_forward_inputs`, and floating outputs to `output_dtype`.

    Args:
      fn: the unit, taking the full parameters first.
      reshard_after_forward: True frees the gathered parameters after the forward pass
        and all-gathers them again for backward (less memory, one more all-gather).
        The unit's forward is not recomputed: it saves what plain JAX's fused program
        keeps for backward (matmul and other non-elementwise outputs) and recomputes
        only elementwise values (a GELU's tanh, masks, casts) there (with an int k
        below, every residual is saved); where `fn` calls `jax.checkpoint` itself,
        that decides what is saved instead. False keeps
        the gathered parameters from forward to backward (no backward all-gather). An
        int k (FSDP2's hpZ) keeps 1/k of them on each device, so the backward
        all-gather runs within groups of k devices only; the parameters must be sharded
        over axes ending in axes of k devices (e.g. `shard_axis=("fsdp_outer",
        "fsdp_inner")`). k = 1 is False, k = the shard count is True.
      name: the unit's label (default: `fn.__name__`). Its collectives appear as
        `funshard/<name>/all_gather` and `funshard/<name>/reduce_scatter` in
        `jax.profiler` traces and in the compiled program's metadata.
      all_gather: the unit's own all-gather of its parameters (`fs.AllGather`, FSDP2's
        `set_custom_all_gather`), inside and outside a step; None: the default.
      reduce_scatter: the unit's own reduce-scatter of its gradients
        (`fs.ReduceScatter`, FSDP2's `set_custom_reduce_scatter`); None: the default.

    Returns:
      The unit taking sharded parameters, by position or by `fn`'s own name for them
      (`unit(params=state, x=x)`), and `fn`'s other arguments as `fn` takes them
      (keyword arguments too: array ones are traced and cast like positional ones,
      others are static). Outside `funshard.value_and_grad` it gathers
      to replicated parameters and runs `fn` (e.g. for evaluation).

    Raises:
      TypeError: `reshard_after_forward` is not a bool or int, `name` is not a
        non-empty string, or `all_gather` / `reduce_scatter` is not an `fs.AllGather` /
        `fs.ReduceScatter`; the unit is called without its parameters.
      ValueError: `reshard_after_forward` is an int below 1 or one that does not
        divide the shard count (raised when the unit is called); the parameters have no
        `Sharded` leaves, or mix meshes or policies; or units are nested (`fn` is
        already a unit, or a unit is called with parameters another unit gathered).
        Pass an inner unit's sharded parameters as an argument instead: the outer
        unit then gathers only its own, as in FSDP2. A custom collective returns
        another shape or dtype than the default's (raised when the unit is traced).
      NotImplementedError: a custom all-gather with an int `reshard_after_forward`
        (hpZ), or a custom reduce-scatter under `sync_every_microbatch=False`.
    """
    _unit.check_reshard_after_forward("fully_shard", reshard_after_forward)
    comm.check_unit_collectives("fully_shard", all_gather, reduce_scatter)
    collectives = (all_gather, reduce_scatter)
    label = name if name is not None else getattr(fn, "__name__", "unit")
    if not isinstance(label, str) or not label:
        raise errors.ShardingTypeError(_bad_unit_name(label))
    if getattr(fn, "_funshard_unit", False):
        raise errors.ShardingValueError(_text.nested_units("fully_shard(fully_shard(fn))"))

    params_name = _first_parameter(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        params, args = _split_params(label, params_name, args, kwargs)
        unit = _unit.prepare("fully_shard", params)
        _unit.log_plan("fully_shard", label, unit, reshard_after_forward)
        args, kwargs = _unit.cast_inputs(unit, (args, kwargs))
        group = _unit.group_size(reshard_after_forward, unit.sharded)
        ctx = _context.current()
        if ctx is not None and group != 1:
            out = _unit.call_resharded(
                _with_keywords(fn), unit, (args, kwargs), group, label, collectives
            )
        else:
            full = _unit.cast_floating(unshard_as(params, label, collectives), unit.param_dtype)
            with _context.unit_body():
                out = fn(full, *args, **kwargs)
        if ctx is not None:
            # Unit outputs (and, by transposition, their cotangents) become fusion
            # boundaries, as module outputs are in eager frameworks.
            out = comm.materialize(out, ctx.dp_axes)
        return _unit.cast_floating(out, unit.output_dtype)

    vars(wrapped)["_funshard_unit"] = True  # a function attribute, unknown to mypy
    return wrapped


def _first_parameter(fn: Callable) -> str | None:
    """The name `fn` takes its parameters under, if they can be passed by keyword."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    if parameters and parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        return parameters[0].name
    return None


def _split_params(label: str, name: str | None, args: tuple, kwargs: dict) -> tuple[Any, tuple]:
    """(the unit's parameters, the other positional arguments), as `fn` would bind them.

    `kwargs` loses the parameters when they came by keyword (`unit(params=s, x=x)`).
    """
    if args:
        return args[0], args[1:]
    if name is not None and name in kwargs:
        return kwargs.pop(name), ()
    raise errors.ShardingTypeError(_no_params(label, name))


def _no_params(label: str, name: str | None) -> str:
    by_keyword = f" (or as {name}=...)" if name else ""
    return (
        f"fully_shard: unit {label!r} was called without its parameters; pass the sharded "
        f"parameters first{by_keyword}, e.g. unit(state['block'], x)."
    )


def _with_keywords(fn: Callable) -> Callable:
    """`fn(params, *args, **kwargs)` as a function of `(params, args, kwargs)`."""
    return lambda params, args, kwargs: fn(params, *args, **kwargs)
