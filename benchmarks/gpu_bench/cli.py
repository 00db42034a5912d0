"""Flags, each part in a process of its own within its time budget, and a run's order."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import ROOT
from .config import BUDGETS
from .parts import PARTS, child_env
from .report import evaluate, markdown

DESCRIPTION = (
    "GPU check: funshard and torch_frontend on ONE GPU, against plain JAX, FSDP2 and torch."
)
# Each part's process runs the entry point again, with `--part`.
ENTRY = Path(__file__).resolve().parents[1] / "gpu_check.py"
EXIT_NO_GPU = 2


def no_gpu_reason(environ, distribution_names) -> str | None:
    """Why JAX cannot run on a GPU here, known without starting JAX (None: it may).

    Args:
      environ: the environment (JAX_PLATFORMS).
      distribution_names: the names of the installed Python distributions.
    """
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.split(",") for p in ("cuda", "gpu", "rocm")):
        return f"JAX_PLATFORMS={platforms!r} leaves out the GPU"
    names = {n.lower().replace("_", "-") for n in distribution_names}
    if not any(n.startswith(("jax-cuda", "jax-rocm")) and n.endswith("-plugin") for n in names):
        return "JAX's GPU plugin is not installed (jax-cuda12-plugin)"
    return None


def run_part(args, part: str, seconds: float) -> dict:
    """Runs one part in a child process within `seconds`; its result, or its error."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        command = [
            sys.executable,
            str(ENTRY),
            "--part",
            part,
            "--result",
            str(result_file),
            "--part-seconds",
            str(seconds),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        if args.cpu_smoke:
            command.append("--cpu-smoke")
        if args.peak_tflops:
            command += ["--peak-tflops", str(args.peak_tflops)]
        try:
            proc = subprocess.run(
                command,
                cwd=ROOT,
                env=child_env(args, part),
                capture_output=True,
                text=True,
                timeout=seconds,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {
                "error": f"timed out after {seconds:.0f} s (its budget)",
                "wall_s": time.monotonic() - start,
            }
        if result_file.exists():
            out = json.loads(result_file.read_text())
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            out = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    out["wall_s"] = time.monotonic() - start
    return out


def run_in_process(args, part: str, seconds: float) -> dict:
    """`--cpu-smoke`: a part in this process (tiny models; no isolation needed)."""
    start = time.monotonic()
    args.part_seconds = seconds
    try:
        out = PARTS[part](args)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["wall_s"] = time.monotonic() - start
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny models on CPU in this process: checks the script, measures nothing",
    )
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak, when its name is not in the table",
    )
    p.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--part-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.cpu_smoke else 10
    if args.warmup is None:
        args.warmup = 1 if args.cpu_smoke else 2
    return args


def child(args) -> int:
    """Runs `args.part` in this process and writes its result (or error) as JSON."""
    try:
        out = PARTS[args.part](args)
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    args.result.write_text(json.dumps(out, default=str))
    return 0


def main(argv=None) -> int:
    """Runs the check (or, with `--part`, one part); the exit status."""
    args = parse_args(argv)
    if args.part:
        return child(args)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts in this process
    start = time.monotonic()
    deadline = start + args.budget
    runner = run_in_process if args.cpu_smoke else run_part
    reason = None
    if not args.cpu_smoke:
        from importlib import metadata

        names = (d.metadata["Name"] or "" for d in metadata.distributions())
        reason = no_gpu_reason(os.environ, names)
    results = {"probe": runner(args, "probe", BUDGETS["probe"])} if reason is None else {}
    probe = results.get("probe", {})
    gpu = probe.get("backend") == "gpu"
    if not args.cpu_smoke and not gpu:
        reason = reason or (
            f"JAX's backend is {probe.get('backend')!r} "
            f"({probe.get('error') or probe.get('device_kind')})"
        )
        print(
            f"gpu_check: no GPU: {reason}. Run it on a GPU machine after "
            "`pip install -e '.[cuda]'` (docs/gpu.md), or pass --cpu-smoke for a tiny CPU "
            "run of the same code paths.",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    wanted = [p for p in BUDGETS if p != "probe" and (not args.only or p in args.only.split(","))]
    for part in wanted:
        if args.cpu_smoke and part == "tests":
            results[part] = {
                "skipped": True,
                "ok": True,
                "median_s": None,
                "summary": "skipped in --cpu-smoke (tests/test_gpu.py skips on CPU)",
            }
            continue
        left = deadline - time.monotonic() - 5
        if left < 10:
            results[part] = {"error": "not run: the run's time budget was spent"}
            continue
        print(f"gpu_check: {part} (up to {min(BUDGETS[part], left):.0f} s)", file=sys.stderr)
        results[part] = runner(args, part, min(BUDGETS[part], left))
    report = {
        "mode": "gpu" if gpu and not args.cpu_smoke else "cpu-smoke",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
        if argv is None
        else "gpu_check.main(" + repr(argv) + ")",
        "machine": platform.platform(),
        "budget_s": args.budget,
        "wall_s": time.monotonic() - start,
        "results": results,
        "evaluation": evaluate(results, gpu and not args.cpu_smoke),
    }
    if args.out_json:
        args.out_json.write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    if args.out_md:
        args.out_md.write_text(text)
    print(text)
    return 0
