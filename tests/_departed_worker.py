"""One process of a job in which one process leaves early (tests/test_departed_peer.py).

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, trains a one-layer
model with a jitted funshard step for `--steps` steps (`--leaving-steps` on the process
`--leaving-rank`, which then returns normally), and prints one line per step. With
`--no-shard-batch` every process builds the global batch itself, so only the watchdog
can notice the departure (`--count-steps`: and counts its steps with `count_step`).
With `--extra-unshard R` process R alone calls an eager `fs.unshard` before step 2
(the others go on training); with `--other-unshard R` every process calls it there, but
process R on a different tree: different collectives outside a step. With
`--sigkill` the leaving process kills itself (SIGKILL) instead of returning; with
`--no-fail-fast` the processes start with `initialize`'s default `fail_fast=False`.

    python tests/_departed_worker.py --steps S --leaving-rank R --leaving-steps K
        [--no-shard-batch [--count-steps]] [--extra-unshard R | --other-unshard R]
        [--sigkill] [--no-fail-fast] [--shutdown-timeout S]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import funshard as fs
import funshard.distributed

START = time.monotonic()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--leaving-rank", type=int, required=True)
    parser.add_argument("--leaving-steps", type=int, required=True)
    parser.add_argument("--no-shard-batch", action="store_true")
    parser.add_argument("--count-steps", action="store_true")
    parser.add_argument("--extra-unshard", type=int, default=None)
    parser.add_argument("--other-unshard", type=int, default=None)
    parser.add_argument("--sigkill", action="store_true")
    parser.add_argument("--no-fail-fast", action="store_true")
    parser.add_argument("--shutdown-timeout", type=float, default=300.0)
    args = parser.parse_args()

    # fail_fast=True unless asked: most tests expect its exits.
    mesh = funshard.distributed.initialize(
        fail_fast=not args.no_fail_fast, shutdown_timeout=args.shutdown_timeout
    )
    rank = jax.process_index()
    state = fs.shard({"w": jnp.ones((16, 16)) / 4}, mesh)

    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ fs.unshard(params)["w"]) ** 2)

    step = jax.jit(fs.value_and_grad(loss))
    steps = args.leaving_steps if rank == args.leaving_rank else args.steps
    rows = np.ones((2 * jax.process_count(), 16), np.float32)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    for i in range(steps):
        if i == 2 and rank == args.extra_unshard:
            fs.unshard(state)
        if i == 2 and args.other_unshard is not None:
            other = fs.shard({"v": jnp.ones((8, 4))}, mesh)
            fs.unshard(other if rank == args.other_unshard else state)
        if args.no_shard_batch:
            batch = jax.make_array_from_callback(rows.shape, sharding, lambda idx: rows[idx])
        else:
            batch = funshard.distributed.shard_batch(rows[:2], mesh)
        value, _ = step(state, batch)
        if args.count_steps:
            funshard.distributed.count_step()
        print(
            f"rank {rank}: step {i} loss {float(value):.4f} at {time.monotonic() - START:.1f} s",
            flush=True,
        )
    if args.sigkill and rank == args.leaving_rank:
        print(f"rank {rank}: SIGKILL at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {rank}: returning after {steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
