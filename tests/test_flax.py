"""funshard.flax: nnx and linen models as FSDP units, checked against the unsharded model.

Every step is compiled once per case (module-scoped fixtures) and each test reads one
fact from it: gradients against plain `jax.grad` of the unsharded Flax model, collective
counts from the compiled HLO, training against plain optax.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import count_by_kind
from _util import assert_tree_close
from conftest import mesh_for
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

import funshard as fs
import funshard.flax  # noqa: F401  (fs.flax)

WIDTH, HEADS, VOCAB, SEQ, ROWS, BLOCKS = 16, 2, 32, 8, 8, 2
UNITS = BLOCKS + 1  # the blocks and the model (embedding, final norm, head)


def _attention(qkv):
    q, k, v = (t.reshape(*t.shape[:-1], HEADS, -1) for t in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
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
    def __init__(self, rngs, blocks=BLOCKS):
        self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(blocks)])
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


def _nnx_loss(graphdef):
    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        return _cross_entropy(model(batch["x"]), batch["y"])

    return loss_fn


def _nnx_reference(batch):
    """(loss, grads) of plain `jax.value_and_grad` on the unsharded model, one device."""
    graphdef, params = nnx.split(_nnx_model(mark=False))
    return jax.jit(jax.value_and_grad(_nnx_loss(graphdef)))(params, batch)


def _compiled_step(loss_fn, state, batch):
    exe = jax.jit(fs.value_and_grad(loss_fn)).lower(state, batch).compile()
    return exe, exe.as_text(), exe(state, batch)


@pytest.fixture(scope="module", params=[("8", True), ("2x4", True), ("8", False)],
                ids=["fsdp", "hsdp", "fsdp-keep"])
def nnx_step(request):
    mesh_name, reshard = request.param
    graphdef, state = fs.flax.shard(_nnx_model(reshard), mesh_for(mesh_name))
    batch = _batch()
    return dict(reshard=reshard, state=state, batch=batch,
                compiled=_compiled_step(_nnx_loss(graphdef), state, batch))


def test_nnx_gradients_match_the_unsharded_model(nnx_step):
    _, _, (loss, grads) = nnx_step["compiled"]
    ref_loss, ref_grads = _nnx_reference(nnx_step["batch"])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert_tree_close(nnx.to_pure_dict(fs.unshard(grads)), nnx.to_pure_dict(ref_grads))


def test_nnx_one_gather_and_one_reduce_scatter_per_unit(nnx_step):
    counts = count_by_kind(nnx_step["compiled"][1])
    regathers = UNITS if nnx_step["reshard"] else 0
    assert counts["all-gather"] == UNITS + regathers, counts
    assert counts["reduce-scatter"] == UNITS, counts


def test_nnx_parameters_sharded_like_fs_shard(nnx_step):
    state = nnx_step["state"]
    params = nnx.split(_nnx_model(mark=False))[1]
    want = fs.shard(params, nnx_step["state"]["head"]["kernel"].get_value().mesh)
    got_leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fs.Sharded))
    want_leaves = jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, fs.Sharded))
    assert [x.layout for x in got_leaves] == [x.layout for x in want_leaves]
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_array_equal(g.data, w.data)
