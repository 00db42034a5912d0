"""The JAX behaviours funshard relies on beyond the documented API still hold."""

import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from _launch import clean_env

from funshard import _jax_compat

_RANGE = re.escape(_jax_compat.SUPPORTED_JAX)


def test_assumptions_hold_on_the_installed_jax():
    _jax_compat.check.cache_clear()
    _jax_compat.check()  # raises naming the broken assumption otherwise


def test_assumptions_hold_under_a_trace():
    _jax_compat.check.cache_clear()
    jax.jit(lambda x: (_jax_compat.check(), x)[1])(jnp.ones(2))


def test_a_broken_assumption_names_itself_and_the_fix(monkeypatch):
    _jax_compat.check.cache_clear()
    monkeypatch.setattr(_jax_compat, "vjp_residuals", lambda fn: ([], None))
    with pytest.raises(RuntimeError, match="saved primal as the same array.*jax" + _RANGE):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_a_missing_internal_name_is_a_runtime_error_not_an_attribute_error(monkeypatch):
    import types

    _jax_compat.check.cache_clear()
    core, callback_p = _jax_compat.jaxpr_internals()
    partial = types.SimpleNamespace(
        Jaxpr=core.Jaxpr, JaxprEqn=core.JaxprEqn, eval_jaxpr=core.eval_jaxpr
    )
    monkeypatch.setattr(_jax_compat, "jaxpr_internals", lambda: (partial, callback_p))
    with pytest.raises(RuntimeError, match="has ClosedJaxpr.*jax" + _RANGE):
        _jax_compat.check()
    _jax_compat.check.cache_clear()

    def no_typeof(*_):
        raise AttributeError("module 'jax' has no attribute 'typeof'")

    monkeypatch.setattr(_jax_compat, "jaxpr_internals", lambda: (core, callback_p))
    monkeypatch.setattr(_jax_compat, "vjp_residuals", no_typeof)
    with pytest.raises(RuntimeError, match="AttributeError: .*typeof.*jax" + _RANGE):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_the_supported_range_is_pyprojects_pin():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    deps = pyproject["project"]["dependencies"]
    assert f"jax{_jax_compat.SUPPORTED_JAX}" in deps
    assert f"jaxlib{_jax_compat.SUPPORTED_JAX}" in deps
    extras = pyproject["project"]["optional-dependencies"]
    assert extras["cuda"] == [f"jax[cuda12]{_jax_compat.SUPPORTED_JAX}"]


def test_a_users_first_step_compiles_once():
    # On jax 0.12, importing `jax.extend` registers config options; when funshard imported
    # it lazily inside the first traced step, the step's jit cache key changed under it
    # and the second call compiled the step again. In a fresh process, so that no other
    # test has imported it first.
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, optax
        import funshard as fs
        mesh = fs.make_mesh()
        state = fs.shard({"w": jnp.ones((16, 4)), "b": jnp.zeros((4,))}, mesh)
        opt = optax.sgd(0.1)

        @jax.jit
        def step(state, opt_state, x):
            def loss(p, x):
                p = fs.unshard(p)
                return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2)
            grads = fs.grad(loss)(state, x)
            updates, opt_state = opt.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state

        x = jnp.ones((8, 16))
        state, opt_state = step(state, opt.init(state), x)
        state, opt_state = step(state, opt_state, x)
        print("compiled", step._cache_size())
    """)
    env = clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "1", done.stdout


def test_jaxpr_internals_prefer_jax_extend_core():
    from jax.extend import core as public_core

    core, _ = _jax_compat.jaxpr_internals()
    for name in ("ClosedJaxpr", "Jaxpr", "JaxprEqn"):
        assert getattr(core, name) is getattr(public_core, name)
    assert callable(core.eval_jaxpr)


def test_varying_axes_reads_the_shard_map_type():
    mesh = jax.make_mesh(
        (2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )

    def body(x):
        assert _jax_compat.varying_axes(x) == {"d"}
        assert _jax_compat.varying_axes(jax.lax.psum(x, "d")) == frozenset()
        return x

    jax.shard_map(
        body,
        mesh=mesh,
        in_specs=jax.sharding.PartitionSpec("d"),
        out_specs=jax.sharding.PartitionSpec("d"),
    )(jnp.ones(4))


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bool", "float64", "int64"])
def test_dlpack_import_shares_memory_and_keeps_values(dtype):
    import numpy as np

    # 64-byte aligned, as torch allocates (DLPack imports of unaligned memory copy).
    values = np.arange(64 * 3).reshape(64, 3).astype(dtype)
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    host = raw[start : start + values.nbytes].view(values.dtype).reshape(values.shape)
    host[...] = values
    device = jax.devices()[3]
    array = _jax_compat.dlpack_import(host, device)
    assert array.devices() == {device}
    np.testing.assert_array_equal(
        np.asarray(array), host.astype(jax.dtypes.canonicalize_dtype(dtype))
    )
    if dtype not in ("float64", "int64"):  # x64 is off: those are converted (a copy)
        assert array.dtype == host.dtype
        assert array.unsafe_buffer_pointer() == host.ctypes.data


def test_enclosing_equations_see_a_callback_traced_before():
    _, callback_p = _jax_compat.jaxpr_internals()
    seen = []

    def step(x):
        jax.debug.callback(lambda _: None, x)
        seen.extend(_jax_compat.enclosing_equations())
        return x * 2

    jax.jit(step).lower(jnp.ones(2))
    callbacks = [eqn for eqn in seen if eqn.primitive is callback_p]
    assert len(callbacks) == 1
    assert "test_jax_compat.py" in _jax_compat.source_line(callbacks[0])
    assert _jax_compat.enclosing_equations() == []  # no trace: nothing recorded


def test_a_lost_trace_walk_names_itself_and_the_range(monkeypatch):
    _jax_compat.check.cache_clear()
    monkeypatch.setattr(_jax_compat, "enclosing_equations", list)  # sees nothing
    with pytest.raises(
        RuntimeError,
        match=r"trace_ctx\.trace, out through \.parent_trace, "
        r"then \.frame\.tracing_eqns\) no longer hold a jax\.debug\.callback.*"
        r"jax" + _RANGE,
    ):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_a_renamed_frame_attribute_names_the_assumption_not_only_the_name(monkeypatch):
    import types

    # As if JAX renamed `tracing_eqns`: the jaxpr trace's frame no longer has it.
    recorded = _jax_compat._recorded_equations
    monkeypatch.setattr(
        _jax_compat,
        "_recorded_equations",
        lambda trace: recorded(types.SimpleNamespace(frame=object())),
    )
    _jax_compat.check.cache_clear()
    with pytest.raises(
        RuntimeError,
        match=r"\.frame\.tracing_eqns\) no longer hold .*"
        r"AttributeError: .*tracing_eqns.*jax" + _RANGE,
    ):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_a_source_line_that_names_nothing_is_a_broken_assumption(monkeypatch):
    _jax_compat.check.cache_clear()
    monkeypatch.setattr(_jax_compat, "source_line", lambda eqn: "an unknown place")
    with pytest.raises(
        RuntimeError,
        match=r"summarize\(eqn\.source_info\) no longer gives.*"
        r"jax" + _RANGE,
    ):
        _jax_compat.check()
    _jax_compat.check.cache_clear()
