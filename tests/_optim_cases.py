"""What the optimizer tests share: a loss whose gradient differs per element and per step,
its batches, plain optax's reference on one device, and the sharded training step."""

import jax
import jax.numpy as jnp
import optax

import funshard as fs


def random_tree(shapes: dict, seed: int) -> dict:
    """Normal arrays of `shapes`, one key per leaf."""
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes.items(), strict=True)}


def loss(params, targets, batch):
    # A gradient that differs per element and per step (the batch scales the targets).
    scale = jnp.mean(batch)
    return sum(jnp.mean((jnp.tanh(params[k]) - scale * targets[k]) ** 2) for k in params)


def batches(steps: int = 3) -> list:
    return [jnp.arange(8.0) / 8 + step for step in range(steps)]


@jax.jit(static_argnums=0)
def reference(make_opt, params, targets, batches):
    """Plain optax on the unsharded parameters, one device (jitted: op by op, adafactor's
    many small operations would each compile)."""
    opt = make_opt()
    opt_state = opt.init(params)
    for batch in batches:
        grads = jax.grad(loss)(params, targets, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def sharded_step(opt, targets):
    """The jitted step `(state, opt_state, batch) -> (state, opt_state)` with `opt`."""

    def loss_fn(state, batch):
        return loss(fs.unshard(state), targets, batch)

    @jax.jit
    def step(state, opt_state, batch):
        _, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    return step
