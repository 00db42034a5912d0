"""Every error message of `funshard.flax`, built in one place (as `funshard._errors`)."""

from __future__ import annotations

from typing import Any, Sequence


def module_path(path: Sequence[Any], root: str = "model") -> str:
    """An nnx graph path as attribute access from `root`: `model.blocks[0].fc`."""
    parts = [root]
    for key in path:
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(parts)


def not_a_module(target: Any) -> str:
    return (
        f"fs.flax.fully_shard: expected an nnx.Module instance or a flax.linen.Module "
        f"subclass, got {target!r} of type {type(target).__name__}. Pass the module "
        "object itself (nnx: `fs.flax.fully_shard(block)`), or the linen class "
        "(`Block = fs.flax.fully_shard(Block)`)."
    )


def linen_instance(target: Any) -> str:
    name = type(target).__name__
    return (
        f"fs.flax.fully_shard: got an instance of the linen module {name}; linen units are "
        f"marked on the class. Write `FSDP{name} = fs.flax.fully_shard({name})` and build "
        f"the model from FSDP{name}(...)."
    )


def marked_twice(name: str, where: str = "") -> str:
    return (
        f"fs.flax.fully_shard: {name}{where} is already a unit (marked by an earlier "
        "fs.flax.fully_shard call). Mark each module once: its blocks first, then the "
        "model, as in FSDP2."
    )


def bad_reshard_after_forward(value: Any) -> str:
    return (
        f"fs.flax.fully_shard: reshard_after_forward must be None, True, False or a "
        f"positive int (hpZ group size), got {value!r}."
    )


def bad_mp_policy(value: Any) -> str:
    return (
        f"fs.flax: mp_policy must be an fs.MixedPrecisionPolicy or None, got {value!r} "
        f"of type {type(value).__name__}."
    )


def no_units(name: str) -> str:
    return (
        f"fs.flax.shard: the model ({name}) has no unit marked by fs.flax.fully_shard, so "
        "nothing would gather its sharded parameters when it runs. Mark it first: "
        "`for blk in model.blocks: fs.flax.fully_shard(blk)`, then "
        "`fs.flax.fully_shard(model)`."
    )


def not_nnx_model(model: Any) -> str:
    return (
        f"fs.flax.shard: expected an nnx.Module, got {type(model).__name__}. For a linen "
        "model, shard the variables of `model.init(...)` with fs.shard (see docs/flax.md)."
    )


def mutated_outside_trace(name: str, paths: Sequence[Sequence[Any]]) -> str:
    listing = ", ".join(module_path(p, root=name) for p in paths)
    return (
        f"fs.flax: the unit {name} changed variables ({listing}) that belong to another "
        "JAX trace, so nnx cannot write them back. This happens when state passed to "
        "fs.value_and_grad as an extra argument is merged with nnx.merge(..., copy=False): "
        "merge with fs.flax.merge(graphdef, *states) (a copying nnx.merge) inside the loss."
    )


def linen_unit_arguments(name: str) -> str:
    return (
        f"fs.flax.fully_shard({name}): a linen unit's parameters live in the 'params' "
        "collection; it found none sharded. Initialise the model with model.init(...) and "
        "shard its variables with fs.shard before applying it inside fs.value_and_grad."
    )


def other_mesh_set(fn: str, context, mesh) -> str:
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


def batch_norm_outside_units(paths: Sequence[Sequence[Any]]) -> str:
    listing = ", ".join(module_path(p) for p in paths)
    return (
        f"fs.flax.shard: {listing} (BatchNorm) is in no unit and its axis_name names no "
        "axis of the mesh, so inside fs.value_and_grad "
        "it would compute its statistics from each device's slice of the batch alone and "
        "every device would keep different running averages. Units average them over the "
        "data-parallel axes (SyncBatchNorm, equal to the unsharded model): mark a module "
        "above it, usually the model itself (`fs.flax.fully_shard(model)`), or give it "
        "`use_running_average=True` if it only evaluates."
    )


def unknown_written(paths: Sequence[str]) -> str:
    return (
        f"fs.flax.apply_updates: `written` has variables the state does not hold: "
        f"{', '.join(paths)}. Pass what the loss returned as "
        "`nnx.state(model, nnx.Not(nnx.Param))` for the same model."
    )


def plan_not_a_model(model: Any) -> str:
    return (
        f"fs.flax.plan: expected an nnx.Module marked with fs.flax.fully_shard, or a "
        f"flax.linen.Module instance, got {type(model).__name__}. For a plain parameter "
        "tree use fs.plan."
    )


def plan_linen_needs_inputs(name: str) -> str:
    return (
        f"fs.flax.plan: {name} is a linen module; pass its variables (or the 'params' "
        "collection) and the arguments of one call, as for model.init: "
        "`fs.flax.plan(model, mesh, variables=variables, args=(x,))`."
    )


def plan_no_mesh(name: str) -> str:
    return (
        f"fs.flax.plan: pass the mesh {name} will be sharded on "
        "(`fs.flax.plan(model, fs.make_mesh(), ...)`); only a linen state already sharded "
        "with fs.shard carries its own."
    )


def plan_no_units(name: str) -> str:
    return (
        f"fs.flax.plan: no unit of {name} was called (no class marked with "
        "fs.flax.fully_shard among the modules applied). Mark the blocks' class and the "
        "model's: `Block = fs.flax.fully_shard(Block)`."
    )


def plan_option_from_model(names: Sequence[str]) -> str:
    return (
        f"fs.flax.plan: {', '.join(names)} come from the model (its marked modules and "
        "the options given to fs.flax.fully_shard); mark the modules instead, or plan a "
        "hand-written unit map with fs.plan."
    )
