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
