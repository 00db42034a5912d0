"""funshard's eager reduce-scatter and all-gather, alternating, checked against numpy (2 ranks).

    torchrun --nproc-per-node 2 benchmarks/torch_bench/collective_probe.py [--rounds 25]
        [--pause 0.05] [--no-gather]

No torch and no DLPack: each round reduce-scatters one transformer block's 12 gradient
shapes (width 1024) with `funshard.comm.eager_reduce_scatter`, then all-gathers
the same shapes with `eager_all_gather`, as the torch frontend's backward does (a
block's reduction, then the previous block's re-gather). Every rank knows every rank's
inputs (seeded), so each result is compared with the exact numpy answer. Each rank
pauses for a random time up to `--pause` seconds after each collective, so the ranks
drift apart as they do in training. Prints every wrong result and a count per rank.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

WIDTH = 1024
SHAPES = [
    (WIDTH,),
    (WIDTH,),
    (3 * WIDTH, WIDTH),
    (3 * WIDTH,),
    (WIDTH, WIDTH),
    (WIDTH,),
    (WIDTH,),
    (WIDTH,),
    (4 * WIDTH, WIDTH),
    (4 * WIDTH,),
    (WIDTH, 4 * WIDTH),
    (WIDTH,),
]


def tensors(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32) for s in SHAPES]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--pause", type=float, default=0.05)
    p.add_argument("--no-gather", action="store_true", help="reduce-scatters only")
    args = p.parse_args(argv)

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import funshard as fs
    import funshard.distributed
    from funshard import comm

    mesh = fs.distributed.initialize()
    rank, world = jax.process_index(), jax.process_count()
    device = mesh.devices.flat[rank]
    sharded = NamedSharding(mesh, P("fsdp"))

    def global_array(local: np.ndarray, shape) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            shape, sharded, [jax.device_put(local, device)]
        )

    rng = random.Random(rank)
    wrong = 0
    for r in range(args.rounds):
        contributions = [tensors(1000 * r + k) for k in range(world)]
        stacked = [global_array(a[None], (world, *a.shape)) for a in contributions[rank]]
        sums = comm.eager_reduce_scatter(stacked, mesh, ("fsdp",))
        for i, s in enumerate(sums):
            rows = SHAPES[i][0] // world
            want = sum(c[i] for c in contributions)[rank * rows : (rank + 1) * rows]
            got = np.asarray(s.addressable_shards[0].data)
            if not np.array_equal(got, want):
                wrong += 1
                print(
                    f"rank {rank} round {r}: reduce-scatter result {i} {SHAPES[i]} wrong, "
                    f"max |diff| {np.abs(got - want).max():.2e}",
                    flush=True,
                )
        time.sleep(rng.random() * args.pause)
        if args.no_gather:
            continue
        full = tensors(7 + 1000 * r)
        blocks = [
            global_array(
                a[rank * (a.shape[0] // world) : (rank + 1) * (a.shape[0] // world)], a.shape
            )
            for a in full
        ]
        for i, g in enumerate(comm.eager_all_gather(blocks, mesh, ("fsdp",))):
            if not np.array_equal(np.asarray(g.addressable_shards[0].data), full[i]):
                wrong += 1
                print(f"rank {rank} round {r}: all-gather result {i} wrong", flush=True)
        time.sleep(rng.random() * args.pause)
    print(f"rank {rank}: {wrong} wrong results in {args.rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
