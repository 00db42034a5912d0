"""funshard.flax: nnx and linen models as FSDP units, checked against the unsharded model.

Every step is compiled once per case (module-scoped fixtures) and each test reads one
fact from it: gradients against plain `jax.grad` of the unsharded Flax model, collective
counts from the compiled HLO, training against plain optax.
"""

import re
from collections import Counter
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import count_by_kind
from _util import assert_tree_close
from conftest import mesh_for
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import funshard as fs
import funshard.flax

pytestmark = pytest.mark.slow

WIDTH, HEADS, VOCAB, SEQ, ROWS, BLOCKS = 16, 2, 32, 8, 8, 2
UNITS = BLOCKS + 1  # the blocks and the model (embedding, final norm, head)


def _attention(qkv):
    q, k, v = (t.reshape(*t.shape[:-1], HEADS, -1) for t in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    causal = jnp.tril(jnp.ones((q.shape[1], q.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(*out.shape[:-2], -1)


def _cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _batch(key=1):
    tokens = jax.random.randint(jax.random.key(key), (ROWS, SEQ + 1), 0, VOCAB)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


# --- nnx -----------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.qkv = nnx.Linear(WIDTH, 3 * WIDTH, rngs=rngs)
        self.proj = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.fc = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.out = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, h):
        h = h + self.proj(_attention(self.qkv(self.ln1(h))))
        return h + self.out(jax.nn.gelu(self.fc(self.ln2(h))))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(BLOCKS)])
        self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def _nnx_model(reshard_after_forward=True, mark=True):
    model = Model(nnx.Rngs(0))
    if mark:
        for block in model.blocks:
            fs.flax.fully_shard(block, reshard_after_forward=reshard_after_forward)
        fs.flax.fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def _abstract(make):
    """The model `make()` builds, with abstract arrays: structure-only tests run nothing."""
    return nnx.eval_shape(make)


def _nnx_loss(graphdef):
    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        return _cross_entropy(model(batch["x"]), batch["y"])

    return loss_fn


@pytest.fixture(scope="module")
def nnx_reference():
    """Plain `jax.value_and_grad` of the unsharded model's loss (one device), jitted."""
    graphdef, params = nnx.split(_nnx_model(mark=False))
    return params, jax.jit(jax.value_and_grad(_nnx_loss(graphdef)))


def _compiled_step(loss_fn, state, batch):
    exe = jax.jit(fs.value_and_grad(loss_fn)).lower(state, batch).compile()
    return exe, exe.as_text()


# (mesh, reshard_after_forward): FSDP regathering, and HSDP keeping the gathered params.
CASES = {"fsdp": ("8", True), "hsdp-keep": ("2x4", False)}


_NNX_CASES: dict = {}


def _nnx_case(name: str) -> dict:
    """The compiled sharded step of one case, built once per session."""
    if name not in _NNX_CASES:
        mesh_name, reshard = CASES[name]
        graphdef, state = fs.flax.shard(_nnx_model(reshard), mesh_for(mesh_name))
        exe, text = _compiled_step(_nnx_loss(graphdef), state, _batch())
        _NNX_CASES[name] = dict(reshard=reshard, graphdef=graphdef, state=state, exe=exe, text=text)
    return _NNX_CASES[name]


@pytest.fixture(params=list(CASES))
def nnx_step(request):
    return _nnx_case(request.param)


def test_nnx_gradients_match_the_unsharded_model(nnx_step, nnx_reference):
    batch = _batch()
    loss, grads = nnx_step["exe"](nnx_step["state"], batch)
    params, reference = nnx_reference
    ref_loss, ref_grads = reference(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(grads)), nnx.to_pure_dict(ref_grads))


def _gathers_by_unit(hlo_text: str) -> Counter:
    """All-gathers per unit label (`funshard/<unit>/all_gather` in their metadata)."""
    names = [
        re.search(r"funshard/(\w+)/all_gather", line)
        for line in hlo_text.splitlines()
        if " all-gather(" in line
    ]
    return Counter(m.group(1) for m in names if m)


def test_nnx_one_gather_and_one_reduce_scatter_per_unit(nnx_step):
    counts = count_by_kind(nnx_step["text"])
    per_unit = 2 if nnx_step["reshard"] else 1  # the re-gather in backward
    assert counts["all-gather"] == per_unit * UNITS, counts
    assert counts["reduce-scatter"] == UNITS, counts
    assert _gathers_by_unit(nnx_step["text"]) == {"Block": per_unit * BLOCKS, "Model": per_unit}


@pytest.fixture(scope="module")
def nnx_default_step():
    """The model marked with FSDP2's default `reshard_after_forward=None`, compiled."""
    model = Model(nnx.Rngs(0))
    for block in model.blocks:
        fs.flax.fully_shard(block)
    fs.flax.fully_shard(model)
    graphdef, state = fs.flax.shard(model, mesh_for("8"))
    _, text = _compiled_step(_nnx_loss(graphdef), state, _batch())
    return model, text


def test_nnx_default_keeps_only_the_outermost_unit_gathered(nnx_default_step):
    # reshard_after_forward=None (FSDP2's default): blocks gather again for backward,
    # the model (the root) keeps its parameters from forward to backward.
    _, text = nnx_default_step
    assert _gathers_by_unit(text) == {"Block": 2 * BLOCKS, "Model": 1}


def test_flax_plan_of_an_nnx_model_predicts_the_compiled_step(nnx_default_step):
    """`fs.flax.plan` reads the units and their resolved `reshard_after_forward` from
    the model (the root keeps its gathered parameters: 5 all-gathers, not 6)."""
    model, text = nnx_default_step
    plan = fs.flax.plan(model, mesh_for("8"), optimizer=ADAM)
    counts = count_by_kind(text)
    assert plan.count("all-gather") == counts["all-gather"] == 2 * BLOCKS + 1
    assert plan.count("reduce-scatter") == counts["reduce-scatter"] == UNITS
    assert {u.name: u.reshard_after_forward for u in plan.units} == {
        "blocks.0": True,
        "blocks.1": True,
        "Model": False,
    }
    assert plan.params.replicated == sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, nnx.Param))
    )


def test_nnx_parameters_sharded_like_fs_shard(nnx_step):
    state = nnx_step["state"]
    mesh = state["head"]["kernel"].get_value().mesh
    want = fs.shard(nnx.split(_nnx_model(mark=False))[1], mesh)
    got_leaves = jax.tree.leaves(state, is_leaf=_is_sharded)
    want_leaves = jax.tree.leaves(want, is_leaf=_is_sharded)
    assert [x.layout for x in got_leaves] == [x.layout for x in want_leaves]
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(g.data, w.data)


def _is_sharded(x):
    return isinstance(x, fs.Sharded)


class WideLayer(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(128, 128, rngs=rngs)

    def __call__(self, h):
        return jnp.tanh(self.fc(h))


class LinenWideLayer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(128)(h))


def _wide_nnx(reshard_after_forward: bool):
    model = nnx.List([WideLayer(nnx.Rngs(i)) for i in range(4)])
    for layer in model:
        fs.flax.fully_shard(layer, reshard_after_forward=reshard_after_forward)
    graphdef, state = fs.flax.shard(model, mesh_for("8"))

    def forward(state, h):
        for layer in nnx.merge(graphdef, state):
            h = layer(h)
        return h

    return forward, state


def _wide_linen(reshard_after_forward: bool):
    layer = fs.flax.fully_shard(LinenWideLayer, reshard_after_forward=reshard_after_forward)
    model = nn.Sequential([layer() for _ in range(4)])
    params = model.init(jax.random.key(0), jnp.ones((1, 128)))["params"]
    return (lambda state, h: model.apply({"params": state}, h)), fs.shard(params, mesh_for("8"))


def _wide_program(build, reshard_after_forward: bool):
    forward, state = build(reshard_after_forward)

    def loss_fn(state, batch):
        return jnp.mean((forward(state, batch["x"]) - batch["x"]) ** 2)

    return _compiled_step(loss_fn, state, {"x": jnp.ones((128, 128))})[0]


@pytest.mark.parametrize("build", [_wide_nnx, _wide_linen], ids=["nnx", "linen"])
def test_reshard_after_forward_saves_memory_not_flops(build):
    """A unit drops its gathered parameters from the saved residuals (re-gathered in
    backward) and recomputes nothing: less temp memory, the same FLOPs."""
    regather, keep = _wide_program(build, True), _wide_program(build, False)
    temp = [exe.memory_analysis().temp_size_in_bytes for exe in (regather, keep)]
    flops = [exe.cost_analysis()["flops"] for exe in (regather, keep)]
    assert temp[0] < 0.75 * temp[1], temp
    assert abs(flops[0] - flops[1]) <= 0.02 * flops[1], flops


def _optax_step(opt):
    @jax.jit
    def step(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


# eps well above float32 noise: Adam divides by sqrt(v), so a gradient that is 0 in one
# reduction order and 1e-9 in another would otherwise move a weight by the learning rate.
ADAM = optax.adamw(1e-2, eps=1e-3)


def test_nnx_optax_training_matches_plain_optax(nnx_reference):
    """Three AdamW steps: the compiled sharded step and optax on the sharded state, against
    optax on the unsharded parameters."""
    case = _nnx_case("fsdp")
    state, exe = case["state"], case["exe"]
    params, reference = nnx_reference
    opt_state, ref_opt_state = fs.init_optimizer(ADAM, state), ADAM.init(params)
    step = _optax_step(ADAM)
    for i in range(3):
        batch = _batch(i + 10)
        state, opt_state = step(exe(state, batch)[1], opt_state, state)
        params, ref_opt_state = step(reference(params, batch)[1], ref_opt_state, params)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(state)), nnx.to_pure_dict(params))


class NoisyBlock(nnx.Module):
    """A unit that writes state when called: an RNG count (Dropout), batch statistics."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, axis_name="fsdp", rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, h):
        return h + self.drop(self.norm(self.fc(h)))


class NoisyModel(nnx.Module):
    def __init__(self, rngs):
        self.block = fs.flax.fully_shard(NoisyBlock(rngs))
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, h):
        return self.head(self.block(h))


def _noisy_batch():
    x = jax.random.normal(jax.random.key(5), (8, 4))
    return {"x": x, "y": x.sum(-1, keepdims=True)}


def _mse_aux(model, batch):
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, nnx.state(model, nnx.Not(nnx.Param))


def test_nnx_rng_and_batch_statistics_stay_replicated_and_are_written_back():
    """RNG keys and counts and batch statistics are replicated, never `Sharded`; written
    inside a unit (Dropout's count, BatchNorm's statistics synced over the shard axis),
    they come back out of the step as aux. The head belongs to no unit: replicated."""
    model = NoisyModel(nnx.Rngs(0, dropout=1))
    graphdef, params, rest = fs.flax.shard(model, mesh_for("8"), nnx.Param, ...)
    assert jax.tree.leaves(rest, is_leaf=_is_sharded) != []
    assert not any(map(_is_sharded, jax.tree.leaves(rest, is_leaf=_is_sharded)))
    assert not _is_sharded(params["head"]["kernel"].get_value())
    assert _is_sharded(params["block"]["fc"]["kernel"].get_value())
    for leaf in jax.tree.leaves(rest):
        assert leaf.sharding.is_fully_replicated

    def loss_fn(params, batch, rest):
        return _mse_aux(fs.flax.merge(graphdef, params, rest), batch)

    (_, new_rest), grads = jax.jit(fs.value_and_grad(loss_fn, has_aux=True))(
        params, _noisy_batch(), rest
    )
    assert new_rest["block"]["drop"]["rngs"]["count"].get_value() == 1
    # BatchNorm's running mean moved by (1 - momentum) * the global batch mean.
    fc = nnx.merge(graphdef, fs.unshard(params), rest).block.fc
    batch_mean = fc(_noisy_batch()["x"]).mean(0)
    np.testing.assert_allclose(
        new_rest["block"]["norm"]["mean"].get_value(), 0.01 * batch_mean, rtol=1e-4, atol=1e-6
    )
    assert _is_sharded(grads["block"]["fc"]["kernel"].get_value())


class DropoutModel(nnx.Module):
    """Dropout inside the model's unit: streams given at construction (miniGPT's way), or
    an `nnx.Rngs` passed to the call (the MNIST tutorial's way)."""

    def __init__(self, rngs, streams_at_init=True, deterministic=False):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(
            0.5, deterministic=deterministic, rngs=rngs if streams_at_init else None
        )
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x, rngs=None):
        h = self.drop(jnp.tanh(self.fc(x)), rngs=rngs)
        return self.head(h), h != 0


def _dropout_batch(i, rows=ROWS):
    x = jax.random.normal(jax.random.key(20 + i), (rows, 4))
    return {"x": x, "y": jnp.sin(x).sum(-1, keepdims=True)}


def _one_state_run(model, steps=3, call_rngs=False):
    """docs/flax.md's one-state recipe, the whole loop: (state, losses, kept masks)."""
    fs.flax.fully_shard(model)
    graphdef, state = fs.flax.shard(model, mesh_for("8"))
    mask = fs.flax.trainable(state)
    opt = optax.masked(ADAM, mask)

    def loss_fn(state, batch, key):
        model = nnx.merge(graphdef, state)
        out, kept = model(batch["x"], nnx.Rngs(dropout=key) if call_rngs else None)
        loss = jnp.mean((out - batch["y"]) ** 2)
        return loss, (nnx.state(model, nnx.Not(nnx.Param)), kept)

    step = fs.value_and_grad(loss_fn, has_aux=True, trainable=mask)

    @jax.jit
    def train_step(state, opt_state, batch, key):
        (loss, (written, kept)), grads = step(state, batch, key)
        updates, opt_state = opt.update(grads, opt_state, state)
        return fs.flax.apply_updates(state, updates, written), opt_state, loss, kept

    opt_state, losses, masks = fs.init_optimizer(opt, state), [], []
    for i in range(steps):
        state, opt_state, loss, kept = train_step(
            state, opt_state, _dropout_batch(i), jax.random.key(i)
        )
        losses.append(loss)
        masks.append(np.asarray(kept))
    return state, losses, masks


def test_nnx_one_state_recipe_with_dropout_matches_the_unsharded_model():
    """fs.flax.shard(model, mesh) + nnx.merge on a model with Dropout streams: the whole
    documented loop (trainable mask, optax.masked, fs.flax.apply_updates) runs, and with
    dropout off it trains exactly as optax on one device."""
    state, losses, _ = _one_state_run(DropoutModel(nnx.Rngs(0), deterministic=True))
    graphdef, params, rest = nnx.split(
        DropoutModel(nnx.Rngs(0), deterministic=True), nnx.Param, ...
    )
    opt_state, step = ADAM.init(params), _optax_step(ADAM)

    def loss_fn(params, batch):
        out, _ = nnx.merge(graphdef, params, rest)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    reference = jax.jit(jax.value_and_grad(loss_fn))
    for i in range(3):
        loss, grads = reference(params, _dropout_batch(i))
        np.testing.assert_allclose(losses[i], loss, rtol=1e-5)
        params, opt_state = step(grads, opt_state, params)
    got = nnx.filter_state(fs.unshard(state), nnx.Param)
    assert_tree_close(nnx.to_pure_dict(got), nnx.to_pure_dict(params))


@pytest.mark.parametrize("call_rngs", [False, True], ids=["streams", "rngs-argument"])
def test_nnx_dropout_masks_differ_per_step_and_per_device(call_rngs):
    """With dropout on, the RNG count comes back advanced every step, each step draws a
    new mask, and each device draws its own rows of the global batch's mask, for
    streams held by the model and for an `nnx.Rngs` passed to the call alike."""
    model = DropoutModel(nnx.Rngs(0, dropout=1), streams_at_init=not call_rngs)
    state, losses, masks = _one_state_run(model, steps=2, call_rngs=call_rngs)
    assert np.all(np.isfinite(losses))
    if not call_rngs:
        assert state["drop"]["rngs"]["count"].get_value() == 2
    assert not np.array_equal(masks[0], masks[1])
    per_device = masks[0].reshape(8, ROWS // 8, -1)
    assert len({d.tobytes() for d in per_device}) == 8, per_device
    assert 0.2 < masks[0].mean() < 0.8


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_nnx_dropout_masks_are_the_unsharded_models_on_the_global_batch(mesh_name):
    """Two-state recipe with Dropout on: the loss and gradients of the unsharded model on
    the whole batch, on 8 devices and HSDP (the root draws each device's rows of it)."""
    model = DropoutModel(nnx.Rngs(0, dropout=1))
    ref_graphdef, ref_params, ref_rest = nnx.split(model, nnx.Param, ...)
    graphdef, params, rest = fs.flax.shard(
        fs.flax.fully_shard(DropoutModel(nnx.Rngs(0, dropout=1))),
        mesh_for(mesh_name),
        nnx.Param,
        ...,
    )

    def loss_fn(params, batch, rest):
        out, _ = fs.flax.merge(graphdef, params, rest)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    def ref_loss(params, batch, rest):
        out, _ = nnx.merge(ref_graphdef, params, rest, copy=True)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2)

    batch = _dropout_batch(0)
    loss, grads = jax.jit(fs.value_and_grad(loss_fn))(params, batch, rest)
    ref, ref_grads = jax.value_and_grad(ref_loss)(ref_params, batch, ref_rest)
    np.testing.assert_allclose(loss, ref, atol=1e-6)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(grads)), nnx.to_pure_dict(ref_grads), atol=1e-6)


class DropoutBlock(nnx.Module):
    def __init__(self, rngs, dropout):
        self.fc = nnx.Linear(4, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, deterministic=not dropout, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.fc(x)))


class OuterDropoutModel(nnx.Module):
    """A Dropout outside every unit (the model is not marked: its Dropout and head run in
    the root), after a block that is a unit and may hold a Dropout of its own."""

    def __init__(self, rngs, inner_dropout, mark=True):
        self.block = DropoutBlock(rngs, inner_dropout)
        if mark:
            fs.flax.fully_shard(self.block)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(self.block(x)))


def _mse_written(model, batch):
    loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    return loss, nnx.state(model, nnx.Not(nnx.Param))


def _plain_flax_run(inner_dropout, steps):
    """The unmarked model trained by plain Flax and optax on the whole batch, carrying its
    RNG counts from step to step: ([loss], [parameter gradients], final parameters)."""
    graphdef, params, rest = nnx.split(
        OuterDropoutModel(nnx.Rngs(0, dropout=1), inner_dropout, mark=False), nnx.Param, ...
    )
    grad_fn = jax.jit(
        jax.value_and_grad(
            lambda p, b, r: _mse_written(nnx.merge(graphdef, p, r, copy=True), b), has_aux=True
        )
    )
    opt_state, update, losses, grads = ADAM.init(params), _optax_step(ADAM), [], []
    for i in range(steps):
        (loss, rest), g = grad_fn(params, _dropout_batch(i, rows=16), rest)
        params, opt_state = update(g, opt_state, params)
        losses.append(loss)
        grads.append(nnx.to_pure_dict(g))
    return losses, grads, nnx.to_pure_dict(params)


def _assert_runs_equal(run, reference):
    for (loss, grads), ref_loss, ref_grads in zip(run[0], *reference[:2], strict=True):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_tree_close(grads, ref_grads, atol=1e-6)
    assert_tree_close(run[1], reference[2], atol=1e-5)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_nnx_one_state_recipe_with_dropout_outside_every_unit_is_plain_flax(mesh_name):
    """docs/flax.md's one-state recipe, three AdamW steps, with a Dropout outside every
    unit (it used to fail inside Flax's Dropout): the losses, gradients and parameters of
    the unmarked model trained by plain Flax on the whole batch with the same streams."""
    model = OuterDropoutModel(nnx.Rngs(0, dropout=1), inner_dropout=False)
    graphdef, state = fs.flax.shard(model, mesh_for(mesh_name))
    mask = fs.flax.trainable(state)
    opt = optax.masked(ADAM, mask)
    step = fs.value_and_grad(
        lambda s, b: _mse_written(nnx.merge(graphdef, s), b), has_aux=True, trainable=mask
    )

    @jax.jit
    def train_step(state, opt_state, batch):
        (loss, written), grads = step(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return fs.flax.apply_updates(state, updates, written), opt_state, loss, grads

    opt_state, steps = fs.init_optimizer(opt, state), []
    for i in range(3):
        state, opt_state, loss, grads = train_step(state, opt_state, _dropout_batch(i, rows=16))
        grads = nnx.filter_state(fs.unshard(grads), nnx.Param)
        steps.append((loss, nnx.to_pure_dict(grads)))
    assert state["drop"]["rngs"]["count"].get_value() == 3
    params = nnx.to_pure_dict(nnx.filter_state(fs.unshard(state), nnx.Param))
    _assert_runs_equal((steps, params), _plain_flax_run(inner_dropout=False, steps=3))


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_nnx_two_state_recipe_with_dropout_inside_and_outside_units_is_plain_flax(mesh_name):
    """docs/flax.md's two-state recipe, three AdamW steps, with one Dropout inside a unit
    and one outside every unit: plain Flax's losses, gradients and parameters."""
    model = OuterDropoutModel(nnx.Rngs(0, dropout=1), inner_dropout=True)
    graphdef, params, rest = fs.flax.shard(model, mesh_for(mesh_name), nnx.Param, ...)
    step = fs.value_and_grad(
        lambda p, b, r: _mse_written(fs.flax.merge(graphdef, p, r), b), has_aux=True
    )

    @jax.jit
    def train_step(params, rest, opt_state, batch):
        (loss, rest), grads = step(params, batch, rest)
        updates, opt_state = ADAM.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss, grads

    opt_state, steps = fs.init_optimizer(ADAM, params), []
    for i in range(3):
        params, rest, opt_state, loss, grads = train_step(
            params, rest, opt_state, _dropout_batch(i, rows=16)
        )
        steps.append((loss, nnx.to_pure_dict(fs.unshard(grads))))
    assert rest["drop"]["rngs"]["count"].get_value() == 3
    assert rest["block"]["drop"]["rngs"]["count"].get_value() == 3
    run = (steps, nnx.to_pure_dict(fs.unshard(params)))
    _assert_runs_equal(run, _plain_flax_run(inner_dropout=True, steps=3))


class BatchNormModel(nnx.Module):
    """BatchNorm as Flax's examples write it: no `axis_name`."""

    def __init__(self, rngs):
        self.fc = fs.flax.fully_shard(nnx.Linear(4, 8, rngs=rngs))
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.norm(self.fc(x))))


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
def test_nnx_batch_norm_statistics_are_those_of_the_global_batch(mesh_name):
    """BatchNorm without `axis_name` inside a unit averages its moments over every data
    axis (SyncBatchNorm): two steps train as the unsharded model on the whole batch, and
    the running averages match (they used to come back stacked per device)."""
    model = fs.flax.fully_shard(BatchNormModel(nnx.Rngs(0)))
    graphdef, params, rest = fs.flax.shard(model, mesh_for(mesh_name), nnx.Param, ...)

    def loss_fn(params, batch, rest):
        model = fs.flax.merge(graphdef, params, rest)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    ref_graphdef, ref_params, ref_rest = nnx.split(BatchNormModel(nnx.Rngs(0)), nnx.Param, ...)

    def ref_loss(params, batch, rest):
        model = nnx.merge(ref_graphdef, params, rest, copy=True)
        loss = jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    sharded = jax.jit(fs.value_and_grad(loss_fn, has_aux=True))
    reference = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))
    opt_state, ref_opt_state = fs.init_optimizer(ADAM, params), ADAM.init(ref_params)
    step = _optax_step(ADAM)
    for i in range(2):
        batch = _dropout_batch(i)
        (loss, rest), grads = sharded(params, batch, rest)
        (ref, ref_rest), ref_grads = reference(ref_params, batch, ref_rest)
        np.testing.assert_allclose(loss, ref, rtol=1e-5)
        params, opt_state = step(grads, opt_state, params)
        ref_params, ref_opt_state = step(ref_grads, ref_opt_state, ref_params)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(params)), nnx.to_pure_dict(ref_params))
    assert_tree_close(nnx.to_pure_dict(rest), nnx.to_pure_dict(ref_rest))


def test_nnx_batch_norm_outside_every_unit_is_an_error():
    model = _abstract(lambda: BatchNormModel(nnx.Rngs(0)))  # only `fc` is a unit
    with pytest.raises(
        ValueError,
        match=r"model\.norm \(BatchNorm\) is in no unit.*"
        r"fs\.flax\.fully_shard\(model\)",
    ):
        fs.flax.shard(model, mesh_for("2"))


def test_apply_updates_with_written_state_it_does_not_hold_is_an_error():
    model = fs.flax.fully_shard(_abstract(lambda: DropoutModel(nnx.Rngs(0))))
    _, state = fs.flax.shard(model, mesh_for("2"))
    written = nnx.State({"other": {"count": nnx.BatchStat(jnp.zeros(()))}})
    with pytest.raises(ValueError, match=r"does not hold: state\.other\.count"):
        fs.flax.apply_updates(state, jax.tree.map(jnp.zeros_like, state), written)


def test_a_leftover_set_mesh_is_named():
    """Flax's tutorials call `jax.set_mesh`; another mesh left set is a clear error, not
    JAX's mesh mismatch inside the step. The state's own mesh may be set."""
    model = fs.flax.fully_shard(_abstract(lambda: DropoutModel(nnx.Rngs(0))))
    tutorial_mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(tutorial_mesh):
        with pytest.raises(
            ValueError,
            match=r"jax\.set_mesh \(axes data=8\).*remove the "
            r"jax\.set_mesh call",
        ):
            fs.flax.shard(model, mesh_for("8"))
        with pytest.raises(ValueError, match=r"fs\.flax\.plan: a mesh is set with jax\.set_mesh"):
            fs.flax.plan(model, mesh_for("8"))
    with jax.set_mesh(mesh_for("8")):
        fs.flax.shard(model, mesh_for("8"))


def test_nnx_write_back_into_uncopied_extra_state_is_a_clear_error():
    model = _abstract(lambda: NoisyModel(nnx.Rngs(0, dropout=1)))
    graphdef, params, rest = fs.flax.shard(model, mesh_for("4"), nnx.Param, ...)
    step = fs.value_and_grad(lambda p, b, r: _mse_aux(nnx.merge(graphdef, p, r), b), has_aux=True)
    with pytest.raises(ValueError, match=r"NoisyBlock\.norm\.mean.*fs\.flax\.merge"):
        jax.eval_shape(step, params, _noisy_batch(), rest)


def test_nnx_unit_policy_overrides_the_shard_policy():
    bf16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    f16 = fs.MixedPrecisionPolicy(param_dtype=jnp.float16)
    model = _abstract(lambda: Model(nnx.Rngs(0)))
    fs.flax.fully_shard(model.blocks[0], mp_policy=f16)
    fs.flax.fully_shard(model.blocks[1])
    fs.flax.fully_shard(model)
    _, state = fs.flax.shard(model, mesh_for("2"), mp_policy=bf16)
    assert state["blocks"][0]["fc"]["kernel"].get_value().mp_policy == f16
    assert state["blocks"][1]["fc"]["kernel"].get_value().mp_policy == bf16
    assert state["embed"]["embedding"].get_value().mp_policy == bf16


@settings(max_examples=5)
@given(marked=st.lists(st.booleans(), min_size=BLOCKS, max_size=BLOCKS), root=st.booleans())
def test_nnx_params_under_a_unit_are_sharded_the_rest_replicated(marked, root):
    """Whatever subset of modules is marked, a parameter is sharded iff a marked module
    holds it, and the sharded model runs (units gather, the rest is replicated)."""
    model = _abstract(lambda: Model(nnx.Rngs(0)))
    for block, mark in zip(model.blocks, marked, strict=True):
        if mark:
            fs.flax.fully_shard(block)
    if root:
        fs.flax.fully_shard(model)
    if not (root or any(marked)):
        with pytest.raises(ValueError, match="no unit marked"):
            fs.flax.shard(model, mesh_for("2"))
        return
    graphdef, state = fs.flax.shard(model, mesh_for("2"))
    for path, variable in nnx.to_flat_state(state):
        block = path[1] if path[0] == "blocks" else None
        owned = root or (block is not None and marked[block])
        assert _is_sharded(variable.get_value()) == owned, path
    out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, _batch()["x"])
    assert out.shape == (ROWS, SEQ, VOCAB)


class KeywordBlock(nnx.Module, pytree=False):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, h, *, scale=1.0, mask=None):
        out = self.fc(h) * scale
        return (out if mask is None else out * mask), {"label": "fc", "calls": 1}


def test_nnx_unit_keywords_static_outputs_and_class_options_pass_through():
    """Keyword arguments (arrays or not) reach the module, non-array outputs come back
    unchanged, and the unit class keeps nnx's `pytree=` option of the original class."""
    block = fs.flax.fully_shard(_abstract(lambda: KeywordBlock(nnx.Rngs(0))))
    assert type(block).__name__ == "FSDPKeywordBlock"
    assert not type(block)._pytree__is_pytree
    graphdef, state = fs.flax.shard(block, mesh_for("4"))

    def loss_fn(state, batch):
        out, info = nnx.merge(graphdef, state)(batch["x"], scale=2.0, mask=jnp.ones(4))
        assert info == {"label": "fc", "calls": 1}
        return jnp.mean(out**2)

    loss, grads = jax.eval_shape(fs.value_and_grad(loss_fn), state, _noisy_batch())
    assert loss.shape == () and _is_sharded(grads["fc"]["kernel"].get_value())


# --- linen ---------------------------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        h = h + nn.Dense(WIDTH)(_attention(nn.Dense(3 * WIDTH)(nn.LayerNorm()(h))))
        return h + nn.Dense(WIDTH)(jax.nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))))


class LinenModel(nn.Module):
    block: Any = LinenBlock

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(VOCAB, WIDTH)(tokens)
        for _ in range(BLOCKS):
            h = self.block()(h)
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def _linen_marked(reshard_after_forward=True):
    block = fs.flax.fully_shard(LinenBlock, reshard_after_forward=reshard_after_forward)
    return fs.flax.fully_shard(LinenModel, reshard_after_forward=reshard_after_forward)(block=block)


def _linen_loss(model):
    def loss_fn(params, batch):
        return _cross_entropy(model.apply({"params": params}, batch["x"]), batch["y"])

    return loss_fn


@pytest.fixture(scope="module")
def linen_step():
    model = _linen_marked()
    variables = model.init(jax.random.key(0), _batch()["x"])
    state = fs.shard(variables["params"], mesh_for("2x4"))
    exe, text = _compiled_step(_linen_loss(model), state, _batch())
    return dict(variables=variables, state=state, exe=exe, text=text)


def test_linen_init_gives_the_unmarked_models_variables(linen_step):
    want = LinenModel().init(jax.random.key(0), _batch()["x"])
    assert_tree_close(linen_step["variables"], want, atol=0, rtol=0)


def test_linen_gradients_match_the_unsharded_model_hsdp(linen_step):
    batch, params = _batch(), linen_step["variables"]["params"]
    loss, grads = linen_step["exe"](linen_step["state"], batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_linen_loss(LinenModel())))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert_tree_close(fs.unshard(grads), ref_grads)


def test_linen_one_gather_and_one_reduce_scatter_per_unit(linen_step):
    counts = count_by_kind(linen_step["text"])
    assert counts["all-gather"] == 2 * UNITS, counts
    assert counts["reduce-scatter"] == UNITS, counts
    assert _gathers_by_unit(linen_step["text"]) == {"LinenBlock": 2 * BLOCKS, "LinenModel": 2}


class LinenNoisyBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        norm = nn.BatchNorm(use_running_average=False, axis_name="fsdp")
        return h + nn.Dropout(0.5, deterministic=False)(norm(nn.Dense(4)(h)))


class LinenNoisyModel(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.Dense(1)(fs.flax.fully_shard(LinenNoisyBlock)()(h))


def test_linen_mutable_collections_and_rngs_inside_a_unit():
    """Batch statistics (synced over the shard axis) written inside a unit come back as
    `apply`'s mutable updates; dropout draws from the rngs passed to `apply`."""
    model = fs.flax.fully_shard(LinenNoisyModel)()
    batch = _noisy_batch()
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, batch["x"])
    params = fs.shard(variables["params"], mesh_for("8"))

    def loss_fn(params, batch, stats, key):
        out, updates = model.apply(
            {"params": params, "batch_stats": stats},
            batch["x"],
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), updates

    (_, updates), _ = jax.jit(fs.value_and_grad(loss_fn, has_aux=True))(
        params, batch, variables["batch_stats"], jax.random.key(2)
    )
    dense = nn.Dense(4).bind({"params": variables["params"]["LinenNoisyBlock_0"]["Dense_0"]})
    np.testing.assert_allclose(
        updates["batch_stats"]["LinenNoisyBlock_0"]["BatchNorm_0"]["mean"],
        0.01 * dense(batch["x"]).mean(0),
        rtol=1e-4,
        atol=1e-6,
    )


class LinenSetupDropoutBlock(nn.Module):
    def setup(self):
        self.dense = nn.Dense(4)
        self.drop = nn.Dropout(0.5, deterministic=False)

    def __call__(self, x):
        noise = jax.random.normal(self.make_rng("dropout"), x.shape)
        return self.drop(jnp.tanh(self.dense(x))) + 0.1 * noise


class LinenCompactDropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(jnp.tanh(nn.Dense(4)(x)))


class LinenDropoutModel(nn.Module):
    """One block instance called twice (its draws must differ between the calls, as
    linen counts them), a Dropout and a `make_rng` draw in the model's own scope."""

    block: Any

    @nn.compact
    def __call__(self, x):
        block = self.block()
        h = nn.Dropout(0.3, deterministic=False)(block(block(x)))
        h = h + 0.1 * jax.random.normal(self.make_rng("dropout"), h.shape)
        return nn.Dense(1)(h)


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("block", [LinenSetupDropoutBlock, LinenCompactDropoutBlock])
def test_linen_dropout_in_units_draws_the_unmarked_models_keys(block, mesh_name):
    """linen units apply their module with their scope's streams and counters: the keys,
    and so the loss and gradients with dropout on, are those of the unmarked model on the
    whole batch (a unit used to draw one key with `make_rng` and derive others from it)."""
    batch = _dropout_batch(0, rows=16)
    plain = LinenDropoutModel(block)
    variables = plain.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, batch["x"])
    model = fs.flax.fully_shard(LinenDropoutModel)(fs.flax.fully_shard(block))

    def loss_of(model):
        def loss_fn(params, batch, key):
            out = model.apply({"params": params}, batch["x"], rngs={"dropout": key})
            return jnp.mean((out - batch["y"]) ** 2)

        return loss_fn

    params = fs.shard(variables["params"], mesh_for(mesh_name))
    loss, grads = jax.jit(fs.value_and_grad(loss_of(model)))(params, batch, jax.random.key(2))
    ref, ref_grads = jax.value_and_grad(loss_of(plain))(
        variables["params"], batch, jax.random.key(2)
    )
    np.testing.assert_allclose(loss, ref, rtol=1e-6, atol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads, atol=1e-6)


def test_flax_plan_of_a_linen_model_predicts_the_compiled_step(linen_step):
    model = _linen_marked()
    plan = fs.flax.plan(model, variables=linen_step["state"], args=(_batch()["x"],))
    counts = count_by_kind(linen_step["text"])
    assert plan.count("all-gather") == counts["all-gather"] == 2 * UNITS
    assert plan.count("reduce-scatter") == counts["reduce-scatter"] == UNITS
    assert [u.name for u in plan.units] == ["LinenModel", "LinenBlock_0", "LinenBlock_1"]


class LinenTrainBlock(nn.Module):
    """A block taking `train: bool`, as Flax's examples write them (BatchNorm without
    `axis_name`)."""

    @nn.compact
    def __call__(self, h, train: bool):
        h = nn.Dense(8)(h)
        return jnp.tanh(nn.BatchNorm(use_running_average=not train, momentum=0.9)(h))


class LinenTrainModel(nn.Module):
    block: Any = LinenTrainBlock

    @nn.compact
    def __call__(self, x, train: bool = True):
        return nn.Dense(1)(self.block()(x, train=train))


def _linen_train_loss(model, train):
    def loss_fn(params, batch, batch_stats):
        out, updates = model.apply(
            {"params": params, "batch_stats": batch_stats},
            batch["x"],
            train,
            mutable=["batch_stats"],
        )
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

    return loss_fn


@pytest.mark.parametrize("train", [True, False])
def test_linen_static_train_argument_and_batch_norm_without_axis_name(train):
    """`train: bool` reaches every unit as a Python bool (static, as nn.remat's
    static_argnums); in training BatchNorm's statistics are the global batch's."""
    model = fs.flax.fully_shard(LinenTrainModel)(block=fs.flax.fully_shard(LinenTrainBlock))
    batch = _dropout_batch(0)
    variables = LinenTrainModel().init(jax.random.key(0), batch["x"], False)
    params = fs.shard(variables["params"], mesh_for("2x4"))
    (loss, stats), grads = jax.jit(
        fs.value_and_grad(_linen_train_loss(model, train), has_aux=True)
    )(params, batch, variables["batch_stats"])
    (ref, ref_stats), ref_grads = jax.jit(
        jax.value_and_grad(_linen_train_loss(LinenTrainModel(), train), has_aux=True)
    )(variables["params"], batch, variables["batch_stats"])
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    assert_tree_close(fs.unshard(grads), ref_grads)
    assert_tree_close(stats, ref_stats)


class BoxedBlock(nn.Module):
    """Parameters boxed by `nn.with_logical_partitioning`, as MaxText-style code does."""

    @nn.compact
    def __call__(self, h):
        dense = nn.Dense(
            8,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.lecun_normal(), ("embed", "mlp")
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
        )
        return jnp.tanh(dense(h))


class BoxedModel(nn.Module):
    block: Any = BoxedBlock

    @nn.compact
    def __call__(self, x):
        kernel_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "vocab"))
        return nn.Dense(1, kernel_init=kernel_init)(self.block()(x))


def test_linen_boxed_parameters_are_unboxed_by_the_units():
    model = fs.flax.fully_shard(BoxedModel)(block=fs.flax.fully_shard(BoxedBlock))
    batch = _dropout_batch(0)
    params = BoxedModel().init(jax.random.key(0), batch["x"])["params"]
    assert isinstance(params["BoxedBlock_0"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)

    def loss_fn(model):
        return lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

    loss, grads = jax.jit(fs.value_and_grad(loss_fn(model)))(fs.shard(params, mesh_for("8")), batch)
    ref, ref_grads = jax.jit(jax.value_and_grad(loss_fn(BoxedModel())))(params, batch)
    np.testing.assert_allclose(loss, ref, rtol=1e-5)
    # The gradients keep the boxes: optax updates the boxed tree as it is.
    assert isinstance(grads["BoxedBlock_0"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
    assert_tree_close(nn.unbox(fs.unshard(grads)), nn.unbox(ref_grads))


def test_linen_unit_policy_casts_its_computation():
    bf16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    block = fs.flax.fully_shard(LinenBlock, mp_policy=bf16)()
    h = jax.ShapeDtypeStruct((2, SEQ, WIDTH), jnp.float32)
    abstract = jax.eval_shape(block.init, jax.random.key(0), h)["params"]
    params = fs.shard(abstract, mesh_for("2"))  # abstract too: nothing runs
    assert jax.eval_shape(block.apply, {"params": params}, h).dtype == jnp.bfloat16


# --- errors --------------------------------------------------------------------------


def test_marking_a_module_twice_is_an_error():
    block = fs.flax.fully_shard(Block(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="Block is already a unit"):
        fs.flax.fully_shard(block)


def test_shard_of_an_unmarked_model_is_an_error():
    with pytest.raises(ValueError, match=r"Model\) has no unit.*fs\.flax\.fully_shard\(blk\)"):
        fs.flax.shard(Model(nnx.Rngs(0)), mesh_for("2"))


def test_shard_of_a_non_nnx_model_is_an_error():
    with pytest.raises(TypeError, match="expected an nnx.Module, got dict"):
        fs.flax.shard({"w": jnp.ones(4)}, mesh_for("2"))


def test_fully_shard_of_a_function_is_an_error():
    with pytest.raises(TypeError, match="expected an nnx.Module instance or a flax.linen"):
        fs.flax.fully_shard(jnp.tanh)


@pytest.mark.parametrize("value,error", [("yes", TypeError), (0, ValueError), (1.0, TypeError)])
def test_bad_reshard_after_forward_is_an_error(value, error):
    with pytest.raises(
        error, match="reshard_after_forward must be None, True, False or a positive"
    ):
        fs.flax.fully_shard(Block(nnx.Rngs(0)), reshard_after_forward=value)


def test_bad_mp_policy_is_an_error():
    with pytest.raises(TypeError, match="mp_policy must be an fs.MixedPrecisionPolicy"):
        fs.flax.fully_shard(Block(nnx.Rngs(0)), mp_policy="bf16")


def test_linen_instance_is_an_error():
    with pytest.raises(TypeError, match="linen units are marked on the class"):
        fs.flax.fully_shard(LinenBlock())


def test_marking_a_linen_class_twice_is_an_error():
    with pytest.raises(ValueError, match="LinenBlock \\(a linen class\\) is already a unit"):
        fs.flax.fully_shard(fs.flax.fully_shard(LinenBlock))


def test_errors_are_funshard_errors_of_the_same_builtin_type():
    block = fs.flax.fully_shard(Block(nnx.Rngs(0)))
    with pytest.raises(ValueError, match="Block is already a unit") as info:
        fs.flax.fully_shard(block)
    assert isinstance(info.value, fs.errors.ShardingValueError)
    with pytest.raises(TypeError, match="expected an nnx.Module, got dict") as info:
        fs.flax.shard({"w": jnp.ones(4)}, mesh_for("2"))
    assert isinstance(info.value, fs.errors.ShardingTypeError)
    assert isinstance(info.value, fs.errors.FunshardError)


def test_flax_plan_takes_its_units_from_the_model():
    model = fs.flax.fully_shard(_abstract(lambda: DropoutModel(nnx.Rngs(0))))
    with pytest.raises(TypeError, match="reshard_after_forward come from the model"):
        fs.flax.plan(model, mesh_for("2"), reshard_after_forward=False)
    with pytest.raises(TypeError, match="expected an nnx.Module marked"):
        fs.flax.plan({"w": jnp.ones(4)}, mesh_for("2"))


# --- model axes (tensor parallelism) through fs.flax.shard --------------------------------


class _TensorBlock(nnx.Module):
    """Column-parallel `up`, row-parallel `down`; `tensor` None is the plain model."""

    def __init__(self, rngs: nnx.Rngs, tensor: str | None = None):
        self.up = nnx.Linear(8, 12, rngs=rngs)
        self.down = nnx.Param(jax.random.normal(rngs.params(), (12, 8)) / 4)
        self.tensor = tensor

    def __call__(self, x):
        h = jax.nn.gelu(fs.column_parallel(x, self.up.kernel[...], self.up.bias[...]))
        if self.tensor:
            return x + fs.row_parallel(h, self.down[...], axis=self.tensor)
        return x + h @ self.down[...]


class _TensorModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, tensor: str | None = None):
        self.blocks = nnx.List([_TensorBlock(rngs, tensor) for _ in range(2)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _tensor_spec(path, array):
    name = jax.tree_util.keystr(path)
    if "['up']['kernel']" in name:
        return jax.sharding.PartitionSpec(None, "tensor")
    if "['up']['bias']" in name:
        return jax.sharding.PartitionSpec("tensor")
    if "['down']" in name:
        return jax.sharding.PartitionSpec("tensor", None)
    return None


@pytest.mark.slow
def test_nnx_units_with_tensor_parallel_params_match_the_unsharded_model():
    """fs.flax.shard(model_spec=...) on fsdp=4 x tensor=2: units gather model blocks
    (b_up 12 -> 6 per tensor rank, padded per block over fsdp), plain Flax's numbers."""
    x = jax.random.normal(jax.random.key(1), (16, 8))
    graphdef, params = nnx.split(_TensorModel(nnx.Rngs(0)))

    def reference(params):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

    want_loss, want = jax.value_and_grad(reference)(params)
    model = _TensorModel(nnx.Rngs(0), tensor="tensor")
    for block in model.blocks:
        fs.flax.fully_shard(block)
    fs.flax.fully_shard(model)
    axis_types = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=axis_types)
    sharded_graphdef, state = fs.flax.shard(model, mesh, model_spec=_tensor_spec)
    up = state["blocks"][0]["up"]["bias"].get_value()
    assert up.model_axes == (("tensor",),) and up.block_shape == (6,)

    def loss(s, b):
        return jnp.mean(nnx.merge(sharded_graphdef, s)(b) ** 2)

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(grads)), nnx.to_pure_dict(want))
