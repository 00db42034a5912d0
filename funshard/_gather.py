"""In-step unshard of a group of `Sharded` leaves: all-gather forward, reduce-scatter back.

`gather` is the differentiable form used by `unshard` inside a step: its transpose is
the reduce-scatter, in the policy's `reduce_dtype`, written explicitly with a
`custom_vjp` so that the dtype, the grouping and the HSDP all-reduce are ours, not
whatever autodiff would insert. `gather_values` / `reduce_values` are the two halves,
reused by `fully_shard`'s re-gathering backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _lowering, _policy
from funshard._sharded import Sharded


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Static facts about one leaf of a gather group."""

    shape: tuple[int, ...]
    dtype: np.dtype
    gather_dtype: np.dtype
    reduce_dtype: np.dtype
    rows: int

    @property
    def differentiable(self) -> bool:
        return bool(jnp.issubdtype(self.dtype, jnp.inexact))


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Static facts about a group of leaves gathered together (hashable: a jit key)."""

    leaves: tuple[LeafLayout, ...]
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    num_shards: int

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return (*self.replicate_axes, *self.shard_axes)


def layout_of(leaves: Sequence[Sharded]) -> GroupLayout:
    """The gather layout of `leaves`, which share one mesh and one set of axes."""
    first = leaves[0]
    return GroupLayout(
        leaves=tuple(
            LeafLayout(
                shape=s.shape,
                dtype=np.dtype(s.dtype),
                gather_dtype=_policy.param_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                reduce_dtype=_policy.reduce_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                rows=s.rows_per_shard,
            )
            for s in leaves
        ),
        shard_axes=first.shard_axis,
        replicate_axes=first.replicate_axis,
        num_shards=first.num_shards,
    )


def gather_values(
    datas: Sequence[jax.Array], layout: GroupLayout, dependency: jax.Array | None = None
) -> list[jax.Array]:
    """All-gathers local blocks (cast to the gather dtype) into logical full arrays.

    The result is typed as varying over every data-parallel axis: each device's use of
    it is its own, so its cotangent reaches `reduce_values` unreduced instead of being
    all-reduced at full size by autodiff.
    """
    blocks = [
        _lowering.vary(d.astype(leaf.gather_dtype), layout.replicate_axes)
        for d, leaf in zip(datas, layout.leaves)
    ]
    fulls = _lowering.all_gather_rows(blocks, layout.shard_axes, dependency=dependency)
    return [f[: leaf.shape[0]] for f, leaf in zip(fulls, layout.leaves)]


def reduce_values(cts: Sequence[jax.Array], layout: GroupLayout) -> list[jax.Array]:
    """Reduce-scatters full-size cotangents into local-block gradients (summed, not averaged).

    Floating leaves are reduced in their `reduce_dtype` and returned in their own dtype;
    the others get float0 cotangents (no communication).
    """
    idx = [i for i, leaf in enumerate(layout.leaves) if leaf.differentiable]
    padded = []
    for i in idx:
        leaf = layout.leaves[i]
        ct = _lowering.vary(cts[i].astype(leaf.reduce_dtype), layout.dp_axes)
        pad = leaf.rows * layout.num_shards - leaf.shape[0]
        padded.append(jnp.pad(ct, [(0, pad)] + [(0, 0)] * (ct.ndim - 1)) if pad else ct)
    reduced = _lowering.reduce_scatter_rows(padded, layout.shard_axes, layout.replicate_axes)
    out = [
        np.zeros((leaf.rows, *leaf.shape[1:]), jax.dtypes.float0) for leaf in layout.leaves
    ]
    for i, r in zip(idx, reduced):
        out[i] = r.astype(layout.leaves[i].dtype)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gather(layout: GroupLayout, datas: tuple[jax.Array, ...]) -> list[jax.Array]:
    """Differentiable in-step unshard: all-gather whose transpose is a reduce-scatter."""
    return gather_values(datas, layout)


def _gather_fwd(layout, datas):
    return gather_values(datas, layout), None


def _gather_bwd(layout, _, cts):
    return (tuple(reduce_values(cts, layout)),)


gather.defvjp(_gather_fwd, _gather_bwd)
