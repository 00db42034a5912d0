"""The running step: which mesh and data-parallel axes `unshard` gathers over right now."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Set while `funshard.value_and_grad` traces the per-device loss.

    Attributes:
      mesh: the step's mesh.
      dp_axes: every data-parallel axis (replicate then shard), which the batch is
        split over.
    """

    mesh: Mesh
    dp_axes: tuple[str, ...]


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
