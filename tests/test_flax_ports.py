"""Flax's own example models, trained sharded on 8 CPU devices against the unsharded model.

Each model is adapted from the Flax repository (google/flax, Apache License 2.0,
copyright the Flax Authors): tiny sizes, synthetic data, and the tensor-parallel
annotations of the tutorials left out, otherwise written as Flax writes it.

- nnx MNIST CNN: `docs_nnx/mnist_tutorial.md` (BatchNorm without `axis_name`, Dropout
  drawing from an `nnx.Rngs` passed at call time, `nnx.view` for train/eval modes).
- nnx miniGPT: `docs_nnx/examples/minigpt.md` (MultiHeadAttention, Dropout with streams
  given at construction, `nnx.Sequential` blocks).
- linen lm1b TransformerLM: `examples/lm1b/models.py` (every parameter boxed by
  `nn.with_logical_partitioning`, config-controlled dropout, a token-weighted loss).
- linen ResNet: `examples/imagenet/models.py` (BatchNorm with `axis_name='batch'` as
  shipped, `train: bool` argument, `batch_stats` collection).

Every port runs the recipe docs/flax.md shows for it, for a few optimizer steps, and
compares losses, parameters and batch statistics with the same model trained by plain
JAX + optax on one device with the whole batch, Dropout included: the step draws each
device's rows of the masks the unsharded model draws on the whole batch from the same
streams (docs/concepts.md, "Randomness"). miniGPT and lm1b run with Dropout off and on.
"""

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import assert_tree_close
from conftest import mesh_for
from flax import nnx, struct

import funshard as fs
import funshard.flax

pytestmark = pytest.mark.slow

STEPS = 3
ROWS = 16  # 2 examples per device

# LLVM's optimizations change neither the program nor its float semantics, only how
# long XLA CPU takes to compile it (convolutions: ~10x); the suite runs on 2 cores.
_jit = partial(
    jax.jit,
    compiler_options={
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    },
)


@cache
def _nnx_init(make: Callable) -> tuple:
    """(graphdef, state) of the nnx model `make()` builds, initialised in one program."""
    graphdef = nnx.split(nnx.eval_shape(make))[0]
    return graphdef, _jit(lambda: nnx.split(make())[1])()


def _nnx_model(make: Callable):
    """A fresh model object with `make`'s initial values (each caller marks its own)."""
    return nnx.merge(*_nnx_init(make))


def _flax_shard(model, mesh, *filters):
    """`fs.flax.shard(model, mesh, *filters)` as one compiled program (docs/flax.md,
    "Sharded initialisation"); eager, each leaf shape would compile its own padding."""
    graphdef, state = nnx.split(model)
    structure = fs.flax.shard(nnx.eval_shape(lambda: nnx.merge(graphdef, state)), mesh)[0]
    states = _jit(lambda s: fs.flax.shard(nnx.merge(graphdef, s), mesh, *filters)[1:])(state)
    return (structure, *states)


def _shard(params, mesh):
    """`fs.shard(params, mesh)` as one compiled program (see `_flax_shard`)."""
    return _jit(lambda p: fs.shard(p, mesh))(params)


def _assert_losses_close(got, want, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=1e-6)


# --- nnx: the MNIST tutorial's CNN ----------------------------------------------------


class CNN(nnx.Module):
    """The tutorial's CNN at 8x8 pixels (two conv + BatchNorm stages, two dense)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(4, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025)
        self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(8, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(32, 16, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025)
        self.linear2 = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def _cnn():
    return CNN(rngs=nnx.Rngs(0))


def _mnist_batches():
    rng = np.random.default_rng(11)
    return [
        {
            "image": rng.normal(size=(ROWS, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, ROWS),
        }
        for _ in range(STEPS)
    ]


# The tutorial's AdamW, with eps well above float32 noise: a conv bias in front of a
# BatchNorm has a true gradient of 0, and Adam would scale the noise in it (different
# in the sharded and the unsharded reduction orders) to steps of the learning rate.
MNIST_OPT = optax.adamw(0.005, 0.9, eps=1e-3)


def _mnist_loss(model, batch, rngs):
    logits = model(batch["image"], rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def _mnist_sharded():
    """docs/flax.md's one-state recipe: fs.flax.shard + nnx.merge, a trainable mask, and
    Dropout on, drawing from an `nnx.Rngs` passed to the call as the tutorial does."""
    model = _nnx_model(_cnn)
    for layer in (model.conv1, model.conv2):
        fs.flax.fully_shard(layer)
    fs.flax.fully_shard(model)
    model = nnx.view(model, deterministic=False, use_running_average=False)
    graphdef, state = _flax_shard(model, mesh_for("8"))
    mask = fs.flax.trainable(state)
    opt = optax.masked(MNIST_OPT, mask)

    def loss_fn(state, batch, key):
        model = nnx.merge(graphdef, state)
        loss = _mnist_loss(model, batch, nnx.Rngs(dropout=key))
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    step = fs.value_and_grad(loss_fn, has_aux=True, trainable=mask)

    @_jit
    def train_step(state, opt_state, batch, key):
        (loss, written), grads = step(state, batch, key)
        updates, opt_state = opt.update(grads, opt_state, state)
        return fs.flax.apply_updates(state, updates, written), opt_state, loss

    opt_state = fs.init_optimizer(opt, state)
    losses = []
    for i, batch in enumerate(_mnist_batches()):
        state, opt_state, loss = train_step(state, opt_state, batch, jax.random.key(i))
        losses.append(loss)
    return state, losses


def _mnist_reference():
    """The tutorial's model trained by plain JAX + optax on one device, with the same
    dropout keys."""
    model = nnx.view(_nnx_model(_cnn), deterministic=False, use_running_average=False)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest, batch, key):
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss = _mnist_loss(model, batch, nnx.Rngs(dropout=key))
        return loss, nnx.state(model, nnx.Not(nnx.Param))

    @_jit
    def train_step(params, rest, opt_state, batch, key):
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch, key)
        updates, opt_state = MNIST_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = MNIST_OPT.init(params), []
    for i, batch in enumerate(_mnist_batches()):
        params, rest, opt_state, loss = train_step(
            params, rest, opt_state, batch, jax.random.key(i)
        )
        losses.append(loss)
    return nnx.merge_state(params, rest), losses


def test_mnist_cnn_trains_like_the_unsharded_model():
    """Conv kernels, BatchNorm (synced over the 8 devices: the global batch's
    statistics) and running averages after three AdamW steps with Dropout on equal one
    device's."""
    state, losses = _mnist_sharded()
    want, want_losses = _mnist_reference()
    _assert_losses_close(losses, want_losses)
    trained = nnx.filter_state(fs.unshard(state), nnx.Any(nnx.Param, nnx.BatchStat))
    got = nnx.to_pure_dict(trained)
    assert_tree_close(got, nnx.to_pure_dict(want), rtol=1e-4, atol=1e-5)


# --- nnx: the miniGPT tutorial --------------------------------------------------------

MAXLEN, GPT_VOCAB, EMBED, GPT_HEADS, FF, GPT_BLOCKS = 8, 32, 16, 2, 32, 2


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs),
            nnx.relu,
            nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb(x) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
    def __init__(
        self,
        maxlen,
        vocab_size,
        embed_dim,
        num_heads,
        feed_forward_dim,
        num_transformer_blocks,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                for _ in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return self.output_layer(x)


def _minigpt():
    return MiniGPT(MAXLEN, GPT_VOCAB, EMBED, GPT_HEADS, FF, GPT_BLOCKS, rngs=nnx.Rngs(0))


def _gpt(deterministic: bool, mark: bool):
    model = _nnx_model(_minigpt)
    if mark:
        for block in model.transformer_blocks.layers:
            fs.flax.fully_shard(block)
        fs.flax.fully_shard(model)
    return nnx.view(model, deterministic=deterministic)


def _gpt_batches():
    tokens = np.random.default_rng(3).integers(0, GPT_VOCAB, (STEPS, ROWS, MAXLEN + 1))
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


# The tutorial's Adam, eps above float32 noise: the attention's key bias has a true
# gradient of 0 (softmax ignores a shift shared by every key), as the MNIST CNN's biases.
GPT_OPT = optax.adam(1e-3, eps=1e-3)


def _gpt_loss(model, batch):
    logits = model(batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()


def _gpt_sharded(deterministic: bool):
    """docs/flax.md's two-state recipe: parameters differentiated, the rest passed along."""
    graphdef, params, rest = _flax_shard(_gpt(deterministic, True), mesh_for("8"), nnx.Param, ...)

    def loss_fn(params, batch, rest):
        model = fs.flax.merge(graphdef, params, rest)
        return _gpt_loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    @_jit
    def train_step(params, rest, opt_state, batch):
        (loss, rest), grads = fs.value_and_grad(loss_fn, has_aux=True)(params, batch, rest)
        updates, opt_state = GPT_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = fs.init_optimizer(GPT_OPT, params), []
    for batch in _gpt_batches():
        params, rest, opt_state, loss = train_step(params, rest, opt_state, batch)
        losses.append(loss)
    return params, rest, losses


def _gpt_reference(deterministic: bool):
    """Plain JAX + optax on one device, the Dropout streams carried from step to step."""
    graphdef, params, rest = nnx.split(_gpt(deterministic, False), nnx.Param, ...)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return _gpt_loss(model, batch), nnx.state(model, nnx.Not(nnx.Param))

    @_jit
    def train_step(params, rest, opt_state, batch):
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
        updates, opt_state = GPT_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    opt_state, losses = GPT_OPT.init(params), []
    for batch in _gpt_batches():
        params, rest, opt_state, loss = train_step(params, rest, opt_state, batch)
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("deterministic", [True, False], ids=["dropout-off", "dropout-on"])
def test_minigpt_trains_like_the_unsharded_model(deterministic):
    """Losses and parameters after three Adam steps equal one device's, with Dropout on
    the same masks as the unsharded model's on the whole batch."""
    params, rest, losses = _gpt_sharded(deterministic)
    want, want_losses = _gpt_reference(deterministic)
    _assert_losses_close(losses, want_losses)
    assert_tree_close(
        nnx.to_pure_dict(fs.unshard(params)), nnx.to_pure_dict(want), rtol=1e-4, atol=1e-5
    )
    if deterministic:
        return
    # Dropout's streams advance once per Dropout call and step (back through the aux).
    counts = [
        v.get_value()
        for path, v in nnx.to_flat_state(rest)
        if isinstance(v, nnx.RngCount) and "dropout1" in path
    ]
    assert counts and all(int(c) == STEPS for c in counts), counts


# --- linen: lm1b's TransformerLM -------------------------------------------------------


@struct.dataclass
class TransformerConfig:
    vocab_size: int
    output_vocab_size: int
    dtype: Any = jnp.float32
    emb_dim: int = 16
    num_heads: int = 2
    num_layers: int = 2
    qkv_dim: int = 16
    mlp_dim: int = 32
    max_len: int = 16
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x, axis=1):
    pad_widths = [(0, 0)] * len(x.shape)
    pad_widths[axis] = (1, 0)
    padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
    return jax.lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


def sinusoidal_init(max_len=2048, min_scale=1.0, max_scale=10000.0):
    def init(key, shape, dtype=np.float32):
        d_feature = shape[-1]
        pe = np.zeros((max_len, d_feature), dtype=np.float32)
        position = np.arange(0, max_len)[:, np.newaxis]
        scale_factor = -np.log(max_scale / min_scale) / (d_feature // 2 - 1)
        div_term = min_scale * np.exp(np.arange(0, d_feature // 2) * scale_factor)
        pe[:, : d_feature // 2] = np.sin(position * div_term)
        pe[:, d_feature // 2 : 2 * (d_feature // 2)] = np.cos(position * div_term)
        return jnp.array(pe[np.newaxis, :, :])

    return init


def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class AddPositionEmbs(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        pos_embedding = sinusoidal_init(max_len=config.max_len)(
            None, (1, config.max_len, inputs.shape[-1]), None
        )
        return inputs + pos_embedding[:, : inputs.shape[1], :]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        x = nn.Dense(
            config.mlp_dim,
            dtype=config.dtype,
            kernel_init=_logical(config.kernel_init, ("embed", "mlp")),
            bias_init=_logical(config.bias_init, ("mlp",)),
        )(inputs)
        x = nn.relu(x)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        output = nn.Dense(
            inputs.shape[-1],
            dtype=config.dtype,
            kernel_init=_logical(config.kernel_init, ("mlp", "embed")),
            bias_init=_logical(config.bias_init, ("embed",)),
        )(x)
        return nn.Dropout(rate=config.dropout_rate)(output, deterministic=config.deterministic)


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        config = self.config
        x = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=_logical(nn.initializers.zeros, ("embed",)),
            scale_init=_logical(nn.initializers.ones, ("embed",)),
        )(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=config.num_heads,
            dtype=config.dtype,
            qkv_features=config.qkv_dim,
            kernel_init=_logical(config.kernel_init, ("embed", "kv")),
            bias_init=_logical(config.bias_init, ("embed",)),
            use_bias=False,
            broadcast_dropout=False,
            dropout_rate=config.attention_dropout_rate,
            deterministic=config.deterministic,
        )(x, mask=decoder_mask)
        x = nn.Dropout(rate=config.dropout_rate)(x, deterministic=config.deterministic)
        x = x + inputs
        z = nn.LayerNorm(
            dtype=config.dtype,
            bias_init=_logical(nn.initializers.zeros, ("embed",)),
            scale_init=_logical(nn.initializers.ones, ("embed",)),
        )(x)
        return x + MlpBlock(config=config)(z)


class Decoder(nn.Module):
    config: TransformerConfig
    block: Any = EncoderDecoder1DBlock  # adapted: the block class, so it can be a unit

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        config = self.config
        output_embed = nn.Embed(
            num_embeddings=config.output_vocab_size,
            features=config.emb_dim,
            embedding_init=_logical(nn.initializers.normal(stddev=1.0), ("vocab", "embed")),
        )
        y = shift_right(inputs.astype("int32"))
        y = output_embed(y)
        y = AddPositionEmbs(config=config, name="posembed_output")(y)
        y = nn.Dropout(rate=config.dropout_rate)(y, deterministic=config.deterministic)
        y = y.astype(config.dtype)
        for lyr in range(config.num_layers):
            y = self.block(config=config, name=f"encoderdecoderblock_{lyr}")(
                y, decoder_mask=decoder_mask
            )
        y = nn.LayerNorm(
            dtype=config.dtype,
            name="encoderdecoder_norm",
            bias_init=_logical(nn.initializers.zeros, ("embed",)),
            scale_init=_logical(nn.initializers.ones, ("embed",)),
        )(y)
        return nn.Dense(
            config.output_vocab_size,
            dtype=config.dtype,
            kernel_init=_logical(config.kernel_init, ("embed", "vocab")),
            bias_init=_logical(config.bias_init, ("vocab",)),
            name="logitdense",
        )(y)


class TransformerLM(nn.Module):
    config: TransformerConfig
    block: Any = EncoderDecoder1DBlock

    @nn.compact
    def __call__(self, inputs):
        config = self.config
        decoder_mask = nn.combine_masks(
            nn.make_attention_mask(inputs > 0, inputs > 0, dtype=config.dtype),
            nn.make_causal_mask(inputs, dtype=config.dtype),
        )
        logits = Decoder(config=config, block=self.block, name="decoder")(
            inputs, decoder_mask=decoder_mask
        )
        return logits.astype(self.config.dtype)


def compute_weighted_cross_entropy(logits, targets, weights):
    """lm1b's loss without label smoothing: (summed token losses, summed weights)."""
    soft_targets = jax.nn.one_hot(targets, logits.shape[-1])
    loss = -jnp.sum(soft_targets * nn.log_softmax(logits), axis=-1)
    return (loss * weights).sum(), weights.sum()


LM_VOCAB, LM_LEN = 32, 8
LM_OPT = optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-6, weight_decay=0.1)


def _lm_batches():
    rng, batches = np.random.default_rng(5), []
    for _ in range(STEPS):
        tokens = rng.integers(1, LM_VOCAB, (ROWS, LM_LEN))
        lengths = rng.integers(3, LM_LEN + 1, (ROWS, 1))  # padded with 0 after
        batches.append({"inputs": np.where(np.arange(LM_LEN) < lengths, tokens, 0)})
    return batches


def _lm(deterministic: bool, mark: bool):
    config = TransformerConfig(LM_VOCAB, LM_VOCAB, deterministic=deterministic)
    if not mark:
        return TransformerLM(config)
    return fs.flax.fully_shard(TransformerLM)(
        config, block=fs.flax.fully_shard(EncoderDecoder1DBlock)
    )


@cache
def _lm_variables():
    return _jit(_lm(True, False).init)(jax.random.key(0), _lm_batches()[0]["inputs"])


def _lm_sharded(deterministic: bool):
    """docs/flax.md's linen recipe with boxed parameters and an already-reduced loss."""
    model = _lm(deterministic, True)
    params = _shard(_lm_variables()["params"], mesh_for("8"))  # boxes and all

    def loss_fn(params, batch, dropout_rng):
        inputs = batch["inputs"]
        logits = model.apply({"params": params}, inputs, rngs={"dropout": dropout_rng})
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights)
        # Tokens per device differ: the global mean is the summed losses over the
        # summed weights (a loss already reduced is not averaged again by the root).
        return jax.lax.psum(loss, "fsdp") / jax.lax.psum(weight_sum, "fsdp")

    @_jit
    def train_step(params, opt_state, batch, step):
        dropout_rng = jax.random.fold_in(jax.random.key(1), step)
        loss, grads = fs.value_and_grad(loss_fn)(params, batch, dropout_rng)
        updates, opt_state = LM_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = fs.init_optimizer(LM_OPT, params), []
    for i, batch in enumerate(_lm_batches()):
        params, opt_state, loss = train_step(params, opt_state, batch, i)
        losses.append(loss)
    return params, losses


def _lm_reference(deterministic: bool):
    model, params = _lm(deterministic, False), _lm_variables()["params"]

    def loss_fn(params, batch, dropout_rng):
        inputs = batch["inputs"]
        logits = model.apply({"params": params}, inputs, rngs={"dropout": dropout_rng})
        weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights)
        return loss / weight_sum

    @_jit
    def train_step(params, opt_state, batch, step):
        dropout_rng = jax.random.fold_in(jax.random.key(1), step)
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_rng)
        updates, opt_state = LM_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = LM_OPT.init(params), []
    for i, batch in enumerate(_lm_batches()):
        params, opt_state, loss = train_step(params, opt_state, batch, i)
        losses.append(loss)
    return params, losses


@pytest.mark.parametrize("deterministic", [True, False], ids=["dropout-off", "dropout-on"])
def test_lm1b_transformer_trains_like_the_unsharded_model(deterministic):
    """Losses and parameters after three steps equal one device's, with Dropout (and
    attention dropout) on the same masks as the unsharded model's on the whole batch."""
    params, losses = _lm_sharded(deterministic)
    want, want_losses = _lm_reference(deterministic)
    _assert_losses_close(losses, want_losses)
    assert_tree_close(nn.unbox(fs.unshard(params)), nn.unbox(want), rtol=1e-4, atol=1e-5)


# --- linen: the ImageNet example's ResNet ---------------------------------------------

ModuleDef = Any


class ResNetBlock(nn.Module):
    filters: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.norm()(y)
        y = self.act(y)
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    stage_sizes: Any
    block_cls: ModuleDef
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    act: Callable = nn.relu
    conv: ModuleDef = nn.Conv

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = partial(self.conv, use_bias=False, dtype=self.dtype)
        norm = partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
            axis_name="batch",
        )
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = norm(name="bn_init")(x)
        x = nn.relu(x)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = self.block_cls(
                    self.num_filters * 2**i, strides=strides, conv=conv, norm=norm, act=self.act
                )(x)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ResNetTiny = partial(ResNet, stage_sizes=[1, 1], num_classes=10, num_filters=4)
RESNET_OPT = optax.sgd(0.1, momentum=0.9, nesterov=True)


def _images():
    rng = np.random.default_rng(8)
    return [
        {
            "image": rng.normal(size=(ROWS, 16, 16, 3)).astype(np.float32),
            "label": rng.integers(0, 10, ROWS),
        }
        for _ in range(STEPS)
    ]


def _resnet_loss(logits, labels):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()


def _resnet_variables():
    init = partial(ResNetTiny(block_cls=ResNetBlock).init, train=False)
    return _jit(init)(jax.random.key(0), jnp.ones((1, 16, 16, 3)))


def _as_pmapped(fn):
    """`fn` with the 'batch' axis bound over one device, as the example's pmap binds it."""
    return lambda *a: jax.tree.map(
        lambda x: x[0],
        jax.vmap(lambda *b: fn(*b), axis_name="batch", in_axes=None, axis_size=1)(*a),
    )


@pytest.fixture(scope="module")
def resnet_runs():
    variables = _resnet_variables()
    # ResNetTiny is a functools.partial of ResNet, as the example's ResNet18 is.
    model = fs.flax.fully_shard(ResNetTiny)(block_cls=fs.flax.fully_shard(ResNetBlock))
    params = _shard(variables["params"], mesh_for("8"))
    stats = variables["batch_stats"]

    def loss_fn(params, batch, batch_stats):
        logits, new_state = model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["image"], mutable=["batch_stats"]
        )
        return _resnet_loss(logits, batch["label"]), new_state["batch_stats"]

    @_jit
    def train_step(params, batch_stats, opt_state, batch):
        (loss, batch_stats), grads = fs.value_and_grad(loss_fn, has_aux=True)(
            params, batch, batch_stats
        )
        updates, opt_state = RESNET_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    reference_model = ResNetTiny(block_cls=ResNetBlock)

    def reference_loss(params, batch_stats, batch):
        logits, new_state = reference_model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["image"], mutable=["batch_stats"]
        )
        return _resnet_loss(logits, batch["label"]), new_state["batch_stats"]

    @_jit
    @_as_pmapped
    def reference_step(params, batch_stats, opt_state, batch):
        (loss, batch_stats), grads = jax.value_and_grad(reference_loss, has_aux=True)(
            params, batch_stats, batch
        )
        updates, opt_state = RESNET_OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    runs = {}
    for name, step, p in (
        ("sharded", train_step, params),
        ("reference", reference_step, variables["params"]),
    ):
        s, opt_state, losses = stats, RESNET_OPT.init(p), []
        if name == "sharded":
            opt_state = fs.init_optimizer(RESNET_OPT, p)
        for batch in _images():
            p, s, opt_state, loss = step(p, s, opt_state, batch)
            losses.append(loss)
        runs[name] = dict(params=p, batch_stats=s, losses=losses)
    runs["model"], runs["reference_model"] = model, reference_model
    return runs


def test_resnet_trains_like_the_unsharded_model(resnet_runs):
    """The example's ResNet, unchanged (BatchNorm's axis_name='batch' included), against
    the same model on one device with 'batch' bound as pmap binds it: losses,
    parameters and running statistics after three SGD steps."""
    got, want = resnet_runs["sharded"], resnet_runs["reference"]
    _assert_losses_close(got["losses"], want["losses"])
    assert_tree_close(fs.unshard(got["params"]), want["params"], rtol=1e-4, atol=1e-5)
    assert_tree_close(got["batch_stats"], want["batch_stats"], rtol=1e-4, atol=1e-5)


def test_resnet_evaluates_with_the_running_statistics(resnet_runs):
    """`train=False` (a static argument of the model's unit) reads the running averages;
    outside a step the units gather their parameters and run, for evaluation."""
    got, want = resnet_runs["sharded"], resnet_runs["reference"]
    image = _images()[0]["image"]

    def evaluate(model, params, batch_stats):
        return _jit(partial(model.apply, train=False))(
            {"params": params, "batch_stats": batch_stats}, image
        )

    logits = evaluate(resnet_runs["model"], got["params"], got["batch_stats"])
    want_logits = evaluate(resnet_runs["reference_model"], want["params"], want["batch_stats"])
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
