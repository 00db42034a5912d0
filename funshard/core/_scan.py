"""`scan` and `lax_scan`: stacked layers under `jax.lax.scan`, gathering layer i+1 while
layer i runs.

MaxText-style models keep their blocks stacked on a leading layer axis so that the
program (and its compile time) does not grow with depth. `scan` is the FSDP unit for
such a stack: a `custom_vjp` whose forward is a `lax.scan` carrying a double buffer
(this layer's gathered parameters, and the next layer's, issued before this layer
computes), and whose backward is a reverse `lax.scan` that re-gathers each layer
(prefetching the previous one) and reduce-scatters its gradient as soon as the layer is
done. The gathered parameters are dropped from the saved residuals, as in `fully_shard`;
of the activations, each layer saves what a fused loop of units keeps (matmul outputs and
other non-elementwise values) and recomputes only elementwise ones in the backward loop
(`funshard.core._residuals`). The loop itself is unit machinery and lives in
`funshard.core._unit` (`call_scanned`).

Two calling conventions share that loop. `scan(fn, stacked, carry)` with
`fn(layer, carry) -> carry` is funshard's own; `lax_scan(f, init, xs)` with
`f(carry, x) -> (carry, y)` is `jax.lax.scan`'s, so that a model which already scans its
blocks changes one call. Two names, not a flag: the argument orders differ, and a flag
would let the same positional call mean either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from funshard import _text, comm, errors
from funshard.core import _context, _tree, _unit
from funshard.core._shard import unshard_as
from funshard.core._sharded import Sharded


def _scan_not_stacked(api: str, path, dim: int) -> str:
    return (
        f"{_text.where(api, path)} is sharded on dim {dim}, not as a stack of layers; shard "
        "the stacked parameters with fs.shard(..., stacked=True)."
    )


def _check_stacked(api: str, paths, items):
    bad = [
        _scan_not_stacked(api, path, x.dim)
        for path, x in zip(paths, items, strict=True)
        if isinstance(x, Sharded) and x.dim != 1
    ]
    if bad:  # every bad leaf at once
        raise errors.ShardingValueError(_text.joined(bad))


def _layer_axes(counts) -> str:
    return ", ".join(f"{_text.leaf_name(path)} {shape}" for path, shape in counts)


def _scan_no_layers(api: str, fn_name: str, counts) -> str:
    return (
        f"{api}: the stack given to fs.{api}({fn_name}, ...) holds no layers: its layer axis "
        f"(dim 0) has size 0 ({_layer_axes(counts)}). Stack at least one layer, or skip "
        f"the fs.{api} call for a model without such layers."
    )


def _scan_layer_counts(api: str, fn_name: str, counts) -> str:
    return (
        f"{api}: the leaves of the stack given to fs.{api}({fn_name}, ...) disagree on the "
        f"number of layers (dim 0): {_layer_axes(counts)}. Stack every leaf over the same "
        "layers."
    )


def _check_layers(api: str, fn: Callable, paths, items) -> int:
    """Every leaf of the stack holds the same number of layers, at least one: that number."""
    counts = [
        (path, tuple(x.shape))
        for path, x in zip(paths, items, strict=True)
        if (isinstance(x, Sharded) or hasattr(x, "shape")) and len(x.shape) >= 1
    ]
    name = getattr(fn, "__name__", type(fn).__name__)
    if any(shape[0] == 0 for _, shape in counts):
        raise errors.ShardingValueError(_scan_no_layers(api, name, counts))
    if len({shape[0] for _, shape in counts}) > 1:
        raise errors.ShardingValueError(_scan_layer_counts(api, name, counts))
    return counts[0][1][0]


def _scan_hpz_unsupported(api: str, k: int) -> str:
    return (
        f"{api}: reshard_after_forward={k} (hpZ) is not supported for scanned stacks yet; "
        "use True or False."
    )


def scan(
    fn: Callable,
    stacked: Any,
    carry: Any,
    *,
    reshard_after_forward: bool = True,
    all_gather: comm.AllGather | None = None,
    reduce_scatter: comm.ReduceScatter | None = None,
) -> Any:
    """Runs `carry = fn(layer_params, carry)` over a stack of sharded layers.

    Args:
      fn: one layer, taking its full parameters and the carry (e.g. the hidden state)
        and returning the new carry (same structure, shapes and dtypes).
      stacked: the layers' parameters stacked on a leading layer axis, sharded with
        `funshard.shard(..., stacked=True)`.
      carry: the initial carry.
      reshard_after_forward: as for `funshard.fully_shard`: True frees each layer's
        gathered parameters after its forward and gathers them again (prefetched) in
        the backward pass; False keeps them.
      all_gather: as for `funshard.fully_shard`: each layer's own all-gather.
      reduce_scatter: as for `funshard.fully_shard`: each layer's own reduce-scatter.

    Returns:
      The final carry. Inside `funshard.value_and_grad` each layer's all-gather is
      issued before the previous layer computes, and each layer's gradient is
      reduce-scattered as soon as its backward is done; outside a step the stack is
      gathered and scanned (e.g. for evaluation).

    Raises:
      ValueError: `stacked` has no `Sharded` leaves, was not sharded as a stack, holds
        no layers (a layer axis of size 0), or its leaves disagree on the layer count.
      TypeError: `reshard_after_forward` is not a bool or int, or `all_gather` /
        `reduce_scatter` is not an `fs.AllGather` / `fs.ReduceScatter`.
      NotImplementedError: deferred gradient accumulation
        (`sync_every_microbatch=False`) over a scanned stack, or an int
        `reshard_after_forward` (hpZ).
    """
    _check_reshard("scan", reshard_after_forward)
    comm.check_unit_collectives("scan", all_gather, reduce_scatter)
    collectives = (all_gather, reduce_scatter)
    if not _has_sharded(stacked) and _has_sharded(carry):
        raise errors.ShardingValueError(_scan_arguments_swapped())
    unit = _unit.prepare("scan", stacked)
    _check_stacked("scan", unit.paths, unit.parts.items)
    _check_layers("scan", fn, unit.paths, unit.parts.items)
    carry = _unit.cast_inputs(unit, carry)
    _unit.log_plan("scan", _name(fn), unit, reshard_after_forward)

    def step(c, layer):
        return fn(layer, c), None

    if _context.current() is None:
        full = _unit.cast_floating(unshard_as(stacked, _name(fn), collectives), unit.param_dtype)
        out = jax.lax.scan(step, carry, full)[0]
    else:
        out = _unit.call_scanned(step, unit, carry, reshard_after_forward, _name(fn), collectives)[
            0
        ]
    return _unit.cast_floating(out, unit.output_dtype)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _has_sharded(tree: Any) -> bool:
    return any(isinstance(x, Sharded) for x in _tree.sharded_leaves(tree)[1])


def _check_reshard(api: str, reshard_after_forward) -> None:
    _unit.check_reshard_after_forward(api, reshard_after_forward)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise errors.UnsupportedError(_scan_hpz_unsupported(api, reshard_after_forward))


def _scan_arguments_swapped() -> str:
    return (
        "scan: the sharded layers were passed as the carry: fs.scan takes "
        "(fn, stacked, carry) with fn(layer_params, carry) -> carry. For jax.lax.scan's "
        "order, f(carry, x) -> (carry, y) over (f, init, xs), call fs.lax_scan."
    )


def lax_scan(
    f: Callable,
    init: Any,
    xs: Any,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    *,
    reshard_after_forward: bool = True,
    all_gather: comm.AllGather | None = None,
    reduce_scatter: comm.ReduceScatter | None = None,
) -> tuple[Any, Any]:
    """Runs `jax.lax.scan(f, init, xs)` over a stack of sharded layers, as FSDP units.

    The calling convention and the result are `jax.lax.scan`'s, so a model that scans
    its own blocks changes one call: `jax.lax.scan(block, h, params["blocks"])` becomes
    `fs.lax_scan(block, h, state["blocks"])`. Every `fs.Sharded` leaf of `xs` is
    gathered one layer at a time, as `funshard.scan` does.

    Args:
      f: one layer, `f(carry, x) -> (carry, y)`: `x` is `xs` with every leaf indexed at
        the layer (the `Sharded` leaves gathered to full arrays), the new carry has the
        structure, shapes and dtypes of the old, `y` is any pytree of arrays (or None).
      init: the initial carry.
      xs: a pytree whose leaves all have the layer axis first: the stacked layers
        sharded with `funshard.shard(..., stacked=True)` (e.g. `state["blocks"]`),
        possibly beside other per-layer arrays (e.g. `(state["blocks"], masks)`). Under
        a mixed-precision policy every floating leaf of `x` reaches `f` in
        `param_dtype`, and floating leaves of `init` too if `cast_forward_inputs`.
      length: as in `jax.lax.scan`: None, or the number of layers.
      reverse: only False (the layers run in stack order).
      unroll: only 1 (each layer is one iteration of the loop).
      reshard_after_forward: as for `funshard.fully_shard`: True frees each layer's
        gathered parameters after its forward and gathers them again (prefetched) in
        the backward pass; False keeps them.
      all_gather: as for `funshard.fully_shard`: each layer's own all-gather.
      reduce_scatter: as for `funshard.fully_shard`: each layer's own reduce-scatter.

    Returns:
      `(carry, ys)` as `jax.lax.scan` returns them: the final carry and every layer's
      `y` stacked on a new leading axis. Inside `funshard.value_and_grad` each layer's
      all-gather is issued before the previous layer computes, and each layer's gradient
      is reduce-scattered as soon as its backward is done; outside a step the stack is
      gathered and scanned (e.g. for evaluation).

    Raises:
      ValueError: `xs` has no `Sharded` leaves (or `init` holds them: the arguments are
        in `funshard.scan`'s order), a `Sharded` leaf was not sharded as a stack, a leaf
        of `xs` has no layer axis, the leaves disagree on the layer count, the stack
        holds no layers, or `length` is not that count.
      TypeError: `f` does not return a pair, `reshard_after_forward` is not a bool
        or int, or `all_gather` / `reduce_scatter` is not an `fs.AllGather` /
        `fs.ReduceScatter`.
      NotImplementedError: `reverse=True`, `unroll` other than 1, an int
        `reshard_after_forward` (hpZ), or deferred gradient accumulation
        (`sync_every_microbatch=False`).
    """
    _check_reshard("lax_scan", reshard_after_forward)
    comm.check_unit_collectives("lax_scan", all_gather, reduce_scatter)
    collectives = (all_gather, reduce_scatter)
    _check_loop_options(reverse, unroll)
    if not _has_sharded(xs) and _has_sharded(init):
        raise errors.ShardingValueError(_lax_scan_arguments_swapped())
    unit = _unit.prepare("lax_scan", xs)
    _check_stacked("lax_scan", unit.paths, unit.parts.items)
    _check_per_layer(unit.paths, unit.parts.items)
    layers = _check_layers("lax_scan", f, unit.paths, unit.parts.items)
    if length is not None and length != layers:
        raise errors.ShardingValueError(_lax_scan_length(length, layers))
    step = _returning_pairs(f)
    init = _unit.cast_inputs(unit, init)
    _unit.log_plan("lax_scan", _name(f), unit, reshard_after_forward)
    if _context.current() is None:
        full = _unit.cast_floating(unshard_as(xs, _name(f), collectives), unit.param_dtype)
        out = jax.lax.scan(step, init, full)
    else:
        out = _unit.call_scanned(step, unit, init, reshard_after_forward, _name(f), collectives)
    return _unit.cast_floating(out, unit.output_dtype)


def _check_loop_options(reverse, unroll) -> None:
    if reverse:
        raise errors.UnsupportedError(_lax_scan_unsupported("reverse=True", "reverse the stack"))
    if isinstance(unroll, bool) and not unroll:
        return  # lax.scan reads unroll=False as 1
    if isinstance(unroll, bool) or unroll != 1:
        raise errors.UnsupportedError(_lax_scan_unsupported(f"unroll={unroll!r}", "pass 1"))


def _lax_scan_unsupported(option: str, fix: str) -> str:
    return (
        f"lax_scan: {option} is not supported for sharded stacks yet (the loop prefetches "
        f"the next layer's gather, one layer per iteration); {fix}, or use jax.lax.scan "
        "over units made with fs.fully_shard."
    )


def _lax_scan_arguments_swapped() -> str:
    return (
        "lax_scan: the sharded layers were passed as init: fs.lax_scan takes jax.lax.scan's "
        "(f, init, xs) with f(carry, x) -> (carry, y), so the stacked layers go in xs (the "
        "third argument). For (fn, stacked, carry) with fn(layer_params, carry) -> carry, "
        "call fs.scan."
    )


def _no_layer_axis(path, x) -> str:
    what = f"a {type(x).__name__}" if not hasattr(x, "shape") else f"shape {tuple(x.shape)}"
    return (
        f"{_text.where('lax_scan', path)} of xs has {what}, no layer axis: every leaf of xs is "
        "sliced per layer, as in jax.lax.scan. Stack it over the layers, or pass it to f "
        "through a closure (functools.partial) if every layer uses the same value."
    )


def _check_per_layer(paths, items) -> None:
    """Every leaf of `xs` that is not `Sharded` is an array with a leading layer axis."""
    bad = [
        _no_layer_axis(path, x)
        for path, x in zip(paths, items, strict=True)
        if not isinstance(x, Sharded) and len(getattr(x, "shape", ())) == 0
    ]
    if bad:  # every bad leaf at once
        raise errors.ShardingValueError(_text.joined(bad))


def _lax_scan_length(length: int, layers: int) -> str:
    return (
        f"lax_scan: length={length}, but xs stacks {layers} layers (dim 0 of its leaves). "
        "Pass length=None, or the number of layers."
    )


def _returning_pairs(f: Callable) -> Callable:
    """`f`, checked at trace time to return `(carry, y)` as `jax.lax.scan`'s body must."""

    def step(carry, x):
        out = f(carry, x)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise errors.ShardingTypeError(_not_a_pair(f, out))
        return tuple(out)

    step.__name__ = _name(f)
    return step


def _not_a_pair(f: Callable, out: Any) -> str:
    return (
        f"lax_scan: {_name(f)} returned {type(out).__name__}, not a pair (carry, y): "
        "fs.lax_scan's function follows jax.lax.scan, f(carry, x) -> (carry, y); return "
        "(carry, None) for no per-layer output. For fn(layer_params, carry) -> carry, "
        "call fs.scan."
    )
