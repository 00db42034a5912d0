"""The running step: which mesh and data-parallel axes `unshard` gathers over right now."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Set while `funshard.value_and_grad` traces the per-device loss.

    Leaves are recognised by the identity of the traced local block the root handed to
    the loss function (`id(sharded.data)`), which is what `unshard` and `fully_shard`
    receive as long as the user passes the state's leaves through unchanged.

    Attributes:
      mesh: the step's mesh.
      dp_axes: every data-parallel axis (replicate then shard), which the batch is
        split over.
      frozen: ids of local blocks whose gradient is not wanted: gathered, never reduced.
      deferred: id of a local block -> the full-size accumulator its unreduced
        cotangent goes to (gradient accumulation without per-microbatch sync).
      skip_replicate_reduce: reduce-scatter but leave the HSDP all-reduce over the
        replicate axes to the end of the step.
    """

    mesh: Mesh
    dp_axes: tuple[str, ...]
    frozen: frozenset[int] = frozenset()
    deferred: dict[int, Any] = dataclasses.field(default_factory=dict)
    skip_replicate_reduce: bool = False


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "funshard_step", default=None
)


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
