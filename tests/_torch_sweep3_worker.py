"""One torchrun job for tests/test_torch_sweep3.py: issue 34's torch cases, both ways.

    torchrun --nproc-per-node 2 tests/_torch_sweep3_worker.py --out DIR [--mode cases|fewer]

`cases`: every case runs with torch_frontend, then with PyTorch's FSDP2 (gloo, the
same default group); each rank writes `{impl}-rank{r}.json` with what each case
returned or raised (type, its built-in bases, message, notes), and `{impl}-rank{r}.npz`
with arrays to compare. Last, torch_frontend's collective check
(TORCH_DISTRIBUTED_DEBUG=DETAIL, switched on here) meets rank 1 skipping a unit.
`fewer`: rank 1 runs 2 steps and returns, rank 0 runs 6 and must fail with a message.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.lin2(torch.tanh(self.lin1(x)))


class Layers(nn.Module):
    """Same-shape layers (one unit each); `skip` leaves layer 1 out of the forward."""

    def __init__(self, depth: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        self.skip = False

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if not (self.skip and i == 1):
                x = torch.tanh(layer(x))
        return x


class WithEmpty(nn.Module):
    """A 0-row parameter that gets a (size-0) gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.empty = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.lin(torch.cat([self.empty, x]))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
    )


def _x(rank: int, rows: int = 4, cols: int = 8) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(rank))


def _local(t) -> np.ndarray:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().numpy().copy()


def case_freeze(fs, rank, arrays):
    """requires_grad_(False) at step 1, True at step 3 (item 4)."""
    model = _mlp()
    fs(model[2])
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    moved, no_grad = [], []
    for step in range(5):
        if step in (1, 3):
            model[2].weight.requires_grad_(step == 3)
        before = _local(model[2].weight)
        model(_x(rank)).sum().backward()
        no_grad.append(model[2].weight.grad is None)
        opt.step()
        opt.zero_grad()
        moved.append(float(np.abs(_local(model[2].weight) - before).max()))
    arrays["freeze_moved"] = np.asarray(moved)
    return no_grad


def case_mixed_group(fs, rank, arrays):
    """One unit with a frozen weight and a trainable bias (frozen before fully_shard)."""
    model = _mlp()
    model[2].weight.requires_grad_(False)
    fs(model[2])
    fs(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for _ in range(3):
        model(_x(rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    for name, param in model.named_parameters():
        arrays[f"mixed/{name}"] = _local(param)
    return model[2].weight.grad is None


def case_bias_none_before_forward(fs, rank, arrays):
    model = Two()
    fs(model.lin1)
    fs(model)
    model.lin1.bias = None
    return float(model(_x(rank)).sum())


def case_bias_none_root_before_forward(fs, rank, arrays):
    model = Two()
    fs(model)
    model.lin1.bias = None
    return float(model(_x(rank)).sum())


def case_bias_none_after_step(fs, rank, arrays):
    model = Two()
    fs(model.lin1)
    fs(model)
    model(_x(rank)).sum().backward()
    model.lin1.bias = None
    return float(model(_x(rank)).sum())


def case_bias_none_kept_gathered(fs, rank, arrays):
    """The root stays gathered after forward: the slot holds the unsharded bias."""
    model = Two()
    fs(model)
    loss = model(_x(rank)).sum()
    model.lin1.bias = None
    out = model(_x(rank))
    arrays["kept_gathered_out"] = out.detach().numpy()
    (loss + out.sum()).backward()
    return float(model(_x(rank)).sum())  # FSDP2 binds the bias again here


def case_to_float64(fs, rank, arrays):
    model = _mlp()
    fs(model[2])
    fs(model)
    model.to(torch.float64)
    return float(model(_x(rank)).sum())


def case_to_float64_inputs(fs, rank, arrays):
    model = _mlp()
    fs(model[2])
    fs(model)
    model.to(torch.float64)
    return float(model(_x(rank).double()).sum())


def case_module_list(fs, rank, arrays):
    model = Layers()
    fs(model.layers)
    fs(model)
    model(_x(rank)).sum().backward()
    return "trained"


def case_empty_list(fs, rank, arrays):
    fs([])
    return "accepted"


def case_same_module_twice(fs, rank, arrays):
    layer = nn.Linear(4, 4)
    fs([layer, layer])
    return "accepted"


def case_zero_rows(fs, rank, arrays):
    model = WithEmpty()
    reference = copy.deepcopy(model)
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _x(0, 2, 4)  # the same batch on both ranks: the mean gradient is its gradient
    model(x).sum().backward()
    opt.step()
    reference(x).sum().backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    arrays["zero_rows/lin.weight"] = _local(model.lin.weight)
    arrays["zero_rows/reference"] = reference.lin.weight.detach().numpy()[rank * 2 : rank * 2 + 2]
    return list(_local(model.empty.grad).shape)


def case_deepcopy(fs, rank, arrays):
    model = _mlp()
    fs(model[2])
    fs(model)
    copy.deepcopy(model)
    return "copied"


def case_two_parents(fs, rank, arrays):
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared), nn.Sequential(shared)
    fs(first)
    fs(second)
    return "accepted"


def case_shared_module_first(fs, rank, arrays):
    """The fix the two-parents message names: shard the shared module first."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared))
    fs(shared)
    fs(model[0])
    fs(model[1])
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = model(_x(rank, 4, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    arrays["shared_first/weight"] = _local(shared.weight)
    return losses


CASES = {name[5:]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def _outcome(fn, fs, rank, arrays) -> dict:
    try:
        return {"ok": fn(fs, rank, arrays)}
    except Exception as exc:
        builtins = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
        return {
            "error": type(exc).__name__,
            "bases": builtins,
            "message": str(exc),
            "notes": list(getattr(exc, "__notes__", [])),
        }


def _skip_a_unit(rank: int) -> dict:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's check: rank 1 skips a unit in step 1."""
    import torch_frontend
    from torch_frontend import _distributed

    _distributed._runtime.comm.check_collectives = True
    model = Layers()
    for layer in model.layers:
        torch_frontend.fully_shard(layer)
    torch_frontend.fully_shard(model)
    steps = 0
    try:
        for step in range(3):
            model.skip = rank == 1 and step == 1
            model(_x(rank)).sum().backward()
            steps += 1
    except Exception as exc:
        return {"steps": steps, "error": type(exc).__name__, "message": str(exc)}
    return {"steps": steps}


def _cases(out: Path, rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import torch_frontend

    torch_frontend.init_distributed()
    mesh = init_device_mesh("cpu", (world,))
    impls = {
        "frontend": torch_frontend.fully_shard,
        "fsdp2": lambda m, **kw: fully_shard(m, mesh=mesh, **kw),
    }
    for impl, fs in impls.items():
        arrays: dict[str, np.ndarray] = {}
        results = {name: _outcome(fn, fs, rank, arrays) for name, fn in CASES.items()}
        (out / f"{impl}-rank{rank}.json").write_text(json.dumps(results))
        np.savez(out / f"{impl}-rank{rank}.npz", **arrays)
    (out / f"check-rank{rank}.json").write_text(json.dumps(_skip_a_unit(rank)))


def _fewer(rank: int) -> None:
    """Rank 1 returns after 2 steps; rank 0's step 2 waits for it (uncaught)."""
    import torch_frontend

    torch_frontend.init_distributed()
    model = Layers()
    for layer in model.layers:
        torch_frontend.fully_shard(layer)
    torch_frontend.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2 if rank == 1 else 6):
        model(_x(rank)).sum().backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {rank}: step {step} done", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--mode", default="cases", choices=["cases", "fewer"])
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ["RANK"])
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))  # never outlive the test
    watchdog.daemon = True
    watchdog.start()
    if args.mode == "fewer":
        _fewer(rank)
        return 0
    _cases(out, rank, int(os.environ["WORLD_SIZE"]))
    # The check's failure ended JAX's side of the job (every rank raised): torch's
    # group is still whole, and os._exit skips a teardown that waits for it.
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
