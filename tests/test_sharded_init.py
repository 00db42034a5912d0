"""Sharded initialisation: `fs.shard` under `jax.jit` / `jax.eval_shape`, and key leaves.

The reference for every traced or abstract result is eager `fs.shard` of the same
parameters (and numpy for the padded shapes): the jitted init must give the same
padding, values, shardings and static metadata, so that a step compiled on one accepts
the other. The parameters themselves come from `jax.jit(init)` in both, and the small
ones are drawn with `uniform`, whose arithmetic is exact: XLA rounds `normal`'s inverse
error function differently when it partitions it over the mesh (by 1 ulp on jax 0.12),
which says nothing about where funshard puts the values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_params, mlp_sharded_loss
from conftest import MESHES, mesh_for
from jax.sharding import NamedSharding, PartitionSpec

import funshard as fs

pytestmark = pytest.mark.slow

is_sharded = lambda x: isinstance(x, fs.Sharded)  # noqa: E731


def _exact_mlp_params(key, sizes=(13, 32, 24, 5)):
    """`mlp_params`' tree with exactly computed values: uniform draws scaled by 1/4."""
    params = mlp_params(key, sizes)
    keys = jax.random.split(key, len(params["layers"]))
    for k, layer in zip(keys, params["layers"], strict=True):
        layer["w"] = jax.random.uniform(k, layer["w"].shape, minval=-1.0, maxval=1.0) * 0.25
    return params


def _init(key):
    """MLP parameters (uneven dims, a weakly typed and a 0-d leaf) plus a host array
    and PRNG key leaves, as flax nnx `Rngs` would hold."""
    k_params, k_rngs = jax.random.split(key)
    return {
        **_exact_mlp_params(k_params),
        "table": np.arange(10, dtype=np.float32).reshape(5, 2),
        "rngs": {"key": jax.random.key(3), "keys": jax.random.split(k_rngs, 3)},
    }


def _host(x):
    return np.asarray(
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    )


def _eager_shard(init, key, mesh, **kwargs):
    return fs.shard(jax.jit(init)(key), mesh, **kwargs)


def _assert_same_state(got, want):
    """Same treedef (static metadata included), shardings, dtypes and exact values."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if g.sharding.num_devices == 1:
            # jit reports a one-device output as P() whatever the spec.
            assert g.sharding.is_equivalent_to(w.sharding, g.ndim)
        else:
            assert g.sharding == w.sharding
        assert g.dtype == w.dtype and g.shape == w.shape
        assert getattr(g, "weak_type", False) == getattr(w, "weak_type", False)
        np.testing.assert_array_equal(_host(g), _host(w))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_jitted_shard_is_bit_identical_to_eager(mesh_name):
    mesh = mesh_for(mesh_name)
    key = jax.random.key(0)
    got = jax.jit(lambda k: fs.shard(_init(k), mesh))(key)
    _assert_same_state(got, _eager_shard(_init, key, mesh))


def test_jitted_stacked_shard_with_policy_matches_eager():
    mesh = mesh_for("8")
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    init = lambda k: {"w": jax.random.normal(k, (3, 13, 4)), "g": jnp.ones((3,))}  # noqa: E731
    key = jax.random.key(1)
    kwargs = dict(mp_policy=policy, stacked=True)
    got = jax.jit(lambda k: fs.shard(init(k), mesh, **kwargs))(key)
    _assert_same_state(got, _eager_shard(init, key, mesh, **kwargs))


def _expected_abstract(eager):
    """(shape, dtype, sharding) of every array leaf of the eager state, the padded
    shapes computed independently (dim 0 rounded up to a multiple of the shard count)."""
    out = []
    for x in jax.tree.leaves(eager, is_leaf=is_sharded):
        if isinstance(x, fs.Sharded):
            n = x.num_shards
            out.append(((-(-x.shape[0] // n) * n, *x.shape[1:]), x.dtype, x.data.sharding))
        else:
            out.append((x.shape, x.dtype, x.sharding))
    return out


def test_eval_shape_of_shard_gives_the_abstract_state():
    mesh = mesh_for("8")
    key = jax.random.key(0)
    eager = fs.shard(_init(key), mesh)
    abstract = jax.eval_shape(lambda: fs.shard(_init(key), mesh))
    assert jax.tree.structure(abstract) == jax.tree.structure(eager)
    for a, e in zip(
        jax.tree.leaves(abstract, is_leaf=is_sharded),
        jax.tree.leaves(eager, is_leaf=is_sharded),
        strict=True,
    ):
        if isinstance(e, fs.Sharded):
            assert isinstance(a.data, jax.ShapeDtypeStruct)
            # The layout fixes where the data lives, though eval_shape itself drops
            # shardings on a mesh with Auto axes.
            assert (a.data.shape, a.data.dtype, a.data.sharding) == (
                e.data.shape,
                e.data.dtype,
                e.data.sharding,
            )
        else:
            assert (a.shape, a.dtype) == (e.shape, e.dtype)


def test_shard_of_an_abstract_tree_gives_the_abstract_state():
    mesh = mesh_for("2x4")
    key = jax.random.key(0)
    abstract = fs.shard(jax.eval_shape(_init, key), mesh)
    eager = _eager_shard(_init, key, mesh)
    assert jax.tree.structure(abstract) == jax.tree.structure(eager)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    want = _expected_abstract(eager)
    assert len(jax.tree.leaves(abstract)) == len(want)
    for a, e in zip(jax.tree.leaves(abstract), want, strict=True):
        assert (a.shape, a.dtype) == e[:2]
        # Replicated key arrays report P(None,) for P(): the same placement.
        assert a.sharding.is_equivalent_to(e[2], len(a.shape))
    # An abstract state is a valid out_shardings for the jitted init.
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    made = jax.jit(lambda k: fs.shard(_init(k), mesh), out_shardings=shardings)(key)
    _assert_same_state(made, eager)


def test_load_state_dict_onto_an_abstract_state():
    mesh = mesh_for("4")
    key = jax.random.key(0)
    eager = _eager_shard(_init, key, mesh)
    loaded = fs.load_state_dict(fs.state_dict(eager), fs.shard(jax.eval_shape(_init, key), mesh))
    _assert_same_state(loaded, eager)


def _big_init(key):
    keys = jax.random.split(key, 5)
    params = {f"w{i}": jax.random.normal(k, (1024, 1024)) for i, k in enumerate(keys[:4])}
    params["uneven"] = jax.random.normal(keys[4], (1020, 1024))  # padded to 1024 rows
    return params


def test_jitted_init_materialises_each_devices_block_only():
    mesh = mesh_for("8")
    abstract = jax.eval_shape(_big_init, jax.random.key(0))
    full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    padded_bytes = sum(-(-x.shape[0] // 8) * 8 * x.shape[1] * 4 for x in jax.tree.leaves(abstract))
    key = jax.random.key(0)

    plain = jax.jit(_big_init).lower(key).compile().memory_analysis()
    assert plain.output_size_in_bytes >= full_bytes  # the analysis sees full arrays

    init = jax.jit(lambda k: fs.shard(_big_init(k), mesh)).lower(key).compile()
    stats = init.memory_analysis()
    assert padded_bytes // 8 <= stats.output_size_in_bytes <= padded_bytes // 8 + 4096
    # No leaf is generated whole: every temporary is a fraction of the parameters.
    assert stats.temp_size_in_bytes < full_bytes // 4
    _assert_same_state(init(key), _eager_shard(_big_init, key, mesh))


def test_step_compiled_on_eager_state_accepts_the_jitted_state():
    mesh = mesh_for("8")
    key = jax.random.key(0)
    opt = optax.adamw(1e-2)

    @jax.jit
    def step(state, opt_state, batch):
        grads = fs.grad(mlp_sharded_loss(True))(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    batch = (jax.random.normal(key, (16, 13)), jnp.ones((16, 5)))
    eager = _eager_shard(_exact_mlp_params, key, mesh)
    want = step(eager, opt.init(eager), batch)
    jitted = jax.jit(lambda k: fs.shard(_exact_mlp_params(k), mesh))(key)
    got = step(jitted, opt.init(jitted), batch)
    assert step._cache_size() == 1
    _assert_same_state(got[0], want[0])


def test_reshard_under_jit_matches_eager():
    mesh = mesh_for("2x4")
    key = jax.random.key(0)
    like = fs.shard(_big_init(key), mesh)
    full = fs.unshard(like)
    eager = fs.reshard(full, like)
    _assert_same_state(jax.jit(lambda f: fs.reshard(f, like))(full), eager)
    # The layout alone is enough: reshard onto an abstract state, under jit.
    abstract = jax.eval_shape(lambda: fs.shard(_big_init(key), mesh))
    _assert_same_state(jax.jit(lambda f: fs.reshard(f, abstract))(full), eager)


def test_key_leaves_stay_replicated_and_round_trip():
    mesh = mesh_for("8")
    key, keys = jax.random.key(3), jax.random.split(jax.random.key(4), 5)
    state = fs.shard({"w": jnp.ones((9, 2)), "rngs": {"key": key, "keys": keys}}, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    for got, want in ((state["rngs"]["key"], key), (state["rngs"]["keys"], keys)):
        assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
        assert got.sharding.is_equivalent_to(replicated, got.ndim)
        np.testing.assert_array_equal(_host(got), _host(want))
    full = fs.unshard(state)
    assert full["rngs"]["key"] is state["rngs"]["key"]
    sd = fs.state_dict(state)
    np.testing.assert_array_equal(sd["['rngs']['keys']"], np.asarray(jax.random.key_data(keys)))
    back = fs.load_state_dict(sd, state)
    _assert_same_state(back, state)
    # A key still draws the same numbers after the round trip.
    np.testing.assert_array_equal(
        jax.random.normal(back["rngs"]["key"], (3,)), jax.random.normal(key, (3,))
    )
