"""One process of a multi-process training run (started by tests/test_multiprocess.py).

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment, trains the transformer block of tests/_models.py for a few AdamW steps
feeding only this process's rows, and writes the losses and final parameters to
`<out>/result.npz` (process 0). The test process imports `train` and `global_batch`
to compute the single-process reference with the very same code.

    python tests/_mp_worker.py --out DIR --params PARAMS.npz --devices K [--replicate R]
        [--steps S] [--die-rank P --die-after-step T]
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Importing JAX does not start it: main sets the device count before initialize.
# _models comes from tests/, which is sys.path[0] when this file runs as a script.
import jax
import numpy as np
import optax
from _models import block_params, block_sharded_loss

import funshard as fs
import funshard.distributed

ROWS_PER_DEVICE = 2  # global batch = ROWS_PER_DEVICE * global device count
# Fast, unoptimised machine code: the step's compile time dominates these tests (every
# process compiles it, on few cores), and the test process compiles its reference the
# same way, so both run the very same program.
COMPILER_OPTIONS = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}
START = time.monotonic()
SEQ, VOCAB = 6, 11


def global_batch(step: int, rows: int):
    """The global token batch of `step` (the same on every process and in the test)."""
    return np.random.default_rng(100 + step).integers(0, VOCAB, (rows, SEQ), dtype=np.int32)


def load_params(path: str):
    """The block model's parameters saved by the test (numpy leaves, keystr keys)."""
    # eval_shape only traces: generating them here would compile jax.random per
    # shape, which costs seconds per process.
    like = jax.eval_shape(lambda: block_params(jax.random.key(1)))
    saved = np.load(path)
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return treedef.unflatten([saved[jax.tree_util.keystr(p)] for p, _ in paths])


def save_tree(path: str, tree, **extra) -> None:
    """Saves a pytree's leaves as numpy arrays keyed by their keystr path."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    flat = {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}
    np.savez(path, **flat, **extra)


def train(mesh, params, steps: int, rows_for_step, on_step=None):
    """Trains the block model on `mesh` from `params`: returns (losses, full params).

    `rows_for_step(step)` gives this process's rows of the step's global batch.
    """
    opt = optax.adamw(1e-2, weight_decay=0.1)
    state = fs.shard(params, mesh)
    # optax's step count starts on the default device; placing it on the mesh now
    # saves a second compilation of the step.
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(
        lambda x: jax.device_put(x, replicated) if x.ndim == 0 else x, opt.init(state)
    )
    loss_fn = fs.value_and_grad(block_sharded_loss(units=True, reshard_after_forward=True))

    def step(state, opt_state, batch):
        loss, grads = loss_fn(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    losses, compiled = [], None
    for i in range(steps):
        batch = funshard.distributed.shard_batch(rows_for_step(i), mesh)
        if compiled is None:
            lowered = jax.jit(step).lower(state, opt_state, batch)
            compiled = lowered.compile(compiler_options=COMPILER_OPTIONS)
        state, opt_state, loss = compiled(state, opt_state, batch)
        losses.append(float(loss))
        if on_step is not None:
            on_step(i, losses[-1])
    full = fs.unshard(state)
    return np.asarray(losses), jax.tree.map(np.asarray, full)


def _elapsed() -> str:
    return f"{time.monotonic() - START:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--params", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--replicate", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-after-step", type=int, default=-1)
    parser.add_argument("--save", default="", help="also write the final params here")
    args = parser.parse_args()

    jax.config.update("jax_num_cpu_devices", args.devices)  # before initialize
    # Registered before funshard's exit handler, so it runs after it: by then funshard's
    # watchdog thread must be gone (one still in a call on JAX's coordination client
    # during JAX's shutdown aborts the process after its work is done).
    atexit.register(
        lambda: print(
            "watchdog alive at exit: "
            f"{any(t.name == 'funshard-departure-watchdog' for t in threading.enumerate())}",
            flush=True,
        )
    )
    # fail_fast: a survivor of a killed peer exits at once (test_survivor_exits_promptly).
    mesh = funshard.distributed.initialize(replicate=args.replicate or None, fail_fast=True)
    assert funshard.distributed.initialize(replicate=args.replicate or None) == mesh
    rank, world = jax.process_index(), jax.process_count()
    owners = [d.process_index for d in mesh.devices.flat]
    assert owners == sorted(owners) and len(owners) == world * args.devices, owners
    rows = ROWS_PER_DEVICE * jax.device_count()
    mine = slice(rank * rows // world, (rank + 1) * rows // world)
    print(f"rank {rank}/{world}: mesh {dict(mesh.shape)} at {_elapsed()}", flush=True)

    def on_step(i, loss):
        print(f"rank {rank}: step {i} loss {loss:.6f} at {_elapsed()}", flush=True)
        if rank == args.die_rank and i == args.die_after_step:
            print(f"rank {rank}: dying now (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    params = load_params(args.params)
    losses, params = train(mesh, params, args.steps, lambda i: global_batch(i, rows)[mine], on_step)
    if args.save:  # every process writes the shards of its own devices
        fs.save(args.save, fs.shard(params, mesh))
    if rank == 0:
        save_tree(os.path.join(args.out, "result.npz"), params, losses=losses)
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
