"""Resuming training from a checkpoint with the documented recipe, on 8 and on 4 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

pytestmark = pytest.mark.slow

OPT = optax.adamw(1e-2, weight_decay=0.1)
SAVED_STEPS = 2


def _params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {
        "w1": jax.random.normal(keys[0], (13, 6)) / 4,  # 13 rows: padded on 8 and 4
        "b1": jnp.zeros((6,)),
        "w2": jax.random.normal(keys[1], (6, 3)) / 3,
        "scale": jnp.float32(1.5),  # 0-d: replicated, not Sharded
    }


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] * params["scale"] - batch["y"]) ** 2)


def _batch(step):
    kx, ky = jax.random.split(jax.random.key(100 + step))
    return {"x": jax.random.normal(kx, (16, 13)), "y": jax.random.normal(ky, (16, 3))}


def _make_step():
    """A fresh jitted training step, as the README writes it (its own compile cache)."""

    def loss_fn(state, batch):
        return _loss(fs.unshard(state), batch)

    @jax.jit
    def train_step(state, opt_state, batch):
        loss, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = OPT.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    return train_step


def _logical(tree):
    return {k: np.asarray(v) for k, v in fs.state_dict(tree).items()}


def _assert_bit_identical(got, want):
    got, want = _logical(got), _logical(want)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(
            got[key].reshape(-1).view(np.uint8), want[key].reshape(-1).view(np.uint8), err_msg=key
        )


def _placements(tree):
    """Each leaf's sharding (a `Sharded` leaf's is that of its data)."""
    return [x.sharding for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Trains SAVED_STEPS steps on 8 devices, saves, and goes on one step uninterrupted."""
    train_step = _make_step()
    state = fs.shard(_params(), mesh_for("8"))
    opt_state = fs.init_optimizer(OPT, state)
    for step in range(SAVED_STEPS):
        state, opt_state, _ = train_step(state, opt_state, _batch(step))
    path = tmp_path_factory.mktemp("resume") / f"step_{SAVED_STEPS}"
    fs.save(path, {"params": state, "opt": opt_state, "step": SAVED_STEPS})
    state, opt_state, loss = train_step(state, opt_state, _batch(SAVED_STEPS))
    return {
        "path": path,
        "state": state,
        "opt": opt_state,
        "loss": loss,
        "compiles": train_step._cache_size(),
    }


def test_uninterrupted_run_matches_single_device_jax(run):
    # The reference the resumed runs are compared with is itself checked against plain
    # JAX on the unsharded parameters.
    params = _params()
    opt_state = OPT.init(params)
    for step in range(SAVED_STEPS + 1):
        loss, grads = jax.value_and_grad(_loss)(params, _batch(step))
        updates, opt_state = OPT.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(run["loss"], loss, rtol=1e-5)
    for key, value in fs.unshard(run["state"]).items():
        np.testing.assert_allclose(value, params[key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_init_optimizer_compiles_the_step_once(run):
    assert run["compiles"] == 1  # initial state, then the state the step returned
    mesh = mesh_for("8")
    state = fs.shard(_params(), mesh)
    opt_state = fs.init_optimizer(OPT, state)
    adam = opt_state[0]
    assert adam.count.sharding == NamedSharding(mesh, P())
    assert isinstance(adam.mu["w1"], fs.Sharded) and adam.mu["w1"].sharding.mesh == mesh
    assert adam.mu["w1"].data.sharding == state["w1"].data.sharding
    # Same values and layout as optax's own init, only placed on the mesh.
    plain = OPT.init(state)
    assert jax.tree.structure(plain) == jax.tree.structure(opt_state)
    for got, want in zip(jax.tree.leaves(opt_state), jax.tree.leaves(plain), strict=True):
        np.testing.assert_array_equal(got, want)


def test_init_optimizer_needs_a_sharded_state():
    with pytest.raises(ValueError, match="no fs.Sharded leaves.*fs.shard"):
        fs.init_optimizer(OPT, {"w": jnp.ones(3)})


@pytest.mark.parametrize("init", ["opt.init", "fs.init_optimizer"])
@pytest.mark.parametrize("mesh_name", ["8", "4"])
def test_documented_resume_recipe(run, mesh_name, init):
    mesh = mesh_for(mesh_name)
    assert mesh.devices.size == int(mesh_name)
    initialise = OPT.init if init == "opt.init" else lambda s: fs.init_optimizer(OPT, s)
    train_step = _make_step()
    # A fresh start on this mesh compiles the step ...
    start = fs.shard(_params(), mesh)
    train_step(start, fs.init_optimizer(OPT, start), _batch(0))

    # ... and the documented recipe (docs/distributed.md) resumes with the same program.
    state = fs.shard(_params(), mesh)
    like = {"params": state, "opt": initialise(state), "step": 0}
    tree = fs.restore(run["path"], like)
    assert tree["step"] == SAVED_STEPS
    assert tree["opt"][0].count.sharding == NamedSharding(mesh, P())
    assert tree["params"]["scale"].sharding == NamedSharding(mesh, P())
    state, opt_state, loss = train_step(tree["params"], tree["opt"], _batch(SAVED_STEPS))
    train_step(state, opt_state, _batch(SAVED_STEPS + 1))
    assert train_step._cache_size() == 1

    resumed = {"params": state, "opt": opt_state}
    reference = {"params": run["state"], "opt": run["opt"]}
    if mesh_name == "8":
        # Same mesh, same program: nothing may differ from the uninterrupted run.
        _assert_bit_identical(resumed, reference)
        assert float(loss) == float(run["loss"])
    else:
        # Four devices sum the gradient in another order: equal up to rounding.
        got, want = _logical(resumed), _logical(reference)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
        np.testing.assert_allclose(loss, run["loss"], rtol=1e-6)
        assert state["w1"].mesh == mesh


def _abstract(tree, with_sharding=True):
    """`tree` with every array (a `Sharded` leaf's data too) turned into a ShapeDtypeStruct."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=x.sharding if with_sharding else None
        ),
        tree,
    )


ABSTRACT_LIKES = {
    "with shardings": lambda s: {"params": _abstract(s), "opt": _abstract(OPT.init(s)), "step": 0},
    "without shardings": lambda s: {
        "params": _abstract(s, False),
        "opt": _abstract(OPT.init(s), False),
        "step": 0,
    },
    "jax.eval_shape": lambda s: jax.eval_shape(
        lambda s: {"params": s, "opt": OPT.init(s), "step": 0}, s
    ),
    "fs.init_optimizer": lambda s: {
        "params": _abstract(s),
        "opt": fs.init_optimizer(OPT, _abstract(s)),
        "step": 0,
    },
}


@pytest.mark.parametrize("kind", list(ABSTRACT_LIKES))
@pytest.mark.parametrize("mesh_name", ["8", "4"])
def test_restore_into_abstract_like_matches_concrete(run, mesh_name, kind):
    state = fs.shard(_params(), mesh_for(mesh_name))
    concrete = fs.restore(run["path"], {"params": state, "opt": OPT.init(state), "step": 0})
    like = ABSTRACT_LIKES[kind](state)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(like["params"]))
    tree = fs.restore(run["path"], like)
    assert int(tree["step"]) == SAVED_STEPS
    tree["step"] = concrete["step"]
    assert jax.tree.structure(tree) == jax.tree.structure(concrete)
    arrays = [tree["params"], tree["opt"]]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(arrays))
    _assert_bit_identical(tree, concrete)
    assert _placements(arrays) == _placements([concrete["params"], concrete["opt"]])
    # The step accepts it as it is: one program for both.
    train_step = _make_step()
    for restored in (concrete, tree):
        train_step(restored["params"], restored["opt"], _batch(SAVED_STEPS))
    assert train_step._cache_size() == 1


def test_abstract_leaves_without_a_mesh_are_all_named(tmp_path):
    fs.save(tmp_path / "plain", {"count": jnp.int32(3), "mu": jnp.arange(2.0)})
    like = {
        "count": jax.ShapeDtypeStruct((), jnp.int32),
        "mu": jax.ShapeDtypeStruct((2,), jnp.float32),
    }
    with pytest.raises(ValueError, match=r"without a sharding.*\n  \['count'\]\n  \['mu'\]\n"):
        fs.restore(tmp_path / "plain", like)
    # With no Sharded leaf there is no state mesh: a given sharding is kept.
    replicated = NamedSharding(mesh_for("4"), P())
    like = {"count": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), "mu": jnp.zeros(2)}
    tree = fs.restore(tmp_path / "plain", like)
    assert int(tree["count"]) == 3 and tree["count"].sharding == replicated
    np.testing.assert_array_equal(tree["mu"], [0.0, 1.0])


def test_saving_an_abstract_tree_names_the_leaf(tmp_path):
    state = _abstract(fs.shard(_params(), mesh_for("8")))
    with pytest.raises(ValueError, match=r"save: leaf \['b1'\] is abstract"):
        fs.save(tmp_path / "abstract", state)
    assert not (tmp_path / "abstract").exists()
