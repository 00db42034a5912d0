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

from funshard import errors
from funshard.core import _tree
from funshard.core._sharded import Sharded, is_sharded


def sharding_on(mesh: Mesh, x: Any) -> NamedSharding:
    """Where a non-`Sharded` array `x` of a state on `mesh` belongs.

    Keeps a sharding `x` already has on `mesh` (a placement the user chose); anything
    else (one device, another mesh, no sharding at all) becomes replicated on `mesh`.
    """
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding
    return NamedSharding(mesh, PartitionSpec())


def _place(mesh: Mesh, x: Any) -> Any:
    if isinstance(x, Sharded):
        if isinstance(x.data, jax.ShapeDtypeStruct):
            # An abstract moment says where it will live, as a concrete one does.
            data = jax.ShapeDtypeStruct(x.data.shape, x.data.dtype, sharding=x.sharding)
            return dataclasses.replace(x, data=data)
        return x  # a concrete moment is laid out like its parameter already
    if isinstance(x, jax.core.Tracer):
        return x  # under a trace, the enclosing jit decides where its outputs go
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_on(mesh, x),
                                    weak_type=x.weak_type)
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
      ValueError: `state` has no `Sharded` leaves (so no mesh), or they live on
        different meshes.
    """
    paths, items, _ = _tree.sharded_leaves(state)
    mesh = _tree.common_mesh("init_optimizer", paths, items)
    if mesh is None:
        raise errors.ShardingValueError(_no_state_mesh("init_optimizer"))
    opt_state = jax.eval_shape(opt.init, state) if _is_abstract(state) else opt.init(state)
    return jax.tree.map(lambda x: _place(mesh, x), opt_state, is_leaf=is_sharded)
