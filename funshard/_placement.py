"""Per-leaf placements: which dimension a parameter is sharded on, or none (replicated)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

from funshard import _errors


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard a leaf on dimension `dim` (FSDP2's `Shard(dim)` placement).

    Dim 0 is zero-padded to a multiple of the shard count; any other dimension must
    divide evenly.
    """

    dim: int = 0

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(f"Shard: dim must be a non-negative int, got {self.dim!r}.")


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Keep a leaf whole on every device (FSDP2's `ignored_params`); its gradient is
    all-reduced."""


Placement = Union[Shard, Replicate]
PlacementFn = Callable[[Any, Any], Union[Placement, None]]


def resolve(path, x, placement: PlacementFn | None, min_shard_size: int) -> Placement:
    """The placement of leaf `x` at `path` (ndim >= 1), validated against its shape."""
    if x.size < min_shard_size:
        return Replicate()
    chosen = placement(path, x) if placement is not None else None
    if chosen is None:
        return Shard(0)
    if not isinstance(chosen, (Shard, Replicate)):
        raise TypeError(
            f"{_errors.where('shard', path)}: placement returned {chosen!r}; return "
            "fs.Shard(dim), fs.Replicate() or None (the default, Shard(0))."
        )
    if isinstance(chosen, Shard) and chosen.dim >= x.ndim:
        raise ValueError(
            f"{_errors.where('shard', path)} has {x.ndim} dimensions, so it cannot be "
            f"sharded on dim {chosen.dim}; return a dim below {x.ndim}."
        )
    return chosen
