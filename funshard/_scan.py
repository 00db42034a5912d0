"""`scan`: stacked layers under `jax.lax.scan`, gathering layer i+1 while layer i runs.

MaxText-style models keep their blocks stacked on a leading layer axis so that the
program (and its compile time) does not grow with depth. `scan` is the FSDP unit for
such a stack: a `custom_vjp` whose forward is a `lax.scan` carrying a double buffer
(this layer's gathered parameters, and the next layer's, issued before this layer
computes), and whose backward is a reverse `lax.scan` that re-gathers each layer
(prefetching the previous one) and reduce-scatters its gradient as soon as the layer is
done. Only the gathered parameters are dropped from the saved residuals, exactly as in
`fully_shard`: activations are saved, nothing is recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from funshard import _context, _errors, _gather, _jax_compat, _unit
from funshard._shard import unshard
from funshard._sharded import Sharded


def _match_types(ct, primal):
    """Sums `ct` over the axes it varies along but `primal` does not (autodiff's rule)."""

    def fix(c, p):
        if not hasattr(c, "dtype") or c.dtype == jax.dtypes.float0:
            return c
        extra = tuple(
            a for a in _jax_compat.varying_axes(c)
            if a not in _jax_compat.varying_axes(p)
        )
        return jax.lax.psum(c, extra) if extra else c

    return jax.tree.map(fix, ct, primal)


def _layer_layout(sharded, name: str):
    """The gather layout of one layer of each stacked leaf (its layer axis dropped)."""
    stack = _gather.layout_of(sharded, name=name)
    layer = tuple(
        dataclasses.replace(leaf, shape=leaf.shape[1:], dim=leaf.dim - 1) for leaf in stack.leaves
    )
    return dataclasses.replace(stack, leaves=layer)


def _check_stacked(paths, items):
    bad = [
        _errors.scan_not_stacked(path, x.dim)
        for path, x in zip(paths, items, strict=True)
        if isinstance(x, Sharded) and x.dim != 1
    ]
    if bad:  # every bad leaf at once
        raise ValueError(_errors.joined(bad))


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
      ValueError: `stacked` has no `Sharded` leaves or was not sharded as a stack.
      TypeError: `reshard_after_forward` is not a bool or int.
      NotImplementedError: deferred gradient accumulation
        (`sync_every_microbatch=False`) over a scanned stack, or an int
        `reshard_after_forward` (hpZ).
    """
    _unit.check_reshard_after_forward("scan", reshard_after_forward)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(_errors.scan_hpz_unsupported(reshard_after_forward))
    unit = _unit.prepare("scan", stacked)
    _check_stacked(unit.paths, unit.parts.items)
    carry = _unit.cast_inputs(unit, carry)
    if _context.current() is None:
        full = _unit.cast_floating(unshard(stacked), unit.param_dtype)
        out = jax.lax.scan(lambda c, p: (fn(p, c), None), carry, full)[0]
    else:
        out = _scan_in_step(fn, unit, carry, reshard_after_forward)
    return _unit.cast_floating(out, unit.output_dtype)


def _scan_in_step(fn, unit: _unit.UnitParams, carry, reshard_after_forward: bool):
    sharded = unit.sharded
    datas = tuple(x.data for x in sharded)
    if _gather.accumulators_for(sharded) is not None:
        raise NotImplementedError(_errors.scan_deferred_sync_unsupported())
    layout = _layer_layout(sharded, f"scan/{getattr(fn, '__name__', 'layer')}")
    others = unit.parts.others
    layers = datas[0].shape[0]
    record = _unit.Residuals()

    def layer_params(gathered, others_i):
        return unit.parts.combine(gathered, others_i)

    def gather_layer(datas, i, dependency):
        blocks = [jax.lax.dynamic_index_in_dim(d, i, keepdims=False) for d in datas]
        return tuple(_gather.gather_values(blocks, layout, dependency))

    def prefetch(datas, pred, i, dependency, current):
        # The other branch hands back the current buffer: same type, no communication.
        return jax.lax.cond(pred, lambda: gather_layer(datas, i, dependency), lambda: current)

    def run_layer(gathered, others_i, h):
        with _context.unit_body():
            return fn(layer_params(gathered, others_i), h)

    @jax.custom_vjp
    def run(datas, others, carry):
        body = lambda h, xs: (run_layer(gather_layer(datas, xs[0], None), xs[1], h), None)  # noqa
        return jax.lax.scan(body, carry, (jnp.arange(layers), others))[0]

    def run_fwd(datas, others, carry):
        def body(c, xs):
            h, current = c
            i, others_i = xs
            upcoming = prefetch(datas, i + 1 < layers, jnp.minimum(i + 1, layers - 1),
                                _unit.dependency_of(h), current)
            h, vjp_fn = jax.vjp(run_layer, current, others_i, h)
            kept = record.drop_gathered(vjp_fn, current if reshard_after_forward else ())
            return (h, upcoming), kept

        first = gather_layer(datas, 0, _unit.dependency_of(carry))
        (h, _), kept = jax.lax.scan(body, (carry, first), (jnp.arange(layers), others))
        return h, (datas, others, carry, kept)

    def run_bwd(res, ct):
        datas, others, carry, kept = res

        def body(c, xs):
            ct_h, current = c
            i, kept_i = xs
            if reshard_after_forward:
                dependency = _unit.dependency_of(ct_h)
                previous = prefetch(datas, i > 0, jnp.maximum(i - 1, 0), dependency, current)
            else:
                previous = current  # every layer's parameters were kept: nothing to gather
            ct_g, ct_others, ct_h = record.resume(kept_i, current)(ct_h)
            ct_blocks = _gather.backward_values(ct_g, layout, None)[0]
            return (ct_h, previous), (ct_blocks, ct_others)

        if reshard_after_forward:
            last = gather_layer(datas, layers - 1, _unit.dependency_of(ct))
        else:
            last = tuple(jnp.zeros(leaf.shape, leaf.gather_dtype) for leaf in layout.leaves)
        (ct_carry, _), (ct_datas, ct_others) = jax.lax.scan(
            body, (ct, last), (jnp.arange(layers), kept), reverse=True
        )
        return ct_datas, _match_types(ct_others, others), _match_types(ct_carry, carry)

    run.defvjp(run_fwd, run_bwd)
    return run(datas, others, carry)
