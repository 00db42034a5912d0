"""The running step's gather of `Sharded` leaves: their group layout, frozen and deferred leaves.

The comm layer (`funshard.comm`) gathers and reduces arrays described by a
`GroupLayout`; this module reads what the step says of each leaf (frozen, deferred,
its HSDP reduction) and builds that layout.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from funshard import comm
from funshard.core import _context, _policy
from funshard.core._sharded import Sharded


def layout_of(
    leaves: Sequence[Sharded], skip_replicate_reduce: bool | None = None, name: str = "unshard"
) -> comm.GroupLayout:
    """The gather layout of `leaves`, which share one mesh and one set of axes.

    Frozen leaves, and whether the HSDP all-reduce waits for the end of the step, are
    read from the step's metadata on each leaf unless `skip_replicate_reduce` is given.
    `name` labels the group's collectives (see `scope`).
    """
    if skip_replicate_reduce is None:
        skip_replicate_reduce = any(_context.skips_replicate_reduce(s) for s in leaves)
    first = leaves[0]
    return comm.GroupLayout(
        leaves=tuple(
            comm.LeafLayout(
                shape=s.shape,
                dtype=np.dtype(s.dtype),
                gather_dtype=_policy.param_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                reduce_dtype=_policy.reduce_dtype_for(s.mp_policy, np.dtype(s.dtype)),
                rows=s.rows_per_shard,
                frozen=_context.is_frozen(s),
                dim=s.dim,
            )
            for s in leaves
        ),
        shard_axes=first.shard_axis,
        replicate_axes=first.replicate_axis,
        num_shards=first.num_shards,
        skip_replicate_reduce=skip_replicate_reduce,
        name=name,
    )


def accumulators_for(leaves: Sequence[Sharded]) -> tuple | None:
    """The deferred-gradient accumulators of `leaves` in the running step, if any."""
    found = tuple(_context.accumulator_of(leaf) for leaf in leaves)
    return found if any(a is not None for a in found) else None


def unshard_in_step(leaves: Sequence[Sharded], name: str = "unshard") -> list[jax.Array]:
    """The step's differentiable gather of `leaves`, honouring frozen and deferred leaves."""
    layout = layout_of(leaves, name=name)
    datas = tuple(leaf.data for leaf in leaves)
    accumulators = accumulators_for(leaves)
    if accumulators is None:
        return comm.gather(layout, datas)
    deferred = tuple(a is not None for a in accumulators)
    return comm.gather_deferred(layout, deferred, datas, accumulators)
