"""Pytree helpers shared by the root and the units."""

from __future__ import annotations

from typing import Any, Callable

import jax

from funshard._sharded import is_array


def split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """The array leaves of `tree`, and a function putting new values in their place.

    Transforms such as `jax.custom_vjp` and `jax.shard_map` take arrays only; the other
    leaves (strings, Python numbers, ...) are static and come back unchanged.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    positions = [i for i, x in enumerate(leaves) if is_array(x)]

    def rebuild(values: list) -> Any:
        out = list(leaves)
        for i, v in zip(positions, values, strict=True):
            out[i] = v
        return jax.tree_util.tree_unflatten(treedef, out)

    return [leaves[i] for i in positions], rebuild
