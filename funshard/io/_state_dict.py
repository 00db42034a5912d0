"""`state_dict` / `load_state_dict`: full, unpadded numpy arrays keyed by path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_unflatten

from funshard import core, errors
from funshard.core import Sharded, is_array, is_key
from funshard.io._stored import stored_leaves


def _is_stored(x) -> bool:
    """Whether a leaf of `like` has an entry in a state dict (abstract leaves too)."""
    return isinstance(x, (Sharded, jax.ShapeDtypeStruct)) or is_array(x)


def _logical(x) -> tuple[tuple[int, ...], np.dtype]:
    if isinstance(x, Sharded):
        return x.shape, np.dtype(x.dtype)
    if is_key(x):
        # A typed key is stored as its raw key data (e.g. uint32[..., 2]).
        data = jax.eval_shape(jax.random.key_data, x)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(np.shape(x)), np.dtype(x.dtype)


def _host(full) -> np.ndarray:
    # numpy has no PRNG key dtype: a key travels as its key data.
    return np.asarray(jax.random.key_data(full) if is_key(full) else full)


def state_dict(tree: Any) -> dict[str, np.ndarray]:
    """The full, unpadded arrays of `tree`, keyed by `jax.tree_util.keystr` paths.

    For export to other tools: every `Sharded` leaf is all-gathered (one collective per
    layout) and its padding removed; replicated arrays are copied to the host; typed
    PRNG keys are stored as their key data (`jax.random.key_data`). Non-array leaves are
    left out.

    Args:
      tree: a (possibly sharded) pytree: parameters, optimizer state, ...

    Returns:
      A dict from paths such as `"['layers'][0]['w']"` to numpy arrays.
    """
    paths, items, _ = stored_leaves(tree)
    full_items = list(items)
    sharded = [i for i, x in enumerate(items) if isinstance(x, Sharded)]
    if sharded:
        gathered = core.unshard_as([items[i] for i in sharded], "state_dict")
        for i, full in zip(sharded, gathered, strict=True):
            full_items[i] = full
    return {
        keystr(tuple(p)): _host(full)
        for p, x, full in zip(paths, items, full_items, strict=True)
        if isinstance(x, Sharded) or is_array(x)
    }


def _state_dict_missing(key: str) -> str:
    return f"  missing: {key}"


def _state_dict_unexpected(key: str) -> str:
    return f"  unexpected: {key}"


def _state_dict_shape(key: str, got, want) -> str:
    return f"  shape mismatch: {key} is {got}, expected {want}"


def _state_dict_dtype(key: str, got, want) -> str:
    return f"  dtype mismatch: {key} is {got}, expected {want}"


def _problems(sd: Mapping[str, Any], paths, items) -> list[str]:
    expected = {keystr(tuple(p)): x for p, x in zip(paths, items, strict=True) if _is_stored(x)}
    problems = [_state_dict_missing(k) for k in expected if k not in sd]
    problems += [_state_dict_unexpected(k) for k in sd if k not in expected]
    for key, like in expected.items():
        if key not in sd:
            continue
        shape, dtype = _logical(like)
        got = np.asarray(sd[key])
        if got.shape != shape:
            problems.append(_state_dict_shape(key, got.shape, shape))
        elif got.dtype != dtype:
            problems.append(_state_dict_dtype(key, got.dtype, dtype))
    return problems


def _place(value: np.ndarray | jax.Array, like):
    if isinstance(like, Sharded):
        return core.reshard_leaf(value, like, in_step=False)
    if is_key(like):
        # Typed as taking a jax.Array; it takes any array (host data here, placed below).
        value = jax.random.wrap_key_data(value, dtype=like.dtype)  # type: ignore[arg-type]
    sharding = getattr(like, "sharding", None)
    if isinstance(like, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None:
        return jax.device_put(value, sharding)
    return jnp.asarray(value) if isinstance(like, jax.ShapeDtypeStruct) else value


def _state_dict_not_mapping(sd) -> str:
    return (
        f"load_state_dict: sd is a {type(sd).__name__}; expected a dict from path strings "
        "to full arrays, as fs.state_dict(tree) returns. To load a tree of full arrays "
        "use fs.reshard(full_tree, like); to load from disk use fs.restore(path, like)."
    )


def _state_dict_bad_entries(entries) -> str:
    listing = "\n".join(f"  {k!r}: {type(v).__name__}" for k, v in entries)
    return (
        "load_state_dict: sd must map path strings (such as \"['layers'][0]['w']\") to "
        f"numpy or jax arrays; these entries do not:\n{listing}\nPass the flat dict "
        "fs.state_dict(tree) returns, not a nested tree (for a tree of full arrays use "
        "fs.reshard(full_tree, like)); wrap numbers with np.asarray(value, dtype)."
    )


def _check_sd(sd: Any) -> None:
    if not isinstance(sd, Mapping):
        raise errors.ShardingTypeError(_state_dict_not_mapping(sd))
    bad = [(k, v) for k, v in sd.items() if not (isinstance(k, str) and is_array(v))]
    if bad:
        raise errors.ShardingTypeError(_state_dict_bad_entries(bad))


def _state_dict_mismatch(problems: Sequence[str]) -> str:
    return (
        "load_state_dict: the state dict does not match `like`:\n"
        + "\n".join(problems)
        + "\nExport it with fs.state_dict from a tree of the same structure, or fix "
        "the listed keys."
    )


def load_state_dict(sd: Mapping[str, Any], like: Any) -> Any:
    """Loads a `state_dict` onto the layout of `like` (any mesh, any padding).

    Args:
      sd: full arrays keyed by path, as `state_dict` returns.
      like: a tree with the wanted structure, shapes, dtypes and shardings: a
        `shard`-ed state, or an abstract one (`fs.shard(jax.eval_shape(init, key),
        mesh)`), which loads without ever materialising the initial parameters.

    Returns:
      A tree like `like` holding the values of `sd`.

    Raises:
      TypeError: `sd` is not a mapping from path strings to arrays.
      ValueError: keys are missing or unexpected, or an array's shape or dtype does
        not match; the message lists every offending path.
    """
    _check_sd(sd)
    paths, items, treedef = stored_leaves(like)
    problems = _problems(sd, paths, items)
    if problems:
        raise errors.ShardingValueError(_state_dict_mismatch(problems))
    out = [
        _place(np.asarray(sd[keystr(tuple(p))]), x) if _is_stored(x) else x
        for p, x in zip(paths, items, strict=True)
    ]
    return tree_unflatten(treedef, out)
