"""One torchrun job for tests/test_torch_state.py: state dicts, checkpoints, clipping.

    torchrun --nproc-per-node 2 tests/_torch_state_worker.py --out DIR --jax-checkpoint PATH
    torchrun --nproc-per-node 4 tests/_torch_state_worker.py --out DIR --replicate 2

Each rank trains `Net` (uneven rows, an empty shard, a dim-1 placement, a buffer and a
0-d int64 buffer) with torch_frontend and AdamW for STEPS steps on per-rank data,
clipping the last step's gradients (2-norm, then inf-norm); saves a checkpoint (sync
and async) with the optimizer; trains one more step; then, on fresh modules, loads the
full state dict, restores its own checkpoint and resumes, and restores the JAX
checkpoint the test wrote. Each rank writes `rank{r}.npz` with everything the test
compares (full tensors, local shards, norms, losses). With `--replicate` (HSDP) a rank
only trains, clips and saves.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from _launch import settle_gc
from torch import nn

STEPS = 3  # then a checkpoint, then one more step
LR = 1e-2
CLIPS = ((0.05, 2.0), (0.01, float("inf")))  # (max_norm, norm_type), in order, on the last step


class Net(nn.Module):
    """A small MLP whose parameters shard unevenly over 2 ranks, with buffers."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 15)
        self.mid = nn.Linear(15, 5)
        self.out = nn.Linear(5, 1)  # 1 row: rank 1's shard is empty
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))
        self.register_buffer("version", torch.tensor(3))  # 0-d int64: stored as numpy

    def forward(self, x):
        h = torch.relu(self.inp(x))
        return self.out(torch.relu(self.mid(h)) * self.scale)


def build(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 7, generator=g), torch.randn(4, 1, generator=g)


def columns(param: nn.Parameter):
    """shard_placement_fn: `mid`'s weight on dim 1, the rest on dim 0."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.shape == (5, 15) else None


def shard(model: Net, fully_shard) -> Net:
    fully_shard(model.inp, reshard_after_forward=False)
    fully_shard(model.mid, shard_placement_fn=columns)
    fully_shard(model.out)
    return fully_shard(model)


def loss_of(model, x, y) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def local(tensor: torch.Tensor) -> np.ndarray:
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.detach().numpy().copy()


def _np(tensors: dict, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}/{k}": local(v) for k, v in tensors.items()}


def train(tf, model, opt, rank: int, record: dict, steps: int, save=None) -> None:
    """`steps` AdamW steps from step 0, clipping step STEPS - 1's gradients (CLIPS).

    Records the state dict right after step 0's forward, the clipped local gradients,
    the norms, and after step STEPS - 1 the full state dict and the local optimizer
    state; `save()` runs before step STEPS.
    """
    losses, norms = [], []
    for step in range(steps):
        if step == STEPS and save is not None:
            save()
        x, y = batch(step, rank)
        loss = loss_of(model, x, y)
        if step == 0:  # gathered parameters still bound (reshard_after_forward=False)
            record.update(_np(model.state_dict(), "sd_after_forward"))
        loss.backward()
        if step == STEPS - 1:
            norms += [tf.clip_grad_norm_(model.parameters(), m, p).item() for m, p in CLIPS]
            record.update({f"grad/{n}": local(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == STEPS - 1:
            record.update(_np(tf.full_state_dict(model), "full"))
            for name, param in model.named_parameters():
                for key, value in opt.state[param].items():
                    record[f"opt/{name}/{key}"] = local(value)
    record["loss"], record["norms"] = np.asarray(losses), np.asarray(norms)


def run(out: Path, jax_checkpoint: str, rank: int) -> dict[str, np.ndarray]:
    import torch_frontend as tf

    record: dict[str, np.ndarray] = {}
    model = shard(build(), tf.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def save():
        tf.save(out / "torch_ckpt", model, opt, step=STEPS)
        tf.save(out / "torch_ckpt_async", model, opt, step=STEPS, asynchronous=True).wait()
        record["rank0_only_keys"] = np.asarray(len(tf.full_state_dict(model, rank0_only=True)))

    train(tf, model, opt, rank, record, STEPS + 1, save)
    full = {
        k.split("/", 1)[1]: torch.from_numpy(v) for k, v in record.items() if k.startswith("full/")
    }
    record.update(_np(tf.full_state_dict(model), "final"))

    loaded = shard(build(seed=1), tf.fully_shard)
    tf.load_full_state_dict(loaded, full)
    record.update(_np(loaded.state_dict(), "loaded"))

    resumed = shard(build(seed=2), tf.fully_shard)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    record["resumed_step"] = np.asarray(tf.restore(out / "torch_ckpt", resumed, resumed_opt))
    x, y = batch(STEPS, rank)
    loss_of(resumed, x, y).backward()
    resumed_opt.step()
    record.update(_np(tf.full_state_dict(resumed), "resumed"))

    from_jax = shard(build(seed=3), tf.fully_shard)
    record["from_jax_step"] = np.asarray(tf.restore(jax_checkpoint, from_jax))
    record.update(_np(tf.full_state_dict(from_jax), "from_jax"))
    return record


def run_hsdp(out: Path, rank: int) -> dict[str, np.ndarray]:
    """HSDP (2 replicas x 2 shards): train with clipping, then save."""
    import torch_frontend as tf

    record: dict[str, np.ndarray] = {}
    model = shard(build(), tf.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train(tf, model, opt, rank, record, STEPS)
    tf.save(out / "torch_ckpt_hsdp", model, opt, step=STEPS)
    return record


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--jax-checkpoint", default=None)
    ap.add_argument("--replicate", type=int, default=None, help="HSDP: train and save only")
    ap.add_argument("--deadline", type=float, default=300.0)
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    # The test kills workers by pid; a worker whose peer died ends itself.
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    import torch_frontend

    torch_frontend.init_distributed(replicate=args.replicate)
    settle_gc()
    record = run_hsdp(out, rank) if args.replicate else run(out, args.jax_checkpoint, rank)
    np.savez(out / f"rank{rank}.npz", **record)
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
