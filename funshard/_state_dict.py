"""`state_dict` / `load_state_dict`: full, unpadded numpy arrays keyed by path."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.tree_util import keystr, tree_unflatten

from funshard import _shard
from funshard._sharded import Sharded, is_array


def _logical(x) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(x, Sharded):
        return x.shape, np.dtype(x.dtype)
    return tuple(np.shape(x)), np.dtype(x.dtype)


def state_dict(tree: Any) -> dict[str, np.ndarray]:
    """The full, unpadded arrays of `tree`, keyed by `jax.tree_util.keystr` paths.

    For export to other tools: every `Sharded` leaf is all-gathered (one collective per
    layout) and its padding removed; replicated arrays are copied to the host. Non-array
    leaves are left out.

    Args:
      tree: a (possibly sharded) pytree: parameters, optimizer state, ...

    Returns:
      A dict from paths such as `"['layers'][0]['w']"` to numpy arrays.
    """
    paths, items, _ = _shard.sharded_leaves("state_dict", tree)
    has_sharded = any(isinstance(x, Sharded) for x in items)
    full_items = items
    if has_sharded:
        full_items = _shard.sharded_leaves("state_dict", _shard.unshard(tree))[1]
    return {
        keystr(tuple(p)): np.asarray(full)
        for p, x, full in zip(paths, items, full_items)
        if isinstance(x, Sharded) or is_array(x)
    }


def _problems(sd: Mapping[str, Any], paths, items) -> list[str]:
    expected = {
        keystr(tuple(p)): x
        for p, x in zip(paths, items)
        if isinstance(x, Sharded) or is_array(x)
    }
    problems = [f"  missing: {k}" for k in expected if k not in sd]
    problems += [f"  unexpected: {k}" for k in sd if k not in expected]
    for key, like in expected.items():
        if key not in sd:
            continue
        shape, dtype = _logical(like)
        got = np.asarray(sd[key])
        if got.shape != shape:
            problems.append(f"  shape mismatch: {key} is {got.shape}, expected {shape}")
        elif got.dtype != dtype:
            problems.append(f"  dtype mismatch: {key} is {got.dtype}, expected {dtype}")
    return problems


def _place(value: np.ndarray, like):
    if isinstance(like, Sharded):
        return _shard.reshard_leaf(value, like, in_step=False)
    if isinstance(like, jax.Array):
        return jax.device_put(value, like.sharding)
    return value


def load_state_dict(sd: Mapping[str, Any], like: Any) -> Any:
    """Loads a `state_dict` onto the layout of `like` (any mesh, any padding).

    Args:
      sd: full arrays keyed by path, as `state_dict` returns.
      like: a tree with the wanted structure, shapes, dtypes and shardings (e.g. a
        freshly `shard`-ed state, or `jax.eval_shape` of one is not enough: it must
        hold `Sharded` leaves or arrays to copy placements from).

    Returns:
      A tree like `like` holding the values of `sd`.

    Raises:
      ValueError: keys are missing or unexpected, or an array's shape or dtype does
        not match; the message lists every offending path.
    """
    paths, items, treedef = _shard.sharded_leaves("load_state_dict", like)
    problems = _problems(sd, paths, items)
    if problems:
        raise ValueError(
            "load_state_dict: the state dict does not match `like`:\n" + "\n".join(problems)
            + "\nExport it with fs.state_dict from a tree of the same structure, or fix "
            "the listed keys."
        )
    out = [
        _place(np.asarray(sd[keystr(tuple(p))]), x) if isinstance(x, Sharded) or is_array(x) else x
        for p, x in zip(paths, items)
    ]
    return tree_unflatten(treedef, out)
