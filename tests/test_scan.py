"""fs.scan over stacked layers: parity with the Python loop, prefetching gathers in the loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funshard as fs
from _hlo import compiled, computations, count_by_kind
from conftest import mesh_for

pytestmark = pytest.mark.slow

LAYERS, WIDTH = 4, 67


def _layers():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return [
        {"w": jax.random.normal(k, (WIDTH, WIDTH)) / 8, "b": jnp.full((WIDTH,), 0.1),
         "gain": jnp.float32(1.0 + i / 4)}
        for i, k in enumerate(keys)
    ]


def _layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"]) * p["gain"]


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _x():
    return jax.random.normal(jax.random.key(5), (32, WIDTH))


def _scan_loss(reshard):
    def loss(state, h):
        return jnp.mean(fs.scan(_layer, state, h, reshard_after_forward=reshard) ** 2)

    return loss


def _loop_loss(state, h):
    unit = fs.fully_shard(_layer)
    for p in state:
        h = unit(p, h)
    return jnp.mean(h**2)


def test_stacked_shard_layout():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    assert state["w"].dim == 1 and state["w"].data.shape == (LAYERS, 72, WIDTH)
    assert state["w"].local_shape == (LAYERS, 9, WIDTH)
    assert not isinstance(state["gain"], fs.Sharded)  # one value per layer: replicated
    back = fs.unshard(state)
    np.testing.assert_array_equal(back["w"], _stack(_layers())["w"])


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("reshard", [True, False])
def test_scan_matches_python_loop_and_reference(mesh_name, reshard):
    mesh = mesh_for(mesh_name)
    layers = _layers()
    stacked_state = fs.shard(_stack(layers), mesh, stacked=True)
    loss, grads = jax.jit(fs.value_and_grad(_scan_loss(reshard)))(stacked_state, _x())
    loop_loss, loop_grads = jax.jit(fs.value_and_grad(_loop_loss))(fs.shard(layers, mesh), _x())
    ref_loss, ref_grads = jax.value_and_grad(
        lambda ps, h: jnp.mean(jax.lax.scan(lambda c, p: (_layer(p, c), None), h, ps)[0] ** 2)
    )(_stack(layers), _x())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(loop_loss, ref_loss, rtol=1e-6)
    got = fs.unshard(grads)
    for name in ("w", "b", "gain"):
        np.testing.assert_allclose(got[name], ref_grads[name], atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(got[name], _stack(fs.unshard(loop_grads))[name],
                                   atol=1e-6, rtol=1e-5)


def test_scan_outside_a_step_evaluates():
    state = fs.shard(_stack(_layers()), mesh_for("4"), stacked=True)
    h = _x()
    want = h
    for p in _layers():
        want = _layer(p, want)
    np.testing.assert_allclose(fs.scan(_layer, state, h), want, rtol=1e-5, atol=1e-6)


def test_gathers_and_reduce_scatters_run_inside_the_loop():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    text = compiled(fs.value_and_grad(_scan_loss(True)), state, _x())[1]
    comps = computations(text)
    entry = count_by_kind(comps["ENTRY"])
    total = count_by_kind(text)
    # Outside the loops: the first layer's gather (forward) and the last layer's
    # (backward). Every other gather is a prefetch inside a loop body, and each layer's
    # reduce-scatter runs inside the backward loop.
    assert entry["all-gather"] == 2 and total["all-gather"] == 4
    assert entry["reduce-scatter"] == 0 and total["reduce-scatter"] == 1
    assert " while(" in comps["ENTRY"]


def test_scan_reshard_saves_memory_without_recompute():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    x = jax.random.normal(jax.random.key(5), (256, WIDTH))
    exe = {r: compiled(fs.value_and_grad(_scan_loss(r)), state, x)[0] for r in (True, False)}
    temp = {r: e.memory_analysis().temp_size_in_bytes for r, e in exe.items()}
    flops = {r: e.cost_analysis()["flops"] for r, e in exe.items()}
    assert temp[True] < temp[False], temp
    assert abs(flops[True] - flops[False]) <= 0.02 * flops[False], flops


def test_scan_requires_a_stacked_state():
    state = fs.shard(_stack(_layers()), mesh_for("8"))
    with pytest.raises(ValueError, match=r"stacked=True"):
        fs.scan(_layer, state, _x())
