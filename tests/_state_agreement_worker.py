"""One process of a job whose processes may build different models (test_state_agreement.py).

Reads torchrun-style RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, builds a two-layer
model (process `--bigger-rank` with 18 rows in `w1` instead of 16), and trains it for two
jitted steps, printing each loss and how long the trace-time state comparison took.

    python tests/_state_agreement_worker.py [--bigger-rank R]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

import funshard as fs
import funshard.distributed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bigger-rank", type=int, default=-1)
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stdout, format="%(name)s: %(message)s")
    logging.getLogger("funshard.comm._state_agreement").setLevel(logging.DEBUG)

    mesh = funshard.distributed.initialize(fail_fast=True)  # the tests expect its exits
    rank = jax.process_index()
    rows = 18 if rank == args.bigger_rank else 16
    params = {"w1": np.full((rows, 4), 0.1, np.float32), "w2": np.full((2, rows), 0.2, np.float32)}
    state = fs.shard(params, mesh)

    def loss(state, x):
        p = fs.unshard(state)
        return jnp.mean(jnp.tanh(x @ p["w1"].T) @ p["w2"].T)

    step = jax.jit(fs.value_and_grad(loss))
    batch = fs.distributed.shard_batch(np.ones((2, 4), np.float32), mesh)
    for i in range(2):
        value, _grads = step(state, batch)
        print(f"rank {rank}: step {i} loss {float(value):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
