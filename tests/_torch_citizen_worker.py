"""One torchrun job for tests/test_torch_citizen.py: torch_frontend among torch.distributed's tools.

    torchrun --nproc-per-node 2 tests/_torch_citizen_worker.py --out DIR --one-process-ckpt DIR
    torchrun --nproc-per-node 4 tests/_torch_citizen_worker.py --out DIR --replicate 2

`titan` is a torchtitan-style training script: `init_device_mesh`, `fully_shard` per
block and on the root, stock `torch.nn.utils.clip_grad_norm_`, `dist.all_reduce` for the
logged loss, `torch.distributed.checkpoint` of `get_state_dict(model, opt)` part way,
and a full state dict at the end. Each rank runs it twice, with the same code: once
with `torch_frontend.fully_shard`, once with PyTorch's own (the control). It then
resumes each run from its checkpoint on fresh modules, loads a checkpoint a single
process wrote (resharding 1 -> 2), and (2 processes only) runs the dtype cases:
int64 parameters, a float64 model, and an fp16 gradient reduction that overflows
without FSDP2's pre-division. Each rank writes `rank{r}.npz`, keys `{impl}/...`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from _launch import settle_gc
from torch import nn

VOCAB, WIDTH, DEPTH = 47, 16, 2  # 47 rows: uneven shards
STEPS, SAVE_AT = 6, 3  # the checkpoint is taken before step SAVE_AT
LR, MAX_NORM = 1e-2, 0.5
INT64 = [2**40 + 1, 3, 2**33, -(2**35), 7, 2**31 + 5]
FP16_GRAD = 40000.0  # each rank's gradient: the sum of two overflows float16


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Titan(nn.Module):
    """A transformer without attention: embedding, residual blocks, norm, head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build(fully_shard, mesh, seed: int = 0, dtype=torch.float32) -> Titan:
    torch.manual_seed(seed)
    model = Titan().to(dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, opt, step: int, rank: int, world: int) -> tuple[float, float]:
    """One step as torchtitan writes it; (logged global loss, total grad norm)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    x, y = batch(step, rank)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    opt.step()
    opt.zero_grad()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
    return logged.item() / world, norm.item()


def full_state(model) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Without cpu_offload every rank gets the full tensors (with it, rank 0 alone).
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().numpy().copy() for k, v in sd.items()}


def save(model, opt, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load(model, opt, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def titan(
    fully_shard, mesh, impl: str, out: Path, rank: int, world: int, one_process_ckpt: str | None
) -> dict[str, np.ndarray]:
    record: dict[str, np.ndarray] = {}
    model = build(fully_shard, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        if step == SAVE_AT:
            save(model, opt, out / f"dcp-{impl}")
            record.update({f"saved/{k}": v for k, v in full_state(model).items()})
        loss, norm = train_step(model, opt, step, rank, world)
        losses.append(loss)
        norms.append(norm)
    record["loss"], record["norm"] = np.asarray(losses), np.asarray(norms)
    record.update({f"final/{k}": v for k, v in full_state(model).items()})

    resumed = build(fully_shard, mesh, seed=1)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    load(resumed, resumed_opt, out / f"dcp-{impl}")
    record["resumed_loss"] = np.asarray(
        [train_step(resumed, resumed_opt, step, rank, world)[0] for step in range(SAVE_AT, STEPS)]
    )
    if one_process_ckpt:  # written by one process: reshard 1 -> world
        one = build(fully_shard, mesh, seed=2)
        one_opt = torch.optim.AdamW(one.parameters(), lr=LR)
        load(one, one_opt, Path(one_process_ckpt))
        record.update({f"from_one/{k}": v for k, v in full_state(one).items()})
        record["from_one_loss"] = np.asarray(train_step(one, one_opt, 0, rank, world)[0])
    return record


class Ints(nn.Module):
    """An int64 parameter (no gradient) beside a float one; forward records what it sees."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.tensor(INT64), requires_grad=False)
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        self.seen = self.table.detach().clone()
        return (self.w * x).sum()


def dtypes(fully_shard, policy_cls, mesh, rank: int, world: int) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    record: dict[str, np.ndarray] = {}
    ints = fully_shard(Ints(), mesh=mesh, reshard_after_forward=False)
    ints(torch.ones(2)).backward()
    record["int64/seen"] = ints.seen.numpy()
    ints.reshard()
    record["int64/full"] = ints.table.full_tensor().numpy()

    scale = fully_shard(Ints(), mesh=mesh, mp_policy=policy_cls(reduce_dtype=torch.float16))
    scale(torch.full((2,), FP16_GRAD)).backward()
    record["fp16/grad"] = scale.w.grad.full_tensor().numpy()

    model = build(fully_shard, mesh, seed=3, dtype=torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [train_step(model, opt, step, rank, world)[0] for step in range(2)]
    record["float64/loss"] = np.asarray(losses)
    record["dtypes/float64"] = np.asarray([str(p.dtype) for p in model.parameters()])
    record.update({f"float64/{k}": v for k, v in full_state(model).items()})
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return record


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--one-process-ckpt", default=None)
    ap.add_argument("--replicate", type=int, default=None, help="HSDP: number of replicas")
    ap.add_argument("--deadline", type=float, default=300.0)
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    # The test kills workers by pid; a worker whose peer died ends itself.
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import torch_frontend

    torch_frontend.init_distributed()  # JAX's runtime and torch's default group
    settle_gc()
    world = dist.get_world_size()
    if args.replicate:
        mesh = init_device_mesh(
            "cpu", (args.replicate, world // args.replicate), mesh_dim_names=("replicate", "shard")
        )
    else:
        mesh = init_device_mesh("cpu", (world,))
    impls = {
        "frontend": (torch_frontend.fully_shard, torch_frontend.MixedPrecisionPolicy),
        "fsdp2": (fully_shard, MixedPrecisionPolicy),
    }
    record: dict[str, np.ndarray] = {}
    for impl, (shard_fn, policy_cls) in impls.items():
        found = titan(shard_fn, mesh, impl, out, rank, world, args.one_process_ckpt)
        if not args.replicate:
            found.update(dtypes(shard_fn, policy_cls, mesh, rank, world))
        record.update({f"{impl}/{k}": v for k, v in found.items()})
    np.savez(out / f"rank{rank}.npz", **record)
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
