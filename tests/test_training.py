"""Gradient parity of the sharded root against jax.value_and_grad on the full batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    block_reference,
    block_sharded_loss,
    jitted_block_params,
    jitted_mlp_params,
    mlp_loss,
    mlp_reference,
    mlp_sharded_loss,
)
from _util import assert_tree_close, mlp_batch
from conftest import mesh_for

import funshard as fs

pytestmark = pytest.mark.slow

MESH_NAMES = ["1", "2", "4", "8", "2x4"]
UNIT_MODES = [(False, True), (True, True), (True, False)]  # (units, reshard_after_forward)


@functools.cache
def _tokens(rows=8, t=6, vocab=11):
    return jax.jit(lambda: jax.random.randint(jax.random.key(3), (rows, t), 0, vocab))()


@pytest.mark.parametrize("mesh_name", MESH_NAMES)
@pytest.mark.parametrize("units,reshard", UNIT_MODES)
def test_mlp_grad_parity(mesh_name, units, reshard):
    params = jitted_mlp_params(jax.random.key(0))
    batch = mlp_batch()
    state = fs.shard(params, mesh_for(mesh_name))
    loss, grads = jax.jit(fs.value_and_grad(mlp_sharded_loss(units, reshard)))(state, batch)
    ref_loss, ref_grads = mlp_reference(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(state)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(state), strict=True):
        assert g.sharding.is_equivalent_to(s.sharding, g.ndim) and g.dtype == s.dtype
    assert_tree_close(fs.unshard(grads), ref_grads)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("units,reshard", UNIT_MODES)
def test_transformer_block_grad_parity(mesh_name, units, reshard):
    params = jitted_block_params(jax.random.key(1))
    tokens = _tokens()
    state = fs.shard(params, mesh_for(mesh_name))
    loss, grads = jax.jit(fs.value_and_grad(block_sharded_loss(units, reshard)))(state, tokens)
    ref_loss, ref_grads = block_reference(params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)


def test_has_aux_and_grad():
    params = jitted_mlp_params(jax.random.key(0))
    batch = mlp_batch()
    state = fs.shard(params, mesh_for("8"))

    def loss_with_aux(state, batch):
        loss = mlp_loss(fs.unshard(state), batch)
        rows = jnp.sum(jnp.isfinite(batch[0][:, 0]))  # varies over the devices
        return loss, {"loss": loss, "rows": rows, "local": jnp.int32(batch[0].shape[0])}

    (loss, aux), grads = jax.jit(fs.value_and_grad(loss_with_aux, has_aux=True))(state, batch)
    np.testing.assert_allclose(aux["loss"], loss)
    assert int(aux["rows"]) == 16  # integer aux varying over the devices is summed
    assert int(aux["local"]) == 2  # a value the same on every device is kept as it is
    only_grads = jax.jit(fs.grad(mlp_sharded_loss(False)))(state, batch)
    assert_tree_close(fs.unshard(only_grads), fs.unshard(grads), atol=0, rtol=0)


def test_replicated_extra_args_and_int_leaves():
    params = {"w": jnp.arange(12.0).reshape(4, 3) / 10, "step": jnp.arange(3, dtype=jnp.int32)}
    state = fs.shard(params, mesh_for("4"))
    x = jnp.linspace(-1, 1, 8 * 4).reshape(8, 4)

    def loss(state, x, scale):
        return jnp.mean((x @ fs.unshard(state)["w"]) ** 2) * scale

    trainable = {"w": True, "step": False}
    _value, grads = jax.jit(fs.value_and_grad(loss, trainable=trainable))(state, x, 3.0)
    ref = jax.jit(jax.grad(lambda w, x: jnp.mean((x @ w) ** 2) * 3.0))(params["w"], x)
    np.testing.assert_allclose(fs.unshard(grads)["w"], ref, rtol=1e-6)
    np.testing.assert_array_equal(fs.unshard(grads)["step"], np.zeros(3, np.int32))


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_adamw_trajectory_matches_unsharded(mesh_name):
    params = jitted_mlp_params(jax.random.key(0))
    opt = optax.adamw(1e-2, weight_decay=0.1)
    state = fs.shard(params, mesh_for(mesh_name))
    opt_state = opt.init(state)
    ref_params, ref_opt_state = params, opt.init(params)

    @jax.jit
    def step(state, opt_state, batch):
        loss, grads = fs.value_and_grad(mlp_sharded_loss(True))(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    @jax.jit
    def ref_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for i in range(20):
        batch = jax.tree.map(lambda a, i=i: a * (1 + 0.05 * i), mlp_batch())
        state, opt_state, loss = step(state, opt_state, batch)
        ref_params, ref_opt_state, ref_loss = ref_step(ref_params, ref_opt_state, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_tree_close(fs.unshard(state), ref_params, atol=1e-5)


def test_optimizer_state_sharded_and_padding_stays_zero():
    # 13 rows over 8 devices: 2 rows each, 3 padding rows.
    params = jitted_mlp_params(jax.random.key(0))
    opt = optax.adamw(1e-1, weight_decay=0.5)
    state = fs.shard(params, mesh_for("8"))
    opt_state = opt.init(state)
    grads_fn = jax.jit(fs.grad(mlp_sharded_loss(True)))
    for _ in range(30):
        grads = grads_fn(state, mlp_batch())
        updates, opt_state = opt.update(grads, opt_state, state)
        state = optax.apply_updates(state, updates)
    w0 = state["layers"][0]["w"]
    assert w0.shape == (13, 32) and w0.data.shape == (16, 32)
    np.testing.assert_array_equal(np.asarray(w0.data)[13:], 0)
    mu = opt_state[0].mu["layers"][0]["w"]
    assert isinstance(mu, fs.Sharded)
    np.testing.assert_array_equal(np.asarray(mu.data)[13:], 0)
    for leaf in jax.tree.leaves(opt_state):
        if leaf.ndim >= 1:
            shard = leaf.addressable_shards[0].data
            assert shard.nbytes * 8 == leaf.nbytes  # 1/N of the bytes on each device


def test_optimizer_scalars_placed_on_the_mesh_compile_the_step_once():
    """optax creates scalar state (the step count) on the default device, while the
    step returns it replicated on the mesh, so the second step compiles another program.
    The workaround in docs/training.md places those scalars on the mesh up front."""
    mesh = mesh_for("8")
    state = fs.shard(jitted_mlp_params(jax.random.key(0)), mesh)
    opt = optax.adamw(1e-2)

    def programs_for_two_steps(opt_state):
        @jax.jit
        def step(state, opt_state, batch):
            grads = fs.grad(mlp_sharded_loss(True))(state, batch)
            updates, opt_state = opt.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state

        s, o = step(state, opt_state, mlp_batch())
        step(s, o, mlp_batch())
        return step._cache_size()

    assert programs_for_two_steps(opt.init(state)) == 2
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(
        lambda x: x if isinstance(x, fs.Sharded) else jax.device_put(x, replicated),
        opt.init(state),
        is_leaf=lambda x: isinstance(x, fs.Sharded),
    )
    assert programs_for_two_steps(opt_state) == 1
    mu = opt_state[0].mu["layers"][0]["w"]
    assert mu.data.sharding == state["layers"][0]["w"].data.sharding


def test_optimizer_state_of_weakly_typed_leaves_is_sharded():
    """`jnp.full(n, 0.1)` is weakly typed, and `jnp.zeros_like` drops the sharding of
    weakly typed arrays: opt.init would put such a leaf's state on one device, whole."""
    params = {"g": jnp.full((32,), 0.1), "w": jnp.ones((16, 4))}
    assert params["g"].weak_type
    state = fs.shard(params, mesh_for("8"))
    opt_state = optax.adam(1e-3).init(state)
    for name in params:
        mu = opt_state[0].mu[name]
        assert mu.data.sharding == state[name].data.sharding, name
        assert mu.data.addressable_shards[0].data.nbytes * 8 == mu.data.nbytes
    np.testing.assert_array_equal(fs.unshard(state)["g"], params["g"])
