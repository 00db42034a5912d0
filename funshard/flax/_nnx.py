"""Flax nnx: FSDP units marked on module instances, and their sharded `nnx.State`.

`fully_shard(module)` swaps the instance's class for `FSDP<Cls>`, a subclass whose
`__call__` runs the original one as an `fs.fully_shard` unit. The class, and the options
it carries, is what nnx records in a `GraphDef`, so `nnx.merge` rebuilds marked modules
with no extra state and `jax.jit` caches per graphdef as usual.

A unit owns the `nnx.Param`s below it that no marked descendant owns (FSDP2's rule).
When called with sharded parameters it gathers only those: its children's still-sharded
parameters cross the unit boundary as plain arguments and are gathered by the children
themselves, so each unit has ONE all-gather (and one re-gather in backward with
`reshard_after_forward=True`).

Inside a step a unit also syncs its BatchNorms (`funshard.flax._data_parallel` says
why); its RNG keys stay as they are (the root makes the draws those of the global batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import errors as flax_errors
from flax import nnx

import funshard as fs
from funshard import comm, core, errors
from funshard.flax import _data_parallel


@dataclasses.dataclass(frozen=True)
class UnitOptions:
    """The options of one marked module; hashable, as they live on its class."""

    reshard_after_forward: bool | int | None = None
    mp_policy: fs.MixedPrecisionPolicy | None = None
    all_gather: fs.AllGather | None = None
    reduce_scatter: fs.ReduceScatter | None = None

    def resolved_reshard_after_forward(self) -> bool | int:
        """None (FSDP2's default): True inside another unit, False for the outermost.

        The outermost unit is the root: its backward starts right after its forward,
        so gathering it again would only cost a collective (FSDP2 keeps the root too).
        """
        if self.reshard_after_forward is None:
            return core.in_unit()
        return self.reshard_after_forward


def check_options(
    reshard_after_forward, mp_policy, all_gather=None, reduce_scatter=None
) -> UnitOptions:
    """The options as a `UnitOptions`.

    Raises:
      errors.ShardingTypeError: (a TypeError) an option of the wrong kind.
      errors.ShardingValueError: (a ValueError) an int `reshard_after_forward` below 1.
    """
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, int):
        raise errors.ShardingTypeError(_bad_reshard_after_forward(reshard_after_forward))
    if not isinstance(reshard_after_forward, (bool, type(None))) and reshard_after_forward < 1:
        raise errors.ShardingValueError(_bad_reshard_after_forward(reshard_after_forward))
    _check_mp_policy(mp_policy)
    comm.check_unit_collectives("fs.flax.fully_shard", all_gather, reduce_scatter)
    return UnitOptions(reshard_after_forward, mp_policy, all_gather, reduce_scatter)


def _bad_reshard_after_forward(value: Any) -> str:
    return (
        f"fs.flax.fully_shard: reshard_after_forward must be None, True, False or a "
        f"positive int (hpZ group size), got {value!r}."
    )


def _check_mp_policy(mp_policy) -> None:
    """Raises `errors.ShardingTypeError` unless `mp_policy` is a policy or None."""
    if mp_policy is not None and not isinstance(mp_policy, fs.MixedPrecisionPolicy):
        raise errors.ShardingTypeError(
            f"fs.flax: mp_policy must be an fs.MixedPrecisionPolicy or None, got "
            f"{mp_policy!r} of type {type(mp_policy).__name__}."
        )


# One class per (original class, options): graphdefs of equally marked models compare
# equal, so a jitted step is not retraced for every new model object.
_UNIT_CLASSES: dict[tuple[type, UnitOptions], type] = {}


def is_unit(node: Any) -> bool:
    """Whether `node` is an nnx module marked by `fully_shard`."""
    return isinstance(getattr(type(node), "_funshard_options", None), UnitOptions)


def _unit_class(cls: type, options: UnitOptions) -> type:
    key = (cls, options)
    if key not in _UNIT_CLASSES:
        namespace = {
            "__call__": _unit_call,
            "__module__": cls.__module__,
            "__qualname__": f"FSDP{cls.__qualname__}",
            "__doc__": cls.__doc__,
            "_funshard_options": options,
            "_funshard_base": cls,
        }
        # The subclass is a pytree exactly when `cls` is (nnx's `pytree=` class option).
        pytree = dict(pytree=cls._pytree__is_pytree) if hasattr(cls, "_pytree__is_pytree") else {}
        _UNIT_CLASSES[key] = type(f"FSDP{cls.__name__}", (cls,), namespace, **pytree)
    return _UNIT_CLASSES[key]


def fully_shard_module(module: nnx.Module, options: UnitOptions) -> nnx.Module:
    """Marks `module` in place as a unit (see `funshard.flax.fully_shard`)."""
    if is_unit(module):
        raise errors.ShardingValueError(marked_twice(base_class(type(module)).__name__))
    # nnx's __setattr__ would record `__class__` as a module attribute.
    object.__setattr__(module, "__class__", _unit_class(type(module), options))
    return module


def base_class(cls: type) -> type:
    """The class `fully_shard` made the unit class `cls` from (nnx or linen); `cls` itself
    if it is not a unit class."""
    return getattr(cls, "_funshard_base", cls)


def marked_twice(name: str, where: str = "") -> str:
    """The message for a module (nnx) or class (linen, `where`) marked a second time."""
    return (
        f"fs.flax.fully_shard: {name}{where} is already a unit (marked by an earlier "
        "fs.flax.fully_shard call). Mark each module once: its blocks first, then the "
        "model, as in FSDP2."
    )


def _module_path(path, root: str = "model") -> str:
    """An nnx graph path as attribute access from `root`: `model.blocks[0].fc`."""
    parts = [root]
    for key in path:
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(parts)


def _under(path: tuple, prefixes) -> bool:
    return any(path[: len(p)] == p for p in prefixes)


def _flat(state) -> dict:
    return dict(nnx.to_flat_state(state))


def _array_ids(variable) -> list[int]:
    # Identity of the traced arrays: a variable the call did not write keeps them.
    return [id(x) for x in jax.tree.leaves(variable.get_value())]


def _is_sharded(x) -> bool:
    return isinstance(x, fs.Sharded)


def _own_params(module) -> tuple:
    """(graphdef, this unit's sharded params, everything else) of `module`."""
    children = [p for p, node in nnx.iter_graph(module) if p and is_unit(node)]

    def own(path, variable):
        return (
            isinstance(variable, nnx.Param)
            and not _under(path, children)
            and _is_sharded(variable.get_value())
        )

    return nnx.split(module, own, ...)


def sliced_leaves(tree) -> list:
    """Key paths of the `Sharded` leaves of `tree` that a lifted transform sliced.

    `nnx.scan` / `nnx.vmap` / `nn.scan` over stacked parameters slice every array of a
    variable on its layer axis, `Sharded.data` too, while the leaf's static logical
    shape still describes the whole stack: its data then has fewer axes than its shape.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_sharded)[0]
    return [
        path for path, x in leaves if _is_sharded(x) and jax.tree.leaves(x)[0].ndim < len(x.shape)
    ]


def sliced_by_transform(unit: str, paths, how: str) -> str:
    """The error of a unit whose sharded parameters a lifted transform sliced per layer."""
    listing = ", ".join(jax.tree_util.keystr(tuple(p)) for p in paths[:3])
    more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    return (
        f"fs.flax.fully_shard: unit {unit} runs inside a lifted transform that slices its "
        f"parameters per layer ({how}), and its sharded parameters {listing}{more} arrive "
        "cut through their padded shards: funshard shards each parameter's dim 0, which "
        "here is the layer axis. Mark the module that runs the scan instead of the "
        "scanned one (its unit gathers the whole stack once, then the scan slices full "
        "arrays), or write the stack as a function of stacked parameters and run it with "
        "fs.scan over fs.shard(params, mesh, stacked=True), which gathers one layer at a "
        "time (docs/flax.md, 'Stacked layers')."
    )


def _unit_call(self, *args, **kwargs):
    """`__call__` of a marked module: the original `__call__` as one funshard unit."""
    cls = type(self)
    options, base = cls._funshard_options, cls._funshard_base
    graphdef, params, rest = _own_params(self)
    if not jax.tree.leaves(params, is_leaf=_is_sharded):
        # Full parameters (before fs.flax.shard), or a unit owning none: plain call.
        return base.__call__(self, *args, **kwargs)
    sliced = sliced_leaves(params)
    if sliced:
        raise errors.UnsupportedError(
            sliced_by_transform(base.__name__, sliced, "nnx.scan / nnx.vmap over stacked modules")
        )
    own_paths = set(_flat(params))
    dp_axes = _data_parallel.step_axes()

    def body(full, args, kwargs, rest):
        given = {p: _array_ids(v) for p, v in _flat(rest).items()}
        # Copies: the variables of `rest` may belong to an outer trace (extra args of
        # fs.value_and_grad), which nnx refuses to write; writes leave as outputs.
        module = nnx.merge(graphdef, full, rest, copy=True)
        if dp_axes is not None:
            _sync_batch_norms(module, dp_axes)
        out = base.__call__(module, *args, **kwargs)
        after = _flat(nnx.state(module, lambda p, v: p not in own_paths))
        # Written variables (RNG counts, batch statistics) leave the unit as outputs.
        changed = {p: v.get_value() for p, v in after.items() if _array_ids(v) != given[p]}
        return out, changed

    unit = fs.fully_shard(
        body,
        reshard_after_forward=options.resolved_reshard_after_forward(),
        name=base.__name__,
        all_gather=options.all_gather,
        reduce_scatter=options.reduce_scatter,
    )
    # The call's inputs come before the module's other state: the unit's gather waits
    # for its first array that varies over the devices, which should be the input.
    out, changed = unit(params, args, kwargs, rest)
    _write_back(self, base.__name__, changed)
    return out


def _sync_batch_norms(module, dp_axes) -> None:
    """BatchNorms of `module` (a copy made for this call) average over the data axes."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.BatchNorm):
            node.axis_name = _data_parallel.batch_axis_name(node.axis_name, dp_axes)


def _write_back(module, name: str, changed: dict) -> None:
    if not changed:
        return
    variables = _flat(nnx.state(module, lambda p, v: p in changed))
    stale = []
    for path, value in changed.items():
        try:
            variables[path].set_value(value)
        except flax_errors.TraceContextError:
            stale.append(path)
    if stale:
        raise errors.ShardingValueError(_mutated_outside_trace(name, stale))


def _mutated_outside_trace(name: str, paths) -> str:
    listing = ", ".join(_module_path(p, root=name) for p in paths)
    return (
        f"fs.flax: the unit {name} changed variables ({listing}) that belong to another "
        "JAX trace, so nnx cannot write them back. This happens when state passed to "
        "fs.value_and_grad as an extra argument is merged with nnx.merge(..., copy=False): "
        "merge with fs.flax.merge(graphdef, *states) (a copying nnx.merge) inside the loss."
    )


def _owner(path: tuple, units) -> tuple | None:
    owners = [u for u in units if path[: len(u)] == u]
    return max(owners, key=len) if owners else None


def _group_key(path, variable, units: dict, mp_policy):
    """Which `fs.shard` call a variable goes to: None (replicated) or its unit's policy."""
    owner = _owner(path, units) if isinstance(variable, nnx.Param) else None
    if owner is None:
        return None
    policy = units[owner].mp_policy
    return ("sharded", policy if policy is not None else mp_policy)


def unit_options(model: nnx.Module) -> dict:
    """{module path: its `UnitOptions`} of every unit of `model`.

    Raises:
      errors.ShardingValueError: (a ValueError) `model` has no unit.
    """
    units = {p: type(n)._funshard_options for p, n in nnx.iter_graph(model) if is_unit(n)}
    if not units:
        raise errors.ShardingValueError(_no_units(type(model).__name__))
    return units


def _no_units(name: str) -> str:
    return (
        f"fs.flax.shard: the model ({name}) has no unit marked by fs.flax.fully_shard, so "
        "nothing would gather its sharded parameters when it runs. Mark it first: "
        "`for blk in model.blocks: fs.flax.fully_shard(blk)`, then "
        "`fs.flax.fully_shard(model)`."
    )


def _check_batch_norms(model, units, mesh) -> None:
    """BatchNorms that compute statistics must run inside a unit (which syncs them),
    unless they average over axes of the mesh themselves."""
    outside = [
        path
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.BatchNorm)
        and node.use_running_average is not True
        and not _data_parallel.names_axes_of(node.axis_name, mesh)
        and _owner(path, units) is None
    ]
    if outside:
        raise errors.ShardingValueError(_batch_norm_outside_units(outside))


def _batch_norm_outside_units(paths) -> str:
    listing = ", ".join(_module_path(p) for p in paths)
    return (
        f"fs.flax.shard: {listing} (BatchNorm) is in no unit and its axis_name names no "
        "axis of the mesh, so inside fs.value_and_grad "
        "it would compute its statistics from each device's slice of the batch alone and "
        "every device would keep different running averages. Units average them over the "
        "data-parallel axes (SyncBatchNorm, equal to the unsharded model): mark a module "
        "above it, usually the model itself (`fs.flax.fully_shard(model)`), or give it "
        "`use_running_average=True` if it only evaluates."
    )


def _replicate(path, array):
    return fs.Replicate()


def shard(model: nnx.Module, mesh, *filters, mp_policy=None, shard_axis=None, model_spec=None):
    """See `funshard.flax.shard`."""
    if not isinstance(model, nnx.Module):
        raise errors.ShardingTypeError(_not_nnx_model(model))
    _check_mp_policy(mp_policy)
    _data_parallel.check_no_other_mesh("fs.flax.shard", mesh)
    units = unit_options(model)
    _check_batch_norms(model, units, mesh)
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    groups: dict = {}
    for path, variable in flat:
        groups.setdefault(_group_key(path, variable, units, mp_policy), []).append((path, variable))
    placed: dict = {}
    for key, items in groups.items():
        options = dict(placement=_replicate) if key is None else dict(mp_policy=key[1])
        if shard_axis is not None:
            options["shard_axis"] = shard_axis
        if model_spec is not None and key is not None:
            options["model_spec"] = model_spec
        placed.update(nnx.to_flat_state(fs.shard(nnx.from_flat_state(items), mesh, **options)))
    # The model's own order, whatever the grouping: it is the pytree order of the state.
    state = nnx.from_flat_state([(path, placed[path]) for path, _ in flat])
    if filters:
        return (graphdef, *nnx.split_state(state, *filters))
    return graphdef, state


def _not_nnx_model(model: Any) -> str:
    return (
        f"fs.flax.shard: expected an nnx.Module, got {type(model).__name__}. For a linen "
        "model, shard the variables of `model.init(...)` with fs.shard (see docs/flax.md)."
    )


def merge(graphdef, *states):
    """See `funshard.flax.merge`."""
    return nnx.merge(graphdef, *states, copy=True)


def trainable(state, wrt=nnx.Param):
    """See `funshard.flax.trainable`."""
    predicate = nnx.filterlib.to_predicate(wrt)
    flat = [(path, predicate(path, v)) for path, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _add(value, update):
    # As optax.apply_updates: the sum in the parameter's own dtype (Sharded: its data).
    return jax.tree.map(lambda p, u: (p + u).astype(p.dtype), value, update)


def apply_updates(state, updates, written=None, wrt=nnx.Param):
    """See `funshard.flax.apply_updates`."""
    predicate = nnx.filterlib.to_predicate(wrt)
    new = dict(nnx.to_flat_state(written)) if written is not None else {}
    flat = list(nnx.to_flat_state(state))
    unknown = set(new) - {path for path, _ in flat}
    if unknown:
        raise errors.ShardingValueError(
            _unknown_written(sorted(_module_path(p, root="state") for p in unknown))
        )
    updated = dict(nnx.to_flat_state(updates))
    out = []
    for path, variable in flat:
        if predicate(path, variable):
            value = _add(variable.get_value(), updated[path].get_value())
            variable = variable.replace(value)
        elif path in new:
            variable = variable.replace(new[path].get_value())
        out.append((path, variable))
    return nnx.from_flat_state(out)


def _unknown_written(paths) -> str:
    return (
        f"fs.flax.apply_updates: `written` has variables the state does not hold: "
        f"{', '.join(paths)}. Pass what the loss returned as "
        "`nnx.state(model, nnx.Not(nnx.Param))` for the same model."
    )
