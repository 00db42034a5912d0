"""Which leaves of a tree checkpoints and state dicts store.

A `Sharded` node of the parameters holds one array in its padded layout. A `Sharded`
node of an optimizer state need not: optax maps its `init` over each node's `.data`, so
the node holds whatever the transform made of the parameter, such as `optax.MaskedNode`
(muon, `optax.masked`, `optax.multi_transform`: no array at all) or adafactor's row and
column statistics (vectors). Such a node is opened: its arrays are stored as plain arrays
under `<path>.data`, and the node is rebuilt around them (or around nothing) on load.
"""

from __future__ import annotations

from typing import Any

from jax.tree_util import tree_flatten_with_path

from funshard.core import Sharded


def is_layout_node(x: Any) -> bool:
    """Whether `x` is a `Sharded` node holding one (global) array of its padded shape."""
    shape = getattr(getattr(x, "data", None), "shape", None) if isinstance(x, Sharded) else None
    return shape is not None and tuple(shape) == x.padded_shape


def stored_leaves(tree: Any) -> tuple[list, list, Any]:
    """Flattens `tree` keeping whole only the `Sharded` nodes in their layout.

    Returns:
      `(paths, items, treedef)`, as `funshard.core.sharded_leaves`, except that a
      `Sharded` node holding anything but one array of its padded shape is flattened
      into that content's leaves.
    """
    with_path, treedef = tree_flatten_with_path(tree, is_leaf=is_layout_node)
    return [p for p, _ in with_path], [x for _, x in with_path], treedef
