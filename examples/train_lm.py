"""Train a small GPT on Shakespeare with funshard, on 8 simulated CPU devices.

The main job. A byte-level GPT written in Flax nnx is sharded FSDP2-style through
`funshard.flax` (every transformer block one unit, the model the root), then trained with
AdamW on the public-domain text in `examples/data/`. It checks every flag before anything
is compiled, prints funshard's plan for the step, trains under a progress bar (loss, step
time, tokens/s, MFU, gradient norm, learning rate, peak memory per device) with validation
every 100 steps, checkpoints into its run folder together with the run's settings (and
resumes from there when run again with the same `--run-dir`; one run at a time holds the
folder, and SIGTERM or Ctrl-C saves a checkpoint of the step under way before exiting),
and ends with a summary table (memory per device, collectives per step read from the
compiled program, losses against the unigram baseline, speed), a loss-curve PNG and a
sample of generated text.

Model parallelism composes with FSDP on one `jax.make_mesh` mesh. `--tensor K` splits
every block over a `tensor` axis of K devices as Megatron does (each device computes
its heads and its columns of the MLP; the output projections sum over `tensor`) and
FSDP-shards the rest over the other devices; the batch is split over the data axes only.
`--experts E` puts a top-2 mixture of E experts in place of each block's MLP, and
`--expert-parallel K` splits the experts over an `expert` axis of K devices (tokens
travel to their experts with `all_to_all`), which the dense parameters and the batch
use as a data axis (torchtitan's dense and sparse views of the same devices). Both
compose with `--replicate`, `--scan` and each other, and a checkpoint resumes on any
other split of the same model.

Run: python examples/train_lm.py [--steps N] [--devices 8] [--replicate K]
         [--tensor K] [--experts E] [--expert-parallel K]
         [--batch B] [--lr LR] [--warmup W] [--clip NORM] [--seed S]
         [--param-dtype bf16] [--scan] [--run-dir DIR] [--override]
         [--peak-tflops T] [--profile DIR] [--tensorboard] [--sample PROMPT]
         [--check-only]

Before training, `fs.check` holds the compiled step's collectives against the policy
(`--check-only` prints its report and exits, status 1 if they differ).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import importlib
import importlib.util
import json
import math
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: run folders are not locked
    fcntl = None

# The devices are simulated on the CPU; must be set before JAX picks a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The examples extra, named instead of a bare "No module named 'flax'".
for _module in ("flax", "rich"):
    if importlib.util.find_spec(_module) is None:
        raise ModuleNotFoundError(
            f"examples/train_lm.py needs {_module}, part of the examples extra: "
            'pip install "funshard[examples]" (in a checkout: pip install -e ".[examples]")',
            name=_module,
        )

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
from rich.text import Text as RichText  # noqa: E402

import funshard as fs  # noqa: E402
import funshard.flax  # noqa: E402  (fs.flax)

# The model: models/nnx_gpt.py beside this script (found also when loaded by path).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))
from models import TINY, VOCAB, ModelConfig  # noqa: E402
from models.nnx_gpt import EXPERT, GPT, TENSOR, TOP_K, model_spec  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt"
PROMPT = "ROMEO:"  # the default --sample, as docs/getting-started.md states it
LOG_EVERY = 10  # steps per logged row (plus the first step, evaluations and checkpoints)
PROFILED_STEPS = 3


# --------------------------------------------------------------------------- config


EVAL_BATCHES = 4


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's settings: kept in the run folder's `config.json`, checked on resume.

    Each field is the flag of the same name (`param_dtype` is `--param-dtype`). A resume
    takes every setting not given on the command line from the run folder; see `FIXED`,
    `MATCHED` and `FREE` for what a resume may change.
    """

    tiny: bool = False
    scan: bool = False
    batch: int = 32  # sequences per step, split over all data-parallel devices
    lr: float = 5e-3
    seed: int = 0
    warmup: int = 50
    clip: float = 0.0  # 0: no gradient clipping
    steps: int = 400
    devices: int = 8
    replicate: int = 1  # 1: plain FSDP
    tensor: int = 1  # 1: no tensor parallelism
    experts: int = 0  # 0: a dense MLP in every block
    expert_parallel: int = 1  # 1: every device holds every expert
    param_dtype: str = "f32"
    eval_every: int = 100
    checkpoint_every: int = 200

    @property
    def model(self) -> ModelConfig:
        """The model shape `--tiny` selects."""
        return TINY if self.tiny else ModelConfig()

    @property
    def data_parallel(self) -> int:
        """Devices the batch is split over: a tensor-parallel group shares its rows."""
        return self.devices // self.tensor


# The checkpoints' shapes depend on these: no resume can change them.
FIXED = ("tiny", "scan", "experts")
# These change what the run computes: a resume refuses a change unless --override.
MATCHED = ("batch", "lr", "seed", "warmup", "clip")
# Layout, length and bookkeeping: a resume may change them (checkpoints are resharded on
# load; a larger --steps extends the run, and the cosine schedule with it).
FREE = (
    "steps",
    "devices",
    "replicate",
    "tensor",
    "expert_parallel",
    "param_dtype",
    "eval_every",
    "checkpoint_every",
)
DEFAULTS = Settings()


def default_warmup(steps: int) -> int:
    """`--warmup`'s default: 50 steps, an eighth of the run for runs under 400 steps."""
    return max(0, min(DEFAULTS.warmup, steps // 8))


def flag(name: str) -> str:
    """The command-line flag of the setting `name`."""
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """The command line. Run settings default to "not given" so a resume can inherit them."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="A run folder keeps the run settings in config.json. Rerunning a folder "
        "takes every setting not given from there; --steps, --devices, --replicate, "
        "--tensor, --expert-parallel, --param-dtype, --eval-every and --checkpoint-every "
        "may change on resume, --batch, --lr, --seed, --warmup and --clip only with "
        "--override, --tiny, --scan and --experts never.",
    )
    run = p.add_argument_group("run settings (kept in the run folder)")
    unset = argparse.SUPPRESS  # absent from the namespace unless given
    run.add_argument(
        "--tiny", action="store_true", default=unset, help="a tiny model, for smoke tests"
    )
    run.add_argument(
        "--scan",
        action="store_true",
        default=unset,
        help="stack the blocks and run them with fs.scan",
    )
    run.add_argument(
        "--steps", type=int, default=unset, help=f"train to step N (default {DEFAULTS.steps})"
    )
    run.add_argument(
        "--batch",
        type=int,
        default=unset,
        help=f"sequences per step, split over all devices (default {DEFAULTS.batch})",
    )
    run.add_argument(
        "--lr", type=float, default=unset, help=f"peak learning rate (default {DEFAULTS.lr})"
    )
    run.add_argument(
        "--warmup",
        type=int,
        default=unset,
        help="linear warm-up steps before the cosine decay to lr/10 "
        f"(default {DEFAULTS.warmup}, at most steps/8)",
    )
    run.add_argument(
        "--clip",
        type=float,
        default=unset,
        metavar="NORM",
        help="clip gradients to this global norm (default 0: no clipping)",
    )
    run.add_argument(
        "--seed",
        type=int,
        default=unset,
        help=f"initialisation, batches and sampling (default {DEFAULTS.seed})",
    )
    run.add_argument(
        "--devices",
        type=int,
        default=unset,
        help=f"simulated CPU devices (default {DEFAULTS.devices})",
    )
    run.add_argument(
        "--replicate",
        type=int,
        default=unset,
        metavar="K",
        help="HSDP: replicate over K groups, shard within each "
        "(jax.make_mesh; default 1: plain FSDP)",
    )
    run.add_argument(
        "--tensor",
        type=int,
        default=unset,
        metavar="K",
        help="tensor parallelism: split each block's heads and MLP over K devices "
        "(Megatron), FSDP over the rest (default 1: none)",
    )
    run.add_argument(
        "--experts",
        type=int,
        default=unset,
        metavar="E",
        help=f"a top-{TOP_K} mixture of E experts in place of each block's MLP "
        "(default 0: a dense MLP)",
    )
    run.add_argument(
        "--expert-parallel",
        type=int,
        default=unset,
        metavar="K",
        help="expert parallelism: split the experts over K devices, with all_to_all "
        "dispatch (default 1: every device holds every expert)",
    )
    run.add_argument(
        "--param-dtype",
        choices=["f32", "bf16"],
        default=unset,
        help="dtype of the all-gathered parameters (master weights stay f32)",
    )
    run.add_argument(
        "--eval-every",
        type=int,
        default=unset,
        help=f"steps between validations (default {DEFAULTS.eval_every})",
    )
    run.add_argument(
        "--checkpoint-every",
        type=int,
        default=unset,
        help=f"steps between checkpoints (default {DEFAULTS.checkpoint_every})",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="checkpoints, settings, metrics and the loss plot; rerun with the "
        "same folder to resume (default: a fresh runs/train_lm/<time>)",
    )
    p.add_argument(
        "--override",
        action="store_true",
        help="resume even though --batch, --lr, --seed, --warmup or --clip "
        "differ from the run folder's",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        metavar="T",
        help="peak dense TFLOP/s of one device, for MFU (default: MFU not shown)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"write a jax.profiler trace of {PROFILED_STEPS} training steps to DIR",
    )
    p.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write the metrics as TensorBoard scalars into the run folder "
        "(needs tensorboardX, or tensorboard for torch.utils.tensorboard)",
    )
    p.add_argument(
        "--sample",
        metavar="PROMPT",
        default=PROMPT,
        help=f"prompt to continue after training (default {PROMPT!r}; '' for none)",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="compile the step, print fs.check's report of its collectives against the "
        "policy, and exit without training (status 1 if they differ)",
    )
    p.add_argument("--sample-length", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    return p


def resolve_settings(parser, args, saved: dict | None) -> tuple[Settings, list[str]]:
    """The run's settings: the command line's, else the run folder's, else the defaults.

    Returns:
      The settings, and the changes a resume accepted as `(name, old, new)`.

    Raises:
      SystemExit: (through `parser.error`) a resume changes a FIXED setting, or a MATCHED
        one without `--override`.
    """
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(Settings) if hasattr(args, f.name)
    }
    values = {**dataclasses.asdict(DEFAULTS), **(saved or {}), **given}
    if "warmup" not in given and "warmup" not in (saved or {}):
        values["warmup"] = default_warmup(values["steps"])
    changed = [
        (name, saved[name], value)
        for name, value in given.items()
        if saved is not None and name in saved and saved[name] != value
    ]
    refused = [c for c in changed if c[0] in FIXED or (c[0] in MATCHED and not args.override)]
    if refused:
        parser.error(resume_conflict(refused, args.override))
    return Settings(**values), changed


def resume_conflict(refused: list[tuple[str, object, object]], override: bool) -> str:
    """The error for settings a resume may not change, with what to do instead."""
    lines = ["this run folder was trained with other settings:"]
    for name, old, new in refused:
        lines.append(f"  {flag(name)}: {_shown(old)} in the run folder, {_shown(new)} now")
    if any(name in FIXED for name, _, _ in refused):
        lines.append(
            "--tiny, --scan and --experts fix the shape of the checkpoints: leave them "
            "as they were, or pass another --run-dir."
        )
    if not override and any(name in MATCHED for name, _, _ in refused):
        lines.append(
            "Leave those flags out to keep the run's values, pass --override to "
            "change them from here on, or pass another --run-dir."
        )
    return "\n".join(lines)


def _change(name: str, old, new) -> str:
    """A setting's change as a line: `--lr 0.5 (was 0.005)`."""
    return f"{flag(name)} {_shown(new)} (was {_shown(old)})"


def _shown(value) -> str:
    """A setting's value as a user would type it (booleans as given / not given)."""
    if isinstance(value, bool):
        return "given" if value else "not given"
    return str(value)


def check_settings(parser, settings: Settings, args, run_path: Path | None = None) -> None:
    """Refuses every bad flag at once, before JAX starts, naming the flag and the fix.

    `run_path` is the run folder (`--run-dir`, or the default one): it must be writable.
    """
    problems = [*_setting_problems(settings), *_invocation_problems(args)]
    if run_path is not None:
        problems.append(_run_dir_problem(run_path))
    problems = [p for p in problems if p]
    if problems:
        parser.error("\n".join(problems))


def _setting_problems(s: Settings) -> list[str | None]:
    return [
        _at_least("steps", s.steps, 1, "the step to train to"),
        _at_least("batch", s.batch, 1, "sequences per step"),
        None
        if s.lr > 0 and math.isfinite(s.lr)
        else f"--lr {s.lr}: the learning rate must be a positive number, e.g. --lr {DEFAULTS.lr}",
        _at_least("seed", s.seed, 0, "a seed for numpy and nnx.Rngs"),
        _at_least("warmup", s.warmup, 0, "warm-up steps"),
        None
        if s.warmup < s.steps or s.steps < 1
        else f"--warmup {s.warmup} must be below --steps {s.steps} (the warm-up is part of "
        "the schedule): pass a smaller --warmup or a larger --steps",
        None
        if s.clip >= 0 and math.isfinite(s.clip)
        else f"--clip {s.clip}: the gradient-norm limit must be positive (or 0: no clipping)",
        _at_least("devices", s.devices, 1, "devices"),
        _at_least("replicate", s.replicate, 1, "replica groups (1: plain FSDP)"),
        _at_least("tensor", s.tensor, 1, "devices per tensor-parallel group (1: none)"),
        _at_least("expert_parallel", s.expert_parallel, 1, "devices the experts are split over"),
        *_model_problems(s),
        *_mesh_problems(s),
        _at_least("eval_every", s.eval_every, 1, "steps between validations"),
        _at_least("checkpoint_every", s.checkpoint_every, 1, "steps between checkpoints"),
    ]


def _model_problems(s: Settings) -> list[str | None]:
    """What the model's shape rules out: a split its heads or experts do not allow."""
    heads = s.model.heads
    return [
        None
        if s.experts == 0 or s.experts >= TOP_K
        else f"--experts {s.experts}: each token goes to {TOP_K} experts, so a mixture "
        f"needs at least {TOP_K} (or 0: a dense MLP)",
        None
        if s.expert_parallel == 1 or s.experts
        else f"--expert-parallel {s.expert_parallel} needs experts to split: pass "
        f"--experts E (a multiple of {s.expert_parallel})",
        None
        if s.tensor < 1 or heads % s.tensor == 0
        else f"--tensor {s.tensor} does not divide the model's {heads} attention heads: "
        "tensor parallelism gives each device whole heads; pass a --tensor that "
        f"divides {heads}",
        None
        if s.experts < TOP_K or s.expert_parallel < 1 or s.experts % s.expert_parallel == 0
        else f"--expert-parallel {s.expert_parallel} does not divide --experts {s.experts}: "
        "every device of the expert axis holds as many experts",
    ]


def _mesh_problems(s: Settings) -> list[str | None]:
    """What the device count rules out: a mesh that does not fit, a batch that does not
    split evenly over the data-parallel devices."""
    split = {"replicate": s.replicate, "tensor": s.tensor, "expert_parallel": s.expert_parallel}
    if s.devices < 1 or min(split.values()) < 1:
        return []  # reported already
    given = {name: k for name, k in split.items() if k > 1}
    product = math.prod(split.values())
    if s.devices % product:
        flags = " x ".join(f"{flag(name)} {k}" for name, k in given.items())
        what = (
            f"HSDP needs {s.devices} devices to form {s.replicate} equal groups"
            if list(given) == ["replicate"]
            else f"the mesh needs a whole number of FSDP devices for each of the {product} "
            "groups they make"
        )
        return [f"{flags} does not divide --devices {s.devices}: {what}"]
    dp = s.data_parallel
    if s.batch < 1 or s.batch % dp == 0:
        return []
    lower = s.batch // dp * dp
    size = (
        f"--devices {s.devices}'s data-parallel size {dp}"
        if s.tensor == 1
        else f"the data-parallel size {dp} (--devices {s.devices} / --tensor {s.tensor})"
    )
    return [
        f"--batch {s.batch} is not divisible by {size} (every device trains on an equal "
        "share of the batch): pass " + (f"--batch {lower} or " if lower else "") + f"--batch "
        f"{lower + dp}, or a --devices "
        + ("that" if s.tensor == 1 else "whose data-parallel size")
        + f" divides {s.batch}"
    ]


def _invocation_problems(args) -> list[str | None]:
    peak = args.peak_tflops
    return [
        _at_least("sample_length", args.sample_length, 0, "bytes to generate"),
        None
        if args.temperature >= 0
        else f"--temperature {args.temperature}: must be >= 0 (0 for greedy decoding)",
        None
        if peak is None or (peak > 0 and math.isfinite(peak))
        else f"--peak-tflops {peak}: must be the device's positive peak TFLOP/s, e.g. 989 for "
        "an H100's dense bf16",
        None
        if args.run_dir is None or not args.run_dir.is_file()
        else f"--run-dir {args.run_dir} is a file: pass a folder (new or a run's)",
        None
        if args.profile is None or not args.profile.is_file()
        else f"--profile {args.profile} is a file: pass a folder for the trace",
        None
        if not args.tensorboard or summary_writer_class() is not None
        else "--tensorboard needs a TensorBoard writer: pip install tensorboardX (or tensorboard, "
        "for torch.utils.tensorboard), or leave --tensorboard out",
    ]


def _run_dir_problem(path: Path) -> str | None:
    """Why no run can write to the run folder `path`, as a flag error; None if it can."""
    blocker = None if path.is_file() else _unwritable(path)  # a file: reported already
    if blocker is None:
        return None
    if not path.exists():
        return (
            f"--run-dir {path}: cannot create it: {blocker} is read-only (or not "
            "yours): pass a --run-dir in a folder you can write to"
        )
    return (
        f"--run-dir {path}: {blocker} is read-only (or not yours), and a run writes its "
        "lock, settings, metrics and checkpoints there: pass a --run-dir you can write "
        f"to (to resume this run from there, copy it first: cp -r {path} NEW_DIR)"
    )


def _unwritable(path: Path) -> Path | None:
    """The first thing a run must write in the run folder `path` and may not, or None.

    That is the folder itself and what a resume rewrites in it, or for a new folder the
    nearest existing folder above it, where it would be created. `os.access` also sees a
    read-only file system, for root too.
    """
    if not path.exists():
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        return None if os.access(parent, os.W_OK | os.X_OK) else parent
    for p in (
        path,
        path / "checkpoints",
        path / "config.json",
        path / "metrics.jsonl",
        path / RunDir.LOCK,
    ):
        mode = os.W_OK | os.X_OK if p.is_dir() else os.W_OK
        if p.exists() and not os.access(p, mode):
            return p
    return None


def _at_least(name: str, value: int, least: int, what: str) -> str | None:
    if value >= least:
        return None
    return f"{flag(name)} {value}: must be at least {least} ({what})"


def summary_writer_class():
    """TensorBoard's `SummaryWriter` (tensorboardX's, else torch's), or None if absent."""
    # torch's writer needs the tensorboard package: look for it before importing torch.
    for module, package in (
        ("tensorboardX", "tensorboardX"),
        ("torch.utils.tensorboard", "tensorboard"),
    ):
        if sys.modules.get(package) is None and importlib.util.find_spec(package) is None:
            continue
        try:
            return importlib.import_module(module).SummaryWriter
        except ImportError:
            continue
    return None


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

    def __init__(
        self,
        mesh,
        rows: int,
        context: int,
        seed: int,
        *,
        path: Path = DATA,
        val_fraction: float = 0.1,
    ):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:split], data[split:]
        self.mesh, self.rows, self.context, self.seed = mesh, rows, context, seed

    def train_batch(self, step: int):
        """The batch of training step `step`."""
        return self._place(batch_at(self.train, step, self.rows, self.context, self.seed))

    def val_batches(self, count: int) -> list:
        """The same held-out windows at every evaluation (a seed stream of their own)."""
        return [
            self._place(batch_at(self.val, i, self.rows, self.context, self.seed + 1))
            for i in range(count)
        ]

    def _place(self, batch: np.ndarray):
        # Split over the data axes only: the devices of a tensor-parallel group see the
        # same rows.
        return fs.distributed.shard_batch(batch, self.mesh, axes=data_axes(self.mesh))


def unigram_entropy(data: np.ndarray) -> float:
    """Entropy of the bytes' frequencies in nats: the loss of a model that ignores context."""
    p = np.bincount(data, minlength=VOCAB) / len(data)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _is_sharded(x) -> bool:
    """Keeps `fs.Sharded` whole when flattening a tree (its logical shape is metadata)."""
    return isinstance(x, fs.Sharded)


# ------------------------------------------------------------------------- sharding


def shard_model(model: GPT, mesh, mp_policy, scan: bool):
    """Marks the FSDP units of `model` and shards its parameters over `mesh`.

    On a mesh with model axes (`tensor`, `expert`) each parameter is first split as
    `models.nnx_gpt.model_spec` says, then FSDP-sharded over the data axes it is not
    split over.

    Returns:
      `(graphdef, state)`: `state` is an `nnx.State` whose parameters are `fs.Sharded`;
      `nnx.merge(graphdef, state)` inside the loss gives the model back, and its units
      gather their parameters (their model blocks) when called.
    """

    def shard(tree, stacked: bool = False):
        return fs.shard(
            tree,
            mesh,
            mp_policy=mp_policy,
            shard_axis=shard_axes(mesh),
            stacked=stacked,
            model_spec=model_spec(mesh.axis_names, stacked=stacked),
        )

    if not scan:
        # FSDP2's recipe: each block a unit, then the model (embeddings and head).
        for block in model.blocks:
            fs.flax.fully_shard(block)
        # The root's parameters are needed again as soon as the backward pass starts:
        # FSDP2 does not reshard the root after forward either.
        fs.flax.fully_shard(model, reshard_after_forward=False)
        if not {TENSOR, EXPERT} & set(mesh.axis_names):
            return fs.flax.shard(model, mesh, mp_policy=mp_policy)
        # fs.flax.shard takes neither model specs nor several shard axes: every
        # parameter belongs to a unit, so fs.shard on the whole state is the same thing.
        graphdef, state = nnx.split(model)
        return graphdef, shard(state)
    # The stack is one `fs.scan` unit, sharded layer by layer (`stacked=True`). The model
    # cannot be a unit here, since it would gather the whole stack: the embeddings and
    # the head are units of their own (FSDP2's `fully_shard(model.embed)`).
    fs.flax.fully_shard(model.embed)
    fs.flax.fully_shard(model.head, reshard_after_forward=False)
    graphdef, state = nnx.split(model)
    stack = nnx.to_flat_state(nnx.State({"blocks": shard(nnx.state(model.blocks), True)}))
    rest = [(path, v) for path, v in nnx.to_flat_state(state) if path[0] != "blocks"]
    placed = dict([*stack, *nnx.to_flat_state(shard(nnx.from_flat_state(rest)))])
    return graphdef, nnx.from_flat_state(
        [(path, placed[path]) for path, _ in nnx.to_flat_state(state)]
    )


def plan(state, optimizer, depth: int, scan: bool):
    """`fs.plan` of the step: what each device will hold and send, before compiling."""
    if scan:
        # The units of `shard_model`: the stack is one unit, gathered one layer at a
        # time by fs.scan; the embeddings and the head are outermost units, which keep
        # their parameters (fs.flax's default for them).
        units = {"embed": "embed", "blocks": "blocks", "head": "head"}
        keep = {"embed": False, "head": False}
        return fs.plan(state, units=units, optimizer=optimizer, reshard_after_forward=keep)
    units = {"model": "", **{f"block{i}": f"blocks.{i}" for i in range(depth)}}
    return fs.plan(state, units=units, optimizer=optimizer, reshard_after_forward={"model": False})


def collectives(compiled_text: str) -> dict[str, int]:
    """Counts the all-gathers, reduce-scatters and all-reduces in a compiled program's HLO,
    and its all-to-alls if it has any (expert parallelism).

    An instruction inside a loop body (`--scan`: the layer loop) is counted once.
    """
    kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
    ops = Counter(re.findall(rf"\s({'|'.join(kinds)})(?:-start)?\(", compiled_text))
    return {kind: ops[kind] for kind in kinds if ops[kind] or kind != "all-to-all"}


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


def init_model(settings: Settings) -> GPT:
    """The model, its parameters drawn by one compiled program.

    Drawn eagerly, each initializer compiles programs of its own (one per shape and
    op): a second or two more at every start. The values are those of the same
    `GPT(...)` traced under `jax.jit`, as plain JAX's reference computes them.
    """
    return nnx.jit(
        lambda: GPT(
            settings.model,
            scan=settings.scan,
            experts=settings.experts,
            rngs=nnx.Rngs(settings.seed),
        )
    )()


def make_mesh(settings: Settings):
    """JAX's own mesh over every device: ("fsdp",), with "replicate" in front for HSDP,
    and "expert" and "tensor" after it for expert and tensor parallelism.

    `jax.make_mesh` gives `Explicit` axes, where an array's type carries its sharding; the
    training step places its inputs itself, so the same job runs on `fs.make_mesh()`.
    Tensor parallelism takes the last axis, whose devices are nearest each other (on a
    GPU node, one NVLink domain), as Megatron places it.
    """
    groups = settings.replicate * settings.expert_parallel * settings.tensor
    sizes = {
        "replicate": settings.replicate,
        "fsdp": jax.device_count() // groups,
        EXPERT: settings.expert_parallel,
        TENSOR: settings.tensor,
    }
    axes = {name: k for name, k in sizes.items() if k > 1 or name == "fsdp"}
    return jax.make_mesh(tuple(axes.values()), tuple(axes))


def shard_axes(mesh) -> tuple[str, ...]:
    """The axes FSDP shards over: "fsdp", and "expert", which the dense parameters use
    as a data axis (the expert stacks, split over it, are FSDP-sharded over "fsdp")."""
    return tuple(a for a in ("fsdp", EXPERT) if a in mesh.axis_names)


def data_axes(mesh) -> tuple[str, ...]:
    """The axes the batch is split over: every axis but "tensor"."""
    return tuple(a for a in mesh.axis_names if a != TENSOR)


def outside_the_step(loss_fn, mesh):
    """`loss_fn` for evaluation, outside the training step, on a mesh of either axis type.

    Outside a step the model is plain JAX on gathered parameters and a sharded batch. On
    `Explicit` axes JAX wants each output's sharding spelled out (Flax's `Embed` gathers
    rows of a replicated table by sharded indices), so the loss runs with the mesh's axes
    `Auto` for the call (`jax.sharding.auto_axes`), as on `fs.make_mesh()`'s mesh, where
    that is a no-op.
    """
    auto = jax.sharding.auto_axes(loss_fn, out_sharding=jax.sharding.PartitionSpec())

    def evaluate(state, batch):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return auto(state, batch)

    return evaluate


def make_schedule(settings: Settings):
    """Linear warm-up from 0 over `--warmup` steps, then cosine decay to a tenth of `--lr`
    at `--steps`. Update `k` (0-based) uses `schedule(k)`, as optax counts."""
    return optax.warmup_cosine_decay_schedule(
        0.0, settings.lr, settings.warmup, settings.steps, settings.lr / 10
    )


def make_optimizer(settings: Settings):
    """AdamW on the schedule, after clipping the gradients' global norm if `--clip` is set.

    optax sees the sharded state as an ordinary pytree: its moments are sharded like
    the parameters they follow.
    """
    adamw = optax.adamw(make_schedule(settings), b2=0.99, weight_decay=0.1)
    if settings.clip == 0:
        return adamw
    clip = optax.clip_by_global_norm(settings.clip)

    def update(grads, state, params=None):
        grads, _ = clip.update(grads, clip.init(params), params)
        return adamw.update(grads, state, params)

    # Not `optax.chain`: the clip keeps no state, and leaving the optimizer state AdamW's
    # alone lets a resume turn clipping on or off and restore checkpoints written without.
    return optax.GradientTransformation(adamw.init, update)


def compile_train_step(loss_fn, optimizer, state, opt_state, batch) -> fs.StepReport:
    """Compiles the step once, ahead of time, and checks it (`fs.check`): the report's
    `compiled` is the step. The state and optimizer state are donated.

    The step returns the new state, optimizer state and `{"loss", "grad_norm"}`: the
    global-mean loss and the global norm of the gradients before any clipping.
    """

    def train_step(state, opt_state, batch):
        loss, grads = fs.value_and_grad(loss_fn)(state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        # The sharded gradients' padding rows are zeros, so the norm over the padded
        # arrays is the full gradient's norm.
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(state, updates), opt_state, metrics

    return fs.check(jax.jit(train_step, donate_argnums=(0, 1)), state, opt_state, batch)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one compiled training step costs each device, read from the compiled program.

    Attributes:
      flops: XLA's count for one step on one device (forward, backward, optimizer), or
        None when XLA cannot count it: with `--scan` its cost analysis counts the layer
        loop's body once, not once per layer.
      memory_bytes: the step's arguments, outputs and temporaries on one device, less the
        donated buffers it reuses (`memory_analysis()`), or None if unknown.
    """

    flops: float | None
    memory_bytes: int | None

    @classmethod
    def of(cls, compiled, scan: bool) -> StepCost:
        """The cost of `compiled`, the step from `compile_train_step`."""
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: a list
        flops = None if scan or not cost else cost.get("flops")
        memory = compiled.memory_analysis()
        memory_bytes = (
            None
            if memory is None
            else (
                memory.argument_size_in_bytes
                + memory.output_size_in_bytes
                + memory.temp_size_in_bytes
                - memory.alias_size_in_bytes
            )
        )
        return cls(flops=flops, memory_bytes=memory_bytes)


def peak_memory(devices, cost: StepCost) -> tuple[int | None, str]:
    """The peak bytes in use on the busiest device, and where the figure comes from.

    Accelerators report it (`memory_stats()["peak_bytes_in_use"]`); the CPU backend
    does not, so the compiled step's own footprint stands in for it.
    """
    stats = [d.memory_stats() for d in devices]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    if peaks and len(peaks) == len(stats):
        return max(peaks), "memory_stats"
    return cost.memory_bytes, "compiled step"


@dataclasses.dataclass(frozen=True)
class Meter:
    """Turns a logging window's time and metrics into a row's readouts."""

    cost: StepCost
    tokens_per_step: int
    schedule: object  # step -> learning rate
    peak_tflops: float | None

    def row(self, done: int, window: list[dict], seconds: float) -> dict:
        """The metrics row of the `len(window)` steps ending at step `done`."""
        host = jax.device_get(window)
        step_time = seconds / len(window)
        memory, source = peak_memory(jax.local_devices(), self.cost)
        row = {
            "step": done,
            "loss": float(np.mean([m["loss"] for m in host])),
            "window": len(window),
            "grad_norm": float(host[-1]["grad_norm"]),
            "lr": float(self.schedule(done - 1)),  # what the window's last update used
            "step_time_s": step_time,
            "tokens_per_s": self.tokens_per_step / step_time,
        }
        if self.cost.flops is not None:
            row["tflops_per_device"] = self.cost.flops / step_time / 1e12
            if self.peak_tflops is not None:
                row["mfu_percent"] = 100 * row["tflops_per_device"] / self.peak_tflops
        if memory is not None:
            row["peak_memory_bytes"], row["peak_memory_source"] = memory, source
        return row


def readout(row: dict, platform: str) -> str:
    """The progress line's speed, optimizer and memory figures of a metrics row."""
    parts = [f"{1000 * row['step_time_s']:.1f} ms/step", f"{row['tokens_per_s']:,.0f} tok/s"]
    if "tflops_per_device" in row:
        parts.append(f"{row['tflops_per_device']:.3g} TFLOP/s/device")
    if "mfu_percent" in row:
        note = " (indicative on CPU)" if platform == "cpu" else ""
        parts.append(f"MFU {row['mfu_percent']:.2f}%{note}")
    parts += [f"gnorm {row['grad_norm']:.3f}", f"lr {row['lr']:.2e}"]
    if "peak_memory_bytes" in row:
        parts.append(f"peak mem {_size(row['peak_memory_bytes'])}/device")
    return "  ".join(parts)


# ------------------------------------------------------------------- run folder


class RunDir:
    """Checkpoints, settings, metrics and the loss plot of one run; reopening it resumes."""

    LOCK = "lock"  # held by the run training in the folder; names it

    def __init__(self, path: Path):
        self.path = path
        self.lock_file = path / self.LOCK
        self.checkpoints = path / "checkpoints"
        self.metrics_file = path / "metrics.jsonl"
        self.config_file = path / "config.json"
        self.scalars = None  # a TensorBoard SummaryWriter, once `write_tensorboard` is called

    @contextlib.contextmanager
    def hold(self):
        """Holds the folder's lock for this process (creating the folder) while in the block.

        The lock is `fcntl.flock` on the file `lock`, so the kernel releases it when the
        process ends, however it ends (SIGKILL too): a file left behind locks nothing.
        The holder writes its pid, host and start time into the file for the message of
        a run it refuses.

        Raises:
          RunDirInUse: another process holds the lock.
          OSError: the folder or its lock file cannot be created.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise RunDirInUse(self.path, _read_holder(fd)) from None
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(_holder()).encode() + b"\n")
            yield
        finally:
            os.close(fd)  # releases the lock

    def saved_settings(self) -> dict | None:
        """The settings the run folder was trained with, or None for a new folder.

        A folder written before the settings were kept holds only the model's shape and
        `scan`: the other settings are then taken as given.

        Raises:
          SystemExit: the folder holds a model this script does not build.
        """
        if not self.config_file.exists():
            return None
        saved = json.loads(self.config_file.read_text())
        if "settings" in saved:
            return saved["settings"]
        shape = {k: saved.get(k) for k in ("width", "depth", "heads", "context")}
        for tiny, model in ((True, TINY), (False, ModelConfig())):
            if shape == dataclasses.asdict(model):
                return {"tiny": tiny, "scan": bool(saved.get("scan", False))}
        raise SystemExit(
            f"{self.path} holds a run of another model ({saved}); pass another --run-dir."
        )

    def save_settings(self, settings: Settings, step: int, changes: list[tuple]) -> None:
        """Writes `config.json`: the settings, the model's shape, and a line per change.

        Args:
          settings: the settings this invocation trains with.
          step: the step it resumes from.
          changes: `(name, old, new)` for each setting it changes, from `resolve_settings`.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        history = []
        if self.config_file.exists():
            history = json.loads(self.config_file.read_text()).get("changes", [])
        history += [{"step": step, "change": _change(*c)} for c in changes]
        config = {
            "settings": dataclasses.asdict(settings),
            "model": dataclasses.asdict(settings.model),
            "changes": history,
        }
        self.config_file.write_text(json.dumps(config, indent=1) + "\n")

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

    def checkpoint(self, step: int) -> Path:
        """Where the checkpoint of `step` goes."""
        return self.checkpoints / f"step_{step:06d}"

    def save(self, step: int, tree) -> fs.PendingSave:
        """Starts writing `tree` as the checkpoint of `step`, in the background."""
        return fs.save(self.checkpoint(step), tree, asynchronous=True)

    def metrics(self, upto: int) -> list[dict]:
        """Metrics logged up to step `upto` (later ones belong to steps that will be redone)."""
        if not self.metrics_file.exists():
            return []
        rows = [json.loads(line) for line in self.metrics_file.read_text().splitlines()]
        rows = [r for r in rows if r["step"] <= upto]
        self.metrics_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return rows

    def write_tensorboard(self, writer_class) -> None:
        """Also writes every logged number as a TensorBoard scalar, into `tensorboard/`."""
        self.scalars = writer_class(str(self.path / "tensorboard"))

    def log(self, row: dict) -> None:
        """Appends one metrics row (the loss plot of a resumed run draws on them all)."""
        with self.metrics_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.scalars is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.scalars.add_scalar(f"train_lm/{name}", value, row["step"])
            self.scalars.flush()

    def close(self) -> None:
        """Closes the TensorBoard writer, if any."""
        if self.scalars is not None:
            self.scalars.close()


class RunDirInUse(Exception):
    """Another process trains in the run folder: its lock names that process."""

    def __init__(self, path: Path, holder: dict):
        super().__init__(_in_use(path, holder))
        self.holder = holder


def _in_use(path: Path, holder: dict) -> str:
    """The refusal of a second run on `path`, naming the run that holds it."""
    pid = holder.get("pid")
    if pid is None:  # between the holder's lock and its note
        who = "another run (it is just starting)"
    else:
        who = f"pid {pid} on host {holder.get('host', '?')}"
        if "started" in holder:
            ago = max(0, round(time.time() - holder.get("started_unix", time.time())))
            who += f", started {holder['started']} ({ago} s ago)"
    stop = f"stop it (kill -TERM {pid} saves a checkpoint first), " if pid else ""
    return (
        f"--run-dir {path} is in use by {who}. Two runs in one folder would overwrite "
        f"each other's checkpoints and metrics: wait for it to end, {stop}or pass "
        "another --run-dir."
    )


def _holder() -> dict:
    """What the lock file says about the run holding it."""
    now = time.time()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_unix": now,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(now)),
    }


def _read_holder(fd: int) -> dict:
    """The lock file's note on its holder; {} if it is not written yet."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class StopSignals:
    """SIGTERM and SIGINT, while in the block, ask the training loop to stop.

    The handler only records the signal: the loop finishes its step, saves a checkpoint
    and returns (an exception raised in the handler could land anywhere, e.g. in a JAX
    callback that swallows it). It also hands both signals back to the system's default
    action, so that a second one ends the process at once, even inside a long call into
    XLA, where no Python handler runs. A signal the process was started ignoring
    (`nohup`, `cmd &`) stays ignored, and the previous handlers come back when the block
    ends.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # else signal.signal fails
            for signum in self.SIGNALS:
                if signal.getsignal(signum) is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def name(self) -> str:
        """The received signal's name (SIGTERM); '' if none came."""
        return "" if self.received is None else signal.Signals(self.received).name

    @property
    def exit_status(self) -> int:
        """What the run exits with after stopping: 128 + the signal, as a shell reports it."""
        return 128 + self.received

    def _handle(self, signum, frame) -> None:
        self.received = signum
        for other in self._previous:
            signal.signal(other, signal.SIG_DFL)
        name = signal.Signals(signum).name
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
        # os.write: the interrupted code may be inside a print to the same stream.
        os.write(
            2,
            f"\ntrain_lm: {name}: finishing the current step, then saving a "
            f"checkpoint and exiting ({again} to exit at once, without saving)\n".encode(),
        )


def resume_command(argv: list[str], run_path: Path) -> str:
    """The command that resumes this run: this one, with `--run-dir` the run folder."""
    script = (
        sys.argv[0]
        if sys.argv and sys.argv[0] and Path(sys.argv[0]).resolve() == Path(__file__).resolve()
        else __file__
    )
    rest, skip = [], False
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip = False
        elif len(name) >= 4 and "--run-dir".startswith(name):  # argparse takes prefixes
            skip = "=" not in arg
        else:
            rest.append(arg)
    return shlex.join([sys.executable, script, *rest, "--run-dir", str(run_path)])


def default_run_dir() -> Path:
    """A fresh folder per run, so that rerunning the command starts over."""
    return Path("runs") / "train_lm" / time.strftime("%Y%m%d-%H%M%S")


UNIT_TRACE = "funshard_trace.json.gz"  # the trace with its collectives named by unit


class Profiler:
    """`--profile DIR`: a `jax.profiler` trace of a few steps, and the step's HLO beside it.

    The trace starts at the second step of this invocation (the first may still be
    warming up) and covers `PROFILED_STEPS` steps.
    """

    def __init__(self, directory: Path | None, start: int, steps: int, hlo_text: str):
        self.directory, self.hlo_text = directory, hlo_text
        self.first = start + 1 if steps - start > 1 else start
        self.last = min(self.first + PROFILED_STEPS, steps) - 1
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            # On CPU the trace names HLO instructions (`all_gather.48`); their metadata
            # here gives each one's scope (`funshard/Block/all_gather`).
            (directory / "train_step.hlo.txt").write_text(hlo_text)

    def before(self, step: int) -> float:
        """Starts the trace before the first profiled step; returns the seconds it took."""
        if self.directory is None or step != self.first:
            return 0.0
        starting = time.perf_counter()
        jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
        return time.perf_counter() - starting

    def after(self, step: int, outputs) -> float:
        """Ends the trace after the last profiled step; returns the seconds spent writing it."""
        if self.directory is None or step != self.last:
            return 0.0
        jax.block_until_ready(outputs)
        writing = time.perf_counter()
        jax.profiler.stop_trace()
        return time.perf_counter() - writing

    def cut_short(self, step: int) -> None:
        """Ends the trace after `step` if the run stops there, before the last profiled step."""
        if self.directory is not None and self.first <= step < self.last:
            jax.profiler.stop_trace()

    def unit_times(self, devices: int) -> dict[str, float]:
        """Milliseconds per step and device in each funshard scope, read from the trace.

        Also writes `DIR/UNIT_TRACE`: the trace with each of those spans named after its
        scope, then its HLO instruction (`funshard/Block/all_gather (all_gather.48)`;
        the collective's own padding and slicing are fusions of the same scope). On CPU,
        XLA names a span after its instruction only, so this is the trace in which
        Perfetto shows the units.

        Keys are `<unit>/<collective>` (`Block/all_gather`); empty if the trace names no
        instruction of the step (another backend's trace layout).
        """
        traces = sorted(
            self.directory.glob("plugins/profile/*/perfetto_trace.json.gz"),
            key=lambda p: p.stat().st_mtime,
        )
        if not traces:
            return {}
        scopes = dict(
            re.findall(
                r'^\s*(?:ROOT )?%?([\w.-]+) = .*?op_name="[^"]*?'
                r"funshard/(\w+/\w+)",
                self.hlo_text,
                re.M,
            )
        )
        trace = json.loads(gzip.decompress(traces[-1].read_bytes()))
        totals = Counter()
        for event in trace["traceEvents"]:
            args = event.get("args", {})
            scope = scopes.get(args.get("hlo_op"))
            if scope is not None and "dur" in event:
                totals[scope] += event["dur"] / 1000  # microseconds
                event["name"] = f"funshard/{scope} ({event.get('name')})"
        if totals:
            (self.directory / UNIT_TRACE).write_bytes(gzip.compress(json.dumps(trace).encode()))
        steps = self.last - self.first + 1
        return {scope: ms / steps / devices for scope, ms in sorted(totals.items())}


# --------------------------------------------------------------------- sampling


def generate(
    graphdef, state, prompt: str, length: int, context: int, temperature: float, seed: int = 0
) -> str:
    """Continues `prompt` byte by byte with the trained model, on one device."""
    device = jax.devices()[0]
    # Full weights on one device: no collectives, and units call their modules directly.
    # Through the host: on jax 0.10 to 0.12 an array put on one device from a mesh with
    # explicit axes keeps that mesh in its type, and jit then refuses the one device.
    weights = jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), fs.unshard(state))

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
        ax.plot(*zip(*train, strict=True), label="train", lw=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
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
        table.add_row(
            f"{name} per device", _size(mine), f"{_size(full)} replicated (1/{full / mine:.1f})"
        )
    memory, source = facts["peak memory"]
    if memory is not None:
        table.add_row(
            "peak memory per device",
            _size(memory),
            "compiled step's buffers" if source == "compiled step" else "memory_stats() peak",
        )
    table.add_section()
    planned = facts["plan"]
    for kind, count in facts["collectives"].items():
        note = f"fs.plan: {planned.count(kind)}"
        if kind == "all-to-all":
            note = "expert dispatch and combine"
        elif facts["scan"]:
            note += " run; here the layer loop's counted once"
        elif kind == "all-reduce" and facts["tensor"] > 1:
            note += " + tensor sums"
        elif kind == "all-reduce" and planned.count(kind) != count:
            note += " (XLA merged some)"
        table.add_row(f"{kind}s per step", str(count), note)
    if facts["model axes"]:
        for (kind, axes), size in planned_bytes_by_axes(planned).items():
            table.add_row(f"{kind} over {','.join(axes)}", _size(size), "fs.plan's bytes per step")
    checked = facts["check"]
    table.add_row(
        "collectives against policy",
        "✓" if checked.ok else f"✗ {len(checked.mismatches)}",
        "fs.check of the compiled step",
    )
    table.add_section()
    baseline = facts["baseline"]
    loss, window = facts["train loss"]
    table.add_row(
        f"train loss, last {window} steps", f"{loss:.3f}", f"unigram baseline {baseline:.3f}"
    )
    table.add_row(
        "validation loss", f"{facts['validation loss']:.3f}", f"unigram baseline {baseline:.3f}"
    )
    table.add_section()
    table.add_row(
        "throughput", f"{facts['tokens/s']:,.0f} tokens/s", f"{facts['tokens']:,} tokens trained"
    )
    flops, step_time = facts["flops"], facts["step time"]
    table.add_row(
        "step time",
        f"{1000 * step_time:.1f} ms",
        "FLOPs n/a with --scan"
        if flops is None
        else f"{flops / step_time / 1e12:.3g} TFLOP/s per device",
    )
    table.add_row("MFU", *_mfu_cells(facts))
    table.add_row("wall time", f"{facts['wall']:.1f} s", f"compile {facts['compile']:.1f} s")
    return table


def planned_bytes_by_axes(planned) -> dict[tuple[str, tuple[str, ...]], int]:
    """FSDP's collective bytes per step by kind and mesh axes, as `fs.plan` counts them.

    On a mesh with model axes each leaf is gathered and reduced over its own data axes:
    dense parameters over "fsdp" and "expert", the expert stacks over "fsdp" alone.
    (The model's own tensor-parallel sums and expert all-to-alls are not planned.)
    """
    totals: Counter = Counter()
    for c in planned.collectives:
        if c.axes:
            totals[c.kind, c.axes] += c.total_bytes
    return dict(sorted(totals.items()))


def _mfu_cells(facts: dict) -> tuple[str, str]:
    """The MFU row: the figure, and what it rests on."""
    flops, peak = facts["flops"], facts["peak tflops"]
    if flops is None:
        return "n/a", "no FLOPs count with --scan"
    if peak is None:
        return "-", "pass --peak-tflops"
    mfu = f"{100 * flops / facts['step time'] / 1e12 / peak:.2f}%"
    if facts["platform"] == "cpu":
        return mfu, f"vs {peak:g} TFLOP/s; indicative"
    return mfu, f"vs {peak:g} TFLOP/s peak"


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
    console.print(str(planned) + "\n", markup=False, highlight=False)


def print_check(console, checked) -> None:
    """`fs.check`'s verdict on the compiled step, and each mismatch it found."""
    if checked.ok:
        console.print("fs.check: ✓ the compiled step's collectives match the policy")
        return
    console.print(f"fs.check: ✗ {len(checked.mismatches)} mismatches", highlight=False)
    for m in checked.mismatches:
        console.print(f"  ✗ {m.kind}: {m.explanation}", markup=False, highlight=False)


def start_devices(parser, count: int) -> None:
    """Asks for `count` simulated CPU devices and checks that JAX has that many."""
    jax.config.update("jax_num_cpu_devices", count)
    found = jax.devices()
    if len(found) != count:  # another platform (JAX_PLATFORMS) has its own device count
        parser.error(
            f"--devices {count}: JAX runs on {len(found)} {found[0].platform} "
            f"devices here; pass --devices {len(found)}"
        )


def print_changes(console, changes, settings: Settings, start: int) -> None:
    """Says which settings this resume changes, and what a new --steps does to the lr."""
    for name, old, new in changes:
        console.print(f"resuming with {_change(name, old, new)}")
        if name == "steps":
            before = make_schedule(dataclasses.replace(settings, steps=old))(start)
            console.print(
                f"  the cosine schedule now ends at step {new}: the learning rate "
                f"of step {start + 1} is {float(make_schedule(settings)(start)):.2e}"
                f" (was {float(before):.2e})"
            )


def print_mfu_basis(console, cost: StepCost, peak_tflops, platform: str) -> None:
    """Says what the FLOPs and MFU readouts rest on, once, before training."""
    if cost.flops is None:
        console.print(
            "FLOPs and MFU: n/a with --scan (XLA's cost analysis counts the "
            "layer loop's body once, not once per layer)"
        )
        return
    basis = f"{cost.flops:,.0f} FLOPs per step per device (XLA's count of the compiled step)"
    if peak_tflops is None:
        console.print(f"{basis}; pass --peak-tflops for MFU")
    elif platform == "cpu":
        console.print(
            f"{basis}; MFU against --peak-tflops {peak_tflops:g} is indicative on "
            "CPU (the simulated devices share the host's cores)"
        )
    else:
        console.print(f"{basis}; MFU against --peak-tflops {peak_tflops:g}")


def print_profile(console, directory: Path, unit_times: dict[str, float]) -> None:
    """Says where the trace is and how long each unit's collectives took in it."""
    console.print(
        f"profile: {directory} (tensorboard --logdir {directory}, or "
        "plugins/profile/*/perfetto_trace.json.gz in ui.perfetto.dev)"
    )
    if unit_times:
        console.print(f"  spans named by unit: {directory / UNIT_TRACE} (ui.perfetto.dev)")
        times = "  ".join(f"{scope} {ms:.2f}" for scope, ms in unit_times.items())
        console.print(
            f"  each unit's collectives, ms per step and device (waits included): {times}"
        )


def main(argv=None) -> None:
    """Checks the flags, trains (or resumes), then reports, plots and samples."""
    started = time.perf_counter()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    run = RunDir(args.run_dir or default_run_dir())
    settings, changes = resolve_settings(parser, args, run.saved_settings())
    check_settings(parser, settings, args, run.path)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(run.hold())
        except (RunDirInUse, OSError) as e:
            parser.exit(2, f"{parser.prog}: error: {_hold_error(run.path, e)}\n")
        stop = held.enter_context(StopSignals())
        console = Console(soft_wrap=True)  # long paths stay on one line for copy-paste
        latest = run.latest()
        done_before = latest[0] if latest else 0
        if done_before >= settings.steps:
            console.print(
                f"{run.path} is finished: trained to step {done_before} of "
                f"--steps {settings.steps}. Pass a larger --steps to train on, or "
                "another --run-dir to start afresh."
            )
            return
        start_devices(parser, settings.devices)
        if not args.check_only:
            run.save_settings(settings, done_before, changes)
        print_changes(console, changes, settings, done_before)
        train(console, run, settings, args, started, stop, resume_command(argv, run.path))


def _hold_error(path: Path, error: Exception) -> str:
    """Why the run folder could not be taken: in use, or not creatable."""
    if isinstance(error, RunDirInUse):
        return str(error)
    return (
        f"--run-dir {path}: cannot write there ({error.strerror or error}): pass a "
        "--run-dir you can write to"
    )


@dataclasses.dataclass(frozen=True)
class Trained:
    """What the report needs from a finished training invocation."""

    graphdef: object
    state: object
    opt_state: object
    history: list
    start: int  # the step this invocation resumed from
    step_fn: object  # the compiled step
    cost: StepCost
    planned: object  # fs.plan's Plan
    checked: object  # fs.check's StepReport
    baseline: float
    compile_s: float


def train(
    console,
    run: RunDir,
    settings: Settings,
    args,
    started: float,
    stop: StopSignals,
    resume_with: str,
) -> None:
    """Builds, shards, compiles and trains the model; then reports.

    Stopped by a signal (`stop`) before the last step, it saves a checkpoint of the step
    it finished, prints `resume_with` and exits with `stop.exit_status` instead.

    Raises:
      SystemExit: stopped by a signal.
    """
    cfg = settings.model
    mesh = make_mesh(settings)
    model = init_model(settings)
    graphdef, state = shard_model(model, mesh, policy_for(settings.param_dtype), settings.scan)
    del model  # its arrays now live sharded in `state`
    optimizer = make_optimizer(settings)
    start, state, opt_state = resume(console, run, state, fs.init_optimizer(optimizer, state))
    history = run.metrics(upto=start)

    text = Text(mesh, settings.batch, cfg.context, settings.seed)
    baseline = unigram_entropy(text.train)
    console.print(
        f"[bold]train_lm[/]: {len(text.train):,} training bytes, {len(text.val):,} held out; "
        f"unigram baseline {baseline:.3f} nats/byte; mesh {dict(mesh.shape)} "
        f"on {len(jax.devices())} {jax.devices()[0].platform} devices"
    )
    planned = plan(state, optimizer, cfg.depth, settings.scan)
    print_plan(console, planned)

    loss_fn = make_loss(graphdef)
    compile_s = time.perf_counter()
    checked = compile_train_step(loss_fn, optimizer, state, opt_state, text.train_batch(0))
    compile_s = time.perf_counter() - compile_s
    if args.check_only:
        console.print(checked.table(), markup=False, highlight=False)
        raise SystemExit(0 if checked.ok else 1)
    print_check(console, checked)
    step_fn = checked.compiled
    cost = StepCost.of(step_fn, settings.scan)
    print_mfu_basis(console, cost, args.peak_tflops, jax.devices()[0].platform)
    meter = Meter(cost, settings.batch * cfg.context, make_schedule(settings), args.peak_tflops)
    profiler = Profiler(args.profile, start, settings.steps, step_fn.as_text())
    if args.tensorboard:
        run.write_tensorboard(summary_writer_class())
    evaluate, val_batches = jax.jit(outside_the_step(loss_fn, mesh)), text.val_batches(EVAL_BATCHES)
    state, opt_state, history, done = train_loop(
        console,
        run,
        step_fn,
        lambda s: float(np.mean([evaluate(s, b) for b in val_batches])),
        meter,
        profiler,
        state,
        opt_state,
        start,
        settings,
        history,
        text.train_batch,
        stop,
    )
    run.close()
    if done < settings.steps:
        console.print(
            f"{stop.name}: stopped after step {done} of {settings.steps}; "
            f"checkpoint {run.checkpoint(done)}. Resume with:\n{resume_with}",
            markup=False,
            highlight=False,
        )
        raise SystemExit(stop.exit_status)
    if args.profile is not None:
        print_profile(console, args.profile, profiler.unit_times(len(jax.devices())))
    report(
        console,
        run,
        settings,
        args,
        started,
        Trained(
            graphdef,
            state,
            opt_state,
            history,
            start,
            step_fn,
            cost,
            planned,
            checked,
            baseline,
            compile_s,
        ),
    )


def report(console, run: RunDir, settings: Settings, args, started: float, t: Trained) -> None:
    """The loss plot, the summary table and the sample."""
    plot_losses(t.history, t.baseline, run.path / "loss.png")
    last = next(r for r in reversed(t.history) if "loss" in r)
    device = jax.devices()[0]
    tokens_per_step = settings.batch * settings.model.context
    step_time = steady_step_time([r for r in t.history if "window" in r and r["step"] > t.start])
    console.print(
        summary_table(
            {
                "parameters": (device_bytes(t.state, device), replicated_bytes(t.state)),
                "optimizer state": (
                    device_bytes(t.opt_state, device),
                    replicated_bytes(t.opt_state),
                ),
                "peak memory": (last.get("peak_memory_bytes"), last.get("peak_memory_source")),
                # Read from the compiled program (XLA may merge all-reduces into tuples).
                "collectives": collectives(t.step_fn.as_text()),
                "plan": t.planned,
                "check": t.checked,
                "scan": settings.scan,
                "tensor": settings.tensor,
                "model axes": settings.tensor > 1 or settings.expert_parallel > 1,
                "baseline": t.baseline,
                # The progress bar's last loss: the same rows, the same average.
                "train loss": (last["loss"], last["window"]),
                "validation loss": next(r["val"] for r in reversed(t.history) if "val" in r),
                "tokens/s": tokens_per_step / step_time,
                "tokens": (settings.steps - t.start) * tokens_per_step,
                "step time": step_time,
                "flops": t.cost.flops,
                "peak tflops": args.peak_tflops,
                "platform": device.platform,
                "wall": time.perf_counter() - started,
                "compile": t.compile_s,
            }
        )
    )
    console.print(f"loss curve: {run.path / 'loss.png'}")
    if args.sample:
        console.print("[bold]sample:[/]")
        console.print(
            generate(
                t.graphdef,
                t.state,
                args.sample,
                args.sample_length,
                settings.model.context,
                args.temperature,
                seed=settings.seed,
            ),
            markup=False,
            highlight=False,
        )
    console.print(
        f"wall time {time.perf_counter() - started:.1f} s; resume or extend with "
        f"--run-dir {run.path} --steps N"
    )


def steady_step_time(rows: list[dict]) -> float:
    """Mean seconds per step over `rows`, leaving out the first row (the first step also
    warms up: allocations, first transfers) unless it is the only one."""
    rows = rows[1:] or rows
    return sum(r["step_time_s"] * r["window"] for r in rows) / sum(r["window"] for r in rows)


class TrainingProgress(Progress):
    """rich's progress bar, with the latest readouts on a line of their own below it."""

    readouts = ""

    def get_renderables(self):
        """The bar, then the readouts line."""
        yield from super().get_renderables()
        if self.readouts:
            # Wrapped, not cropped: a soft-wrapping console leaves long lines to the
            # live display, which cuts them at the terminal's width.
            yield RichText(self.readouts, no_wrap=False, overflow="fold")


def train_loop(
    console,
    run,
    step_fn,
    val_loss,
    meter,
    profiler,
    state,
    opt_state,
    start,
    settings,
    history,
    batch_for,
    stop,
):
    """Runs steps `start..settings.steps`: logs, evaluates and checkpoints as it goes.

    A row is logged after the first step, every `LOG_EVERY` steps, and at every
    evaluation and checkpoint; its loss is the mean over the steps since the last row.
    Once `stop` (`StopSignals`) has received a signal, the step under way is finished,
    logged and checkpointed, and the loop ends there.

    A row's step time leaves out evaluation, checkpoints and starting or writing the
    profile.

    Returns:
      The final state and optimizer state, the metrics history, and the last step done.
    """
    columns = (
        TextColumn("[bold]training"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("val {task.fields[val]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    last_val = next((r["val"] for r in reversed(history) if "val" in r), None)
    platform = jax.devices()[0].platform
    pending, window, excluded, done = None, [], 0.0, start
    with TrainingProgress(*columns, console=console) as progress:
        task = progress.add_task(
            "train",
            total=settings.steps,
            completed=start,
            loss="-",
            val="-" if last_val is None else f"{last_val:.3f}",
        )
        tick = time.perf_counter()
        for step in range(start, settings.steps):
            excluded += profiler.before(step)
            with jax.profiler.StepTraceAnnotation("train", step_num=step + 1):
                state, opt_state, metrics = step_fn(state, opt_state, batch_for(step))
            excluded += profiler.after(step, metrics)
            window.append(metrics)  # device arrays: reading them now would stall the pipeline
            done = step + 1
            stopping = stop.received is not None
            evaluate = done % settings.eval_every == 0 or done == settings.steps
            save = done % settings.checkpoint_every == 0 or done == settings.steps or stopping
            if done != start + 1 and done % LOG_EVERY and not (evaluate or save):
                continue
            jax.block_until_ready(window)
            seconds = time.perf_counter() - tick - excluded
            row = meter.row(done, window, seconds)
            history.append(row)
            run.log(row)
            window, excluded = [], 0.0
            progress.readouts = readout(row, platform)
            progress.update(task, completed=done, loss=f"{row['loss']:.3f}")
            if evaluate:
                val = val_loss(state)
                history.append({"step": done, "val": val})
                run.log(history[-1])
                progress.update(task, val=f"{val:.3f}")
                progress.console.print(
                    f"step {done:5d}  train {row['loss']:.3f}  val {val:.3f}  {progress.readouts}"
                )
            if save:
                if pending is not None:
                    pending.wait()
                # Returns once the arrays are copied off the devices (the next step
                # donates them); the files are written in the background.
                pending = run.save(done, {"params": state, "opt": opt_state, "step": done})
            if stopping:
                profiler.cut_short(step)
                break
            tick = time.perf_counter()
    if pending is not None:
        pending.wait()
    return state, opt_state, history, done


if __name__ == "__main__":
    main()
