"""One torchrun rank of a torch_frontend job in which one rank leaves early.

    torchrun --nproc-per-node 2 tests/_departed_torch_worker.py --out DIR --deadline S
        --steps N --leaving-rank R --leaving-steps K [--how fewer|caught]
        [--extra-full-state-dict R]

Every rank trains a small fully_shard model; rank R stops after K steps, either by
running fewer steps ("fewer") or by raising an exception of its own that it catches
before returning normally ("caught"). With `--extra-full-state-dict R`, rank R alone
calls `full_state_dict` before step 2 (and nobody leaves on purpose). Each rank writes
`rank{r}.npz` with the steps it finished, what it raised (if anything) and how long
after the leaving rank left.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn


class Planned(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--leaving-rank", type=int, required=True)
    ap.add_argument("--leaving-steps", type=int, required=True)
    ap.add_argument("--how", default="fewer", choices=["fewer", "caught"])
    ap.add_argument(
        "--extra-full-state-dict",
        type=int,
        default=None,
        help="this rank alone calls full_state_dict before step 2",
    )
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ["RANK"])
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))  # never outlive the test
    watchdog.daemon = True
    watchdog.start()

    import torch_frontend

    torch_frontend.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            torch_frontend.fully_shard(layer)
    torch_frontend.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    leaving = rank == args.leaving_rank
    done, error = 0, ""
    try:
        for i in range(args.steps):
            if leaving and i == args.leaving_steps:
                if args.how == "caught":
                    raise Planned("this rank's own failure, caught below")
                break
            if i == 2 and rank == args.extra_full_state_dict:
                torch_frontend.full_state_dict(model)
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            done = i + 1
            print(f"rank {rank}: step {i} at {time.monotonic():.1f}", flush=True)
    except Planned:
        pass
    except (RuntimeError, TimeoutError) as exc:  # the frontend gives up on the other rank
        error = str(exc)
    np.savez(out / f"rank{rank}.npz", done=done, error=error, left_at=time.monotonic())
    print(f"rank {rank}: returning ({'error' if error else 'ok'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
