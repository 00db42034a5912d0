"""Per-process rows into one global batch: `shard_batch`, and the check that they fit.

`shard_batch` assembles each process's own rows into one global batch without any
host-to-host copy; in a multi-process job it first compares every process's batch
(tree, rows, trailing shapes, dtypes) through JAX's coordination service, so that a
mismatch raises the same error on every process. See docs/distributed.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import KeyPath, keystr, tree_flatten_with_path, tree_unflatten

from funshard import _jax_compat, _text, comm, errors

# How long shard_batch waits for the other processes' batches before it goes on unchecked.
BATCH_CHECK_WAIT_S = 10.0


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data-parallel axes: ("replicate", "fsdp") or ("fsdp",)."""
    return tuple(a for a in (comm.REPLICATE_AXIS, comm.SHARD_AXIS) if a in mesh.axis_names)


def _local_positions(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many distinct batch blocks (positions along `axes`) this process's devices hold."""
    me, where = jax.process_index(), [mesh.axis_names.index(a) for a in axes]
    return len(
        {
            tuple(idx[i] for i in where)
            for idx, device in np.ndenumerate(mesh.devices)
            if device.process_index == me
        }
    )


def _local_batch_not_array(path: KeyPath, leaf: Any) -> str:
    return (
        f"{_text.where('shard_batch', path)} is a {type(leaf).__name__}, not an array; pass a "
        "numpy or jax array of this process's rows."
    )


def _local_batch_scalar(path: KeyPath) -> str:
    return (
        f"{_text.where('shard_batch', path)} is a scalar; every batch leaf needs a leading row "
        "dimension (pass replicated values as extra arguments)."
    )


def _as_rows(path: KeyPath, leaf: Any) -> Any:
    if not isinstance(leaf, jax.Array):
        if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, bool, complex)):
            raise errors.ShardingTypeError(_local_batch_not_array(path, leaf))
        leaf = np.asarray(leaf)
    if leaf.ndim == 0:
        raise errors.ShardingValueError(_local_batch_scalar(path))
    return leaf


def _shard_batch_not_mesh(mesh: object) -> str:
    return (
        f"shard_batch: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
        "use the mesh funshard.distributed.initialize() returned."
    )


def _shard_batch_no_data_axes(mesh_axes: Sequence[str], axes: tuple[str, ...]) -> str:
    return (
        f"shard_batch: mesh axes {tuple(mesh_axes)} lack the data-parallel axes "
        f"{axes or ('fsdp',)}; pass axes=... naming the axes the batch is split over."
    )


def _shard_batch_no_local_device(rank: int) -> str:
    return (
        f"shard_batch: process {rank} has no device in the mesh; build the mesh over "
        "every process's devices (funshard.distributed.initialize())."
    )


def _local_batch_uneven(path: KeyPath, rows: int, local: int) -> str:
    return (
        f"{_text.where('shard_batch', path)} has {rows} rows, which do not split over this "
        f"process's {local} data-parallel devices; give each process a multiple of "
        f"{local} rows."
    )


def shard_batch(
    local_batch: Any,
    mesh: Mesh,
    *,
    axes: str | Sequence[str] | None = None,
    check: bool = True,
) -> Any:
    """Assembles every process's own rows into one global batch, sharded on dim 0.

    No process sees another's rows: each leaf becomes a global `jax.Array` built with
    `jax.make_array_from_process_local_data`, its leading dimension split over the
    mesh's data-parallel axes. Rows are ordered by process (process 0's rows first),
    which is the mesh's device order when it comes from `initialize`.

    Args:
      local_batch: a pytree of numpy / jax arrays; each leading dimension is this
        process's share of the global batch (the same size on every process).
      mesh: the global mesh (from `initialize` or `funshard.make_mesh`).
      axes: mesh axes dim 0 is split over (default: ("replicate", "fsdp") on an HSDP
        mesh, else ("fsdp",)).
      check: in a multi-process job, first compare every process's tree, row counts,
        trailing shapes and dtypes through JAX's coordination service (three small
        messages per call, no device work, no barrier: a process waits at most 10 s for
        the others' batches). Every process must call `shard_batch` equally often.
        False skips it, for a data pipeline known to be consistent.

    Returns:
      The same pytree of global arrays, each with `num_processes` times the rows.

    Raises:
      ValueError: a leaf is a scalar, or its rows do not split evenly over this
        process's devices, or the mesh has no data-parallel axis, or (on every
        process) the processes' batches differ in structure, rows, shapes or dtypes.
      TypeError: `mesh` is not a `jax.sharding.Mesh`, or a leaf is not an array.
      RuntimeError: (with `check`) another process left the job after fewer
        `shard_batch` calls than this one has made: it will never join this step.
    """
    if not isinstance(mesh, Mesh):
        raise errors.ShardingTypeError(_shard_batch_not_mesh(mesh))
    comm.count_step("shard_batch call")
    axes = data_axes(mesh) if axes is None else comm.as_axes(axes)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise errors.ShardingValueError(_shard_batch_no_data_axes(mesh.axis_names, axes))
    with_path, treedef = tree_flatten_with_path(local_batch)
    if check and jax.process_count() > 1:
        # Before any check of this process alone: a mismatch must raise on every
        # process, not leave the others waiting for one that already raised.
        _check_same_batch(_signature(with_path), BATCH_CHECK_WAIT_S)
    local = _local_positions(mesh, axes)
    if not local:
        raise errors.ShardingValueError(_shard_batch_no_local_device(jax.process_index()))
    world = comm.axes_size(mesh, axes)
    sharding = NamedSharding(mesh, comm.spec(axes))
    out = []
    for path, leaf in with_path:
        leaf = _as_rows(path, leaf)
        if leaf.shape[0] % local:
            raise errors.ShardingValueError(_local_batch_uneven(path, leaf.shape[0], local))
        global_shape = (leaf.shape[0] // local * world, *leaf.shape[1:])
        out.append(jax.make_array_from_process_local_data(sharding, leaf, global_shape))
    return tree_unflatten(treedef, out)


def _signature(with_path: list[tuple[KeyPath, Any]]) -> list[tuple[str, Any]]:
    """[(keystr path, [shape, dtype] or a type name)]: what must agree across processes."""
    described: list[tuple[str, Any]] = []
    for path, leaf in with_path:
        if isinstance(leaf, (int, float, bool, complex)):
            leaf = np.asarray(leaf)
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            described.append((keystr(path), [list(leaf.shape), str(leaf.dtype)]))
        else:
            described.append((keystr(path), type(leaf).__name__))
    return described


# Numbers this process's shard_batch calls; each call's keys carry it, so that every
# process compares with the others' batch of the same step.
_batch_calls = itertools.count()


def _leaf_text(described: Any, groups: Mapping[Any, list[int]]) -> str:
    """ "8 rows" where only the row counts differ, else "float32 (8, 3)"."""
    if described == "absent":
        return described
    if not isinstance(described, tuple):
        return f"a {described}, not an array,"
    arrays = [d for d in groups if isinstance(d, tuple)]
    if (
        len(arrays) == len(groups)
        and all(
            len(d[0]) >= 1 and d[0][1:] == described[0][1:] and d[1] == described[1] for d in arrays
        )
        and described[0]
    ):
        return f"{described[0][0]} rows"
    return f"{described[1]} {tuple(described[0])}"


def _batch_differs_across_processes(signatures: Mapping[int, list[tuple[str, Any]]]) -> str:
    """`signatures`: rank -> [(keystr path, (shape, dtype) or a type name)] of its leaves."""
    by_path: dict = {}
    for rank, leaves in signatures.items():
        for path, described in leaves:
            by_path.setdefault(path, {})[rank] = described
    lines = []
    for path, per_rank in by_path.items():
        groups: dict = {}
        for rank in signatures:
            groups.setdefault(per_rank.get(rank, "absent"), []).append(rank)
        if len(groups) > 1:
            listing = "; ".join(
                f"{_leaf_text(d, groups)} on {_text.process_list(r)}" for d, r in groups.items()
            )
            lines.append(f"  local_batch{path}: {listing}")
    return (
        "shard_batch: the processes passed batches that do not fit together:\n"
        + "\n".join(lines)
        + "\nEvery process must pass the same tree with the same number of rows, trailing "
        "shape and dtype per leaf (drop or pad a last partial batch on every process alike)."
    )


def _check_same_batch(signature: list, wait_s: float) -> None:
    """Raises the same ValueError on every process when their batches do not fit together.

    The processes agree on a digest of their signatures (`comm.agree_on_digest`); only
    on a mismatch do the full signatures travel (`comm.exchange_texts`).

    The others wait at most `wait_s`, never at a collective barrier: a process that
    died would hold that barrier until its heartbeat times out (100 s by default),
    where the next collective fails at once. A process more than `wait_s` behind the
    others still gets the verdict (it arrives last) and raises; the others then fail
    in their next collective with it, as they would without the check.
    """
    client = _jax_compat.coordination_client()
    if client is None:  # not started by jax.distributed: nothing to compare through
        return
    call, count = next(_batch_calls), jax.process_count()
    root = f"funshard/batch/{call}/"
    text = json.dumps(signature)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    # The last to arrive knows every process is past the previous call: it drops its keys.
    previous = f"funshard/batch/{call - 1}/" if call else None
    deadline = time.monotonic() + wait_s
    left = comm.left_before_this_step
    verdict = comm.agree_on_digest(client, root, digest, deadline, left, previous)
    if verdict is False:  # every process got the same verdict, and raises
        deadline = time.monotonic() + wait_s
        texts = comm.exchange_texts(client, root, text, deadline, left)
        message = _batch_differs_across_processes({r: _decode(t) for r, t in texts.items()})
        comm.announce_failure()
        comm.await_failures(range(count))
        raise errors.ShardingValueError(message)


def _decode(text: str) -> list:
    """A process's posted signature, with shapes as tuples again."""
    return [(p, (tuple(d[0]), d[1]) if isinstance(d, list) else d) for p, d in json.loads(text)]
