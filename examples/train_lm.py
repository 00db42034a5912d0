"""Train a small GPT on Shakespeare with funshard, on 8 simulated CPU devices.

The main job. A byte-level GPT written in Flax nnx is sharded FSDP2-style through
`funshard.flax` (every transformer block one unit, the model the root), then trained with
AdamW on the public-domain text in `examples/data/`. It prints funshard's plan for the
step, trains under a progress bar with validation every 100 steps, checkpoints
into its run folder (and resumes from there when run again with the same `--run-dir`),
and ends with a summary table (memory per device, collectives per step read from the
compiled program, losses against the unigram baseline), a loss-curve PNG and a sample of
generated text.

Run: python examples/train_lm.py [--steps N] [--devices 8] [--replicate K]
         [--param-dtype bf16] [--scan] [--run-dir DIR] [--sample PROMPT]
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
from collections import Counter
from pathlib import Path

# The devices are simulated on the CPU; must be set before JAX picks a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import (  # noqa: E402
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table  # noqa: E402

import funshard as fs  # noqa: E402
import funshard.flax  # noqa: E402,F401  (fs.flax)

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
VOCAB = 256  # byte-level tokens: no tokenizer to ship or download


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of the GPT; a run folder's checkpoints only fit the config that wrote them."""

    width: int = 128
    depth: int = 3
    heads: int = 4
    context: int = 64


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How the model is trained."""

    steps: int = 400
    batch: int = 32  # sequences per step, split over all data-parallel devices
    lr: float = 5e-3
    warmup: int = 50
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 200
    seed: int = 0


TINY = ModelConfig(width=32, depth=2, heads=2, context=32)


def parse_args(argv=None) -> argparse.Namespace:
    """Reads the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--replicate", type=int, default=None,
                   help="HSDP: replicate over K groups, shard within each (fs.make_mesh)")
    p.add_argument("--steps", type=int, default=TrainConfig.steps)
    p.add_argument("--batch", type=int, default=TrainConfig.batch)
    p.add_argument("--lr", type=float, default=TrainConfig.lr)
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    p.add_argument("--checkpoint-every", type=int, default=TrainConfig.checkpoint_every)
    p.add_argument("--param-dtype", choices=["f32", "bf16"], default="f32",
                   help="dtype of the all-gathered parameters (master weights stay f32)")
    p.add_argument("--scan", action="store_true",
                   help="stack the blocks and run them with fs.scan")
    p.add_argument("--tiny", action="store_true", help="a tiny model, for smoke tests")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="checkpoints, metrics and the loss plot; rerun with the same "
                        "folder to resume (default: a fresh runs/train_lm/<time>)")
    p.add_argument("--sample", metavar="PROMPT", default="ROMEO:\n",
                   help="prompt to continue after training ('' for none)")
    p.add_argument("--sample-length", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def batch_at(data: np.ndarray, index: int, rows: int, context: int, seed: int) -> np.ndarray:
    """Random windows of `context + 1` bytes: inputs and their next-byte targets.

    The windows are a function of `index` alone, so a resumed run sees exactly the batches
    an uninterrupted one would have seen.
    """
    rng = np.random.default_rng([seed, index])
    starts = rng.integers(0, len(data) - context - 1, size=rows)
    return data[starts[:, None] + np.arange(context + 1)].astype(np.int32)


class Text:
    """The text as bytes, split into a training part and a held-out tail, served as batches
    placed on the mesh (each device receives its rows)."""

    def __init__(self, mesh, rows: int, context: int, seed: int, *, path: Path = DATA,
                 val_fraction: float = 0.1):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:split], data[split:]
        self.mesh, self.rows, self.context, self.seed = mesh, rows, context, seed

    def train_batch(self, step: int):
        """The batch of training step `step`."""
        return self._place(batch_at(self.train, step, self.rows, self.context, self.seed))

    def val_batches(self, count: int) -> list:
        """The same held-out windows at every evaluation (a seed stream of their own)."""
        return [self._place(batch_at(self.val, i, self.rows, self.context, self.seed + 1))
                for i in range(count)]

    def _place(self, batch: np.ndarray):
        return fs.distributed.shard_batch(batch, self.mesh)


def unigram_entropy(data: np.ndarray) -> float:
    """Entropy of the bytes' frequencies in nats: the loss of a model that ignores context."""
    p = np.bincount(data, minlength=VOCAB) / len(data)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------- model


class Embedding(nnx.Module):
    """Token and learned position embeddings."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.tokens = nnx.Embed(VOCAB, cfg.width, rngs=rngs)
        self.positions = nnx.Embed(cfg.context, cfg.width, rngs=rngs)

    def __call__(self, tokens):
        return self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[-1]))


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.heads = cfg.heads
        self.norm1 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.qkv = nnx.Linear(cfg.width, 3 * cfg.width, rngs=rngs)
        self.proj = nnx.Linear(cfg.width, cfg.width, rngs=rngs)
        self.norm2 = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.up = nnx.Linear(cfg.width, 4 * cfg.width, rngs=rngs)
        self.down = nnx.Linear(4 * cfg.width, cfg.width, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(qkv, 3, axis=2)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Head(nnx.Module):
    """Final LayerNorm and the projection to next-byte logits."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
        self.out = nnx.Linear(cfg.width, VOCAB, rngs=rngs)

    def __call__(self, h):
        return self.out(self.norm(h))


class ScannedBlocks(nnx.Module):
    """The blocks stacked on a leading layer axis, run by `fs.scan` (one program for any depth).

    Built from the same per-block initialisation as `GPT`'s list of blocks, so `--scan`
    trains the same model from the same start.
    """

    def __init__(self, blocks: list[Block]):
        graphdef = nnx.graphdef(blocks[0])
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(b) for b in blocks])
        self.layers = nnx.merge(graphdef, stacked)

    def __call__(self, h):
        graphdef, stacked = nnx.split(self.layers)

        def layer(params, h):
            return nnx.merge(graphdef, params)(h)

        if any(isinstance(x, fs.Sharded) for x in jax.tree.leaves(stacked, is_leaf=_is_sharded)):
            return fs.scan(layer, stacked, h)
        # Unsharded weights (sampling on one device): a plain scan over the layers.
        return jax.lax.scan(lambda h, p: (layer(p, h), None), h, stacked)[0]


class GPT(nnx.Module):
    """A byte-level GPT: embeddings, `depth` blocks, head."""

    def __init__(self, cfg: ModelConfig, *, scan: bool = False, rngs: nnx.Rngs):
        self.embed = Embedding(cfg, rngs=rngs)
        blocks = [Block(cfg, rngs=rngs) for _ in range(cfg.depth)]
        self.blocks = ScannedBlocks(blocks) if scan else nnx.List(blocks)
        self.head = Head(cfg, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        if isinstance(self.blocks, ScannedBlocks):
            h = self.blocks(h)
        else:
            for block in self.blocks:
                h = block(h)
        return self.head(h)


def _is_sharded(x) -> bool:
    """Keeps `fs.Sharded` whole when flattening a tree (its logical shape is metadata)."""
    return isinstance(x, fs.Sharded)


# ------------------------------------------------------------------------- sharding


def shard_model(model: GPT, mesh, mp_policy, scan: bool):
    """Marks the FSDP units of `model` and shards its parameters over `mesh`.

    Returns:
      `(graphdef, state)`: `state` is an `nnx.State` whose parameters are `fs.Sharded`;
      `nnx.merge(graphdef, state)` inside the loss gives the model back, and its units
      gather their parameters when called.
    """
    if not scan:
        # FSDP2's recipe: each block a unit, then the model (embeddings and head).
        for block in model.blocks:
            fs.flax.fully_shard(block)
        # The root's parameters are needed again as soon as the backward pass starts:
        # FSDP2 does not reshard the root after forward either.
        fs.flax.fully_shard(model, reshard_after_forward=False)
        return fs.flax.shard(model, mesh, mp_policy=mp_policy)
    # The stack is one `fs.scan` unit, sharded layer by layer (`stacked=True`). The model
    # cannot be a unit here, since it would gather the whole stack: the embeddings and
    # the head are units of their own (FSDP2's `fully_shard(model.embed)`).
    fs.flax.fully_shard(model.embed)
    fs.flax.fully_shard(model.head, reshard_after_forward=False)
    stack = fs.shard(nnx.state(model.blocks), mesh, stacked=True, mp_policy=mp_policy)
    graphdef, state = fs.flax.shard(model, mesh, mp_policy=mp_policy)  # blocks: replicated
    stacked = dict(nnx.to_flat_state(nnx.State({"blocks": stack})))
    return graphdef, nnx.from_flat_state(
        [(path, stacked.get(path, value)) for path, value in nnx.to_flat_state(state)]
    )


def plan(state, optimizer, depth: int, scan: bool):
    """`fs.plan` of the step: what each device will hold and send, before compiling."""
    if scan:
        return None  # fs.plan does not model `fs.scan` stacks
    units = {"model": "", **{f"block{i}": f"blocks.{i}" for i in range(depth)}}
    return fs.plan(state, units=units, optimizer=optimizer,
                   reshard_after_forward={"model": False})


def collectives(compiled_text: str) -> dict[str, int]:
    """Counts the all-gathers, reduce-scatters and all-reduces in a compiled program's HLO.

    An instruction inside a loop body (`--scan`: the layer loop) is counted once.
    """
    ops = Counter(re.findall(r"\s(all-gather|reduce-scatter|all-reduce)(?:-start)?\(",
                             compiled_text))
    return {kind: ops[kind] for kind in ("all-gather", "reduce-scatter", "all-reduce")}


def device_bytes(tree, device) -> int:
    """Bytes of `tree`'s arrays that live on `device`."""
    return sum(
        shard.data.nbytes
        for leaf in jax.tree.leaves(tree)
        for shard in leaf.addressable_shards
        if shard.device == device
    )


def replicated_bytes(tree) -> int:
    """Bytes of one unsharded copy of `tree` (logical shapes, no padding)."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=_is_sharded):
        if isinstance(leaf, fs.Sharded):
            total += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        elif hasattr(leaf, "nbytes"):
            total += leaf.nbytes
    return total


# ------------------------------------------------------------------------- training


def make_loss(graphdef):
    """The loss `fs.value_and_grad` runs on every device, on its slice of the batch."""

    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        logits = model(batch[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return loss_fn


def make_optimizer(train: TrainConfig):
    """AdamW with linear warm-up and cosine decay to a tenth of the peak rate.

    optax sees the sharded state as an ordinary pytree: its moments are sharded like
    the parameters they follow.
    """
    # The clamps keep a valid schedule for runs of a few steps (smoke tests).
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, train.lr, min(train.warmup, max(train.steps - 1, 1)), max(train.steps, 2),
        train.lr / 10,
    )
    return optax.adamw(schedule, b2=0.99, weight_decay=0.1)


def compile_train_step(loss_fn, optimizer, state, opt_state, batch):
    """Compiles the step once, ahead of time; the state and optimizer state are donated."""

    def train_step(state, opt_state, batch):
        loss, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1)).lower(state, opt_state, batch).compile()


# ------------------------------------------------------------------- run folder


class RunDir:
    """Checkpoints, metrics and the loss plot of one run; reopening it resumes the run."""

    def __init__(self, path: Path):
        self.path = path
        self.checkpoints = path / "checkpoints"
        self.metrics_file = path / "metrics.jsonl"

    def check_config(self, config: dict) -> None:
        """Writes the model config, or checks it against the one already there."""
        self.path.mkdir(parents=True, exist_ok=True)
        saved = self.path / "config.json"
        if saved.exists():
            before = json.loads(saved.read_text())
            if before != config:
                sys.exit(f"{self.path} holds a run of another model ({before}); this one is "
                         f"{config}. Pass another --run-dir.")
        else:
            saved.write_text(json.dumps(config, indent=1) + "\n")

    def latest(self) -> tuple[int, Path] | None:
        """The step and path of the newest complete checkpoint, if any."""
        found = []
        if self.checkpoints.is_dir():
            # Incomplete saves carry a suffix until they are renamed: never matched.
            for p in self.checkpoints.iterdir():
                m = re.fullmatch(r"step_(\d+)", p.name)
                if m:
                    found.append((int(m.group(1)), p))
        return max(found) if found else None

    def save(self, step: int, tree) -> fs.PendingSave:
        """Starts writing `tree` as the checkpoint of `step`, in the background."""
        return fs.save(self.checkpoints / f"step_{step:06d}", tree, asynchronous=True)

    def metrics(self, upto: int) -> list[dict]:
        """Metrics logged up to step `upto` (later ones belong to steps that will be redone)."""
        if not self.metrics_file.exists():
            return []
        rows = [json.loads(line) for line in self.metrics_file.read_text().splitlines()]
        rows = [r for r in rows if r["step"] <= upto]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def log(self, row: dict) -> None:
        """Appends one metrics row (the loss plot of a resumed run draws on them all)."""
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")


def default_run_dir() -> Path:
    """A fresh folder per run, so that rerunning the command starts over."""
    return Path("runs") / "train_lm" / time.strftime("%Y%m%d-%H%M%S")


# --------------------------------------------------------------------- sampling


def generate(graphdef, state, prompt: str, length: int, context: int, temperature: float,
             seed: int = 0) -> str:
    """Continues `prompt` byte by byte with the trained model, on one device."""
    device = jax.devices()[0]
    # Full weights on one device: no collectives, and units call their modules directly.
    weights = jax.device_put(fs.unshard(state), device)

    @jax.jit
    def logits_at(weights, window, position):
        return nnx.merge(graphdef, weights)(window[None])[0, position]

    tokens = list(prompt.encode("utf-8")) or [ord("\n")]
    rng = np.random.default_rng(seed)
    for _ in range(length):
        recent = tokens[-context:]
        window = np.zeros(context, np.int32)
        window[: len(recent)] = recent  # causal: positions after the last byte do not matter
        logits = np.asarray(logits_at(weights, window, len(recent) - 1), np.float64)
        if temperature <= 0:
            tokens.append(int(logits.argmax()))
        else:
            p = np.exp((logits - logits.max()) / temperature)
            tokens.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return bytes(tokens).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------- report


def plot_losses(rows: list[dict], baseline: float, path: Path) -> None:
    """Writes the training and validation loss curves as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val"]) for r in rows if "val" in r]
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title="train_lm: byte-level GPT")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_table(facts: dict) -> Table:
    """The end-of-run summary: memory, communication, losses, speed."""
    table = Table(title="train_lm summary", header_style="bold")
    table.add_column("")
    table.add_column("this run", justify="right")
    table.add_column("compared with")
    for name in ("parameters", "optimizer state"):
        mine, full = facts[name]
        table.add_row(f"{name} per device", _size(mine),
                      f"{_size(full)} replicated (1/{full / mine:.1f})")
    table.add_section()
    planned = facts["plan"]
    for kind, count in facts["collectives"].items():
        note = "" if planned is None else f"fs.plan: {planned.count(kind)}"
        if facts["scan"]:
            note = "the layer loop's counted once"
        if planned is not None and kind == "all-reduce" and planned.count(kind) != count:
            note += " (XLA merged some)"
        table.add_row(f"{kind}s per step", str(count), note)
    table.add_section()
    baseline = facts["baseline"]
    for name in ("train loss", "validation loss"):
        table.add_row(f"{name} (nats/byte)", f"{facts[name]:.3f}",
                      f"unigram baseline {baseline:.3f}")
    table.add_section()
    table.add_row("throughput", f"{facts['tokens/s']:,.0f} tokens/s",
                  f"{facts['tokens']:,} tokens trained")
    table.add_row("wall time", f"{facts['wall']:.1f} s", f"compile {facts['compile']:.1f} s")
    return table


def _size(n: int) -> str:
    """Bytes in KiB or MiB, as `fs.plan` writes them."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


# -------------------------------------------------------------------------- main


def policy_for(param_dtype: str) -> fs.MixedPrecisionPolicy | None:
    """`--param-dtype` as funshard's mixed-precision policy (None: f32 throughout)."""
    if param_dtype == "f32":
        return None
    # Gather in bf16; reduce gradients in f32 so that the f32 master weights see
    # full-precision sums.
    return fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)


def resume(console, run: RunDir, state, opt_state) -> tuple[int, object, object]:
    """`(step, state, opt_state)` of the newest checkpoint in `run`, else of step 0.

    `state` and `opt_state` are the fresh ones: they give the structure and the layout
    (mesh, policy) the checkpoint is restored onto, whatever mesh wrote it.
    """
    latest = run.latest()
    if latest is None:
        return 0, state, opt_state
    start, path = latest
    tree = fs.restore(path, {"params": state, "opt": opt_state, "step": 0})
    console.print(f"resumed at step {start} from {path}")
    return start, tree["params"], tree["opt"]


def print_plan(console, planned) -> None:
    """Prints `fs.plan`'s tables as plain text (their own layout, unwrapped)."""
    if planned is None:
        console.print("(fs.plan does not cover fs.scan stacks: no plan for --scan)")
    else:
        console.print(str(planned) + "\n", markup=False, highlight=False)


def main(argv=None) -> None:
    """Trains (or resumes), then reports, plots and samples."""
    started = time.perf_counter()
    args = parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)
    console = Console(soft_wrap=True)  # long paths stay on one line for copy-paste
    cfg = TINY if args.tiny else ModelConfig()
    train = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr,
                        eval_every=args.eval_every, checkpoint_every=args.checkpoint_every)
    run = RunDir(args.run_dir or default_run_dir())
    # The mesh and the mixed-precision policy may change on resume (checkpoints are
    # resharded on load); the model's shape and its stacking may not.
    run.check_config({**dataclasses.asdict(cfg), "scan": args.scan})

    mesh = fs.make_mesh(replicate=args.replicate)
    model = GPT(cfg, scan=args.scan, rngs=nnx.Rngs(train.seed))
    graphdef, state = shard_model(model, mesh, policy_for(args.param_dtype), args.scan)
    del model  # its arrays now live sharded in `state`
    optimizer = make_optimizer(train)
    start, state, opt_state = resume(console, run, state, fs.init_optimizer(optimizer, state))
    history = run.metrics(upto=start)
    if start >= train.steps:
        console.print(f"already trained to step {start}; pass a larger --steps to go on")

    text = Text(mesh, train.batch, cfg.context, train.seed)
    baseline = unigram_entropy(text.train)
    console.print(
        f"[bold]train_lm[/]: {len(text.train):,} training bytes, {len(text.val):,} held out; "
        f"unigram baseline {baseline:.3f} nats/byte; mesh {dict(mesh.shape)} "
        f"on {len(jax.devices())} {jax.devices()[0].platform} devices"
    )
    planned = plan(state, optimizer, cfg.depth, args.scan)
    print_plan(console, planned)

    loss_fn = make_loss(graphdef)
    compile_s = time.perf_counter()
    step_fn = compile_train_step(loss_fn, optimizer, state, opt_state, text.train_batch(0))
    compile_s = time.perf_counter() - compile_s
    evaluate, val_batches = jax.jit(loss_fn), text.val_batches(train.eval_batches)
    state, opt_state, history, tps = train_loop(
        console, run, step_fn, lambda s: float(np.mean([evaluate(s, b) for b in val_batches])),
        state, opt_state, start, train, history, text.train_batch,
        tokens_per_step=train.batch * cfg.context,
    )

    plot_losses(history, baseline, run.path / "loss.png")
    train_losses = [r["loss"] for r in history if "loss" in r][-3:]  # the last 30 steps
    vals = [r["val"] for r in history if "val" in r]
    device = jax.devices()[0]
    console.print(summary_table({
        "parameters": (device_bytes(state, device), replicated_bytes(state)),
        "optimizer state": (device_bytes(opt_state, device), replicated_bytes(opt_state)),
        # Read from the compiled program (XLA may merge all-reduces into tuples).
        "collectives": collectives(step_fn.as_text()),
        "plan": planned,
        "scan": args.scan,
        "baseline": baseline,
        "train loss": float(np.mean(train_losses)) if train_losses else float("nan"),
        "validation loss": vals[-1] if vals else float("nan"),
        "tokens/s": tps,
        "tokens": max(train.steps - start, 0) * train.batch * cfg.context,
        "wall": time.perf_counter() - started,
        "compile": compile_s,
    }))
    console.print(f"loss curve: {run.path / 'loss.png'}")
    if args.sample:
        console.print("[bold]sample:[/]")
        console.print(generate(graphdef, state, args.sample, args.sample_length, cfg.context,
                               args.temperature, seed=train.seed), markup=False, highlight=False)
    console.print(f"wall time {time.perf_counter() - started:.1f} s; resume or extend with "
                  f"--run-dir {run.path} --steps N")


def train_loop(console, run, step_fn, val_loss, state, opt_state, start, train, history,
               batch_for, tokens_per_step):
    """Runs steps `start..train.steps`: logs, evaluates and checkpoints as it goes.

    Returns:
      The final state and optimizer state, the metrics history, and the training
      throughput in tokens per second (evaluation and checkpoint time excluded).
    """
    columns = (
        TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("val {task.fields[val]}"),
        TextColumn("{task.fields[tps]} tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
    )
    last_val = next((r["val"] for r in reversed(history) if "val" in r), None)
    pending, losses, trained_s = None, [], 0.0
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("train", total=train.steps, completed=start, loss="-",
                                 val="-" if last_val is None else f"{last_val:.3f}", tps="-")
        tick = time.perf_counter()
        for step in range(start, train.steps):
            state, opt_state, loss = step_fn(state, opt_state, batch_for(step))
            losses.append(loss)  # a device array: reading it now would stall the pipeline
            done = step + 1
            evaluate = done % train.eval_every == 0 or done == train.steps
            save = done % train.checkpoint_every == 0 or done == train.steps
            if done % 10 and not (evaluate or save):
                continue
            mean = float(np.mean([float(x) for x in losses]))
            trained_s += time.perf_counter() - tick
            history.append({"step": done, "loss": mean})
            run.log(history[-1])
            losses = []
            tps = tokens_per_step * (done - start) / trained_s
            progress.update(task, completed=done, loss=f"{mean:.3f}", tps=f"{tps:,.0f}")
            if evaluate:
                val = val_loss(state)
                history.append({"step": done, "val": val})
                run.log(history[-1])
                progress.update(task, val=f"{val:.3f}")
                progress.console.print(f"step {done:5d}  train {mean:.3f}  val {val:.3f}")
            if save:
                if pending is not None:
                    pending.wait()
                # Returns once the arrays are copied off the devices (the next step
                # donates them); the files are written in the background.
                pending = run.save(done, {"params": state, "opt": opt_state, "step": done})
            tick = time.perf_counter()
    if pending is not None:
        pending.wait()
    steps_run = train.steps - start
    return state, opt_state, history, tokens_per_step * steps_run / trained_s if steps_run else 0.0


if __name__ == "__main__":
    main()
