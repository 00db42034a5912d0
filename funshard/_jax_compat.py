"""Every JAX behaviour funshard relies on beyond the documented API, in one place.

funshard admits the JAX releases in `SUPPORTED_JAX` (pyproject.toml's pin; a test keeps
the two equal). Each function here names the JAX behaviour it depends on and the test
that guards it; `check()` verifies them on first use (never at import: importing
funshard must not start a JAX backend, or `jax.distributed.initialize` could no longer
run) and fails with a message naming the broken assumption, so that moving the pin is a
one-file job. The CPython behaviours funshard relies on live in `funshard/_py_compat.py`,
checked the same way.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import re
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
from jax.tree_util import tree_flatten, tree_unflatten

from funshard import errors

# The `jax` / `jaxlib` requirement in pyproject.toml (tests/test_jax_compat.py compares).
SUPPORTED_JAX = ">=0.10.2,<0.13"

# Imported with funshard, not at first use: importing `jax.extend` registers config
# options (Pallas's, on jax 0.12), and an option registered after a user's `jax.jit` has
# traced once changes that jit's cache key, so the user's first step would compile twice.
# It starts no backend.
_extend_core: types.ModuleType | None
try:
    from jax.extend import core as _extend_core
except ImportError:  # pragma: no cover - every supported JAX has it
    _extend_core = None


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside `jax.shard_map` (its vma type).

    Relies on `jax.typeof(x).manual_axis_type.varying` (jax 0.10; `.vma` before).
    Guarded by tests/test_compositions.py (psum-normalised losses) and every step test.
    """
    return jax.typeof(x).manual_axis_type.varying


def aval_varying_axes(aval: Any) -> frozenset[str]:
    """The manual mesh axes a jaxpr variable's abstract value varies over (its vma type).

    Relies on `aval.manual_axis_type.varying` on the avals of a jaxpr traced inside
    `jax.shard_map` (jax 0.10). Avals without it (tokens, abstract refs) vary over none.
    Guarded by tests/test_control_flow.py.
    """
    axis_type = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()) or ())


def source_line(eqn: Any) -> str:
    """ "file:line (function)" of the user's code that traced a jaxpr equation.

    Relies on `jax._src.source_info_util.summarize` (no public way to read an
    equation's source) and on an equation's `source_info`. Guarded by `check()` and
    tests/test_control_flow.py.
    """
    from jax._src import source_info_util

    return source_info_util.summarize(eqn.source_info)


def enclosing_equations() -> list[Any]:
    """The equations the traces around this call have recorded so far, innermost first.

    Lets a function traced inside a user's `jax.jit` see what the user's program did
    before calling it (the root looks for host callbacks there). Relies on
    `jax._src.core.trace_ctx.trace` (the running trace), on `parent_trace` leading out
    of the JVP, batching and partial-evaluation traces (a jit's `DynamicJaxprTrace`
    starts a trace stack of its own: the walk ends there), and on a
    `DynamicJaxprTrace` keeping the equations it has recorded in `frame.tracing_eqns`
    (equations, or weak references to them) with their `primitive`, `params` and
    `source_info` (jax 0.10 to 0.12); traces without a `frame` record none. Guarded by
    `check()` and tests/test_hardening.py.
    """
    from jax._src import core as private_core

    found, seen = [], set()
    trace = private_core.trace_ctx.trace
    while trace is not None and id(trace) not in seen:
        seen.add(id(trace))
        found += _recorded_equations(trace)
        trace = getattr(trace, "parent_trace", None)  # an eval trace has none: the end
    return found


def _recorded_equations(trace: Any) -> list[Any]:
    """The equations `trace` has recorded so far (none unless it builds a jaxpr)."""
    frame = getattr(trace, "frame", None)
    if frame is None:
        return []
    entries = (e() if isinstance(e, weakref.ReferenceType) else e for e in frame.tracing_eqns)
    return [eqn for eqn in entries if eqn is not None]


def scan_counts(params: Any) -> tuple[int, int]:
    """(consts, carries) among the operands of a `lax.scan` equation with `params`.

    jax 0.10 records them as `num_consts` / `num_carry`; jax 0.12 as `ft_in`, a flat
    tree of the three groups (consts, carry, xs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts.vals), len(carry.vals)


def vjp_residuals(vjp_fn: Callable) -> tuple[list, Any]:
    """The residual arrays a `jax.vjp` function holds, and the structure to rebuild it.

    Relies on the function returned by `jax.vjp` being a pytree whose leaves are its
    residuals, with a primal the function saves unchanged appearing as that very array
    object (identity). Guarded by tests/test_hlo.py (re-gather counts, temp bytes).
    """
    return tree_flatten(vjp_fn)


def vjp_from_residuals(treedef: Any, residuals: list) -> Callable:
    """The inverse of `vjp_residuals`."""
    return tree_unflatten(treedef, residuals)


_CARRIES_VARY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "funshard_loop_carries_vary", default=False
)


@contextlib.contextmanager
def loop_carries_vary():
    """Inside it, a loop's initial carry takes the varying type its body gives it.

    Inside `jax.shard_map`, `lax.scan`, `lax.fori_loop` and `lax.while_loop` reject an
    initial carry that varies over fewer mesh axes than the body's new carry (a
    statistic accumulated from the batch, started at `0.0`), and ask for
    `jax.lax.pcast(init, axes, to='varying')`: that cast, equal values on every device
    typed as varying, is what plain JAX's numbers need, so the root applies it while it
    traces the loss. Relies on the loops of `jax._src.lax.control_flow.loops` passing
    each initial carry, with its type and the body's output type, through the module's
    `_promote_weak_typed_input` and tracing the body again when it reports a change
    (how JAX widens a weak-typed initial carry; jax 0.10 to 0.12). The wrapper
    installed there on first use changes nothing outside this context. Guarded by
    `check()` and tests/test_scan.py (carries started from constants).
    """
    _install_carry_promotion()
    token = _CARRIES_VARY.set(True)
    try:
        yield
    finally:
        _CARRIES_VARY.reset(token)


@functools.cache
def _install_carry_promotion() -> None:
    from jax._src.lax.control_flow import loops

    original = loops._promote_weak_typed_input

    def promote(in_val: Any, in_aval: Any, out_aval: Any) -> tuple[Any, bool]:
        value, changed = original(in_val, in_aval, out_aval)
        missing = aval_varying_axes(out_aval) - aval_varying_axes(in_aval)
        if missing and _CARRIES_VARY.get():
            return jax.lax.pcast(value, tuple(sorted(missing)), to="varying"), True
        return value, changed

    loops._promote_weak_typed_input = promote


def backends_started() -> bool:
    """Whether a JAX backend is already running (so `jax.distributed` can no longer start).

    Relies on `jax._src.xla_bridge.backends_are_initialized` (no public way to ask
    without starting a backend). Guarded by tests/test_multiprocess.py.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:
        return False
    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: False)())


# XLA's CPU client reads this (then NPROC) as its core count when it sizes its pool.
_CPU_POOL_ENV = "PJRT_NPROC"


def cpu_devices_requested() -> int:
    """How many devices the CPU backend will create: `jax_num_cpu_devices` if set, else
    `--xla_force_host_platform_device_count` in `XLA_FLAGS`, else 1. Starts no backend.
    """
    # jax.config's options are attributes it sets at run time, unknown to jax 0.10's stub
    # (0.12's knows them: hence unused-ignore).
    count = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined, unused-ignore]
    if count >= 0:
        return count
    flags = re.findall(
        r"--xla_force_host_platform_device_count[= ](\d+)", os.environ.get("XLA_FLAGS", "")
    )
    return int(flags[-1]) if flags else 1


def cpu_pool_threads(devices: int, cores: int) -> int | None:
    """The `PJRT_NPROC` funshard sets for a CPU client of `devices` devices on `cores`
    cores, or None where XLA's own pool is already large enough.

    XLA's CPU client runs everything on one pool of max(cores, devices) threads. A
    program over several devices takes one thread per device at once (its in-process
    collectives wait for all of them), and the launch of the next program, also a pool
    task, blocks on a thread when a device already has 32 programs in flight (the
    client's pacing). An asynchronous loop reaches that limit within a few dozen steps;
    then one blocked launch leaves the running program a thread short and XLA aborts
    ("Expected 8 threads to join the rendezvous, but only 7 of them arrived"). Twice
    the devices leaves room for the running program and the launch of the next one.
    """
    needed = 2 * devices
    return needed if needed > cores else None


def _xla_cpu_cores() -> int:
    """The core count XLA's CPU client assumes: `NPROC` if set, else the cores this
    process may run on (`tsl::port::MaxParallelism`)."""
    nproc = os.environ.get("NPROC", "")
    if nproc.isdigit():
        return int(nproc)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_pool_missed() -> int | None:
    """The `PJRT_NPROC` that `widen_cpu_pool` would have given a CPU backend that started
    before it could: None where no backend runs, JAX's default backend is not the CPU,
    `PJRT_NPROC` was set, or the running pool is large enough. Starts no backend.
    """
    if not backends_started() or _CPU_POOL_ENV in os.environ or jax.default_backend() != "cpu":
        return None
    return cpu_pool_threads(jax.local_device_count(), _xla_cpu_cores())


def widen_cpu_pool() -> None:
    """Makes the CPU backend, when JAX creates it, size its thread pool by
    `cpu_pool_threads` (called at `import funshard`; starts no backend).

    Relies on `jax._src.xla_bridge._backend_factories["cpu"].factory` (JAX calls it
    once, when the backend starts) and on XLA's CPU client reading `PJRT_NPROC` as its
    core count (`xla::DefaultThreadPoolSize`). The variable is set only while the client
    is created and only if the user has not set it; a backend already running is left
    as it is. Guarded by tests/test_async_loop.py.
    """
    try:
        from jax._src import xla_bridge
    except ImportError:
        return
    registration = getattr(xla_bridge, "_backend_factories", {}).get("cpu")
    factory = getattr(registration, "factory", None)
    if registration is None or factory is None or getattr(factory, "_funshard_pool", False):
        return

    @functools.wraps(factory)
    def make_cpu_client(*args, **kwargs):
        threads = cpu_pool_threads(cpu_devices_requested(), _xla_cpu_cores())
        if threads is None or _CPU_POOL_ENV in os.environ:
            return factory(*args, **kwargs)
        os.environ[_CPU_POOL_ENV] = str(threads)
        try:
            return factory(*args, **kwargs)
        finally:
            os.environ.pop(_CPU_POOL_ENV, None)

    vars(make_cpu_client)["_funshard_pool"] = True  # a function attribute, unknown to mypy
    registration.factory = make_cpu_client


def compiled_count(fn: Any) -> int | None:
    """How many programs the jitted `fn` keeps compiled; None where JAX does not say.

    Relies on the `_cache_size()` method of `jax.jit`'s functions (the size of their
    dispatch cache). Guarded by tests/test_comm_eager.py.
    """
    size = getattr(fn, "_cache_size", None)
    return size() if callable(size) else None


def drop_lowered_modules() -> None:
    """Empties JAX's cache of lowered modules (StableHLO and its MLIR objects).

    A jitted function keeps each compiled program in its own dispatch cache and runs it
    from there; the program's lowered module stays in this cache only for a second
    lowering of the same trace, which a function called with shapes it has compiled
    never asks for. A later lowering of such a trace (`.lower()` twice) lowers again;
    results are unchanged. Relies on
    `jax._src.interpreters.pxla._cached_lowering_to_hlo` and its `cache_clear()`; a JAX
    without them is left as it is. Guarded by tests/test_comm_eager.py.
    """
    try:
        from jax._src.interpreters import pxla
    except ImportError:  # pragma: no cover - every supported JAX has it
        return
    clear = getattr(getattr(pxla, "_cached_lowering_to_hlo", None), "cache_clear", None)
    if callable(clear):
        clear()


def coordination_client() -> Any:
    """The coordination service's client (its key-value store), or None if not started.

    Relies on `jax._src.distributed.global_state.client` and its `key_value_*` /
    `blocking_key_value_get` / `wait_at_barrier` methods (no public API). Guarded by
    tests/test_multiprocess.py and tests/test_distributed_startup.py.
    """
    from jax._src import distributed

    return distributed.global_state.client


@functools.cache
def jaxpr_internals() -> tuple[Any, Any]:
    """`(core, debug_callback_p)`: a namespace of the jaxpr types to rewrite, and the
    callback primitive.

    `core` has `ClosedJaxpr`, `Jaxpr`, `JaxprEqn` and `eval_jaxpr`: each from
    `jax.extend.core` where it is there (the types are, in jax 0.10 and 0.12), else from
    `jax._src.core` (`eval_jaxpr` is not in `jax.extend.core`); a name neither has is
    absent, which `check()` reports. Relies on `Jaxpr.replace`, `JaxprEqn.replace`,
    `ClosedJaxpr.replace`, `eval_jaxpr` and a `callback` parameter on
    `debug_callback_p`. Guarded by tests/test_callbacks.py.
    """
    from jax._src import core as private_core
    from jax._src import debugging

    found = {}
    for name in _JAXPR_NAMES:
        for source in (_extend_core, private_core):
            if source is not None and hasattr(source, name):
                found[name] = getattr(source, name)
                break
    return types.SimpleNamespace(**found), getattr(debugging, "debug_callback_p", None)


_JAXPR_NAMES = ("ClosedJaxpr", "Jaxpr", "JaxprEqn", "eval_jaxpr")


# ---- re-evaluating a traced jaxpr (funshard/core/_random.py) -----------------------------

# The casts that only change a value's varying type inside `jax.shard_map` (jax 0.10, 0.12).
VARYING_CASTS = frozenset({"pvary", "pcast"})

# Equations that call a jaxpr once with their inputs: evaluating the jaxpr in their place
# computes the same values (JAX's samplers, user `jax.jit`s, custom-derivative calls,
# whose rules are no longer needed once the step's gradient has been traced).
_INLINED_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}
)


def literal_value(var: Any, env: dict) -> Any:
    """The value of a jaxpr atom: a literal's constant, else what `env` holds for it.

    Relies on `jax.extend.core.Literal` (its `.val`). Guarded by tests/test_randomness.py.
    """
    from jax.extend import core as extend_core

    return var.val if isinstance(var, extend_core.Literal) else env[var]


def cast_axes(eqn: Any) -> tuple[str, ...]:
    """The axes a `pvary` / `pcast` equation casts to varying (its `axes` parameter)."""
    axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def bind_equation(eqn: Any, invals: list) -> list:
    """Binds a jaxpr equation's primitive to `invals`, as `eval_jaxpr` does: with its
    bind parameters, source location and context. Always a list of outputs.

    Relies on `Primitive.get_bind_params`, `eqn.source_info`, `eqn.ctx.manager` and
    `jax._src.source_info_util.user_context` (what `jax._src.core.eval_jaxpr` does for
    each equation, jax 0.10 to 0.12). Guarded by tests/test_randomness.py.
    """
    from jax._src import source_info_util

    params = eqn.primitive.get_bind_params(eqn.params)
    with source_info_util.user_context(eqn.source_info.traceback), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def rebuild_higher_order(
    eqn: Any, invals: list, evaluate: Callable, dp_axes: tuple[str, ...]
) -> list | None:
    """`eqn` (an equation holding jaxprs) run on `invals` with its jaxprs evaluated by
    `evaluate(jaxpr, consts, args)`, rebuilt with the public API so that the types of
    its outputs follow those of the evaluated bodies; None for an unknown primitive.

    Relies on the parameters of the jaxpr equations of `jax.jit` (`jaxpr`),
    `jax.checkpoint` (`remat2`: `jaxpr`, `prevent_cse`, `policy`), `lax.scan`
    (`jaxpr`, `num_consts`, `num_carry`, `length`, `reverse`, `unroll`), `lax.cond`
    (`branches`) and `lax.while_loop` (`cond_jaxpr`, `body_jaxpr`, `cond_nconsts`,
    `body_nconsts`), jax 0.10 to 0.12. Guarded by tests/test_randomness.py.
    """
    core, _ = jaxpr_internals()
    name, p = eqn.primitive.name, eqn.params

    def call(closed: Any) -> Callable:
        if isinstance(closed, core.ClosedJaxpr):
            return lambda *a: evaluate(closed.jaxpr, closed.consts, a)
        return lambda *a: evaluate(closed, (), a)

    if name in _INLINED_CALLS:
        closed = next(p[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in p)
        return list(call(closed)(*invals))
    if name == "remat2":
        body = call(p["jaxpr"])
        remat = jax.checkpoint(body, prevent_cse=p["prevent_cse"], policy=p["policy"])
        return list(remat(*invals))
    if name == "scan":
        nc, nk = scan_counts(p)
        consts, init, xs = invals[:nc], invals[nc : nc + nk], invals[nc + nk :]
        run = call(p["jaxpr"])

        def scan_body(carry, x):
            out = run(*consts, *carry, *x)
            return list(out[:nk]), list(out[nk:])

        x0 = [x[0] for x in xs]
        init = _carry_like(lambda c: scan_body(c, x0)[0], list(init), dp_axes)
        carry, ys = jax.lax.scan(
            scan_body, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        return [*carry, *ys]
    if name == "cond":
        index, *ops = invals
        branches = [call(b) for b in p["branches"]]
        shapes = [jax.make_jaxpr(b)(*ops).out_avals for b in branches]
        axes = [
            frozenset().union(*(aval_varying_axes(s[i]) for s in shapes))
            for i in range(len(shapes[0]))
        ]

        def joined(branch: Callable) -> Callable:
            return lambda *a: [_vary(x, ax) for x, ax in zip(branch(*a), axes, strict=True)]

        return list(jax.lax.switch(index, [joined(b) for b in branches], *ops))
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = invals[:cn], invals[cn : cn + bn], list(invals[cn + bn :])
        cond, body = call(p["cond_jaxpr"]), call(p["body_jaxpr"])

        def loop_body(c):
            return list(body(*bc, *c))

        init = _carry_like(loop_body, init, dp_axes)
        return list(jax.lax.while_loop(lambda c: cond(*cc, *c)[0], loop_body, init))
    return None


def _vary(x: Any, axes: frozenset[str]) -> Any:
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _carry_like(step: Callable, init: list, dp_axes: tuple[str, ...]) -> list:
    """`init` cast to the varying type one `step` gives the carry (a loop's carry in and
    out must have one type), repeated until it no longer widens."""
    for _ in range(len(dp_axes) + 1):
        out = jax.make_jaxpr(step)(init).out_avals
        wider = [_vary(x, aval_varying_axes(o)) for x, o in zip(init, out, strict=True)]
        if all(varying_axes(a) == varying_axes(b) for a, b in zip(wider, init, strict=True)):
            return init
        init = wider
    return init


def threefry_rows(
    key: Any, bit_width: int, global_shape: tuple, axis: int, start: Any, size: int
) -> Any:
    """Rows `start : start + size` along `axis` of `jax.random.bits`-style random bits of
    `global_shape` from `key`, computed from their counters alone; None where that is not
    exact (another key implementation, `jax_threefry_partitionable` off, 64-bit draws, a
    key array, or 2**32 elements or more).

    Relies on JAX's partitionable threefry (`_threefry_random_bits_partitionable`,
    jax 0.10 to 0.12): element `j` (flat, row-major) of a draw is `threefry2x32(key,
    (hi(j), lo(j)))`, its two words xor-ed (truncated below 32 bits). Guarded by
    tests/test_randomness.py, which compares with `jax.random.bits` of the global
    shape, sliced.
    """
    from jax.extend import random as extend_random

    partitionable = jax.config.jax_threefry_partitionable  # type: ignore[attr-defined, unused-ignore]
    if (
        not partitionable
        or bit_width == 64
        or getattr(key, "ndim", 1) != 0
        or jax.random.key_impl(key) != "threefry2x32"
        or math.prod(global_shape) >= 2**32
    ):
        return None
    import jax.numpy as jnp

    local = (*global_shape[:axis], size, *global_shape[axis + 1 :])
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    counts = jnp.zeros(local, jnp.uint32)
    for d, stride in enumerate(strides):
        index = jax.lax.broadcasted_iota(jnp.uint32, local, d)
        if d == axis:
            index = index + jnp.asarray(start, jnp.uint32)
        counts = counts + index * jnp.uint32(stride)
    data = jax.random.key_data(key)
    hi = jnp.zeros_like(counts)  # below 2**32 elements
    bits1, bits2 = extend_random.threefry2x32_p.bind(data[0], data[1], hi, counts)
    # threefry2x32_p has no varying-type rule: its outputs vary where the counters do.
    axes = varying_axes(counts) | varying_axes(data)
    bits1, bits2 = _vary(bits1, axes), _vary(bits2, axes)
    return (bits1 ^ bits2).astype(jnp.dtype(f"uint{bit_width}"))


def collectives_over_gloo(platform: str, *, distributed: bool, cpu_implementation: str) -> bool:
    """Whether the collectives of a program lowered for `platform` run over gloo.

    Only XLA CPU's cross-process collectives use gloo, and only once `jax.distributed`
    is initialised with `jax_cpu_collectives_implementation` "gloo" (its default):
    single-process CPU meshes use XLA's in-process collectives, and GPU programs
    ("cuda", "rocm") use NCCL / RCCL whatever the CPU setting says.

    Args:
      platform: the lowering platform ("cpu", "cuda", "rocm", ...).
      distributed: whether `jax.distributed` is initialised in this process.
      cpu_implementation: the value of `jax_cpu_collectives_implementation`.
    """
    return platform == "cpu" and distributed and cpu_implementation == "gloo"


def cpu_collectives_over_gloo() -> bool:
    """Whether this process's CPU programs run their collectives over gloo (see
    `collectives_over_gloo`). Guarded by tests/test_cuda_paths.py.
    """
    return collectives_over_gloo(
        "cpu",
        distributed=coordination_client() is not None,
        # jax.config's options are attributes it sets at run time, unknown to jax 0.10's
        # stub (0.12's knows them: hence unused-ignore).
        cpu_implementation=jax.config.jax_cpu_collectives_implementation,  # type: ignore[attr-defined, unused-ignore]
    )


_DLPACK_CPU = 1  # DLDeviceType.kDLCPU
_DLPACK_GPU = (2, 10)  # DLDeviceType.kDLCUDA, kDLROCM


def dlpack_import(obj: Any, device: jax.Device) -> jax.Array:
    """`obj` (a `__dlpack__` producer in `device`'s memory) as an array on `device`, no copy.

    For a CPU `device` the producer must be in host memory, for a GPU `device` on that
    same GPU (a DLPack import never moves data between devices here: the result must
    alias `obj`, which its callers rely on).

    `jax.dlpack.from_dlpack` spends several times the import itself in Python (device
    lookup, dtype canonicalisation, placement; docs/benchmarks_design.md has the
    numbers), and a torch frontend imports every gradient of every
    backward. This calls jaxlib's
    `_jax.dlpack_managed_tensor_to_buffer` directly (its 5-argument form, jaxlib
    extension version >= 467) for dtypes JAX keeps as they are, and falls back to
    `from_dlpack` otherwise. On a GPU the import is ordered after the producer's
    pending work the way `from_dlpack` orders it (see `_gpu_import`). Guarded by
    tests/test_jax_compat.py (CPU), tests/test_cuda_paths.py (the GPU arguments, with
    a fake device) and tests/test_gpu.py (on a GPU).

    Raises:
      ValueError: for a GPU `device`, `obj` is not on that GPU.
    """
    from jax._src.lib import _jax, jaxlib_extension_version

    if jaxlib_extension_version >= 467 and device.platform in ("cpu", "gpu"):
        if device.platform == "cpu":
            array = _jax.dlpack_managed_tensor_to_buffer(
                obj.__dlpack__(), device, None, None, _DLPACK_CPU
            )
        else:
            array = _gpu_import(_jax, obj, device)
        if array.dtype == jax.dtypes.canonicalize_dtype(array.dtype):
            return array
    return jax.device_put(jax.dlpack.from_dlpack(obj), device)


def _gpu_import(jax_lib: Any, obj: Any, device: jax.Device) -> jax.Array:
    """The GPU branch of `dlpack_import`: `obj` on `device`'s GPU, stream-ordered.

    DLPack's stream argument orders the producer's writes before JAX's reads:
    `obj.__dlpack__(stream=s)` is given `s`, the device's stream for external ready
    events, and the producer makes `s` wait for its own current stream (torch records
    an event on its current stream and has `s` wait on it, torch/_tensor.py
    `__dlpack__`). The buffer is then created as defined on `s`, so every JAX program
    that reads it waits for that stream first. No host synchronisation is involved.
    Relies on `Device.get_stream_for_external_ready_events` and the 5-argument
    `dlpack_managed_tensor_to_buffer(capsule, device, stream, copy, dl_device_type)`,
    as `jax.dlpack.from_dlpack` calls them in jax 0.10.
    """
    kind, index = obj.__dlpack_device__()
    if int(kind) not in _DLPACK_GPU or index != device.local_hardware_id:
        raise errors.ShardingValueError(
            f"dlpack_import: the array is on DLPack device ({int(kind)}, {index}) but "
            f"the target is {device} (GPU {device.local_hardware_id}); a zero-copy import "
            "needs the array on that same GPU. Move it there first."
        )
    stream = device.get_stream_for_external_ready_events()
    capsule = obj.__dlpack__(stream=stream)
    return jax_lib.dlpack_managed_tensor_to_buffer(capsule, device, stream, None, int(kind))


@functools.cache
def check() -> None:
    """Verifies the assumptions above once; raises naming the one that broke.

    Raises:
      RuntimeError: an assumption does not hold for the installed JAX (an internal name
        it relies on is missing too: never an AttributeError or ImportError from here).
    """
    try:
        _check()
    except (AttributeError, ImportError) as e:
        _broken(f"{type(e).__name__}: {e}")


def _check() -> None:
    import jax.numpy as jnp

    core, callback_p = jaxpr_internals()
    for name in _JAXPR_NAMES:
        if not hasattr(core, name):
            _broken(f"neither jax.extend.core nor jax._src.core has {name}")
    for owner in ("Jaxpr", "JaxprEqn", "ClosedJaxpr"):
        if not hasattr(getattr(core, owner), "replace"):
            _broken(f"{owner} has no .replace")
    if callback_p is None:
        _broken("jax._src.debugging has no debug_callback_p")
    if not hasattr(jax, "typeof") or not hasattr(jax.typeof(jnp.zeros(())), "manual_axis_type"):
        _broken("jax.typeof(x) has no .manual_axis_type (the shard_map varying-axes type)")
    x = jnp.ones(3)
    residuals, _ = vjp_residuals(jax.vjp(lambda a: a * a, x)[1])
    if not any(r is x for r in residuals):
        _broken(
            "a jax.vjp function no longer holds a saved primal as the same array "
            "object among its pytree leaves"
        )
    _check_enclosing_equations(callback_p)
    from jax._src.lax.control_flow import loops

    if not callable(getattr(loops, "_promote_weak_typed_input", None)):
        _broken(
            "jax._src.lax.control_flow.loops has no _promote_weak_typed_input (how a "
            "loop's initial carry takes its body's type)"
        )


def _check_enclosing_equations(callback_p: Any) -> None:
    """`enclosing_equations` sees a callback traced before it, from inside a `vmap`."""
    assumption = (
        "the equations a jit trace has recorded so far (jax._src.core.trace_ctx"
        ".trace, out through .parent_trace, then .frame.tracing_eqns) no longer "
        "hold a jax.debug.callback traced before"
    )
    try:
        seen = _equations_seen_after_a_callback()
    except AttributeError as e:
        _broken(f"{assumption} ({type(e).__name__}: {e})")
    callbacks = [eqn for eqn in seen if eqn.primitive is callback_p]
    if not callbacks or not hasattr(callbacks[0], "params"):
        _broken(assumption)
    if not re.search(r"\S+:\d+", source_line(callbacks[0])):
        _broken(
            "jax._src.source_info_util.summarize(eqn.source_info) no longer gives "
            "the file:line that traced an equation"
        )


def _equations_seen_after_a_callback() -> list[Any]:
    """What `enclosing_equations` returns inside a `vmap`, after a traced callback."""
    import jax.numpy as jnp

    seen: list[Any] = []

    def traced(x):
        jax.debug.callback(lambda _: None, x)

        def record(y):
            seen.extend(enclosing_equations())
            return y

        jax.vmap(record)(jnp.stack([x, x]))
        return x

    jax.make_jaxpr(traced)(jnp.zeros(()))
    return seen


def _broken(what: str) -> None:
    raise RuntimeError(
        f"funshard: an assumption about JAX {jax.__version__} failed: {what}. funshard "
        f"supports jax{SUPPORTED_JAX}; install a supported version, or update "
        "funshard/_jax_compat.py for this one."
    )
