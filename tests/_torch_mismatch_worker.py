"""One torchrun job for tests/test_torch_mismatch.py: ranks that issue different collectives.

    torchrun --nproc-per-node 2 tests/_torch_mismatch_worker.py --out DIR --case CASE

With the default settings, one of four ordinary mistakes (a job each: once the ranks'
collectives differ, some may stay stuck in gloo, and the job cannot go on):

- `swapped`: at the last step (4) rank 1 runs layer 1 before layer 0 (same shapes), and
  each step ends with an optimizer step;
- `swapped_kept`: the same with `reshard_after_forward=False` (no gather in the
  backward; the histories have the same length, and only the digests differ), run on
  4 ranks;
- `extra_forward`: at step 3 rank 0 runs an extra forward under `torch.no_grad()`;
- `unused`: a top-1 mixture of two experts, one FSDP unit, whose router sends rank 0's
  tokens to expert 0 and rank 1's to expert 1, without `set_reduce_scatter_unused_params`.

Each rank writes `rank{r}.json`: the steps it finished, what it raised, in which pass,
and when.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _launch import start_worker
from torch import nn


class Layers(nn.Module):
    """Same-shape layers, one unit each; `swap` runs layer 1 before layer 0."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.swap = False

    def forward(self, x):
        order = [1, 0, 2] if self.swap else [0, 1, 2]
        for i in order:
            x = torch.tanh(self.layers[i](x))
        return x


class Experts(nn.Module):
    """Two experts in one FSDP unit; `route` picks each row's expert (top-1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = route == e
            if rows.any():
                out[rows] = expert(x[rows])
        return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.moe = Experts()

    def forward(self, x, route):
        return self.moe(torch.tanh(self.embed(x)), route)


def _x(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))


STEPS = 4
PASS = ["forward"]  # the pass running: "forward", "backward" or "optimizer"


def _run(case, rank: int) -> dict:
    import torch_frontend

    steps = 0
    start = time.monotonic()
    try:
        for step in range(STEPS):
            PASS[0] = "forward"
            case(torch_frontend, rank, step)
            steps += 1
    except Exception as exc:
        return {
            "steps": steps,
            "error": type(exc).__name__,
            "message": str(exc),
            "pass": PASS[0],
            "seconds": time.monotonic() - start,
        }
    return {"steps": steps}


def _train(model, loss, opt=None) -> None:
    PASS[0] = "backward"
    loss.backward()
    if opt is not None:
        PASS[0] = "optimizer"
        opt.step()
        opt.zero_grad()


def _layers(**kwargs):
    import torch_frontend

    model = Layers()
    for layer in model.layers:
        torch_frontend.fully_shard(layer, **kwargs)
    return torch_frontend.fully_shard(model, **kwargs)


def swapped(fs, rank: int, step: int, models={}, reshard=True) -> None:  # noqa: B006
    # (`models`: one model per job)
    if "swapped" not in models:
        model = _layers(reshard_after_forward=reshard)
        models["swapped"] = model, torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = models["swapped"]
    model.swap = rank == 1 and step == STEPS - 1  # the script's last step
    _train(model, model(_x(rank)).sum(), opt)


def swapped_kept(fs, rank: int, step: int) -> None:
    swapped(fs, rank, step, reshard=False)


def extra_forward(fs, rank: int, step: int, models={}) -> None:  # noqa: B006
    if "extra_forward" not in models:
        models["extra_forward"] = _layers()
    model = models["extra_forward"]
    if rank == 0 and step == 2:
        with torch.no_grad():  # a metric, on rank 0 only
            model(_x(rank))
    _train(model, model(_x(rank)).sum())


def unused(fs, rank: int, step: int, models={}) -> None:  # noqa: B006
    if "unused" not in models:
        model = MoE()
        fs.fully_shard(model.moe)
        models["unused"] = fs.fully_shard(model)
    model = models["unused"]
    route = torch.full((4,), rank)  # every token of rank r to expert r
    _train(model, model(_x(rank), route).sum())


def sleeper(fs, rank: int, step: int, models={}) -> None:  # noqa: B006
    if "sleeper" not in models:
        models["sleeper"] = _layers()
    if rank == 1 and step == 1:
        print("rank 1: sleeping", flush=True)
        time.sleep(1000)  # alive, in no collective: rank 0's next one waits for it
    models["sleeper"](_x(rank)).sum().backward()
    print(f"rank {rank}: step {step} done", flush=True)


CASES = {f.__name__: f for f in (swapped, swapped_kept, extra_forward, unused, sleeper)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    args = ap.parse_args()
    out = Path(args.out)
    rank = start_worker(out, args.deadline)
    faulthandler.dump_traceback_later(max(1.0, args.deadline - 5))  # where it hangs, if so
    import torch_frontend

    torch_frontend.init_distributed()
    (out / f"rank{rank}.json").write_text(json.dumps(_run(CASES[args.case], rank)))
    print(f"rank {rank}: done", flush=True)
    dist.barrier()  # torch's group is whole: both ranks are done before either exits
    sys.stdout.flush()
    os._exit(0)  # a collective may be stuck in gloo: skip a teardown that waits for it


if __name__ == "__main__":
    sys.exit(main())
