"""One process of a start-up test (started by tests/test_distributed_startup.py).

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment
and calls `funshard.distributed.initialize` with one CPU device. Start-up errors are left
uncaught (the test reads the traceback). With --batches it then feeds `shard_batch`
batches that differ between processes, printing each error, and finally a consistent
batch, printing the global sum computed on the mesh.

    python tests/_startup_worker.py [--delay S] [--timeout T] [--batches]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

import funshard.distributed


def uneven_batches(rank: int) -> list:
    """Batches whose rows / trailing shapes / dtypes differ between process 0 and 1."""
    return [
        {"x": np.ones((4 if rank == 0 else 2, 3), np.float32), "y": np.zeros(4, np.int32)},
        {
            "x": np.ones((2, 3 if rank == 0 else 5), np.float32),
            "y": np.zeros(2, np.int32 if rank == 0 else np.float32),
        },
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delay", type=float, default=0.0, help="sleep before initialize")
    parser.add_argument("--timeout", type=int, default=None)
    parser.add_argument("--batches", action="store_true")
    args = parser.parse_args()

    jax.config.update("jax_num_cpu_devices", 1)  # before initialize
    time.sleep(args.delay)
    mesh = funshard.distributed.initialize(initialization_timeout=args.timeout)
    rank = jax.process_index()
    print(f"rank {rank}: mesh {dict(mesh.shape)}", flush=True)
    if not args.batches:
        return 0
    for i, batch in enumerate(uneven_batches(rank)):
        try:
            funshard.distributed.shard_batch(batch, mesh)
            print(f"rank {rank}: uneven batch {i} accepted", flush=True)
        except ValueError as exc:
            print(f"rank {rank}: uneven batch {i} refused: {exc}", flush=True)
    rows = np.arange(6, dtype=np.float32).reshape(2, 3) + 6 * rank
    batch = funshard.distributed.shard_batch({"x": rows}, mesh)
    total = jax.jit(lambda b: b["x"].sum())(batch)
    print(f"rank {rank}: even batch {batch['x'].shape} sum {float(total)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
