"""Checkpoints of a fully sharded module (and its optimizer) in `funshard.save`'s format.

The checkpoint is the tree

    {"model": {state_dict key: leaf},
     "optimizer": {"state": {parameter name: {state name: leaf}},
                   "param_groups": [{option: value}, ...]},
     "step": int}

written by `funshard.save` (orbax; atomic; each process writes only its own shards)
and read by `funshard.restore`, so JAX restores it and writes it too. A tensor with
dims and a 32-bit-or-narrower dtype is an `fs.Sharded` leaf: the global array whose
block on each rank is that rank's padded local rows (a managed parameter's own padded
storage, no copy), exactly what `fs.shard` makes of the full tensor. 0-d tensors and
64-bit dtypes (which JAX keeps out of `fs.shard`) are numpy arrays; Python numbers stay
numbers. Restoring reads each rank's rows onto the module's current mesh, whatever
the world size that wrote them.
"""

from __future__ import annotations

import ast
import logging
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.tree_util import DictKey, keystr
from torch import nn
from torch.distributed.tensor import DTensor

import funshard as fs
from funshard import comm, errors
from torch_frontend import _bridge
from torch_frontend._fully_shard import not_fsdp_module
from torch_frontend._state import get_module_fsdp_state
from torch_frontend._state_dict import Managed, managed_params

logger = logging.getLogger("torch_frontend")  # silent unless configured (see _group.py)

MODEL, OPTIMIZER, STEP = "model", "optimizer", "step"
_STATE, _GROUPS = "state", "param_groups"
_SCALARS = {"bool": False, "int": 0, "float": 0.0}


def _base_layout(module: nn.Module) -> _bridge.RankLayout:
    """The layout of the first fully_shard group at or below `module` (for buffers)."""
    for sub in module.modules():
        state = get_module_fsdp_state(sub)
        if state is not None:
            return state._fsdp_param_groups[0].layout
    raise errors.ShardingValueError(not_fsdp_module("torch_frontend checkpoint", module))


def _shardable(t: torch.Tensor) -> bool:
    # What fs.shard shards: arrays with dims, in dtypes JAX keeps without x64.
    return t.ndim >= 1 and t.element_size() <= 4


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the bits are exact
        return t.view(torch.int16).numpy().view(jnp.bfloat16).copy()
    return t.numpy().copy()


def _torch(x) -> torch.Tensor:
    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        return np.dtype(jnp.bfloat16)
    return torch.empty(0, dtype=dtype).numpy().dtype


def _leaf_layout(layout: _bridge.RankLayout, shape, dtype, dim: int) -> comm.Layout:
    """A parameter's layout as the JAX core describes its leaves (fs.restore reads it)."""
    return comm.Layout(
        tuple(shape),
        np.dtype(dtype),
        layout.mesh,
        layout.shard_axes,
        layout.replicate_axes,
        dim=dim,
    )


def _leaf(layout: _bridge.RankLayout, data, shape, dtype, dim: int) -> fs.Sharded:
    return fs.Sharded.from_layout(_leaf_layout(layout, shape, dtype, dim), data)


def _padded_leaf(layout: _bridge.RankLayout, local: torch.Tensor, shape, dim: int) -> fs.Sharded:
    """The Sharded leaf whose block on this rank is `local` (its rows), zero-padded."""
    padded_shape = list(local.shape)
    padded_shape[dim] = layout.padded_rows(shape[dim])
    padded = local.detach().new_zeros(padded_shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local.detach())
    data = _bridge.global_block(layout, padded, dim)
    return _leaf(layout, data, shape, data.dtype, dim)


def _abstract_leaf(layout: _bridge.RankLayout, shape, dtype, dim: int) -> fs.Sharded:
    leaf = _leaf_layout(layout, shape, dtype, dim)
    data = jax.ShapeDtypeStruct(leaf.padded_shape, dtype, sharding=leaf.sharding)
    return fs.Sharded.from_layout(leaf, data)


def _chunk_of_full(layout: _bridge.RankLayout, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a tensor every rank holds whole (a buffer), on dim 0."""
    start, count = layout.chunk(full.shape[0])
    return full.narrow(0, start, count)


# ---- save ----


def _model_tree(
    module: nn.Module,
    local: dict,
    managed: dict[int, Managed],
    base: _bridge.RankLayout,
    copy: bool,
) -> dict:
    tree: dict[str, Any] = {}
    leaves: dict[int, fs.Sharded] = {}  # tied parameters: one leaf under each name
    for key, t in local.items():
        entry = managed.get(id(t))
        if entry is not None:
            if id(t) not in leaves:
                param = entry.param
                if param.dtype.itemsize == 8:
                    raise errors.UnsupportedError(_checkpoint_64bit(key, param.dtype))
                padded = param.sync_padded()
                # An asynchronous save outlives this call: the optimizer writes the
                # parameter's `_sharded_param_data`.
                data = _bridge.global_block(
                    entry.layout, padded.clone() if copy else padded, param.dim
                )
                leaves[id(t)] = _leaf(entry.layout, data, param.shape, data.dtype, param.dim)
            tree[key] = leaves[id(t)]
        elif _shardable(t):
            tree[key] = _padded_leaf(base, _chunk_of_full(base, t), t.shape, 0)
        else:
            tree[key] = _numpy(t)
    return tree


def _checkpoint_64bit(key: str, dtype) -> str:
    return (
        f"torch_frontend.save: parameter {key!r} has the 64-bit dtype {dtype}, which "
        "funshard's JAX format (x64 off) cannot hold exactly. Save this model with "
        "torch.distributed.checkpoint (dcp.save(get_model_state_dict(model))) instead."
    )


def _names(module: nn.Module) -> dict[int, str]:
    """`id` of each parameter (local shards, after the state-dict hooks) -> its first name."""
    return {id(p): name for name, p in module.named_parameters()}


def _optimizer_params(optimizer: torch.optim.Optimizer, names: dict[int, str]):
    """(name, parameter) of every parameter of the optimizer, in its order."""
    found = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise errors.ShardingValueError(_param_not_in_module(g, i, param.shape))
            found.append((names[id(param)], param))
    return found


def _param_not_in_module(group: int, index: int, shape) -> str:
    return (
        f"save/restore: parameter {index} of the optimizer's param group {group} (shape "
        f"{tuple(shape)}) is not a parameter of the module. Build the optimizer from "
        "module.parameters() after fully_shard, and pass that module."
    )


def _state_leaf(
    fqn: str, name: str, value, param: torch.Tensor, entry: Managed | None, base: _bridge.RankLayout
):
    if isinstance(value, (bool, int, float)):
        return value
    if not isinstance(value, torch.Tensor):
        raise errors.UnsupportedError(_state_unsupported(fqn, name, value))
    if value.ndim == 0:
        return _numpy(value)
    if tuple(value.shape) != tuple(param.shape):
        raise errors.UnsupportedError(_state_unsupported(fqn, name, value))
    if isinstance(value, DTensor):  # a managed parameter's state: its local rows
        value = value._local_tensor
    if entry is not None:
        return _padded_leaf(entry.layout, value, entry.param.shape, entry.param.dim)
    if _shardable(value):
        return _padded_leaf(base, _chunk_of_full(base, value), value.shape, 0)
    return _numpy(value)


def _state_unsupported(fqn: str, name: str, value) -> str:
    shape = f" of shape {tuple(value.shape)}" if hasattr(value, "shape") else ""
    return (
        f"save: optimizer state {name!r} of parameter {fqn!r} is a {type(value).__name__}"
        f"{shape}; only tensors shaped like the parameter's local shard, 0-d tensors and "
        "Python numbers are supported yet."
    )


def _hyperparameter(value):
    """An optimizer option as a checkpoint leaf, or None to leave it out.

    Numbers are stored as floats, so that `lr=1` and `lr=1e-3` are one kind of leaf.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, (int, float)) for v in value):
        return tuple(v if isinstance(v, bool) else float(v) for v in value)
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return _numpy(value)
    return None


def _groups_tree(optimizer: torch.optim.Optimizer) -> list[dict]:
    groups = []
    for group in optimizer.param_groups:
        kept = {k: _hyperparameter(v) for k, v in group.items() if k != "params"}
        groups.append({k: v for k, v in kept.items() if v is not None})
    return groups


def _optimizer_tree(optimizer, module, managed, base) -> dict:
    state = {}
    for fqn, param in _optimizer_params(optimizer, _names(module)):
        entries = optimizer.state.get(param)
        if entries:
            state[fqn] = {
                name: _state_leaf(fqn, name, value, param, managed.get(id(param)), base)
                for name, value in entries.items()
            }
    return {_STATE: state, _GROUPS: _groups_tree(optimizer)}


def checkpoint_tree(
    module: nn.Module, optimizer=None, step: int | None = None, copy: bool = False
) -> dict:
    """The tree `save` writes (see the module docstring); no collectives run.

    Args:
      module: a fully sharded module.
      optimizer: a torch optimizer over `module.parameters()`, or None.
      step: a training step to store, or None.
      copy: copy the parameters' shards (for a save that outlives the call).
    """
    local = module.state_dict(keep_vars=True)
    managed, base = managed_params(module, "torch_frontend.save"), _base_layout(module)
    tree: dict[str, Any] = {MODEL: _model_tree(module, local, managed, base, copy)}
    if optimizer is not None:
        tree[OPTIMIZER] = _optimizer_tree(optimizer, module, managed, base)
    if step is not None:
        tree[STEP] = int(step)
    return tree


def save(
    path: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    *,
    overwrite: bool = False,
    asynchronous: bool = False,
) -> str | fs.PendingSave:
    """Writes the module's (and optimizer's) state as a `funshard.save` checkpoint.

    Each process writes only its own shards; the checkpoint appears at `path` only
    once complete. Every process must call it. `funshard.restore` reads it into a
    JAX tree, and `restore` into a module on any world size (see docs/torch.md).

    Args:
      path: the checkpoint directory to create.
      module: the fully sharded module (usually the root).
      optimizer: a torch optimizer built over `module.parameters()` (its per-parameter
        state is stored by parameter name, sharded like the parameter), or None.
      step: a training step count to store, or None.
      overwrite: replace an existing checkpoint at `path` (atomically).
      asynchronous: return once the shards are copied, while the files are written in
        the background; call `.wait()` on the result before relying on them.

    Returns:
      The path, or a `funshard.PendingSave` when `asynchronous`.

    Raises:
      FileExistsError: `path` exists and `overwrite` is False.
      ValueError: an optimizer parameter is not one of the module's, or `module` has
        no fully_shard state.
      NotImplementedError: optimizer state that is not a tensor shaped like the
        local shard, a 0-d tensor or a Python number.
    """
    tree = checkpoint_tree(module, optimizer, step, copy=asynchronous)
    base = _base_layout(module)
    if logger.isEnabledFor(logging.DEBUG):
        _log_checkpoint("save", "to", path, tree, base, " (asynchronous)" if asynchronous else "")
    comm = base.comm
    return comm.in_order(fs.save, path, tree, overwrite=overwrite, asynchronous=asynchronous)


# ---- restore ----


def _stored(path: str) -> dict[str, dict]:
    """The checkpoint's leaf records (path -> kind, shape, dtype), or {} if unreadable.

    An unreadable checkpoint is left for `funshard.restore` to report.
    """
    if not os.path.isdir(os.path.join(path, "funshard")):
        return {}
    return {leaf["path"]: leaf for leaf in fs.io.leaf_records(path)}


def _like_model(local: dict, managed: dict[int, Managed], base: _bridge.RankLayout) -> dict:
    like: dict[str, fs.Sharded | np.ndarray] = {}  # abstract sharded leaves, whole arrays
    for key, t in local.items():
        entry = managed.get(id(t))
        if entry is not None:
            p = entry.param
            like[key] = _abstract_leaf(entry.layout, p.shape, _np_dtype(p.dtype), p.dim)
        elif _shardable(t):
            like[key] = _abstract_leaf(base, tuple(t.shape), _np_dtype(t.dtype), 0)
        else:
            like[key] = np.zeros(tuple(t.shape), _np_dtype(t.dtype))
    return like


def _like_entry(record: dict, full_shape, entry: Managed | None, base: _bridge.RankLayout):
    """A `like` leaf for a stored optimizer-state record; None if it cannot fit."""
    shape = tuple(record["shape"])
    if record["kind"] == "scalar" or (record["kind"] == "array" and not shape):
        return _like_record(record)
    dtype = jnp.dtype(record["dtype"])
    if record["kind"] == "array":
        return np.zeros(shape, dtype) if shape == tuple(full_shape) else None
    if shape != tuple(full_shape):
        return None
    if entry is not None:
        return _abstract_leaf(entry.layout, shape, dtype, entry.param.dim)
    return _abstract_leaf(base, shape, dtype, 0)


def _state_names(stored: dict[str, dict], fqn: str) -> tuple[dict[str, dict], list[str]]:
    """Stored records of `fqn`'s optimizer state by state name, and paths nested deeper."""
    prefix = keystr((DictKey(OPTIMIZER), DictKey(_STATE), DictKey(fqn)))
    names, deeper = {}, []
    for path, record in stored.items():
        if not path.startswith(prefix):
            continue
        rest = path[len(prefix) :]
        try:
            name = ast.literal_eval(rest[1:-1])
        except (ValueError, SyntaxError):
            name = None
        if isinstance(name, str) and keystr((DictKey(name),)) == rest:
            names[name] = record
        else:
            deeper.append(path)
    return names, deeper


def _like_optimizer(path: str, stored: dict, optimizer, module, managed, base) -> dict:
    problems: list[str] = []
    state: dict[str, dict[str, Any]] = {}
    claimed: set[str] = set()  # the checkpoint's optimizer-state paths this optimizer reads
    for fqn, param in _optimizer_params(optimizer, _names(module)):
        records, deeper = _state_names(stored, fqn)
        claimed.update(
            keystr((DictKey(OPTIMIZER), DictKey(_STATE), DictKey(fqn), DictKey(n))) for n in records
        )
        problems += [f"  not a tensor or number: {p}" for p in deeper]
        claimed.update(deeper)
        full_shape = managed[id(param)].param.shape if id(param) in managed else param.shape
        likes = {}
        for name, record in records.items():
            likes[name] = _like_entry(record, full_shape, managed.get(id(param)), base)
            if likes[name] is None:
                problems.append(
                    f"  state {name!r} of {fqn!r} is {record['kind']} "
                    f"{tuple(record['shape'])} {record['dtype']} in the checkpoint; the "
                    f"parameter has shape {tuple(full_shape)}"
                )
        if records:
            state[fqn] = likes
    state_prefix = keystr((DictKey(OPTIMIZER), DictKey(_STATE)))
    problems += [
        f"  not a parameter of the optimizer: {p}"
        for p in stored
        if p.startswith(state_prefix) and p not in claimed
    ]
    if problems:
        raise errors.CheckpointError(_optimizer_mismatch(path, problems))
    like: dict[str, Any] = {_STATE: state}
    if any(p.startswith(keystr((DictKey(OPTIMIZER), DictKey(_GROUPS)))) for p in stored):
        like[_GROUPS] = _groups_tree(optimizer)
    return like


def _optimizer_mismatch(path: str, problems: list[str]) -> str:
    return (
        f"restore: the optimizer state in the checkpoint at {path} does not fit the "
        "optimizer:\n"
        + "\n".join(problems)
        + "\nRestore into an optimizer of the same kind, built over the same parameters."
    )


def _log_checkpoint(
    fn: str, direction: str, path: str | os.PathLike, tree: dict, base: _bridge.RankLayout, how: str
) -> None:
    """One debug record per save / restore: the leaves funshard's collectives move."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, fs.Sharded))
    sharded = sum(isinstance(x, fs.Sharded) for x in leaves)
    logger.debug(
        "%s: funshard.%s %s %s of %d leaves (%d sharded over %d ranks, %d whole) through "
        "funshard's collectives, in order on the collective thread%s",
        fn,
        fn,
        direction,
        os.fspath(path),
        len(leaves),
        sharded,
        base.world,
        len(leaves) - sharded,
        how,
    )


def _restore_tree(path: str, like: dict, comm: _bridge.CommContext) -> dict:
    try:
        return comm.in_order(fs.restore, path, like)
    except ValueError as exc:
        raise errors.CheckpointError(_module_mismatch(str(exc))) from exc


def _module_mismatch(detail: str) -> str:
    return (
        f"{detail}\nThe module (and optimizer) must have the keys, shapes and dtypes of "
        "the saved ones; the checkpoint's paths are ['model'][<state_dict key>], "
        "['optimizer']['state'][<parameter name>][<state name>], "
        "['optimizer']['param_groups'][<i>][<option>] and ['step']."
    )


def _gather_sharded(
    leaves: list[fs.Sharded], base: _bridge.RankLayout, what: str
) -> list[torch.Tensor]:
    """The full tensors of restored leaves of tensors every rank holds whole (one gather).

    Args:
      leaves: the restored leaves, sharded on dim 0 over `base`.
      base: the layout they are sharded over.
      what: what the tensors are, for the debug record.
    """
    if not leaves:
        return []
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "restore: all-gather of %d %s over %d ranks, %d elements",
            len(leaves),
            what,
            base.world,
            sum(math.prod(x.shape) for x in leaves),
        )
    future = _bridge.start_all_gather(base, [x.data for x in leaves], [x.shape[0] for x in leaves])
    return [full.clone() for full in _bridge.finish_all_gather(future)]


def _local_rows(leaf: fs.Sharded, rows: int) -> torch.Tensor:
    """This rank's rows of a restored leaf (a torch view of JAX's buffer: read-only)."""
    block = torch.from_dlpack(leaf.data.addressable_shards[0].data)
    return block.narrow(leaf.dim, 0, rows)


def _write_model(local, managed, restored: dict, base) -> None:
    whole = []
    with torch.no_grad():
        for key, t in local.items():
            value, entry = restored[key], managed.get(id(t))
            if entry is not None:
                entry.param.sync_padded()
                entry.param._sharded_local_tensor.copy_(_local_rows(value, entry.param.local_rows))
            elif isinstance(value, fs.Sharded):
                whole.append((value, t))
            else:
                t.copy_(_torch(value))
        for (_, t), full in zip(
            whole,
            _gather_sharded([leaf for leaf, _ in whole], base, "unmanaged tensors of the model"),
            strict=True,
        ):
            t.copy_(full)


def _write_optimizer(optimizer, module, managed, restored: dict, base) -> None:
    # As torch's Optimizer.load_state_dict: each parameter's state is replaced whole,
    # and a parameter without saved state has none afterwards.
    by_name = dict(_optimizer_params(optimizer, _names(module)))
    for param in by_name.values():
        optimizer.state.pop(param, None)
    whole = []  # (leaf, state dict, name) of unmanaged parameters' sharded state
    for fqn, values in restored[_STATE].items():
        param = by_name[fqn]
        entry = managed.get(id(param))
        state: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, fs.Sharded) and entry is None:
                whole.append((value, state, name))
            elif isinstance(value, fs.Sharded):
                state[name] = entry.param.to_sharded_dtensor(
                    _local_rows(value, entry.param.local_rows).clone()
                )
            elif isinstance(value, np.ndarray):
                full = _torch(value)
                if entry is not None and full.ndim:
                    full = entry.param.to_sharded_dtensor(entry.chunk(full).clone())
                state[name] = full
            else:
                state[name] = value
        optimizer.state[param] = state
    for (_, state, name), full in zip(
        whole,
        _gather_sharded(
            [w[0] for w in whole], base, "optimizer-state tensors of unmanaged parameters"
        ),
        strict=True,
    ):
        state[name] = full
    for group, values in zip(optimizer.param_groups, restored.get(_GROUPS, []), strict=False):
        for option, value in values.items():
            if isinstance(group[option], torch.Tensor):
                group[option].copy_(_torch(value))
            else:
                group[option] = type(group[option])(value) if isinstance(value, tuple) else value


def _like_record(record: dict):
    """A `like` leaf for a stored array or Python number."""
    if record["kind"] == "scalar":
        return _SCALARS[record["dtype"]]
    return np.zeros(tuple(record["shape"]), jnp.dtype(record["dtype"]))


def restore(
    path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> int | None:
    """Loads a checkpoint into the module's shards (and the optimizer) in place.

    The checkpoint may come from `save` on any world size or from `funshard.save` of
    a JAX tree of the same structure. Each rank reads its own rows; parameters keep
    their identity. Every process must call it.

    Args:
      path: a checkpoint directory.
      module: the fully sharded module, built as the saved one was.
      optimizer: the optimizer over `module.parameters()`, if the checkpoint holds
        optimizer state (its state is replaced, created if it has none yet).

    Returns:
      The stored step, or None if the checkpoint has none.

    Raises:
      FileNotFoundError: there is no checkpoint at `path`.
      ValueError: (`funshard.errors.CheckpointError`) the checkpoint does not fit the
        module or optimizer (the message names every offending path), holds optimizer
        state and `optimizer` is None, or holds none and `optimizer` is given.
    """
    path = os.path.abspath(os.fspath(path))
    stored = _stored(path)
    local = module.state_dict(keep_vars=True)
    managed, base = managed_params(module, "torch_frontend.restore"), _base_layout(module)
    like: dict[str, Any] = {MODEL: _like_model(local, managed, base)}
    has_optimizer = any(p.startswith(keystr((DictKey(OPTIMIZER),))) for p in stored)
    if optimizer is None and has_optimizer:
        raise errors.CheckpointError(_has_optimizer(path))
    if optimizer is not None and stored and not has_optimizer:
        raise errors.CheckpointError(_lacks_optimizer(path))
    if optimizer is not None and stored:
        like[OPTIMIZER] = _like_optimizer(path, stored, optimizer, module, managed, base)
    step = stored.get(keystr((DictKey(STEP),)))
    if step is not None:
        like[STEP] = _like_record(step)
    if logger.isEnabledFor(logging.DEBUG):
        _log_checkpoint("restore", "from", path, like, base, "")
    restored = _restore_tree(path, like, base.comm)
    _write_model(local, managed, restored[MODEL], base)
    if OPTIMIZER in like:
        _write_optimizer(optimizer, module, managed, restored[OPTIMIZER], base)
    return int(restored[STEP]) if STEP in restored else None


def _has_optimizer(path: str) -> str:
    return (
        f"restore: the checkpoint at {path} holds optimizer state; pass the optimizer "
        "(restore(path, module, optimizer)) to restore it too."
    )


def _lacks_optimizer(path: str) -> str:
    return (
        f"restore: the checkpoint at {path} holds no optimizer state; pass optimizer=None, "
        "or restore from a checkpoint saved with the optimizer."
    )
