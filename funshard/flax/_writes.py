"""State a unit writes (RNG counts, batch statistics), carried out of the unit.

A unit's floating outputs cross a fusion boundary typed as varying over the step's
data-parallel axes, so a written value that is already equal on every device (e.g.
batch statistics synced with `axis_name`) is made varying inside the unit and recovered
exactly with `pmax` after it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import funshard as fs


def _varying(x) -> frozenset:
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return kind.varying if kind is not None else frozenset()


def step_axes(sharded: Any) -> tuple[str, ...]:
    """The data-parallel axes when `sharded`'s leaves are a step's local blocks, else ()."""
    leaf = jax.tree.leaves(sharded, is_leaf=lambda x: isinstance(x, fs.Sharded))[0]
    if not _varying(leaf.data):
        return ()
    return (*leaf.replicate_axis, *leaf.shard_axis)


def widen(tree: Any, axes: tuple[str, ...]) -> tuple[Any, list]:
    """`tree` with each floating leaf varying over `axes`, and the axes each one gained."""
    leaves, treedef = jax.tree.flatten(tree)
    gained = []
    for i, x in enumerate(leaves):
        floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
        missing = tuple(a for a in axes if a not in _varying(x)) if floating else ()
        gained.append(missing)
        if missing:
            leaves[i] = jax.lax.pcast(x, missing, to="varying")
    return jax.tree.unflatten(treedef, leaves), gained


def narrow(tree: Any, gained: list) -> Any:
    """The inverse of `widen` for values equal on every device (no gradient flows)."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [
        jax.lax.pmax(jax.lax.stop_gradient(x), axes) if axes else x
        for x, axes in zip(leaves, gained, strict=True)
    ]
    return jax.tree.unflatten(treedef, leaves)
