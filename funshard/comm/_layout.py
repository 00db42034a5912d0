"""Row arithmetic of a dim-sharded array, written once: chunk sizes, padding, rank slices.

Every sharded array in funshard, the JAX core's `Sharded` leaves and the torch
frontend's DTensor shards alike, is split as `torch.chunk(x, n, dim)` splits it: each of
the `n` shards owns `ceil(size / n)` rows, the last ones fewer or none, and the stored
block is zero-padded to `ceil(size / n)` rows so that every device holds the same shape.
"""

from __future__ import annotations

from funshard import errors


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
