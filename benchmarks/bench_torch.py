"""Torch benchmark: torch_frontend against FSDP2, DDP and funshard's JAX step, in ONE run.

Run from the repository root (2 processes on gloo, this machine's CPUs):

    python benchmarks/bench_torch.py                       # the 4 x 1024 GPT (10-15 min here)
    python benchmarks/bench_torch.py --quick               # tiny model, 3 steps (smoke run)
    python benchmarks/bench_torch.py --preset nano-10.8m --rss   # nanoGPT's 6 x 384, and
                                                           # each process's peak RSS
    python benchmarks/bench_torch.py --out-md result.md --out-json result.json
    python benchmarks/bench_torch.py --preset nano-0.8m --alone-repeats 5   # and each variant
                                                           # timed in jobs of its own

One torchrun job (`torch_bench/worker.py`, 2 ranks) builds every variant on the same
model (`torch_bench/model.py`: a 4-block, width-1024 byte-level GPT), the same initial
weights and the same batches of the bundled corpus, then runs them interleaved (round r
runs step r of every variant, each after a barrier):

1. torch_frontend, fully_shard per block then the root, reshard_after_forward=True
2. PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) on gloo, the same, True
3. / 4. the same two with reshard_after_forward=False
5. DistributedDataParallel on gloo
6. funshard's JAX step on the same 2 processes (`fs.distributed` mesh,
   `fs.value_and_grad`, `fs.fully_shard` per block), the same model in JAX
7. one process alone: plain torch on rank 0 with the whole global batch
8. the compute floor: plain torch on one rank's rows, nothing communicated

Every rank computes with one thread (torch and XLA), as 2 ranks share 2 cores. Reported:
median step time (the slower rank's, over the timed steps) and its ratio to PyTorch
FSDP2 measured in the same run; bytes each rank sent per step (`/proc/self/io` wchar:
gloo writes its sockets with writev); per-rank state (parameters + optimizer state) and
the step's peak resident memory above the resident memory at its start (VmHWM);
losses, with the frontend's checked against FSDP2's step by step. With
`--profile-steps N` (default 5) the frontend then runs N more steps with its bridge
calls timed (`torch_bench/measure.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: torch_bench

from torch_bench import report
from torch_bench.model import PRESETS

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "torch_bench" / "worker.py"
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "JAX_COORDINATOR_ADDRESS",
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps: a smoke run")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument(
        "--profile-steps",
        type=int,
        default=None,
        help="profiled frontend steps after the timed ones (default 5; 0: none)",
    )
    p.add_argument("--processes", type=int, default=2)
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model shape and batch (default gpt-51m; --quick: quick); "
        "--blocks etc. override its fields",
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated variant keys to build "
        "(frontend-True, fsdp2-True, frontend-False, fsdp2-False, ddp, jax, "
        "single, floor; default all)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run torch_frontend and FSDP2 (reshard=True) with block.compile() "
        "per block, one job each with an empty Inductor cache, and report "
        "the first step (compilation included) and the median step after",
    )
    p.add_argument(
        "--malloc",
        choices=("trimmed", "default"),
        default="trimmed",
        help="trimmed (default): glibc hands freed blocks over 64 KiB back at "
        "once, so resident memory follows allocations; default: glibc's "
        "own settings, as a training script runs",
    )
    p.add_argument(
        "--alone-repeats",
        type=int,
        default=0,
        metavar="N",
        help="also time torch_frontend and FSDP2 (reshard True / False) each in "
        "a job of its own, N jobs each in alternating order",
    )
    p.add_argument(
        "--rss",
        action="store_true",
        help="also run torch_frontend and FSDP2 (reshard=True) alone, one job "
        "each, and report each process's peak resident memory",
    )
    for name in ("blocks", "width", "heads", "seq", "batch"):
        p.add_argument(f"--{name}", type=int, default=None, help="model / global batch")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole job")
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    p.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="also keep each rank's raw result (rank*.json) in this folder",
    )
    p.add_argument(
        "--report-only",
        type=Path,
        default=None,
        metavar="DIR",
        help="run nothing: report the raw results kept in DIR by --keep",
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("quick" if args.quick else "gpt-51m")]
    for name in ("blocks", "width", "heads", "seq", "batch"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.steps is None:
        args.steps = 3 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.profile_steps is None:
        args.profile_steps = 1 if args.quick else 5
    return args


def _free_port_pair() -> int:
    """A port p with p + 1 free too (torchrun's store on p, JAX's coordinator on p + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    # One compute thread per rank, in torch and in XLA: the ranks share the cores.
    flags.append("--xla_cpu_multi_thread_eigen=false")
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
    )
    return env


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def run_job(
    args, out: Path, only: str, compile_blocks: bool = False, sample_memory: bool = False
) -> int:
    """Runs the torchrun job; kills torchrun and its workers (by pid) on the way out."""
    model = [
        f"--{k}={getattr(args, k)}"
        for k in ("blocks", "width", "heads", "seq", "batch")
        if getattr(args, k) is not None
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port_pair()}",
        str(WORKER),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--profile-steps",
        str(args.profile_steps),
        "--deadline",
        str(args.timeout),
        *(["--only", only] if only else []),
        *(["--compile"] if compile_blocks else []),
        *(["--sample-memory"] if sample_memory else []),
        "--malloc",
        args.malloc,
        *model,
    ]
    env = _env()
    if compile_blocks:  # a cold start for every job: nothing compiled by an earlier one
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        return -1
    finally:
        _kill(proc.pid)
        for pid_file in out.glob("pid-rank*"):  # the workers run in sessions of their own
            _kill(int(pid_file.read_text()))
        proc.wait()


def measure(
    args, only: str = "", compile_blocks: bool = False, sample_memory: bool = False
) -> list[dict] | None:
    """Runs the job; returns every rank's raw result (None if the job failed)."""
    load_start, started = _command("uptime"), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_torch-") as tmp:
        out = Path(tmp)
        code = run_job(args, out, only, compile_blocks, sample_memory)
        files = sorted(out.glob("rank*.json"))
        if code != 0 or len(files) != args.processes:
            print(f"bench_torch: the torchrun job failed (exit {code})", file=sys.stderr)
            return None
        ranks = [json.loads(f.read_text()) for f in files]
    for r in ranks:
        r["load"] = (load_start, _command("uptime"))
        r["job_wall_s"] = time.perf_counter() - started
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        for r in ranks:
            (args.keep / f"rank{r['rank']}.json").write_text(json.dumps(r, indent=1))
    return ranks


def _command(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """The machine and the software the numbers were measured on."""
    import jax
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": _command("nproc"),
        "free": _command("free", "-h"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "commit": _command("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"),
    }


def markdown(
    args, m: dict, rows: dict, losses, targets, prof, load, wall: float, cfg: dict, params: int
) -> str:
    lines = [
        "# torch_frontend benchmark",
        "",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- machine: {m['cpu']}, `nproc` {m['nproc']}, `{m['platform']}`; Python "
        f"{m['python']}, torch {m['torch']}, jax {m['jax']}; commit {m['commit']}",
        f"- load (`uptime`): at the start `{load[0]}`; at the end `{load[1]}`",
        f"- model: GPT, {cfg['blocks']} blocks, width {cfg['width']}, {cfg['heads']} heads, "
        f"seq {cfg['seq']}, vocab 256, global batch {cfg['batch']} ({params:,} parameters, "
        f"{params * 4 / report.MIB:,.0f} MiB f32); AdamW; {args.processes} ranks on gloo, "
        "one compute thread each",
        f"- timing: median over {args.steps} steps after {args.warmup} warm-up steps, each "
        "step the slower rank's; variants interleaved; run wall time "
        f"{wall:.0f} s",
        "",
        "```",
        m["free"],
        "```",
        "",
    ]
    lines += report.markdown_table(report.HEADER, report.table_rows(rows))
    lines += [
        report.RATIO_NOTE + ". sent: bytes written per step per rank (larger rank). "
        "state: parameters + optimizer state per rank; step peak: the step's peak "
        "resident memory above the resident memory at its start.",
        "",
    ]
    jax_row = rows.get("funshard JAX step reshard=True")
    if jax_row and jax_row["facts"]:
        f = jax_row["facts"]
        lines += [
            f"funshard JAX step: compiled in {f['compile_s']:.1f} s; "
            f"`memory_analysis()`: temp {report._mib(f['compiled_temp'])} MiB, "
            f"arguments {report._mib(f['compiled_arg'])} MiB.",
            "",
        ]
    lines += ["## Checks", ""]
    lines += [
        f"- losses {c['variant']} vs {c['peer']}: max |diff| over {c['steps']} steps "
        f"and every rank = {c['max_abs_diff']:.2e} ({'equal' if c['equal'] else 'DIFFER'})"
        for c in losses
    ]
    lines += [
        f"- target {t['metric']} {t['variant']} <= {t['limit']:.1f}x {t['peer']}: "
        f"{t['ratio']:.2f}x, {'met' if t['met'] else 'MISSED'}"
        for t in targets
    ]
    lines.append("")
    if prof:
        header, prow = report.profile_table(prof)
        title = "## Frontend profile (ms per step inside each bridge call, calls per step)"
        lines += [title, "", *report.markdown_table(header, prow)]
    return "\n".join(lines)


ALONE = ("frontend-True", "fsdp2-True")
RSS_NOTE = (
    "One job per implementation, each building only that variant (the FSDP2 job "
    "never imports JAX) and running the same steps: `start` is a rank's resident "
    "memory right after start-up (process group, and JAX's runtime for the "
    "frontend), `peak` its peak resident memory (VmHWM) over start-up, building "
    "and the steps; the larger rank's. `anon` and `file` are the peaks of its two "
    "parts, sampled every 5 ms: anonymous memory is the process's own; "
    "file-backed memory is shared libraries' code pages (torch's, and jaxlib's "
    "for the frontend), shared by every rank and reclaimable by the kernel."
)


def each_alone(
    args, summary, compile_blocks: bool = False, sample_memory: bool = False
) -> dict | None:
    """{variant key: summary(its ranks' results)}, one job per key of ALONE."""
    out = {}
    for key in ALONE:
        ranks = measure(args, key, compile_blocks, sample_memory)
        if ranks is None:
            return None
        out[key] = summary(ranks)
    return out


def process_memory(args) -> dict | None:
    """{variant key: {"start", "peak"} bytes (the larger rank's)}, one job each."""
    return each_alone(
        args,
        lambda ranks: {
            f: max(r["rss_process"][f] for r in ranks)
            for f in ("start", "peak", "peak_anon", "peak_file")
        },
        sample_memory=True,
    )


COMPILE_NOTE = (
    "One job per implementation, each building only that variant with "
    "`block.compile()` (Inductor) on every block after fully_shard, and an "
    "empty Inductor cache of its own: `first` is the first step, compilation "
    "included; `then` the median of the timed steps after the warm-up; the "
    "slower rank's."
)


def compile_runs(args) -> dict | None:
    """{variant key: {"first", "then"} seconds}, one cold-cache job each."""

    def summary(ranks):
        per_rank = [r["variants"][0] for r in ranks]
        steps = [max(ls) for ls in zip(*(v["all_times"] for v in per_rank), strict=True)]
        after = sorted(steps[args.warmup :])
        return {"first": steps[0], "then": after[len(after) // 2] if after else float("nan")}

    return each_alone(args, summary, compile_blocks=True)


def compile_table(compiled: dict) -> tuple[list[str], list[list[str]]]:
    peer = compiled["fsdp2-True"]
    rows = [
        [key, f"{v['first']:,.1f}", f"{v['first'] / peer['first']:.2f}", f"{v['then'] * 1e3:,.0f}"]
        for key, v in compiled.items()
    ]
    return ["compiled", "first step s", "first / FSDP2", "then ms"], rows


STEP_ALONE = ("frontend-True", "fsdp2-True", "frontend-False", "fsdp2-False")
STEP_ALONE_NOTE = (
    "Each variant in a job of its own (the FSDP2 jobs never import JAX), "
    "`--alone-repeats` jobs per variant in alternating order: a job's figure "
    "is the median over its timed steps of the slower rank's step time; "
    "`pairs` is the median of the frontend / FSDP2 ratios of the jobs run "
    "next to each other, `medians` the ratio of the two medians."
)


def step_times_alone(args) -> dict | None:
    """{variant key: [each job's median step seconds]}, every variant alone, in turn."""
    out: dict[str, list[float]] = {key: [] for key in STEP_ALONE}
    for repeat in range(args.alone_repeats):
        for key in STEP_ALONE if repeat % 2 == 0 else STEP_ALONE[::-1]:
            ranks = measure(args, key)
            if ranks is None:
                return None
            per_rank = [r["variants"][0]["times"] for r in ranks]
            out[key].append(statistics.median(max(ts) for ts in zip(*per_rank, strict=True)))
    return out


def step_alone_table(times: dict) -> tuple[list[str], list[list[str]]]:
    rows = []
    for reshard in ("True", "False"):
        ours, peer = times[f"frontend-{reshard}"], times[f"fsdp2-{reshard}"]
        pairs = statistics.median(a / b for a, b in zip(ours, peer, strict=True))
        medians = statistics.median(ours) / statistics.median(peer)
        for key, values in ((f"frontend-{reshard}", ours), (f"fsdp2-{reshard}", peer)):
            mine = key.startswith("frontend")
            rows.append(
                [
                    key,
                    " ".join(f"{v * 1e3:,.0f}" for v in values),
                    f"{statistics.median(values) * 1e3:,.1f}",
                    f"{pairs:.3f}" if mine else "",
                    f"{medians:.3f}" if mine else "",
                ]
            )
    return ["alone", "each job, ms", "median ms", "pairs / FSDP2", "medians / FSDP2"], rows


def rss_table(alone: dict) -> tuple[list[str], list[list[str]]]:
    peer = alone["fsdp2-True"]
    rows = [
        [
            key,
            f"{v['start'] / report.MIB:,.0f}",
            f"{v['peak'] / report.MIB:,.0f}",
            f"{v['peak'] / peer['peak']:.2f}",
            f"{v['peak_anon'] / report.MIB:,.0f}",
            f"{v['peak_anon'] / peer['peak_anon']:.2f}",
            f"{v['peak_file'] / report.MIB:,.0f}",
        ]
        for key, v in alone.items()
    ]
    return [
        "alone",
        "start MiB",
        "peak MiB",
        "peak / FSDP2",
        "anon peak MiB",
        "anon / FSDP2",
        "file peak MiB",
    ], rows


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.report_only:
        ranks = [json.loads(f.read_text()) for f in sorted(args.report_only.glob("rank*.json"))]
        if not ranks:
            print(f"bench_torch: no rank*.json in {args.report_only}", file=sys.stderr)
            return 1
        load = tuple(ranks[0].get("load", ("?", "?")))
    else:
        ranks = measure(args, args.only)
        if ranks is None:
            return 1
        load = tuple(ranks[0]["load"])
    stepped = step_times_alone(args) if args.alone_repeats else None
    if args.alone_repeats and stepped is None:
        return 1
    alone = process_memory(args) if args.rss else None
    if args.rss and alone is None:
        return 1
    compiled = compile_runs(args) if args.compile else None
    if args.compile and compiled is None:
        return 1
    rows = report.aggregate(ranks)
    losses, targets = report.loss_checks(rows), report.target_checks(rows)
    prof = report.profile_rows(ranks)
    cfg = ranks[0]["config"]
    from torch_bench.model import Config

    params = Config(**cfg).params()
    report.print_table(
        f"torch benchmark: {cfg}, {args.processes} ranks (gloo)",
        report.HEADER,
        report.table_rows(rows),
    )
    for c in losses:
        print(f"losses {c['variant']} vs {c['peer']}: max |diff| {c['max_abs_diff']:.2e}")
    for t in targets:
        print(
            f"target {t['metric']} {t['variant']} <= {t['limit']}x {t['peer']}: {t['ratio']:.2f}x "
            f"({'met' if t['met'] else 'MISSED'})"
        )
    if prof:
        report.print_table(
            "frontend profile: ms per step (calls per step)", *report.profile_table(prof)
        )
    if stepped:
        report.print_table("each variant alone: step time", *step_alone_table(stepped))
    if alone:
        report.print_table(
            "each implementation alone, reshard=True: resident memory per rank", *rss_table(alone)
        )
    if compiled:
        report.print_table(
            "block.compile() per block, reshard=True, cold Inductor cache", *compile_table(compiled)
        )
    print(f"load: {load[0]} -> {load[1]}")
    wall = ranks[0].get("job_wall_s", time.perf_counter() - started)
    m = machine()
    if args.out_md:
        text = markdown(args, m, rows, losses, targets, prof, load, wall, cfg, params)
        if stepped:
            header, srows = step_alone_table(stepped)
            text += "\n".join(
                [
                    "",
                    "## Each variant alone (step time)",
                    "",
                    STEP_ALONE_NOTE,
                    "",
                    *report.markdown_table(header, srows),
                    "",
                ]
            )
        if alone:
            header, rrows = rss_table(alone)
            text += "\n".join(
                [
                    "",
                    "## Each implementation alone (peak resident memory)",
                    "",
                    RSS_NOTE,
                    "",
                    *report.markdown_table(header, rrows),
                    "",
                ]
            )
        if compiled:
            header, crows = compile_table(compiled)
            text += "\n".join(
                [
                    "",
                    "## block.compile() per block (first step)",
                    "",
                    COMPILE_NOTE,
                    "",
                    *report.markdown_table(header, crows),
                    "",
                ]
            )
        args.out_md.write_text(text + "\n")
    if args.out_json:
        args.out_json.write_text(
            json.dumps(
                {
                    "machine": m,
                    "load": load,
                    "config": cfg,
                    "wall_s": wall,
                    "variants": list(rows.values()),
                    "loss_checks": losses,
                    "targets": targets,
                    "profile": prof,
                    "alone": alone,
                    "compiled": compiled,
                    "step_times_alone": stepped,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
