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
