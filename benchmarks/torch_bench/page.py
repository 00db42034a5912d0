"""The run's Markdown page, from what `report` aggregated and `isolated` measured."""

from __future__ import annotations

import argparse
import shlex
import sys

from . import isolated, report


def _header(
    args: argparse.Namespace, m: dict, load: tuple, wall: float, cfg: dict, params: int
) -> list[str]:
    """The page's title, how it was run and on what."""
    return [
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


def _checks(losses: list[dict], targets: list[dict]) -> list[str]:
    """The loss comparisons and the targets, one bullet each."""
    lines = ["## Checks", ""]
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
    return lines


def markdown(
    args: argparse.Namespace,
    m: dict,
    rows: dict,
    losses: list[dict],
    targets: list[dict],
    prof: list[dict],
    load: tuple,
    wall: float,
    cfg: dict,
    params: int,
) -> str:
    """The page of the interleaved run: the table, the checks and the frontend's profile.

    Args:
      args: the parsed flags.
      m: `jobs.machine()`.
      rows: `report.aggregate`'s records, by variant name.
      losses: `report.loss_checks(rows)`.
      targets: `report.target_checks(rows)`.
      prof: `report.profile_rows` (empty: no profile section).
      load: `uptime` at the start and at the end of the run.
      wall: the run's wall time in seconds.
      cfg: the model's config, as the ranks reported it.
      params: the model's parameter count.
    """
    lines = _header(args, m, load, wall, cfg, params)
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
    lines += _checks(losses, targets)
    if prof:
        header, prow = report.profile_table(prof)
        title = "## Frontend profile (ms per step inside each bridge call, calls per step)"
        lines += [title, "", *report.markdown_table(header, prow)]
    return "\n".join(lines)


def _section(title: str, note: str, table: isolated.Table) -> str:
    return "\n".join(["", title, "", note, "", *report.markdown_table(*table), ""])


def isolated_sections(stepped: dict | None, alone: dict | None, compiled: dict | None) -> str:
    """The sections of the jobs run one variant each, those that ran ("" if none).

    Args:
      stepped: `isolated.step_times_alone`'s result (`--alone-repeats`).
      alone: `isolated.process_memory`'s result (`--rss`).
      compiled: `isolated.compile_runs`' result (`--compile`).
    """
    text = ""
    if stepped:
        title = "## Each variant alone (step time)"
        text += _section(title, isolated.STEP_ALONE_NOTE, isolated.step_alone_table(stepped))
    if alone:
        title = "## Each implementation alone (peak resident memory)"
        text += _section(title, isolated.RSS_NOTE, isolated.rss_table(alone))
        title = "## Each implementation alone (start-up cost)"
        text += _section(title, isolated.STARTUP_NOTE, isolated.startup_table(alone))
    if compiled:
        title = "## block.compile() per block (first step)"
        text += _section(title, isolated.COMPILE_NOTE, isolated.compile_table(compiled))
    return text
