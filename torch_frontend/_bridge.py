"""The DLPack bridge: torch tensors of this rank <-> the core's eager collectives.

Private adapter over funshard's eager collectives (`funshard.comm.eager_all_gather`,
`eager_reduce_scatter`, `eager_reduce_scatter_rows`: the same `all_gather_blocks` /
`reduce_scatter_blocks` as the functional step). Every tensor crosses without a copy: a
process-local torch buffer becomes this device's block of a global `jax.Array`
(`funshard.comm.global_array`), and the results come back as torch views of JAX's own
buffers. Those results are immutable on the JAX side, so callers never write into them
in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import jax
import numpy as np
import torch
from jax.sharding import Mesh
from torch.autograd import Variable

from funshard import comm, errors
from funshard.comm import REPLICATE_AXIS, SHARD_AXIS
from torch_frontend import _cuda
from torch_frontend._recorder import Recorder
from torch_frontend._worker import OrderedWorker

DEBUG_ENV = "TORCH_DISTRIBUTED_DEBUG"
DIGESTS_ENV = "FUNSHARD_COLLECTIVE_DIGESTS"


def check_collective(layout: RankLayout, kind: str, label: str, leaves: list[tuple]) -> None:
    """Raises unless every process of `layout` issues the same collective now.

    The signature is the collective's kind, the unit it serves and its operands'
    (shape, dim, dtype): two units of the same shapes differ by name.

    Raises:
      RuntimeError: (`funshard.errors.DistributedError`) another process issues a
        different collective at this point, or left the job.
      TimeoutError: (`funshard.errors.DistributedTimeoutError`) another process has
        not issued one within the departure timeout.
    """
    processes = {d.process_index for d in layout.mesh.devices.flat}
    nouns = (f"tensor for the {kind} of {label}", f"tensors for the {kind} of {label}")
    try:
        comm.same_collective(f"torch_frontend's {kind} of {label}", leaves, processes, nouns)
    except (errors.DistributedError, errors.DistributedTimeoutError) as exc:
        raise type(exc)(_different_collectives(str(exc))) from None


def _different_collectives(detail: str) -> str:
    return (
        f"torch_frontend ({DEBUG_ENV}=DETAIL): the ranks do not issue the same "
        "collectives (a module that runs on some ranks only, a rank-dependent branch, an "
        "extra forward on one rank): without this check gloo pairs them anyway, and "
        f"aborts on a size mismatch or computes with another unit's shards. {detail}"
    )


class CommContext:
    """Launches this process's collectives on one thread, in call order.

    JAX's CPU client runs a collective-only program inline (it dispatches only
    expensive programs asynchronously), so a prefetched gather overlaps torch's compute
    only from another thread. Every process must launch its collectives in the same
    order, so ONE context serves all of a process's roots (`init_distributed` makes
    it and every group's `RankLayout` carries it): two roots issuing on threads of their
    own (a GAN's two models, each prefetching) could interleave their collectives
    differently on different ranks.
    """

    def __init__(self):
        # funshard's worker, not a ThreadPoolExecutor: its futures give up (RuntimeError)
        # on a process that left the job, and its daemon thread, stuck in a collective
        # with such a process, never holds up the interpreter's exit.
        # Every collective is recorded as submitted; a stalled wait compares the ranks'
        # records (`_recorder`), and so does an all-gather whose digests differ.
        self.recorder = Recorder()
        self._thread = OrderedWorker("torch_frontend", self.recorder.stalled)
        # The digest riding in the first all-gather of each root forward (one float32
        # per rank: in every gather it cost 8 to 18% of a step, once per step under 1%;
        # benchmarks/torch_bench/mismatch_cost.py). The end of each backward compares
        # the digests through torch's TCPStore (`agree`): not in a collective,
        # since where the ranks' histories differ in length a digest-carrying one pairs
        # with another of another size, and gloo aborts the process.
        # DIGESTS_ENV=0 leaves both out.
        self.digests = os.environ.get(DIGESTS_ENV, "1") != "0"
        self._digest_next = False
        # Set once the ranks' digests differed: their histories no longer pair, so
        # every later collective fails with the same message instead of running (gloo
        # aborts the process on a pair of different sizes): those already queued (a
        # prefetch) and those of a script that catches the error and goes on.
        self.mismatched: str | None = None
        self._agree_thread: OrderedWorker | None = None
        self._agreeing: Future | None = None
        self._count_step = comm.count_step
        # Started reduce-scatters, oldest first: (future, what writes their gradients).
        self._held: list[tuple[Future | None, Callable[[], None]]] = []
        # How many may be in flight at a group's post-backward (FSDP2's cap-K,
        # `set_reduce_scatter_max_input_buffers`; resolved per iteration by the root).
        self.reduce_scatter_max_input_buffers = 1
        self._finish_queued = False
        # torch's switch for checking that every rank issues the same collective
        # (its ProcessGroupWrapper): here each collective's signature is compared
        # first, through JAX's coordination service (`check_collective`).
        self.check_collectives = os.environ.get(DEBUG_ENV, "").upper() == "DETAIL"
        self._label: str | None = None
        self._missing: tuple[str, ...] = ()

    def label_next(self, label: str, missing: Sequence[str] = ()) -> None:
        """Names the next collective for the records and `check_collectives`' messages.

        `missing`: the parameters a reduce-scatter leaves out (no gradient on this rank).
        """
        self._label, self._missing = label, tuple(missing)

    def digest_next(self) -> None:
        """Makes the next all-gather carry the records' digest (a root's forward starts)."""
        self._digest_next = self.digests

    def start_agree(self) -> None:
        """Starts comparing the ranks' digests (`Recorder.agree`), once a backward has
        issued its last collective: on a thread of its own, so that its two requests
        to torch's store overlap the last reduce-scatter's wait."""
        if not self.digests or self.mismatched is not None or comm.board() is None:
            return
        if self._agree_thread is None:
            self._agree_thread = OrderedWorker("torch_frontend-digests")
        self._agreeing = self._agree_thread.submit(self.recorder.agree)

    def agree(self) -> None:
        """Waits for `start_agree`'s comparison, if one is running.

        Raises:
          DistributedError: the ranks issued different collectives.
        """
        pending, self._agreeing = self._agreeing, None
        error = None if pending is None else pending.result()
        if error is not None:
            self.mismatched = error
            raise errors.DistributedError(error)

    def take_label(self, default: str) -> str:
        label, self._label = self._label, None
        return label or default

    def submit_checked(
        self, layout: RankLayout, kind: str, leaves: Callable[[], list[tuple]], fn, *args
    ) -> Future:
        """`submit(fn, *args)`; first, with `check_collectives`, the signature check.

        The check runs on the collective thread, right before the collective, so it
        sees the collectives in the order every process issues them. Every collective
        is recorded first (`_recorder`); after `digest_next`, in a multi-process job,
        the next all-gather is passed the records' digest (`digest=`), to gather with
        the values.
        """
        label = self.take_label("torch_frontend")
        missing, self._missing = self._missing, ()
        operands = leaves()
        digest = self.recorder.record(kind, label, operands, _group_of(layout), missing)
        if kind == "all-gather" and self._digest_next and comm.board() is not None:
            self._digest_next = False
            fn = functools.partial(fn, digest=digest)
        if not self.check_collectives:
            return self.submit(fn, *args)

        def checked():
            check_collective(layout, kind, label, operands)
            return fn(*args)

        return self.submit(checked)

    def submit(self, fn, *args, **kwargs) -> Future:
        """Queues `fn` behind every collective launched before it; returns its future."""
        return self._thread.submit(self._unless_mismatched, fn, *args, **kwargs)

    def _unless_mismatched(self, fn, *args, **kwargs):
        if self.mismatched is not None:
            raise errors.DistributedError(self.mismatched)
        return fn(*args, **kwargs)

    def in_order(self, fn, *args, **kwargs):
        """Runs `fn` on the collective thread, after every collective launched before it.

        For work that runs collectives of its own (a checkpoint's barriers and reads):
        queued behind any prefetched gather, it keeps one launch order on every process.
        """
        return self.submit(fn, *args, **kwargs).result()

    def hold_reduce(self, pending: Future | None, finish: Callable[[], None]) -> None:
        """Keeps a started reduce-scatter in flight, behind those held before.

        As FSDP2's, by default at most one reduce-scatter is in flight: it overlaps the
        backward of the next group, and the gradients it reads are freed once it
        completes. A group's post-backward calls `finish_reduce(keep=cap - 1)` before
        it packs its own gradients (`reduce_scatter_max_input_buffers` is the cap), so
        at most `cap` flat buffers are alive together; this call completes the oldest
        beyond that, for callers that did not.

        Args:
          pending: the started reduce-scatter (None: nothing to wait for).
          finish: called by `finish_reduce` once `pending` is done (it reads the
            result and writes the gradients).
        """
        self.finish_reduce(keep=max(0, self.reduce_scatter_max_input_buffers - 1))
        self._held.append((pending, finish))

    def finish_reduce(self, keep: int = 0) -> None:
        """Completes held reduce-scatters, oldest first, until `keep` remain in flight.

        Each writes its gradients as it completes.
        """
        while len(self._held) > keep:
            self._held.pop(0)[1]()

    def finish_after_backward(self) -> None:
        """Makes the running backward end with `finish_reduce` (queued once per backward).

        The root's final callback finishes it too, but a group run on its own (one
        module of a grouped `fully_shard`, whose post-forward never ran) queues none.
        """
        if not self._finish_queued:
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self._finish_queued_reduce)

    def _finish_queued_reduce(self) -> None:
        self._finish_queued = False
        self._count_step("backward pass")  # named when a process leaves the job early
        self.finish_reduce()

    def drop_reduce(self) -> None:
        """Waits for the held reduce-scatters, if any, and discards their results."""
        self._finish_queued = False
        held, self._held = self._held, []
        for pending, _ in held:
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending.result()


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Where this process sits on the mesh (static per mesh); each parameter's own layout
    is a `funshard.comm.Layout` (see `torch_frontend._checkpoint._leaf_layout`).

    Attributes:
      mesh: the mesh, one device per process.
      device: this process's device in it.
      shard_axes: axes parameters are sharded over (world = their size).
      replicate_axes: HSDP axes gradients are all-reduced over (empty for FSDP).
      rank: this device's position along `shard_axes` (its torch.chunk index).
      world: number of shards.
      data_parallel: devices gradients are averaged over (all of the mesh).
      comm: the process's collective launcher (not part of the layout's identity).
    """

    mesh: Mesh
    device: jax.Device
    shard_axes: tuple[str, ...]
    replicate_axes: tuple[str, ...]
    rank: int
    world: int
    data_parallel: int
    comm: CommContext = dataclasses.field(compare=False, repr=False)

    def padded_rows(self, rows: int) -> int:
        """Rows each rank stores for a dim 0 of `rows` (torch.chunk's chunk size)."""
        return comm.rows_per_shard(rows, self.world)

    def local_rows(self, rows: int) -> int:
        """Rows of `torch.chunk(p, world, dim=0)[rank]` (possibly 0)."""
        return self.chunk(rows)[1]

    def chunk(self, rows: int) -> tuple[int, int]:
        """`(start, count)` of this rank's rows of a dim of `rows` (torch.chunk's)."""
        return comm.chunk(rows, self.world, self.rank)

    def padded_size(self, rows: int) -> int:
        """A dim of `rows` zero-padded to `world * padded_rows(rows)`."""
        return comm.padded_size(rows, self.world)


@functools.cache
def _group_of(layout: RankLayout) -> tuple[int, ...]:
    """The processes of this process's data-parallel group on `layout.mesh`: those whose
    devices differ from its own on the shard and replicate axes only."""
    devices = layout.mesh.devices
    (where,) = np.argwhere(devices == layout.device)
    data = {*layout.shard_axes, *layout.replicate_axes}
    sel = tuple(
        slice(None) if name in data else int(i)
        for name, i in zip(layout.mesh.axis_names, where, strict=True)
    )
    return tuple(sorted(d.process_index for d in np.asarray(devices[sel]).flat))


def layout_of(mesh: Mesh, comm: CommContext) -> RankLayout:
    """This process's `RankLayout` on `mesh`, launching its collectives through `comm`.

    Raises:
      TypeError: `mesh` is not a jax Mesh.
      ValueError: the mesh lacks the "fsdp" axis, or this process has no device or
        several devices in it.
    """
    if not isinstance(mesh, Mesh):
        raise errors.ShardingTypeError(_not_a_jax_mesh(mesh))
    if SHARD_AXIS not in mesh.axis_names:
        raise errors.ShardingValueError(_lacks_shard_axis(mesh))
    mine = [
        idx for idx, d in np.ndenumerate(mesh.devices) if d.process_index == jax.process_index()
    ]
    if len(mine) != 1:
        raise errors.ShardingValueError(_devices_per_process(len(mine)))
    idx = mine[0]
    replicate = (REPLICATE_AXIS,) if REPLICATE_AXIS in mesh.axis_names else ()
    position = idx[mesh.axis_names.index(SHARD_AXIS)]
    device = mesh.devices[idx]
    return RankLayout(
        mesh,
        device,
        (SHARD_AXIS,),
        replicate,
        int(position),
        mesh.shape[SHARD_AXIS],
        mesh.devices.size,
        comm,
    )


def _not_a_jax_mesh(mesh) -> str:
    return (
        f"fully_shard: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
        "pass the mesh torch_frontend.init_distributed() returns (or mesh=None)."
    )


def _lacks_shard_axis(mesh: Mesh) -> str:
    return (
        f"fully_shard: mesh axes {mesh.axis_names} lack the {SHARD_AXIS!r} axis; build "
        "the mesh with torch_frontend.init_distributed() or funshard.make_mesh()."
    )


def _devices_per_process(count: int) -> str:
    return (
        f"fully_shard: process {jax.process_index()} has {count} devices in the mesh; "
        "the torch frontend needs exactly one per process (one rank, one shard). Use "
        "the mesh torch_frontend.init_distributed() returns."
    )


HPZ_INNER_AXIS = "hpz_inner"
HPZ_OUTER_AXIS = "hpz_outer"


@functools.cache
def hpz_layout(layout: RankLayout, k: int) -> RankLayout:
    """The layout of the hpZ groups of `k` consecutive ranks (FSDP2's post-forward mesh).

    The shard axis is split into (world / k, k): ranks `k*j .. k*j + k - 1` form a group
    (as FSDP2's `mesh.view(-1, k)`), and the backward's gather runs over the inner axis
    only, each rank contributing its 1/k part of the gathered parameters. Cached so that
    the compiled gather is reused.
    """
    shard = layout.mesh.axis_names.index(SHARD_AXIS)
    devices = np.moveaxis(layout.mesh.devices, shard, -1)
    lead = devices.shape[:-1]
    devices = devices.reshape(*lead, layout.world // k, k)
    names = tuple(a for a in layout.mesh.axis_names if a != SHARD_AXIS)
    mesh = Mesh(
        devices,
        (*names, HPZ_OUTER_AXIS, HPZ_INNER_AXIS),
        axis_types=layout.mesh.axis_types[:1] * devices.ndim,
    )
    return dataclasses.replace(
        layout, mesh=mesh, shard_axes=(HPZ_INNER_AXIS,), rank=layout.rank % k, world=k
    )


def _import(layout: RankLayout, tensor: torch.Tensor) -> jax.Array:
    """`tensor` as a single-device jax.Array on this process's device, sharing memory.

    A CUDA tensor must be on this process's GPU; JAX's reads wait for torch's current
    stream (DLPack's stream argument, in `funshard.comm.dlpack_import`).

    Raises:
      ValueError: `tensor` is on another device than this process's JAX device.
    """
    tensor = tensor.detach()
    if not tensor.is_cuda:
        return comm.dlpack_import(tensor, layout.device)
    _cuda.check_same_device(tensor, layout.device)
    _cuda.RETIREMENT.release_finished()
    with _cuda.importing(tensor):
        return comm.dlpack_import(tensor, layout.device)


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """A 64-bit tensor's bits as int32 pairs on a new last axis (a view); others as they are.

    JAX without x64 would narrow 64-bit values to 32 bits on import; a gather moves
    the pairs exactly, and `from_words` views them back.
    """
    if tensor.element_size() != 8:
        return tensor
    return tensor.unsqueeze(-1).view(torch.int32)


def from_words(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `as_words` for a tensor gathered as int32 pairs of `dtype` (a view)."""
    if dtype.itemsize != 8 or tensor.dtype == dtype:
        return tensor
    return tensor.view(dtype).squeeze(-1)


def global_block(layout: RankLayout, padded: torch.Tensor, dim: int = 0) -> jax.Array:
    """This rank's padded block as its part of the global array sharded on `dim`.

    The result aliases `padded`'s memory, so a caller may keep it and gather it again
    after torch updated `padded` in place (the optimizer step). The caller must not
    write `padded` while a gather of it is in flight (`finish_all_gather` ends it).
    A 64-bit block crosses as int32 pairs (`as_words`); `from_words` restores it.
    """
    block = _import(layout, as_words(padded))
    return comm.global_array(block, layout.mesh, layout.shard_axes, dim)


def _export(block: jax.Array) -> torch.Tensor:
    """JAX's buffer `block` as a torch view; on a GPU stream-ordered (`_cuda.export`)."""
    return _cuda.export(block)


def _gather_now(
    layout: RankLayout,
    blocks: Sequence[jax.Array],
    rows: Sequence[int],
    dims: Sequence[int] | None,
    digest: int | None = None,
) -> list[jax.Array]:
    """The all-gather, on the collective thread; with `digest` (this process's records'),
    gathered beside the values and compared: ranks whose digests differ raise, each
    naming every rank's collective (`_recorder.Recorder.mismatch`)."""
    if digest is not None:
        blocks, rows = [*blocks, _digest_block(layout, digest)], [*rows, layout.world]
        dims = None if dims is None else [*dims, 0]
    fulls = comm.eager_all_gather(blocks, layout.mesh, layout.shard_axes, rows=rows, dims=dims)
    outs = jax.block_until_ready([f.addressable_shards[0].data for f in fulls])
    if digest is not None:
        _same_digests(layout, outs.pop())
    return outs


def _digest_block(layout: RankLayout, digest: int) -> jax.Array:
    """23 bits of `digest` as this rank's float32 in [1, 2), exact: a float block like
    the flat buffers beside it (an int32 one made the whole gather travel as raw words)."""
    value = 1.0 + (digest & 0x7FFFFF) * 2.0**-23
    return global_block(layout, torch.tensor([value], dtype=torch.float32))


def _same_digests(layout: RankLayout, gathered: jax.Array) -> None:
    """Raises, naming every rank's collective, where the `gathered` digests differ."""
    digests = [round((v - 1.0) * 2**23) for v in np.asarray(gathered).tolist()]
    if len(set(digests)) > 1:
        layout.comm.mismatched = layout.comm.recorder.mismatch(digests)
        raise errors.DistributedError(layout.comm.mismatched)


def start_all_gather(
    layout: RankLayout,
    blocks: Sequence[jax.Array],
    rows: Sequence[int],
    dims: Sequence[int] | None = None,
) -> Future:
    """Starts ONE all-gather of every rank's padded blocks and returns at once.

    It runs on the collective thread while torch computes: this is FSDP2's prefetch.

    Args:
      layout: this process's place on the mesh.
      blocks: each tensor's global array from `global_block`.
      rows: each tensor's full size on its sharded dimension (the padding is cut off).
      dims: each tensor's sharded dimension (default: all 0).

    Returns:
      A future of the gathered arrays, for `finish_all_gather`.
    """

    def leaves():  # the operands' (shape, dim, dtype), for the records
        return [
            (tuple(b.shape), 0 if dims is None else dims[i], str(b.dtype))
            for i, b in enumerate(blocks)
        ]

    return layout.comm.submit_checked(
        layout, "all-gather", leaves, _gather_now, layout, blocks, rows, dims
    )


def finish_all_gather(pending: Future) -> list[torch.Tensor]:
    """Waits for `start_all_gather`'s result; returns the full tensors.

    Returns:
      Each full tensor, a torch view of the gathered JAX buffer (read-only by contract).
    """
    return [_export(b) for b in pending.result()]


def padded_full(layout: RankLayout, full: torch.Tensor, dim: int) -> torch.Tensor:
    """`full` zero-padded to `world * padded_rows` on `dim`, contiguous (maybe `full`)."""
    padded_rows = layout.padded_size(full.shape[dim])
    if padded_rows == full.shape[dim] and full.is_contiguous():
        return full
    shape = list(full.shape)
    shape[dim] = padded_rows
    block = full.new_zeros(shape)
    block.narrow(dim, 0, full.shape[dim]).copy_(full)
    return block


def _stacked_block(layout: RankLayout, full: torch.Tensor, dim: int) -> torch.Tensor:
    """`full` zero-padded to `world * padded_rows` on `dim`, with a leading axis of 1."""
    return padded_full(layout, full, dim).unsqueeze(0)


# XLA CPU imports a DLPack buffer without a copy only if it starts 64-byte aligned
# (measured: a float32 view at 16 elements in aliases its tensor, at 4 or 8 it is copied).
ALIGN_BYTES = 64


def row_align(layout: RankLayout, dtype: torch.dtype) -> int:
    """Elements a flat gradient's rows are rounded to for `start_reduce_scatter` (1: none).

    Where the reduce-scatter runs by rows (`comm.reduce_scatter_by_permutes`), each row
    of the flat buffer crosses as its own DLPack import, which must be aligned to cross
    without a copy.
    """
    if not comm.reduce_scatter_by_permutes(layout.device.platform):
        return 1
    return max(1, ALIGN_BYTES // dtype.itemsize)


def start_reduce_scatter(
    layout: RankLayout,
    fulls: Sequence[torch.Tensor],
    dims: Sequence[int] | None = None,
    all_reduce: bool = True,
) -> Future:
    """Starts ONE reduce-scatter (sum) of every rank's full tensors and returns at once.

    It runs on the collective thread while torch computes the rest of the backward
    (FSDP2's asynchronous reduce-scatter). `fulls` must not be written until
    `finish_reduce_scatter` returns: JAX reads them in place.

    Where CPU collectives run over gloo, flat (1-D) tensors cross as their N rows
    (`comm.eager_reduce_scatter_rows`): the rows a rank sends are read in place, where
    the stacked form would copy each first (one row-sized buffer per reduce-scatter,
    25 MiB per block of the 51M benchmark model). Rows start aligned when the caller
    rounded them (`row_align`); others are copied by the import, with the same result.

    Args:
      layout: this process's place on the mesh.
      fulls: this rank's contribution to each tensor (full shape, reduce dtype); on an
        HSDP mesh the scattered sums are also summed over the replicas.
      dims: each tensor's sharded dimension (default: all 0).
      all_reduce: False skips the HSDP all-reduce: the result is this replica's sum.

    Returns:
      A future of this rank's blocks, for `finish_reduce_scatter`.
    """
    dims = tuple(dims) if dims is not None else (0,) * len(fulls)

    def leaves():  # the operands' (shape, dim, dtype), for the records
        return [(tuple(f.shape), d, str(f.dtype)) for f, d in zip(fulls, dims, strict=True)]

    if comm.reduce_scatter_by_permutes(layout.device.platform) and all(
        full.dim() == 1 and dim == 0 for full, dim in zip(fulls, dims, strict=True)
    ):
        rows = [_rows(layout, padded_full(layout, full, 0)) for full in fulls]
        return layout.comm.submit_checked(
            layout, "reduce-scatter", leaves, _reduce_rows_now, layout, rows, all_reduce
        )
    stacked = [
        _contribution(layout, _stacked_block(layout, full, dim))
        for full, dim in zip(fulls, dims, strict=True)
    ]
    return layout.comm.submit_checked(
        layout, "reduce-scatter", leaves, _reduce_now, layout, stacked, dims, all_reduce
    )


def _contribution(layout: RankLayout, block: torch.Tensor) -> jax.Array:
    """`block` (leading axis 1) as this rank's part of a global `(W, ...)` array.

    Its leading axis is split over every data-parallel axis (W devices), the form the
    eager reduce-scatters take each rank's contribution in.
    """
    dp_axes = (*layout.replicate_axes, *layout.shard_axes)
    return comm.global_array(_import(layout, block), layout.mesh, dp_axes)


def _rows(layout: RankLayout, flat: torch.Tensor) -> list[jax.Array]:
    """`flat`'s rows for ranks r, r+1, ... (mod world), each a global `(W, cols)` array."""
    cols = flat.numel() // layout.world
    starts = [(layout.rank + k) % layout.world * cols for k in range(layout.world)]
    return [_contribution(layout, flat.narrow(0, start, cols).unsqueeze(0)) for start in starts]


def finish_reduce_scatter(pending: Future) -> list[torch.Tensor]:
    """Waits for `start_reduce_scatter`'s result.

    Returns:
      This rank's `padded_rows` block of each sum on its dimension (padding last), a
      torch view of JAX's buffer (read-only by contract).
    """
    return [_export(b) for b in pending.result()]


def _reduce_now(layout: RankLayout, stacked: Sequence[jax.Array], dims, all_reduce: bool):
    sums = comm.eager_reduce_scatter(
        stacked, layout.mesh, layout.shard_axes, layout.replicate_axes, dims, all_reduce
    )
    return jax.block_until_ready([s.addressable_shards[0].data for s in sums])


def _reduce_rows_now(layout: RankLayout, rows: Sequence[Sequence[jax.Array]], all_reduce: bool):
    sums = comm.eager_reduce_scatter_rows(
        rows, layout.mesh, layout.shard_axes, layout.replicate_axes, all_reduce
    )
    return jax.block_until_ready([s.addressable_shards[0].data for s in sums])
