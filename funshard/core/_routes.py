"""What each leaf of a training state is to the step: one `LeafRoute` per leaf.

`value_and_grad` reads its state through these records (which leaves it traces, gathers,
differentiates, and whose gradients it defers), and `fs.plan` reads the same records to
count what the step will move: both build them with `leaf_routes`, so the two cannot
disagree about a leaf.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from funshard import _text, errors
from funshard.core._sharded import Sharded, is_array
from funshard.core._tree import is_inexact_array


@dataclasses.dataclass(frozen=True)
class LeafRoute:
    """Where one state leaf goes in a step, and where its gradient comes from.

    Attributes:
      path: the leaf's key path.
      sharded: an `fs.Sharded` leaf: gathered in the step, its gradient reduce-scattered.
      position: its index among the values the step traces (its `Sharded` leaves and
        arrays, in tree order), or None for a leaf carried over unchanged.
      differentiable: floating or complex.
      trainable: as `trainable` marks it.
      deferred: its gradient goes, full size and unreduced, to an accumulator the step
        reduce-scatters after the last microbatch (`sync_every_microbatch=False`).
    """

    path: tuple
    sharded: bool
    position: int | None
    differentiable: bool
    trainable: bool
    deferred: bool

    @property
    def traced(self) -> bool:
        """Whether the step traces the leaf (else it is static)."""
        return self.position is not None

    @property
    def wanted(self) -> bool:
        """Whether the step computes the leaf's gradient (traced, floating, trainable)."""
        return self.traced and self.differentiable and self.trainable

    @property
    def by_autodiff(self) -> bool:
        """Whether the gradient comes from autodiff (through the units' reduce-scatter)."""
        return self.wanted and not self.deferred


def is_value(x: Any) -> bool:
    """Whether a state leaf is traced by the step: `Sharded`, an array or its abstract form."""
    return isinstance(x, Sharded) or is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def leaf_routes(
    paths, items, flags, *, sync_every_microbatch: bool = True
) -> tuple[LeafRoute, ...]:
    """One `LeafRoute` per state leaf (`Sharded` leaves whole, as `sharded_leaves` gives).

    Args:
      paths: the leaves' key paths.
      items: the leaves.
      flags: whether each leaf is trainable (`trainable_flags`).
      sync_every_microbatch: as in `value_and_grad` (False defers the sharded leaves'
        gradients).
    """
    routes, position = [], 0
    for path, x, trainable in zip(paths, items, flags, strict=True):
        traced = is_value(x)
        sharded = isinstance(x, Sharded)
        wanted = traced and trainable and is_inexact_array(x)
        routes.append(
            LeafRoute(
                path=tuple(path),
                sharded=sharded,
                position=position if traced else None,
                differentiable=is_inexact_array(x),
                trainable=trainable,
                deferred=wanted and sharded and not sync_every_microbatch,
            )
        )
        position += traced
    return tuple(routes)


def state_axes(fn: str, paths, items) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(replicate axes, shard axes) of the state (None: it has no `Sharded` leaf).

    Those are every leaf's data axes together: a leaf split over model axes (an expert
    stack over `expert`) is FSDP-sharded over the state's data axes minus those, and the
    batch is split over all of them. The order is that of the leaf with the most.

    Raises:
      ShardingValueError: two leaves are sharded over different axes, other than by
        the model axes one of them is split over.
    """
    found = [(p, x) for p, x in zip(paths, items, strict=True) if isinstance(x, Sharded)]
    if not found:
        return None
    # A leaf without model axes has the state's own data axes; if every leaf has some,
    # the one with the most data axes does.
    dense = [x for _, x in found if not x.model_axis_names]
    first = dense[0] if dense else max((x for _, x in found), key=_data_axes_count)
    axes = (first.replicate_axis, first.shard_axis)
    for path, x in found:
        model = set(x.model_axis_names)
        these = (x.replicate_axis, x.shard_axis)
        pairs = zip(axes, these, strict=True)
        if any(tuple(a for a in want if a not in model) != have for want, have in pairs):
            raise errors.ShardingValueError(_mixed_axes(fn, path, these, axes))
    return axes


def _data_axes_count(x: Sharded) -> int:
    return len(x.replicate_axis) + len(x.shard_axis)


def _mixed_axes(fn: str, path, these, axes) -> str:
    return (
        f"{_text.where(fn, path)} is sharded over {these[1]} (replicated over {these[0]}) "
        f"but other leaves over {axes[1]} (replicated over {axes[0]}); fs.value_and_grad "
        "needs one shard_axis/replicate_axis for the whole state: shard it all with the "
        "same axes."
    )
