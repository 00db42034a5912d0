"""The root and units composed with JAX transforms and odd inputs: plain JAX is the reference.

Every case here once gave a silently different number (a psum-normalised loss, integer
leaves under an optimizer, jax.checkpoint around a unit with deferred accumulation, NaN
input, ragged batches) or is a composition a user will try (vmap, cond, scan, donation,
eval_shape, aux values). Each either matches `jax.value_and_grad` of the unsharded model
or raises a clear error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import compiled, count_by_kind
from _models import mlp_layer, mlp_params, mse
from _util import assert_tree_close, mlp_batch_dict
from conftest import mesh_for

import funshard as fs

pytestmark = pytest.mark.slow

F32 = np.float32


def _forward(params, x, layer=mlp_layer):
    for p in params["layers"]:
        x = layer(p, x)
    return x * params["scale"]


def _ref_loss(params, batch):
    return mse(_forward(params, batch["x"]), batch["y"])


def _unit_loss(layer, reduce=None):
    """A per-device loss over units `layer`; `reduce` optionally reduces it over devices."""

    def loss(state, batch):
        h = batch["x"]
        for p in state["layers"]:
            h = layer(p, h)
        value = mse(h * state["scale"], batch["y"])
        return value if reduce is None else reduce(value)

    return loss


# --- 1. losses already reduced over the devices --------------------------------------


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("reduce", ["pmean", "pmean_shard_axis_only"])
def test_pmean_loss_gives_the_global_gradient(mesh_name, reduce):
    mesh = mesh_for(mesh_name)
    axes = tuple(mesh.axis_names) if reduce == "pmean" else ("fsdp",)
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh)
    unit = fs.fully_shard(mlp_layer)
    step = fs.value_and_grad(_unit_loss(unit, lambda v: jax.lax.pmean(v, axes)))
    loss, grads = jax.jit(step)(state, batch)
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_token_normalised_loss_gives_the_global_gradient(mesh_name, microbatches):
    """LLM-style normalisation: psum(sum of token losses) / psum(token count)."""
    mesh = mesh_for(mesh_name)
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    # Uneven numbers of valid rows per device: a local mean would weight them wrongly.
    batch["mask"] = (jnp.arange(16) % 3 != 0) & (jnp.arange(16) < 13)
    axes = tuple(mesh.axis_names)

    def total(pred, b):
        err = jnp.sum((pred - b["y"]) ** 2, -1) * b["mask"]
        return jnp.sum(err), jnp.sum(b["mask"]).astype(F32)

    def loss(state, b):
        h = b["x"]
        for p in state["layers"]:
            h = fs.fully_shard(mlp_layer)(p, h)
        s, n = total(h * state["scale"], b)
        return jax.lax.psum(s, axes) / jax.lax.psum(n, axes)

    def ref_loss(params, b):
        s, n = total(_forward(params, b["x"]), b)
        return s / n

    got_loss, grads = jax.jit(fs.value_and_grad(loss, microbatches=microbatches))(
        fs.shard(params, mesh), batch
    )
    ref_value, ref = jax.value_and_grad(ref_loss)(params, batch)
    if microbatches == 1:  # with microbatches each is normalised by its own count
        np.testing.assert_allclose(got_loss, ref_value, rtol=1e-6)
        assert_tree_close(fs.unshard(grads), ref)
    else:
        halves = [
            jax.tree.map(
                lambda x, m=m: x.reshape(8, 2, *x.shape[1:])[:, m].reshape(8, *x.shape[1:]), batch
            )
            for m in range(2)
        ]
        values, refs = zip(*(jax.value_and_grad(ref_loss)(params, h) for h in halves), strict=True)
        np.testing.assert_allclose(got_loss, np.mean(values), rtol=1e-6)
        assert_tree_close(fs.unshard(grads), jax.tree.map(lambda a, b: (a + b) / 2, *refs))


def test_divide_factor_means_the_same_for_reduced_and_local_losses():
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh_for("8"))
    unit = fs.fully_shard(mlp_layer)
    local = fs.value_and_grad(_unit_loss(unit), gradient_divide_factor=1.0)
    reduced = fs.value_and_grad(
        _unit_loss(unit, lambda v: jax.lax.pmean(v, "fsdp")), gradient_divide_factor=1.0
    )
    _, g_local = jax.jit(local)(state, batch)
    _, g_reduced = jax.jit(reduced)(state, batch)
    _, ref = jax.value_and_grad(_ref_loss)(params, batch)
    assert_tree_close(fs.unshard(g_local), fs.unshard(g_reduced))
    assert_tree_close(fs.unshard(g_reduced), jax.tree.map(lambda g: 8 * g, ref), atol=1e-4)


# --- 2. leaves an optimizer must leave alone -----------------------------------------


def _with_buffer():
    params = mlp_params(jax.random.key(0))
    params["positions"] = jnp.arange(6, dtype=jnp.int32)
    return params


def _buffer_loss(state, batch):
    p = fs.unshard(state)
    return _ref_loss(p, batch) + 0.0 * p["positions"].sum()


@pytest.mark.parametrize("jit", [True, False])
def test_integer_leaf_is_an_error_naming_it(jit):
    state = fs.shard(_with_buffer(), mesh_for("8"))
    step = fs.value_and_grad(_buffer_loss)
    step = jax.jit(step) if jit else step
    with pytest.raises(TypeError) as err:
        step(state, mlp_batch_dict())
    message = str(err.value)
    assert "['positions']: int32" in message and "trainable" in message
    assert "optax.masked" in message


def test_frozen_integer_leaf_is_bit_identical_after_adamw():
    params = _with_buffer()
    mesh = mesh_for("8")
    state = fs.shard(params, mesh)
    trainable = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), params)
    mask = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.floating), state)
    opt = optax.masked(optax.adamw(1e-2, weight_decay=0.1), mask)
    step_fn = fs.value_and_grad(_buffer_loss, trainable=trainable)
    opt_state = opt.init(state)

    @jax.jit
    def train(state, opt_state, batch):
        _, grads = step_fn(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    ref_opt = optax.adamw(1e-2, weight_decay=0.1)
    ref_params = {k: v for k, v in params.items() if k != "positions"}
    ref_state = ref_opt.init(ref_params)
    for i in range(3):
        batch = mlp_batch_dict(key=i)
        state, opt_state = train(state, opt_state, batch)
        grads = jax.grad(_ref_loss)(ref_params, batch)
        updates, ref_state = ref_opt.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    got = fs.unshard(state)
    np.testing.assert_array_equal(got["positions"], np.arange(6, dtype=np.int32))
    assert got["positions"].dtype == jnp.int32
    assert_tree_close({k: v for k, v in got.items() if k != "positions"}, ref_params, atol=1e-5)


@pytest.mark.parametrize("jit", [True, False])
def test_python_float_leaf_trains_like_jax_grad_with_and_without_jit(jit):
    # Two units, not three: eager runs op by op and compiles each op's shape on its own.
    params = mlp_params(jax.random.key(0), sizes=(13, 16, 5))
    params["scale"] = 0.5  # a Python float: jax.grad differentiates it, so must we
    state = fs.shard(params, mesh_for("8"))
    step = fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))
    loss, grads = (jax.jit(step) if jit else step)(state, mlp_batch_dict())
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, mlp_batch_dict())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref)


@pytest.mark.parametrize("jit", [True, False])
def test_python_int_leaf_is_an_error_with_and_without_jit(jit):
    params = mlp_params(jax.random.key(0))
    params["depth"] = 3
    state = fs.shard(params, mesh_for("8"))

    def loss(state, batch):
        return _ref_loss(fs.unshard(state), batch)

    step = fs.value_and_grad(loss)
    with pytest.raises(TypeError, match=r"\['depth'\]: int32"):
        (jax.jit(step) if jit else step)(state, mlp_batch_dict())


# --- 3. transforms that re-trace the loss --------------------------------------------


def _checkpointed(layer):
    return jax.checkpoint(layer)


def _checkpointed_dots(layer):
    return jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)


def _vmapped(layer):
    # Each example on its own: the unit's gather runs under vmap over the batch.
    return lambda p, h: jax.vmap(lambda row: layer(p, row[None])[0])(h)


def _in_cond(layer):
    # A data-dependent predicate (always true here), made equal on every device by a pmin
    # over the data axis (a predicate that varies is an error: tests/test_control_flow.py);
    # both branches run a unit.
    def run(p, h):
        finite = jax.lax.pmin(jnp.all(jnp.isfinite(h)).astype(jnp.int32), "fsdp") > 0
        return jax.lax.cond(finite, layer, lambda p, h: 0.0 * layer(p, h), p, h)

    return run


WRAPPERS = {
    "checkpoint": _checkpointed,
    "checkpoint_dots": _checkpointed_dots,
    "vmap": _vmapped,
    "cond": _in_cond,
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("sync", [True, False])
@pytest.mark.parametrize("reshard", [True, False])
def test_unit_under_transforms_with_accumulation(wrapper, sync, reshard):
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh_for("8"))
    unit = WRAPPERS[wrapper](fs.fully_shard(mlp_layer, reshard_after_forward=reshard))
    step = fs.value_and_grad(_unit_loss(unit), microbatches=2, sync_every_microbatch=sync)
    loss, grads = jax.jit(step)(state, batch)
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_tree_close(fs.unshard(grads), ref)


def test_units_inside_lax_scan_with_deferred_accumulation():
    params = mlp_params(jax.random.key(0), sizes=(13, 13, 13, 13))
    batch = {"x": mlp_batch_dict()["x"], "y": mlp_batch_dict()["y"][:, :1].repeat(13, 1)}
    state = fs.shard(params, mesh_for("8"))
    unit = fs.fully_shard(mlp_layer)

    step = fs.value_and_grad(
        lambda s, b: mse(
            jax.lax.scan(lambda h, _: (unit(s["layers"][0], h), None), b["x"], None, length=2)[0]
            * s["scale"],
            b["y"],
        ),
        microbatches=2,
        sync_every_microbatch=False,
    )
    loss_value, grads = jax.jit(step)(state, batch)

    def ref_loss(p, b):
        h = mlp_layer(p["layers"][0], mlp_layer(p["layers"][0], b["x"]))
        return mse(h * p["scale"], b["y"])

    ref_value, ref = jax.value_and_grad(ref_loss)(params, batch)
    np.testing.assert_allclose(loss_value, ref_value, rtol=1e-5)
    assert_tree_close(fs.unshard(grads), ref)


@pytest.mark.parametrize("sync", [True, False])
def test_frozen_leaves_under_checkpoint_are_not_communicated(sync):
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh_for("8"))
    unit = jax.checkpoint(fs.fully_shard(mlp_layer))
    trainable = {"layers": [False, False, False], "scale": True}
    step = fs.value_and_grad(
        _unit_loss(unit), trainable=trainable, microbatches=2, sync_every_microbatch=sync
    )
    loss, grads = jax.jit(step)(state, batch)
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grads["scale"], ref["scale"], rtol=1e-5)
    for layer in fs.unshard(grads)["layers"]:
        for g in layer.values():
            np.testing.assert_array_equal(g, np.zeros_like(g))
    assert count_by_kind(compiled(step, state, batch)[1])["reduce-scatter"] == 0


# --- 4. NaN input and units without a floating input ---------------------------------


@pytest.mark.parametrize("reshard", [True, False])
def test_nan_in_a_unit_input_changes_nothing_else(reshard):
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    batch["x"] = batch["x"].at[2, 0].set(jnp.nan)  # the first element of device 1's slice
    state = fs.shard(params, mesh_for("8"))
    unit = fs.fully_shard(mlp_layer, reshard_after_forward=reshard)

    def robust(h):
        return jnp.where(jnp.isnan(h), 0.0, h)

    def loss(state, b):
        h = robust(unit(state["layers"][0], b["x"]))
        for p in state["layers"][1:]:
            h = unit(p, h)
        return mse(h * state["scale"], b["y"])

    def ref(params, b):
        h = robust(mlp_layer(params["layers"][0], b["x"]))
        for p in params["layers"][1:]:
            h = mlp_layer(p, h)
        return mse(h * params["scale"], b["y"])

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, batch)
    ref_loss, ref_grads = jax.value_and_grad(ref)(params, batch)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads)


@pytest.mark.parametrize("reshard", [True, False])
def test_unit_with_only_integer_input(reshard):
    emb = jax.random.normal(jax.random.key(0), (11, 6))
    tokens = jax.random.randint(jax.random.key(1), (8, 5), 0, 11)
    embed = fs.fully_shard(lambda p, t: p["emb"][t], reshard_after_forward=reshard)

    def loss(state, t):
        return jnp.mean(jnp.sin(embed(state, t)) ** 2)

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(
        fs.shard({"emb": emb}, mesh_for("8")), tokens
    )
    ref_loss, ref = jax.value_and_grad(lambda p: jnp.mean(jnp.sin(p["emb"][tokens]) ** 2))(
        {"emb": emb}
    )
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref)


# --- 5. batches ----------------------------------------------------------------------


def test_batch_leaves_of_different_lengths_are_an_error():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    batch = {"x": mlp_batch_dict()["x"], "y": mlp_batch_dict(rows=8)["y"]}
    with pytest.raises(ValueError) as err:
        fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))(state, batch)
    assert "['x']: 16 rows" in str(err.value) and "['y']: 8 rows" in str(err.value)


# --- 6. compositions of whole steps --------------------------------------------------


def test_vmap_over_steps_matches_per_batch_steps():
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"))
    step = fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))
    batches = jax.tree.map(lambda *xs: jnp.stack(xs), mlp_batch_dict(key=1), mlp_batch_dict(key=2))
    try:
        losses, grads = jax.jit(jax.vmap(step, in_axes=(None, 0)))(state, batches)
    except (ValueError, TypeError, NotImplementedError) as exc:  # pragma: no cover
        pytest.fail(f"vmap over a step raised {exc!r}")
    for k, key in enumerate((1, 2)):
        ref_loss, ref = jax.value_and_grad(_ref_loss)(params, mlp_batch_dict(key=key))
        np.testing.assert_allclose(losses[k], ref_loss, rtol=1e-5)
        got = jax.tree.map(lambda g, k=k: g[k], grads)  # batch k's gradients, like state
        assert_tree_close(fs.unshard(got), ref)


def test_two_steps_in_one_jit():
    params = mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"))
    first = fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))
    second = fs.value_and_grad(
        _unit_loss(fs.fully_shard(mlp_layer, reshard_after_forward=False)),
        microbatches=2,
        sync_every_microbatch=False,
    )

    @jax.jit
    def both(state, a, b):
        return first(state, a), second(state, b)

    (la, ga), (lb, gb) = both(state, mlp_batch_dict(key=1), mlp_batch_dict(key=2))
    for (loss, grads), key in (((la, ga), 1), ((lb, gb), 2)):
        ref_loss, ref = jax.value_and_grad(_ref_loss)(params, mlp_batch_dict(key=key))
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        assert_tree_close(fs.unshard(grads), ref)


def test_donated_train_step_matches_undonated():
    params = mlp_params(jax.random.key(0))
    opt = optax.adam(1e-2)
    step_fn = fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))

    def train(state, opt_state, batch):
        loss, grads = step_fn(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    results = []
    for donate in ((), (0, 1)):
        state = fs.shard(params, mesh_for("8"))
        opt_state = opt.init(state)
        fn = jax.jit(train, donate_argnums=donate)
        for i in range(3):
            state, opt_state, loss = fn(state, opt_state, mlp_batch_dict(key=i))
        results.append((fs.unshard(state), loss))
    assert_tree_close(results[0][0], results[1][0], atol=0, rtol=0)
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_eval_shape_of_a_step():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    step = fs.value_and_grad(_unit_loss(fs.fully_shard(mlp_layer)))
    loss, grads = jax.eval_shape(step, state, mlp_batch_dict())
    assert loss.shape == () and loss.dtype == jnp.float32
    assert jax.tree.structure(grads) == jax.tree.structure(state)
    for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(state), strict=True):
        assert g.shape == s.shape and g.dtype == s.dtype


@pytest.mark.parametrize("reshard", [True, False])
def test_unit_outputs_with_non_array_leaves(reshard):
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    unit = fs.fully_shard(
        lambda p, h: {"h": mlp_layer(p, h), "tag": "layer", "n": 3, "z": None},
        reshard_after_forward=reshard,
    )

    def loss(state, b):
        out = {"h": b["x"]}
        for p in state["layers"]:
            out = unit(p, out["h"])
            assert out["tag"] == "layer" and out["n"] == 3 and out["z"] is None
        return mse(out["h"] * state["scale"], b["y"])

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh_for("8")), batch)
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref)


# --- 12. aux values and has_aux mistakes ---------------------------------------------


def test_aux_with_sharded_leaves_is_an_error():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))

    def loss(state, b):
        return _ref_loss(fs.unshard(state), b), {"w": state["layers"][0]["w"]}

    with pytest.raises(TypeError, match=r"aux holds fs.Sharded leaves \(\['w'\]\).*fs.unshard"):
        fs.value_and_grad(loss, has_aux=True)(state, mlp_batch_dict())


@pytest.mark.parametrize("mesh_name,microbatches", [("8", 1), ("8", 2), ("2x4", 2)])
def test_per_example_aux_comes_back_in_global_batch_order(mesh_name, microbatches):
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    state = fs.shard(params, mesh_for(mesh_name))

    def per_example(p, b):
        return jnp.mean((_forward(p, b["x"]) - b["y"]) ** 2, -1)

    def loss(state, b):
        errors = per_example(fs.unshard(state), b)
        return jnp.mean(errors), {"errors": errors, "mean": jnp.mean(errors)}

    (value, aux), _ = jax.jit(fs.value_and_grad(loss, has_aux=True, microbatches=microbatches))(
        state, batch
    )
    want = per_example(params, batch)
    np.testing.assert_allclose(aux["errors"], want, rtol=1e-5)
    np.testing.assert_allclose(aux["mean"], jnp.mean(want), rtol=1e-5)
    np.testing.assert_allclose(value, jnp.mean(want), rtol=1e-5)


def test_aux_already_reduced_is_not_reduced_again():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))

    def loss(state, b):
        value = _ref_loss(fs.unshard(state), b)
        rows = jnp.sum(jnp.isfinite(b["x"][:, 0]))
        return value, {"total_rows": jax.lax.psum(rows, "fsdp"), "rows": rows}

    (_, aux), _ = jax.jit(fs.value_and_grad(loss, has_aux=True))(state, mlp_batch_dict())
    assert int(aux["total_rows"]) == 16 and int(aux["rows"]) == 16


def test_tuple_returned_without_has_aux():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    step = fs.value_and_grad(lambda s, b: (_ref_loss(fs.unshard(s), b), {"n": 1}))
    with pytest.raises(TypeError, match="pass has_aux=True"):
        step(state, mlp_batch_dict())


def test_scalar_returned_with_has_aux():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    step = fs.value_and_grad(lambda s, b: _ref_loss(fs.unshard(s), b), has_aux=True)
    with pytest.raises(TypeError, match="or pass has_aux=False"):
        step(state, mlp_batch_dict())


def test_non_scalar_loss():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    step = fs.value_and_grad(lambda s, b: _forward(fs.unshard(s), b["x"]))
    with pytest.raises(TypeError, match=r"floating scalar, got shape \(2, 5\)"):
        step(state, mlp_batch_dict())


# --- 12. nested units -----------------------------------------------------------------


def test_fully_shard_of_a_unit_is_an_error():
    with pytest.raises(ValueError, match="units cannot be nested"):
        fs.fully_shard(fs.fully_shard(mlp_layer))


def test_unit_called_with_gathered_parameters_is_an_error():
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    inner = fs.fully_shard(mlp_layer)
    outer = fs.fully_shard(lambda layers, h: inner(layers[1], inner(layers[0], h)))

    def loss(state, b):
        return mse(outer(state["layers"][:2], b["x"])[:, :5], b["y"])

    with pytest.raises(ValueError, match="units cannot be nested.*as an argument"):
        jax.jit(fs.value_and_grad(loss))(state, mlp_batch_dict())


@pytest.mark.parametrize("reshard", [True, False])
def test_inner_unit_parameters_passed_as_arguments(reshard):
    """FSDP2 nesting: the outer unit gathers only what it owns."""
    params, batch = mlp_params(jax.random.key(0)), mlp_batch_dict()
    inner = fs.fully_shard(mlp_layer, reshard_after_forward=reshard)

    def outer_fn(own, h, inner_params):
        return inner(inner_params, mlp_layer(own, h))

    outer = fs.fully_shard(outer_fn, reshard_after_forward=reshard)

    def loss(state, b):
        layers = state["layers"]
        h = outer(layers[0], b["x"], layers[1])
        return mse(inner(layers[2], h) * state["scale"], b["y"])

    state = fs.shard(params, mesh_for("8"))
    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, batch)
    ref_loss, ref = jax.value_and_grad(_ref_loss)(params, batch)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-6)
    assert_tree_close(fs.unshard(grads), ref)


@pytest.mark.parametrize(
    "value,error", [("yes", TypeError), (0, ValueError), (-1, ValueError), (2.0, TypeError)]
)
def test_reshard_after_forward_validated_alike(value, error):
    stacked = fs.shard({"w": jnp.ones((2, 4, 4))}, mesh_for("4"), stacked=True)
    for call in (
        lambda: fs.fully_shard(mlp_layer, reshard_after_forward=value),
        lambda: fs.scan(lambda p, h: h, stacked, jnp.ones(4), reshard_after_forward=value),
    ):
        with pytest.raises(error, match="reshard_after_forward must be True, False or a positive"):
            call()


def test_scan_rejects_hpz_clearly():
    stacked = fs.shard({"w": jnp.ones((2, 4, 4))}, mesh_for("4"), stacked=True)
    with pytest.raises(NotImplementedError, match="reshard_after_forward=2"):
        fs.scan(lambda p, h: h, stacked, jnp.ones(4), reshard_after_forward=2)


@pytest.mark.parametrize(
    "mesh_name, axes", [("8", "fsdp"), ("2x4", "fsdp"), ("2x4", ("replicate", "fsdp"))]
)
def test_unit_output_already_reduced_over_devices_trains_like_jax(mesh_name, axes):
    # A unit returning a statistic it pmean'd itself (e.g. synced batch statistics)
    # next to its per-device activation: the statistic is not per-device data.
    mesh = mesh_for(mesh_name)
    params = {"w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64}
    batch = jnp.sin(jnp.arange(16 * 8, dtype=jnp.float32)).reshape(16, 8)
    unit = fs.fully_shard(lambda p, x: (x @ p["w"], jax.lax.pmean(x.mean(0), axes)))

    def loss(s, b):
        y, stat = unit(s, b)
        return jnp.mean(y**2) + jnp.sum(stat * jnp.mean(y))

    def reference(p, b):
        y = b @ p["w"]
        # The pmean over the devices holding equal row counts is the global mean when
        # the statistic is reduced over every data axis; over "fsdp" only on 2x4, each
        # replica's mean of its own half of the batch.
        halves = b.reshape(2, 8, 8) if mesh_name == "2x4" and axes == "fsdp" else b[None]
        per_row = jnp.repeat(halves.mean(1), b.shape[0] // halves.shape[0], axis=0)
        return jnp.mean(
            jnp.mean(y**2, axis=1)
            + jnp.sum(per_row, axis=1)
            * jnp.mean(y.reshape(halves.shape[0], -1), axis=1).repeat(b.shape[0] // halves.shape[0])
        )

    got = jax.jit(fs.value_and_grad(loss))(fs.shard(params, mesh), batch)
    want = jax.value_and_grad(reference)(params, batch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    assert_tree_close(fs.unshard(got[1]), want[1], rtol=1e-4, atol=1e-6)
