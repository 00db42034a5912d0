"""funshard.comm's eager collectives over process-local buffers, against numpy.

One process holds all 8 CPU devices here, so it passes one block per device (in the
mesh's device order); a torch rank passes its one block. The reference is numpy on
the blocks: concatenation for the all-gather, sums for the reductions.
"""

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from funshard import comm
from tests.conftest import MESHES, mesh_for


def _blocks(mesh, shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in mesh.devices.flat]


def _shard_index(mesh, position):
    """A device's index along the "fsdp" axis from its flat mesh position."""
    return np.unravel_index(position, mesh.devices.shape)[mesh.axis_names.index("fsdp")]


@given(mesh_name=st.sampled_from(sorted(MESHES)), rows=st.integers(0, 9),
       dim=st.sampled_from([0, 1]))
def test_all_gather_concatenates_the_shards_blocks(mesh_name, rows, dim):
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    per = comm.rows_per_shard(rows, n)
    shape = (per, 3) if dim == 0 else (3, per)
    shards = _blocks(mesh, shape)
    # Replicas of one shard hold the same block (HSDP).
    blocks = [shards[_shard_index(mesh, i)] for i in range(mesh.devices.size)]
    (full,) = comm.all_gather([blocks], mesh, ("fsdp",), rows=[rows], dims=[dim])
    want = np.concatenate(shards[:n], axis=dim)
    want = want[:rows] if dim == 0 else want[:, :rows]
    np.testing.assert_array_equal(np.asarray(full), want)


@pytest.mark.parametrize("mesh_name", ["2", "8", "2x4"])
@pytest.mark.parametrize("all_reduce", [True, False])
def test_reduce_scatter_sums_then_scatters(mesh_name, all_reduce):
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    replicate = ("replicate",) if "replicate" in mesh.axis_names else ()
    fulls = _blocks(mesh, (2 * n, 5), seed=1)
    got = comm.reduce_scatter([fulls], mesh, ("fsdp",), replicate, all_reduce=all_reduce)[0]
    # This process's first device is mesh position 0: replica 0, shard 0.
    summed = fulls[:n] if replicate and not all_reduce else fulls  # replica 0's only
    want = np.sum(summed, axis=0)[:2]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("axes", [("fsdp",), ("replicate",), ("replicate", "fsdp")])
def test_all_reduce_sums_over_the_axes_only(axes):
    mesh = mesh_for("2x4")
    values = _blocks(mesh, (3,), seed=2)
    (got,) = comm.all_reduce([values], mesh, axes)
    grid = np.stack(values).reshape(*mesh.devices.shape, 3)
    summed = grid.sum(axis=tuple(mesh.axis_names.index(a) for a in axes), keepdims=True)
    np.testing.assert_allclose(np.asarray(got), summed.reshape(-1, 3)[0], rtol=1e-6)


def test_global_array_aliases_the_blocks_and_counts_them():
    mesh = mesh_for("4")
    blocks = [jax.device_put(b, d) for b, d in zip(_blocks(mesh, (2, 2)), mesh.devices.flat)]
    array = comm.global_array(blocks, mesh, ("fsdp",))
    assert array.shape == (8, 2)
    for shard, block in zip(array.addressable_shards, blocks):
        assert shard.data.unsafe_buffer_pointer() == block.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="one block per local device"):
        comm.global_array(blocks[:1], mesh, ("fsdp",))


@pytest.mark.torch
def test_eager_collectives_refuse_traced_values():
    mesh = mesh_for("2")
    gather = jax.jit(lambda a, b: comm.all_gather([[a, b]], mesh, ("fsdp",))[0])
    ones = np.ones(2, np.float32)
    with pytest.raises(TypeError, match="outside jax.jit .* fs.unshard"):
        gather(ones, ones)


@pytest.mark.torch
def test_row_arithmetic_is_torch_chunks():
    import torch  # the dev extra's CPU build: torch.chunk is the reference
    for size in range(0, 11):
        for n in (1, 2, 3, 4, 8):
            chunks = torch.arange(size).chunk(n) if size else ()
            for i in range(n):
                want = chunks[i].tolist() if i < len(chunks) else []
                start, rows = comm.chunk(size, n, i)
                assert list(range(start, start + rows)) == want
            assert comm.padded_size(size, n) == comm.rows_per_shard(size, n) * n
            assert comm.rows_per_shard(size, n) == max((len(c) for c in chunks), default=0)


@given(mesh_name=st.sampled_from(sorted(MESHES)), rows=st.integers(1, 11))
def test_a_leafs_layout_says_where_each_row_lives(mesh_name, rows):
    import funshard as fs

    mesh = mesh_for(mesh_name)
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    leaf = fs.shard({"w": x}, mesh)["w"]
    layout = leaf.layout
    assert isinstance(layout, comm.Layout)
    assert fs.Sharded.from_layout(layout, leaf.data).layout == layout
    assert (layout.padded_shape, layout.local_shape, layout.sharding) == (
        leaf.padded_shape, leaf.local_shape, leaf.sharding)
    data = np.asarray(leaf.data)
    for i in range(layout.num_shards):
        start, count = layout.chunk(i)
        block = data[i * layout.rows_per_shard:(i + 1) * layout.rows_per_shard]
        np.testing.assert_array_equal(block[:count], x[start:start + count])
        assert not block[count:].any()  # padding rows are zeros
