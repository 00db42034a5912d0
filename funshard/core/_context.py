"""The running step: its mesh, its data-parallel axes, what each sharded leaf is in it,
and the gather of those leaves.

Per-leaf facts (frozen, where a deferred gradient goes) travel on the `StepLeaf` the
root hands to the loss function, as static metadata or pytree children, never keyed by
the identity of a traced value nor read from context: `jax.checkpoint`, `vmap`,
`lax.cond` and `lax.scan` re-trace the loss and make new tracers (and
`jax.checkpoint` caches its trace per function), but a pytree's children and static
metadata travel through every transform.

The comm layer (`funshard.comm`) gathers and reduces arrays described by a
`GroupLayout`; `layout_of` reads what the step says of each leaf (frozen, deferred, its
HSDP reduction) and builds that layout, so that the comm layer never reads the step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from funshard import _jax_compat, _py_compat, comm, errors
from funshard.core import _policy, _record
from funshard.core._sharded import Sharded, is_concrete


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLeaf(Sharded):
    """A `Sharded` leaf as the loss function sees it inside a step.

    `data` is this device's local block. The extra fields tell `unshard` and the units
    how the step treats the leaf.

    Attributes:
      frozen: gathered for the forward pass, but its gradient is not wanted (no
        reduce-scatter at all). Static.
      accumulator: for gradient accumulation without per-microbatch sync, the
        full-size zero array whose gradient receives this leaf's unreduced cotangent;
        else None. A pytree child, not context: a function the user wraps in
        `jax.checkpoint` receives it as an input with the leaf, whereas a value read
        from context would be baked into the transform's cached trace.
      skip_replicate_reduce: reduce-scatter but leave the HSDP all-reduce over the
        replicate axes to the end of the step. Static.
    """

    frozen: bool = dataclasses.field(metadata=dict(static=True), default=False)
    accumulator: Any = None
    skip_replicate_reduce: bool = dataclasses.field(metadata=dict(static=True), default=False)


def _local_block_read(shape, local_shape) -> str:
    return (
        f"`.data` of a sharded parameter of shape {tuple(shape)} read inside a funshard "
        f"step: there it is only this device's local block, of shape {tuple(local_shape)} "
        "(its rows of the padded array), not the parameter. Call fs.unshard(state) (or use "
        "an fs.fully_shard unit) for the full array. To compute on the local block on "
        "purpose (e.g. a sum of squares followed by jax.lax.psum), take it as the leaf's "
        "pytree child: jax.tree.leaves(leaf)[0]."
    )


# `Sharded.data` as the property `_sharded.py` puts on the class (the type checker sees
# the dataclass field).
_SHARDED_DATA: property = vars(Sharded)["data"]


def _local_block(self) -> Any:
    # `Sharded`'s own getter first: it refuses donated buffers, as for every leaf.
    data = _SHARDED_DATA.__get__(self)
    if not is_concrete(data) and _read_in_user_code(_py_compat.calling_frame()):
        raise errors.ShardingTypeError(_local_block_read(self.shape, self.local_shape))
    return data


def _read_in_user_code(frame) -> bool:
    """Whether `frame` (outside funshard) is executing a `.data` attribute read itself.

    jax's flattening, and `getattr(leaf, "data")`, read the field through a call: only
    the `.data` expression in the user's own code is the mistake (trace time only: a
    step's leaves hold tracers).
    """
    if frame.f_globals.get("__name__", "").startswith("funshard"):
        return False
    return _py_compat.attribute_read_at(frame, "data")


# Reading `.data` in a loss function is a TypeError on a step's leaves only: outside a
# step it is the padded global array, as the user expects.
StepLeaf.data = property(_local_block, _SHARDED_DATA.fset, doc=_SHARDED_DATA.__doc__)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Set while `funshard.value_and_grad` traces the per-device loss.

    Attributes:
      mesh: the step's mesh.
      dp_axes: every data-parallel axis (replicate then shard), which the batch is
        split over.
      skip_replicate_reduce: reduce-scatter but leave the HSDP all-reduce over the
        replicate axes to the end of the step.
    """

    mesh: Mesh
    dp_axes: tuple[str, ...]
    skip_replicate_reduce: bool = False


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "funshard_step", default=None
)
_IN_UNIT: contextvars.ContextVar[bool] = contextvars.ContextVar("funshard_unit", default=False)


def current() -> StepContext | None:
    """The step being traced, or None outside `funshard.value_and_grad`."""
    return _CURRENT.get()


@contextlib.contextmanager
def inside(ctx: StepContext):
    """Runs the body as part of the step `ctx`.

    The body runs on each device inside `jax.shard_map`, where a loop whose carry
    starts from a constant and accumulates this device's values must be cast to the
    varying type first: the cast is applied for the user, so that a loss is written as
    in plain JAX (`_jax_compat.loop_carries_vary`).
    """
    token = _CURRENT.set(ctx)
    try:
        with _jax_compat.loop_carries_vary():
            yield ctx
    finally:
        _CURRENT.reset(token)


def in_unit() -> bool:
    """Whether a `fully_shard` unit's function is being traced right now."""
    return _IN_UNIT.get()


@contextlib.contextmanager
def unit_body():
    """Marks the body as a unit's function (its parameters are already gathered)."""
    token = _IN_UNIT.set(True)
    try:
        yield
    finally:
        _IN_UNIT.reset(token)


def is_frozen(leaf: Sharded) -> bool:
    """Whether the running step wants no gradient for `leaf`."""
    return isinstance(leaf, StepLeaf) and leaf.frozen


def skips_replicate_reduce(leaf: Sharded) -> bool:
    """Whether the running step all-reduces `leaf`'s gradient over replicas only at its end."""
    return isinstance(leaf, StepLeaf) and leaf.skip_replicate_reduce


def accumulator_of(leaf: Sharded):
    """The deferred-gradient accumulator of `leaf` in the running step, or None."""
    return leaf.accumulator if isinstance(leaf, StepLeaf) else None


def layout_of(
    leaves: Sequence[Sharded], skip_replicate_reduce: bool | None = None, name: str = "unshard"
) -> comm.GroupLayout:
    """The gather layout of `leaves`, which share one mesh and one set of axes.

    Frozen leaves, and whether the HSDP all-reduce waits for the end of the step, are
    read from the step's metadata on each leaf unless `skip_replicate_reduce` is given.
    `name` labels the group's collectives (see `scope`).
    """
    if skip_replicate_reduce is None:
        skip_replicate_reduce = any(skips_replicate_reduce(s) for s in leaves)
    by_axes: dict[tuple, list[int]] = {}
    for i, s in enumerate(leaves):
        by_axes.setdefault(_axes_key(s), []).append(i)
    if len(by_axes) > 1:
        whole = _uniform_layout(leaves, skip_replicate_reduce, name)
        subgroups = tuple(
            (tuple(idx), _uniform_layout([leaves[i] for i in idx], skip_replicate_reduce, name))
            for idx in by_axes.values()
        )
        return dataclasses.replace(whole, subgroups=subgroups)
    return _uniform_layout(leaves, skip_replicate_reduce, name)


def _axes_key(leaf: Sharded) -> tuple:
    """The axes a leaf is gathered, reduced and typed over: one collective per key."""
    return (leaf.shard_axis, leaf.replicate_axis, tuple(sorted(leaf.model_axis_names)))


def _uniform_layout(
    leaves: Sequence[Sharded], skip_replicate_reduce: bool, name: str
) -> comm.GroupLayout:
    first = leaves[0]
    return comm.GroupLayout(
        leaves=tuple(
            comm.LeafLayout(
                # A model-split leaf is gathered and reduced within its model block.
                shape=s.block_shape,
                dtype=np.dtype(s.dtype),
                gather_dtype=_policy.param_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                reduce_dtype=_policy.reduce_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                rows=s.rows_per_shard,
                frozen=is_frozen(s),
                dim=s.dim,
            )
            for s in leaves
        ),
        shard_axes=first.shard_axis,
        replicate_axes=first.replicate_axis,
        num_shards=first.num_shards,
        skip_replicate_reduce=skip_replicate_reduce,
        name=name,
        model_axes=tuple(sorted(first.model_axis_names)),
    )


def accumulators_for(leaves: Sequence[Sharded]) -> tuple | None:
    """The deferred-gradient accumulators of `leaves` in the running step, if any."""
    found = tuple(accumulator_of(leaf) for leaf in leaves)
    return found if any(a is not None for a in found) else None


def unshard_in_step(
    leaves: Sequence[Sharded], name: str = "unshard", collectives: tuple = (None, None)
) -> list[jax.Array]:
    """The step's differentiable gather of `leaves`, honouring frozen and deferred leaves
    (with the unit's own `collectives`: `(all_gather, reduce_scatter)`, None for the
    default)."""
    layout = comm.with_collectives(layout_of(leaves, name=name), *collectives)
    _record.unit(name, layout, False, None)
    datas = tuple(leaf.data for leaf in leaves)
    accumulators = accumulators_for(leaves)
    if accumulators is None:
        return comm.gather(layout, datas)
    deferred = tuple(a is not None for a in accumulators)
    return comm.gather_deferred(layout, deferred, datas, accumulators)
