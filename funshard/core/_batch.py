"""The global batch `value_and_grad` splits over the data-parallel devices, checked.

Every batch leaf needs the same leading (batch) dimension, a multiple of the
data-parallel world size times the number of microbatches; the messages name the
offending leaves by key path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.tree_util import tree_flatten_with_path

from funshard import _text, errors
from funshard.core._sharded import is_array


def check_batch(batch: Any, world: int, dp_axes, microbatches: int = 1) -> None:
    """Checks that `batch` splits over `world` devices and `microbatches` microbatches.

    Raises:
      ShardingTypeError: a leaf is not an array (every bad leaf named at once).
      ShardingValueError: a leaf is a scalar, the leaves' leading sizes differ, or the
        batch is empty or does not split evenly.
    """
    rows, not_arrays, scalars = [], [], []
    for path, leaf in tree_flatten_with_path(batch)[0]:
        if not is_array(leaf):
            if not isinstance(leaf, (int, float, complex, bool)):
                not_arrays.append(_batch_not_array(path, leaf))
                continue
            leaf = np.asarray(leaf)
        if leaf.ndim == 0:
            scalars.append(_batch_scalar(path))
        else:
            rows.append((path, leaf.shape[0]))
    # Every bad leaf at once, as jax.shard_map reports its specs.
    if not_arrays:
        raise errors.ShardingTypeError(_text.joined(not_arrays + scalars))
    if scalars:
        raise errors.ShardingValueError(_text.joined(scalars))
    if len({r for _, r in rows}) > 1:
        raise errors.ShardingValueError(_batch_ragged(rows))
    for path, size in rows[:1]:
        if size == 0:
            raise errors.ShardingValueError(_batch_empty(path))
        if size % world:
            raise errors.ShardingValueError(_batch_not_divisible(path, size, world, dp_axes))
        if size % (world * microbatches):
            raise errors.ShardingValueError(
                _batch_not_microbatchable(path, size, world, microbatches)
            )


def _batch_not_array(path, leaf) -> str:
    return (
        f"{_text.where('value_and_grad', path)} is a {type(leaf).__name__}, not an array; "
        "the batch may only hold arrays (pass other values as extra *args or close over "
        "them)."
    )


def _batch_scalar(path) -> str:
    return (
        f"{_text.where('value_and_grad', path)} is a scalar; every batch leaf needs a "
        "leading batch dimension to split over the data-parallel devices. Pass scalars as "
        "extra *args instead."
    )


def _batch_ragged(rows) -> str:
    listing = "\n".join(f"  {_text.leaf_name(p)}: {n} rows" for p, n in rows)
    return (
        "value_and_grad: the batch leaves have different leading (batch) sizes:\n"
        f"{listing}\nEvery batch leaf must hold one row per example; give them all the "
        "same number of rows."
    )


def _batch_empty(path) -> str:
    return (
        f"{_text.where('value_and_grad', path)} has 0 rows: the mean loss of an empty "
        "batch is undefined. Skip empty batches."
    )


def _batch_not_divisible(path, dim0: int, world: int, axes) -> str:
    return (
        f"{_text.where('value_and_grad', path)} has leading (batch) dimension {dim0}, "
        f"which the data-parallel world size {world} (mesh axes {tuple(axes)}) does not "
        f"divide. Use a global batch that is a multiple of {world}, e.g. drop the last "
        "incomplete batch or pad it."
    )


def _batch_not_microbatchable(path, rows: int, world: int, microbatches: int) -> str:
    return (
        f"{_text.where('value_and_grad', path)} has {rows} rows, which do not split into "
        f"{microbatches} microbatches on each of {world} devices; use a global batch that "
        f"is a multiple of {world * microbatches}."
    )
