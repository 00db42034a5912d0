"""`shard_optimizer`: any optax transform on a sharded state, with optax's numbers.

optax maps over each `Sharded` leaf's `.data`, the padded global array. A transform that
works element by element (SGD, Adam, AdamW, Lion) leaves the zero padding rows zero and
computes the real rows exactly as on the unsharded parameters. A transform that looks at
a whole matrix (adafactor's row and column means, muon's orthogonalisation and its
shape-dependent scale) sees the padding rows and the padded shape instead, and its numbers
drift from optax's on the unsharded parameters.

`shard_optimizer(opt)` runs `opt` on each uneven leaf's logical array: the leaf's update,
parameter and parameter-shaped optimizer state are gathered (replicated on the mesh), cut
to the logical shape, updated, then padded again and put back in the sharded layout.
Leaves the shard count divides pass through untouched, so a tree of even leaves compiles
to plain optax's program. docs/concepts.md ("Optimizers and padding") states the costs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from funshard import comm
from funshard.core import _tree
from funshard.core._sharded import Sharded, is_sharded

if TYPE_CHECKING:  # optax is imported where it is used: `import funshard` does not load it
    import optax

# Set while `init_optimizer`'s probe runs a transform on single-device host copies: there
# a wrapped transform inside it cuts and pads but places nothing on the mesh.
_PROBING: contextvars.ContextVar[bool] = contextvars.ContextVar("funshard_probing", default=False)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Within this context `shard_optimizer`'s transforms leave arrays where they are."""
    token = _PROBING.set(True)
    try:
        yield
    finally:
        _PROBING.reset(token)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LeafStatistics:
    """Optimizer state of one sharded parameter that is not shaped like the parameter.

    optax maps its `init` over each `Sharded` leaf's `.data`, so an array it derives
    from a parameter lands inside that parameter's `Sharded` node even when it is not a
    moment of the parameter's shape: adafactor's row and column statistics are vectors.
    A `Sharded` node whose `data` is not its padded layout is no leaf funshard can gather,
    save or restore; `shard_optimizer` keeps such arrays in this node instead, with the
    parameter's layout as static metadata, and hands them back to the transform as the
    `Sharded` node it built.

    Attributes:
      data: the array (or subtree of arrays), replicated on the mesh, or split along the
        sharded dimension when it spans the parameter's padded rows.
      layout: the parameter's `funshard.comm.Layout`.
    """

    data: Any
    layout: comm.Layout = dataclasses.field(metadata=dict(static=True))

    def __repr__(self) -> str:
        return f"LeafStatistics(param_shape={self.layout.shape}, data={self.data!r})"


def _is_node(x: Any) -> bool:
    return isinstance(x, (Sharded, LeafStatistics))


def _in_layout(x: Sharded) -> bool:
    """Whether every array of the node is a (padded) moment of its parameter."""
    return all(tuple(getattr(a, "shape", ())) == x.padded_shape for a in jax.tree.leaves(x.data))


def state_out(state: Any) -> Any:
    """The transform's state as stored: odd-shaped arrays moved out of `Sharded` nodes."""

    def node(x):
        if isinstance(x, Sharded) and not _in_layout(x):
            return LeafStatistics(x.data, x.layout)
        return x

    return jax.tree.map(node, state, is_leaf=is_sharded)


def state_in(state: Any) -> Any:
    """The stored state as the transform built it (the inverse of `state_out`)."""

    def node(x):
        return Sharded.from_layout(x.layout, x.data) if isinstance(x, LeafStatistics) else x

    return jax.tree.map(node, state, is_leaf=_is_node)


def is_uneven(x: Any) -> bool:
    """Whether `x` is a `Sharded` leaf whose sharded dimension carries padding."""
    return isinstance(x, Sharded) and x.padded_shape != tuple(x.shape)


def _has_uneven(tree: Any) -> bool:
    return any(is_uneven(x) for x in jax.tree.leaves(tree, is_leaf=is_sharded))


def _constrain(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    # `with_sharding_constraint` places a concrete array too (an eager init), and under
    # jit it is the annotation that makes the partitioner gather or slice right here.
    if _PROBING.get():
        return x
    return comm.constrain(x, sharding)


def _replicated(leaf: Sharded) -> NamedSharding:
    return NamedSharding(leaf.mesh, PartitionSpec())


def _cut(leaf: Sharded, x: Any) -> Any:
    """One array under `leaf`: padded-shaped ones gathered and cut to the logical shape."""
    if getattr(x, "shape", None) is None or tuple(x.shape) != leaf.padded_shape:
        return x
    full = _constrain(x, _replicated(leaf))  # the all-gather of this array
    return comm.from_padded(full, leaf)  # each model block's padding cut off


def _pad(leaf: Sharded, x: Any) -> Any:
    """One array under `leaf` after the update: logical-shaped ones padded and resharded.

    Arrays of other shapes (adafactor's row and column statistics, placeholders) were
    computed from gathered inputs and stay replicated on the mesh.
    """
    if getattr(x, "shape", None) is None:
        return x
    if tuple(x.shape) != tuple(leaf.shape):
        return _constrain(x, _replicated(leaf))
    # Every device keeps only its own block: a local slice of a replicated value.
    return _constrain(comm.to_padded(x, leaf), leaf.sharding)


def _map_uneven(fn, tree: Any) -> Any:
    """`tree` with `fn(leaf, array)` applied to every array under its uneven `Sharded` nodes.

    A `Sharded` node in an optimizer state may hold a subtree (a masked transform's
    `MaskedNode`, a factored state's pieces) rather than one array; each array of it is
    mapped with the node's layout.
    """

    def node(x):
        if not is_uneven(x):
            return x
        return dataclasses.replace(x, data=jax.tree.map(lambda a: fn(x, a), x.data))

    return jax.tree.map(node, tree, is_leaf=is_sharded)


def to_logical(tree: Any) -> Any:
    """`tree` with every uneven `Sharded` node holding its gathered, unpadded array(s)."""
    return _map_uneven(_cut, tree)


def to_padded(tree: Any) -> Any:
    """The inverse of `to_logical`: logical arrays padded and back in the sharded layout."""
    return _map_uneven(_pad, tree)


def _logical_args(extra_args: dict[str, Any]) -> dict[str, Any]:
    """Extra arguments of `update` as the transform on logical arrays needs them.

    Trees shaped like the parameters (L-BFGS's `grad=`) are cut like the updates;
    functions of the parameters (its `value_fn=`, which the line search calls at trial
    points) get them back in the sharded layout, the form the caller wrote them for.
    """

    def arg(value):
        if callable(value):
            return lambda params, *args, **kwargs: value(to_padded(params), *args, **kwargs)
        return to_logical(value)

    return {name: arg(value) for name, value in extra_args.items()}


def shard_optimizer(opt: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax transform so that it sees every parameter's logical (unpadded) shape.

    On a sharded state optax computes on each leaf's padded array. For element-wise
    transforms (SGD, Adam, AdamW, Lion) that changes nothing; transforms that look at a
    whole matrix (`optax.adafactor`, `optax.contrib.muon`, anything normalising by a row
    or column count) see the padding rows of leaves the shard count does not divide, and
    `fs.init_optimizer` refuses them on such leaves. The wrapped transform gives plain
    optax's numbers on every leaf; use it in place of the transform:

        opt = fs.shard_optimizer(optax.adafactor(1e-3))
        opt_state = fs.init_optimizer(opt, state)
        updates, opt_state = opt.update(grads, opt_state, state)

    For each uneven leaf, its update, its parameter and each optimizer-state array shaped
    like it are all-gathered (replicated on the mesh), cut to the logical shape, and the
    transform runs on the full leaf on every device; its outputs are padded with zero rows
    and each device keeps its own block (a local slice, no collective). Cost per uneven
    leaf and step: one all-gather of the update, of the parameter if the transform reads
    it, and of each parameter-shaped state array (Adam's two moments), plus that many
    full-leaf temporaries. Leaves the shard count divides pass through untouched: for a
    state of even leaves the compiled update is plain optax's.

    Optimizer state shaped like its parameter stays padded and sharded like it (so
    checkpoints and memory stay sharded). State of other shapes derived from a parameter
    (adafactor's row and column statistics) is held in a `LeafStatistics` node, so that
    `fs.save`, `fs.restore` and `fs.state_dict` treat it as plain arrays: replicated on
    the mesh for an uneven leaf; for an even leaf where a jitted update puts it.

    Args:
      opt: any optax `GradientTransformation`. Extra arguments of its `update` are
        passed on: scalars (`value=` of `optax.contrib.reduce_on_plateau`) as they are,
        trees shaped like the parameters (`grad=` of `optax.lbfgs`) cut to the logical
        shapes like the updates, and functions (`value_fn=`) called with the parameters
        in the sharded layout, as the caller's own loss takes them.

    Returns:
      A `GradientTransformationExtraArgs` whose `init` and `update` take and return the
      sharded state, updates and optimizer state in funshard's padded layout.
    """
    import optax

    inner = optax.with_extra_args_support(opt)

    # Moving arrays between `Sharded` and `LeafStatistics` nodes changes the pytree, not
    # the program: for even leaves the compiled update stays plain optax's.
    def init(params):
        _tree.check_numeric_leaves("shard_optimizer(...).init", params)
        if not _has_uneven(params):
            return state_out(inner.init(params))
        return state_out(to_padded(inner.init(to_logical(params))))

    def update(updates, state, params=None, **extra_args):
        _tree.check_numeric_leaves("shard_optimizer(...).update", updates, "updates")
        _tree.check_numeric_leaves("shard_optimizer(...).update", params)
        state = state_in(state)
        if not (_has_uneven(updates) or _has_uneven(params)):
            new_updates, new_state = inner.update(updates, state, params, **extra_args)
            return new_updates, state_out(new_state)
        new_updates, new_state = inner.update(
            to_logical(updates), to_logical(state), to_logical(params), **_logical_args(extra_args)
        )
        return to_padded(new_updates), state_out(to_padded(new_state))

    # `init_optimizer` skips its padding probe for this transform (and only this one:
    # a chain around it is probed, and passes, since this part computes logically).
    vars(init)["funshard_logical_shapes"] = True  # a function attribute, unknown to mypy
    return optax.GradientTransformationExtraArgs(init, update)


def is_shard_optimizer(opt: Any) -> bool:
    """Whether `opt` is a transform `shard_optimizer` returned."""
    return getattr(getattr(opt, "init", None), "funshard_logical_shapes", False)
