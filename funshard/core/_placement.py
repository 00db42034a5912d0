"""Per-leaf placements: which dimension a parameter is sharded on, or none (replicated)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from funshard import _text, errors


def _shard_dim_invalid(dim) -> str:
    return (
        f"Shard: dim must be a non-negative int, got {dim!r}; pass e.g. fs.Shard(0) "
        "(the default) or fs.Shard(1)."
    )


@dataclasses.dataclass(frozen=True)
class Shard:
    """Places a leaf sharded on dimension `dim` (FSDP2's `Shard(dim)` placement).

    Dim 0 is zero-padded to a multiple of the shard count; any other dimension must
    divide evenly.

    Attributes:
      dim: the dimension split over the shard axes.

    Raises:
      ValueError: `dim` is not a non-negative int.
    """

    dim: int = 0

    def __post_init__(self):
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise errors.ShardingValueError(_shard_dim_invalid(self.dim))


@dataclasses.dataclass(frozen=True)
class Replicate:
    """Places a leaf whole on every device (the role of FSDP2's `ignored_params`).

    Its gradient is all-reduced over the data-parallel devices.
    """


Placement = Shard | Replicate
PlacementFn = Callable[[Any, Any], Placement | None]


def _placement_bad_return(path, chosen) -> str:
    return (
        f"{_text.where('shard', path)}: placement returned {chosen!r}; return fs.Shard(dim), "
        "fs.Replicate() or None (the default, Shard(0))."
    )


def _placement_dim_out_of_range(path, ndim: int, dim: int) -> str:
    return (
        f"{_text.where('shard', path)} has {ndim} dimensions, so it cannot be sharded on dim "
        f"{dim}; return a dim below {ndim}."
    )


def resolve(path, x, placement: PlacementFn | None, min_shard_size: int) -> Placement:
    """The placement of leaf `x` at `path` (ndim >= 1), validated against its shape."""
    if x.size < min_shard_size:
        return Replicate()
    chosen = placement(path, x) if placement is not None else None
    if chosen is None:
        return Shard(0)
    if not isinstance(chosen, (Shard, Replicate)):
        raise errors.ShardingTypeError(_placement_bad_return(path, chosen))
    if isinstance(chosen, Shard) and chosen.dim >= x.ndim:
        raise errors.ShardingValueError(_placement_dim_out_of_range(path, x.ndim, chosen.dim))
    return chosen
