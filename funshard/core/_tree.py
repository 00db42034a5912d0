"""Pytree helpers shared by the root, the units and the public transforms.

`sharded_leaves` flattens a tree keeping `Sharded` nodes whole; `partition` /
`Partition.combine` (equinox's partition/combine idea) select some of those leaves,
compute new values for them and put them back, which is how every transform here
rebuilds a tree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.tree_util import tree_flatten_with_path, tree_unflatten

from funshard import _text, errors
from funshard.comm import is_inexact_array as is_inexact_array
from funshard.core._sharded import Sharded, is_array, is_sharded


def sharded_leaves(tree: Any) -> tuple[list, list, Any]:
    """Flattens `tree` keeping `Sharded` nodes whole: (paths, items, treedef)."""
    with_path, treedef = tree_flatten_with_path(tree, is_leaf=is_sharded)
    return [p for p, _ in with_path], [x for _, x in with_path], treedef


def _mixed_meshes(fn: str, first, other) -> str:
    return (
        f"{_text.where(fn, other[0])} lives on mesh {other[1]} but {_text.leaf_name(first[0])} "
        f"lives on mesh {first[1]}; states sharded on different meshes cannot be mixed in "
        "one call. Shard every tree with the same mesh (fs.shard(params, mesh))."
    )


def common_mesh(fn: str, paths, items) -> Mesh | None:
    """The one mesh all `Sharded` items live on (ValueError if they disagree)."""
    first = None
    for path, x in zip(paths, items, strict=True):
        if not isinstance(x, Sharded):
            continue
        if first is None:
            first = (path, x.mesh)
        elif x.mesh != first[1]:
            raise errors.ShardingValueError(_mixed_meshes(fn, first, (path, x.mesh)))
    return None if first is None else first[1]


def _non_numeric_leaves(fn: str, what: str, bad) -> str:
    listing = "\n".join(f"  {_text.leaf_name(p)}: {kind}" for p, kind in bad)
    return (
        f"{fn}: the {what} {'have' if what.endswith('s') else 'has'} leaves that are not "
        f"arrays or numbers:\n{listing}\nAn "
        "optax optimizer makes a moment of every leaf of the state and cannot for these. "
        "Keep them out of the state: pass them to the step as an extra argument, or "
        "close over them."
    )


def check_numeric_leaves(fn: str, tree: Any, what: str = "state") -> None:
    """Refuses strings and other objects in a tree an optimizer is about to map over.

    They pass through `fs.shard` and the step unchanged, but optax makes a moment of
    every leaf and fails deep inside (`data type 'mlp' not understood`, or `'str' object
    has no attribute 'shape'`), naming neither the leaf nor the fix.

    Raises:
      TypeError: a leaf of `tree` is neither an array, a `Sharded` leaf nor a Python
        number (`ShardingTypeError`, listing each such leaf by key path).
    """
    paths, items, _ = sharded_leaves(tree)
    bad = [
        (p, type(x).__name__)
        for p, x in zip(paths, items, strict=True)
        if not (isinstance(x, (Sharded, bool, int, float, complex)) or hasattr(x, "dtype"))
    ]
    if bad:
        raise errors.ShardingTypeError(_non_numeric_leaves(fn, what, bad))


@dataclasses.dataclass(frozen=True)
class Partition:
    """A flattened tree with some positions selected (`partition`)."""

    items: tuple
    treedef: Any
    positions: tuple[int, ...]

    @property
    def selected(self) -> list:
        """The selected items, in tree order."""
        return [self.items[i] for i in self.positions]

    @property
    def others(self) -> list:
        """Every item, with None in the selected positions."""
        chosen = set(self.positions)
        return [None if i in chosen else x for i, x in enumerate(self.items)]

    def combine(self, values, others: list | None = None) -> Any:
        """The tree again, with `values` in the selected positions (and `others`, if
        given, in the rest)."""
        out = list(self.items if others is None else others)
        for i, v in zip(self.positions, values, strict=True):
            out[i] = v
        return tree_unflatten(self.treedef, out)


def partition(tree: Any, select: Callable[[Any], bool] = is_sharded) -> Partition:
    """`tree` flattened (`Sharded` nodes whole) with the items `select` picks marked."""
    _, items, treedef = sharded_leaves(tree)
    positions = tuple(i for i, x in enumerate(items) if select(x))
    return Partition(tuple(items), treedef, positions)


def split_arrays(tree: Any) -> tuple[list, Callable[[list], Any]]:
    """The array leaves of `tree`, and a function putting new values in their place.

    Transforms such as `jax.custom_vjp` and `jax.shard_map` take arrays only; the other
    leaves (strings, Python numbers, ...) are static and come back unchanged.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    parts = Partition(tuple(leaves), treedef, tuple(i for i, x in enumerate(leaves) if is_array(x)))
    return parts.selected, parts.combine
