"""Randomness inside the root: each device's rows of the draw plain JAX makes on the global batch.

The loss runs on every device with the step's replicated arguments, so a key passed to
the step is the same on every device. Plain JAX on the global batch of `R` rows draws
`jax.random.bernoulli(key, p, (R, d))` once and gives row `i` to example `i`; each
device, drawing `(r, d)` for its `r` rows, would repeat the first `r` rows on every
device. So the root rewrites the traced program of each microbatch: a draw (every
`jax.random` sampler draws through the `random_bits` primitive, a split through
`random_split`) whose key is the same on every device and whose shape scales with the
batch is replaced by this device's rows of the draw of the global shape, at the rows the
device's (micro)batch holds in the global batch. Any other draw (a scalar, noise shaped
like a parameter) is left as the loss wrote it: the same key gives the same numbers on
every device, as in plain JAX. The numbers are therefore a function of the key and of
the example's index in the global batch only: equal on any mesh and any number of
microbatches, and equal to plain JAX.

Which draws scale with the batch is read, not guessed: the loss is traced a second time
on a batch of twice the rows, and a draw is per example when one of its dimensions
doubled and the rest did not. A draw that changes otherwise is refused with its source
line. With `jax_threefry_partitionable` (JAX's default) and the default threefry keys,
the device's rows are computed from their counters alone (the bits of element `j` of a
draw depend only on the key and `j`); otherwise the global draw is made and sliced.

`value_and_grad(..., per_device_keys=False)` turns the rewrite off: every draw is made
as the loss writes it, on the device's rows only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from funshard import _jax_compat, comm, errors
from funshard.core._control_flow import sub_jaxprs

_DRAWS = ("random_bits", "random_split")


def _draws(jaxpr: Any, where: str = "") -> Iterator[tuple[Any, str]]:
    """The `random_bits` / `random_split` equations of `jaxpr`, nested ones included,
    in program order, each with the user's source line that leads to it.

    jax.random's samplers are jitted, so the draw itself sits in a nested jaxpr whose
    equations know only JAX's own frames: the outermost equation's line is the user's.
    """
    for eqn in jaxpr.eqns:
        line = where or _jax_compat.source_line(eqn)
        if eqn.primitive.name in _DRAWS:
            yield eqn, line
        for sub in sub_jaxprs(eqn):
            yield from _draws(sub, line)


def _shared_key(eqn: Any, dp_axes: Sequence[str]) -> bool:
    """Whether a draw's key is the same on every device (varies over no data axis)."""
    return not set(dp_axes) & _jax_compat.aval_varying_axes(eqn.invars[0].aval)


def _batch_axis(small: tuple, large: tuple) -> int | None:
    """The one axis that doubled from `small` to `large` (None: the shapes are equal).

    Raises:
      ValueError: the shapes differ otherwise.
    """
    changed = [i for i, (a, b) in enumerate(zip(small, large, strict=False)) if a != b]
    if len(small) != len(large) or len(changed) > 1:
        raise ValueError
    if not changed:
        return None
    axis = changed[0]
    if large[axis] != 2 * small[axis]:
        raise ValueError
    return axis


def _not_per_example(fn: str, where: str, small, large) -> str:
    return (
        f"{fn}: a random draw (at {where}) changes shape with the batch in a way funshard "
        f"cannot map onto the global batch: shape {small} on this device's rows, {large} "
        "on twice as many. Each device draws the rows of the draw plain JAX makes on the "
        "global batch, which needs exactly one dimension proportional to the batch "
        "(e.g. (rows, features) or (rows * length,)). Draw with such a shape and reshape "
        f"afterwards, or pass {fn}(..., per_device_keys=False) to draw on each device's "
        "rows as written (every device then draws the same numbers)."
    )


def _ambiguous(fn: str, where: str, shape) -> str:
    return (
        f"{fn}: a random draw of shape {shape} (at {where}) is made twice through one "
        "traced sampler, once per example and once not (its shape happens to match the "
        "batch), so funshard cannot tell which rows of the global draw it needs. Give the "
        "draw that is not per example another shape, or use a separate key for each."
    )


def _plan(
    fn: Callable, batch: Any, jaxpr: Any, dp_axes: Sequence[str], name: str
) -> dict[int, int]:
    """id of each per-example draw equation of `jaxpr` -> the axis that holds the batch.

    Traces `fn` again on `batch` with twice the rows and compares the draws in
    program order. Draws whose key varies between devices (folded by the user, or a
    per-example key in the batch) are left out: they are already per device.

    Raises:
      ShardingValueError: a draw changes shape otherwise than along one batch axis, or
        one traced draw serves both a per-example and a shared draw.
    """
    small = [(e, w) for e, w in _draws(jaxpr) if _shared_key(e, dp_axes)]
    if not any(e.outvars[0].aval.ndim for e, _ in small):
        return {}
    doubled = jax.tree.map(lambda x: jnp.concatenate([x, x]), batch)
    large = [e for e, _ in _draws(jax.make_jaxpr(fn)(doubled).jaxpr) if _shared_key(e, dp_axes)]
    if len(large) != len(small):
        where = small[0][1] if small else "the loss"
        raise errors.ShardingValueError(
            f"{name}: the loss makes {len(small)} random draws on this device's rows but "
            f"{len(large)} on twice as many (first draw at {where}), so funshard cannot "
            "match its draws to those of the global batch. Make the number of draws "
            f"independent of the batch size, or pass {name}(..., per_device_keys=False)."
        )
    plan: dict[int, int | None] = {}
    for (eqn, where), big in zip(small, large, strict=True):
        shape, big_shape = eqn.outvars[0].aval.shape, big.outvars[0].aval.shape
        try:
            axis = _batch_axis(shape, big_shape)
        except ValueError:
            raise errors.ShardingValueError(
                _not_per_example(name, where, shape, big_shape)
            ) from None
        if plan.get(id(eqn), axis) != axis:
            raise errors.ShardingValueError(_ambiguous(name, where, shape))
        plan[id(eqn)] = axis
    return {i: a for i, a in plan.items() if a is not None}


def _local_draw(eqn: Any, key: jax.Array, axis: int, block: jax.Array, blocks: int):
    """This device's part of the draw `eqn` makes with the global batch's shape.

    The local draw's `axis` holds `size` rows of the batch; the global draw holds
    `size * blocks`, and this (micro)batch's rows start at `block * size`.
    """
    size = eqn.outvars[0].aval.shape[axis]
    start = block * size
    name, params = eqn.primitive.name, eqn.params
    lead = key.ndim
    if name == "random_bits" and axis >= lead:
        shape = tuple(params["shape"])
        global_shape = (*shape[: axis - lead], size * blocks, *shape[axis - lead + 1 :])
        direct = _jax_compat.threefry_rows(
            key, params["bit_width"], global_shape, axis - lead, start, size
        )
        if direct is not None:
            return direct
    # The draw of the global shape, sliced: exact for every key implementation.
    if axis < lead:
        raise errors.ShardingValueError(
            "value_and_grad: a random draw from an array of keys whose number of keys "
            "grows with the batch is not supported; draw from one key, or pass "
            "value_and_grad(..., per_device_keys=False)."
        )
    shape = tuple(params["shape"])
    inner = axis - lead
    global_shape = (*shape[:inner], size * blocks, *shape[inner + 1 :])
    if name == "random_bits":
        full = jax.random.bits(key, global_shape, jnp.dtype(f"uint{params['bit_width']}"))
    else:
        full = _split(key, global_shape)
    return jax.lax.dynamic_slice_in_dim(full, start, size, axis)


def _split(key: jax.Array, shape: tuple) -> jax.Array:
    if key.ndim == 0:
        return jax.random.split(key, shape)
    flat = key.reshape(-1)
    out = jax.vmap(lambda k: jax.random.split(k, shape))(flat)
    return out.reshape(*key.shape, *shape)


class _Interpreter:
    """Evaluates a microbatch's jaxpr with the per-example draws of `plan` replaced.

    Every equation is bound again, so types follow the values: a replaced draw varies
    between devices, and so does what is computed from it. An equation that holds a
    jaxpr is bound as traced unless a replaced draw, or a value whose type changed,
    reaches it; then it is evaluated here again (jit-like calls inlined, `jax.checkpoint`,
    `lax.scan`, `lax.cond` and `lax.while_loop` rebuilt around the rewritten body).
    """

    def __init__(self, plan: dict[int, int], block, blocks: int, dp_axes, name: str):
        self.plan, self.block, self.blocks = plan, block, blocks
        self.dp_axes, self.name = tuple(dp_axes), name
        self._reaches: dict[int, bool] = {}

    def _holds_plan(self, jaxpr: Any) -> bool:
        found = self._reaches.get(id(jaxpr))
        if found is None:
            found = any(id(e) in self.plan for e, _ in _draws(jaxpr))
            self._reaches[id(jaxpr)] = found
        return found

    def eval(self, jaxpr: Any, consts: Sequence, args: Sequence) -> list:
        env: dict[Any, Any] = {}

        def read(v):
            return _jax_compat.literal_value(v, env)

        for v, x in zip(jaxpr.constvars, consts, strict=True):
            env[v] = x
        for v, x in zip(jaxpr.invars, args, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self._equation(eqn, invals)
            for v, x in zip(eqn.outvars, outs, strict=True):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _equation(self, eqn: Any, invals: list) -> list:
        axis = self.plan.get(id(eqn))
        if axis is not None and not set(self.dp_axes) & _jax_compat.varying_axes(invals[0]):
            return [_local_draw(eqn, invals[0], axis, self.block, self.blocks)]
        if eqn.primitive.name in _jax_compat.VARYING_CASTS:
            # Already varying (a replaced draw's descendant): cast only what is missing.
            return [comm.vary(x, _jax_compat.cast_axes(eqn)) for x in invals]
        subs = list(sub_jaxprs(eqn))
        retyped = any(
            _jax_compat.varying_axes(x) != _jax_compat.aval_varying_axes(v.aval)
            for v, x in zip(eqn.invars, invals, strict=True)
            if hasattr(x, "dtype")
        )
        if subs and (retyped or any(self._holds_plan(s) for s in subs)):
            return self._higher_order(eqn, invals)
        if retyped:
            # As JAX's own functions do when tracing: operands of one primitive share
            # one varying type (a replaced draw's descendant with a constant operand).
            arrays = [x for x in invals if hasattr(x, "dtype")]
            axes = tuple(sorted(set().union(*(_jax_compat.varying_axes(x) for x in arrays))))
            invals = [comm.vary(x, axes) if hasattr(x, "dtype") else x for x in invals]
        return _jax_compat.bind_equation(eqn, invals)

    def _higher_order(self, eqn: Any, invals: list) -> list:
        rebuilt = _jax_compat.rebuild_higher_order(eqn, invals, self.eval, self.dp_axes)
        if rebuilt is None:
            raise errors.ShardingValueError(
                f"{self.name}: a per-example random draw (at "
                f"{_jax_compat.source_line(eqn)}) sits inside `{eqn.primitive.name}`, "
                "which funshard cannot rebuild around the draw of the global batch. "
                "Draw outside it and pass the numbers in, or pass "
                f"{self.name}(..., per_device_keys=False)."
            )
        return rebuilt


def global_draws(
    fn: Callable,
    batch: Any,
    dp_axes: Sequence[str],
    block: jax.Array,
    blocks: int,
    name: str = "value_and_grad",
) -> Callable:
    """An evaluator of `fn`'s traced jaxpr that draws as plain JAX on the global batch.

    Args:
      fn: the microbatch's function, traced by the caller on `batch`.
      batch: the microbatch's rows on this device.
      dp_axes: the step's data-parallel axes.
      block: this microbatch's position among the global batch's `blocks` equal blocks
        of rows (device-major over `dp_axes`, then microbatch), traced.
      blocks: data-parallel devices times microbatches.
      name: the public function to name in messages.

    Returns:
      `evaluate(jaxpr, consts, *args) -> outputs`, a drop-in for `eval_jaxpr`.
    """

    def evaluate(jaxpr: Any, consts: Sequence, *args: Any) -> list:
        plan = _plan(fn, batch, jaxpr, dp_axes, name)
        if not plan:
            return _jax_compat.jaxpr_internals()[0].eval_jaxpr(jaxpr, consts, *args)
        return _Interpreter(plan, block, blocks, dp_axes, name).eval(jaxpr, consts, args)

    return evaluate
