"""PRNG keys inside the root: independent draws per example, as on the global batch.

A key passed to `fs.value_and_grad` reaches every device; drawn from as it is, every
device would drop the same positions of its slice (issue: silent wrong numbers, third
sweep, item 3). The root folds the device's (and microbatch's) index into typed keys
among its arguments, and refuses draws from keys equal on every device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funshard as fs
from funshard import errors
from tests._util import assert_tree_close
from tests.conftest import mesh_for

ROWS, WIDTH = 16, 6


def _params():
    k1, k2 = jax.random.split(jax.random.key(7))
    return {
        "w": jax.random.normal(k1, (WIDTH, WIDTH)) / 3.0,
        "v": jax.random.normal(k2, (WIDTH, 1)),
    }


def _batch():
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(ROWS, 1)).astype(np.float32),
    }


def _dropout_loss(p, x, y, key):
    """Dropout on the hidden layer, written as a user would in plain JAX."""
    h = jnp.tanh(x @ p["w"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    h = jnp.where(keep, h / 0.5, 0.0)
    return jnp.mean((h @ p["v"] - y) ** 2), keep


def _sharded_loss(s, b, key):
    return _dropout_loss(fs.unshard(s), b["x"], b["y"], key)


def _reference(params, batch, key, slices):
    """Plain JAX on the global batch, slice i drawing from `fold_in(key, i)` (the
    documented derivation): per-slice means averaged = the global mean."""
    xs = batch["x"].reshape(slices, ROWS // slices, WIDTH)
    ys = batch["y"].reshape(slices, ROWS // slices, 1)

    def loss(p):
        keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(slices))
        losses, keep = jax.vmap(lambda x, y, k: _dropout_loss(p, x, y, k))(xs, ys, keys)
        return jnp.mean(losses), keep.reshape(ROWS, WIDTH)

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("mesh, microbatches", [("8", 1), ("2x4", 1), ("4", 2)])
def test_key_argument_draws_per_example_as_documented(mesh, microbatches):
    params, batch, key = _params(), _batch(), jax.random.key(5)
    step = jax.jit(fs.value_and_grad(_sharded_loss, has_aux=True, microbatches=microbatches))
    state = fs.shard(params, mesh_for(mesh))
    (loss, keep), grads = step(state, batch, key)
    # Device d's microbatch m (of k) is slice d * k + m of the global batch.
    slices = len(mesh_for(mesh).devices.flat) * microbatches
    (ref_loss, ref_keep), ref_grads = _reference(params, batch, key, slices)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)
    # Every slice drew its own mask: no device repeats another's.
    per_slice = np.asarray(keep).reshape(slices, -1)
    assert len({row.tobytes() for row in per_slice}) == slices


def test_same_key_same_numbers_other_key_other_numbers():
    state, batch = fs.shard(_params(), mesh_for("8")), _batch()
    step = jax.jit(fs.value_and_grad(_sharded_loss, has_aux=True))
    (_, a), _ = step(state, batch, jax.random.key(0))
    (_, b), _ = step(state, batch, jax.random.key(0))
    (_, c), _ = step(state, batch, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_raw_uint32_key_argument_is_refused_with_the_fix():
    state = fs.shard(_params(), mesh_for("8"))
    step = fs.value_and_grad(_sharded_loss, has_aux=True)
    with pytest.raises(errors.ShardingValueError) as info:
        step(state, _batch(), jax.random.PRNGKey(0))
    message = str(info.value)
    assert "same on several devices" in message
    assert "test_randomness.py" in message and "_dropout_loss" in message
    assert "jax.random.wrap_key_data" in message and "per_device_keys=False" in message


def test_key_made_inside_the_loss_from_a_constant_is_refused():
    def loss(s, b):
        return _dropout_loss(fs.unshard(s), b["x"], b["y"], jax.random.key(3))[0]

    with pytest.raises(errors.ShardingValueError, match="same on several devices"):
        jax.jit(fs.value_and_grad(loss))(fs.shard(_params(), mesh_for("8")), _batch())


def test_key_folded_over_one_axis_only_is_refused_on_hsdp():
    # Folding the shard axis alone leaves the two replica groups drawing alike. (The key
    # arrives as raw data, which the root does not fold.)
    def loss(s, b, raw):
        key = jax.random.fold_in(jax.random.wrap_key_data(raw), jax.lax.axis_index("fsdp"))
        return _dropout_loss(fs.unshard(s), b["x"], b["y"], key)[0]

    raw = jax.random.key_data(jax.random.key(0))
    with pytest.raises(errors.ShardingValueError, match="every data axis of"):
        fs.value_and_grad(loss)(fs.shard(_params(), mesh_for("2x4")), _batch(), raw)


def test_opt_out_shares_the_draws_across_devices():
    # Noise meant for the whole batch (here: on the parameters) is the same on every
    # device with per_device_keys=False, as plain JAX draws it once.
    def noisy(p, x, y, key):
        w = p["w"] + 0.1 * jax.random.normal(key, p["w"].shape)
        return jnp.mean((jnp.tanh(x @ w) @ p["v"] - y) ** 2)

    def loss(s, b, key):
        return noisy(fs.unshard(s), b["x"], b["y"], key)

    params, batch, key = _params(), _batch(), jax.random.key(9)
    step = jax.jit(fs.value_and_grad(loss, per_device_keys=False))
    value, grads = step(fs.shard(params, mesh_for("8")), batch, key)
    ref_value, ref_grads = jax.value_and_grad(noisy)(params, batch["x"], batch["y"], key)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)


def test_per_device_keys_must_be_a_bool():
    with pytest.raises(errors.ShardingTypeError, match="per_device_keys must be a bool"):
        fs.value_and_grad(_sharded_loss, per_device_keys="yes")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_keys_returned_untouched_come_back_as_given(microbatches):
    # Flax's recipe writes its RNG streams back from aux: the caller's key, not a
    # device's folded one, comes back (and the step does not fail reducing it).
    def loss(s, b, key):
        value, _ = _dropout_loss(fs.unshard(s), b["x"], b["y"], key)
        return value, {"key": key}

    key = jax.random.key(4)
    step = jax.jit(fs.value_and_grad(loss, has_aux=True, microbatches=microbatches))
    (_, aux), _ = step(fs.shard(_params(), mesh_for("8")), _batch(), key)
    np.testing.assert_array_equal(jax.random.key_data(aux["key"]), jax.random.key_data(key))
