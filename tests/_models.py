"""Small reference models (plain JAX) and their funshard-sharded forms for the tests."""

import jax
import jax.numpy as jnp

import funshard as fs


def mlp_params(key, sizes=(13, 32, 24, 5)):
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        "layers": [
            {"w": jax.random.normal(k, (i, o)) / jnp.sqrt(i), "b": jnp.full((o,), 0.1)}
            for k, i, o in zip(keys, sizes[:-1], sizes[1:], strict=True)
        ],
        "scale": jnp.float32(1.5),  # a 0-d leaf: replicated, all-reduced gradient
    }


def mlp_layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def mlp_apply(params, x):
    for p in params["layers"]:
        x = mlp_layer(p, x)
    return x * params["scale"]


def mse(pred, y):
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def mlp_loss(params, batch):
    x, y = batch
    return mse(mlp_apply(params, x), y)


def mlp_sharded_loss(units: bool, reshard_after_forward: bool = True):
    """The per-device loss on a sharded MLP state: whole-model gather or one unit per layer."""
    layer = fs.fully_shard(mlp_layer, reshard_after_forward=reshard_after_forward)

    def loss(state, batch):
        x, y = batch
        if not units:
            return mlp_loss(fs.unshard(state), batch)
        for p in state["layers"]:
            x = layer(p, x)
        return mse(x * state["scale"], y)

    return loss


HEADS = 2


def block_params(key, d=16, ff=40, vocab=11):
    k = jax.random.split(key, 6)
    n = lambda kk, shape: jax.random.normal(kk, shape) / jnp.sqrt(shape[0])  # noqa: E731
    return {
        "embed": n(k[0], (vocab, d)),
        "block": {
            "ln": jnp.ones((d,)),
            "qkv": n(k[1], (d, 3 * d)),
            "proj": n(k[2], (d, d)),
            "ff1": n(k[3], (d, ff)),
            "ff2": n(k[4], (ff, d)),
            "ff_b": jnp.zeros((ff,)),
        },
        "head": n(k[5], (d, vocab)),
    }


def _norm(x, g):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g


def block_apply(p, h, heads):
    b, t, d = h.shape
    q, k, v = jnp.split(_norm(h, p["ln"]) @ p["qkv"], 3, axis=-1)
    split = lambda a: a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3)  # noqa: E731
    att = split(q) @ split(k).transpose(0, 1, 3, 2) / jnp.sqrt(d // heads)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
    o = (jax.nn.softmax(att, -1) @ split(v)).transpose(0, 2, 1, 3).reshape(b, t, d)
    h = h + o @ p["proj"]
    return h + jax.nn.gelu(_norm(h, p["ln"]) @ p["ff1"] + p["ff_b"]) @ p["ff2"]


def lm_loss_from_logits(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def block_loss(params, tokens):
    h = params["embed"][tokens]
    h = block_apply(params["block"], h, HEADS)
    return lm_loss_from_logits(h @ params["head"], tokens)


# Parameters and one-device references for tests that need only their values, jitted:
# one program each (shared by every test of a process) instead of a compile per eager op.
jitted_mlp_params = jax.jit(mlp_params, static_argnames="sizes")
jitted_block_params = jax.jit(block_params, static_argnames=("d", "ff", "vocab"))
mlp_reference = jax.jit(jax.value_and_grad(mlp_loss))
block_reference = jax.jit(jax.value_and_grad(block_loss))


def block_sharded_loss(units: bool, reshard_after_forward: bool = True):
    unit = fs.fully_shard(
        lambda p, h: block_apply(p, h, HEADS), reshard_after_forward=reshard_after_forward
    )

    def loss(state, tokens):
        if not units:
            return block_loss(fs.unshard(state), tokens)
        outer = fs.unshard({"embed": state["embed"], "head": state["head"]})
        h = outer["embed"][tokens]
        h = unit(state["block"], h)
        return lm_loss_from_logits(h @ outer["head"], tokens)

    return loss
