"""One torchrun job for tests/test_torch_surface.py: FSDPModule's communication settings.

    torchrun --nproc-per-node 2 tests/_torch_surface_worker.py --out DIR

Every case runs with torch_frontend, then with PyTorch's FSDP2 (gloo, the same default
group); each rank writes `{impl}-rank{r}.json` with what each case returned or raised
(type, its built-in bases, message) and `{impl}-rank{r}.npz` with arrays to compare.
Cases named `frontend_*` run on torch_frontend alone (argument checks FSDP2 makes
later, or never).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from _launch import start_worker
from torch import nn

STEPS = 3


class TopOneExperts(nn.Module):
    """Two experts behind a top-1 router; rank 0's tokens all go to expert 0, rank 1's
    to expert 1 (their inputs' signs differ, and the router reads the sign)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 2, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(torch.stack([torch.ones(8), -torch.ones(8)]))
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        gates = torch.softmax(self.router(x), dim=-1)
        top = gates.argmax(dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            chosen = top == i
            if chosen.any():
                out[chosen] = gates[chosen, i : i + 1] * expert(x[chosen])
        return out


class Moe(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.moe = TopOneExperts()
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.moe(x)))


def _mlp():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4)]
    return nn.Sequential(*layers)


def _x(rank: int, rows: int = 6, cols: int = 8) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(rank))


def _local(t) -> np.ndarray:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().float().numpy().copy()


def _sharded_mlp(fs, **kw):
    model = _mlp()
    fs(model[0], **kw)
    fs(model[2], **kw)
    fs(model, **kw)
    return model


def _train(model, rank: int, arrays: dict, name: str, event: bool = False, x=None) -> list:
    """STEPS of SGD; records each step's loss and the final local shards and grads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(STEPS):
        if event:
            model.set_post_optim_event(torch.Event())
        loss = model(_x(rank) if x is None else x).pow(2).mean()
        loss.backward()
        losses.append(float(loss))
        for pname, param in model.named_parameters():
            arrays[f"{name}/grad/{pname}"] = _local(param.grad)
        opt.step()
        opt.zero_grad()
    for pname, param in model.named_parameters():
        arrays[f"{name}/param/{pname}"] = _local(param)
    return losses


def case_unused_experts(fs, rank, arrays):
    """Each rank routes to one expert: with the setting, the other is reduced as zeros."""
    model = Moe()
    fs(model.moe)
    fs(model)
    model.set_reduce_scatter_unused_params(True)  # recurse: the experts' unit too
    x = _x(rank).abs() + 0.5
    return _train(model, rank, arrays, "unused", x=x if rank == 0 else -x)


def case_all_reduce_hook(fs, rank, arrays):
    """The hook sees each reduced flat shard and halves it: the gradients are halved."""
    model = _sharded_mlp(fs)
    seen = []

    def hook(output: torch.Tensor) -> None:
        seen.append([list(output.shape), str(output.dtype), float(output.sum())])
        output.mul_(0.5)

    model[2].set_all_reduce_hook(hook)
    return {"losses": _train(model, rank, arrays, "hook"), "seen": seen}


def case_all_reduce_hook_fp16(fs, rank, arrays):
    """fp16 reductions divide around the sum: the hook sees the pre-divided sum."""
    from torch.distributed import fsdp

    import torch_frontend

    policies = torch_frontend if fs is torch_frontend.fully_shard else fsdp
    policy = policies.MixedPrecisionPolicy(reduce_dtype=torch.float16)
    model = _sharded_mlp(fs, mp_policy=policy)
    seen = []
    model[2].set_all_reduce_hook(
        lambda t: seen.append([list(t.shape), str(t.dtype), float(t.sum())])
    )
    return {"losses": _train(model, rank, arrays, "hook16"), "seen": seen}


def case_max_input_buffers(fs, rank, arrays):
    model = _sharded_mlp(fs)
    model.set_reduce_scatter_max_input_buffers(3)
    return _train(model, rank, arrays, "buffers")


def case_separate_reduce_scatter_group(fs, rank, arrays):
    model = _sharded_mlp(fs)
    model.set_separate_reduce_scatter_group()
    return _train(model, rank, arrays, "separate")


def case_post_optim_event(fs, rank, arrays):
    return _train(_sharded_mlp(fs), rank, arrays, "event", event=True)


def case_allocate_from_process_group(fs, rank, arrays):
    model = _sharded_mlp(fs)
    model.set_allocate_memory_from_process_group_for_comm(True)
    return _train(model, rank, arrays, "allocate")


def case_symm_mem(fs, rank, arrays):
    _sharded_mlp(fs).set_symm_mem_for_comm()


def case_max_input_buffers_zero(fs, rank, arrays):
    _sharded_mlp(fs).set_reduce_scatter_max_input_buffers(0)


def case_max_input_buffers_bool(fs, rank, arrays):
    _sharded_mlp(fs).set_reduce_scatter_max_input_buffers(True)


def case_frontend_hook_without_argument(fs, rank, arrays):
    _sharded_mlp(fs).set_all_reduce_hook(lambda: None)


def case_frontend_hook_not_callable(fs, rank, arrays):
    _sharded_mlp(fs).set_all_reduce_hook("not a hook")


class CountingAllGather:
    """FSDP2's `AllGather` interface over torch's own collective, logging every call."""

    def __init__(self, log: list):
        self.log = log

    def allocate(self, size, *, dtype, device):
        self.log.append(["allocate", list(size), str(dtype)])
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        offset = (input_tensor.data_ptr() - output_tensor.data_ptr()) // input_tensor.itemsize
        self.log.append(["all_gather", list(output_tensor.shape), input_tensor.numel(), offset])
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group)


class CountingReduceScatter:
    """FSDP2's `ReduceScatter` interface over torch's own collective, logging every call."""

    def __init__(self, log: list):
        self.log = log

    def allocate(self, size, *, dtype, device):
        self.log.append(["allocate", list(size), str(dtype)])
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.log.append(["reduce_scatter", output_tensor.numel(), input_tensor.numel(), str(op)])
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)


class WrongSize(CountingAllGather):
    def allocate(self, size, *, dtype, device):
        return torch.empty(size[0] + 1, dtype=dtype, device=device)


def case_custom_collectives(fs, rank, arrays):
    """The root's gathers and reductions through the user's collectives; the other
    units' through the default ones."""
    model = _sharded_mlp(fs)
    log: list = []
    model.set_custom_all_gather(CountingAllGather(log))
    model.set_custom_reduce_scatter(CountingReduceScatter(log))
    return {"losses": _train(model, rank, arrays, "custom"), "log": log}


def case_allocate_after_custom_all_gather(fs, rank, arrays):
    model = _sharded_mlp(fs)
    model.set_custom_all_gather(CountingAllGather([]))
    model.set_allocate_memory_from_process_group_for_comm(True)


def case_frontend_custom_all_gather_of_the_wrong_size(fs, rank, arrays):
    model = _sharded_mlp(fs)
    model.set_custom_all_gather(WrongSize([]))
    model(_x(rank))


def case_frontend_custom_all_gather_not_a_comm(fs, rank, arrays):
    _sharded_mlp(fs).set_custom_all_gather(lambda out, inp, group: None)


CASES = {name[5:]: fn for name, fn in list(globals().items()) if name.startswith("case_")}


def _outcome(fn, fs, rank, arrays) -> dict:
    try:
        return {"ok": fn(fs, rank, arrays)}
    except Exception as exc:
        builtins = [c.__name__ for c in type(exc).__mro__ if c.__module__ == "builtins"]
        return {"error": type(exc).__name__, "bases": builtins, "message": str(exc)}


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
        results = {
            name: _outcome(fn, fs, rank, arrays)
            for name, fn in CASES.items()
            if impl == "frontend" or not name.startswith("frontend_")
        }
        (out / f"{impl}-rank{rank}.json").write_text(json.dumps(results))
        np.savez(out / f"{impl}-rank{rank}.npz", **arrays)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    args = ap.parse_args()
    out = Path(args.out)
    rank = start_worker(out, args.deadline)
    _cases(out, rank, int(os.environ["WORLD_SIZE"]))
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
