"""A sharded array's layout and its row arithmetic, written once.

Every sharded array in funshard, the JAX core's `Sharded` leaves and the torch
frontend's DTensor shards alike, is split as `torch.chunk(x, n, dim)` splits it: each of
the `n` shards owns `ceil(size / n)` rows, the last ones fewer or none, and the stored
block is zero-padded to `ceil(size / n)` rows so that every device holds the same shape.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from funshard import errors
from funshard.comm import _mesh


def rows_per_shard(size: int, shards: int) -> int:
    """Rows each shard stores for a dimension of `size`: `ceil(size / shards)`."""
    return -(-size // shards)


def padded_size(size: int, shards: int) -> int:
    """`size` rounded up to a multiple of `shards` (the padded global dimension)."""
    return rows_per_shard(size, shards) * shards


def chunk(size: int, shards: int, index: int) -> tuple[int, int]:
    """`(start, rows)` of shard `index`'s logical rows, as `torch.chunk` gives them.

    `rows` may be 0 (a shard past the end of a short dimension); `start` is then 0.
    """
    per = rows_per_shard(size, shards)
    rows = max(0, min(per, size - index * per))
    return (index * per if rows else 0), rows


def check_group_size(fn: str, k: int, shards: int) -> None:
    """Raises unless `k` divides `shards`: hpZ (`reshard_after_forward=k`) keeps the
    parameters sharded over groups of k of the shards after the forward.

    Raises:
      ValueError (`funshard.errors.ShardingValueError`): `k` is not a divisor of `shards`.
    """
    if k < 1 or shards % k:
        raise errors.ShardingValueError(_group_size_not_divisor(fn, k, shards))


def _group_size_not_divisor(fn: str, k: int, shards: int) -> str:
    divisors = [d for d in range(1, shards + 1) if shards % d == 0]
    return (
        f"{fn}: reshard_after_forward={k} must divide the number of shards ({shards}) "
        f"(it keeps 1/k of the parameters after the forward and gathers them again within "
        f"groups of k shards); pass one of {divisors}, or True / False."
    )


class LayoutFacts:
    """What follows from a layout's fields: shard count, padding, block shapes, sharding.

    With model axes (tensor or expert parallelism), each dim `d` is first split evenly
    over `model_axes[d]`: a device's *model block* has `block_shape`. FSDP then chunks
    the block's `dim` over the shard axes as above. Where `dim` is itself split over
    model axes, each model block is zero-padded on its own, so the padded global array
    is the model blocks' padded chunks in mesh order (torch's `_StridedShard` layout).
    """

    # The fields these facts read, declared for the type checker: the dataclasses that
    # share them (`Layout`, `funshard.Sharded`) define them.
    shape: tuple[int, ...]
    mesh: Mesh
    shard_axis: tuple[str, ...]
    dim: int
    model_axes: tuple[tuple[str, ...], ...]

    @property
    def num_shards(self) -> int:
        """Number of devices the sharded dimension is split over."""
        return _mesh.axes_size(self.mesh, self.shard_axis)

    def model_split(self, d: int) -> int:
        """Number of model blocks dim `d` is split into (1 without model axes)."""
        if not self.model_axes:
            return 1
        return _mesh.axes_size(self.mesh, self.model_axes[d])

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The logical shape of one device's model block (`shape` without model axes)."""
        return tuple(size // self.model_split(d) for d, size in enumerate(self.shape))

    @property
    def model_axis_names(self) -> tuple[str, ...]:
        """Every model axis the array is split over, in dim order."""
        return tuple(a for axes in self.model_axes for a in axes)

    @property
    def rows_per_shard(self) -> int:
        """Size of each device's block along `dim`: `ceil(block / num_shards)`."""
        return rows_per_shard(self.block_shape[self.dim], self.num_shards)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """Global shape of `data` (`dim` zero-padded to a multiple of the shard count,
        per model block)."""
        size = self.model_split(self.dim) * self.rows_per_shard * self.num_shards
        return self._with_dim(self.shape, size)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one device's block of `data`."""
        return self._with_dim(self.block_shape, self.rows_per_shard)

    def _with_dim(self, shape: tuple[int, ...], size: int) -> tuple[int, ...]:
        return (*shape[: self.dim], size, *shape[self.dim + 1 :])

    @property
    def ndim(self) -> int:
        """Logical number of dimensions."""
        return len(self.shape)

    @property
    def size(self) -> int:
        """Logical number of elements."""
        return math.prod(self.shape)

    def chunk(self, index: int) -> tuple[int, int]:
        """`(start, rows)` of shard `index`'s logical rows along `dim` of a model block
        (see `chunk`)."""
        return chunk(self.block_shape[self.dim], self.num_shards, index)

    @property
    def spec(self) -> PartitionSpec:
        """The `PartitionSpec` of `data` outside a step."""
        if not self.model_axes:
            return _mesh.spec(self.shard_axis, self.dim)
        entries = [
            (*axes, *self.shard_axis) if d == self.dim else axes
            for d, axes in enumerate(self.model_axes)
        ]
        return PartitionSpec(*(_entry(axes) for axes in entries))

    @property
    def model_spec(self) -> PartitionSpec:
        """The `PartitionSpec` of the full logical array: its model axes only."""
        return PartitionSpec(*(_entry(axes) for axes in self.model_axes))

    @property
    def sharding(self) -> NamedSharding:
        """The sharding of `data` outside a step."""
        return NamedSharding(self.mesh, self.spec)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """One dim's `PartitionSpec` entry for `axes`."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def pad_end(x: Any, dim: int, size: int) -> Any:
    """`x` (a numpy or jax array) zero-padded at the end of `dim` to `size`."""
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, size - x.shape[dim])
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def to_padded(x: Any, layout: LayoutFacts, pad: Any = pad_end, lead: int = 0) -> Any:
    """The full logical array `x` as `layout`'s padded global array.

    `pad(x, dim, size)` zero-pads `dim` at its end (default `pad_end`); `lead` leading
    axes (a `jax.vmap` stack) are carried along. Each model block of `dim` is padded on
    its own.
    """
    size = layout.rows_per_shard * layout.num_shards
    return pad_blocks(x, lead + layout.dim, layout.model_split(layout.dim), size, pad)


def from_padded(x: Any, layout: LayoutFacts, lead: int = 0) -> Any:
    """The full logical array of `layout`'s padded global array `x` (`to_padded`'s
    inverse, for numpy and jax arrays alike)."""
    dim = layout.dim
    return unpad_blocks(x, lead + dim, layout.model_split(dim), layout.block_shape[dim])


def pad_blocks(x: Any, dim: int, blocks: int, size: int, pad: Any = pad_end) -> Any:
    """`x` with each of its `blocks` equal blocks along `dim` padded to `size` by `pad`."""
    if blocks == 1:
        return pad(x, dim, size)
    shape = tuple(x.shape)
    split = x.reshape(*shape[:dim], blocks, shape[dim] // blocks, *shape[dim + 1 :])
    return pad(split, dim + 1, size).reshape(*shape[:dim], blocks * size, *shape[dim + 1 :])


def unpad_blocks(x: Any, dim: int, blocks: int, rows: int) -> Any:
    """`x` with each of its `blocks` equal blocks along `dim` cut to its first `rows`."""
    shape = tuple(x.shape)
    if blocks == 1:
        return x[(slice(None),) * dim + (slice(0, rows),)]
    split = x.reshape(*shape[:dim], blocks, shape[dim] // blocks, *shape[dim + 1 :])
    kept = split[(slice(None),) * (dim + 1) + (slice(0, rows),)]
    return kept.reshape(*shape[:dim], blocks * rows, *shape[dim + 1 :])


@dataclasses.dataclass(frozen=True)
class Layout(LayoutFacts):
    """Where one sharded array lives, without the array: the one description of a leaf.

    A JAX `funshard.Sharded` leaf carries these fields as its static metadata
    (`Sharded.layout`); the planner and the torch frontend's checkpoints describe a
    parameter with it. Everything else (shard count, rows per shard, padded and local
    shapes, a shard's rows, the sharding) follows from the fields (`LayoutFacts`).

    Attributes:
      shape: the logical (unpadded) shape.
      dtype: the logical dtype.
      mesh: the mesh the array lives on.
      shard_axis: mesh axes `dim` is split over.
      replicate_axis: mesh axes the shards are replicated over (HSDP); may be empty.
      mp_policy: the mixed-precision policy for its gathers and reductions (a
        `funshard.MixedPrecisionPolicy`), or None.
      dim: the sharded dimension.
      model_axes: per dim, the model axes (tensor, expert, ...) that split it evenly
        before FSDP shards it; `()` for none at all (a plain FSDP leaf).
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    mesh: Mesh
    shard_axis: tuple[str, ...]
    replicate_axis: tuple[str, ...] = ()
    mp_policy: Any = None
    dim: int = 0
    model_axes: tuple[tuple[str, ...], ...] = ()
