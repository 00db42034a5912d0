"""The benchmark's command line and the order of a run.

The interleaved job first (or the raw results `--keep` kept, with `--report-only`),
then the jobs of one variant each that the flags ask for; then the tables, the
Markdown page and the JSON result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import isolated, page, report
from .jobs import machine, measure
from .model import PRESETS, Config

DESCRIPTION = (
    "Torch benchmark: torch_frontend against FSDP2, DDP and funshard's JAX step, in ONE run."
)
MODEL_FLAGS = ("blocks", "width", "heads", "seq", "batch")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What runs: steps, processes, the model, the variants and the extra jobs."""
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
        help="also run torch_frontend and FSDP2 (reshard=True) alone, "
        "--rss-repeats jobs each in alternating order, and report resident memory: "
        "what FSDP controls (peak above the process after start-up and the plain "
        "model), the whole process's peaks, and the start-up cost",
    )
    p.add_argument(
        "--rss-repeats",
        type=int,
        default=1,
        metavar="N",
        help="with --rss: jobs per implementation (default 1)",
    )
    for name in MODEL_FLAGS:
        p.add_argument(f"--{name}", type=int, default=None, help="model / global batch")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole job")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """Where the results go, and reporting results kept earlier."""
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the flags; fills the model's and the steps' defaults from the preset."""
    p = argparse.ArgumentParser(description=DESCRIPTION)
    _add_run_flags(p)
    _add_output_flags(p)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("quick" if args.quick else "gpt-51m")]
    for name in MODEL_FLAGS:
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.steps is None:
        args.steps = 3 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.profile_steps is None:
        args.profile_steps = 1 if args.quick else 5
    return args


def _ranks(args: argparse.Namespace) -> tuple[list[dict], tuple] | None:
    """Every rank's raw result and the load around the job (None: nothing to report)."""
    if not args.report_only:
        ranks = measure(args, args.only)
        return None if ranks is None else (ranks, tuple(ranks[0]["load"]))
    ranks = [json.loads(f.read_text()) for f in sorted(args.report_only.glob("rank*.json"))]
    if not ranks:
        print(f"bench_torch: no rank*.json in {args.report_only}", file=sys.stderr)
        return None
    return ranks, tuple(ranks[0].get("load", ("?", "?")))


def _isolated_runs(
    args: argparse.Namespace,
) -> tuple[dict | None, dict | None, dict | None] | None:
    """(step times, resident memory, compiled) of the jobs the flags ask for, else None.

    None in place of a result: not asked for; None in all: a job failed (the later
    ones did not run).
    """
    stepped = isolated.step_times_alone(args) if args.alone_repeats else None
    if args.alone_repeats and stepped is None:
        return None
    alone = isolated.process_memory(args) if args.rss else None
    if args.rss and alone is None:
        return None
    compiled = isolated.compile_runs(args) if args.compile else None
    if args.compile and compiled is None:
        return None
    return stepped, alone, compiled


def _print_checks(losses: list[dict], targets: list[dict]) -> None:
    for c in losses:
        print(f"losses {c['variant']} vs {c['peer']}: max |diff| {c['max_abs_diff']:.2e}")
    for t in targets:
        print(
            f"target {t['metric']} {t['variant']} <= {t['limit']}x {t['peer']}: {t['ratio']:.2f}x "
            f"({'met' if t['met'] else 'MISSED'})"
        )


def _print_isolated(stepped: dict | None, alone: dict | None, compiled: dict | None) -> None:
    if stepped:
        report.print_table("each variant alone: step time", *isolated.step_alone_table(stepped))
    if alone:
        report.print_table(
            "each implementation alone, reshard=True: resident memory per rank",
            *isolated.rss_table(alone),
        )
        report.print_table(
            "each implementation alone: start-up cost per rank", *isolated.startup_table(alone)
        )
    if compiled:
        report.print_table(
            "block.compile() per block, reshard=True, cold Inductor cache",
            *isolated.compile_table(compiled),
        )


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark the flags describe; prints and writes its results.

    Args:
      argv: the flags (None: the command line's).

    Returns:
      The exit status: 0, or 1 when a job failed or `--report-only` found nothing.
    """
    args = parse_args(argv)
    started = time.perf_counter()
    collected = _ranks(args)
    if collected is None:
        return 1
    ranks, load = collected
    extra = _isolated_runs(args)
    if extra is None:
        return 1
    stepped, alone, compiled = extra
    rows = report.aggregate(ranks)
    losses, targets = report.loss_checks(rows), report.target_checks(rows)
    prof = report.profile_rows(ranks)
    cfg = ranks[0]["config"]
    params = Config(**cfg).params()
    report.print_table(
        f"torch benchmark: {cfg}, {args.processes} ranks (gloo)",
        report.HEADER,
        report.table_rows(rows),
    )
    _print_checks(losses, targets)
    if prof:
        report.print_table(
            "frontend profile: ms per step (calls per step)", *report.profile_table(prof)
        )
    _print_isolated(stepped, alone, compiled)
    print(f"load: {load[0]} -> {load[1]}")
    wall = ranks[0].get("job_wall_s", time.perf_counter() - started)
    m = machine()
    if args.out_md:
        text = page.markdown(args, m, rows, losses, targets, prof, load, wall, cfg, params)
        args.out_md.write_text(text + page.isolated_sections(stepped, alone, compiled) + "\n")
    if args.out_json:
        result = {
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
        }
        args.out_json.write_text(json.dumps(result, indent=1))
    return 0
