"""The running step: its mesh, its data-parallel axes, and what each sharded leaf is in it.

Per-leaf facts (frozen, where a deferred gradient goes) travel on the `StepLeaf` the
root hands to the loss function, as static metadata or pytree children, never keyed by
the identity of a traced value nor read from context: `jax.checkpoint`, `vmap`,
`lax.cond` and `lax.scan` re-trace the loss and make new tracers (and
`jax.checkpoint` caches its trace per function), but a pytree's children and static
metadata travel through every transform.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from funshard.core._sharded import Sharded


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
    """Runs the body as part of the step `ctx`."""
    token = _CURRENT.set(ctx)
    try:
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
