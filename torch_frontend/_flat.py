"""A group's tensors as one flat buffer per dtype: one collective operand each.

A collective costs per operand: over gloo through JAX on CPU, 26 tensors of 16 KiB
gather in 10.5 ms and the same bytes as one buffer in 2.7 ms. So a group crosses to
JAX as FSDP2's does: its rank blocks are copied into one flat buffer per dtype (the
copy-in), one all-gather or reduce-scatter runs over those, and each parameter's part
is copied out of the result (the copy-out) or viewed in it.

Layout of a flat buffer of `world` ranks: rank-major, `(world, sum(sizes))`, where
member i's columns hold its rank block (the padded `torch.chunk` of the parameter on its
sharded dim, contiguous, `sizes[i]` elements). A gradient buffer's rows may end in
zeros (`reduce_input`'s `row_align`: over gloo each row crosses to JAX on its own, and
must start 64-byte aligned to cross without a copy). A 64-bit member crosses as int32
pairs (`_bridge.as_words`), as JAX without x64 holds no 64-bit value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from funshard import comm
from torch_frontend._bridge import as_words


def crossing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor of `dtype` has in a flat buffer (int32 words for 64-bit)."""
    return torch.int32 if dtype.itemsize == 8 else dtype


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Members of a group that share one flat buffer.

    Attributes:
      dtype: the buffer's dtype (`crossing_dtype` of the members' dtype).
      members: indices of the members in the group's list.
      sizes: elements of each member's rank block in `dtype`.
    """

    dtype: torch.dtype
    members: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def block_shape(shape: Sequence[int], dim: int, world: int) -> list[int]:
    """The shape of one rank's padded block of a tensor of `shape` sharded on `dim`."""
    block = list(shape)
    block[dim] = comm.rows_per_shard(shape[dim], world)
    return block


def buckets(dtypes: Sequence[torch.dtype], blocks: Sequence[Sequence[int]]) -> list[Bucket]:
    """Members grouped by crossing dtype, in order of first appearance.

    Args:
      dtypes: each member's dtype (what it is gathered or reduced in).
      blocks: each member's rank block shape (`block_shape`).
    """
    found: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        found.setdefault(crossing_dtype(dtype), []).append(i)
    return [
        Bucket(
            dtype,
            tuple(members),
            tuple(math.prod(blocks[i]) * (dtypes[i].itemsize // dtype.itemsize) for i in members),
        )
        for dtype, members in found.items()
    ]


def copy_in(
    bucket: Bucket, sources: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype]
) -> torch.Tensor:
    """This rank's padded blocks of `bucket`'s members, cast, in one new flat buffer.

    Args:
      bucket: the members.
      sources: every member's padded block (contiguous), in its storage dtype.
      dtypes: every member's gather dtype (the cast happens in the copy).
    """
    parts = []
    for i in bucket.members:
        source, dtype = sources[i], dtypes[i]
        if dtype.itemsize == 8:
            parts.append(as_words(source.to(dtype)).reshape(-1))
        else:
            parts.append(source.reshape(-1))
    flat = torch.empty(bucket.total, dtype=bucket.dtype, device=sources[bucket.members[0]].device)
    return torch.cat(parts, out=flat)


def copy_out(
    bucket: Bucket,
    gathered: torch.Tensor,
    targets: Sequence[torch.Tensor],
    shapes: Sequence[Sequence[int]],
    dims: Sequence[int],
    world: int,
) -> None:
    """Writes each member's full tensor from a gathered flat buffer into its target.

    Args:
      bucket: the members.
      gathered: the all-gathered flat buffer, `world * bucket.total` elements.
      targets: every member's `FSDPParam.unsharded_padded` (padding rows included on
        dim 0), in the member's dtype.
      shapes: every member's full shape.
      dims: every member's sharded dim.
      world: the number of ranks the buffer was gathered over.
    """
    rank_major = gathered.view(world, bucket.total)
    outs = [as_words(targets[i]) for i in bucket.members]
    if all(dims[i] == 0 for i in bucket.members):
        torch.split_with_sizes_copy(
            rank_major, list(bucket.sizes), dim=1, out=[o.view(world, -1) for o in outs]
        )
        return
    offset = 0
    for i, out, size in zip(bucket.members, outs, bucket.sizes, strict=True):
        block = block_shape(out.shape, dims[i], world)
        blocks = rank_major.narrow(1, offset, size).view(world, *block)
        offset += size
        if dims[i] == 0:
            out.view(world, *block).copy_(blocks)
        else:  # the ranks' blocks side by side on that dim, then the padding cut
            full = torch.cat(blocks.unbind(0), dim=dims[i])
            out.copy_(full.narrow(dims[i], 0, shapes[i][dims[i]]))


def reduce_input(
    grads: Sequence[torch.Tensor], dims: Sequence[int], world: int, row_align: int = 1
) -> torch.Tensor:
    """One flat, rank-major buffer of full gradients (same dtype), padded per member.

    The reduce-scatter of it leaves rank r with the sum of every rank's row r: its
    blocks, in order (`split_reduced`).

    Args:
      grads: the full gradients.
      dims: each one's sharded dim.
      world: the number of ranks.
      row_align: each row's length is rounded up to a multiple of this many elements
        (zeros after the blocks), so that every row starts as aligned as the buffer.
    """
    sizes = [math.prod(block_shape(g.shape, d, world)) for g, d in zip(grads, dims, strict=True)]
    total = sum(sizes)
    length = -(-total // row_align) * row_align
    flat = torch.empty(world, length, dtype=grads[0].dtype, device=grads[0].device)
    if length != total:
        flat[:, total:].zero_()
    blocks = flat[:, :total]
    if all(d == 0 for d in dims):
        torch._chunk_cat(list(grads), dim=0, num_chunks=world, out=blocks)
        return flat.view(-1)
    offset = 0
    for grad, dim, size in zip(grads, dims, sizes, strict=True):
        chunks = torch.chunk(grad, world, dim=dim)
        block = block_shape(grad.shape, dim, world)
        for rank in range(world):
            target = blocks[rank].narrow(0, offset, size).view(block)
            target.zero_()
            if rank < len(chunks):
                target.narrow(dim, 0, chunks[rank].shape[dim]).copy_(chunks[rank])
        offset += size
    return flat.view(-1)


def split_reduced(
    reduced: torch.Tensor, shapes: Sequence[Sequence[int]], dims: Sequence[int], world: int
) -> list[torch.Tensor]:
    """This rank's block of each gradient in a reduce-scattered flat buffer (views).

    Args:
      reduced: this rank's part of the reduce-scatter of `reduce_input`'s buffer.
      shapes: each gradient's full shape.
      dims: each gradient's sharded dim.
      world: the number of ranks.
    """
    blocks = [block_shape(shape, d, world) for shape, d in zip(shapes, dims, strict=True)]
    sizes = [math.prod(b) for b in blocks]
    parts = reduced.narrow(0, 0, sum(sizes)).split(sizes)  # a row may end in padding
    return [part.view(block) for part, block in zip(parts, blocks, strict=True)]
