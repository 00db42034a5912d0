"""The result of a run: aggregated over the ranks, as a table, Markdown and JSON.

A step's time is the slowest rank's (they end together, at the last collective); a
variant's time is the median over the timed steps. Ratios divide by the peer's median
measured in the same run. Bytes sent and memory are per rank (the larger of the ranks).
"""

from __future__ import annotations

import statistics

MIB = 1024 * 1024
TARGETS = (  # (variant, peer, the most its median may be, in units of the peer's)
    ("torch_frontend reshard=True", "FSDP2 reshard=True", 1.0),
    ("torch_frontend reshard=False", "FSDP2 reshard=False", 1.0),
    ("funshard JAX step reshard=True", "FSDP2 reshard=True", 0.7),
)
MEMORY_TARGETS = (  # the same, for the step's peak resident memory above its start
    ("torch_frontend reshard=True", "FSDP2 reshard=True", 1.1),
    ("torch_frontend reshard=False", "FSDP2 reshard=False", 1.1),
)
LOSS_PAIRS = (
    ("torch_frontend reshard=True", "FSDP2 reshard=True"),
    ("torch_frontend reshard=False", "FSDP2 reshard=False"),
)


def aggregate(ranks: list[dict]) -> dict:
    """One record per variant from every rank's `rank{r}.json`."""
    out = {}
    for i, first in enumerate(ranks[0]["variants"]):
        per_rank = [r["variants"][i] for r in ranks]
        times = [max(ts) for ts in zip(*(v["times"] for v in per_rank), strict=True)]
        losses = _global_losses(first["loss_scope"], per_rank)
        mem = [v["memory"] for v in per_rank]
        out[first["name"]] = {
            "name": first["name"],
            "peer": first["peer"],
            "note": first["note"],
            "facts": first["facts"],
            "times": times,
            "median": statistics.median(times) if times else float("nan"),
            "min": min(times) if times else float("nan"),
            "losses": losses,
            "local_losses": [v["losses"] for v in per_rank],
            "sent": max(statistics.median(v["sent"]) if v["sent"] else 0 for v in per_rank),
            "state": max(m["state"] for m in mem),
            "step_peak": max(
                (m["rss_peak"] - m["rss_before"]) for m in mem if m["rss_peak"] is not None
            )
            if all(m["rss_peak"] is not None for m in mem)
            else None,
        }
    for rec in out.values():
        peer = out.get(rec["peer"]) if rec["peer"] else None
        rec["ratio"] = rec["median"] / peer["median"] if peer else None
        base = out.get("FSDP2 reshard=True")
        rec["vs_fsdp2"] = rec["median"] / base["median"] if base else None
    return out


def _global_losses(scope: str, per_rank: list[dict]) -> list[float]:
    if scope == "local":  # equal rows per rank: the global mean is the ranks' mean
        return [statistics.fmean(ls) for ls in zip(*(v["losses"] for v in per_rank), strict=True)]
    return list(per_rank[0]["losses"])


def loss_checks(rows: dict) -> list[dict]:
    """Largest per-step difference of the frontend's losses from FSDP2's, every rank."""
    checks = []
    for ours, theirs in LOSS_PAIRS:
        if ours in rows and theirs in rows:
            diff = max(
                abs(a - b)
                for la, lb in zip(
                    rows[ours]["local_losses"], rows[theirs]["local_losses"], strict=True
                )
                for a, b in zip(la, lb, strict=True)
            )
            checks.append(
                {
                    "variant": ours,
                    "peer": theirs,
                    "max_abs_diff": diff,
                    "steps": len(rows[ours]["losses"]),
                    "equal": diff <= 1e-5,
                }
            )
    return checks


def target_checks(rows: dict) -> list[dict]:
    out = []
    for name, peer, limit in TARGETS:
        if name in rows and peer in rows:
            ratio = rows[name]["median"] / rows[peer]["median"]
            out.append(
                {
                    "variant": name,
                    "peer": peer,
                    "limit": limit,
                    "ratio": ratio,
                    "met": ratio <= limit,
                    "metric": "step time",
                }
            )
    for name, peer, limit in MEMORY_TARGETS:
        if name in rows and peer in rows and rows[name]["step_peak"] and rows[peer]["step_peak"]:
            ratio = rows[name]["step_peak"] / rows[peer]["step_peak"]
            out.append(
                {
                    "variant": name,
                    "peer": peer,
                    "limit": limit,
                    "ratio": ratio,
                    "met": ratio <= limit,
                    "metric": "step peak memory",
                }
            )
    return out


def profile_rows(ranks: list[dict]) -> list[dict]:
    """Per frontend variant and rank: milliseconds per step inside each bridge call."""
    out = []
    for r in ranks:
        for name, p in r.get("profile", {}).items():
            per_step = {k: 1e3 * s / p["steps"] for k, s in p["seconds"].items()}
            calls = {k: c / p["steps"] for k, c in p["calls"].items()}
            out.append(
                {
                    "variant": name,
                    "rank": r["rank"],
                    "step_ms": 1e3 * statistics.median(p["step_s"]),
                    "ms": per_step,
                    "calls": calls,
                }
            )
    return out


# ------------------------------------------------------------------------ output


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:,.1f}"


HEADER = [
    "variant",
    "median ms",
    "min ms",
    "/ FSDP2",
    "sent MiB/step",
    "state MiB",
    "step peak +MiB",
    "loss first -> last",
]
RATIO_NOTE = (
    "/ FSDP2: the median over PyTorch FSDP2's median in the same run, with the same "
    "reshard_after_forward for the frontend's rows, else FSDP2 reshard=True's"
)


def table_rows(rows: dict) -> list[list[str]]:
    out = []
    for r in rows.values():
        losses = r["losses"]
        out.append(
            [
                r["name"],
                f"{r['median'] * 1e3:,.0f}",
                f"{r['min'] * 1e3:,.0f}",
                _fmt_ratio(r["ratio"] if r["peer"] else r["vs_fsdp2"]),
                _mib(r["sent"]),
                _mib(r["state"]),
                _mib(r["step_peak"]),
                f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-",
            ]
        )
    return out


PROFILE_KEYS = (
    "_gather_now",
    "eager_all_gather",
    "finish_all_gather",
    "start_reduce_scatter",
    "finish_reduce_scatter",
    "_reduce_now",
    "eager_reduce_scatter",
    "_import",
    "_export",
    "global_block",
)


def profile_table(prof: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["variant", "rank", "step ms", *PROFILE_KEYS]
    rows = []
    for p in prof:
        cells = [p["variant"], str(p["rank"]), f"{p['step_ms']:,.0f}"]
        cells += [f"{p['ms'].get(k, 0):,.1f} ({p['calls'].get(k, 0):g})" for k in PROFILE_KEYS]
        rows.append(cells)
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows] + [""]


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """Prints with rich when it is installed, else as Markdown."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print("\n".join(markdown_table(header, rows)))
        return
    table = Table(title=title, header_style="bold")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    Console(width=max(160, Console().width)).print(table)
