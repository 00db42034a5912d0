"""`fs.flax.plan`: `fs.plan` of a marked Flax model, its units read from the model.

`fs.plan` needs the units as key-path prefixes and each unit's `reshard_after_forward`
(and its own collectives, if any).
A marked model knows both: nnx marks module instances (their graph paths are the state's
paths), linen marks classes (their scope paths, found by one abstract trace with every
unit recording its path, are the 'params' paths). `reshard_after_forward=None` resolves
as it does when the model runs: False for a unit inside no other unit (the root keeps
its parameters from forward to backward), True for the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
from flax import nnx, traverse_util

import funshard as fs
from funshard import errors
from funshard.flax import _data_parallel, _nnx


def _is_sharded(x) -> bool:
    return isinstance(x, fs.Sharded)


def _abstract(tree):
    """Every array (and `Sharded` leaf, whole) as an abstract array of its full shape."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x,
        tree,
        is_leaf=_is_sharded,
    )


def _resolved(options_by_path: dict) -> dict:
    """{path: reshard_after_forward} with None read as the running model reads it."""
    out = {}
    for path, options in options_by_path.items():
        if options.reshard_after_forward is not None:
            out[path] = options.reshard_after_forward
        else:
            out[path] = any(p != path and path[: len(p)] == p for p in options_by_path)
    return out


def _names(paths, root_name: str) -> dict:
    """A unit name per path: the dotted module path, the class name for the root."""
    names = {}
    for path in paths:
        name = ".".join(str(k) for k in path) or root_name
        names[path] = name if name != "root" else "root_unit"
    return names


def nnx_plan(model: nnx.Module, mesh, wrt, mp_policy, options: dict) -> fs.Plan:
    """See `funshard.flax.plan` (nnx)."""
    if mesh is None:
        raise errors.ShardingTypeError(_no_mesh(type(model).__name__))
    _data_parallel.check_no_other_mesh("fs.flax.plan", mesh)
    units = _nnx.unit_options(model)
    graphdef, state = nnx.split(model)
    abstract = nnx.merge(graphdef, _abstract(state))
    _, params, _ = _nnx.shard(abstract, mesh, wrt, ..., mp_policy=mp_policy)
    cls = type(model)
    return _plan(params, units, _nnx.base_class(cls).__name__, options)


def _no_mesh(name: str) -> str:
    return (
        f"fs.flax.plan: pass the mesh {name} will be sharded on "
        "(`fs.flax.plan(model, fs.make_mesh(), ...)`); only a linen state already sharded "
        "with fs.shard carries its own."
    )


def _plan(state, units: dict, root_name: str, options: dict) -> fs.Plan:
    names = _names(units, root_name)
    reshard = _resolved(units)
    return fs.plan(
        state,
        units={names[p]: tuple(str(k) for k in p) for p in units},
        reshard_after_forward={names[p]: reshard[p] for p in units},
        all_gather={names[p]: o.all_gather for p, o in units.items() if o.all_gather},
        reduce_scatter={names[p]: o.reduce_scatter for p, o in units.items() if o.reduce_scatter},
        **options,
    )


def linen_plan(model: nn.Module, mesh, variables, args, kwargs, mp_policy, options) -> fs.Plan:
    """See `funshard.flax.plan` (linen)."""
    from funshard.flax import _linen

    if variables is None:
        raise errors.ShardingTypeError(_linen_needs_inputs(type(model).__name__))
    others = {c: v for c, v in variables.items() if c != "params"} if "params" in variables else {}
    params = _linen.unbox(variables.get("params", variables))
    sharded = [x for x in jax.tree.leaves(params, is_leaf=_is_sharded) if _is_sharded(x)]
    if sharded:
        state, mesh = params, sharded[0].mesh
    else:
        if mesh is None:
            raise errors.ShardingTypeError(_no_mesh(type(model).__name__))
        state = fs.shard(_abstract(params), mesh, mp_policy=mp_policy)
    _data_parallel.check_no_other_mesh("fs.flax.plan", mesh)
    units = _linen.unit_scopes(
        model, {**_abstract(others), "params": _abstract(params)}, args, kwargs or {}
    )
    if not units:
        raise errors.ShardingValueError(_no_units_called(type(model).__name__))
    state = _with_unit_policies(state, units)
    return _plan(state, units, type(model).__name__, options)


def _linen_needs_inputs(name: str) -> str:
    return (
        f"fs.flax.plan: {name} is a linen module; pass its variables (or the 'params' "
        "collection) and the arguments of one call, as for model.init: "
        "`fs.flax.plan(model, mesh, variables=variables, args=(x,))`."
    )


def _no_units_called(name: str) -> str:
    return (
        f"fs.flax.plan: no unit of {name} was called (no class marked with "
        "fs.flax.fully_shard among the modules applied). Mark the blocks' class and the "
        "model's: `Block = fs.flax.fully_shard(Block)`."
    )


def _with_unit_policies(state, units: dict):
    """The sharded params with each unit's own `mp_policy` on the leaves it owns."""
    flat = traverse_util.flatten_dict(state)
    for path, leaf in flat.items():
        owners = [u for u in units if path[: len(u)] == u]
        if not owners or not isinstance(leaf, fs.Sharded):
            continue
        policy = units[max(owners, key=len)].mp_policy
        if policy is not None:
            flat[path] = dataclasses.replace(leaf, mp_policy=policy)
    return traverse_util.unflatten_dict(flat)


def plan(model: Any, mesh, *, variables, args, kwargs, wrt, mp_policy, options) -> fs.Plan:
    """Dispatches on the kind of model (see `funshard.flax.plan`)."""
    given = [name for name in ("units", "reshard_after_forward") if name in options]
    if given:
        raise errors.ShardingTypeError(_option_from_model(given))
    if isinstance(model, nnx.Module):
        return nnx_plan(model, mesh, wrt, mp_policy, options)
    if isinstance(model, nn.Module):
        return linen_plan(model, mesh, variables, args, kwargs, mp_policy, options)
    raise errors.ShardingTypeError(_not_a_model(model))


def _option_from_model(names) -> str:
    return (
        f"fs.flax.plan: {', '.join(names)} come from the model (its marked modules and "
        "the options given to fs.flax.fully_shard); mark the modules instead, or plan a "
        "hand-written unit map with fs.plan."
    )


def _not_a_model(model: Any) -> str:
    return (
        f"fs.flax.plan: expected an nnx.Module marked with fs.flax.fully_shard, or a "
        f"flax.linen.Module instance, got {type(model).__name__}. For a plain parameter "
        "tree use fs.plan."
    )
