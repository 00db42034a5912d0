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
    "One job per implementation, each building only that variant (the FSDP2 job "
    "never imports JAX) and running the same steps: `start` is a rank's resident "
    "memory right after start-up (process group, and JAX's runtime for the "
    "frontend), `peak` its peak resident memory (VmHWM) over start-up, building "
    "and the steps; the larger rank's. `anon` and `file` are the peaks of its two "
    "parts, sampled every 5 ms: anonymous memory is the process's own; "
    "file-backed memory is shared libraries' code pages (torch's, and jaxlib's "
    "for the frontend), shared by every rank and reclaimable by the kernel."
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


def process_memory(args: argparse.Namespace) -> dict | None:
    """{variant key: {"start", "peak"} bytes (the larger rank's)}, one job each."""
    return each_alone(
        args,
        lambda ranks: {
            f: max(r["rss_process"][f] for r in ranks)
            for f in ("start", "peak", "peak_anon", "peak_file")
        },
        sample_memory=True,
    )


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


def rss_table(alone: dict) -> Table:
    """The header and rows of `process_memory`'s result, against FSDP2's peaks."""
    peer = alone["fsdp2-True"]
    rows = [
        [
            key,
            f"{v['start'] / MIB:,.0f}",
            f"{v['peak'] / MIB:,.0f}",
            f"{v['peak'] / peer['peak']:.2f}",
            f"{v['peak_anon'] / MIB:,.0f}",
            f"{v['peak_anon'] / peer['peak_anon']:.2f}",
            f"{v['peak_file'] / MIB:,.0f}",
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
