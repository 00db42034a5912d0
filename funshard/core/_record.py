"""What a step declares, written down while it traces: its options and each unit call.

`funshard.check` lowers a step inside `recording()`; the step (`value_and_grad`), its
units (`fully_shard`, `fs.scan` / `fs.lax_scan`) and `unshard` note here what they were
asked for: the root's options, and per unit call its gather layout (leaves, axes, dtypes,
its own collectives), `reshard_after_forward` and, for a stack, its number of layers.
From these the planner states the collectives the policy implies (`funshard.plan`'s
rules), which the check sets beside those of the compiled program. Outside a recording
nothing is kept.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from funshard import comm


@dataclasses.dataclass(frozen=True)
class UnitCall:
    """One call of a unit (or of `unshard`) in a traced step.

    Attributes:
      name: the unit's name, as its collectives are labelled.
      layout: its gather layout (for a stack: the whole stack's).
      reshard_after_forward: True, False, or hpZ's group size.
      layers: the layers of a stack run by `fs.scan` / `fs.lax_scan`, else None.
    """

    name: str
    layout: comm.GroupLayout
    reshard_after_forward: bool | int
    layers: int | None = None


@dataclasses.dataclass
class StepTrace:
    """One traced `value_and_grad` step.

    Attributes:
      opts: its `RootOptions`.
      mesh: its mesh.
      reduced: the layout of every sharded leaf whose gradient the step reduces (what
        it reduces after its microbatch loop when that is deferred), or None.
      traces: the unit calls of each trace of its loss (the step may trace the loss
        more than once, e.g. to inspect it; each trace calls the same units).
    """

    opts: Any
    mesh: Any
    reduced: comm.GroupLayout | None
    traces: list[list[UnitCall]] = dataclasses.field(default_factory=list)

    @property
    def units(self) -> list[UnitCall]:
        """The unit calls of one trace of the loss (the last)."""
        return self.traces[-1] if self.traces else []


@dataclasses.dataclass
class Recording:
    """Every step traced while recording, in order."""

    steps: list[StepTrace] = dataclasses.field(default_factory=list)


_RECORDING: contextvars.ContextVar[Recording | None] = contextvars.ContextVar(
    "funshard_recording", default=None
)
_STEP: contextvars.ContextVar[StepTrace | None] = contextvars.ContextVar(
    "funshard_recorded_step", default=None
)
_CALLS: contextvars.ContextVar[list[UnitCall] | None] = contextvars.ContextVar(
    "funshard_recorded_calls", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """Records every step traced in the body."""
    found = Recording()
    token = _RECORDING.set(found)
    try:
        yield found
    finally:
        _RECORDING.reset(token)


def active() -> bool:
    """Whether a recording is under way (what only it needs is then worked out)."""
    return _RECORDING.get() is not None


@contextlib.contextmanager
def step(opts: Any, mesh: Any, reduced: comm.GroupLayout | None) -> Iterator[None]:
    """Marks the body as the trace of one step with these options."""
    found = _RECORDING.get()
    if found is None:
        yield
        return
    traced = StepTrace(opts, mesh, reduced)
    found.steps.append(traced)
    token = _STEP.set(traced)
    try:
        yield
    finally:
        _STEP.reset(token)


@contextlib.contextmanager
def loss_trace() -> Iterator[None]:
    """Marks the body as one trace of the step's loss."""
    traced = _STEP.get()
    if traced is None:
        yield
        return
    calls: list[UnitCall] = []
    traced.traces.append(calls)
    token = _CALLS.set(calls)
    try:
        yield
    finally:
        _CALLS.reset(token)


def unit(
    name: str, layout: comm.GroupLayout, reshard_after_forward: bool | int, layers: int | None
) -> None:
    """Notes a unit call of the loss being traced (nothing outside a recording)."""
    calls = _CALLS.get()
    if calls is not None:
        calls.append(UnitCall(name, layout, reshard_after_forward, layers))
