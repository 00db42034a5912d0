"""Branches of the public API's validation that no other test reaches, and in-step reshard."""

import jax
import numpy as np
import pytest
from _models import mlp_layer, mlp_params, mse
from _util import mlp_batch_dict
from conftest import mesh_for

import funshard as fs

F32 = np.float32


def _loss(state, batch):
    h = batch["x"]
    for p in state["layers"]:
        h = fs.fully_shard(mlp_layer)(p, h)
    return mse(h * state["scale"], batch["y"])


def _ref_loss(params, batch):
    h = batch["x"]
    for p in params["layers"]:
        h = mlp_layer(p, h)
    return mse(h * params["scale"], batch["y"])


def _state():
    return fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))


def test_reshard_inside_a_step_gives_the_local_blocks():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh_for("8"))

    def loss(state, b):
        full = fs.unshard(state)
        again = fs.reshard(full, like=state)  # local slices: no communication
        for got, want in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
            assert got.shape == want.shape
        return _loss(again, b)

    value, grads = jax.jit(fs.value_and_grad(loss))(state, batch)
    ref_value, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_trainable_that_does_not_fit_the_state():
    with pytest.raises(ValueError, match="`trainable` must be a pytree prefix of the state"):
        fs.value_and_grad(_loss, trainable={"nope": True})(_state(), mlp_batch_dict())


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_microbatches_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="microbatches must be an int >= 1"):
        fs.value_and_grad(_loss, microbatches=value)


@pytest.mark.parametrize("value", [0, -2.0])
def test_gradient_divide_factor_must_be_positive(value):
    with pytest.raises(ValueError, match="gradient_divide_factor must be a positive number"):
        fs.value_and_grad(_loss, gradient_divide_factor=value)


def test_batch_that_does_not_split_into_microbatches():
    step = fs.value_and_grad(_loss, microbatches=4)
    with pytest.raises(ValueError, match="do not split into 4 microbatches on each of 8 devices"):
        step(_state(), mlp_batch_dict(rows=16))


@pytest.mark.parametrize("dim", [-1, True, "0", 1.0])
def test_shard_placement_dim_validation(dim):
    with pytest.raises(ValueError, match="Shard: dim must be a non-negative int"):
        fs.Shard(dim)


def test_reshard_reports_every_bad_leaf_at_once():
    state = _state()
    full = fs.unshard(state)
    full["layers"][0]["w"] = np.zeros((2, 2), F32)
    full["layers"][2]["b"] = np.zeros(full["layers"][2]["b"].shape, np.int32)
    with pytest.raises(ValueError) as err:
        fs.reshard(full, state)
    message = str(err.value)
    assert "['layers'][0]['w'] has shape (2, 2)" in message
    assert "['layers'][2]['b'] has dtype int32" in message


def test_batch_reports_every_bad_leaf_at_once():
    batch = {**mlp_batch_dict(), "name": "train", "step": 3, "ids": object()}
    with pytest.raises(TypeError) as err:
        fs.value_and_grad(_loss)(_state(), batch)
    message = str(err.value)
    assert "leaf ['name'] is a str" in message and "leaf ['ids'] is a object" in message
    assert "leaf ['step'] is a scalar" in message


def test_async_save_cannot_overwrite(tmp_path):
    state = _state()
    fs.save(tmp_path / "ckpt", state)
    with pytest.raises(ValueError, match="overwrite=True cannot be asynchronous"):
        fs.save(tmp_path / "ckpt", state, overwrite=True, asynchronous=True)
    restored = fs.restore(tmp_path / "ckpt", state)  # the existing checkpoint is intact
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unit_outside_a_step_matches_the_plain_function():
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"))
    x = mlp_batch_dict()["x"]
    got = fs.fully_shard(mlp_layer)(state["layers"][0], x)
    np.testing.assert_allclose(got, mlp_layer(params["layers"][0], x), rtol=1e-6)


def test_hpz_group_that_the_axes_cannot_form():
    mesh = mesh_for("8")
    state = fs.shard(mlp_params(jax.random.key(0)), mesh)
    unit = fs.fully_shard(mlp_layer, reshard_after_forward=2)

    def loss(state, b):
        return mse(unit(state["layers"][0], b["x"])[:, :5], b["y"])

    with pytest.raises(
        ValueError, match="reshard_after_forward=2 needs the parameters' shard axes"
    ):
        jax.jit(fs.value_and_grad(loss))(state, mlp_batch_dict())


def test_hpz_group_that_does_not_divide_the_shards():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    unit = fs.fully_shard(mlp_layer, reshard_after_forward=3)

    def loss(state, b):
        return mse(unit(state["layers"][0], b["x"])[:, :5], b["y"])

    with pytest.raises(
        ValueError, match="reshard_after_forward=3 must divide the number of shards"
    ):
        jax.jit(fs.value_and_grad(loss))(state, mlp_batch_dict())


def test_scan_reports_every_unstacked_leaf_at_once():
    mesh = mesh_for("4")
    stacked = {
        "a": fs.shard(np.ones((2, 4, 4), F32), mesh),
        "b": fs.shard(np.ones((2, 4), F32), mesh),
        "c": fs.shard({"c": np.ones((2, 4, 4), F32)}, mesh, stacked=True)["c"],
    }
    with pytest.raises(ValueError) as err:
        fs.scan(lambda p, h: h, stacked, np.ones(4, F32))
    assert "leaf ['a'] is sharded on dim 0" in str(err.value)
    assert "leaf ['b'] is sharded on dim 0" in str(err.value)
    assert "['c']" not in str(err.value)


def test_shard_reports_every_bad_leaf_at_once():
    params = {"a": np.zeros(3, object), "b": np.ones(3, F32), "c": np.zeros(3, np.float64)}
    with pytest.raises(TypeError) as err:
        fs.shard(params, mesh_for("8"))
    assert "leaf ['a'] has dtype object" in str(err.value)
    assert "leaf ['c'] has dtype float64" in str(err.value)
