"""reshard_after_forward as an int (FSDP2's hpZ): backward gathers within groups of k."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives
from jax.sharding import AxisType, Mesh

import funshard as fs

LAYERS, WIDTH = 4, 67  # 67 rows: uneven over 8 devices


def _split_mesh():
    devices = np.array(jax.devices()).reshape(2, 4)
    return Mesh(devices, ("fsdp_outer", "fsdp_inner"), axis_types=(AxisType.Auto,) * 2)


def _setup():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    params = [
        {"w": jax.random.normal(k, (WIDTH, WIDTH)) / 8, "b": jnp.full((WIDTH,), 0.1)} for k in keys
    ]
    x = jax.random.normal(keys[0], (64, WIDTH))
    state = fs.shard(params, _split_mesh(), shard_axis=("fsdp_outer", "fsdp_inner"))
    return params, state, x


def _ref_loss(params, h):
    for p in params:
        h = jnp.tanh(h @ p["w"] + p["b"])
    return jnp.mean(h**2)


def _step(reshard_after_forward):
    unit = fs.fully_shard(
        lambda p, h: jnp.tanh(h @ p["w"] + p["b"]), reshard_after_forward=reshard_after_forward
    )

    def loss(state, h):
        for p in state:
            h = unit(p, h)
        return jnp.mean(h**2)

    return fs.value_and_grad(loss)


@pytest.fixture(scope="module")
def results():
    params, state, x = _setup()
    out = {}  # keyed by repr: True == 1 as a dict key
    for policy in (True, False, 4, 8, 1):
        step = _step(policy)
        loss, grads = jax.jit(step)(state, x)
        exe = jax.jit(step).lower(state, x).compile()
        out[repr(policy)] = (loss, fs.unshard(grads), exe)
    return params, x, out


@pytest.mark.parametrize("policy", [True, False, 4, 8, 1])
def test_parity_with_reference(results, policy):
    params, x, out = results
    ref_loss, ref_grads = jax.value_and_grad(_ref_loss)(params, x)
    loss, grads, _ = out[repr(policy)]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-6, rtol=1e-5)


def _gather_groups(exe):
    return [c["groups"] for c in collectives(exe.as_text()) if c["kind"] == "all-gather"]


def test_hpz_backward_gathers_stay_inside_groups_of_k(results):
    groups = _gather_groups(results[2]["4"][2])
    whole, inner = "{{0,1,2,3,4,5,6,7}}", "{{0,1,2,3},{4,5,6,7}}"
    assert groups.count(whole) == LAYERS  # forward: one gather per unit over all 8
    assert groups.count(inner) >= LAYERS - 1  # backward: within groups of 4
    assert set(groups) == {whole, inner}


def test_hpz_memory_between_full_reshard_and_none(results):
    temp = {
        p: results[2][p][2].memory_analysis().temp_size_in_bytes for p in ("True", "False", "4")
    }
    assert temp["True"] < temp["4"] < temp["False"], temp


def test_int_extremes_equal_the_bools(results):
    out = results[2]
    assert _gather_groups(out["8"][2]) == _gather_groups(out["True"][2])
    assert _gather_groups(out["1"][2]) == _gather_groups(out["False"][2])


def test_group_size_must_match_trailing_axes():
    _, state, x = _setup()
    with pytest.raises(ValueError, match=re.escape("reshard_after_forward=2 needs")):
        jax.jit(_step(2))(state, x)
    with pytest.raises(ValueError, match="must divide the number of shards"):
        jax.jit(_step(3))(state, x)
    with pytest.raises(ValueError, match="positive int"):  # FSDP2 raises ValueError too
        fs.fully_shard(lambda p, h: h, reshard_after_forward=0)
