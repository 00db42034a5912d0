"""funshard.comm's eager collectives (outside a step), against numpy.

One process holds all 8 CPU devices here, so it passes one block per device (in the
mesh's device order) to `global_array`; a torch rank passes its one block. The
reference is numpy on the blocks: concatenation for the all-gather, sums for the
reduce-scatters, checked on every device of the mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from funshard import comm
from tests.conftest import MESHES, mesh_for

MESH_NAMES = sorted(MESHES)
DTYPES = [np.float32, jnp.bfloat16, np.int32, np.bool_]


def _random(rng, shape, dtype):
    """Random values of `dtype`; integer-valued floats, so that sums are exact."""
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    return rng.integers(-8, 8, size=shape).astype(dtype)


def _shard_index(mesh, position):
    """A device's index along the "fsdp" axis from its flat mesh position."""
    return np.unravel_index(position, mesh.devices.shape)[mesh.axis_names.index("fsdp")]


def _replica_index(mesh, position):
    """A device's index along the "replicate" axis (0 without one)."""
    if "replicate" not in mesh.axis_names:
        return 0
    return np.unravel_index(position, mesh.devices.shape)[mesh.axis_names.index("replicate")]


def _positions(mesh):
    """Each device of `mesh` -> its flat position in the mesh."""
    return {d: i for i, d in enumerate(mesh.devices.flat)}


def _replicate_axes(mesh):
    return ("replicate",) if "replicate" in mesh.axis_names else ()


def _block(array, dim, index, size):
    """Block `index` of `size` along `dim` of a numpy array."""
    return np.take(array, np.arange(index * size, (index + 1) * size), axis=dim)


def _stacked(mesh, contributions):
    """Per-device contributions as a `(W, ...)` global array over every data-parallel axis."""
    dp = (*_replicate_axes(mesh), "fsdp")
    return comm.global_array([c[None] for c in contributions], mesh, dp)


def _summed(mesh, contributions, position, all_reduce):
    """numpy's sum of the contributions that device `position`'s result adds up."""
    replica = _replica_index(mesh, position)
    devices = range(mesh.devices.size)
    if not all_reduce:  # each replica keeps its own sum
        devices = [p for p in devices if _replica_index(mesh, p) == replica]
    return np.sum([contributions[p] for p in devices], axis=0)


@given(
    mesh_name=st.sampled_from(MESH_NAMES),
    rows=st.integers(0, 9),
    other_rows=st.integers(0, 9),
    dim=st.sampled_from([0, 1]),
    dtype=st.sampled_from(DTYPES),
)
def test_eager_all_gather_concatenates_the_shards_blocks(mesh_name, rows, other_rows, dim, dtype):
    # Two leaves of different dtypes, sizes and split dims: ONE gather (mixed dtypes
    # travel as raw words), the padding cut off at each leaf's rows.
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    rng = np.random.default_rng(rows * 10 + other_rows)
    per, other_per = comm.rows_per_shard(rows, n), comm.rows_per_shard(other_rows, n)
    shapes = ((per, 3) if dim == 0 else (3, per), (other_per, 2))
    leaves = [(shapes[0], dim, dtype, rows), (shapes[1], 0, np.float32, other_rows)]
    shards = [[_random(rng, shape, dt) for _ in range(n)] for shape, _, dt, _ in leaves]
    datas = [
        # Replicas of one shard hold the same block (HSDP).
        comm.global_array(
            [s[_shard_index(mesh, i)] for i in range(mesh.devices.size)], mesh, ("fsdp",), d
        )
        for s, (_, d, _, _) in zip(shards, leaves, strict=True)
    ]
    fulls = comm.eager_all_gather(datas, mesh, ("fsdp",), rows=[rows, other_rows], dims=[dim, 0])
    for full, s, (_, d, dt, r) in zip(fulls, shards, leaves, strict=True):
        want = np.take(np.concatenate(s, axis=d), np.arange(r), axis=d)
        assert full.sharding.is_fully_replicated and full.dtype == dt
        for shard in full.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want)


@pytest.mark.parametrize("mesh_name", MESH_NAMES)
def test_eager_all_gather_defaults_to_the_padded_size_on_dim_0(mesh_name):
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    shards = [np.full((2, 3), i, np.float32) for i in range(n)]
    data = comm.global_array(
        [shards[_shard_index(mesh, i)] for i in range(mesh.devices.size)], mesh, ("fsdp",)
    )
    (full,) = comm.eager_all_gather([data], mesh, ("fsdp",))
    np.testing.assert_array_equal(np.asarray(full), np.concatenate(shards))
    assert comm.eager_all_gather([], mesh, ("fsdp",)) == []


@pytest.mark.parametrize("mesh_name", MESH_NAMES)
@pytest.mark.parametrize("all_reduce", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_eager_reduce_scatter_sums_then_scatters(mesh_name, all_reduce, dim):
    # Two leaves in one call: float32 on `dim`, int32 on dim 0 (one reduce-scatter per
    # dtype), of uneven logical sizes padded to a multiple of the shard count.
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    rng = np.random.default_rng(dim + 2 * all_reduce)
    padded = comm.padded_size(5, n), comm.padded_size(3, n)
    shapes = ((padded[0], 3) if dim == 0 else (3, padded[0]), (padded[1], 2))
    dims = (dim, 0)
    contributions = [
        [_random(rng, shape, dt) for _ in mesh.devices.flat]
        for shape, dt in zip(shapes, (np.float32, np.int32), strict=True)
    ]
    outs = comm.eager_reduce_scatter(
        [_stacked(mesh, c) for c in contributions],
        mesh,
        ("fsdp",),
        _replicate_axes(mesh),
        dims=dims,
        all_reduce=all_reduce,
    )
    positions = _positions(mesh)
    for out, c, d, size in zip(outs, contributions, dims, padded, strict=True):
        replicas = 1 if all_reduce else mesh.devices.size // n
        assert out.shape[d] == size * replicas and out.dtype == c[0].dtype
        for shard in out.addressable_shards:
            p = positions[shard.device]
            want = _block(_summed(mesh, c, p, all_reduce), d, _shard_index(mesh, p), size // n)
            np.testing.assert_array_equal(np.asarray(shard.data), want)  # integers: exact


def _rows_apart(mesh, flats):
    """Each device's flat contribution as its rows for devices f, f+1, ... on "fsdp"."""
    n = mesh.shape["fsdp"]
    cols = flats[0].size // n
    dp = (*_replicate_axes(mesh), "fsdp")
    return [
        comm.global_array(
            [
                flats[p][(_shard_index(mesh, p) + k) % n * cols :][:cols][None]
                for p in range(mesh.devices.size)
            ],
            mesh,
            dp,
        )
        for k in range(n)
    ]


@pytest.mark.parametrize("mesh_name", MESH_NAMES)
@pytest.mark.parametrize("all_reduce", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_eager_reduce_scatter_rows_sums_each_devices_row(mesh_name, all_reduce, dtype):
    mesh = mesh_for(mesh_name)
    n = mesh.shape["fsdp"]
    rng = np.random.default_rng(3)
    cols = (5, 2)  # two leaves, of different row lengths
    flats = [[_random(rng, (n * c,), dtype) for _ in mesh.devices.flat] for c in cols]
    outs = comm.eager_reduce_scatter_rows(
        [_rows_apart(mesh, f) for f in flats], mesh, ("fsdp",), _replicate_axes(mesh), all_reduce
    )
    positions = _positions(mesh)
    for out, f, c in zip(outs, flats, cols, strict=True):
        assert out.dtype == dtype and out.ndim == 1
        for shard in out.addressable_shards:
            p = positions[shard.device]
            want = _block(_summed(mesh, f, p, all_reduce), 0, _shard_index(mesh, p), c)
            np.testing.assert_array_equal(np.asarray(shard.data), want)  # small integers


def test_eager_collectives_keep_their_programs_but_no_lowered_modules():
    # After a call that compiled, JAX's cache of lowered modules is emptied (memory held
    # for a second lowering that never comes); the next call with the same shapes runs
    # the kept program: nothing is lowered again, and the numbers are numpy's.
    from jax._src.interpreters import pxla

    lowered = pxla._cached_lowering_to_hlo
    mesh = mesh_for("4")
    n = mesh.shape["fsdp"]
    rng = np.random.default_rng(7)
    jax.jit(lambda x: x * 3).lower(jnp.ones(13))  # an unrelated module in the cache
    for _ in range(2):
        shards = [_random(rng, (3, 7), np.float32) for _ in range(n)]
        data = comm.global_array([shards[_shard_index(mesh, i)] for i in range(n)], mesh, ("fsdp",))
        flats = [_random(rng, (n * 11,), np.float32) for _ in range(n)]
        misses = lowered.cache_info().misses
        (full,) = comm.eager_all_gather([data], mesh, ("fsdp",), rows=[3 * n - 1])
        (out,) = comm.eager_reduce_scatter_rows([_rows_apart(mesh, flats)], mesh, ("fsdp",))
        assert lowered.cache_info().currsize == 0
        np.testing.assert_array_equal(np.asarray(full), np.concatenate(shards)[: 3 * n - 1])
        for shard in out.addressable_shards:
            p = _positions(mesh)[shard.device]
            want = _block(_summed(mesh, flats, p, True), 0, _shard_index(mesh, p), 11)
            np.testing.assert_array_equal(np.asarray(shard.data), want)
    assert lowered.cache_info().misses == misses  # the second round lowered nothing


def test_eager_reduce_scatter_rows_needs_one_row_per_device():
    mesh = mesh_for("4")
    rows = _rows_apart(mesh, [np.zeros(8, np.float32)] * 4)
    with pytest.raises(ValueError, match=r"leaf 0 has 3 rows; the shard axes \('fsdp',\) have 4"):
        comm.eager_reduce_scatter_rows([rows[:3]], mesh, ("fsdp",))


@pytest.mark.parametrize(
    ("mesh_name", "axes", "dim"),
    [
        ("1", ("fsdp",), 0),
        ("4", ("fsdp",), 1),
        ("8", ("fsdp",), 0),
        ("2x4", ("fsdp",), 1),
        ("2x4", ("replicate", "fsdp"), 0),
    ],
)
def test_global_array_aliases_the_blocks_and_counts_them(mesh_name, axes, dim):
    mesh = mesh_for(mesh_name)
    rng = np.random.default_rng(5)
    blocks = [jax.device_put(_random(rng, (2, 3), np.float32), d) for d in mesh.devices.flat]
    array = comm.global_array(blocks, mesh, axes, dim)
    size = comm.axes_size(mesh, axes)
    assert array.shape == ((2 * size, 3) if dim == 0 else (2, 3 * size))
    for shard, block in zip(array.addressable_shards, blocks, strict=True):
        assert shard.device == next(iter(block.devices()))
        assert shard.data.unsafe_buffer_pointer() == block.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="one block per local device"):
        comm.global_array(blocks[:-1] or blocks * 2, mesh, axes, dim)


def test_global_array_places_host_blocks_on_their_devices():
    mesh = mesh_for("2x4")
    blocks = [np.full((1, 2), i, np.float32) for i in range(8)]
    array = comm.global_array(blocks, mesh, ("replicate", "fsdp"))
    # Data-parallel order is the mesh's flat order: block i is rows [i, i + 1).
    np.testing.assert_array_equal(np.asarray(array), np.concatenate(blocks))


def test_eager_collectives_refuse_traced_values():
    mesh = mesh_for("2")
    wrap = jax.jit(lambda a, b: comm.global_array([a, b], mesh, ("fsdp",)))
    ones = np.ones(2, np.float32)
    with pytest.raises(TypeError, match="outside jax.jit .* fs.unshard"):
        wrap(ones, ones)


@pytest.mark.torch
def test_row_arithmetic_is_torch_chunks():
    torch = pytest.importorskip("torch")  # the dev extra's CPU build: torch.chunk is the reference
    for size in range(11):
        for n in (1, 2, 3, 4, 8):
            chunks = torch.arange(size).chunk(n) if size else ()
            for i in range(n):
                want = chunks[i].tolist() if i < len(chunks) else []
                start, rows = comm.chunk(size, n, i)
                assert list(range(start, start + rows)) == want
            assert comm.padded_size(size, n) == comm.rows_per_shard(size, n) * n
            assert comm.rows_per_shard(size, n) == max((len(c) for c in chunks), default=0)


@given(mesh_name=st.sampled_from(MESH_NAMES), rows=st.integers(1, 11))
def test_a_leafs_layout_says_where_each_row_lives(mesh_name, rows):
    import funshard as fs

    mesh = mesh_for(mesh_name)
    x = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    leaf = fs.shard({"w": x}, mesh)["w"]
    layout = leaf.layout
    assert isinstance(layout, comm.Layout)
    assert fs.Sharded.from_layout(layout, leaf.data).layout == layout
    assert (layout.padded_shape, layout.local_shape, layout.sharding) == (
        leaf.padded_shape,
        leaf.local_shape,
        leaf.sharding,
    )
    data = np.asarray(leaf.data)
    for i in range(layout.num_shards):
        start, count = layout.chunk(i)
        block = data[i * layout.rows_per_shard : (i + 1) * layout.rows_per_shard]
        np.testing.assert_array_equal(block[:count], x[start : start + count])
        assert not block[count:].any()  # padding rows are zeros
