"""`init_optimizer`: optax state placed on the state's mesh, so a jitted step compiles once.

`opt.init(state)` already shards every moment like its parameter (optax maps over the
`Sharded` leaves' `.data`), but it creates scalar state, such as Adam's step count, on
the default device. A jitted step returns that scalar replicated on the mesh, so the
step's second call would compile a second program, and a checkpoint restored into such
a tree would mix devices. Placing every array outside a `Sharded` leaf replicated on the
state's mesh up front avoids both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from funshard import comm, errors
from funshard.core import _padding_probe, _tree
from funshard.core._shard_optimizer import LeafStatistics, is_shard_optimizer
from funshard.core._sharded import Sharded


def sharding_on(mesh: Mesh, x: Any) -> NamedSharding:
    """Where a non-`Sharded` array `x` of a state on `mesh` belongs.

    Keeps a sharding `x` already has on `mesh` (a placement the user chose); anything
    else (one device, another mesh, no sharding at all) becomes replicated on `mesh`.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return NamedSharding(mesh, PartitionSpec())


def _node_sharding(leaf: comm.LayoutFacts, x: Any) -> NamedSharding:
    """Where one array of an optimizer state's `Sharded` node lives.

    A moment shaped like the padded parameter is laid out like it. Another array that
    spans the padded sharded dimension (adafactor's per-row statistics of an even leaf)
    is split along it, as XLA lays out a jitted update's output: placed otherwise, the
    step's second call would compile again. Anything else is replicated.
    """
    shape = tuple(x.shape)
    if shape == leaf.padded_shape:
        return leaf.sharding
    dim = leaf.dim
    if dim < len(shape) and shape[dim] == leaf.padded_shape[dim]:
        return NamedSharding(leaf.mesh, comm.spec(leaf.shard_axis, dim))
    return NamedSharding(leaf.mesh, PartitionSpec())


def _place_in_node(leaf: comm.LayoutFacts, x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        # An abstract state array says where it will live, as a concrete one does.
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=_node_sharding(leaf, x), weak_type=x.weak_type
        )
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        sharding = _node_sharding(leaf, x)
        return x if x.sharding == sharding else jax.device_put(x, sharding)
    return x


def _place(mesh: Mesh, x: Any) -> Any:
    if isinstance(x, Sharded):
        data = jax.tree.map(lambda a: _place_in_node(x, a), x.data)
        return dataclasses.replace(x, data=data)
    if isinstance(x, LeafStatistics):
        return LeafStatistics(jax.tree.map(lambda a: _place_in_node(x.layout, a), x.data), x.layout)
    if isinstance(x, jax.core.Tracer):
        return x  # under a trace, the enclosing jit decides where its outputs go
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=sharding_on(mesh, x), weak_type=x.weak_type
        )
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding_on(mesh, x))
    return x


def _is_abstract(tree: Any) -> bool:
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def _no_state_mesh(fn: str) -> str:
    return (
        f"{fn}: the state has no fs.Sharded leaves, so there is no mesh to place the "
        "optimizer state on. Pass the state returned by fs.shard(params, mesh)."
    )


_WRAP = (
    "Wrap the optimizer: opt = fs.shard_optimizer(opt), then fs.init_optimizer(opt, state) "
    "and opt.update(grads, opt_state, state) as before (it runs the optimizer on each uneven "
    "leaf's logical array, at the cost of gathering that leaf), or give these leaves sizes "
    "the shard count divides."
)


def _listing(lines) -> str:
    return "\n".join(f"  {line}" for line in lines)


def _update_sees_padding(leaves) -> str:
    return (
        "init_optimizer: the optimizer's update of these uneven leaves depends on their zero "
        "padding rows (it reads their padded shape or reduces over their rows, as "
        "optax.adafactor and optax.contrib.muon do on matrices), so opt.update on the "
        "sharded state would not give optax's numbers on the unsharded parameters:\n"
        f"{_listing(leaves)}\n{_WRAP}"
    )


def _state_sees_padding(paths) -> str:
    return (
        "init_optimizer: the optimizer state at these paths depends on the zero padding rows "
        "of an uneven leaf (its shape or values differ from optax's on the unsharded "
        f"parameters):\n{_listing(paths)}\n{_WRAP}"
    )


def _undecided(leaves, reason: str) -> str:
    return (
        "init_optimizer: could not tell whether the optimizer's update of these uneven "
        f"leaves depends on their zero padding rows: {reason}:\n{_listing(leaves)}\nAn "
        f"optimizer the probe cannot judge is refused rather than trusted. {_WRAP}"
    )


def _check_padding(opt: Any, state: Any) -> None:
    """Refuses `opt` if its plain update on `state` depends, or may depend, on padding rows.

    The fix is said once, after the list of leaves; a differing state is reported only
    when no update differs (it usually follows from the update).
    """
    verdict = _padding_probe.padding_dependence(opt, state)
    if verdict.updates:
        raise errors.ShardingValueError(_update_sees_padding(verdict.updates))
    if verdict.states:
        raise errors.ShardingValueError(_state_sees_padding(verdict.states))
    if verdict.undecided:
        raise errors.ShardingValueError(_undecided(verdict.undecided, verdict.reason))


def init_optimizer(opt: Any, state: Any) -> Any:
    """Initialises an optax optimizer for a sharded state, every array on its mesh.

    Equivalent to `opt.init(state)`, except that every array outside a `Sharded` leaf
    (such as Adam's step count) is placed replicated on the state's mesh instead of on
    the default device, so a jitted training step compiles once for the initial state
    and for the state it returns. Moments shaped like the parameters stay `Sharded`.

    Args:
      opt: an optax `GradientTransformation` (anything with an `init(params)` method).
      state: the sharded state, `fs.shard(params, mesh)`, or its abstract form (leaves
        `jax.ShapeDtypeStruct`, as from `jax.eval_shape`), which gives the abstract
        optimizer state (for example as the `like` of `fs.restore`).

    Returns:
      `opt.init(state)` (or its abstract form) with every non-`Sharded` array
      replicated on the state's mesh; arrays already on that mesh keep their sharding.

    Raises:
      TypeError: a leaf of `state` is a string or another object that is neither an
        array nor a number (optax would fail on it deep inside).
      ValueError: `state` has no `Sharded` leaves (so no mesh), or they live on
        different meshes; or `opt`, run on the padded array of a leaf the shard count
        does not divide, would update its real rows differently from optax on the
        logical array (adafactor, muon: wrap them with `fs.shard_optimizer`). A probe
        on single-device host copies of the uneven leaves decides this once per
        transform and layout (see docs/concepts.md, "Optimizers and padding").
    """
    paths, items, _ = _tree.sharded_leaves(state)
    mesh = _tree.common_mesh("init_optimizer", paths, items)
    if mesh is None:
        raise errors.ShardingValueError(_no_state_mesh("init_optimizer"))
    _tree.check_numeric_leaves("init_optimizer", state)
    if not is_shard_optimizer(opt):
        _check_padding(opt, state)
    opt_state = jax.eval_shape(opt.init, state) if _is_abstract(state) else opt.init(state)
    return jax.tree.map(
        lambda x: _place(mesh, x),
        opt_state,
        is_leaf=lambda x: isinstance(x, (Sharded, LeafStatistics)),
    )
