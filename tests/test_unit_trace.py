"""Identical units reuse their traced pieces: a deep loop of units costs no trace of the
gathers' copy-out per layer (issue: the loop's compile time grows with the depth)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for

import funshard as fs
from funshard.comm import _lowering

WIDTH = 24  # a shape no other test uses: this test's layouts are traced here first


def _block(p, h):
    return h + jnp.tanh(h @ p["w"] + p["b"])


def _deep_loss(block):
    """The mean square of `block` applied layer after layer."""

    def loss(params, batch):
        h = batch
        for p in params:
            h = block(p, h)
        return jnp.mean(h**2)

    return loss


def _step_for(layers: int):
    mesh = mesh_for("8")
    rng = np.random.default_rng(0)
    params = [
        {
            "w": rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.1,
            "b": np.zeros(WIDTH, np.float32),
        }
        for _ in range(layers)
    ]
    state = fs.shard(params, mesh)
    batch = rng.normal(size=(16, WIDTH)).astype(np.float32)
    return jax.jit(fs.value_and_grad(_deep_loss(fs.fully_shard(_block)))), state, batch


@pytest.fixture
def unpack_calls(monkeypatch):
    """How often the gathers' copy-out (`unpack`) is traced, from a cold cache."""
    calls = []
    original = _lowering.unpack

    def counting(gathered, packing):
        calls.append(packing)
        return original(gathered, packing)

    monkeypatch.setattr(_lowering, "unpack", counting)
    _lowering._unpacker.cache_clear()
    _lowering._boundary_branches.cache_clear()
    yield calls
    _lowering._unpacker.cache_clear()
    _lowering._boundary_branches.cache_clear()


def test_identical_units_trace_the_copy_out_once(unpack_calls):
    """The copy-out of 12 identical units is traced as often as that of 2: its jaxprs
    are reused, and the step still gives plain JAX's numbers."""
    counts = {}
    for layers in (2, 12):
        unpack_calls.clear()
        _lowering._unpacker.cache_clear()
        _lowering._boundary_branches.cache_clear()
        step, state, batch = _step_for(layers)
        loss, grads = step(state, batch)
        counts[layers] = len(unpack_calls)
        want_loss, want_grads = jax.value_and_grad(_deep_loss(_block))(fs.unshard(state), batch)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        for got, want in zip(
            jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(want_grads), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert counts[2] > 0
    assert counts[12] == counts[2], counts
