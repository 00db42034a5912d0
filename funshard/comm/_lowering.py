"""The collectives, written once: flat-buffer all-gather and reduce-scatter over mesh axes.

Everything here runs per device inside `jax.shard_map`. The functional training step
calls these directly; eager callers (`unshard` outside a step, the torch frontend's
hooks on process-local buffers) go through `funshard.comm._eager`, which wraps the very
same functions in a jitted `shard_map`.

One unit = one collective of each kind: the unit's local blocks are flattened into a
single buffer, gathered once and split (like FSDP2's copy-in / copy-out buffers).
Leaves of mixed dtypes share the buffer as raw bits in a common unsigned width; 16-bit
floats always travel as `uint16`, which keeps them 16-bit on XLA CPU (whose float
normalisation would otherwise widen a bf16 all-gather to f32) and is exact everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _jax_compat
from funshard.comm import _custom


def is_inexact_array(x: Any) -> bool:
    """Whether `x` (an array, tracer, abstract array or `Sharded`) is floating or complex."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _word_width(dtypes: Sequence[np.dtype]) -> int:
    return min(np.dtype(d).itemsize for d in dtypes)


def _carrier(dtypes: Sequence[np.dtype]) -> np.dtype | None:
    """The dtype the flat buffer travels in, or None for raw unsigned words.

    A group of one dtype travels as itself (no conversion ops at all) unless it is a
    16-bit float (kept 16-bit as uint16, see the module docstring) or bool.
    """
    first = np.dtype(dtypes[0])
    if any(np.dtype(d) != first for d in dtypes) or first == np.bool_:
        return None
    if jnp.issubdtype(first, jnp.floating) and first.itemsize == 2:
        return None
    return first


def _to_words(block: jax.Array, width: int) -> jax.Array:
    """This device's block as a 1-D buffer of `width`-byte unsigned words (exact bits)."""
    if block.dtype == jnp.bool_:
        block = block.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(block, UINT[width])
    return words.reshape(-1)


def _from_words(words: jax.Array, shape: tuple[int, ...], dtype: np.dtype, width: int):
    """Inverse of `_to_words` for a gathered `(N, n)` slab -> array of `shape`."""
    carrier = jnp.uint8 if dtype == jnp.bool_ else dtype
    ratio = np.dtype(carrier).itemsize // width
    words = words.reshape(shape + ((ratio,) if ratio > 1 else ()))
    out = jax.lax.bitcast_convert_type(words, carrier)
    return out != 0 if dtype == jnp.bool_ else out


def vary(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """Marks `x` as varying over `axes` (a no-op for axes it already varies over)."""
    varying = _jax_compat.varying_axes(x)
    missing = tuple(a for a in axes if a not in varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def tie_to(buffer: jax.Array, dependency: jax.Array | None) -> jax.Array:
    """Makes `buffer` data-dependent on `dependency` without changing its value.

    The predicate `d == d or d != d` (on one element of `dependency`, read as a float)
    is true for every value, NaN and infinities included, but XLA's algebraic
    simplifier does not fold float comparisons of a value with itself (they depend on
    NaN). So XLA can neither hoist a collective on `buffer` above the op producing
    `dependency` nor merge it with an identical collective elsewhere (the re-gather of
    the backward pass), and the values never change.
    """
    return tie_all([buffer], dependency)[0]


def tie_all(buffers: Sequence[jax.Array], dependency: jax.Array | None) -> list[jax.Array]:
    """Each of `buffers` tied to `dependency` (see `tie_to`) by one shared predicate."""
    buffers = list(buffers)
    if dependency is None or dependency.size == 0 or not any(b.size for b in buffers):
        return buffers
    d = dependency.reshape(-1)[0]
    if jnp.issubdtype(d.dtype, jnp.complexfloating):
        d = jnp.real(d)
    d = d.astype(jnp.float32)
    # The tie must not type the buffers as varying over more axes than they do: a
    # unit's input split over a model axis (sequence parallelism) would make the
    # gathered parameters, and so their gradients, vary over it. One element reduced
    # over those axes still waits for the input.
    extra = _jax_compat.varying_axes(d) - frozenset().union(
        *(_jax_compat.varying_axes(b) for b in buffers)
    )
    if extra:
        d = jax.lax.pmax(d, tuple(sorted(extra)))
    always = (d == d) | (d != d)
    return [jnp.where(always, b, jnp.zeros_like(b)) if b.size else b for b in buffers]


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a group of local blocks is laid out in one flat buffer (static)."""

    shapes: tuple[tuple[int, ...], ...]  # each block with its sharded dim moved first
    dtypes: tuple[np.dtype, ...]
    dims: tuple[int, ...]
    carrier: np.dtype | None  # None: raw unsigned words of `width` bytes
    width: int
    sizes: tuple[int, ...]  # buffer elements per block

    @property
    def total(self) -> int:
        return sum(self.sizes)


def packing_of(blocks: Sequence[Any], dims: Sequence[int] | None = None) -> Packing:
    """The flat-buffer layout of `blocks` (arrays or shape/dtype structs, each sharded
    on its entry of `dims`)."""
    dims = tuple(dims) if dims is not None else (0,) * len(blocks)
    dtypes = tuple(np.dtype(b.dtype) for b in blocks)
    carrier, width = _carrier(dtypes), _word_width(dtypes)
    shapes = tuple(
        (b.shape[d], *b.shape[:d], *b.shape[d + 1 :]) for b, d in zip(blocks, dims, strict=True)
    )
    sizes = tuple(
        int(np.prod(shape)) * (1 if carrier is not None else dtype.itemsize // width)
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    return Packing(shapes, dtypes, dims, carrier, width, sizes)


def pack(blocks: Sequence[jax.Array], packing: Packing) -> jax.Array:
    """This device's blocks as ONE flat buffer."""
    words = []
    for block, d in zip(blocks, packing.dims, strict=True):
        block = jnp.moveaxis(block, d, 0) if d else block
        words.append(block.reshape(-1) if packing.carrier else _to_words(block, packing.width))
    return jnp.concatenate(words) if len(words) > 1 else words[0]


def unpack(gathered: jax.Array, packing: Packing) -> list[jax.Array]:
    """Splits a gathered `(N, L)` buffer into each leaf's `(N * r_i, ...)` global array."""
    n = gathered.shape[0]
    out, start = [], 0
    layout = zip(packing.shapes, packing.dtypes, packing.dims, packing.sizes, strict=True)
    for shape, dtype, d, size in layout:
        slab = gathered[:, start : start + size]
        start += size
        full_shape = (n * shape[0], *shape[1:])
        if packing.carrier is None:
            full = _from_words(slab, full_shape, dtype, packing.width)
        else:
            full = slab.reshape(full_shape)
        out.append(jnp.moveaxis(full, 0, d) if d else full)
    return out


def all_gather_blocks(
    blocks: Sequence[jax.Array],
    axes: tuple[str, ...],
    *,
    dims: Sequence[int] | None = None,
    to: str = "varying",
    dependency: jax.Array | None = None,
    keep_group: tuple[str, ...] | None = None,
    custom: _custom.AllGather | None = None,
    unit: str = "unshard",
):
    """All-gathers every device's block of each leaf in ONE collective.

    Args:
      blocks: this device's block of each leaf (any dtypes), sharded on dim 0 or on
        its entry of `dims`.
      axes: mesh axes to gather over (N devices), in mesh order.
      dims: the sharded dimension of each leaf (default: all 0).
      to: `"varying"` inside the training step (the result is typed as varying over
        `axes`); `"invarying"` for a standalone gather returning a replicated value.
      dependency: optional array the gather must wait for (see `tie_to`).
      keep_group: trailing axes of `axes` (k devices). When given, also return this
        device's 1/k of the gathered buffer, from which `regather_group` rebuilds the
        whole by gathering within the group only (FSDP2's hpZ).
      custom: the unit's own all-gather, run in place of `jax.lax.all_gather`.
      unit: the unit's name, for a custom all-gather's errors.

    Returns:
      Each leaf's global array: its sharded dimension `N` times longer, blocks in
      device order (so padding, if any, comes last); with `keep_group`, the pair
      `(arrays, part)`.
    """
    if not blocks:
        return ([], None) if keep_group else []
    packing = packing_of(blocks, dims)
    n = _mesh_axes_size(axes)
    if packing.total == 0:
        empty = unpack(jnp.zeros((n, 0), packing.carrier or UINT[packing.width]), packing)
        return (empty, None) if keep_group else empty
    # Tied before packing, not after: the backward pass's re-gather would otherwise share
    # (by CSE) the forward's packed buffer, keeping it alive from forward to backward.
    flat = pack(tie_all(blocks, dependency), packing)
    if custom is None:
        gathered = jax.lax.all_gather(flat, axes, axis=0, tiled=False, to=to)
    else:
        gathered = _custom_gather(custom, flat, packing, axes, n, unit)
        gathered = vary(gathered, axes) if to == "varying" else gathered
    if keep_group is None:
        return copy_out(gathered, packing, axes) if to == "varying" else unpack(gathered, packing)
    k = _mesh_axes_size(keep_group)
    grouped = gathered.reshape(n // k, k, packing.total)
    part = jax.lax.dynamic_index_in_dim(
        grouped, jax.lax.axis_index(keep_group), axis=1, keepdims=False
    )
    return copy_out(gathered, packing, axes), part


def _custom_gather(
    custom: _custom.AllGather,
    flat: jax.Array,
    packing: Packing,
    axes: tuple[str, ...],
    n: int,
    unit: str,
) -> jax.Array:
    """`custom` over the packed buffer, as an `(N, L)` slab like `jax.lax.all_gather`'s.

    A unit of one 16-bit float dtype packs its blocks as `uint16` bits (see the module
    docstring); the user's function sees them as that float dtype, which is free (a
    bitcast) and lets it compute on the values (e.g. cast them to float8).
    """
    dtypes = set(packing.dtypes)
    view = None
    if packing.carrier is None and len(dtypes) == 1:
        (only,) = dtypes
        if jnp.issubdtype(only, jnp.floating) and np.dtype(only).itemsize == packing.width:
            view = only
    buffer = jax.lax.bitcast_convert_type(flat, view) if view is not None else flat
    out = _custom.run("all-gather", custom, buffer, axes, (n * flat.shape[0],), unit)
    if view is not None:
        out = jax.lax.bitcast_convert_type(out, flat.dtype)
    return out.reshape(n, flat.shape[0])


# The name scope of the conditionals whose predicate is `_present`: equal (true) on every
# device, which the control-flow check of the root reads from this name.
PRESENT_SCOPE = "funshard_present_on_every_device"


def _present(axes: tuple[str, ...]) -> jax.Array:
    """A predicate that is true on every device but that the compiler cannot fold."""
    return jax.lax.axis_index(axes) < _mesh_axes_size(axes)


def _materialized(fn: Callable, operand, axes: tuple[str, ...]):
    """`fn(operand)` as buffers XLA must materialise: a fusion boundary.

    An `optimization_barrier` is the tool for this, and XLA GPU keeps it until after
    fusion. XLA CPU deletes every barrier before fusing, so on CPU `fn` runs inside a
    conditional instead, whose outputs are always materialised. Its predicate is true
    on every device but unknown to the compiler; the other branch never runs. (On GPU
    a conditional would cost a device-to-host sync, hence not everywhere.)

    `fn` must be a function that lives as long as its inputs' layout (see `_unpacker`):
    the branches are then the same objects for every unit of that layout, so JAX traces
    them once and reuses the jaxprs (tracing them anew in every unit of a deep model
    cost more than the rest of the unit's trace).
    """
    conditional, barrier = _boundary_branches(fn, axes)
    return jax.lax.platform_dependent(operand, cpu=conditional, default=barrier)


# Bounded: an evicted entry only costs a trace again.
@functools.lru_cache(maxsize=4096)
def _boundary_branches(fn: Callable, axes: tuple[str, ...]) -> tuple[Callable, Callable]:
    """The two platform branches of `_materialized(fn, ., axes)`, one pair per `fn`."""

    def barrier(x):
        return jax.lax.optimization_barrier(fn(x))

    def never(y):
        return jax.tree.map(jnp.zeros_like, fn(y))

    def conditional(x):
        with jax.named_scope(PRESENT_SCOPE):
            return jax.lax.cond(_present(axes), fn, never, x)

    return conditional, barrier


def _identity(x):
    return x


@functools.lru_cache(maxsize=4096)
def _unpacker(packing: Packing) -> Callable:
    """`unpack(., packing)` as one function per layout (see `_materialized`)."""
    return functools.partial(unpack, packing=packing)


def materialize(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` unchanged, as materialised buffers (see `_materialized`).

    XLA's fusion duplicates cheap elementwise producers into every consumer instead of
    storing their results: a residual stream `h + a + b + ...` written across many
    units is then recomputed from all its terms in every later unit's backward pass
    (work quadratic in the depth), and each recomputation keeps its inputs alive.
    Materialised unit outputs stop such chains at unit boundaries; the transpose of the
    boundary is again a boundary, so cotangents are materialised too.
    """
    leaves, treedef = jax.tree.flatten(tree)
    # Only values that differ per device (activations): the conditional's predicate
    # varies over `axes`, and its branches must type alike. A value already reduced
    # over the devices (a pmean'd statistic) is small and stays as it is.
    idx = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, jax.Array)
        and is_inexact_array(x)
        and x.size
        and set(axes) <= _jax_compat.varying_axes(x)
    ]
    if not idx:
        return tree
    kept = _materialized(_identity, [leaves[i] for i in idx], axes)
    for i, x in zip(idx, kept, strict=True):
        leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


def copy_out(gathered: jax.Array, packing: Packing, axes: tuple[str, ...]) -> list[jax.Array]:
    """`unpack` into separate, materialised leaf buffers (FSDP2's copy-out).

    A plain `unpack` leaves XLA free to fuse each slice of the gathered buffer into its
    consumers, including the backward pass's recomputation of cheap forward values (a
    bias add, a broadcast LayerNorm gain): that keeps the whole flat buffer of every
    unit alive from its forward to the end of the backward pass, i.e. all parameters
    gathered at once. Materialised (see `_materialized`), the leaves are buffers of
    their own and the flat buffer dies right after this copy.
    """
    with jax.named_scope("copy_out"):  # funshard/<unit>/all_gather/copy_out in profiles
        return _materialized(_unpacker(packing), gathered, axes)


def regather_group(
    part: jax.Array,
    packing: Packing,
    group: tuple[str, ...],
    dependency: jax.Array | None = None,
) -> list[jax.Array]:
    """Rebuilds the global arrays from the `part`s kept by `all_gather_blocks(keep_group=)`.

    Gathers only within `group` (k devices), not over all N.
    """
    part = tie_to(part, dependency)
    gathered = jax.lax.all_gather(part, group, axis=0, tiled=False)  # (k, N / k, L)
    return copy_out(gathered.transpose(1, 0, 2).reshape(-1, packing.total), packing, group)


def _scatter_sum(slab: jax.Array, shard_axes: tuple[str, ...]) -> jax.Array:
    """Row `i` of the sum of every device's `(N, cols)` slab, on device `i`: a reduce-scatter.

    XLA CPU's multi-process collectives (gloo) return wrong values at the end of rank
    0's reduce-scatter result, intermittently and silently, for results over ~256 KiB
    (jax-ml/jax#40830; reproduced here by benchmarks/torch_bench/collective_probe.py:
    1 of 20 reduce-scatters of 64 MiB wrong). There the sum is N - 1 collective
    permutes instead (`_scatter_sum_by_permutes`), which move a reduce-scatter's bytes.
    Elsewhere it is one reduce-scatter.

    "There" (`_jax_compat.collectives_over_gloo`) is decided at trace time (a
    multi-process job whose CPU collectives are gloo) and again per lowering platform
    (`platform_dependent`): only a CPU lowering takes the permutes, so a GPU program
    (NCCL) keeps its reduce-scatter even in a job whose CPU collectives are gloo.
    """

    def native(x):
        return jax.lax.psum_scatter(x, shard_axes, scatter_dimension=0, tiled=False)

    if not _jax_compat.cpu_collectives_over_gloo():
        return native(slab)

    def permutes(x):
        return _scatter_sum_by_permutes(x, shard_axes)

    return jax.lax.platform_dependent(slab, cpu=permutes, default=native)


def reduce_scatter_by_permutes(platform: str) -> bool:
    """Whether this process's reduce-scatters for `platform` run as collective permutes.

    True for CPU programs of a multi-process job whose CPU collectives are gloo (see
    `_scatter_sum`): there `reduce_scatter_rows`, given the rows apart, saves a copy per
    row.
    """
    return platform == "cpu" and _jax_compat.cpu_collectives_over_gloo()


def _scatter_sum_by_permutes(slab: jax.Array, shard_axes: tuple[str, ...]) -> jax.Array:
    """`_scatter_sum` as N - 1 collective permutes (`_sum_rows`), rows sliced out of
    `slab` here.

    Against the all-reduce that PyTorch's gloo backend uses for a reduce-scatter (also
    correct, twice the bytes) it moves half the bytes and takes about half the time, and
    XLA keeps one row-sized buffer (the row it sends) where the all-reduce keeps the whole
    slab (docs/benchmarks_design.md has the numbers). An all-to-all
    moves the same bytes, but XLA CPU first copies the slab into one buffer per row.
    """
    n = slab.shape[0]
    me = jax.lax.axis_index(shard_axes)
    rows = [jax.lax.dynamic_index_in_dim(slab, (me + k) % n, 0, keepdims=False) for k in range(n)]
    return _sum_rows(rows[0], rows[1:], shard_axes)


def _sum_rows(own: jax.Array, sends: Sequence[jax.Array], shard_axes: tuple[str, ...]) -> jax.Array:
    """This device's row of a reduce-scatter, from its rows for devices i, i+1, ... (mod N).

    At shift k every device sends `sends[k - 1]` (its row for device i + k) there and
    adds the row it receives from device i - k. So device i's sum is its own row, then
    the rows of devices i-1, i-2, ...: one fixed order per device, the same from run to
    run, and with 2 devices equal to any other order.
    """
    n = len(sends) + 1
    # 16-bit floats travel as their bits, as in a gather (`_carrier`): XLA CPU would
    # widen them to f32; a permute only moves them, so the bits are exact.
    width = own.dtype.itemsize if _carrier([own.dtype]) is None else None
    total = own
    for k, send in enumerate(sends, start=1):
        send = _to_words(send, width) if width else send
        got = jax.lax.ppermute(send, shard_axes, [(j, (j + k) % n) for j in range(n)])
        total = total + (_from_words(got, own.shape, own.dtype, width) if width else got)
    return total


def reduce_scatter_rows(
    rows: Sequence[Sequence[jax.Array]],
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
) -> list[jax.Array]:
    """Sums each flat leaf over devices from rows given apart, by collective permutes.

    `reduce_scatter_blocks` for flat leaves whose rows are separate arrays: the rows a
    device sends are read where they are, never first sliced out of one slab (see
    `_scatter_sum_by_permutes`, and `reduce_scatter_by_permutes` for where that pays).

    Args:
      rows: per leaf, this device's N rows (N = the size of `shard_axes`): its
        contribution to the result of device i, i+1, ... (mod N), its own first.
      shard_axes: mesh axes the result is scattered over.
      replicate_axes: mesh axes the scattered result is also summed over (HSDP).

    Returns:
      This device's row of each summed leaf: its own row, then those of devices i-1,
      i-2, ... (mod N) added in that order.
    """
    sums = []
    for parts in rows:
        total = _sum_rows(parts[0], parts[1:], shard_axes)
        sums.append(jax.lax.psum(total, replicate_axes) if replicate_axes else total)
    return sums


def reduce_scatter_blocks(
    fulls: Sequence[jax.Array],
    shard_axes: tuple[str, ...],
    replicate_axes: tuple[str, ...] = (),
    dims: Sequence[int] | None = None,
    custom: _custom.ReduceScatter | None = None,
    unit: str = "unshard",
) -> list[jax.Array]:
    """Sums each padded `(N * r_i, ...)` array over devices and keeps this device's rows.

    Leaves sharing a dtype go through ONE reduce-scatter over `shard_axes` (and, for
    HSDP, one all-reduce of the scattered result over `replicate_axes`). That all-reduce
    is the step's only sum over the replicate axes: it runs in the dtype of `fulls` (the
    policy's `reduce_dtype`), once per unit, and leaves the result typed like the local
    shard, so neither autodiff nor the unit's `custom_vjp` adds another.

    Args:
      fulls: this device's padded full-size contribution to each leaf, already in the
        dtype the reduction should run in.
      shard_axes: mesh axes the result is scattered over (N devices).
      replicate_axes: mesh axes the scattered result is summed over.
      dims: the dimension each leaf is scattered on (default: all 0).
      custom: the unit's own reduce-scatter, run once per dtype in place of the
        default's (the HSDP all-reduce stays).
      unit: the unit's name, for a custom reduce-scatter's errors.

    Returns:
      This device's block of each summed leaf.
    """
    n = _mesh_axes_size(shard_axes)
    dims = tuple(dims) if dims is not None else (0,) * len(fulls)
    fulls = [jnp.moveaxis(f, d, 0) if d else f for f, d in zip(fulls, dims, strict=True)]
    out: list[jax.Array | None] = [None] * len(fulls)
    groups: dict[np.dtype, list[int]] = {}
    for i, full in enumerate(fulls):
        groups.setdefault(np.dtype(full.dtype), []).append(i)
    for idx in groups.values():
        cols = [fulls[i].reshape(n, -1) for i in idx]
        slab = jnp.concatenate(cols, axis=1) if len(cols) > 1 else cols[0]
        if slab.size == 0:
            # Typed as the reduce-scatter's result would be: varying over the shard axes
            # (and whatever else the cotangent varies over but the reduction sums away).
            varying = _jax_compat.varying_axes(slab) - set(replicate_axes)
            flat = vary(jnp.zeros((slab.shape[1],), slab.dtype), sorted(varying | set(shard_axes)))
        else:
            if custom is None:
                flat = _scatter_sum(slab, shard_axes)
            else:
                buffer = slab.reshape(-1)
                flat = _custom.run(
                    "reduce-scatter", custom, buffer, shard_axes, (slab.shape[1],), unit
                )
                flat = vary(flat, shard_axes)
            if replicate_axes:
                flat = jax.lax.psum(flat, replicate_axes)
        start = 0
        for i, col in zip(idx, cols, strict=True):
            rows = fulls[i].shape[0] // n
            block = flat[start : start + col.shape[1]].reshape(rows, *fulls[i].shape[1:])
            out[i] = jnp.moveaxis(block, 0, dims[i]) if dims[i] else block
            start += col.shape[1]
    return out  # type: ignore[return-value]


def _mesh_axes_size(axes: tuple[str, ...]) -> int:
    return int(np.prod([jax.lax.axis_size(a) for a in axes]))
