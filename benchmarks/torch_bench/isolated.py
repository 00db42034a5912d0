"""Variants measured each in a torchrun job of its own, and their tables.

`--alone-repeats` times the frontend and FSDP2 (reshard True / False) alone, `--rss`
reads each implementation's resident memory alone, `--compile` times the first step of
`block.compile()` per block with a cold Inductor cache: a job per variant, so that
nothing another variant loaded (JAX, compiled code) counts against it.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from .jobs import measure
from .report import MIB

ALONE = ("frontend-True", "fsdp2-True")
RSS_NOTE = (
    "Jobs of one implementation each, `--rss-repeats` per implementation in "
    "alternating order (the FSDP2 jobs never import JAX), each building only that "
    "variant and running the same steps; each figure is the larger rank's, the "
    "table the median over the jobs. `base` is a rank's resident memory after its "
    "imports (torch.distributed.fsdp, or torch_frontend and so JAX), the process "
    "group (and JAX's runtime) and the plain model: what FSDP does not control. "
    "`peak` is the peak resident memory (VmHWM) over start-up, sharding and the "
    "steps, `anon peak` the peak of anonymous memory (`/proc/self/smaps_rollup`, "
    "sampled every 5 ms), `file peak` of file-backed memory (shared libraries' code "
    "pages, shared by every rank and reclaimable by the kernel). `peak - base` and "
    "`anon peak - base` are what FSDP controls; `file peak - base` is the code "
    "paged in after start-up (for the frontend, XLA's compiler at the first step)."
)
STARTUP_NOTE = (
    "The fixed start-up cost, from the same jobs: a rank's resident memory after "
    "its imports, and after the first fully_shard call (the process group, JAX's "
    "runtime for the frontend, the plain model and one block's sharding), each "
    "split into anonymous and file-backed memory."
)
COMPILE_NOTE = (
    "One job per implementation, each building only that variant with "
    "`block.compile()` (Inductor) on every block after fully_shard, and an "
    "empty Inductor cache of its own: `first` is the first step, compilation "
    "included; `then` the median of the timed steps after the warm-up; the "
    "slower rank's."
)
STEP_ALONE = ("frontend-True", "fsdp2-True", "frontend-False", "fsdp2-False")
STEP_ALONE_NOTE = (
    "Each variant in a job of its own (the FSDP2 jobs never import JAX), "
    "`--alone-repeats` jobs per variant in alternating order: a job's figure "
    "is the median over its timed steps of the slower rank's step time; "
    "`pairs` is the median of the frontend / FSDP2 ratios of the jobs run "
    "next to each other, `medians` the ratio of the two medians."
)
Table = tuple[list[str], list[list[str]]]


def each_alone(
    args: argparse.Namespace,
    summary: Callable[[list[dict]], dict],
    compile_blocks: bool = False,
    sample_memory: bool = False,
) -> dict | None:
    """{variant key: summary(its ranks' results)}, one job per key of ALONE.

    Args:
      args: the parsed flags.
      summary: what to keep of one job's ranks' raw results.
      compile_blocks: `block.compile()` every block (see `jobs.run_job`).
      sample_memory: sample each rank's resident memory (see `jobs.run_job`).

    Returns:
      The summaries, or None as soon as a job failed.
    """
    out = {}
    for key in ALONE:
        ranks = measure(args, key, compile_blocks, sample_memory)
        if ranks is None:
            return None
        out[key] = summary(ranks)
    return out


def _memory_summary(ranks: list[dict]) -> dict:
    """One job's memory figures in bytes, each the larger rank's.

    `start`, `peak`, `peak_anon`, `peak_file`: as before (whole process). From the
    phases: `imports_*` (after the imports), `shard_*` (after the first fully_shard,
    split into `anon` and `file`), `base` / `base_anon` (after imports, the process
    group and the plain model: what FSDP does not control), and what FSDP controls:
    `delta` = peak - base, `delta_anon` = peak anonymous (smaps_rollup) - base_anon,
    `delta_file` = peak file-backed - the file-backed part of base.
    """

    def one(r: dict) -> dict:
        p = r["rss_process"]
        ph = p["phases"]
        return {
            "start": p["start"],
            "peak": p["peak"],
            "peak_anon": p["peak_rollup_anon"],
            "peak_file": p["peak_file"],
            **{f"imports_{k}": ph["imports"][k] for k in ("rss", "anon", "file")},
            **{f"shard_{k}": ph["first_shard"][k] for k in ("rss", "anon", "file")},
            "base": ph["model"]["rss"],
            "base_anon": ph["model"]["anon"],
            "delta": p["peak"] - ph["model"]["rss"],
            "delta_anon": p["peak_rollup_anon"] - ph["model"]["anon"],
            "delta_file": p["peak_file"] - ph["model"]["file"],
        }

    per_rank = [one(r) for r in ranks]
    return {f: max(r[f] for r in per_rank) for f in per_rank[0]}


def process_memory(args: argparse.Namespace) -> dict | None:
    """{variant key: [each job's `_memory_summary`]}: `--rss-repeats` jobs per key of
    ALONE, interleaved (frontend, FSDP2, FSDP2, frontend, ...), so that a drift in the
    machine's load or page cache hits both alike. None as soon as a job failed."""
    out: dict[str, list[dict]] = {key: [] for key in ALONE}
    for repeat in range(args.rss_repeats):
        for key in ALONE if repeat % 2 == 0 else ALONE[::-1]:
            ranks = measure(args, key, sample_memory=True)
            if ranks is None:
                return None
            out[key].append(_memory_summary(ranks))
    return out


def compile_runs(args: argparse.Namespace) -> dict | None:
    """{variant key: {"first", "then"} seconds}, one cold-cache job each."""

    def summary(ranks: list[dict]) -> dict:
        per_rank = [r["variants"][0] for r in ranks]
        steps = [max(ls) for ls in zip(*(v["all_times"] for v in per_rank), strict=True)]
        after = sorted(steps[args.warmup :])
        return {"first": steps[0], "then": after[len(after) // 2] if after else float("nan")}

    return each_alone(args, summary, compile_blocks=True)


def step_times_alone(args: argparse.Namespace) -> dict | None:
    """{variant key: [each job's median step seconds]}, every variant alone, in turn."""
    out: dict[str, list[float]] = {key: [] for key in STEP_ALONE}
    for repeat in range(args.alone_repeats):
        # Alternating the order, so that a drift in the machine's load hits both alike.
        for key in STEP_ALONE if repeat % 2 == 0 else STEP_ALONE[::-1]:
            ranks = measure(args, key)
            if ranks is None:
                return None
            per_rank = [r["variants"][0]["times"] for r in ranks]
            out[key].append(statistics.median(max(ts) for ts in zip(*per_rank, strict=True)))
    return out


def compile_table(compiled: dict) -> Table:
    """The header and rows of `compile_runs`' result, against FSDP2's first step."""
    peer = compiled["fsdp2-True"]
    rows = [
        [key, f"{v['first']:,.1f}", f"{v['first'] / peer['first']:.2f}", f"{v['then'] * 1e3:,.0f}"]
        for key, v in compiled.items()
    ]
    return ["compiled", "first step s", "first / FSDP2", "then ms"], rows


def step_alone_table(times: dict) -> Table:
    """The header and rows of `step_times_alone`'s result, the frontend against FSDP2."""
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


def _median(jobs: list[dict], field: str) -> float:
    return statistics.median(j[field] for j in jobs)


def rss_table(alone: dict) -> Table:
    """The header and rows of `process_memory`'s result (medians over the jobs), the
    frontend against FSDP2: what FSDP controls, then the whole process."""
    peer = alone["fsdp2-True"]
    rows = []
    for key, jobs in alone.items():
        row = [key, str(len(jobs))]
        for field, ratio in (
            ("delta", True),
            ("delta_anon", True),
            ("delta_file", False),
            ("base", False),
            ("peak", True),
            ("peak_anon", True),
            ("peak_file", False),
        ):
            value = _median(jobs, field)
            row.append(f"{value / MIB:,.1f}")
            if ratio:
                row.append(f"{value / _median(peer, field):.2f}")
        rows.append(row)
    return [
        "alone",
        "jobs",
        "peak - base MiB",
        "/ FSDP2",
        "anon peak - base MiB",
        "/ FSDP2",
        "file peak - base MiB",
        "base MiB",
        "peak MiB",
        "/ FSDP2",
        "anon peak MiB",
        "/ FSDP2",
        "file peak MiB",
    ], rows


def startup_table(alone: dict) -> Table:
    """The fixed start-up cost (medians over the jobs): resident memory after the
    imports and after the first fully_shard, each split into anonymous and file-backed."""
    rows = [
        [key]
        + [
            f"{_median(jobs, f'{phase}_{part}') / MIB:,.1f}"
            for phase in ("imports", "shard")
            for part in ("rss", "anon", "file")
        ]
        for key, jobs in alone.items()
    ]
    return [
        "alone",
        "imports MiB",
        "anon",
        "file",
        "first fully_shard MiB",
        "anon",
        "file",
    ], rows
