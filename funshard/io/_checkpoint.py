"""Sharded checkpoints on orbax-checkpoint, restorable onto a mesh of any size.

Every array is written by the processes that own its shards (orbax/tensorstore), never
gathered to one host. A `Sharded` leaf is stored as its padded global array: the
logical rows come first and the padding rows are zeros, so restoring onto another
shard count reads the logical rows and pads (or drops) zero rows at the end
(`ArrayRestoreArgs(strict=False)`). An optimizer state's `Sharded` node that holds no
such array (`optax.MaskedNode`, adafactor's statistics) is stored as its arrays, if any
(`funshard/io/_stored.py`). A small JSON item records each leaf's path,
logical shape and dtype, so a restore into a tree of another structure or dtype is a
clear error naming each offending path, never a silent partial load.

Restored arrays outside `Sharded` leaves (an optimizer's step count, a replicated
scalar parameter) are placed replicated on the mesh of `like`'s `Sharded` leaves, so a
jitted step accepts the restored tree whatever device `like`'s copy was on. `like` may
be abstract (`jax.ShapeDtypeStruct` leaves, as from `jax.eval_shape`), so a model too
large for one device is restored without first materialising an initial state.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import traceback
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import keystr

from funshard import _text, comm, core, errors
from funshard.core import Sharded, is_array
from funshard.io._stored import stored_leaves

if TYPE_CHECKING:  # imported on first use at run time (see `_ocp`)
    import orbax.checkpoint as ocp

_FORMAT = "funshard-checkpoint-1"

# Paths of this process's asynchronous saves not yet waited for. Waiting, not the
# background thread finishing, ends an entry, so every process refuses (or accepts) the
# same later save whatever its thread timing: a refusal on one process only would hang
# the others in the save's barrier.
_IN_FLIGHT: dict[str, PendingSave] = {}


def _ocp():
    # orbax is heavy to import; only checkpointing pays for it.
    import orbax.checkpoint as ocp

    return ocp


def _is_abstract(x) -> bool:
    return isinstance(x.data if isinstance(x, Sharded) else x, jax.ShapeDtypeStruct)


def _entry(path, x) -> dict | None:
    if isinstance(x, Sharded):
        entry: dict[str, Any] = {
            "path": keystr(tuple(path)),
            "kind": "sharded",
            "shape": list(x.shape),
            "dtype": np.dtype(x.dtype).name,
        }
        blocks = x.model_split(x.dim)
        if blocks > 1:
            # Padded per model block: restoring onto another split cuts each block's
            # padding, which only these two numbers locate.
            entry["blocks"] = blocks
            entry["padded"] = x.padded_shape[x.dim]
        return entry
    if is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        return {
            "path": keystr(tuple(path)),
            "kind": "array",
            "shape": list(np.shape(x)),
            "dtype": np.dtype(x.dtype).name,
        }
    if isinstance(x, (bool, int, float)):
        return {
            "path": keystr(tuple(path)),
            "kind": "scalar",
            "shape": [],
            "dtype": type(x).__name__,
        }
    return None


def _abstract_in_save(path) -> str:
    return (
        f"{_text.where('save', path)} is abstract (a jax.ShapeDtypeStruct) and has no values "
        "to write; save the concrete state (materialise it first, e.g. with fs.restore "
        "or jax.jit of the initialiser)."
    )


def _arrays_and_meta(tree: Any):
    paths, items, _ = stored_leaves(tree)
    arrays: dict[str, Any] = {}
    leaves: list[Any] = []
    for path, x in zip(paths, items, strict=True):
        entry = _entry(path, x)
        if entry is None:
            continue
        if _is_abstract(x):
            raise errors.CheckpointError(_abstract_in_save(path))
        key = str(len(leaves))
        leaves.append(entry)
        if isinstance(x, Sharded):
            arrays[key] = x.data
        else:
            arrays[key] = x if is_array(x) else np.asarray(x)
    return arrays, {"format": _FORMAT, "leaves": leaves}


class PendingSave:
    """An asynchronous save in flight: `wait()` blocks until it is durable on disk.

    Returned by `save(..., asynchronous=True)`; not constructed directly.

    Attributes:
      path: the absolute path of the checkpoint being written.
    """

    def __init__(self, checkpointer: ocp.AsyncCheckpointer, path: str) -> None:
        self._checkpointer = checkpointer
        self.path = path

    def wait(self) -> str:
        """Blocks until the checkpoint is complete; returns its path.

        Raises:
          Exception: whatever made the background write fail; the path is then free
            for another save.
        """
        try:
            self._checkpointer.wait_until_finished()
            self._checkpointer.close()
        finally:
            if _IN_FLIGHT.get(self.path) is self:
                del _IN_FLIGHT[self.path]
        return self.path


def _save_exists(path: str) -> str:
    return (
        f"save: {path} already exists; pass overwrite=True, or save each step to its "
        "own directory (e.g. f'{root}/step_{step}')."
    )


def _save_overwrite_async() -> str:
    return "save: overwrite=True cannot be asynchronous; save to a new path."


def _save_in_flight(path: str) -> str:
    return (
        f"save: an asynchronous save to {path} is still in flight; call .wait() on the "
        "fs.PendingSave it returned before saving to that path again, or save each step "
        "to its own directory (e.g. f'{root}/step_{step}')."
    )


def save(
    path: str | os.PathLike, tree: Any, *, overwrite: bool = False, asynchronous: bool = False
) -> PendingSave | str:
    """Writes `tree` (params, optimizer state, step counters, ...) as a sharded checkpoint.

    Each process writes only the shards it owns. The checkpoint appears at `path` only
    once complete (orbax writes to a temporary directory and renames it), so a save
    killed half-way leaves every earlier checkpoint restorable.

    Args:
      path: the checkpoint directory to create.
      tree: a pytree of `Sharded` leaves, arrays and Python scalars (other leaves, such
        as strings or None, are not stored and come from `like` on restore).
      overwrite: replace an existing checkpoint at `path`. The new one is written
        beside it first and swapped in only when complete.
      asynchronous: return as soon as the arrays are copied off the devices, while the
        files are written in the background; call `.wait()` on the result before
        relying on the checkpoint (or before the process exits).

    Returns:
      The path, or a `PendingSave` when `asynchronous`.

    Raises:
      CheckpointExistsError: (a `FileExistsError`) `path` exists and `overwrite` is
        False.
      CheckpointInFlightError: (a `RuntimeError`) an asynchronous save to `path` has
        not been waited for yet.
      CheckpointError: (a `ValueError`) `overwrite` together with `asynchronous`, or
        an abstract leaf (`jax.ShapeDtypeStruct`) in `tree`.
    """
    ocp = _ocp()
    path = os.path.abspath(os.fspath(path))
    if path in _IN_FLIGHT:
        raise errors.CheckpointInFlightError(_save_in_flight(path))
    exists = os.path.exists(path)
    if exists and not overwrite:
        raise errors.CheckpointExistsError(_save_exists(path))
    if overwrite and asynchronous:
        raise errors.CheckpointError(_save_overwrite_async())
    arrays, meta = _arrays_and_meta(tree)
    args = ocp.args.Composite(arrays=ocp.args.PyTreeSave(arrays), funshard=ocp.args.JsonSave(meta))
    target = path + ".funshard-new" if exists else path
    if asynchronous:
        checkpointer = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
        checkpointer.save(target, args=args)
        _IN_FLIGHT[path] = PendingSave(checkpointer, path)
        return _IN_FLIGHT[path]
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(target, args=args, force=True)
    if exists:
        _swap_in(target, path)
    return path


def _swap_in(new: str, path: str) -> None:
    """Replaces `path` by the complete checkpoint `new` (primary process only)."""
    if jax.process_index() == 0:
        old = path + ".funshard-old"
        os.replace(path, old)
        os.replace(new, path)
        shutil.rmtree(old)
    _ocp().multihost.sync_global_processes("funshard_save_swap")


def _checkpoint_missing_leaf(key: str) -> str:
    return f"  missing from the checkpoint: {key}"


def _checkpoint_extra_leaf(key: str) -> str:
    return f"  not in `like`: {key}"


def _checkpoint_shape(key: str, have, want) -> str:
    return f"  shape mismatch: {key} is {tuple(have)} in the checkpoint, {tuple(want)} in `like`"


def _checkpoint_dtype(key: str, have, want) -> str:
    return f"  dtype mismatch: {key} is {have} in the checkpoint, {want} in `like`"


def _mismatches(meta: dict, paths, items) -> list[str]:
    stored = {leaf["path"]: leaf for leaf in meta["leaves"]}
    wanted = {}
    for path, x in zip(paths, items, strict=True):
        entry = _entry(path, x)
        if entry is not None:
            wanted[entry["path"]] = entry
    problems = [_checkpoint_missing_leaf(p) for p in wanted if p not in stored]
    problems += [_checkpoint_extra_leaf(p) for p in stored if p not in wanted]
    for p, want in wanted.items():
        have = stored.get(p)
        if have is None:
            continue
        if have["shape"] != want["shape"]:
            problems.append(_checkpoint_shape(p, have["shape"], want["shape"]))
        elif not _readable(have, want):
            problems.append(_checkpoint_dtype(p, have["dtype"], want["dtype"]))
    return problems


def _readable(have: dict, want: dict) -> bool:
    """Whether the stored leaf `have` can be read into `like`'s leaf `want`."""
    if have["dtype"] == want["dtype"]:
        return True
    # `jax.eval_shape` turns a Python scalar such as `"step": 0` into a 0-d
    # ShapeDtypeStruct: an abstract `like` may ask for it as an array of its kind.
    kinds = {"bool": "b", "int": "iu", "float": "f"}
    return (
        have["kind"] == "scalar"
        and want["kind"] == "array"
        and not want["shape"]
        and np.dtype(want["dtype"]).kind in kinds.get(have["dtype"], "")
    )


def _unplaced(paths, items, mesh) -> list:
    """Paths of abstract `like` leaves that say nowhere to put them (no sharding, no mesh)."""
    if mesh is not None:
        return []
    return [
        p
        for p, x in zip(paths, items, strict=True)
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
    ]


def _restore_target(x, mesh, record: dict):
    ocp = _ocp()
    saved = _saved_blocks(x, record)
    if saved is not None:
        # Read whole in the stored padding (replicated), then moved by `_relaid`.
        shape = list(x.shape)
        shape[x.dim] = saved[1]
        whole = NamedSharding(x.mesh, PartitionSpec())
        struct = jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=whole)
        # strict=False: a leaf written without model blocks is read at its logical size
        # (its padding, at the end, cut off).
        args = ocp.ArrayRestoreArgs(
            sharding=whole, global_shape=tuple(shape), dtype=x.dtype, strict=False
        )
        return struct, args
    if isinstance(x, Sharded):
        struct = jax.ShapeDtypeStruct(x.padded_shape, x.dtype, sharding=x.sharding)
        # Padding rows are zeros at the end: pad or drop them for this shard count.
        args = ocp.ArrayRestoreArgs(
            sharding=x.sharding, global_shape=x.padded_shape, dtype=x.dtype, strict=False
        )
        return struct, args
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        # See the module docstring: replicated on the state's mesh, if there is one.
        sharding = x.sharding if mesh is None else core.sharding_on(mesh, x)
        struct = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return struct, ocp.ArrayRestoreArgs(sharding=sharding, global_shape=x.shape, dtype=x.dtype)
    return np.asarray(x), ocp.RestoreArgs(restore_type=np.ndarray)


def _checkpoint_corrupt(path: str, what: str, exc: BaseException) -> str:
    return (
        f"restore: the checkpoint at {path} is incomplete or corrupt (reading its "
        f"{what} failed: {type(exc).__name__}: {exc}). Restore an earlier checkpoint."
    )


def _read(path: str, what: str, args):
    ocp = _ocp()
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            return checkpointer.restore(path, args=args)
    except (FileNotFoundError, ValueError, KeyError, OSError) as exc:
        failure = exc
    _drop_abandoned_coroutines(failure)
    raise errors.CheckpointError(_checkpoint_corrupt(path, what, failure)) from failure


def leaf_records(path: str) -> list[dict]:
    """The leaf records (path, kind, shape, dtype) of the checkpoint at `path`.

    Raises:
      CheckpointError: (a `ValueError`) the checkpoint's metadata cannot be read.
    """
    ocp = _ocp()
    meta = _read(path, "metadata", ocp.args.Composite(funshard=ocp.args.JsonRestore()))
    return meta["funshard"].get("leaves", []) if isinstance(meta["funshard"], dict) else []


def _drop_abandoned_coroutines(failure: BaseException | None) -> None:
    """Collects the coroutines a failed orbax read left behind, now and silently.

    orbax reads a checkpoint's files with `asyncio.gather` on an event loop it closes as
    soon as the first read fails: the other reads' coroutines never start. Left to the
    garbage collector they would warn "coroutine ... was never awaited" at some later,
    unrelated moment (an error under `-W error`, blamed on whatever runs then). The
    failure's frames hold them; clearing the frames' variables keeps the traceback
    printable and frees them.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning
        )
        seen = set()
        while failure is not None and id(failure) not in seen:
            seen.add(id(failure))
            traceback.clear_frames(failure.__traceback__)
            failure = failure.__cause__ or failure.__context__
        gc.collect()


def _no_checkpoint(path: str) -> str:
    return (
        f"restore: no checkpoint at {path}. Pass a directory written by fs.save, e.g. "
        "f'{root}/step_{step}'."
    )


def _restore_in_flight(path: str) -> str:
    return (
        f"restore: no checkpoint at {path} yet: an asynchronous save to it is still in "
        "flight. Call .wait() on the fs.PendingSave that fs.save returned first."
    )


def _not_a_checkpoint(path: str, why: str) -> str:
    return (
        f"restore: {path} is not a funshard checkpoint: {why}. Pass a directory written "
        "by fs.save, e.g. f'{root}/step_{step}', not its parent or another tool's checkpoint."
    )


def _held(entries: Sequence[str]) -> str:
    """What a directory that is not a checkpoint holds, for `_not_a_checkpoint`."""
    held = ", ".join(sorted(entries)[:8]) + (", ..." if len(entries) > 8 else "")
    return f"it has no 'funshard' metadata item (it holds: {held or 'nothing'})"


def _checkpoint_mismatch(path: str, problems: Sequence[str]) -> str:
    return (
        f"restore: the checkpoint at {path} does not match `like`:\n"
        + "\n".join(problems)
        + "\nBuild `like` exactly as the saved tree was built (same model, optimizer "
        "and dtypes)."
    )


def _no_placement(fn: str, paths) -> str:
    listing = "\n".join(f"  {_text.leaf_name(p)}" for p in paths)
    return (
        f"{fn}: these leaves are jax.ShapeDtypeStruct without a sharding, and `like` has "
        f"no fs.Sharded leaves whose mesh they could be replicated on:\n{listing}\nGive "
        "each a sharding, e.g. jax.ShapeDtypeStruct(shape, dtype, "
        "sharding=NamedSharding(mesh, P()))."
    )


def restore(path: str | os.PathLike, like: Any) -> Any:
    """Reads a checkpoint onto the layout of `like`, which may use another mesh.

    Args:
      path: a directory written by `save`.
      like: a tree with the structure, logical shapes and dtypes of the saved one,
        whose `Sharded` leaves say where the restored values go (for example
        `fs.shard(init_params, new_mesh)` and `opt.init` of it). Its array leaves may
        be concrete or abstract (`jax.ShapeDtypeStruct`, e.g. from `jax.eval_shape`);
        a 0-d abstract leaf may receive a saved Python scalar of its kind.

    Returns:
      A tree like `like` holding the checkpoint's values, logically bit-identical to
      what was saved whatever the mesh. Arrays outside `Sharded` leaves are
      replicated on the mesh of `like`'s `Sharded` leaves unless `like` already had
      them on that mesh (then they keep its sharding); numpy leaves stay numpy.

    Raises:
      CheckpointNotFoundError: (a `FileNotFoundError`) there is no checkpoint at
        `path`.
      CheckpointError: (a `ValueError`) `path` is not a funshard checkpoint or is
        incomplete or corrupt, or its structure, shapes or dtypes differ from `like`
        (the message lists every offending path).
      ShardingValueError: (a `ValueError`) `like`'s `Sharded` leaves live on different
        meshes.
    """
    ocp = _ocp()
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        if path in _IN_FLIGHT:
            raise errors.CheckpointNotFoundError(_restore_in_flight(path))
        raise errors.CheckpointNotFoundError(_no_checkpoint(path))
    if not os.path.isdir(os.path.join(path, "funshard")):
        raise errors.CheckpointError(_not_a_checkpoint(path, _held(os.listdir(path))))
    meta = _read(path, "metadata", ocp.args.Composite(funshard=ocp.args.JsonRestore()))
    meta = meta["funshard"]
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise errors.CheckpointError(
            _not_a_checkpoint(
                path, "its 'funshard' metadata is not in the format this funshard writes"
            )
        )
    paths, items, treedef = stored_leaves(like)
    mesh = core.common_mesh("restore", paths, items)
    problems = _mismatches(meta, paths, items)
    if problems:
        raise errors.CheckpointError(_checkpoint_mismatch(path, problems))
    unplaced = _unplaced(paths, items, mesh)
    if unplaced:
        raise errors.CheckpointError(_no_placement("restore", unplaced))
    stored = [
        i for i, (p, x) in enumerate(zip(paths, items, strict=True)) if _entry(p, x) is not None
    ]
    records = {leaf["path"]: leaf for leaf in meta["leaves"]}
    saved = [records[keystr(tuple(paths[i]))] for i in stored]
    targets = [_restore_target(items[i], mesh, r) for i, r in zip(stored, saved, strict=True)]
    item = {str(k): t[0] for k, t in enumerate(targets)}
    restore_args = {str(k): t[1] for k, t in enumerate(targets)}
    arrays = _read(
        path,
        "arrays",
        ocp.args.Composite(arrays=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)),
    )["arrays"]
    parts = core.Partition(tuple(items), treedef, tuple(stored))
    return parts.combine(
        [
            _restored(items[i], _relaid(items[i], arrays[str(k)], record))
            for k, (i, record) in enumerate(zip(stored, saved, strict=True))
        ]
    )


def _saved_blocks(like: Any, record: dict) -> tuple[int, int] | None:
    """(model blocks, padded size) of a stored `Sharded` leaf whose padding `like`
    cannot read in place (padded per model block, on one side or both), else None."""
    if not isinstance(like, Sharded):
        return None
    blocks, padded = int(record.get("blocks", 1)), record.get("padded")
    wanted = (like.model_split(like.dim), like.padded_shape[like.dim])
    if blocks == 1 and wanted[0] == 1:
        return None  # padding at the end only: orbax pads or cuts it (strict=False)
    if (blocks, padded) == wanted:
        return None
    if padded is None:  # written without model blocks: padded at the end
        return 1, like.shape[like.dim]
    return blocks, int(padded)


def _relaid(like: Any, value: Any, record: dict) -> Any:
    """`value` as read, moved into `like`'s padding where it was read in another one."""
    saved = _saved_blocks(like, record)
    if saved is None:
        return value
    blocks, _ = saved
    rows = like.shape[like.dim] // blocks
    layout = like.layout

    def move(x):
        full = comm.unpad_blocks(x, like.dim, blocks, rows)
        return comm.to_padded(full, layout)

    return jax.jit(move, out_shardings=like.sharding)(value)


def _restored(like: Any, value: Any) -> Any:
    """A restored `value` in the form of its `like` leaf."""
    if isinstance(like, Sharded):
        return dataclasses.replace(like, data=value)
    if is_array(like) or isinstance(like, jax.ShapeDtypeStruct):
        return value
    return type(like)(np.asarray(value).item())
