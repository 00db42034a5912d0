"""One process of a multi-process training run (started by tests/test_multiprocess.py).

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the
environment, trains the transformer block of tests/_models.py for a few AdamW steps
feeding only this process's rows, and writes the losses and final parameters to
`<out>/result.npz` (process 0). The test process imports `train` and `global_batch`
to compute the single-process reference with the very same code.

    python tests/_mp_worker.py --out DIR --devices K [--replicate R] [--steps S]
        [--die-rank P --die-after-step T] [--heartbeat-timeout SECONDS]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

ROWS_PER_DEVICE = 2  # global batch = ROWS_PER_DEVICE * global device count
SEQ, VOCAB = 6, 11


def global_batch(step: int, rows: int):
    """The global token batch of `step` (the same on every process and in the test)."""
    import numpy as np

    return np.random.default_rng(100 + step).integers(0, VOCAB, (rows, SEQ), dtype=np.int32)


def train(mesh, steps: int, rows_for_step, on_step=None):
    """Trains the block model on `mesh`: returns (losses, full params as numpy).

    `rows_for_step(step)` gives this process's rows of the step's global batch.
    """
    import jax
    import numpy as np
    import optax

    import funshard as fs
    import funshard.distributed
    from _models import block_params, block_sharded_loss

    opt = optax.adamw(1e-2, weight_decay=0.1)
    state = fs.shard(block_params(jax.random.key(1)), mesh)
    opt_state = opt.init(state)
    loss_fn = fs.value_and_grad(block_sharded_loss(units=True, reshard_after_forward=True))

    @jax.jit
    def step(state, opt_state, batch):
        loss, grads = loss_fn(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    losses = []
    for i in range(steps):
        batch = funshard.distributed.shard_batch(rows_for_step(i), mesh)
        state, opt_state, loss = step(state, opt_state, batch)
        losses.append(float(loss))
        if on_step is not None:
            on_step(i, losses[-1])
    full = fs.unshard(state)
    return np.asarray(losses), jax.tree.map(np.asarray, full)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--replicate", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-after-step", type=int, default=-1)
    parser.add_argument("--heartbeat-timeout", type=int, default=None)
    args = parser.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np

    import funshard.distributed

    extra = {} if args.heartbeat_timeout is None else {"heartbeat_timeout": args.heartbeat_timeout}
    mesh = funshard.distributed.initialize(replicate=args.replicate or None, **extra)
    rank, world = jax.process_index(), jax.process_count()
    rows = ROWS_PER_DEVICE * jax.device_count()
    mine = slice(rank * rows // world, (rank + 1) * rows // world)
    print(f"rank {rank}/{world}: mesh {dict(mesh.shape)}", flush=True)

    def on_step(i, loss):
        print(f"rank {rank}: step {i} loss {loss:.6f}", flush=True)
        if rank == args.die_rank and i == args.die_after_step:
            print(f"rank {rank}: dying now (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if args.die_rank >= 0 and i >= args.die_after_step:
            time.sleep(0.5)  # let the peer die before the next collective starts

    losses, params = train(mesh, args.steps, lambda i: global_batch(i, rows)[mine], on_step)
    if rank == 0:
        flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(os.path.join(args.out, "result.npz"), losses=losses, **flat)
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
