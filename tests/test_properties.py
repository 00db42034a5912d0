"""Property tests of shard / unshard / reshard on random pytrees, dtypes, shapes and meshes.

Every property is checked against numpy: the round trip must be bit-exact, and each
device's block must hold the rows `torch.chunk(x, N)[i]` gives, zero-padded.
"""

import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import MESHES, mesh_for
from hypothesis import given, settings
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

pytestmark = pytest.mark.slow

MESH_NAMES = list(MESHES)
# Small, uneven, size-0 and size-1 dims; each distinct shape costs a compile.
DIMS = [0, 1, 2, 3, 5, 7, 8, 9, 13]
DTYPES = [
    np.dtype(np.float32),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float16),
    np.dtype(np.int32),
    np.dtype(np.bool_),
]
KEYS = ["w", "b", "bias", "layers", "0", "a_b"]
SPECIAL_FLOATS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.5]


@functools.cache
def _mesh(name):
    return mesh_for(name)


def _fsdp_size(mesh):
    return mesh.shape["fsdp"]


# --- strategies -------------------------------------------------------------------------


def _values(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype == np.int32:
        return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)
    if rng.random() < 0.3:
        # Arbitrary bit patterns: subnormals, NaN payloads, infinities.
        words = rng.integers(0, 2 ** (8 * dtype.itemsize), size=shape, dtype=np.uint64)
        return words.astype(np.dtype(f"u{dtype.itemsize}")).view(dtype)
    x = rng.standard_normal(size=shape) * 10.0 ** rng.integers(-3, 4, size=shape)
    # Signed zeros, infinities and NaN must survive the round trip bit for bit.
    specials = rng.random(size=shape) < 0.15
    x = np.where(specials, rng.choice(SPECIAL_FLOATS, size=shape), x)
    return np.asarray(x).astype(dtype)


@st.composite
def arrays(draw):
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3]))
    shape = tuple(draw(st.lists(st.sampled_from(DIMS), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**32 - 1))
    return _values(np.random.default_rng(seed), shape, dtype)


non_arrays = st.one_of(
    st.none(), st.integers(-(2**40), 2**40), st.text(max_size=5), st.sampled_from(["relu", ""])
)
leaves = st.one_of(arrays(), arrays(), arrays(), non_arrays)  # mostly arrays


def pytrees(depth=3):
    """Nested dicts / lists / tuples (depth <= `depth`) of arrays and other leaves."""
    if depth == 0:
        return leaves
    child = pytrees(depth - 1)
    return st.one_of(
        leaves,
        st.dictionaries(st.sampled_from(KEYS), child, max_size=3),
        st.dictionaries(st.sampled_from(KEYS), child, min_size=2, max_size=4),
        st.lists(child, max_size=3),
        st.lists(child, max_size=3).map(tuple),
    )


# --- helpers ----------------------------------------------------------------------------


def _bits(x):
    """The raw bits of `x` (exact comparison, NaN payloads and signed zeros included)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x.view(np.uint8)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _assert_same_array(got, want):
    assert isinstance(got, (jax.Array, np.ndarray)), type(got)
    assert tuple(got.shape) == want.shape
    assert np.dtype(got.dtype) == want.dtype
    got = np.asarray(got)
    # Equal bits imply equal values (NaN payloads and signed zeros included); numpy's
    # own NaN-aware comparison warns on some bfloat16 NaN payloads.
    assert np.array_equal(_bits(got), _bits(want))


def _assert_same_tree(got, want):
    """`got` has the structure, leaf types and exact values of the original `want`."""
    if isinstance(want, np.ndarray):
        _assert_same_array(got, want)
    elif isinstance(want, dict):
        assert type(got) is dict and set(got) == set(want)
        for k in want:
            _assert_same_tree(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same_tree(g, w)
    else:
        assert type(got) is type(want) and got == want


def _array_leaves_with_path(tree):
    is_sharded = lambda x: isinstance(x, fs.Sharded)  # noqa: E731
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_sharded)[0]


def _has_sharded_leaf(tree):
    return any(isinstance(x, np.ndarray) and x.ndim >= 1 for x in jax.tree.leaves(tree))


def _shard_index(mesh, axes):
    """Each device's position along the shard `axes` (row-major over them)."""
    dims = [mesh.axis_names.index(a) for a in axes]
    sizes = [mesh.devices.shape[k] for k in dims]
    return {
        d: int(np.ravel_multi_index([idx[k] for k in dims], sizes))
        for idx, d in np.ndenumerate(mesh.devices)
    }


def _check_layout(s, x, mesh, axes=("fsdp",)):
    """`s` is `x` sharded on `mesh` with torch.chunk rows per device, zero-padded."""
    n = math.prod(mesh.shape[a] for a in axes)
    d0 = x.shape[0]
    c = -(-d0 // n)
    assert s.shape == x.shape and np.dtype(s.dtype) == x.dtype
    assert s.data.shape == (n * c, *x.shape[1:])
    assert np.dtype(s.data.dtype) == x.dtype
    spec = P(axes[0] if len(axes) == 1 else axes)
    assert s.data.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    full = np.asarray(s.data)
    assert not np.any(full[d0:]), "padding rows must be zero"
    position = _shard_index(mesh, axes)
    shards = s.data.addressable_shards
    assert {sh.device for sh in shards} == set(mesh.devices.flat)
    for sh in shards:
        i = position[sh.device]
        block = np.asarray(sh.data)
        assert block.shape == (c, *x.shape[1:])
        if c:
            start, stop, step = sh.index[0].indices(n * c)
            assert (start, stop, step) == (i * c, (i + 1) * c, 1)
        for dim_index, dim in zip(sh.index[1:], x.shape[1:], strict=True):
            assert dim_index.indices(dim) == (0, dim, 1)
        # torch.chunk semantics: device i owns rows [i*c, min((i+1)*c, d0)).
        want = x[i * c : min((i + 1) * c, d0)]
        assert np.array_equal(_bits(block[: len(want)]), _bits(want))
        assert not np.any(block[len(want) :]), "padding rows must be zero"


# --- properties -------------------------------------------------------------------------


@settings(max_examples=100)
@given(tree=pytrees(), mesh_name=st.sampled_from(MESH_NAMES))
def test_unshard_inverts_shard_exactly(tree, mesh_name):
    mesh = _mesh(mesh_name)
    state = fs.shard(tree, mesh)
    if not _has_sharded_leaf(tree):
        with pytest.raises(ValueError, match="no fs.Sharded"):
            fs.unshard(state)
        _assert_same_tree(state, tree)
        return
    full = fs.unshard(state)
    _assert_same_tree(full, tree)
    for _, leaf in _array_leaves_with_path(full):
        if isinstance(leaf, jax.Array):
            assert leaf.sharding.is_fully_replicated


@settings(max_examples=100)
@given(tree=pytrees(), mesh_name=st.sampled_from(MESH_NAMES))
def test_shard_layout_is_torch_chunk(tree, mesh_name):
    mesh = _mesh(mesh_name)
    state = fs.shard(tree, mesh)
    want = dict(_array_leaves_with_path(tree))
    got = _array_leaves_with_path(state)
    assert [p for p, _ in got] == list(want)
    for path, s in got:
        x = want[path]
        if isinstance(x, np.ndarray) and x.ndim >= 1:
            assert isinstance(s, fs.Sharded), path
            _check_layout(s, x, mesh)
        elif isinstance(x, np.ndarray):
            # 0-d arrays are replicated, never Sharded.
            assert isinstance(s, jax.Array) and s.sharding.is_fully_replicated
            _assert_same_array(s, x)
        else:
            assert s is x or (type(s) is type(x) and s == x)


POLICIES = [
    None,
    fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16),
    fs.MixedPrecisionPolicy(param_dtype=jnp.float16, reduce_dtype=jnp.float32),
]


@settings(max_examples=60)
@given(x=arrays(), mesh_name=st.sampled_from(MESH_NAMES), policy=st.sampled_from(POLICIES))
def test_shard_preserves_dtype(x, mesh_name, policy):
    mesh = _mesh(mesh_name)
    s = fs.shard({"w": x}, mesh, mp_policy=policy)["w"]
    if x.ndim == 0:
        assert not isinstance(s, fs.Sharded)
        _assert_same_array(s, x)
        return
    assert s.dtype == x.dtype and np.dtype(s.data.dtype) == x.dtype
    assert s.shape == x.shape and s.mp_policy == policy
    # The policy decides the gather dtype, never the stored one: fp32 master weights.
    assert np.dtype(fs.unshard(s).dtype) == x.dtype
    if mesh_name == "2x4":
        assert s.replicate_axis == ("replicate",) and s.shard_axis == ("fsdp",)
    else:
        assert s.replicate_axis == () and s.shard_axis == ("fsdp",)


@settings(max_examples=60)
@given(tree=pytrees().filter(_has_sharded_leaf), mesh_name=st.sampled_from(MESH_NAMES))
def test_reshard_of_unshard_is_identity(tree, mesh_name):
    mesh = _mesh(mesh_name)
    state = fs.shard(tree, mesh)
    again = fs.reshard(fs.unshard(state), state)
    want = _array_leaves_with_path(state)
    got = _array_leaves_with_path(again)
    assert jax.tree.structure(again) == jax.tree.structure(state)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want, strict=True):
        if isinstance(w, fs.Sharded):
            assert isinstance(g, fs.Sharded), path
            assert (g.shape, g.dtype, g.mesh, g.shard_axis, g.replicate_axis, g.mp_policy) == (
                w.shape,
                w.dtype,
                w.mesh,
                w.shard_axis,
                w.replicate_axis,
                w.mp_policy,
            )
            assert g.data.shape == w.data.shape and g.data.dtype == w.data.dtype
            assert g.data.sharding.is_equivalent_to(w.data.sharding, w.data.ndim)
            if w.data.size:  # size-0 blocks: see test_reshard_zero_size_leaf_blocks
                assert np.array_equal(_bits(g.data), _bits(w.data))
        elif isinstance(w, jax.Array):
            _assert_same_array(g, np.asarray(w))
        else:
            assert type(g) is type(w) and g == w


@settings(max_examples=40)
@given(tree=pytrees())
def test_shard_over_both_axes_of_2x4(tree):
    """Plain FSDP over all 8 devices of the 2-D mesh: rows follow (replicate, fsdp) order."""
    mesh, axes = _mesh("2x4"), ("replicate", "fsdp")
    state = fs.shard(tree, mesh, shard_axis=axes, replicate_axis=())
    want = dict(_array_leaves_with_path(tree))
    for path, s in _array_leaves_with_path(state):
        if isinstance(want[path], np.ndarray) and want[path].ndim >= 1:
            assert s.shard_axis == axes and s.replicate_axis == () and s.num_shards == 8
            _check_layout(s, want[path], mesh, axes)
    if _has_sharded_leaf(tree):
        _assert_same_tree(fs.unshard(state), tree)


@pytest.mark.parametrize("mesh_name", ["2", "2x4"])
def test_reshard_zero_size_leaf_blocks(mesh_name):
    mesh = _mesh(mesh_name)
    x = np.zeros((1, 0), np.float32)
    state = fs.shard({"e": x}, mesh)
    _check_layout(state["e"], x, mesh)
    again = fs.reshard(fs.unshard(state), state)
    _check_layout(again["e"], x, mesh)


# --- Sharded as a pytree ----------------------------------------------------------------


@pytest.mark.parametrize("mesh_name", MESH_NAMES)
def test_sharded_is_a_pytree_with_one_child(mesh_name):
    mesh = _mesh(mesh_name)
    params = {
        "w": np.arange(15, dtype=np.float32).reshape(5, 3),
        "b": np.ones(3, np.float32),
        "s": np.float32(2.0),
        "name": "mlp",
    }
    state = fs.shard(params, mesh, mp_policy=fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(state)
    # Sorted keys: 'b', 'name', 's', 'w'; the string is a leaf that passes through.
    assert [type(x) for x in leaves] == [
        type(state["b"].data),
        str,
        type(state["s"]),
        type(state["w"].data),
    ]
    n = _fsdp_size(mesh)
    assert leaves[0] is state["b"].data and leaves[3] is state["w"].data
    assert leaves[3].shape == (n * math.ceil(5 / n), 3)
    assert leaves[0].shape == (n * math.ceil(3 / n),)
    assert len(jax.tree.leaves(state["w"])) == 1

    doubled = jax.jit(lambda s: jax.tree.map(lambda x: x * 2, s))(
        {k: v for k, v in state.items() if k != "name"}
    )
    for key in ("w", "b"):
        got, want = doubled[key], state[key]
        assert isinstance(got, fs.Sharded)
        assert (
            got.shape,
            got.dtype,
            got.mesh,
            got.shard_axis,
            got.replicate_axis,
            got.mp_policy,
        ) == (
            want.shape,
            want.dtype,
            want.mesh,
            want.shard_axis,
            want.replicate_axis,
            want.mp_policy,
        )
        assert got.data.sharding.is_equivalent_to(want.data.sharding, want.data.ndim)
        np.testing.assert_array_equal(np.asarray(got.data), 2 * np.asarray(want.data))
    np.testing.assert_array_equal(np.asarray(fs.unshard(doubled)["w"]), 2 * params["w"])


def _data_bits(tree):
    return [
        (_bits(x.data), x.data.sharding)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, fs.Sharded))
        if isinstance(x, fs.Sharded)
    ]


@settings(max_examples=20)
@given(x=arrays().filter(lambda x: x.ndim >= 1), mesh_name=st.sampled_from(MESH_NAMES))
def test_shard_on_the_device_equals_shard_on_the_host(x, mesh_name):
    """Arrays on CPU devices are padded and sliced by numpy; on an accelerator by
    compiled programs (forced here): the same bits and layout either way, for
    fs.shard and for fs.reshard outside a step."""
    from funshard.core import _shard

    mesh = _mesh(mesh_name)
    on_device = jax.device_put(x, jax.devices()[0])
    host = fs.shard({"w": on_device}, mesh)
    again_host = fs.reshard(fs.unshard(host), host) if x.size else host
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_shard, "_in_host_memory", lambda _: False)
        m.setattr(_shard, "_concrete_in_host_memory", lambda _: False)
        device = fs.shard({"w": on_device}, mesh)
        again_device = fs.reshard(fs.unshard(device), device) if x.size else device
    for got, want in ((device, host), (again_device, again_host), (again_host, host)):
        for (g, gs), (w, ws) in zip(_data_bits(got), _data_bits(want), strict=True):
            assert np.array_equal(g, w) and gs.is_equivalent_to(ws, g.ndim)


@pytest.mark.parametrize(
    ("spec", "shape"), [(P(None, "tensor"), (7, 6)), (P("tensor"), (10, 3)), (P("tensor"), (6, 2))]
)
def test_model_split_shard_on_the_device_equals_shard_on_the_host(spec, shape, monkeypatch):
    """The same for a leaf split over a model axis (padded per model block)."""
    from funshard.core import _shard

    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), devices=jax.devices()[:8])
    x = _values(np.random.default_rng(3), shape, np.dtype(ml_dtypes.bfloat16))
    placed = jax.device_put(x, NamedSharding(mesh, spec))
    host = fs.shard({"w": placed}, mesh)
    monkeypatch.setattr(_shard, "_in_host_memory", lambda _: False)
    device = fs.shard({"w": placed}, mesh)
    for (g, gs), (w, ws) in zip(_data_bits(device), _data_bits(host), strict=True):
        assert np.array_equal(g, w) and gs.is_equivalent_to(ws, g.ndim)
    assert host["w"].model_axis_names == ("tensor",)
