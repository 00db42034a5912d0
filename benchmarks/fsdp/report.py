"""The Markdown report: one section per function, each a list of lines."""

from __future__ import annotations

import os
import platform
import shlex
import sys

import jax
import optax
from hlo import KINDS  # benchmarks/hlo.py, shared with the tests

from .model import Config, gathered_unit_bytes
from .targets import targets
from .variants import BASELINE, Context

MIB = 1024 * 1024


def mib(x: float) -> str:
    """`x` bytes in MiB, two decimals."""
    return f"{x / MIB:,.2f}"


def bound(summary: dict) -> str:
    """'≤ ' when a collective total is an upper bound (see `hlo.executed_collectives`)."""
    return "≤ " if summary["upper"] else ""


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table, followed by a blank line."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return [*out, ""]


def report(
    args,
    cfg: Config,
    ctx: Context,
    results: list[dict],
    scale: list[dict],
    act: dict,
    wall: float,
    micro: list[dict] | None = None,
) -> str:
    """The whole report.

    Args:
        args: the parsed flags (`steps`, `warmup`, `load_start` are read).
        cfg: the model's config.
        ctx: what the variants were built from.
        results: per variant, `measure.static_facts` plus compile time and timing.
        scale: rows of the scaling table (`probes.scaling_row`); empty to leave it out.
        act: `plain`: temp bytes of the plain-grad probe; `slope`: temp growth with a
            doubled batch (either may be None).
        wall: the run's wall time in seconds.
        micro: rows of the microbatch table (`microbatches.microbatch_rows`); None or
            empty to leave it out.

    Returns:
        Markdown text.
    """
    lines = _header(args, cfg, ctx, wall)
    lines += _collectives_section(results)
    lines += _memory_section(results, len(ctx.devices))
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(ctx.params))
    lines += _scaling_section(scale, param_bytes)
    lines += microbatch_section(micro or [])
    lines += ["## Targets", ""]
    lines += targets(ctx, {r["name"]: r for r in results}, act, micro)
    return "\n".join(lines)


def _header(args, cfg: Config, ctx: Context, wall: float) -> list[str]:
    n = len(ctx.devices)
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(ctx.params))
    param_count = sum(int(x.size) for x in jax.tree.leaves(ctx.params))
    units = gathered_unit_bytes(ctx.params, n)
    block_bytes = max(units[1:]) if len(units) > 1 else 0
    return [
        "# funshard FSDP benchmark",
        "",
        f"- machine: `{platform.platform()}`, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}",
        f"- devices: {len(jax.devices())} x {jax.devices()[0].platform} "
        f"(simulated: all share the cores above)",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: GPT-style, {cfg.blocks} blocks, width {cfg.width}, {cfg.heads} heads, "
        f"MLP {cfg.mlp}x, vocab {cfg.vocab}, seq {cfg.seq}, global batch {cfg.batch} "
        f"({cfg.batch // n} rows per device); untied head; f32; AdamW",
        f"- parameters: {param_count:,} ({param_bytes:,} bytes = {mib(param_bytes)} MiB); "
        f"one block {mib(block_bytes)} MiB, root unit (embed, pos, final LN, head) "
        f"{mib(units[0])} MiB; largest unit gathered: {mib(max(units))} MiB",
        f"- timing: median of {args.steps} steps after {args.warmup} warm-up steps, the "
        "variants' steps interleaved (round r runs step r of every variant); "
        f"total wall time of the run {wall:.0f} s; 1-minute load average "
        f"{args.load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
        "(this run adds about 1-2; more means other processes shared the cores)",
        "",
    ]


def _collectives_section(results: list[dict]) -> list[str]:
    lines = [
        "## Collectives per device per step (compiled HLO)",
        "",
        "count / MiB per kind. Bytes convention: all-gather = output (gathered) buffer; "
        "reduce-scatter = input (full, pre-scatter) buffer; all-reduce, all-to-all, "
        "collective-permute = buffer size (combined tuple all-reduces: all parts). "
        "`AG+RS moved` = sum of (N-1)/N x full buffer over all-gathers and "
        "reduce-scatters (ring); `all moved` adds 2(N-1)/N x buffer per all-reduce, "
        "(N-1)/N per all-to-all and the buffer per collective-permute.",
        "",
    ]
    lines += table(
        [
            "variant",
            "dev",
            "all-gather",
            "reduce-scatter",
            "all-reduce",
            "all-to-all",
            "coll-permute",
            "dtypes",
            "AG+RS moved MiB",
            "all moved MiB",
        ],
        [_collectives_row(r) for r in results],
    )
    if any(s["upper"] for r in results for s in r["by_kind"].values()):
        lines += [
            "≤: an upper bound. Collectives inside a `conditional` branch (e.g. "
            "fs.scan's prefetch gathers, whose branch need not run on every "
            "iteration) are counted as if it ran on every loop iteration; collectives "
            "in while-loop bodies are counted trip-count times.",
            "",
        ]
    if any(r["unknown_trip"] for r in results):
        lines += ["Note: some while loop had no known trip count; its body counted once.", ""]
    return lines


def _collectives_row(r: dict) -> list[str]:
    k = r["by_kind"]
    dtypes = sorted(set().union(*(s["dtypes"] for s in k.values())))
    cells = [r["name"], str(r["devices"])]
    cells += [
        f"{bound(k[x])}{k[x]['count']} / {mib(k[x]['bytes'])}" if k[x]["count"] else "-"
        for x in KINDS
    ]
    ag_rs = k["all-gather"]["moved"] + k["reduce-scatter"]["moved"]
    total = sum(s["moved"] for s in k.values())
    ag_rs_bound = bound(k["all-gather"]) or bound(k["reduce-scatter"])
    total_bound = "≤ " if any(s["upper"] for s in k.values()) else ""
    return [*cells, ", ".join(dtypes) or "-", ag_rs_bound + mib(ag_rs), total_bound + mib(total)]


def _memory_section(results: list[dict], n: int) -> list[str]:
    base = next((r for r in results if r["name"] == BASELINE), None)
    lines = [
        "## Memory, FLOPs and step time (per device)",
        "",
        "argument / output / temp: `compiled.memory_analysis()`; state: parameters + "
        "optimizer state (or buffers) held on device 0, from `addressable_shards`; "
        "GFLOP: `cost_analysis()['flops']` of one device's program; compile s: "
        "wall time of `.compile()`.",
        "",
    ]
    lines += table(
        [
            "variant",
            "arg MiB",
            "out MiB",
            "temp MiB",
            "state MiB",
            "GFLOP",
            "compile s",
            "median ms",
            "min ms",
            "time / funshard",
            "loss first -> last",
        ],
        [_memory_row(r, base) for r in results],
    )
    if any(r["while"] for r in results):
        lines += [
            "*: the program has a while loop, and XLA's cost analysis counts a loop "
            "body once, not once per iteration: these FLOPs are too low.",
            "",
        ]
    lines += ["Variant notes:", ""]
    lines += [f"- **{r['name']}**: {r['note']}" for r in results]
    return lines + _times_note(results, n)


def _memory_row(r: dict, base: dict | None) -> list[str]:
    ratio = r["median"] / base["median"] if base else float("nan")
    return [
        r["name"],
        mib(r["arg"]),
        mib(r["out"]),
        mib(r["temp"]),
        mib(r["state_bytes"]),
        f"{r['flops'] / 1e9:,.2f}" + ("*" if r["while"] else ""),
        f"{r['compile_s']:.1f}",
        f"{r['median'] * 1e3:,.1f}",
        f"{min(r['times']) * 1e3:,.1f}" if r["times"] else "-",
        f"{ratio:.2f}",
        f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}" if r["has_loss"] else "-",
    ]


def _times_note(results: list[dict], n: int) -> list[str]:
    lines = [
        "",
        f"Reading the times: the {n} simulated devices run concurrently on the same "
        f"{os.cpu_count()} cores and a collective is a memory copy on those cores, so a "
        "multi-device step costs roughly the sum of all devices' work. The floor is ONE "
        "device's share run alone on one device (XLA may spread it over all cores); "
        f"{n} x floor is what the {n} devices' compute costs run one after another, which "
        "the concurrent device programs can beat, so on CPU it is a yardstick, not a "
        "lower bound. Replicated DP does the same per-device FLOPs with one full-size "
        "all-reduce in place of funshard's gathers and reduce-scatters, which "
        "collectives-only times alone. On a real accelerator each device has its own "
        "compute, so bytes moved, memory and FLOPs are the portable numbers here, not "
        "CPU step times. The floor's loss is that of its 1/N batch slice and stays flat: "
        "it trains only its shards.",
        "",
    ]
    floor = next((r for r in results if r["name"].startswith("comm-free")), None)
    if floor:
        lines += [
            f"Floor: {floor['median'] * 1e3:,.1f} ms; {n} x floor = "
            f"{n * floor['median'] * 1e3:,.1f} ms.",
            "",
        ]
    return lines


def _scaling_section(scale: list[dict], param_bytes: int) -> list[str]:
    lines = [
        "## Scaling: funshard reshard_after_forward=True on N devices",
        "",
        "state = parameters + AdamW state on device 0 (ideal 3 x params / N); AG/RS "
        "from the compiled HLO (full-buffer bytes, the same at every N), moved = "
        "(N-1)/N x full buffer; ideal as in the targets below.",
        "",
    ]
    rows = []
    for s in scale:
        ideal_state = 3 * param_bytes / s["n"]
        moved = s["ag"]["moved"] + s["rs"]["moved"]
        rows.append(
            [
                str(s["n"]),
                mib(s["state_bytes"]),
                mib(ideal_state),
                f"{s['state_bytes'] / ideal_state:.3f}",
                f"{s['ag']['count']} / {mib(s['ag']['bytes'])}",
                f"{s['rs']['count']} / {mib(s['rs']['bytes'])}",
                mib(moved),
                mib(s["ideal_comm"]),
                mib(s["temp"]),
            ]
        )
    return lines + table(
        [
            "N",
            "state MiB",
            "ideal MiB",
            "ratio",
            "AG count / MiB",
            "RS count / MiB",
            "AG+RS moved MiB",
            "ideal moved MiB",
            "temp MiB",
        ],
        rows,
    )


def _kinds(counts: dict) -> str:
    """'AG / RS / other' counts of a collectives-by-kind dict."""
    other = sum(v for kind, v in counts.items() if kind not in ("all-gather", "reduce-scatter"))
    return f"{counts.get('all-gather', 0)} / {counts.get('reduce-scatter', 0)} / {other}"


def microbatch_section(micro: list[dict]) -> list[str]:
    """The table of `microbatches.microbatch_rows`; nothing when there are no rows."""
    if not micro:
        return []
    r0 = micro[0]
    lines = [
        "## Microbatches: compile time and program size vs k",
        "",
        "`jax.jit(fs.value_and_grad(loss, microbatches=k, sync_every_microbatch=...))` "
        "of variant 1's loss (fully_shard per block, reshard_after_forward=True; "
        "gradients only, no optimizer update), lowered and compiled, never run. The "
        "global batch scales with k (k x the run's batch, so each microbatch has the "
        "run's rows per device). lower / compile s: median of "
        f"{r0['repeats']} compiles, each on fresh function objects after "
        "`jax.clear_caches()`, the (sync, k) compiles interleaved round by round; "
        "fastest s: the fastest of them (lower+compile). HLO "
        "lines: lines of `compiled.as_text()`; while: while loops in it; collectives in "
        "HLO: instructions in the text (AG / RS / other); executed per step: the same "
        "with while bodies counted trip-count times (`benchmarks/hlo.py`).",
        "",
    ]
    return lines + table(
        [
            "sync_every_microbatch",
            "k",
            "global batch",
            "lower s",
            "compile s",
            "lower+compile s",
            "fastest s",
            "HLO lines",
            "while",
            "collectives in HLO AG / RS / other",
            "executed per step AG / RS / other",
        ],
        [
            [
                str(r["sync"]),
                str(r["k"]),
                str(r["batch"]),
                f"{r['lower_s']:.2f}",
                f"{r['compile_s']:.2f}",
                f"{r['total_s']:.2f}",
                f"{r['fastest_s']:.2f}",
                f"{r['lines']:,}",
                str(r["whiles"]),
                _kinds(r["static"]),
                _kinds(r["executed"]),
            ]
            for r in micro
        ],
    )
