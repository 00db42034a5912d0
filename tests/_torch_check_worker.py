"""One torchrun job for tests/test_torch_check.py: `torch_frontend.check` on 2 gloo ranks.

    torchrun --nproc-per-node 2 tests/_torch_check_worker.py --out DIR

Each case builds a model, runs `torch_frontend.check` on it (and, where it says so,
trains around the check and without it), and each rank writes `rank{r}.json`: per case,
the report (ok, each collective's row, each mismatch's kind and unit) or the error it
raised, and the values the test compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _launch import start_worker
from torch import nn


def _mlp(fs, **kw) -> nn.Module:
    """Two units (Linear(8, 16), Linear(16, 4)) under a root without parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fs(model[0], **kw)
    fs(model[2], **kw)
    fs(model, **kw)
    return model


def _x(rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))


def _report(report) -> dict:
    return {
        "ok": report.ok,
        "rows": [dataclasses.asdict(c) for c in report.collectives],
        "mismatches": [dataclasses.asdict(m) for m in report.mismatches],
        "notes": [dataclasses.asdict(m) for m in report.notes],
        "mesh_shape": report.mesh_shape,
        "table": report.table(),
    }


def _local(t: torch.Tensor | None) -> list | None:
    if t is None:
        return None
    return (t.to_local() if hasattr(t, "to_local") else t).detach().float().reshape(-1).tolist()


def _state(model: nn.Module) -> dict:
    """Every parameter's local shard and `.grad` (None where it has none)."""
    return {
        name: {"param": _local(p), "grad": _local(p.grad)} for name, p in model.named_parameters()
    }


def case_clean(fs, check, rank):
    return _report(check(_mlp(fs), _x(rank)))


def case_bf16(fs, check, rank):
    from torch_frontend import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return _report(check(_mlp(fs, mp_policy=policy), _x(rank)))


def _accumulate(fs, check, rank: int, sync: bool, with_check: bool) -> dict:
    """Two microbatches (the first one's gradient sync as `sync` says, the second one's
    on), with the check between them or not; the final shards' gradients."""
    model = _mlp(fs)
    model.set_requires_gradient_sync(sync)
    model(_x(rank)).pow(2).mean().backward()
    out = {}
    if with_check:
        before = _state(model)
        out["report"] = _report(check(model, _x(rank + 2)))
        out["unchanged"] = _state(model) == before
    model.set_requires_gradient_sync(True)
    model(_x(rank + 4)).pow(2).mean().backward()
    out["final"] = _state(model)
    return out


def case_accumulate_with_sync(fs, check, rank):
    checked = _accumulate(fs, check, rank, sync=True, with_check=True)
    checked["reference"] = _accumulate(fs, check, rank, sync=True, with_check=False)["final"]
    return checked


def case_accumulate_without_sync(fs, check, rank):
    checked = _accumulate(fs, check, rank, sync=False, with_check=True)
    checked["reference"] = _accumulate(fs, check, rank, sync=False, with_check=False)["final"]
    return checked


def _summed_over_ranks(out: torch.Tensor) -> torch.Tensor:
    total = out.detach().sum()
    dist.all_reduce(total)  # the planted collective: a loss summed over the ranks
    return out.sum() + 0.0 * total


def case_unplanned(fs, check, rank):
    return _report(check(_mlp(fs), _x(rank), loss_fn=_summed_over_ranks))


def case_unplanned_allowed(fs, check, rank):
    return _report(check(_mlp(fs), _x(rank), loss_fn=_summed_over_ranks, allow=("unplanned",)))


def case_hsdp(fs, check, rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    return _report(check(_mlp(fs, mesh=mesh), _x(rank)))


def case_unchanged(fs, check, rank):
    """A trained model with gradients, a BatchNorm's statistics and the random state:
    the same after the check, and so is the next step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    fs(model[0])
    fs(model[3])
    fs(model)
    model(_x(rank)).sum().backward()
    before = _state(model)
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    collectives = (dist.all_reduce, dist.distributed_c10d.all_reduce)
    report = check(model, _x(rank + 2))
    return {
        "report": _report(report),
        "same_state": _state(model) == before,
        "same_buffers": all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True)),
        "same_rng": torch.equal(rng, torch.get_rng_state()),
        "resharded": all(
            type(p).__name__ == "DTensor" for p in model.parameters()
        ),  # the shards, not gathered parameters
        "dist_restored": collectives == (dist.all_reduce, dist.distributed_c10d.all_reduce),
    }


CASES = {name[5:]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def _outcome(fn, fs, check, rank) -> dict:
    try:
        return {"ok": fn(fs, check, rank)}
    except Exception as exc:
        builtins = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
        return {"error": type(exc).__name__, "bases": builtins, "message": str(exc)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    args = ap.parse_args()
    out = Path(args.out)
    rank = start_worker(out, args.deadline)

    import torch_frontend

    torch_frontend.init_distributed()
    results = {
        name: _outcome(fn, torch_frontend.fully_shard, torch_frontend.check, rank)
        for name, fn in CASES.items()
    }
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
