"""JAX's own meshes: every public entry point on `jax.make_mesh` meshes, against plain JAX.

`jax.make_mesh` gives `Explicit` axes (an array's type carries its sharding, and
`jax.shard_map` refuses inputs typed otherwise); `fs.make_mesh` gives `Auto` axes. Each
case runs on both kinds, 1-D and HSDP, and compares with plain JAX on the unsharded
parameters and the global batch, or with the same call on an `fs.make_mesh` mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import collectives
from _util import assert_tree_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

pytestmark = pytest.mark.slow

KINDS = {
    "explicit-8": ((8,), ("fsdp",), AxisType.Explicit),
    "explicit-2x4": ((2, 4), ("replicate", "fsdp"), AxisType.Explicit),
    "auto-8": ((8,), ("fsdp",), AxisType.Auto),
}


def jax_mesh(kind: str, devices=None):
    shape, names, axis_type = KINDS[kind]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=devices)


def dp_spec(mesh) -> P:
    names = mesh.axis_names
    return P(names if len(names) > 1 else names[0])


def params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (13, 6)) * 0.3,  # uneven: 13 rows on 8 / 4 devices
        "b1": jnp.arange(6.0) / 10,
        "w2": jax.random.normal(k2, (6, 3)) * 0.3,
        "scale": jnp.float32(1.5),  # 0-d: replicated
    }


def ref_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2) * p["scale"]


def loss(state, batch):
    return ref_loss(fs.unshard(state), batch)


def unit_loss(state, batch):
    def layer(p, x):
        return jnp.tanh(x @ p["w1"] + p["b1"])

    h = fs.fully_shard(layer)({"w1": state["w1"], "b1": state["b1"]}, batch["x"])
    w2 = fs.unshard(state["w2"])
    return jnp.mean((h @ w2 - batch["y"]) ** 2) * state["scale"]


def make_batch(rows=32):
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (rows, 13)), "y": jax.random.normal(ky, (rows, 3))}


def check_step(step, state, batch, p, global_batch):
    value, grads = step(state, batch)
    ref_value, ref_grads = jax.value_and_grad(ref_loss)(p, global_batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(state), strict=True):
        assert g.sharding.is_equivalent_to(s.sharding, g.ndim)


def batch_forms(mesh, batch):
    """The ways a user hands the step a batch on `mesh`."""
    dp = NamedSharding(mesh, dp_spec(mesh))
    return {
        "host": jax.tree.map(np.asarray, batch),
        "device": batch,
        "sharded": jax.device_put(batch, dp),
        "replicated": jax.device_put(batch, NamedSharding(mesh, P())),
        "one-axis": jax.device_put(batch, NamedSharding(mesh, P("fsdp"))),
        "shard_batch": fs.distributed.shard_batch(jax.tree.map(np.asarray, batch), mesh),
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_shard_unshard_reshard_round_trip(kind):
    mesh, p = jax_mesh(kind), params()
    state = fs.shard(p, mesh)
    assert_tree_close(fs.unshard(state), p, atol=0)
    assert_tree_close(jax.jit(fs.unshard)(state), p, atol=0)
    again = fs.reshard(fs.unshard(state), state)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    # Under jit too, where placing is an annotation (reshard on Explicit axes; JAX asks
    # for the mesh to be set around a jit whose inputs live on one device).
    with jax.set_mesh(mesh):
        jitted = jax.jit(lambda q: fs.shard(q, mesh))(p)
    assert_tree_close(fs.unshard(jitted), p, atol=0)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "form", ["host", "device", "sharded", "replicated", "one-axis", "shard_batch"]
)
def test_step_takes_every_batch_form(kind, form):
    mesh, p, batch = jax_mesh(kind), params(), make_batch()
    state = fs.shard(p, mesh)
    step = jax.jit(fs.value_and_grad(loss))
    check_step(step, state, batch_forms(mesh, batch)[form], p, batch)


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_step_eager_units_microbatches_and_set_mesh(kind):
    mesh, p, batch = jax_mesh(kind), params(), make_batch()
    state = fs.shard(p, mesh)
    check_step(fs.value_and_grad(loss), state, batch, p, batch)  # not jitted
    check_step(jax.jit(fs.value_and_grad(unit_loss)), state, batch, p, batch)
    check_step(jax.jit(fs.value_and_grad(loss, microbatches=2)), state, batch, p, batch)
    with jax.set_mesh(mesh):
        placed = jax.tree.map(jnp.asarray, jax.tree.map(np.asarray, batch))
        check_step(jax.jit(fs.value_and_grad(unit_loss)), state, placed, p, batch)


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_reshard_in_user_code(kind):
    """`jax.sharding.reshard` of the batch inside the user's jitted function."""
    mesh, p, batch = jax_mesh(kind), params(), make_batch()
    state = fs.shard(p, mesh)

    @jax.jit
    def step(state, batch):
        batch = jax.sharding.reshard(batch, NamedSharding(mesh, P("fsdp")))
        return fs.value_and_grad(loss)(state, batch)

    check_step(step, state, batch, p, batch)


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_same_collectives_as_on_an_auto_mesh(kind):
    """Placing the inputs adds no collective: the compiled step moves what it moved on
    `fs.make_mesh`'s mesh (the batch arrives sharded; a replicated one is sliced locally)."""
    p, batch = params(), make_batch()
    mesh = jax_mesh(kind)
    auto = fs.make_mesh(2 if "2x4" in kind else None)

    def kinds(mesh, batch):
        state = fs.shard(p, mesh)
        text = jax.jit(fs.value_and_grad(unit_loss)).lower(state, batch).compile().as_text()
        return sorted((c["kind"], c["dtype"], c["elements"]) for c in collectives(text))

    expected = kinds(auto, batch)
    assert expected  # the unit's gather and reduce-scatter at least
    assert kinds(mesh, batch) == expected
    assert kinds(mesh, jax.device_put(batch, NamedSharding(mesh, P()))) == expected


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_scan_and_lax_scan(kind):
    mesh = jax_mesh(kind)
    stack = {"w": jax.random.normal(jax.random.key(2), (3, 13, 13)) * 0.3}
    batch = make_batch()
    state = fs.shard(stack, mesh, stacked=True)

    def layer(h, q):
        return jnp.tanh(h @ q["w"]), None

    def ref(q, batch):
        return jnp.mean(jax.lax.scan(layer, batch["x"], q)[0] ** 2)

    def with_lax_scan(s, batch):
        return jnp.mean(fs.lax_scan(layer, batch["x"], s)[0] ** 2)

    def with_scan(s, batch):
        return jnp.mean(fs.scan(lambda q, h: layer(h, q)[0], s, batch["x"]) ** 2)

    ref_value, ref_grads = jax.value_and_grad(ref)(stack, batch)
    for fn in (with_lax_scan, with_scan):
        value, grads = jax.jit(fs.value_and_grad(fn))(state, batch)
        np.testing.assert_allclose(value, ref_value, rtol=1e-6)
        assert_tree_close(fs.unshard(grads), ref_grads)


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_optimizers_match_optax(kind):
    mesh, p, batch = jax_mesh(kind), params(), make_batch()
    state = fs.shard(p, mesh)
    _, ref_grads = jax.value_and_grad(ref_loss)(p, batch)
    ref_opt = optax.adamw(1e-2)
    ref_updates, _ = ref_opt.update(ref_grads, ref_opt.init(p), p)
    expected = optax.apply_updates(p, ref_updates)

    _, grads = jax.jit(fs.value_and_grad(loss))(state, batch)
    wrapped = fs.shard_optimizer(optax.adamw(1e-2))
    opt_state = wrapped.init(state)
    # A jitted init makes arrays from shapes alone: on Explicit axes JAX itself (plain
    # optax too) asks for the mesh to be set around it.
    with jax.set_mesh(mesh):
        jitted_state = jax.jit(wrapped.init)(state)
    assert_tree_close(jitted_state, opt_state, atol=0)
    updates, _ = jax.jit(wrapped.update)(grads, opt_state, state)
    assert_tree_close(fs.unshard(optax.apply_updates(state, updates)), expected)

    plain = optax.adamw(1e-2)
    opt_state = fs.init_optimizer(plain, state)
    updates, _ = jax.jit(plain.update)(grads, opt_state, state)
    assert_tree_close(fs.unshard(optax.apply_updates(state, updates)), expected)


def test_state_dict_checkpoint_and_plan(tmp_path):
    mesh, p = jax_mesh("explicit-2x4"), params()
    state = fs.shard(p, mesh)
    sd = fs.state_dict(state)
    for path, value in jax.tree_util.tree_flatten_with_path(p)[0]:
        np.testing.assert_array_equal(sd[jax.tree_util.keystr(path)], value)
    assert_tree_close(fs.unshard(fs.load_state_dict(sd, state)), p, atol=0)
    # Saved from the 2x4 explicit mesh, restored onto 4 devices of another explicit mesh.
    fs.save(tmp_path / "ckpt", state)
    smaller = jax_mesh("explicit-8").devices.flat[:4]
    like = fs.shard(p, jax.make_mesh((4,), ("fsdp",), devices=list(smaller)))
    restored = fs.restore(tmp_path / "ckpt", like)
    assert_tree_close(fs.unshard(restored), p, atol=0)
    # The plan of the state on JAX's mesh is the plan on fs.make_mesh's.
    planned, expected = fs.plan(state), fs.plan(fs.shard(p, fs.make_mesh(2)))
    assert planned.mesh_shape == (("replicate", 2), ("fsdp", 4))
    assert (planned.num_shards, planned.num_replicas) == (4, 2)
    assert planned.collectives == expected.collectives
    assert planned.params == expected.params


@pytest.mark.parametrize("kind", ["explicit-8", "explicit-2x4"])
def test_a_unit_outside_the_step_under_auto_axes(kind):
    """Evaluation as JAX asks for it on Explicit axes (`jax.sharding.auto_axes`): the
    unit's gather runs on the mesh with the context's axis types."""
    mesh, p, batch = jax_mesh(kind), params(), make_batch()
    state = fs.shard(p, mesh)
    evaluate = jax.sharding.auto_axes(unit_loss, out_sharding=P())

    @jax.jit
    def run(state, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return evaluate(state, batch)

    sharded = jax.device_put(batch, NamedSharding(mesh, dp_spec(mesh)))
    np.testing.assert_allclose(run(state, sharded), ref_loss(p, batch), rtol=1e-6)
    # Plain jit outside any context: the unit gathers eagerly-placed parameters too.
    np.testing.assert_allclose(jax.jit(unit_loss)(state, batch), ref_loss(p, batch), rtol=1e-6)
