"""The JAX behaviours funshard relies on beyond the documented API still hold."""

import jax
import jax.numpy as jnp
import pytest

from funshard import _jax_compat


def test_assumptions_hold_on_the_installed_jax():
    _jax_compat.check.cache_clear()
    _jax_compat.check()  # raises naming the broken assumption otherwise


def test_assumptions_hold_under_a_trace():
    _jax_compat.check.cache_clear()
    jax.jit(lambda x: (_jax_compat.check(), x)[1])(jnp.ones(2))


def test_a_broken_assumption_names_itself_and_the_fix(monkeypatch):
    _jax_compat.check.cache_clear()
    monkeypatch.setattr(_jax_compat, "vjp_residuals", lambda fn: ([], None))
    with pytest.raises(RuntimeError, match="saved primal as the same array.*jax>=0.10.2,<0.11"):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_a_missing_internal_name_is_a_runtime_error_not_an_attribute_error(monkeypatch):
    import types

    _jax_compat.check.cache_clear()
    core, callback_p = _jax_compat.jaxpr_internals()
    partial = types.SimpleNamespace(Jaxpr=core.Jaxpr, JaxprEqn=core.JaxprEqn,
                                    eval_jaxpr=core.eval_jaxpr)
    monkeypatch.setattr(_jax_compat, "jaxpr_internals", lambda: (partial, callback_p))
    with pytest.raises(RuntimeError, match="has ClosedJaxpr.*jax>=0.10.2,<0.11"):
        _jax_compat.check()
    _jax_compat.check.cache_clear()

    def no_typeof(*_):
        raise AttributeError("module 'jax' has no attribute 'typeof'")

    monkeypatch.setattr(_jax_compat, "jaxpr_internals", lambda: (core, callback_p))
    monkeypatch.setattr(_jax_compat, "vjp_residuals", no_typeof)
    with pytest.raises(RuntimeError, match="AttributeError: .*typeof.*jax>=0.10.2,<0.11"):
        _jax_compat.check()
    _jax_compat.check.cache_clear()


def test_jaxpr_internals_prefer_jax_extend_core():
    from jax.extend import core as public_core

    core, _ = _jax_compat.jaxpr_internals()
    for name in ("ClosedJaxpr", "Jaxpr", "JaxprEqn"):
        assert getattr(core, name) is getattr(public_core, name)
    assert callable(core.eval_jaxpr)


def test_varying_axes_reads_the_shard_map_type():
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])

    def body(x):
        assert _jax_compat.varying_axes(x) == {"d"}
        assert _jax_compat.varying_axes(jax.lax.psum(x, "d")) == frozenset()
        return x

    jax.shard_map(body, mesh=mesh, in_specs=jax.sharding.PartitionSpec("d"),
                  out_specs=jax.sharding.PartitionSpec("d"))(jnp.ones(4))


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bool", "float64", "int64"])
def test_dlpack_import_shares_memory_and_keeps_values(dtype):
    import numpy as np

    # 64-byte aligned, as torch allocates (DLPack imports of unaligned memory copy).
    values = np.arange(64 * 3).reshape(64, 3).astype(dtype)
    raw = np.empty(values.nbytes + 64, np.uint8)
    start = -raw.ctypes.data % 64
    host = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    host[...] = values
    device = jax.devices()[3]
    array = _jax_compat.dlpack_import(host, device)
    assert array.devices() == {device}
    np.testing.assert_array_equal(np.asarray(array), host.astype(jax.dtypes.canonicalize_dtype(dtype)))
    if dtype not in ("float64", "int64"):  # x64 is off: those are converted (a copy)
        assert array.dtype == host.dtype
        assert array.unsafe_buffer_pointer() == host.ctypes.data
