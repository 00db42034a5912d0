"""The padding probe: does an optax transform's update of real rows depend on padding?

`fs.init_optimizer(opt, state)` runs it before `opt.init` when `state` has uneven
leaves. On single-device host copies (never on the mesh) it trains twice for a few steps
on a fixed loss: once on the uneven leaves' logical arrays, once on the same values padded
with zero rows as funshard stores them. Padding rows are zero in training too, so the two
runs agree exactly where plain `opt.update` on the sharded state gives optax's numbers
(element-wise transforms, global-norm clipping, LAMB's trust ratio) and disagree where
the transform looks at the padded shape (adafactor's row and column means, muon). A leaf
the probe cannot judge (the update does not run, or stays zero while the state
accumulates) is reported as undecided, and refused like one that disagrees. Other leaves
are replaced by one-element stand-ins, so the probe's cost is that of the uneven leaves
alone. Its verdict is cached per transform and layout, a transform keyed by value (its
functions' code and the values they close over), so an equal transform built again is
judged without tracing; and per lowered program, so one that is not keyed by value is
judged again without compiling.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from funshard import _text, comm
from funshard.core._shard_optimizer import is_shard_optimizer, is_uneven, probing
from funshard.core._sharded import Sharded, is_key, is_sharded

logger = logging.getLogger(__name__)

# (transform, layout of the state) -> its Verdict.
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
    return comm.to_padded(values, x)  # each model block padded on its own


def _probed(x: Any) -> bool:
    return is_uneven(x) and jnp.issubdtype(x.dtype, jnp.floating)


def _probe_inputs(state: Any, real_shapes: bool) -> tuple[Any, Any]:
    """The (logical, padded) parameters of the probe's two runs."""
    items, treedef = jax.tree.flatten(state, is_leaf=is_sharded)
    logical, padded = [], []
    for i, x in enumerate(items):
        if _probed(x):
            values = _real_rows(x, i)
            logical.append(dataclasses.replace(x, data=values))
            padded.append(dataclasses.replace(x, data=_padded(x, values)))
            continue
        if isinstance(x, Sharded):
            stand_in = dataclasses.replace(x, data=_stand_in(x, real_shapes))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            stand_in = _stand_in(x, real_shapes)
        else:
            stand_in = x
        logical.append(stand_in)
        padded.append(stand_in)
    return jax.tree.unflatten(treedef, logical), jax.tree.unflatten(treedef, padded)


# Updates the probe runs: enough to see past one step that only accumulates (optax.MultiSteps
# of 2, a warmup that starts at zero) without paying for a long run.
STEPS = 3


def _objective(params: Any) -> jax.Array:
    """The loss the probe trains on: sum(1 - cos(p)) over the floating arrays.

    Zero rows add nothing to it and get a zero gradient, so the logical and the padded run
    see the same value and gradient; `value=`, `grad=` and `value_fn=` of transforms that
    need them (reduce_on_plateau, L-BFGS's line search) come from it.
    """
    arrays = [x for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum((jnp.sum(1 - jnp.cos(x.astype(jnp.float32))) for x in arrays), jnp.float32(0))


def _gradient(params: Any) -> Any:
    def grad(x):
        return jnp.sin(x) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(grad, params)


def _applied(params: Any, updates: Any) -> Any:
    def apply(p, u):
        if not jnp.issubdtype(p.dtype, jnp.floating):
            return p
        # A wrapped transform inside pads its updates back to the node's layout, in the
        # logical run too: its padding rows are zero, and cut here.
        return (p + u[tuple(slice(0, n) for n in p.shape)]).astype(p.dtype)

    return jax.tree.map(apply, params, updates)


def _training(opt: Any, params: Any) -> tuple:
    """`(updates of each step, stacked; final opt_state)` after `opt.init` and STEPS updates."""
    import optax  # here, not at module level: `import funshard` does not load optax

    opt = optax.with_extra_args_support(opt)

    def step(carry, _):
        params, opt_state = carry
        grads = _gradient(params)
        extra = dict(value=_objective(params), grad=grads, value_fn=_objective)
        updates, opt_state = opt.update(grads, opt_state, params, **extra)
        return (_applied(params, updates), opt_state), updates

    carry = (params, opt.init(params))
    try:
        carry, updates = jax.lax.scan(step, carry, length=STEPS)
    except TypeError:  # a state whose types change with its first update: unroll instead
        steps = []
        for _ in range(STEPS):
            carry, out = step(carry, None)
            steps.append(out)
        updates = jax.tree.map(lambda *u: jnp.stack(u), *steps)
    return updates, carry[1]


def _lowered_runs(opt: Any, logical: Any, padded: Any) -> Any:
    """Both runs (on the logical and the padded parameters) as one lowered program."""

    def both(logical, padded):
        return _training(opt, logical), _training(opt, padded)

    return jax.jit(both).lower(logical, padded)


# Compile options, fastest first. Compiling, not running, is the probe's cost: at XLA's
# lowest backend optimisation and with XLA:CPU's legacy emitters instead of its MLIR fusion
# emitters (which own the time), the probe compiles about 7 times as fast as with either
# alone, and op by op each small operation would compile on first use
# (docs/benchmarks_design.md). An XLA without one of these options refuses the set ("No
# such compile option") and the next is tried. Both runs are one program, compiled alike.
_COMPILER_OPTIONS: tuple[dict[str, Any], ...] = (
    {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False},
    {"xla_backend_optimization_level": 0},
)


def _compiled(lowered: Any) -> Any:
    for options in _COMPILER_OPTIONS:
        try:
            # jax 0.10's stub types option values as str | bool (0.12's admits ints: hence
            # unused-ignore); XLA's integer options take ints.
            return lowered.compile(compiler_options=options)  # type: ignore[arg-type, unused-ignore]
        except jax.errors.JaxRuntimeError as exc:
            if "No such compile option" not in str(exc):
                raise
    return lowered.compile()


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


def _padded_axis(node: Sharded, logical: tuple, padded: tuple) -> int | None:
    """The axis along which a state array spans `node`'s padded rows, if it has one.

    A moment has it at the parameter's sharded dim; an array of several copies
    (L-BFGS's memory of past steps) one axis further in.
    """
    rows = (node.shape[node.dim], node.padded_shape[node.dim])
    if len(logical) != len(padded):
        return None
    differ = [
        axis for axis, pair in enumerate(zip(logical, padded, strict=True)) if pair[0] != pair[1]
    ]
    if len(differ) == 1 and (logical[differ[0]], padded[differ[0]]) == rows:
        return differ[0]
    return None


def _agrees(node: Sharded, logical: Any, padded: Any, check_padding: bool) -> bool:
    """Whether one array of the padded run matches the logical run on `node`'s real rows."""
    logical, padded = _host(logical), _host(padded)
    if logical.shape == padded.shape:
        return _close(logical, padded)
    axis = _padded_axis(node, logical.shape, padded.shape)
    if axis is None:
        return False  # a state array whose shape depends on the padding otherwise
    blocks, rows = node.model_split(node.dim), node.block_shape[node.dim]
    real = comm.unpad_blocks(padded, axis, blocks, rows)
    size = node.rows_per_shard * node.num_shards
    kept = comm.pad_blocks(np.ones(real.shape, bool), axis, blocks, size)
    return _close(logical, real) and (not check_padding or not np.any(padded[~kept]))


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


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the probe found on the uneven leaves of one optimizer and state layout.

    Attributes:
      updates: each leaf whose update depends on its padding rows (its `describe` text).
      states: the key path of each optimizer-state node that does.
      undecided: each leaf the probe could not judge (its `describe` text).
      reason: why it could not, when `undecided` is not empty.
    """

    updates: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    undecided: tuple[str, ...] = ()
    reason: str = ""


def _probed_leaves(tree: Any) -> list[tuple[Any, Sharded]]:
    with_path = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]
    return [(path, x) for path, x in with_path if isinstance(x, Sharded) and _probed(x)]


def _scaled(tree: Any, paths: set[str]) -> Any:
    """`tree` with the data of the probed leaves at `paths` halved."""

    def leaf(path, x):
        if isinstance(x, Sharded) and jax.tree_util.keystr(path) in paths:
            return dataclasses.replace(x, data=x.data * np.asarray(0.5, x.data.dtype))
        return x

    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_sharded)


def _nodes_of(state: Any, leaf: str) -> list:
    """The arrays of the optimizer-state nodes kept for the parameter at path `leaf`
    (optax's states mirror the parameters: their paths end with the parameter's)."""
    with_path = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_sharded)[0]
    return [
        _host(a)
        for path, x in with_path
        if isinstance(x, Sharded) and jax.tree_util.keystr(path).endswith(leaf)
        for a in jax.tree.leaves(x.data)
    ]


def _accumulating(compiled: Any, logical: Any, padded: Any, state: Any, quiet: list) -> list:
    """Of the leaves whose update stayed zero, those whose optimizer state still took in
    their gradients (accumulated for a later update: the probe saw nothing of it yet).

    A leaf whose state is the same for other parameter values (a frozen leaf under
    `optax.set_to_zero`, or no state at all) updates by zero whatever: it is exact.
    """
    names = {jax.tree_util.keystr(path) for path, _ in quiet}
    (_, other), _ = compiled(_scaled(logical, names), _scaled(padded, names))
    return [
        (path, x)
        for path, x in quiet
        if not all(
            np.array_equal(a, b)
            for a, b in zip(
                _nodes_of(state, jax.tree_util.keystr(path)),
                _nodes_of(other, jax.tree_util.keystr(path)),
                strict=True,
            )
        )
    ]


def _judge(compiled: Any, logical: Any, padded: Any) -> Verdict:
    (updates, state), (padded_updates, padded_state) = compiled(logical, padded)
    quiet = [(p, x) for p, x in _probed_leaves(updates) if not np.any(_host(x.data))]
    undecided = _accumulating(compiled, logical, padded, state, quiet) if quiet else []
    return Verdict(
        updates=tuple(
            describe(p, x) for p, x in _disagreeing(updates, padded_updates, check_padding=True)
        ),
        states=tuple(
            _text.leaf_name(p) for p, _ in _disagreeing(state, padded_state, check_padding=False)
        ),
        undecided=tuple(describe(p, x) for p, x in undecided),
        reason=(
            f"their updates stayed zero for the probe's {STEPS} steps while the optimizer "
            "state took in their gradients (gradient accumulation such as optax.MultiSteps "
            "inside another transform, or a learning rate that is still zero), so the probe "
            "saw no update to compare"
        ),
    )


# Hash of the probe's lowered program -> its verdict. Equal programs get equal inputs (the
# inputs follow from the layout the program's argument types spell out), so they get the
# same verdict: a new but equal optimizer instance is judged by lowering alone.
_PROGRAM_VERDICTS: collections.OrderedDict = collections.OrderedDict()


def _remember(cache: collections.OrderedDict, key: Any, verdict: Verdict) -> Verdict:
    cache[key] = verdict
    while len(cache) > _MAX_VERDICTS:
        cache.popitem(last=False)
    return verdict


def _probe(opt: Any, state: Any, real_shapes: bool) -> Verdict:
    logical, padded = _probe_inputs(state, real_shapes)
    with probing(), jax.default_device(_host_device()):
        lowered = _lowered_runs(opt, logical, padded)
        # The leaves' descriptions too: the program does not show the shard counts the
        # verdict's text names.
        leaves = "\n".join(describe(path, x) for path, x in _probed_leaves(state))
        key = hashlib.sha256(f"{lowered.as_text()}\n{leaves}".encode()).hexdigest()
        if key in _PROGRAM_VERDICTS:
            _PROGRAM_VERDICTS.move_to_end(key)
            return _PROGRAM_VERDICTS[key]
        return _remember(_PROGRAM_VERDICTS, key, _judge(_compiled(lowered), logical, padded))


def _host_device() -> jax.Device:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device is all there is
        return jax.devices()[0]


def _deciding_transform(opt: Any) -> Any:
    """The transform whose numbers decide: an `optax.MultiSteps`'s inner one.

    MultiSteps itself only averages gradients element by element and emits its inner
    transform's update every k steps, so it is exact padded exactly when that transform
    is; probing the inner one sees an update at once, however large k.
    """
    import optax  # here, not at module level: `import funshard` does not load optax

    owner = opt if isinstance(opt, optax.MultiSteps) else getattr(opt.init, "__self__", None)
    inner = getattr(owner, "_opt", None) if isinstance(owner, optax.MultiSteps) else None
    return opt if inner is None else _deciding_transform(inner)


def padding_dependence(opt: Any, state: Any) -> Verdict:
    """Which uneven leaves `opt`'s plain update would compute wrongly on `state`.

    Runs `opt.init` and STEPS updates (on the gradients of a fixed loss, with its
    `value=`, `grad=` and `value_fn=` for transforms that take them) on host copies of
    the uneven leaves, once logical and once padded, and compares.

    Args:
      opt: an optax `GradientTransformation`.
      state: the sharded state (concrete, traced or abstract: only layouts are read).

    Returns:
      A `Verdict`: the leaves whose real rows of the update differ from optax's on the
      logical array (or whose padding rows become nonzero), the optimizer-state nodes
      that differ, and the leaves the probe could not judge (it could not run the
      update, or saw only zero updates while the state accumulated). All empty when the
      transform is exact on this state's layout (always when no leaf is uneven).
    """
    items, treedef = jax.tree.flatten(state, is_leaf=is_sharded)
    opt = _deciding_transform(opt)
    if not any(_probed(x) for x in items) or is_shard_optimizer(opt):
        return Verdict()
    key = _cache_key(opt, treedef, items)
    if key is not None and key in _VERDICTS:
        _VERDICTS.move_to_end(key)
        return _VERDICTS[key]
    verdict = _verdict(opt, state)
    return verdict if key is None else _remember(_VERDICTS, key, verdict)


def _verdict(opt: Any, state: Any) -> Verdict:
    try:
        return _probe(opt, state, real_shapes=False)
    except Exception:
        logger.debug(
            "padding probe on one-element stand-ins failed; retrying with the leaves' real shapes",
            exc_info=True,
        )
    try:
        return _probe(opt, state, real_shapes=True)
    except Exception as exc:  # the transform's own error, whatever its type
        logger.debug("padding probe failed", exc_info=True)
        first_line = (str(exc).splitlines() or [""])[0]
        return Verdict(
            undecided=tuple(describe(p, x) for p, x in _probed_leaves(state)),
            reason=f"the probe could not run the update ({type(exc).__name__}: {first_line})",
        )


def _cache_key(opt: Any, treedef: Any, items: list) -> Any:
    layout = tuple(
        # The shard count is in the verdict's text, not in the padded shape alone.
        (tuple(x.shape), str(x.dtype), x.padded_shape, x.dim, x.num_shards, x.model_axes)
        if isinstance(x, Sharded)
        else (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
        for x in items
    )
    try:
        transform = _by_value(opt)
    except _Opaque:  # keyed as the object itself
        transform = opt
    key = (transform, treedef, layout)
    try:
        hash(key)
    except TypeError:  # a transform object that is not hashable: probe every time
        return None
    return key


class _Opaque(Exception):
    """A part of a transform that `_by_value` does not key by value."""


# Arrays a transform closes over (masks, schedule boundaries) are keyed by their bytes
# up to this size; a larger one makes the transform opaque.
_MAX_KEYED_ELEMENTS = 4096
_MAX_DEPTH = 64


def _by_value(x: Any, seen: tuple = ()) -> Any:
    """A hashable key for a part of an optax transform, equal for parts that compute alike.

    optax builds a transform from closures, so `optax.adamw(1e-3)` called twice gives two
    objects of equal code closing over equal values. A function is keyed by its code, its
    module's globals (by identity), its defaults, attributes and the values of its cells,
    and the scalars it reads from its globals (a module-level learning rate): two functions
    with equal keys compute as one function called twice does, so they get the same
    verdict the per-object cache gives that function. Numbers are keyed by type and repr
    (0.0 is not -0.0, 1 is not True), containers by their items, arrays by their bytes,
    types by identity. Anything else (an object with attributes of its own, a bound method,
    a tracer, a large array) raises `_Opaque`: such a transform is cached per object only.
    """
    if isinstance(x, (type(None), bool, int, float, complex, str, bytes, np.generic)):
        return (type(x), repr(x))
    if isinstance(x, type):
        return ("type", x)
    if isinstance(x, np.dtype):
        return ("dtype", str(x))
    if id(x) in seen:
        return ("cycle", seen.index(id(x)))
    if len(seen) > _MAX_DEPTH:
        raise _Opaque
    seen = (*seen, id(x))
    if isinstance(x, tuple):  # namedtuples included, with any attributes of their own
        attributes = _by_value(getattr(x, "__dict__", {}), seen)
        return (type(x), tuple(_by_value(item, seen) for item in x), attributes)
    if type(x) in (list, dict):
        items = x.items() if isinstance(x, dict) else enumerate(x)
        return (type(x), tuple((_by_value(k, seen), _by_value(v, seen)) for k, v in items))
    if isinstance(x, types.FunctionType):
        return _function_key(x, seen)
    if isinstance(x, functools.partial):
        return ("partial", *(_by_value(a, seen) for a in (x.func, x.args, x.keywords)))
    if type(x) is np.ndarray and x.size <= _MAX_KEYED_ELEMENTS:
        return ("ndarray", str(x.dtype), x.shape, x.tobytes())
    raise _Opaque


def _function_key(fn: types.FunctionType, seen: tuple) -> Any:
    try:
        cells = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    except ValueError:  # an empty cell (a variable not yet assigned)
        raise _Opaque from None
    scalars = sorted(
        (name, fn.__globals__[name])
        for name in _global_names(fn.__code__)
        if isinstance(fn.__globals__.get(name), (bool, int, float, complex, str))
    )
    parts = (fn.__defaults__, fn.__kwdefaults__, fn.__dict__, cells, scalars)
    return (
        "function",
        fn.__code__,
        id(fn.__globals__),
        *(_by_value(part, seen) for part in parts),
    )


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` and the functions defined in it may read from their globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def describe(path: Any, leaf: Sharded) -> str:
    """`params['w'] (shape (130, 128), padded to (136, 128) over 8 shards)`."""
    return (
        f"{_text.leaf_name(path)} (shape {tuple(leaf.shape)}, padded to "
        f"{leaf.padded_shape} over {leaf.num_shards} shards)"
    )
