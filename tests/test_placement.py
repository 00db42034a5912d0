"""Placements: shard on another dim, replicate (ignored params), min_shard_size."""

import jax
import numpy as np
import pytest
from _hlo import collectives, compiled
from _models import mlp_loss, mlp_params, mlp_sharded_loss
from _util import mlp_batch
from conftest import mesh_for

import funshard as fs


def _dim1_when_even(path, x):
    return fs.Shard(1) if x.ndim == 2 and x.shape[1] % 8 == 0 else None


def _replicate_biases(path, x):
    return fs.Replicate() if x.ndim == 1 else None


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize(
    "placement,min_size",
    [
        (_dim1_when_even, 0),
        (_replicate_biases, 0),
        (None, 100),
    ],
)
@pytest.mark.parametrize("units", [False, True])
def test_placements_round_trip_and_gradient_parity(mesh_name, placement, min_size, units):
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for(mesh_name), placement=placement, min_shard_size=min_size)
    back = fs.unshard(state)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, want)
    loss, grads = jax.jit(fs.value_and_grad(mlp_sharded_loss(units)))(state, mlp_batch())
    ref_loss, ref = jax.value_and_grad(mlp_loss)(params, mlp_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(state), strict=True):
        assert g.sharding.is_equivalent_to(s.sharding, g.ndim)


def test_dim1_layout_and_reshard():
    w = np.arange(5 * 16, dtype=np.float32).reshape(5, 16)
    state = fs.shard({"w": w}, mesh_for("8"), placement=_dim1_when_even)
    s = state["w"]
    assert s.dim == 1 and s.data.shape == (5, 16) and s.local_shape == (5, 2)
    for shard in s.data.addressable_shards:
        cols = shard.index[1]
        np.testing.assert_array_equal(np.asarray(shard.data), w[:, cols])
    again = fs.reshard(fs.unshard(state), state)
    assert again["w"].data.sharding.is_equivalent_to(s.data.sharding, 2)


def test_min_shard_size_replicates_small_leaves_and_all_reduces_their_grads():
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"), min_shard_size=100)
    # Biases (24, 32 and 5 elements) stay plain replicated arrays.
    assert not isinstance(state["layers"][0]["b"], fs.Sharded)
    assert isinstance(state["layers"][0]["w"], fs.Sharded)
    text = compiled(fs.value_and_grad(mlp_sharded_loss(True)), state, mlp_batch())[1]
    reduced = sum(c["elements"] for c in collectives(text) if c["kind"] == "all-reduce")
    assert reduced == 32 + 24 + 5 + 1 + 1  # three biases, the 0-d scale and the loss


def test_uneven_other_dim_is_a_clear_error():
    with pytest.raises(ValueError, match=r"leaf \['w'\].*do not divide"):
        fs.shard(
            {"w": np.ones((4, 6), np.float32)}, mesh_for("8"), placement=lambda p, x: fs.Shard(1)
        )
    with pytest.raises(ValueError, match="cannot be sharded on dim 2"):
        fs.shard(
            {"w": np.ones((4, 8), np.float32)}, mesh_for("8"), placement=lambda p, x: fs.Shard(2)
        )
    with pytest.raises(TypeError, match="placement returned"):
        fs.shard({"w": np.ones((4, 8), np.float32)}, mesh_for("8"), placement=lambda p, x: 1)
