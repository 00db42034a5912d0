"""Train a small MLP with funshard on 8 simulated CPU devices.

Run: python examples/quickstart.py [--steps N]

Prints the loss as it trains and, at the end, the parameter and optimizer bytes each
device holds compared with the unsharded model.
"""

import argparse
import os

# Simulate 8 devices on the CPU; must happen before JAX initialises.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import funshard as fs  # noqa: E402

SIZES = (64, 256, 256, 10)


def init_params(key):
    keys = jax.random.split(key, len(SIZES) - 1)
    return [
        {"w": jax.random.normal(k, (i, o)) / jnp.sqrt(i), "b": jnp.zeros((o,))}
        for k, i, o in zip(keys, SIZES[:-1], SIZES[1:], strict=True)
    ]


def layer(p, h):
    return jax.nn.relu(h @ p["w"] + p["b"])


# One FSDP unit per layer: gathered just before it runs, freed after, gathered again for
# backward; its gradient is reduce-scattered as soon as backward leaves it.
unit = fs.fully_shard(layer)


def loss_fn(state, batch):
    """Runs on every device, on its slice of the batch."""
    x, y = batch
    for p in state[:-1]:
        x = unit(p, x)
    last = fs.unshard(state[-1])
    logits = x @ last["w"] + last["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_batch(key, rows=256):
    # A learnable task: the label is the argmax of a fixed projection of the input.
    x = jax.random.normal(key, (rows, SIZES[0]))
    y = jnp.argmax(x[:, : SIZES[-1]], axis=-1)
    return x, y


def per_device_bytes(tree) -> int:
    device = jax.devices()[0]
    return sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for s in leaf.addressable_shards
        if s.device == device
    )


def main(steps: int) -> None:
    mesh = fs.make_mesh()
    params = init_params(jax.random.key(0))
    state = fs.shard(params, mesh)
    opt = optax.adamw(3e-3, weight_decay=1e-4)
    # opt.init(state) with its step count on the mesh too: the step compiles once.
    opt_state = fs.init_optimizer(opt, state)

    @jax.jit
    def train_step(state, opt_state, batch):
        loss, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    print(f"devices: {len(jax.devices())} ({jax.devices()[0].platform}), mesh {dict(mesh.shape)}")
    for step in range(steps):
        batch = make_batch(jax.random.key(step))
        state, opt_state, loss = train_step(state, opt_state, batch)
        if step % 20 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {float(loss):.4f}")

    full = sum(p.nbytes for p in jax.tree.leaves(params))
    print(f"parameters: {full:,} bytes unsharded")
    print(
        f"per device: {per_device_bytes(state):,} bytes of parameters, "
        f"{per_device_bytes(opt_state):,} bytes of optimizer state"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
