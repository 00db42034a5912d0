"""The padding probe: does an optax transform's update of real rows depend on padding?

`fs.init_optimizer(opt, state)` runs it before `opt.init` when `state` has uneven
leaves. On single-device host copies (never on the mesh) it runs one `init` and one
`update` twice: once on the uneven leaves' logical arrays, once on the same values padded
with zero rows as funshard stores them. Padding rows are zero in training too, so the two
runs agree exactly where plain `opt.update` on the sharded state gives optax's numbers
(element-wise transforms, global-norm clipping, LAMB's trust ratio) and disagree where
the transform looks at the padded shape (adafactor's row and column means, muon). Other
leaves are replaced by one-element stand-ins, so the probe's cost is that of the uneven
leaves alone; its verdict is cached per transform and layout.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _text
from funshard.core._shard_optimizer import is_uneven, probing
from funshard.core._sharded import Sharded, is_key, is_sharded

logger = logging.getLogger(__name__)

# (transform, layout of the state) -> the leaves whose updates depend on their padding.
_VERDICTS: collections.OrderedDict = collections.OrderedDict()
_MAX_VERDICTS = 64


def _stand_in(x: Any, real: bool) -> Any:
    """A cheap host array standing in for a leaf that cannot see padding."""
    if is_key(x):
        return (
            jax.random.key(0)
            if not x.ndim
            else jax.random.split(jax.random.key(0), 1).reshape((1,) * x.ndim)
        )
    shape = tuple(x.shape) if real else (1,) * len(x.shape)
    return np.full(shape, 0.5, dtype=np.dtype(x.dtype))


def _real_rows(x: Sharded, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal(x.shape)
    return values.astype(np.dtype(x.dtype))


def _padded(x: Sharded, values: np.ndarray) -> np.ndarray:
    widths = [(0, 0)] * values.ndim
    widths[x.dim] = (0, x.padded_shape[x.dim] - x.shape[x.dim])
    return np.pad(values, widths)


def _probed(x: Any) -> bool:
    return is_uneven(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _probe_inputs(state: Any, seed: int, real_shapes: bool) -> tuple[Any, Any]:
    """(logical, padded) versions of (params, grads) for the probe's two runs."""
    items, treedef = jax.tree.flatten(state, is_leaf=is_sharded)
    logical, padded = [], []
    for i, x in enumerate(items):
        if _probed(x):
            p, g = _real_rows(x, seed + 2 * i), _real_rows(x, seed + 2 * i + 1)
            logical.append((dataclasses.replace(x, data=p), dataclasses.replace(x, data=g)))
            padded.append(
                (
                    dataclasses.replace(x, data=_padded(x, p)),
                    dataclasses.replace(x, data=_padded(x, g)),
                )
            )
            continue
        if isinstance(x, Sharded):
            stand_in = dataclasses.replace(x, data=_stand_in(x, real_shapes))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            stand_in = _stand_in(x, real_shapes)
        else:
            stand_in = x
        logical.append((stand_in, stand_in))
        padded.append((stand_in, stand_in))

    def trees(pairs):
        return tuple(jax.tree.unflatten(treedef, list(half)) for half in zip(*pairs, strict=True))

    return trees(logical), trees(padded)


def _both_runs(opt: Any, logical: tuple, padded: tuple) -> tuple:
    """`(updates, opt_state)` after one init and update on each of the two inputs."""

    def run(params, grads):
        return opt.update(grads, opt.init(params), params)

    def both(logical, padded):
        return run(*logical), run(*padded)

    # One compiled program, at XLA's lowest backend optimisation: compiling, not running,
    # is the probe's cost, and this level compiles it in about half the time of the
    # default one, where op by op AdamW's dozens of small operations would each compile
    # on first use (docs/benchmarks_design.md has the numbers).
    compiled = (
        jax.jit(both)
        .lower(logical, padded)
        # jax 0.10's stub types option values as str | bool (0.12's admits ints: hence
        # unused-ignore); XLA's integer options take ints.
        .compile(compiler_options={"xla_backend_optimization_level": 0})  # type: ignore[dict-item, unused-ignore]
    )
    return compiled(logical, padded)


def _close(logical: np.ndarray, padded_real: np.ndarray) -> bool:
    if logical.shape != padded_real.shape:
        return False
    if not jnp.issubdtype(logical.dtype, jnp.floating):
        return np.array_equal(logical, padded_real)
    # Only reduction order may differ between the two runs (a sum over more zeros):
    # a few ulps of the largest value. A transform that sees the padding is off by
    # about (padding rows / rows), far above that for any row count below ~10^5.
    eps = float(jnp.finfo(logical.dtype).eps)
    logical, padded_real = logical.astype(np.float64), padded_real.astype(np.float64)
    tolerance = 64 * eps * float(np.max(np.abs(logical), initial=0.0))
    return bool(np.all(np.abs(logical - padded_real) <= tolerance))


def _host(x: Any) -> np.ndarray:
    return np.asarray(jax.random.key_data(x) if is_key(x) else x)


def _agrees(node: Sharded, logical: Any, padded: Any, check_padding: bool) -> bool:
    """Whether one array of the padded run matches the logical run on `node`'s real rows."""
    logical, padded = _host(logical), _host(padded)
    if logical.shape == padded.shape:
        return _close(logical, padded)
    if logical.shape != tuple(node.shape) or padded.shape != node.padded_shape:
        return False  # a state array whose shape depends on the padding
    rows = node.shape[node.dim]
    real, padding = np.split(padded, [rows], axis=node.dim)
    return _close(logical, real) and (not check_padding or not np.any(padding))


def _item_agrees(logical: Any, padded: Any, check_padding: bool) -> bool:
    """Whether the two runs agree on one flattened item (a `Sharded` node or an array)."""
    if not isinstance(padded, Sharded):
        return _close(_host(logical), _host(padded))
    if not is_uneven(padded):
        return True  # a stand-in: the same in both runs
    pairs = zip(jax.tree.leaves(logical.data), jax.tree.leaves(padded.data), strict=True)
    return all(_agrees(padded, a, b, check_padding) for a, b in pairs)


def _disagreeing(logical: Any, padded: Any, check_padding: bool) -> list[tuple[Any, Any]]:
    """(path, padded-run item) of every leaf or state node where the two runs disagree."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(logical, is_leaf=is_sharded)
    # jaxlib ships no stub for PyTreeDef: its public flatten_up_to is unknown to mypy.
    padded_items = treedef.flatten_up_to(padded)  # type: ignore[attr-defined]
    return [
        (path, b)
        for (path, a), b in zip(with_path, padded_items, strict=True)
        if not _item_agrees(a, b, check_padding)
    ]


def _probe(opt: Any, state: Any, real_shapes: bool) -> tuple[list, list]:
    (params, grads), (padded_params, padded_grads) = _probe_inputs(state, 0, real_shapes)
    with probing(), jax.default_device(_host_device()):
        (updates, opt_state), (padded_updates, padded_state) = _both_runs(
            opt, (params, grads), (padded_params, padded_grads)
        )
    return (
        _disagreeing(updates, padded_updates, check_padding=True),
        _disagreeing(opt_state, padded_state, check_padding=False),
    )


def _host_device() -> jax.Device:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device is all there is
        return jax.devices()[0]


def padding_dependence(opt: Any, state: Any) -> tuple[list, list]:
    """Which uneven leaves `opt`'s plain update would compute wrongly on `state`.

    Args:
      opt: an optax `GradientTransformation`.
      state: the sharded state (concrete, traced or abstract: only layouts are read).

    Returns:
      `(update_paths, state_paths)`: `(path, Sharded)` of each leaf whose real rows of
      the update differ from optax's on the logical array (or whose padding rows become
      nonzero), and of each optimizer-state node that differs. Both empty when the
      transform is safe on this state's layout (always when no leaf is uneven).
    """
    items, treedef = jax.tree.flatten(state, is_leaf=is_sharded)
    if not any(_probed(x) for x in items):
        return [], []
    key = _cache_key(opt, treedef, items)
    if key is not None and key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    verdict = _probe_or_none(opt, state)
    if verdict is None:
        return [], []
    if key is not None:
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > _MAX_VERDICTS:
            _VERDICTS.popitem(last=False)
    return verdict


def _probe_or_none(opt: Any, state: Any) -> tuple[list, list] | None:
    """The probe's verdict, or None when the transform cannot run without the caller."""
    try:
        return _probe(opt, state, real_shapes=False)
    except Exception:
        logger.debug(
            "padding probe on one-element stand-ins failed; retrying with the leaves' real shapes",
            exc_info=True,
        )
    try:
        return _probe(opt, state, real_shapes=True)
    except Exception:
        # E.g. an update that needs extra arguments (`value=` of reduce_on_plateau).
        logger.warning(
            "init_optimizer could not probe the optimizer on the uneven leaves "
            "(it raised the error below); if it looks at whole matrices, wrap it "
            "with fs.shard_optimizer",
            exc_info=True,
        )
        return None


def _cache_key(opt: Any, treedef: Any, items: list) -> Any:
    layout = tuple(
        (tuple(x.shape), str(x.dtype), x.padded_shape, x.dim)
        if isinstance(x, Sharded)
        else (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
        for x in items
    )
    key = (opt, treedef, layout)
    try:
        hash(key)
    except TypeError:  # a transform object that is not hashable: probe every time
        return None
    return key


def describe(path: Any, leaf: Sharded) -> str:
    """`params['w'] (shape (130, 128), padded to (136, 128) over 8 shards)`."""
    return (
        f"{_text.leaf_name(path)} (shape {tuple(leaf.shape)}, padded to "
        f"{leaf.padded_shape} over {leaf.num_shards} shards)"
    )
