"""A group's differentiable gather: all-gather forward, reduce-scatter back.

`gather` is the differentiable form used by `unshard` inside a step: its transpose is
the reduce-scatter, in the policy's `reduce_dtype`, written explicitly with a
`custom_vjp` so that the dtype, the grouping and the HSDP all-reduce are ours, not
whatever autodiff would insert. `gather_values` / `reduce_values` are the two halves,
reused by `fully_shard`'s re-gathering backward. A `GroupLayout` says everything this
module needs to know: it reads no step (the core builds the layout from the step's
view of each leaf, `funshard.core._context`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _text, errors
from funshard.comm import _custom, _lowering
from funshard.comm._lowering import is_inexact_array

# One debug record per collective a step's trace issues (never at run time: these functions
# run while JAX traces the step). A child of "funshard", silent unless configured.
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Static facts about one leaf of a gather group."""

    shape: tuple[int, ...]
    dtype: np.dtype
    gather_dtype: np.dtype
    reduce_dtype: np.dtype
    rows: int
    frozen: bool = False
    dim: int = 0

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (*self.shape[: self.dim], self.rows, *self.shape[self.dim + 1 :])

    @property
    def differentiable(self) -> bool:
        return is_inexact_array(self)

    @property
    def reduced(self) -> bool:
        """Whether the backward pass reduces this leaf's gradient."""
        return self.differentiable and not self.frozen


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Static facts about a group of leaves gathered together (hashable: a jit key)."""

    leaves: tuple[LeafLayout, ...]
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    num_shards: int
    skip_replicate_reduce: bool = False
    name: str = "unshard"  # the unit's label in profiles and HLO metadata
    # The model axes (tensor, expert) the leaves are split over: their blocks, gathered
    # values and gradients vary over them, and no collective here runs over them.
    model_axes: tuple[str, ...] = ()
    # A unit whose leaves live on different axes (an expert stack beside dense leaves,
    # tensor-split kernels beside replicated norms): (leaf positions, layout) per set of
    # axes, each gathered and reduced on its own. Empty when all leaves share their axes.
    subgroups: tuple[tuple[tuple[int, ...], GroupLayout], ...] = ()
    # The unit's own collectives (`fs.AllGather` / `fs.ReduceScatter`), or None for the
    # default ones; a unit's subgroups carry them too.
    all_gather: _custom.AllGather | None = None
    reduce_scatter: _custom.ReduceScatter | None = None

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return (*self.replicate_axes, *self.shard_axes)

    def layer(self) -> GroupLayout:
        """The layout of one layer of a stack (leaves sharded on dim 1, `stacked=True`):
        each leaf with its leading layer axis dropped, as `fs.scan` gathers it."""
        leaves = tuple(
            dataclasses.replace(leaf, shape=leaf.shape[1:], dim=leaf.dim - 1)
            for leaf in self.leaves
        )
        subgroups = tuple((idx, sub.layer()) for idx, sub in self.subgroups)
        return dataclasses.replace(self, leaves=leaves, subgroups=subgroups)


def with_collectives(
    layout: GroupLayout,
    all_gather: _custom.AllGather | None,
    reduce_scatter: _custom.ReduceScatter | None,
) -> GroupLayout:
    """`layout` (and each of its subgroups) running the unit's own collectives."""
    if all_gather is None and reduce_scatter is None:
        return layout
    subgroups = tuple(
        (idx, with_collectives(sub, all_gather, reduce_scatter)) for idx, sub in layout.subgroups
    )
    return dataclasses.replace(
        layout, all_gather=all_gather, reduce_scatter=reduce_scatter, subgroups=subgroups
    )


def _custom_hpz(layout: GroupLayout) -> str:
    return (
        f"fully_shard: unit {layout.name!r} has a custom all-gather, which "
        "reshard_after_forward=<int> (hpZ) does not support yet: its backward re-gather "
        "would run the default all-gather within the groups. Use reshard_after_forward="
        "True or False with a custom all-gather."
    )


def _custom_deferred(layout: GroupLayout) -> str:
    return (
        f"unit {layout.name!r} has a custom reduce-scatter, which gradient accumulation "
        "without per-microbatch sync (sync_every_microbatch=False) does not support yet: "
        "the step reduces the accumulated gradients of every unit together, after the "
        "loop. Use sync_every_microbatch=True (the default) with a custom reduce-scatter."
    )


def _check_not_deferred(layout: GroupLayout, deferred) -> None:
    if layout.reduce_scatter is not None and deferred is not None and any(deferred):
        raise errors.UnsupportedError(_custom_deferred(layout))


def scope(layout: GroupLayout, what: str):
    """`funshard/<unit>/<what>`: a unit's collectives, named in profiles and HLO metadata.

    FSDP2 labels its work `FSDP::all_gather` etc. per module; these names let a
    `jax.profiler` trace or an HLO dump attribute time and memory to units.
    """
    return jax.named_scope(f"funshard/{layout.name}/{what}")


def _log_collective(
    layout: GroupLayout,
    kind: str,
    leaves: Sequence[LeafLayout],
    dtypes: Sequence[np.dtype],
    axes: tuple[str, ...],
    detail: str,
) -> None:
    """One debug record for a collective of `layout`'s unit, built only if it is wanted."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    names = "+".join(sorted({np.dtype(d).name for d in dtypes}))
    logger.debug(
        "funshard/%s: %s of %s (%s) over mesh axes %s: %s",
        layout.name,
        kind,
        _text.counted(len(leaves), "leaf", "leaves"),
        names,
        axes,
        detail,
    )


def _elements(leaves: Sequence[LeafLayout]) -> int:
    """Elements of the leaves' local blocks together: one device's part of a gather."""
    return sum(math.prod(leaf.local_shape) for leaf in leaves)


def _log_gather(layout: GroupLayout, keep_group: tuple[str, ...] | None) -> None:
    elements = _elements(layout.leaves)
    if not elements or not logger.isEnabledFor(logging.DEBUG):
        return
    detail = f"{elements:,} elements per device, {elements * layout.num_shards:,} gathered"
    if keep_group is not None:
        detail += f"; each device keeps its part for a re-gather within {keep_group}"
    gather_dtypes = [leaf.gather_dtype for leaf in layout.leaves]
    _log_collective(layout, "all-gather", layout.leaves, gather_dtypes, layout.shard_axes, detail)


def _log_regather(layout: GroupLayout, group: tuple[str, ...]) -> None:
    elements = _elements(layout.leaves)
    if not elements or not logger.isEnabledFor(logging.DEBUG):
        return
    detail = f"{elements * layout.num_shards:,} elements gathered from the kept parts"
    gather_dtypes = [leaf.gather_dtype for leaf in layout.leaves]
    _log_collective(layout, "all-gather", layout.leaves, gather_dtypes, group, detail)


def _log_reductions(
    layout: GroupLayout, leaves: Sequence[LeafLayout], replicate_axes: tuple[str, ...]
) -> None:
    """The reduce-scatter of each reduce dtype (and its HSDP all-reduce), as `_lowering`
    issues them: one per dtype, none for an empty one."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    by_dtype: dict[np.dtype, list[LeafLayout]] = {}
    for leaf in leaves:
        by_dtype.setdefault(np.dtype(leaf.reduce_dtype), []).append(leaf)
    for dtype, group in by_dtype.items():
        elements = _elements(group)
        if not elements:
            continue
        full = elements * layout.num_shards
        detail = f"{full:,} elements per device in, {elements:,} out"
        _log_collective(layout, "reduce-scatter", group, [dtype], layout.shard_axes, detail)
        if replicate_axes:
            detail = f"{elements:,} elements per device"
            _log_collective(layout, "all-reduce", group, [dtype], replicate_axes, detail)


def _blocks(datas: Sequence[jax.Array], layout: GroupLayout) -> list[jax.Array]:
    # Typed as varying over every data-parallel axis: each device's use of the gathered
    # value is its own, so its cotangent reaches `reduce_values` unreduced instead of
    # being all-reduced at full size by autodiff.
    return [
        _lowering.vary(d.astype(leaf.gather_dtype), layout.replicate_axes)
        for d, leaf in zip(datas, layout.leaves, strict=True)
    ]


def _logical(fulls: Sequence[jax.Array], layout: GroupLayout) -> list[jax.Array]:
    return [
        jax.lax.slice_in_dim(f, 0, leaf.shape[leaf.dim], axis=leaf.dim)
        for f, leaf in zip(fulls, layout.leaves, strict=True)
    ]


def _per_subgroup(layout: GroupLayout, values: Sequence, run) -> list:
    """`run(values of a subgroup, its layout)` for each subgroup, back in leaf order."""
    out: list = [None] * len(layout.leaves)
    for idx, sub in layout.subgroups:
        for i, value in zip(idx, run([values[i] for i in idx], sub), strict=True):
            out[i] = value
    return out


def _mixed_hpz(layout: GroupLayout) -> str:
    return (
        f"fully_shard: reshard_after_forward=<int> (hpZ) needs one set of shard axes for "
        f"the unit {layout.name!r}, but its parameters live on several (model-split "
        "leaves beside others); use reshard_after_forward=True or False, or put them in "
        "separate units."
    )


def gather_values(
    datas: Sequence[jax.Array],
    layout: GroupLayout,
    dependency: jax.Array | None = None,
    keep_group: tuple[str, ...] | None = None,
):
    """All-gathers local blocks (cast to the gather dtype) into logical full arrays.

    With `keep_group` (hpZ), returns `(arrays, part)` where `part` is this device's
    share of the gathered buffer within `keep_group`, for `regather_values`.
    """
    if layout.subgroups:
        if keep_group is not None:
            raise errors.UnsupportedError(_mixed_hpz(layout))
        return _per_subgroup(layout, datas, lambda d, sub: gather_values(d, sub, dependency))
    if keep_group is not None and layout.all_gather is not None:
        raise errors.UnsupportedError(_custom_hpz(layout))
    dims = [leaf.dim for leaf in layout.leaves]
    _log_gather(layout, keep_group)
    with scope(layout, "all_gather"):
        out = _lowering.all_gather_blocks(
            _blocks(datas, layout),
            layout.shard_axes,
            dims=dims,
            dependency=dependency,
            keep_group=keep_group,
            custom=layout.all_gather,
            unit=layout.name,
        )
    if keep_group is None:
        return _logical(out, layout)
    return _logical(out[0], layout), out[1]


def regather_values(part, layout: GroupLayout, group, dependency=None) -> list[jax.Array]:
    """The logical full arrays again, gathered from hpZ `part`s within `group` only."""
    structs = [jax.ShapeDtypeStruct(leaf.local_shape, leaf.gather_dtype) for leaf in layout.leaves]
    packing = _lowering.packing_of(structs, [leaf.dim for leaf in layout.leaves])
    _log_regather(layout, group)
    with scope(layout, "all_gather"):
        fulls = _lowering.regather_group(part, packing, group, dependency)
    return _logical(fulls, layout)


def _zero_cotangent(leaf: LeafLayout, layout: GroupLayout):
    """A zero cotangent typed like the local block (varying as the root typed it)."""
    shape = leaf.local_shape
    if not leaf.differentiable:
        return np.zeros(shape, jax.dtypes.float0)
    varying = layout.shard_axes + layout.model_axes
    if layout.skip_replicate_reduce:
        varying = varying + layout.replicate_axes
    return _lowering.vary(jnp.zeros(shape, leaf.dtype), varying)


def reduce_values(cts: Sequence[jax.Array], layout: GroupLayout) -> list[jax.Array]:
    """Reduce-scatters full-size cotangents into local-block gradients (summed, not averaged).

    Trainable floating leaves are reduced in their `reduce_dtype` and returned in their
    own dtype; frozen and non-floating leaves get zero cotangents (no communication).
    """
    if layout.subgroups:
        return _per_subgroup(layout, cts, reduce_values)
    idx = [i for i, leaf in enumerate(layout.leaves) if leaf.reduced]
    padded = []
    for i in idx:
        leaf = layout.leaves[i]
        ct = _lowering.vary(cts[i].astype(leaf.reduce_dtype), layout.dp_axes + layout.model_axes)
        widths = [(0, 0)] * ct.ndim
        widths[leaf.dim] = (0, leaf.rows * layout.num_shards - leaf.shape[leaf.dim])
        padded.append(jnp.pad(ct, widths) if widths[leaf.dim][1] else ct)
    replicate_axes = () if layout.skip_replicate_reduce else layout.replicate_axes
    dims = [layout.leaves[i].dim for i in idx]
    _log_reductions(layout, [layout.leaves[i] for i in idx], replicate_axes)
    with scope(layout, "reduce_scatter"):
        reduced = _lowering.reduce_scatter_blocks(
            padded,
            layout.shard_axes,
            replicate_axes,
            dims,
            custom=layout.reduce_scatter,
            unit=layout.name,
        )
    out = [_zero_cotangent(leaf, layout) for leaf in layout.leaves]
    for i, r in zip(idx, reduced, strict=True):
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def gather_deferred(
    layout: GroupLayout, deferred: tuple[bool, ...], datas: tuple, accumulators: tuple
) -> list[jax.Array]:
    """In-step unshard whose gradient is NOT reduced: it goes, full size, to `accumulators`.

    Used for gradient accumulation without per-microbatch sync (FSDP2's
    `set_requires_gradient_sync(False)`): the root differentiates with respect to the
    accumulators (full-size, in `reduce_dtype`, one per leaf marked in `deferred`) and
    reduce-scatters their sum once, after the last microbatch.
    """
    _check_not_deferred(layout, deferred)
    return gather_values(datas, layout)


def _deferred_fwd(layout, deferred, datas, accumulators):
    _check_not_deferred(layout, deferred)
    return gather_values(datas, layout), None


def backward_values(cts, layout: GroupLayout, deferred: tuple[bool, ...] | None) -> tuple:
    """(local-block cotangents, accumulator cotangents) for full-size cotangents `cts`.

    Without deferral this is the reduce-scatter. With it, no communication: the
    cotangents go unreduced to the accumulators and the local blocks get zeros.
    """
    if deferred is None:
        return tuple(reduce_values(cts, layout)), None
    _check_not_deferred(layout, deferred)
    if layout.subgroups:
        both = _per_subgroup(
            layout,
            list(zip(cts, deferred, strict=True)),
            lambda pairs, sub: list(
                zip(
                    *backward_values([c for c, _ in pairs], sub, tuple(d for _, d in pairs)),
                    strict=True,
                )
            ),
        )
        return tuple(z for z, _ in both), tuple(r for _, r in both)
    zeros = tuple(_zero_cotangent(leaf, layout) for leaf in layout.leaves)
    routed = tuple(
        _lowering.vary(ct.astype(leaf.reduce_dtype), layout.dp_axes + layout.model_axes)
        if d
        else None
        for ct, leaf, d in zip(cts, layout.leaves, deferred, strict=True)
    )
    return zeros, routed


def _deferred_bwd(layout, deferred, _, cts):
    return backward_values(cts, layout, deferred)


gather_deferred.defvjp(_deferred_fwd, _deferred_bwd)
