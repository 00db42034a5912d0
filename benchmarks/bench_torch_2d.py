"""2-D benchmark: torch_frontend's dp x tp step against PyTorch FSDP2's, in ONE run.

Run from the repository root (4 processes on gloo, this machine's CPUs):

    python benchmarks/bench_torch_2d.py                  # 3 jobs each, about 2 min here
    python benchmarks/bench_torch_2d.py --runs 1 --steps 3 --warmup 1   # a smoke run
    python benchmarks/bench_torch_2d.py --out-md result.md

One script, torchtitan's 2-D recipe (as `tests/_torch_2d_worker.py`), runs with
`torch.distributed.fsdp.fully_shard` and with `torch_frontend.fully_shard`, nothing else
changed: a 4-block pre-norm transformer (width 256, 4 heads, MLP 4x, byte vocabulary)
on a `("dp", "tp") = (2, 2)` mesh; per block `wq` / `wk` / `wv` / `up` column-parallel and
`wo` / `down` row-parallel (`parallelize_module` on `mesh["tp"]`), then
`fully_shard(block, mesh=mesh["dp"])` and the root over `dp`; AdamW. Each torchrun job
(4 ranks) runs one implementation; jobs alternate (fsdp2, frontend, frontend, fsdp2, ...:
the order flips every round, so a drift in the machine's load hits both alike).

Step time: every rank waits at a barrier, then times forward, backward, `opt.step()` and
`zero_grad()`; the step's time is the slowest rank's (an all-reduce of the times, outside
the timing). Reported: each job's median over its timed steps, each implementation's
median over all its jobs' timed steps, and the ratio frontend / FSDP2, with the losses
of the two checked against each other. The frontend's jobs then run `--profile-steps`
more steps with its bridge calls timed (`torch_bench/measure.py`'s `BridgeProfile`).
Every rank computes with one thread (torch and XLA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: torch_bench

WORLD, DP, TP = 4, 2, 2
IMPLS = ("fsdp2", "frontend")


# ---------------------------------------------------------------------- the worker


def build(args: argparse.Namespace):
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        """Pre-norm attention + MLP; heads are split over tp by the column-parallel wq/wk/wv."""

        def __init__(self, width: int, heads: int):
            super().__init__()
            self.head_dim = width // heads
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.wq, self.wk, self.wv = (nn.Linear(width, width) for _ in range(3))
            self.wo = nn.Linear(width, width)
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            # -1 heads: the local ones under TP (torchtitan's view).
            q, k, v = (
                w(h).view(b, s, -1, self.head_dim).transpose(1, 2)
                for w in (self.wq, self.wk, self.wv)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(256, args.width)
            self.blocks = nn.ModuleList(Block(args.width, args.heads) for _ in range(args.blocks))
            self.norm = nn.LayerNorm(args.width)
            self.head = nn.Linear(args.width, 256)

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return self.head(self.norm(h))

    torch.manual_seed(0)
    return Model()


def parallelize(model, mesh, fully_shard):
    """torchtitan's order: the TP plan per block, then fully_shard over dp."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.blocks:
        plan: dict[str, ParallelStyle] = {n: ColwiseParallel() for n in ("wq", "wk", "wv", "up")}
        plan |= {n: RowwiseParallel() for n in ("wo", "down")}
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn import functional as F

    if args.impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from torch_frontend import fully_shard  # type: ignore[no-redef]  # the one change

    torch.set_num_threads(1)  # 4 ranks share the cores
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = parallelize(build(args), mesh, fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> float:
        g = torch.Generator().manual_seed(1000 * i + dp_rank)  # tp ranks share the batch
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(step(i))
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
        if i >= args.warmup:
            times.append(took.item())
    result = {"impl": args.impl, "times": times, "losses": losses}
    if args.impl == "frontend" and args.profile_steps:
        from torch_bench.measure import BridgeProfile

        profiler = BridgeProfile()
        profiler.install()
        n = args.warmup + args.steps
        dist.barrier()
        start = time.perf_counter()
        with profiler.recording():
            for i in range(n, n + args.profile_steps):
                step(i)
        result["profile"] = {
            "steps": args.profile_steps,
            "wall_s": time.perf_counter() - start,
            "seconds": dict(profiler.seconds),
            "calls": dict(profiler.calls),
        }
    rank = dist.get_rank()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)  # torch 2.13's gloo teardown sometimes aborts at exit (DESIGN.md)


# ---------------------------------------------------------------------- the driver


def run_job(args: argparse.Namespace, impl: str) -> list[dict] | None:
    """One torchrun job of `impl`; every rank's result, or None if it failed."""
    from torch_bench import jobs

    with tempfile.TemporaryDirectory(prefix="bench_torch_2d-") as tmp:
        out = Path(tmp)
        model = [f"--{k}={getattr(args, k)}" for k in ("blocks", "width", "heads", "seq", "batch")]
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={WORLD}",
            "--master-addr=127.0.0.1",
            f"--master-port={jobs._free_port_pair()}",
            str(Path(__file__).resolve()),
            "--worker",
            f"--impl={impl}",
            f"--out={out}",
            f"--warmup={args.warmup}",
            f"--steps={args.steps}",
            f"--profile-steps={args.profile_steps}",
            *model,
        ]
        log = (out / "job.log").open("w")  # gloo's and the ranks' chatter, shown on failure
        proc = subprocess.Popen(
            command,
            env=jobs._env(),
            cwd=jobs.ROOT,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            jobs._kill(proc.pid)
            for pid_file in out.glob("pid-rank*"):  # torchrun may give workers sessions
                jobs._kill(int(pid_file.read_text()))
            proc.wait()
            log.close()
        files = sorted(out.glob("rank*.json"))
        if code != 0 or len(files) != WORLD:
            print((out / "job.log").read_text()[-4000:], file=sys.stderr)
            print(f"bench_torch_2d: the {impl} job failed (exit {code})", file=sys.stderr)
            return None
        return [json.loads(f.read_text()) for f in files]


def report(
    args: argparse.Namespace, runs: dict[str, list[list[dict]]], load: tuple[str, str]
) -> str:
    """The Markdown report: `runs[impl]` is each job's ranks' results, `load` uptime's."""
    from torch_bench import jobs

    info = jobs.machine()
    med = {impl: [statistics.median(r[0]["times"]) for r in runs[impl]] for impl in IMPLS}
    pooled = {
        impl: statistics.median(t for r in runs[impl] for t in r[0]["times"]) for impl in IMPLS
    }
    ratio = pooled["frontend"] / pooled["fsdp2"]
    loss_diff = max(
        abs(a - b)
        for f, t in zip(runs["fsdp2"], runs["frontend"], strict=True)
        for a, b in zip(f[0]["losses"], t[0]["losses"], strict=True)
    )
    lines = [
        f"torch {info['torch']}, jax {info['jax']}, Python {info['python']}, "
        f"commit {info['commit']}; {info['cpu']}, {info['nproc']} CPUs",
        f"load before: `{load[0]}`",
        f"load after: `{load[1]}`",
        "",
        f"Model: {args.blocks} blocks, width {args.width}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch} per dp rank; mesh (dp, tp) = ({DP}, {TP}), 4 gloo ranks; "
        f"{args.warmup} warm-up + {args.steps} timed steps per job, {args.runs} jobs each.",
        "",
        "| | per-job median step (ms) | median step (ms) | ratio to FSDP2 |",
        "|---|---|---|---|",
    ]
    for impl, name in (("fsdp2", "PyTorch FSDP2"), ("frontend", "torch_frontend")):
        jobs_ms = ", ".join(f"{1e3 * m:.1f}" for m in med[impl])
        r = pooled[impl] / pooled["fsdp2"]
        lines.append(f"| {name} | {jobs_ms} | {1e3 * pooled[impl]:.1f} | {r:.2f}x |")
    per_round = ", ".join(
        f"{f / t:.2f}x" for f, t in zip(med["frontend"], med["fsdp2"], strict=True)
    )
    lines += [
        "",
        f"Ratio frontend / FSDP2: {ratio:.2f}x (each round's: {per_round}); target <= 1.0x: "
        f"{'met' if ratio <= 1.0 else 'not met'}.",
        f"Losses, frontend against FSDP2, every step of every job: max |diff| {loss_diff:.2e}.",
    ]
    profiles = [r[0]["profile"] for r in runs["frontend"] if "profile" in r[0]]
    if profiles:
        p = profiles[-1]
        per_step = {k: 1e3 * v / p["steps"] for k, v in p["seconds"].items()}
        lines += [
            "",
            f"Frontend bridge profile (rank 0, last job, {p['steps']} steps, "
            f"{1e3 * p['wall_s'] / p['steps']:.1f} ms/step wall, no barriers; the collective "
            "thread's calls overlap the main thread's, so the rows do not add up):",
            "",
            "| bridge call | ms / step | calls / step |",
            "|---|---|---|",
        ]
        for name, ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
            lines.append(f"| `{name}` | {ms:.1f} | {p['calls'][name] / p['steps']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="jobs per implementation")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per job")
    ap.add_argument("--out-md", type=Path)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (args.out / f"pid-rank{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
        # A worker whose peer died ends itself.
        watchdog = threading.Timer(args.timeout, os._exit, args=(3,))
        watchdog.daemon = True
        watchdog.start()
        worker(args)
        return 0

    from torch_bench import jobs

    load_before = jobs.command_output("uptime")
    runs: dict[str, list[list[dict]]] = {impl: [] for impl in IMPLS}
    for r in range(args.runs):
        for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
            started = time.perf_counter()
            ranks = run_job(args, impl)
            if ranks is None:
                return 1
            runs[impl].append(ranks)
            ms = 1e3 * statistics.median(ranks[0]["times"])
            print(f"round {r} {impl}: median {ms:.1f} ms ({time.perf_counter() - started:.0f} s)")
    text = report(args, runs, (load_before, jobs.command_output("uptime")))
    print(text)
    if args.out_md:
        args.out_md.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
