"""`scan`: stacked layers under `jax.lax.scan`, gathering layer i+1 while layer i runs.

MaxText-style models keep their blocks stacked on a leading layer axis so that the
program (and its compile time) does not grow with depth. `scan` is the FSDP unit for
such a stack: a `custom_vjp` whose forward is a `lax.scan` carrying a double buffer
(this layer's gathered parameters, and the next layer's, issued before this layer
computes), and whose backward is a reverse `lax.scan` that re-gathers each layer
(prefetching the previous one) and reduce-scatters its gradient as soon as the layer is
done. Only the gathered parameters are dropped from the saved residuals, exactly as in
`fully_shard`: activations are saved, nothing is recomputed. The loop itself is unit
machinery and lives in `funshard.core._unit` (`call_scanned`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from funshard import _text, errors
from funshard.core import _context, _unit
from funshard.core._shard import unshard
from funshard.core._sharded import Sharded


def _scan_not_stacked(path, dim: int) -> str:
    return (
        f"{_text.where('scan', path)} is sharded on dim {dim}, not as a stack of layers; shard "
        "the stacked parameters with fs.shard(..., stacked=True)."
    )


def _check_stacked(paths, items):
    bad = [
        _scan_not_stacked(path, x.dim)
        for path, x in zip(paths, items, strict=True)
        if isinstance(x, Sharded) and x.dim != 1
    ]
    if bad:  # every bad leaf at once
        raise errors.ShardingValueError(_text.joined(bad))


def _layer_axes(counts) -> str:
    return ", ".join(f"{_text.leaf_name(path)} {shape}" for path, shape in counts)


def _scan_no_layers(fn_name: str, counts) -> str:
    return (
        f"scan: the stack given to fs.scan({fn_name}, ...) holds no layers: its layer axis "
        f"(dim 0) has size 0 ({_layer_axes(counts)}). Stack at least one layer, or skip "
        "the fs.scan call for a model without such layers."
    )


def _scan_layer_counts(fn_name: str, counts) -> str:
    return (
        f"scan: the leaves of the stack given to fs.scan({fn_name}, ...) disagree on the "
        f"number of layers (dim 0): {_layer_axes(counts)}. Stack every leaf over the same "
        "layers."
    )


def _check_layers(fn: Callable, paths, items) -> None:
    """Every leaf of the stack holds the same number of layers, at least one."""
    counts = [
        (path, tuple(x.shape))
        for path, x in zip(paths, items, strict=True)
        if (isinstance(x, Sharded) or hasattr(x, "shape")) and len(x.shape) >= 1
    ]
    name = getattr(fn, "__name__", type(fn).__name__)
    if any(shape[0] == 0 for _, shape in counts):
        raise errors.ShardingValueError(_scan_no_layers(name, counts))
    if len({shape[0] for _, shape in counts}) > 1:
        raise errors.ShardingValueError(_scan_layer_counts(name, counts))


def _scan_hpz_unsupported(k: int) -> str:
    return (
        f"scan: reshard_after_forward={k} (hpZ) is not supported for scanned stacks yet; "
        "use True or False."
    )


def scan(
    fn: Callable, stacked: Any, carry: Any, *, reshard_after_forward: bool = True
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

    Returns:
      The final carry. Inside `funshard.value_and_grad` each layer's all-gather is
      issued before the previous layer computes, and each layer's gradient is
      reduce-scattered as soon as its backward is done; outside a step the stack is
      gathered and scanned (e.g. for evaluation).

    Raises:
      ValueError: `stacked` has no `Sharded` leaves, was not sharded as a stack, holds
        no layers (a layer axis of size 0), or its leaves disagree on the layer count.
      TypeError: `reshard_after_forward` is not a bool or int.
      NotImplementedError: deferred gradient accumulation
        (`sync_every_microbatch=False`) over a scanned stack, or an int
        `reshard_after_forward` (hpZ).
    """
    _unit.check_reshard_after_forward("scan", reshard_after_forward)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise errors.UnsupportedError(_scan_hpz_unsupported(reshard_after_forward))
    unit = _unit.prepare("scan", stacked)
    _check_stacked(unit.paths, unit.parts.items)
    _check_layers(fn, unit.paths, unit.parts.items)
    carry = _unit.cast_inputs(unit, carry)
    if _context.current() is None:
        full = _unit.cast_floating(unshard(stacked), unit.param_dtype)
        out = jax.lax.scan(lambda c, p: (fn(p, c), None), carry, full)[0]
    else:
        out = _unit.call_scanned(fn, unit, carry, reshard_after_forward)
    return _unit.cast_floating(out, unit.output_dtype)
