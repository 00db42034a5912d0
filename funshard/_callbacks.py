"""Host callbacks that raise inside a step: a Python exception at the end, never an abort.

A `jax.debug.callback` that raises ends that device's run of the program. When only
some devices raise (a NaN check that fires on one device's batch slice), the others wait
for them at the next collective, and XLA CPU ends the process (`LOG(FATAL)` in its
rendezvous, after `xla_cpu_collective_call_terminate_timeout_seconds`): the training
state is lost. The same happens in a bare `jax.shard_map` with a `psum` after the
callback; a program with no collective after the raise fails cleanly instead.

So inside the root every user callback runs through a wrapper that records its
exception instead of raising it, the device carries on through the step's collectives,
and one check at the end of the step (after the last collective, data-dependent on the
results) raises the first recorded exception: a `JaxRuntimeError` carrying the
callback's message, with the caller's arrays untouched. Programs without callbacks are
not changed at all.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax

from funshard import _jax_compat

# Exceptions recorded by wrapped callbacks, waiting for the step's check. A process-wide
# list: every device of the process runs its callbacks on its own thread.
_PENDING: list[BaseException] = []
_LOCK = threading.Lock()


def _deferring(callback: Callable) -> Callable:
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except Exception as exc:  # re-raised by `_raise_pending` at the end of the step
            with _LOCK:
                _PENDING.append(exc)
            return None

    return run


def _raise_pending(*_) -> None:
    with _LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    if pending:
        raise pending[0]


def _rewrite_param(value: Any) -> tuple[Any, bool]:
    core, _ = _jax_compat.jaxpr_internals()
    if isinstance(value, core.ClosedJaxpr):
        jaxpr, found = _rewrite(value.jaxpr)
        return (value.replace(jaxpr=jaxpr), True) if found else (value, False)
    if isinstance(value, core.Jaxpr):
        return _rewrite(value)
    jaxpr_types = (core.Jaxpr, core.ClosedJaxpr)
    if isinstance(value, tuple) and any(isinstance(v, jaxpr_types) for v in value):
        rewritten = [_rewrite_param(v) for v in value]
        return tuple(v for v, _ in rewritten), any(f for _, f in rewritten)
    return value, False


def _rewrite(jaxpr) -> tuple[Any, bool]:
    """`jaxpr` with every debug callback (nested ones included) wrapped by `_deferring`."""
    _, callback_p = _jax_compat.jaxpr_internals()
    eqns, found = [], False
    for eqn in jaxpr.eqns:
        if eqn.primitive is callback_p:
            params = {**eqn.params, "callback": _deferring(eqn.params["callback"])}
            eqns.append(eqn.replace(params=params))
            found = True
            continue
        params, changed = dict(eqn.params), False
        for name, value in eqn.params.items():
            params[name], hit = _rewrite_param(value)
            changed |= hit
        eqns.append(eqn.replace(params=params) if changed else eqn)
        found |= changed
    return (jaxpr.replace(eqns=eqns), True) if found else (jaxpr, False)


def deferring_errors(fn: Callable) -> Callable:
    """`fn` with the exceptions of its host callbacks recorded instead of raised.

    Returns a function `(*args) -> (fn(*args), has_callbacks)`: `fn` runs as its traced
    program, with every callback wrapped if it has any; then the caller must end the
    step with `raise_pending`.
    """

    def run(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        jaxpr, found = _rewrite(closed.jaxpr)
        flat = jax.tree.leaves(args)
        core, _ = _jax_compat.jaxpr_internals()
        out = core.eval_jaxpr(jaxpr, closed.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out), found

    return run


def raise_pending(results: Any) -> None:
    """Raises, at the end of the step, the first exception a wrapped callback recorded.

    Runs after `results` are computed (it reads one element of each), i.e. after every
    collective that produced them, so no device can be left waiting at a rendezvous.
    """
    anchors = [x.reshape(-1)[:1] for x in jax.tree.leaves(results) if getattr(x, "size", 0)]
    jax.debug.callback(_raise_pending, *anchors)
