"""Units and collectives under control flow: a predicate that differs between devices is
a clear error at trace time; a predicate equal on every device gives plain JAX's numbers.

Inside the root each device runs the loss on its own rows, so a `lax.cond` on the batch
would send devices into different branches and pair one unit's all-gather with
another's (issue: silent wrong numbers, third sweep, item 1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funshard as fs
from funshard import errors
from tests._models import mlp_layer, mse
from tests._util import assert_tree_close
from tests.conftest import mesh_for


def _params():
    keys = jax.random.split(jax.random.key(3), 2)
    return {
        name: {"w": jax.random.normal(k, (6, 6)) / 3.0, "b": jnp.full((6,), 0.1 * i)}
        for i, (name, k) in enumerate(zip(("a", "b"), keys, strict=True))
    }


def _batch():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype(np.float32)
    # Rows 0, 2, 4, ...: device 0's first row is positive, device 1's negative, and so on.
    x[::2, 0] = np.where(np.arange(8) % 2 == 0, 1.0, -1.0)
    return {"x": x, "y": rng.normal(size=(16, 6)).astype(np.float32)}


UA = fs.fully_shard(mlp_layer, name="unit_a")
UB = fs.fully_shard(mlp_layer, name="unit_b")


def _cond_loss(s, b):
    out = jax.lax.cond(b["x"][0, 0] > 0, lambda: UA(s["a"], b["x"]), lambda: UB(s["b"], b["x"]))
    return mse(out, b["y"])


def _switch_loss(s, b):
    index = (b["x"][0, 0] > 0).astype(jnp.int32)
    out = jax.lax.switch(index, [lambda: UA(s["a"], b["x"]), lambda: UB(s["b"], b["x"])])
    return mse(out, b["y"])


def _while_loss(s, b):
    # The trip count reads this device's rows: 1 on some devices, 2 on others.
    # (Reverse mode cannot differentiate a while loop: unit_a is a frozen feature
    # extractor here, unit_b trains on its output.)
    trips = jnp.where(b["x"][0, 0] > 0, 2, 1)
    frozen = jax.lax.stop_gradient(s["a"])

    def body(carry):
        i, h = carry
        return i + 1, UA(frozen, h)

    h = jax.lax.while_loop(lambda c: c[0] < trips, body, (0, b["x"]))[1]
    return mse(UB(s["b"], h), b["y"])


def _psum_loss(s, b):
    p = fs.unshard(s)
    h = mlp_layer(p["a"], b["x"])
    # The user's own collective under a batch-dependent predicate.
    total = jax.lax.cond(
        b["x"][0, 0] > 0,
        lambda: jax.lax.psum(jnp.sum(h), "fsdp"),
        lambda: jax.lax.psum(jnp.sum(h), "fsdp") * 2.0,
    )
    return mse(h, b["y"]) + 0.0 * total


@pytest.mark.parametrize(
    "loss, what",
    [
        (_cond_loss, "unit 'unit_b', 'unit_a'"),
        (_switch_loss, "unit 'unit_a', 'unit_b'"),
        (_while_loss, "unit 'unit_a'"),
        (_psum_loss, "a psum over ['fsdp']"),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_collective_under_a_varying_predicate_is_an_error(loss, what, jit):
    state = fs.shard(_params(), mesh_for("8"))
    step = fs.value_and_grad(loss)
    with pytest.raises(errors.ShardingValueError) as info:
        (jax.jit(step) if jit else step)(state, _batch())
    message = str(info.value)
    assert what in message
    assert "differs between devices" in message and "'fsdp'" in message
    assert "test_control_flow.py" in message  # the user's line of the control flow
    assert "jax.lax.pmax" in message


def test_varying_predicate_over_the_replicate_axis_is_an_error_on_hsdp():
    # On 2x4 the unit's all-gather runs over 'fsdp' only, but its gradient is all-reduced
    # over 'replicate', where the predicate differs too.
    state = fs.shard(_params(), mesh_for("2x4"))
    with pytest.raises(errors.ShardingValueError, match="differs between devices"):
        jax.jit(fs.value_and_grad(_cond_loss))(state, _batch())


def _global_first_positive(x, world):
    """The predicate `pmax` gives: is any device's first row positive (plain JAX)."""
    return jnp.max(x.reshape(world, -1, x.shape[1])[:, 0, 0]) > 0


@pytest.mark.parametrize("mesh", ["8", "2x4"])
def test_predicate_reduced_over_the_data_axes_matches_plain_jax(mesh):
    mesh_ = mesh_for(mesh)
    axes = tuple(mesh_.axis_names)

    def loss(s, b):
        pred = jax.lax.pmax(b["x"][0, 0], axes) > 0
        out = jax.lax.cond(pred, lambda: UA(s["a"], b["x"]), lambda: UB(s["b"], b["x"]))
        return mse(out, b["y"])

    def ref(p, b):
        pred = _global_first_positive(b["x"], 8)
        out = jax.lax.cond(
            pred, lambda: mlp_layer(p["a"], b["x"]), lambda: mlp_layer(p["b"], b["x"])
        )
        return mse(out, b["y"])

    params, batch = _params(), _batch()
    value, grads = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh_), batch)
    ref_value, ref_grads = jax.value_and_grad(ref)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)
    assert float(jnp.abs(fs.unshard(grads)["a"]["w"]).sum()) > 0  # branch a was taken


@pytest.mark.parametrize("flag", [0, 1])
def test_replicated_predicate_and_while_trip_count_match_plain_jax(flag):
    # A predicate and a trip count from a replicated argument are equal on every device.
    # (The while loop's unit is frozen: reverse mode cannot differentiate a while loop.)
    def loss(s, b, f):
        frozen = jax.lax.stop_gradient(s["a"])
        h = jax.lax.fori_loop(0, f + 1, lambda _, h: UA(frozen, h), b["x"])
        out = jax.lax.cond(f > 0, lambda: UA(s["a"], h), lambda: UB(s["b"], h))
        return mse(out, b["y"])

    def ref(p, b, f):
        frozen = jax.lax.stop_gradient(p["a"])
        h = jax.lax.fori_loop(0, f + 1, lambda _, h: mlp_layer(frozen, h), b["x"])
        out = jax.lax.cond(f > 0, lambda: mlp_layer(p["a"], h), lambda: mlp_layer(p["b"], h))
        return mse(out, b["y"])

    params, batch, f = _params(), _batch(), jnp.int32(flag)
    value, grads = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh_for("8")), batch, f)
    ref_value, ref_grads = jax.value_and_grad(ref)(params, batch, f)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)


def test_varying_predicate_without_collectives_inside_is_allowed():
    # Per-device control flow that only computes locally is the user's own business:
    # both units run outside it, so nothing mixes. The reference runs each device's rows.
    def body(pa, pb, x, y):
        h = jax.lax.cond(x[0, 0] > 0, lambda: x * 2.0, lambda: x - 1.0)
        return mse(mlp_layer(pb, mlp_layer(pa, h)), y)

    def loss(s, b):
        return body(fs.unshard(s["a"]), fs.unshard(s["b"]), b["x"], b["y"])

    def ref(p, b):
        xs, ys = b["x"].reshape(8, 2, 6), b["y"].reshape(8, 2, 6)
        return jnp.mean(jax.vmap(lambda x, y: body(p["a"], p["b"], x, y))(xs, ys))

    params, batch = _params(), _batch()
    value, grads = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh_for("8")), batch)
    ref_value, ref_grads = jax.value_and_grad(ref)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)


@pytest.mark.parametrize("mesh", ["8", "2x4"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_predicate_on_a_gathered_parameter_matches_plain_jax(mesh, sign):
    # The all-gather is typed varying (its transpose is the reduce-scatter), but every
    # device holds the same gathered parameter, so the predicate is the same everywhere.
    def loss(s, b):
        pred = jnp.sum(fs.unshard(s["a"])["w"]) * sign > 0
        out = jax.lax.cond(pred, lambda: UA(s["a"], b["x"]), lambda: UB(s["b"], b["x"]))
        return mse(out, b["y"])

    def ref(p, b):
        pred = jnp.sum(p["a"]["w"]) * sign > 0
        out = jax.lax.cond(
            pred, lambda: mlp_layer(p["a"], b["x"]), lambda: mlp_layer(p["b"], b["x"])
        )
        return mse(out, b["y"])

    params, batch = _params(), _batch()
    value, grads = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh_for(mesh)), batch)
    ref_value, ref_grads = jax.value_and_grad(ref)(params, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)
    taken = "a" if float(jnp.sum(params["a"]["w"])) * sign > 0 else "b"
    assert float(jnp.abs(fs.unshard(grads)[taken]["w"]).sum()) > 0


def test_predicate_on_a_gathered_parameter_and_the_batch_is_still_an_error():
    def loss(s, b):
        pred = jnp.sum(fs.unshard(s["a"])["w"]) + b["x"][0, 0] > 0
        out = jax.lax.cond(pred, lambda: UA(s["a"], b["x"]), lambda: UB(s["b"], b["x"]))
        return mse(out, b["y"])

    state = fs.shard(_params(), mesh_for("8"))
    with pytest.raises(errors.ShardingValueError, match="differs between devices"):
        jax.jit(fs.value_and_grad(loss))(state, _batch())
