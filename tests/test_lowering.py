"""The eager collectives (outside a step): the entry points a torch frontend's hooks call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import funshard as fs
from funshard import _lowering, _mesh
from conftest import mesh_for


@pytest.mark.parametrize("mesh_name", ["1", "2", "4", "8", "2x4"])
def test_eager_all_gather_matches_numpy(mesh_name):
    mesh = mesh_for(mesh_name)
    x = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    b = np.array([True, False, True, True, False])
    h = np.arange(9, dtype=np.float32).astype(jnp.bfloat16)
    state = fs.shard({"x": x, "b": b, "h": h}, mesh)
    leaves = [state["x"], state["b"], state["h"]]
    fulls = _lowering.eager_all_gather(
        [s.data for s in leaves], mesh, ("fsdp",), [s.shape[0] for s in leaves]
    )
    for full, want in zip(fulls, (x, b, h)):
        assert full.sharding.is_fully_replicated
        assert full.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(full), want)


@pytest.mark.parametrize("mesh_name", ["2", "8", "2x4"])
def test_eager_reduce_scatter_sums_per_device_contributions(mesh_name):
    mesh = mesh_for(mesh_name)
    replicate = ("replicate",) if "replicate" in mesh.axis_names else ()
    dp = (*replicate, "fsdp")
    world, n = _mesh.axes_size(mesh, dp), mesh.shape["fsdp"]
    rows = -(-5 // n) * n
    contributions = np.random.default_rng(0).normal(size=(world, rows, 3)).astype(np.float32)
    stacked = jax.device_put(contributions, NamedSharding(mesh, _mesh.spec(dp)))
    (out,) = _lowering.eager_reduce_scatter([stacked], mesh, ("fsdp",), replicate)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("fsdp")), 2)
    np.testing.assert_allclose(np.asarray(out), contributions.sum(0), rtol=1e-5)


@pytest.mark.parametrize("mesh_name", ["2", "2x4"])
def test_eager_reduce_scatter_on_another_dimension(mesh_name):
    # shard_placement_fn's Shard(1): each leaf is scattered on its own dimension, in ONE
    # program (one reduce-scatter per dtype).
    mesh = mesh_for(mesh_name)
    replicate = ("replicate",) if "replicate" in mesh.axis_names else ()
    dp = (*replicate, "fsdp")
    world, n = _mesh.axes_size(mesh, dp), mesh.shape["fsdp"]
    rng = np.random.default_rng(1)
    by_dim0 = rng.normal(size=(world, 2 * n, 3)).astype(np.float32)
    by_dim1 = rng.normal(size=(world, 3, 4 * n)).astype(np.float32)
    stacked = [jax.device_put(c, NamedSharding(mesh, _mesh.spec(dp))) for c in (by_dim0, by_dim1)]
    outs = _lowering.eager_reduce_scatter(stacked, mesh, ("fsdp",), replicate, dims=(0, 1))
    assert outs[1].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec(None, "fsdp")), 2)
    for out, contributions in zip(outs, (by_dim0, by_dim1)):
        np.testing.assert_allclose(np.asarray(out), contributions.sum(0), rtol=1e-5)


def test_eager_reduce_scatter_without_all_reduce_keeps_each_replicas_sum():
    mesh = mesh_for("2x4")
    dp = ("replicate", "fsdp")
    contributions = np.random.default_rng(2).normal(size=(8, 8, 3)).astype(np.float32)
    stacked = jax.device_put(contributions, NamedSharding(mesh, _mesh.spec(dp)))
    (out,) = _lowering.eager_reduce_scatter(
        [stacked], mesh, ("fsdp",), ("replicate",), all_reduce=False)
    # Replica r's devices sum only their own 4 contributions; blocks stack by replica.
    want = np.concatenate([contributions[:4].sum(0), contributions[4:].sum(0)])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5)
