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

A callback in the jitted step but outside the loss function is beyond the root's reach
(XLA offers no way to defer it from there): one traced before the root gets a
RuntimeWarning at trace time (`warn_outer_callbacks`), naming where it was called.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

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

    # A function attribute (unknown to mypy): one of the root's own, see `outer_callbacks`.
    vars(run)["funshard_deferred"] = True
    return run


def _ours(callback: Callable) -> bool:
    return getattr(callback, "funshard_deferred", False)


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


def deferring_errors(
    fn: Callable,
    inspect: Callable[[Any], None] | None = None,
    evaluate: Callable[..., list] | None = None,
) -> Callable:
    """`fn` with the exceptions of its host callbacks recorded instead of raised.

    Returns a function `(*args) -> (fn(*args), has_callbacks)`: `fn` runs as its traced
    program, with every callback wrapped if it has any; then the caller must end the
    step with `raise_pending`.

    Args:
      fn: the function to run.
      inspect: called with `fn`'s traced jaxpr before it runs (it may raise): the root
        checks the program it has traced anyway here.
      evaluate: runs the (rewritten) jaxpr, `evaluate(jaxpr, consts, *args)`; default
        `eval_jaxpr` (the root passes its randomness rewrite, `_random.global_draws`).
    """

    def run(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if inspect is not None:
            inspect(closed.jaxpr)
        jaxpr, found = _rewrite(closed.jaxpr)
        flat = jax.tree.leaves(args)
        core, _ = _jax_compat.jaxpr_internals()
        out = (evaluate or core.eval_jaxpr)(jaxpr, closed.consts, *flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out), found

    return run


def raise_pending(results: Any) -> None:
    """Raises, at the end of the step, the first exception a wrapped callback recorded.

    Runs after `results` are computed (it reads one element of each), i.e. after every
    collective that produced them, so no device can be left waiting at a rendezvous.
    """
    anchors = [x.reshape(-1)[:1] for x in jax.tree.leaves(results) if getattr(x, "size", 0)]
    jax.debug.callback(_raise_pending, *anchors)


def _callback_in(value: Any) -> bool:
    """Whether a jaxpr parameter (or tuple of them) runs a user's debug callback that
    no root defers (a root's own program holds `_deferring` wrappers: skipped whole)."""
    core, callback_p = _jax_compat.jaxpr_internals()
    if isinstance(value, core.ClosedJaxpr):
        value = value.jaxpr
    if isinstance(value, core.Jaxpr):
        if any(e.primitive is callback_p and _ours(e.params["callback"]) for e in value.eqns):
            return False
        return any(_user_callback(eqn) for eqn in value.eqns)
    if isinstance(value, tuple):
        return any(_callback_in(v) for v in value)
    return False


def _user_callback(eqn) -> bool:
    _, callback_p = _jax_compat.jaxpr_internals()
    if eqn.primitive is callback_p:
        return not _ours(eqn.params["callback"])
    return any(_callback_in(v) for v in eqn.params.values())


def outer_callbacks() -> list[str]:
    """Where the user's step called `jax.debug.callback` before this root, outside it.

    Reads the equations the enclosing traces (the user's `jax.jit`, `vmap`, ...) have
    recorded so far (`_jax_compat.enclosing_equations`). Callbacks recorded after the
    root returns are out of its sight. Guarded by tests/test_hardening.py.

    Returns:
      One "file:line (function)" per such callback, innermost trace first ([] if none).
    """
    return [
        _jax_compat.source_line(eqn)
        for eqn in _jax_compat.enclosing_equations()
        if _user_callback(eqn)
    ]


def _callbacks_outside_root(fn: str, places) -> str:
    listed = "; ".join(places)
    return (
        f"{fn}: the jitted step runs jax.debug.callback before {fn}, outside the loss "
        f"function (at {listed}). If such a callback raises on some devices only (a NaN "
        "check of one device's rows), the other devices wait for them at the step's first "
        "collective and XLA CPU aborts the process (rendezvous termination timeout, 40 s "
        "by default), losing the training state. Inside the loss function funshard raises "
        "a callback's exception cleanly at the end of the step: move the callback there "
        "(or run the check outside the jitted step). A callback that never raises is safe; "
        "silence this with warnings.filterwarnings('ignore', message='.*before "
        f"{fn}, outside the loss function')."
    )


def warn_outer_callbacks(fn: str) -> None:
    """Warns, at trace time, of host callbacks the step runs before the root `fn`.

    Inside the loss a raising callback ends the step with its exception; outside, the
    device that raised leaves the program and the others wait for it at the root's
    first collective until XLA CPU aborts the process (rendezvous termination timeout,
    40 s by default). XLA gives no way to defer them from here, so say so first.
    """
    found = outer_callbacks()
    if found:
        warnings.warn(_callbacks_outside_root(fn, found), RuntimeWarning, stacklevel=3)
