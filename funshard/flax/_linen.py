"""Flax linen: FSDP unit classes over sharded 'params' collections.

`fully_shard(Cls)` returns a subclass whose `__call__`, given sharded parameters, runs
the original module as a pure `Cls(...).apply` inside an `fs.fully_shard` unit. The
subclass keeps the name `Cls`, so auto-named submodules (`Block_0`) and therefore the
variables tree are the same as the unmarked model's.

A unit owns the parameters of its scope that no marked descendant owns. Which
descendants are units is found by tracing the module once abstractly (`jax.eval_shape`,
no computation) with every unit recording its scope path instead of gathering; the unit
then gathers only its own parameters, and the children's still-sharded parameters cross
the unit boundary as arguments, to be gathered by the children themselves.

Only arrays are traced, in the discovery trace as in the unit: Python arguments
(`train: bool`) stay static. Parameters boxed with Flax's partitioning metadata
(`nn.with_logical_partitioning`) are unboxed before the module sees them. Inside a step
BatchNorm is synced through a method interceptor (see `funshard.flax._data_parallel`).
A unit applies its module with the RNG streams and counters of its own scope, so every
key is the one the unmarked model derives (the root then makes each device's draws its
rows of the global batch's draw).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import traverse_util
from flax.core import meta
from flax.core import scope as flax_scope

import funshard as fs
from funshard import errors
from funshard.flax import _data_parallel
from funshard.flax._nnx import (
    UnitOptions,
    base_class,
    marked_twice,
    sliced_by_transform,
    sliced_leaves,
)

# Set while a unit traces its module abstractly to find its descendant units: the
# (scope path, options) of every unit called.
_DISCOVERY: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "funshard_flax_linen_discovery", default=None
)

_UNIT_CLASSES: dict[tuple[type, UnitOptions], type] = {}


def is_unit_class(cls: Any) -> bool:
    """Whether `cls` is a linen unit class made by `fully_shard`."""
    return isinstance(getattr(cls, "_funshard_options", None), UnitOptions)


def fully_shard_class(cls: Any, options: UnitOptions) -> type | functools.partial:
    """The linen unit class of `cls` (see `funshard.flax.fully_shard`).

    Raises:
      errors.ShardingTypeError: (a TypeError) `cls` is not a linen module class.
      errors.ShardingValueError: (a ValueError) `cls` is a unit class already.
    """
    if isinstance(cls, functools.partial):
        # `ResNet18 = partial(ResNet, stage_sizes=...)`: the same partial of the unit class.
        return functools.partial(fully_shard_class(cls.func, options), *cls.args, **cls.keywords)
    if isinstance(cls, nn.Module):
        raise errors.ShardingTypeError(_linen_instance(cls))
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise errors.ShardingTypeError(_not_a_module(cls))
    if is_unit_class(cls):
        raise errors.ShardingValueError(marked_twice(base_class(cls).__name__, " (a linen class)"))
    key = (cls, options)
    if key not in _UNIT_CLASSES:
        namespace = {
            "__call__": _unit_call,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "_funshard_options": options,
            "_funshard_base": cls,
        }
        _UNIT_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return _UNIT_CLASSES[key]


def _linen_instance(target: Any) -> str:
    name = type(target).__name__
    return (
        f"fs.flax.fully_shard: got an instance of the linen module {name}; linen units are "
        f"marked on the class. Write `FSDP{name} = fs.flax.fully_shard({name})` and build "
        f"the model from FSDP{name}(...)."
    )


def _not_a_module(target: Any) -> str:
    return (
        f"fs.flax.fully_shard: expected an nnx.Module instance or a flax.linen.Module "
        f"subclass, got {target!r} of type {type(target).__name__}. Pass the module "
        "object itself (nnx: `fs.flax.fully_shard(block)`), or the linen class "
        "(`Block = fs.flax.fully_shard(Block)`)."
    )


def _is_sharded(x) -> bool:
    return isinstance(x, fs.Sharded)


def _has_sharded(tree) -> bool:
    return any(map(_is_sharded, jax.tree.leaves(tree, is_leaf=_is_sharded)))


def _plain(module: nn.Module) -> nn.Module:
    """An unbound instance of the original class with `module`'s fields."""
    base = base_class(type(module))
    fields = {
        f.name: getattr(module, f.name)
        for f in dataclasses.fields(base)
        if f.init and f.name not in ("parent", "name")
    }
    return base(**fields, parent=None)


@contextlib.contextmanager
def _discovering(found: list):
    token = _DISCOVERY.set(found)
    try:
        yield
    finally:
        _DISCOVERY.reset(token)


def _abstract(tree):
    """Sharded leaves as abstract full arrays (a discovery trace computes nothing)."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_sharded(x) else x,
        tree,
        is_leaf=_is_sharded,
    )


def _static_split(tree) -> tuple[list, Any]:
    """The array leaves of `tree`, and a function putting values back in their place.

    Only arrays are traced: Python values among a unit's arguments (`train: bool`,
    strings, None) stay static, as they are for the unit itself.
    """
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]

    def rebuild(values):
        out = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            out[i] = v
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in arrays], rebuild


def _is_array(x) -> bool:
    if isinstance(x, (str, bytes)):  # np.str_ / np.bytes_ are np.generic too
        return False
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def _child_unit_paths(apply, variables, args, kwargs, dp_axes) -> list[tuple]:
    found: list = []
    params = _abstract(variables["params"])
    arrays, rebuild = _static_split((args, kwargs))
    with _discovering(found), nn.intercept_methods(_sync_batch_norm(dp_axes)):
        jax.eval_shape(
            lambda p, rest, arrays: apply({**rest, "params": p}, *rebuild(arrays)),
            params,
            {c: v for c, v in variables.items() if c != "params"},
            arrays,
        )
    return [path for path, _ in found]


def unit_scopes(model: nn.Module, variables: dict, args, kwargs) -> dict:
    """{scope path: options} of every unit `model.apply(variables, *args)` calls.

    One abstract trace (nothing is computed) in which every unit records its path.
    """
    found: list = []
    key = jax.random.key(0)
    arrays, rebuild = _static_split((args, kwargs))

    def apply(variables, arrays):
        a, k = rebuild(arrays)
        return model.apply(variables, *a, rngs={"params": key, "dropout": key}, mutable=True, **k)

    with _discovering(found), nn.intercept_methods(_sync_batch_norm(None)):
        jax.eval_shape(apply, variables, arrays)
    return dict(found)


def unbox(tree):
    """`tree` with Flax's metadata boxes (`nn.with_logical_partitioning`,
    `nn.with_partitioning`) replaced by their values; no sharding constraint applied."""

    def open_box(x):
        if not isinstance(x, meta.AxisMetadata):
            return x
        try:
            # AxisMetadata's own unbox takes no argument; the partitioning boxes' take
            # apply_constraint (the TypeError below catches the others).
            return x.unbox(apply_constraint=False)  # type: ignore[call-arg]
        except TypeError:  # boxes of other kinds take no argument
            return x.unbox()

    return jax.tree.map(open_box, tree, is_leaf=lambda x: isinstance(x, meta.AxisMetadata))


def _split_params(params, children: list[tuple]) -> tuple[dict, dict]:
    """(this unit's sharded params, everything else), as flat {path: leaf} dicts."""
    flat = traverse_util.flatten_dict(params)
    own: dict[tuple, Any] = {}
    rest: dict[tuple, Any] = {}
    for path, leaf in flat.items():
        under_child = any(path[: len(c)] == c for c in children)
        (rest if under_child or not _is_sharded(leaf) else own)[path] = leaf
    return own, rest


def _with_policy(own: dict, policy) -> dict:
    if policy is None:
        return own
    return {p: dataclasses.replace(x, mp_policy=policy) for p, x in own.items()}


def _rngs(module: nn.Module) -> dict:
    """The unit scope's RNG streams as linen holds them: `LazyRng`s, a key and the scope
    path still to be folded into it (a pytree whose leaf is the key).

    linen derives a submodule's key by folding the whole path and the call's count into
    the root key at once; a key drawn here with `make_rng` and folded again below would
    differ from the unmarked model's. `Module.apply` takes `LazyRng`s as they are.
    """
    assert module.scope is not None, "a unit's module is bound when it runs"
    return dict(module.scope.rngs)


def _copy_counters(counters: dict) -> dict:
    # Not copy.deepcopy: a child's entry is keyed by linen's token object, which must stay.
    return {k: _copy_counters(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _set_counters(into: dict, counters: dict) -> None:
    """Writes linen's nested draw counters `counters` into `into` in place: child scopes
    already made (by `setup`) hold their own part of it."""
    for key, value in counters.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _set_counters(into[key], value)
        else:
            into[key] = _copy_counters(value) if isinstance(value, dict) else value


def _rng_counters(start: dict, end: dict):
    """A method interceptor: the pure apply's root scope counts draws from `start` (the
    unit scope's counters: a module called again draws new keys, as unmarked), and
    `end["counters"]` is that scope's counters, which count on during the call."""

    def interceptor(next_fun, args, kwargs, context):
        scope = context.module.scope
        if scope is not None and scope.parent is None and "counters" not in end:
            _set_counters(scope.rng_counters, start)
            end["counters"] = scope.rng_counters
        return next_fun(*args, **kwargs)

    return interceptor


def _sync_batch_norm(dp_axes):
    """A method interceptor: BatchNorm averages its statistics over the data axes.

    With `dp_axes` None (an abstract trace outside a step) it only drops axis names
    nothing binds, so that the trace does not fail on them.
    """

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not (isinstance(module, nn.BatchNorm) and context.method_name == "__call__"):
            return next_fun(*args, **kwargs)
        own = module.axis_name
        # The module is this apply's own bound instance; its field is restored after.
        object.__setattr__(module, "axis_name", _data_parallel.batch_axis_name(own, dp_axes))
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "axis_name", own)

    return interceptor


def _mutable_collections(module: nn.Module):
    """The collections the unit's pure apply may write: the caller's filter, less params.

    The filter itself, not the collections that exist already: `sow` writes a
    collection ("intermediates") the variables do not hold yet, and a unit that listed
    only existing ones applied its module with that collection immutable, where `sow`
    silently stores nothing.
    """
    assert module.scope is not None, "a unit's module is bound when it runs"
    mutable = flax_scope.subtract_filters(module.scope.mutable, "params")
    if flax_scope.is_filter_empty(mutable):
        return False
    return sorted(mutable) if isinstance(mutable, (set, frozenset)) else mutable


def _put_updates(module: nn.Module, updates: dict) -> None:
    """Writes a pure apply's mutable updates (relative to `module`) into its scope."""
    for collection, tree in updates.items():
        for name, value in tree.items():
            module.put_variable(collection, name, value)


def _unit_call(self, *args, **kwargs):
    """`__call__` of a linen unit: the original module applied inside one funshard unit."""
    cls = type(self)
    options, base = cls._funshard_options, cls._funshard_base
    found = _DISCOVERY.get()
    if found is not None:
        found.append((tuple(self.scope.path), options))
        return base.__call__(self, *args, **kwargs)
    variables = dict(self.variables)
    if self.is_initializing() or not _has_sharded(variables.get("params", {})):
        return base.__call__(self, *args, **kwargs)
    sliced = sliced_leaves(variables["params"])
    if sliced:
        raise errors.UnsupportedError(
            sliced_by_transform(base.__name__, sliced, "nn.scan / nn.vmap over a marked class")
        )
    variables["params"] = unbox(variables["params"])
    mutable = _mutable_collections(self)
    plain = _plain(self)
    dp_axes = _data_parallel.step_axes()

    def apply(variables, args, kwargs, rngs):
        return plain.apply(variables, *args, rngs=rngs, mutable=mutable, **kwargs)

    # Discovered paths are relative to this unit: `plain` is applied as a root. The
    # abstract trace needs the streams' names only, not this unit's keys.
    dummy_rngs = {name: jax.random.key(0) for name in self.scope.rngs}
    children = _child_unit_paths(
        lambda v, a, k: apply(v, a, k, dummy_rngs), variables, args, kwargs, dp_axes
    )
    own, rest = _split_params(variables["params"], children)
    if not own:  # every parameter belongs to a descendant unit
        return base.__call__(self, *args, **kwargs)
    others = {c: v for c, v in variables.items() if c != "params"}
    start = _copy_counters(self.scope.rng_counters)
    counted: dict = {}  # "counters": the last trace's counts, written back below

    def body(own_full, args, kwargs, rest, others, rngs):
        params = traverse_util.unflatten_dict({**own_full, **rest})
        counted.clear()  # each trace of the body counts from `start`
        with nn.intercept_methods(_rng_counters(start, counted)):
            if dp_axes is None:
                return apply({**others, "params": params}, args, kwargs, rngs)
            with nn.intercept_methods(_sync_batch_norm(dp_axes)):
                return apply({**others, "params": params}, args, kwargs, rngs)

    unit = fs.fully_shard(
        body,
        reshard_after_forward=options.resolved_reshard_after_forward(),
        name=base.__name__,
        all_gather=options.all_gather,
        reduce_scatter=options.reduce_scatter,
    )
    own = _with_policy(own, options.mp_policy)
    # The call's inputs first: the unit's gather waits for its first varying array.
    out = unit(own, args, kwargs, rest, others, _rngs(self))
    # In place: the parent scope holds this dict for the next call of this module.
    _set_counters(self.scope.rng_counters, counted.get("counters", {}))
    if mutable is False:
        return out
    out, updates = out
    _put_updates(self, updates)
    return out
