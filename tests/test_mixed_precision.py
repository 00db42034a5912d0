"""MixedPrecisionPolicy: gather dtype, reduce dtype, fp32 master weights, input/output casts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import mlp_loss, mlp_params, mlp_sharded_loss
from _util import mlp_batch
from conftest import mesh_for

import funshard as fs

BF16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def test_policy_normalises_dtypes_and_is_hashable():
    policy = fs.MixedPrecisionPolicy(param_dtype="bfloat16", reduce_dtype=np.float32)
    assert policy.param_dtype == jnp.bfloat16 and policy.reduce_dtype == np.float32
    assert hash(policy) == hash(fs.MixedPrecisionPolicy(jnp.bfloat16, jnp.float32))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.param_dtype = jnp.float16  # frozen


@pytest.mark.parametrize("units", [False, True])
def test_bf16_gradients_close_to_reference_and_master_weights_stay_f32(units):
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"), mp_policy=BF16)
    loss, grads = jax.jit(fs.value_and_grad(mlp_sharded_loss(units)))(state, mlp_batch())
    bf16_params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    ref_loss, _ = jax.value_and_grad(mlp_loss)(bf16_params, mlp_batch())
    _, f32_grads = jax.value_and_grad(mlp_loss)(params, mlp_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for g, ref, s in zip(
        jax.tree.leaves(fs.unshard(grads)),
        jax.tree.leaves(f32_grads),
        jax.tree.leaves(state),
        strict=True,
    ):
        assert g.dtype == jnp.float32 == s.dtype
        np.testing.assert_allclose(g, ref, atol=3e-2, rtol=5e-2)


def test_gathered_params_and_inputs_in_param_dtype_outputs_in_output_dtype():
    seen = {}

    def unit_fn(p, x):
        seen["w"], seen["x"] = p["w"].dtype, x.dtype
        return x @ p["w"]

    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, output_dtype=jnp.float16)
    state = fs.shard({"w": jnp.ones((4, 3))}, mesh_for("4"), mp_policy=policy)
    unit = fs.fully_shard(unit_fn)

    def loss(state, x):
        out = unit(state, x)
        seen["out"] = out.dtype
        return jnp.mean(out.astype(jnp.float32))

    jax.jit(fs.value_and_grad(loss))(state, jnp.ones((8, 4)))
    assert seen == {"w": jnp.bfloat16, "x": jnp.bfloat16, "out": jnp.float16}


def test_cast_forward_inputs_false_keeps_input_dtype():
    seen = {}

    def unit_fn(p, x):
        seen["x"] = x.dtype
        return x @ p["w"].astype(x.dtype)

    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, cast_forward_inputs=False)
    state = fs.shard({"w": jnp.ones((4, 3))}, mesh_for("4"), mp_policy=policy)
    fs.fully_shard(unit_fn)(state, jnp.ones((2, 4)))  # outside a step: eval
    assert seen["x"] == jnp.float32


def test_adamw_on_bf16_policy_keeps_f32_optimizer_state():
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("2x4"), mp_policy=BF16)
    opt = optax.adamw(1e-2)
    opt_state = opt.init(state)

    @jax.jit  # one program: eagerly, each of adamw's operations compiles per leaf shape
    def train_step(state, opt_state, batch):
        grads = fs.grad(mlp_sharded_loss(True))(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    state, opt_state = train_step(state, opt_state, mlp_batch())
    assert all(
        leaf.dtype == jnp.float32
        for leaf in jax.tree.leaves((state, opt_state))
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    )
