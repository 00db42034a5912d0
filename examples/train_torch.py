"""Train a small byte-level GPT written in plain PyTorch, sharded with FSDP2's API.

The PyTorch twin of `examples/train_lm.py`: the same GPT shape (byte-level, learned
positions, pre-norm blocks of causal attention and a 4x MLP), the same corpus
(`examples/data/`), batches and learning-rate schedule. The model is ordinary `torch.nn`
code; `torch_frontend.fully_shard` shards each block, then the root, exactly as
`torch.distributed.fsdp.fully_shard` would, and every all-gather / reduce-scatter runs on
JAX's multi-process runtime. `torch.optim.AdamW` updates each rank's shards. Rank 0 prints
a progress line (step, loss, tokens/s); every `--checkpoint-every` steps the model and
optimizer are checkpointed into `--run-dir`, and `--resume` continues from the newest
checkpoint there.

Run:
    torchrun --nproc-per-node 2 examples/train_torch.py [--steps N] [--run-dir DIR] [--resume]
    python examples/train_torch.py [--tiny] ...      # one process (world size 1)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from pathlib import Path

# Collectives run on JAX's CPU runtime; must be set before JAX picks a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import torch
from jax.experimental import multihost_utils

import torch_frontend
from torch_frontend import fully_shard, init_distributed

# The model: models/torch_gpt.py beside this script (found also when loaded by path).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from models import TINY, ModelConfig
from models.torch_gpt import GPT

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How the model is trained (train_lm.py's defaults)."""

    steps: int = 500
    batch: int = 32  # sequences per step, split over all ranks
    lr: float = 3e-3
    warmup: int = 50
    log_every: int = 10
    checkpoint_every: int = 250
    seed: int = 0


def parse_args(argv=None) -> argparse.Namespace:
    """Reads the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument(
        "--batch",
        type=int,
        default=TrainConfig.batch,
        help="global batch: sequences per step over all ranks",
    )
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--log-every", type=int, default=TrainConfig.log_every)
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every)
    p.add_argument("--tiny", action="store_true", help="a tiny model, for smoke tests")
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="checkpoints and metrics (default: a fresh runs/train_torch/<time>)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --run-dir"
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def load_text(path: Path = DATA, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The text as bytes, split into a training part and a held-out tail."""
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    split = int(len(data) * (1 - val_fraction))
    return data[:split], data[split:]


def batch_at(data: np.ndarray, index: int, rows: int, context: int, seed: int) -> np.ndarray:
    """Random windows of `context + 1` bytes: inputs and their next-byte targets.

    The windows are a function of `index` alone (train_lm.py's batches), so a resumed
    run sees exactly the batches an uninterrupted one would have seen.
    """
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(data) - context - 1, size=rows)
    return data[starts[:, None] + np.arange(context + 1)].astype(np.int64)


def local_rows(batch: np.ndarray, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch."""
    rows = len(batch) // world
    return torch.from_numpy(batch[rank * rows : (rank + 1) * rows])


# ---------------------------------------------------------------------------- model


def build_model(cfg: ModelConfig) -> GPT:
    """The GPT of `cfg` (`models/torch_gpt.py`): GPT-2's initialisation, from torch's seed."""
    return GPT(width=cfg.width, depth=cfg.depth, heads=cfg.heads, context=cfg.context)


def shard_model(model: GPT) -> GPT:
    """FSDP2's recipe: every block one group, then the root (embeddings, norm, head)."""
    for block in model.blocks:
        fully_shard(block)
    # The root runs forward first: it stays gathered through backward (FSDP2's default).
    return fully_shard(model)


def lr_at(step: int, train: TrainConfig) -> float:
    """train_lm.py's schedule: linear warm-up from 0, cosine decay to lr / 10."""
    warmup = min(train.warmup, max(train.steps - 1, 1))
    if step < warmup:
        return train.lr * step / warmup
    progress = min(1.0, (step - warmup) / max(train.steps - warmup, 1))
    floor = train.lr / 10
    return floor + (train.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train_step(model: GPT, opt: torch.optim.Optimizer, tokens: torch.Tensor, lr: float) -> float:
    """One AdamW step on this rank's rows; returns their mean next-byte loss."""
    for group in opt.param_groups:
        group["lr"] = lr  # a pure function of the step: nothing to checkpoint
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


# ------------------------------------------------------------------- run folder


class RunDir:
    """Checkpoints and metrics of one run, written by rank 0 (checkpoints by every rank)."""

    def __init__(self, path: Path, rank: int):
        self.path, self.rank = path, rank
        self.checkpoints = path / "checkpoints"
        self.metrics_file = path / "metrics.jsonl"

    def check_config(self, config: dict) -> None:
        """Writes the model config, or exits if the folder holds another model's run."""
        saved = self.path / "config.json"
        if saved.exists():
            before = json.loads(saved.read_text())
            if before != config:
                sys.exit(
                    f"{self.path} holds a run of another model ({before}); this one is "
                    f"{config}. Pass another --run-dir."
                )
        elif self.rank == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: another rank may read it at any time.
            partial = saved.with_suffix(".partial")
            partial.write_text(json.dumps(config, indent=1) + "\n")
            partial.rename(saved)

    def latest(self) -> tuple[int, Path] | None:
        """The step and path of the newest complete checkpoint, if any."""
        found = []
        if self.checkpoints.is_dir():
            for p in self.checkpoints.iterdir():
                m = re.fullmatch(r"step_(\d+)", p.name)  # a save in flight has a longer name
                if m:
                    found.append((int(m.group(1)), p))
        return max(found) if found else None

    def save(self, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer):
        """Starts checkpointing model, optimizer and step; returns the pending save.

        Every rank writes its own shards (funshard's checkpoint format, which JAX reads
        too); the folder appears under its final name only once complete, so `latest`
        never sees half a checkpoint. The shards are copied before this returns: the
        files are written while training goes on.
        """
        return torch_frontend.save(
            self.checkpoints / f"step_{step:06d}",
            model,
            optimizer=opt,
            step=step,
            asynchronous=True,
        )

    def metrics(self, upto: int) -> list[dict]:
        """Metrics logged up to step `upto` (later ones belong to steps that will be redone)."""
        if not self.metrics_file.exists():
            return []
        rows = [json.loads(line) for line in self.metrics_file.read_text().splitlines()]
        rows = [r for r in rows if r["step"] <= upto]
        if self.rank == 0:
            self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def log(self, rows: list[dict]) -> None:
        if self.rank == 0:
            with self.metrics_file.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def global_mean(values: list[float]) -> np.ndarray:
    """Each entry averaged over the ranks (one collective for all of them)."""
    gathered = multihost_utils.process_allgather(np.asarray(values, np.float64))
    return np.asarray(gathered).reshape(-1, len(values)).mean(axis=0)


def default_run_dir() -> Path:
    return Path("runs") / "train_torch" / time.strftime("%Y%m%d-%H%M%S")


# -------------------------------------------------------------------------- main


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    init_distributed()  # torchrun's environment; without one, a single process
    import jax  # after init_distributed: it starts JAX's runtime

    rank, world = jax.process_index(), jax.process_count()
    cfg = TINY if args.tiny else ModelConfig()
    train = TrainConfig(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
    )
    if train.batch % world:
        sys.exit(f"--batch {train.batch} must be a multiple of the {world} ranks")
    run_dir = args.run_dir or default_run_dir()
    if args.run_dir is None and world > 1:
        sys.exit("pass --run-dir under torchrun: every rank must write the same folder")
    run = RunDir(run_dir, rank)
    run.check_config(dataclasses.asdict(cfg))

    torch.manual_seed(train.seed)  # identical initial weights on every rank
    model = build_model(cfg)
    full = sum(p.numel() for p in model.parameters())
    model = shard_model(model)
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(0.9, 0.99), weight_decay=0.1)

    start = 0
    latest = run.latest()
    if latest is not None and not args.resume:
        sys.exit(
            f"{run.path} already holds checkpoints (newest: step {latest[0]}); pass "
            "--resume to continue from it, or another --run-dir."
        )
    if args.resume:
        if latest is None:
            say(rank, f"no checkpoint in {run.checkpoints}: starting from step 0")
        else:
            start = int(torch_frontend.restore(latest[1], model, optimizer=opt))
            say(rank, f"resumed at step {start} from {latest[1]}")
    run.metrics(upto=start)

    train_data, _ = load_text()
    local = sum(p.numel() for p in model.parameters())
    say(
        rank,
        f"train_torch: {world} rank(s); GPT width {cfg.width}, depth {cfg.depth}, "
        f"{cfg.heads} heads, context {cfg.context}: {full:,} parameters, {local:,} "
        f"in rank 0's shards; {len(train_data):,} training bytes",
    )
    tokens_per_step = train.batch * cfg.context
    pending: list[tuple[int, float]] = []
    saving = None
    tick, trained_s = time.perf_counter(), 0.0
    for step in range(start, train.steps):
        batch = batch_at(train_data, step, train.batch, cfg.context, train.seed)
        loss = train_step(model, opt, local_rows(batch, rank, world), lr_at(step, train))
        done = step + 1
        pending.append((done, loss))
        save = done % train.checkpoint_every == 0 or done == train.steps
        if done % train.log_every and not save:
            continue
        # Per-step losses averaged over the ranks: the global batch's mean loss.
        losses = global_mean([x for _, x in pending])
        elapsed = time.perf_counter() - tick
        trained_s += elapsed
        run.log([{"step": s, "loss": float(x)} for (s, _), x in zip(pending, losses, strict=True)])
        say(
            rank,
            f"step {done:5d}  loss {losses.mean():.4f}  "
            f"{tokens_per_step * len(pending) / elapsed:,.0f} tokens/s",
        )
        pending = []
        if save:
            if saving is not None:
                saving.wait()
            saving = run.save(done, model, opt)
            say(rank, f"checkpoint step {done} -> {run.checkpoints}")
        tick = time.perf_counter()
    if saving is not None:
        saving.wait()
    steps_run = max(train.steps - start, 0)
    speed = tokens_per_step * steps_run / trained_s if steps_run else 0.0
    say(
        rank,
        f"done: {steps_run} steps in {time.perf_counter() - started:.1f} s "
        f"({speed:,.0f} tokens/s while training); resume or extend with "
        f"--run-dir {run.path} --resume --steps N",
    )


if __name__ == "__main__":
    main()
