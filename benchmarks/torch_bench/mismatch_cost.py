"""What the collective records and digests cost a torch_frontend step (2 gloo ranks).

    torchrun --nproc-per-node 2 benchmarks/torch_bench/mismatch_cost.py [--rounds 15]
        [--steps 10] [--width 256] [--layers 8]

Every collective of torch_frontend is recorded as it is submitted; the first all-gather
of each root forward carries the records' digest (one float32 per rank), and the end of
each backward compares the digests through torch's TCPStore, so that ranks
whose collectives differ end in a named error (torch_frontend/_recorder.py). This times
training steps of a stack of Linear units with the digests on and off
(`CommContext.digests`), interleaved in rounds, and prints the medians, their ratio,
and how long the backward's end waited for the check (rank 0). Both variants record.
docs/torch.md's numbers: `--rounds 151 --steps 1` (the variants alternate step by step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args(argv)

    import torch
    from torch import nn

    import torch_frontend
    from torch_frontend import _distributed

    torch_frontend.init_distributed()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        torch_frontend.fully_shard(layer)
    torch_frontend.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(rank))
    comm = _distributed._runtime.comm
    # The time the backward's end waits for the digest check (`CommContext.agree`),
    # once the last reduce-scatter is done: what the check adds to a step directly.
    held: list[float] = []
    join = comm.agree

    def timed_join() -> None:
        start = time.perf_counter()
        join()
        held.append(time.perf_counter() - start)

    comm.agree = timed_join

    def steps(digests: bool) -> float:
        comm.digests = digests
        start = time.perf_counter()
        for _ in range(args.steps):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / args.steps

    times: dict[bool, list[float]] = {True: [], False: []}
    for digests in (True, False):  # warm-up: compiles both variants
        steps(digests)
    held.clear()
    for r in range(args.rounds):
        for digests in (True, False) if r % 2 else (False, True):
            times[digests].append(steps(digests))
    if rank == 0:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        # Each round's two variants ran back to back: their ratio drifts less with the
        # machine's load than the ratio of the medians.
        paired = statistics.median(a / b for a, b in zip(times[True], times[False], strict=True))
        print(
            f"{args.layers} units of {args.width}x{args.width}, {args.rounds} rounds of "
            f"{args.steps} steps: digest on {on * 1e3:.2f} ms/step, off {off * 1e3:.2f} "
            f"ms/step, ratio {on / off:.3f} (of each round's pair: median {paired:.3f}); "
            f"the backward's end waited {statistics.median(held) * 1e3:.2f} ms (median) "
            "for the digest check"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
