"""Mistakes and compositions that used to fail with someone else's obscure error.

Each case either works exactly as plain JAX / Flax does on the unsharded parameters
(compared with that reference), or raises a typed funshard error whose message names
the function, the leaf or unit, and the fix.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_for

import funshard as fs
from funshard import errors


def _params(key=0, rows=10):
    k = jax.random.split(jax.random.key(key), 2)
    return {"w1": jax.random.normal(k[0], (rows, 4)), "w2": jax.random.normal(k[1], (3, rows))}


def _plain_loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"].T) @ p["w2"].T) ** 2)


def _assert_close(got, want):
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        )


# ---- fs.shard inside the loss function --------------------------------------------------


def test_shard_inside_the_loss_function_is_a_clear_error():
    mesh = mesh_for("8")
    state = fs.shard(_params(), mesh)

    def loss(state, x):
        again = fs.shard(fs.unshard(state), mesh)  # already inside the step's shard_map
        return _plain_loss(fs.unshard(again), x)

    with pytest.raises(errors.ShardingValueError) as info:
        fs.value_and_grad(loss)(state, jnp.ones((8, 4)))
    msg = str(info.value)
    assert msg.startswith("shard: called inside a funshard step")
    assert "state = fs.shard(params, mesh)" in msg and "fs.reshard(full, like)" in msg
    # fs.reshard is the in-step way (jitted: one compile, where eager compiles each op),
    # and fs.shard under a plain jit still works.
    ok = fs.value_and_grad(lambda s, x: _plain_loss(fs.unshard(fs.reshard(fs.unshard(s), s)), x))
    loss, grads = jax.jit(ok)(state, jnp.ones((8, 4)))
    want_loss, want = jax.value_and_grad(_plain_loss)(_params(), jnp.ones((8, 4)))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)
    jitted = jax.jit(lambda p: fs.shard(p, mesh))(_params())
    _assert_close(fs.unshard(jitted), _params())


# ---- a unit called with its parameters as a keyword argument ----------------------------


def _layer(params, x, *, scale=1.0):
    return jnp.tanh(x @ params["w1"].T) * scale


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_unit_takes_its_params_and_arguments_by_keyword(reshard_after_forward):
    params, x = _params(), jax.random.normal(jax.random.key(5), (16, 4))
    state = fs.shard(params, mesh_for("8"))
    unit = fs.fully_shard(_layer, reshard_after_forward=reshard_after_forward)

    def loss(state, x):
        h = unit(params={"w1": state["w1"]}, x=x, scale=2.0)
        return jnp.mean((h @ fs.unshard(state["w2"]).T) ** 2)

    def plain(p, x):
        return jnp.mean((_layer(params={"w1": p["w1"]}, x=x, scale=2.0) @ p["w2"].T) ** 2)

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, x)
    want_loss, want = jax.value_and_grad(plain)(params, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)
    # Outside a step (evaluation), and with mixed positional / keyword arguments.
    _assert_close(unit(params={"w1": state["w1"]}, x=x), _layer({"w1": params["w1"]}, x))
    _assert_close(
        unit({"w1": state["w1"]}, x, scale=3.0), _layer({"w1": params["w1"]}, x, scale=3.0)
    )


def test_unit_called_without_its_params_names_the_unit():
    unit = fs.fully_shard(_layer)
    with pytest.raises(
        errors.ShardingTypeError,
        match=r"unit '_layer' was called without its parameters.*params=\.\.\.",
    ):
        unit(x=jnp.ones((2, 4)))


# ---- float8 as the policy's dtype ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_float8_policy_is_refused_at_construction(field, dtype):
    with pytest.raises(errors.ShardingValueError) as info:
        fs.MixedPrecisionPolicy(**{field: dtype})
    msg = str(info.value)
    assert msg.startswith(f"MixedPrecisionPolicy: {field}={np.dtype(dtype).name} is an 8-bit")
    assert "per-tensor scales" in msg and "jnp.bfloat16" in msg
    # Why: the unscaled cast the policy would run turns 1000.0 into NaN (e4m3fn).
    if dtype is jnp.float8_e4m3fn:
        assert np.isnan(np.asarray(jnp.float32(1000.0).astype(dtype), np.float32))


# ---- jax.vmap over a whole step -----------------------------------------------------------


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_vmap_over_the_step_matches_plain_jax_per_batch(mesh_name):
    params = _params()
    xs = jax.random.normal(jax.random.key(3), (3, 16, 4))
    state = fs.shard(params, mesh_for(mesh_name))
    first = fs.fully_shard(lambda p, x: jnp.tanh(x @ p["w1"].T))

    def loss(state, x):
        return jnp.mean((first({"w1": state["w1"]}, x) @ fs.unshard(state["w2"]).T) ** 2)

    losses, grads = jax.jit(jax.vmap(fs.value_and_grad(loss), in_axes=(None, 0)))(state, xs)
    want_losses, want = jax.vmap(jax.value_and_grad(_plain_loss), in_axes=(None, 0))(params, xs)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)  # the stack of full gradients, (3, *shape)
    for k in range(3):  # and batch k's gradients as a state
        _assert_close(
            fs.unshard(jax.tree.map(lambda g, k=k: g[k], grads)),
            jax.tree.map(lambda g, k=k: g[k], want),
        )


def test_string_leaf_reaching_the_optimizer_is_named():
    # A string passes through fs.shard and the step, but optax failed deep inside with
    # "data type 'mlp' not understood"; plain optax fails on it too.
    import optax

    state = fs.shard({"w": jnp.ones((8, 4)), "name": "mlp"}, mesh_for("8"))
    with pytest.raises(TypeError):
        optax.adamw(1e-3).init({"w": jnp.ones((8, 4)), "name": "mlp"})
    with pytest.raises(errors.ShardingTypeError) as info:
        fs.init_optimizer(optax.adamw(1e-3), state)
    assert "['name']: str" in str(info.value)
    assert "extra argument" in str(info.value)
    state = fs.shard({"w": jnp.ones((8, 4)), "lr_scale": 0.5, "none": None}, mesh_for("8"))
    fs.init_optimizer(optax.adamw(1e-3), state)  # Python numbers and None are fine


@pytest.mark.parametrize("make", ["adamw", "adafactor", "sgd"])
def test_string_leaf_reaching_a_wrapped_optimizer_is_named(make):
    # fs.shard_optimizer(opt).init / .update let optax fail deep inside: "data type 'mlp'
    # not understood" (adamw), "'str' object has no attribute 'shape'" (adafactor), "can't
    # multiply sequence by non-int of type 'float'" (sgd's update).
    import optax

    opt = fs.shard_optimizer(getattr(optax, make)(1e-3))
    params = {"w": jnp.ones((10, 4)), "name": "mlp"}
    state = fs.shard(params, mesh_for("8"))
    with pytest.raises(errors.ShardingTypeError) as info:
        opt.init(state)
    msg = str(info.value)
    assert msg.startswith("shard_optimizer(...).init: the state has leaves that are not")
    assert "\n  ['name']: str\n" in msg and "extra argument" in msg
    # The gradients carry the string through the step as they carry the state's.
    loss = fs.value_and_grad(lambda s, x: jnp.mean(x @ fs.unshard(s["w"]).T))
    _, grads = loss(state, jnp.ones((8, 4)))
    assert grads["name"] == "mlp"
    opt_state = opt.init({"w": state["w"], "name": None})
    with pytest.raises(errors.ShardingTypeError) as info:
        opt.update(grads, opt_state, state)
    msg = str(info.value)
    assert msg.startswith("shard_optimizer(...).update: the updates have leaves that are not")
    assert "\n  ['name']: str\n" in msg
    # Scalars and None are fine, and the wrapper still gives plain optax's numbers.
    plain = getattr(optax, make)(1e-3)
    clean = {"w": params["w"], "lr_scale": jnp.float32(0.5), "none": None}
    updates, _ = opt.update(
        {"w": grads["w"], "lr_scale": jnp.float32(0.1), "none": None},
        opt.init(fs.shard(clean, mesh_for("8"))),
        fs.shard(clean, mesh_for("8")),
    )
    want, _ = plain.update(
        {"w": fs.unshard(grads["w"]), "lr_scale": jnp.float32(0.1), "none": None},
        plain.init(clean),
        clean,
    )
    _assert_close(fs.unshard(updates), want)


def _embedding_loss(state, tokens):
    return jnp.mean(state["embed"][tokens] ** 2)


@pytest.mark.parametrize("where", ["step", "jit", "eager"])
def test_indexing_a_sharded_leaf_names_the_expression_the_function_and_the_fix(where):
    # The refusal named neither the leaf nor the code: "fs.Sharded leaf of shape (10, 4)
    # and dtype float32 is a sharded parameter ...; call fs.unshard(state) ... first."
    params = {"embed": jax.random.normal(jax.random.key(0), (10, 4))}
    state, tokens = fs.shard(params, mesh_for("8")), jnp.arange(8) % 10
    run = {
        "step": fs.value_and_grad(_embedding_loss),
        "jit": jax.jit(_embedding_loss),
        "eager": _embedding_loss,
    }[where]
    with pytest.raises(errors.ShardingTypeError) as info:
        run(state, tokens)
    msg = str(info.value)
    assert msg.startswith("indexing an fs.Sharded leaf of shape (10, 4) and dtype float32: ")
    assert "`state['embed'][tokens]` in _embedding_loss (" in msg
    assert "test_obscure_errors.py:" in msg and "reads `state['embed']`" in msg
    assert "Gather it first: `fs.unshard(state['embed'])[tokens]`" in msg
    # The fix it shows gives plain JAX's numbers.
    fixed = fs.value_and_grad(lambda s, t: jnp.mean(fs.unshard(s["embed"])[t] ** 2))
    loss, grads = fixed(state, tokens)
    want_loss, want = jax.value_and_grad(_embedding_loss)(params, tokens)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


def test_a_sharded_leaf_in_a_jnp_function_or_operator_is_found_among_its_arguments():
    state = fs.shard({"w": jnp.ones((10, 4))}, mesh_for("8"))
    x = jnp.ones((2, 10))
    with pytest.raises(errors.ShardingTypeError) as info:
        jnp.take(state["w"], jnp.arange(3), axis=0)
    msg = str(info.value)
    assert msg.startswith("converting an fs.Sharded leaf of shape (10, 4) and dtype float32 ")
    assert "`jnp.take(fs.unshard(state['w']), jnp.arange(3), axis=0)`" in msg
    with pytest.raises(errors.ShardingTypeError, match=r"`x @ fs\.unshard\(state\['w'\]\)`"):
        x @ state["w"]
    # Two leaves of one layout in one call: which one refused is not guessed.
    pair = fs.shard({"a": jnp.ones((8, 4)), "b": jnp.ones((8, 4))}, mesh_for("8"))
    with pytest.raises(errors.ShardingTypeError) as info:
        jnp.add(pair["a"], pair["b"])
    msg = str(info.value)
    assert "`jnp.add(pair['a'], pair['b'])` in " in msg and "uses it" in msg
    assert "pass fs.unshard(leaf) instead" in msg


def test_unshard_of_data_that_is_not_the_layout_names_the_leaf():
    import dataclasses

    state = fs.shard(_params(), mesh_for("8"))
    broken = dataclasses.replace(state["w1"], data=jnp.zeros((3, 5)))
    with pytest.raises(
        errors.ShardingValueError,
        match=r"unshard: leaf \['w1'\] holds data of shape \(3, 5\).*\(16, 4\)",
    ):
        fs.unshard({"w1": broken})


# ---- torch_frontend: model.to(dtype) after fully_shard -----------------------------------


def _conv_model(torch):
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(24, 2))


@pytest.mark.torch
def test_torch_to_float64_after_fully_shard_as_fsdp2_and_conv_errors_get_the_note():
    # FSDP2 converts the shards and computes in float64; float32 inputs then fail inside
    # torch. Conv's wording ("Input type (float) and bias type (double) should be the
    # same") has no "dtype" in it, and got no note saying what changed.
    torch = pytest.importorskip("torch", reason="the torch extra is not installed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import torch_frontend as tf

    tf.init_distributed()
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(5, 3, 8, generator=torch.Generator().manual_seed(1))
    plain = _conv_model(torch).to(torch.float64)
    runs = {}
    for name, shard in (("fsdp2", fsdp2_shard), ("ours", tf.fully_shard)):
        model = _conv_model(torch)
        shard(model[0], mesh=mesh)
        shard(model, mesh=mesh)
        model.to(torch.float64)
        with pytest.raises(RuntimeError) as info:
            model(x)
        runs[name] = model, info.value
    (theirs, their_error), (ours, our_error) = runs["fsdp2"], runs["ours"]
    assert str(our_error) == str(their_error)  # FSDP2's type and text
    assert "bias type (double)" in str(our_error)
    assert not getattr(their_error, "__notes__", None)
    note = " ".join(our_error.__notes__)
    assert "parameter '0.weight' (and others) became torch.float64 after fully_shard" in note
    assert "Cast the inputs to torch.float64" in note
    # Inputs in float64 train as FSDP2 and plain torch do.
    for model in (plain, theirs, ours):
        model(x.double()).pow(2).mean().backward()
    for (name, p), q, r in zip(
        ours.named_parameters(), theirs.parameters(), plain.parameters(), strict=True
    ):
        assert p.dtype == torch.float64, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), rtol=0, atol=0)
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=0, atol=1e-12)


# ---- Flax -------------------------------------------------------------------------------

flax = pytest.importorskip("flax")
import flax.linen as nn
from flax import nnx

import funshard.flax

X = jax.random.normal(jax.random.key(7), (8, 4))


def test_linen_module_applied_to_sharded_params_it_does_not_gather():
    dense = nn.Dense(3)
    variables = dense.init(jax.random.key(0), X)
    params = fs.shard(variables["params"], mesh_for("8"))
    hint = r"scope '/' read its parameter 'kernel' as an fs.Sharded leaf of shape \(4, 3\)"
    with pytest.raises(
        errors.ShardingTypeError, match=hint + r".*fs\.flax\.fully_shard\(nn\.Dense\)"
    ):
        fs.value_and_grad(lambda p, x: jnp.mean(dense.apply({"params": p}, x)))(params, X)
    with pytest.raises(errors.ShardingTypeError, match=hint):
        dense.apply({"params": params}, X)  # outside a step too
    # The fix the message gives trains as plain linen does.
    unit = fs.flax.fully_shard(nn.Dense)(3)
    loss, grads = fs.value_and_grad(lambda p, x: jnp.mean(unit.apply({"params": p}, x) ** 2))(
        params, X
    )
    want_loss, want = jax.value_and_grad(lambda p, x: jnp.mean(dense.apply({"params": p}, x) ** 2))(
        variables["params"], X
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


@pytest.mark.parametrize(
    ("features", "inputs", "mesh_name", "in_step"),
    [(3, 8, "8", False), (8, 16, "8", False), (3, 4, "1", False), (3, 4, "1", True)],
)
def test_linen_module_on_sharded_params_whose_shape_passes_linens_check(
    features, inputs, mesh_name, in_step
):
    # The padded global array of an even leaf (or any leaf on one device) has the
    # parameter's shape: linen's check passed and the module's math refused the leaf
    # with an error naming neither the module nor the parameter.
    dense, x = nn.Dense(features), jax.random.normal(jax.random.key(7), (8, inputs))
    variables = dense.init(jax.random.key(0), x)
    params = fs.shard(variables["params"], mesh_for(mesh_name))
    apply = lambda p, x: jnp.mean(dense.apply({"params": p}, x) ** 2)  # noqa: E731
    with pytest.raises(errors.ShardingTypeError) as info:
        fs.value_and_grad(apply)(params, x) if in_step else apply(params, x)
    msg = str(info.value)
    assert msg.startswith("linen: the module at scope '/' read its parameter 'kernel' as an ")
    assert f"fs.Sharded leaf of shape {(inputs, features)}" in msg
    assert "fs.flax.fully_shard(nn.Dense)" in msg and "fs.unshard(params)" in msg
    # Both fixes the message gives compute plain linen's numbers.
    want_loss, want = jax.value_and_grad(apply)(variables["params"], x)
    np.testing.assert_allclose(apply(fs.unshard(params), x), want_loss, rtol=1e-6)
    unit = fs.flax.fully_shard(nn.Dense)(features)
    loss, grads = fs.value_and_grad(lambda p, x: jnp.mean(unit.apply({"params": p}, x) ** 2))(
        params, x
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


class _Sowing(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        self.sow("intermediates", "h", h)
        return nn.Dense(2)(jnp.tanh(h))


def test_linen_sow_inside_a_unit_comes_out_as_plain_linen():
    variables = _Sowing().init(jax.random.key(0), X)
    model = fs.flax.fully_shard(_Sowing)()
    params = fs.shard(variables["params"], mesh_for("8"))

    def loss(p, x):
        out, sown = model.apply({"params": p}, x, mutable=["intermediates"])
        return jnp.mean(out**2), sown

    def plain(p, x):
        out, sown = _Sowing().apply({"params": p}, x, mutable=["intermediates"])
        return jnp.mean(out**2), sown

    (got, sown), grads = jax.jit(fs.value_and_grad(loss, has_aux=True))(params, X)
    (want, want_sown), want_grads = jax.value_and_grad(plain, has_aux=True)(variables["params"], X)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    _assert_close(sown, want_sown)  # per-example values, gathered in batch order
    _assert_close(fs.unshard(grads), want_grads)
    _, outside = model.apply({"params": params}, X, mutable=True)  # evaluation, mutable=True
    _assert_close(outside["intermediates"], want_sown["intermediates"])


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, c, _):
        return jnp.tanh(nn.Dense(4)(c)), None


def _linen_stack(layer_cls):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                layer_cls, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return scanned()(x, None)[0]

    return Stack


def test_linen_scan_over_a_marked_class_is_a_clear_error_and_the_outer_unit_works():
    plain = _linen_stack(_Layer)()
    variables = plain.init(jax.random.key(0), X)
    params = fs.shard(variables["params"], mesh_for("8"))
    marked_inner = fs.flax.fully_shard(_linen_stack(fs.flax.fully_shard(_Layer)))()
    with pytest.raises(
        errors.UnsupportedError,
        match=r"unit _Layer runs inside a lifted transform.*nn\.scan.*"
        r"\['Dense_0'\]\['bias'\].*Mark the module that runs the scan",
    ):
        fs.value_and_grad(lambda p, x: jnp.mean(marked_inner.apply({"params": p}, x)))(params, X)
    outer = fs.flax.fully_shard(_linen_stack(_Layer))()
    step = fs.value_and_grad(lambda p, x: jnp.mean(outer.apply({"params": p}, x) ** 2))
    loss, grads = jax.jit(step)(params, X)
    want_loss, want = jax.value_and_grad(lambda p, x: jnp.mean(plain.apply({"params": p}, x) ** 2))(
        variables["params"], X
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


class _NBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class _NStack(nnx.Module):
    def __init__(self, key):
        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return _NBlock(nnx.Rngs(key))

        self.blocks = make(jax.random.split(key, 3))

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return run(x, self.blocks)


def test_nnx_scan_stacked_blocks_marked_as_a_unit_is_a_clear_error_and_the_outer_unit_works():
    mesh = mesh_for("8")
    model = _NStack(jax.random.key(0))
    fs.flax.fully_shard(model.blocks)
    fs.flax.fully_shard(model)
    graphdef, state = fs.flax.shard(model, mesh)
    with pytest.raises(
        errors.UnsupportedError, match=r"unit _NBlock runs inside a lifted transform.*nnx\.scan"
    ):
        fs.value_and_grad(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x)))(state, X)

    reference = _NStack(jax.random.key(0))
    outer = fs.flax.fully_shard(_NStack(jax.random.key(0)))  # the model alone is the unit
    graphdef, state = fs.flax.shard(outer, mesh)
    step = fs.value_and_grad(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))
    loss, grads = jax.jit(step)(state, X)
    ref_graph, ref_state = nnx.split(reference)
    want_loss, want = jax.value_and_grad(lambda s, x: jnp.mean(nnx.merge(ref_graph, s)(x) ** 2))(
        ref_state, X
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(want))
