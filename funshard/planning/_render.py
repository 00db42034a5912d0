"""A `Plan` as tables: plain text for `str(plan)`, `rich` tables for `rich.print(plan)`.

Both renderings come from the same rows (`sections`); `rich` is imported only when a
rich rendering is asked for, so the core does not depend on it.
"""

from __future__ import annotations

from typing import Any

KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def human(n: float) -> str:
    """Bytes as `812 B`, `1.5 KiB`, `3.2 MiB`, ..."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):  # noqa: B007 (the unit it stops at is printed)
        n /= 1024
        if abs(n) < 1024:
            break
    return f"{n:.1f} {unit}"


def title(plan: Any) -> str:
    axes = ", ".join(f"{a}={s}" for a, s in plan.mesh_shape)
    replicas = f" x {plan.num_replicas} replicas" if plan.num_replicas > 1 else ""
    mb = plan.microbatches
    return (
        f"funshard plan: mesh ({axes}), {plan.num_shards} shards{replicas}, "
        f"{mb} microbatch{'es' if mb > 1 else ''} per step"
    )


def _memory(plan: Any) -> tuple[str, list[str], list[list[str]]]:
    rows = [("parameters", plan.params), ("gradients", plan.grads)]
    if plan.optimizer is not None:
        rows.append(("optimizer state", plan.optimizer))
    if plan.accumulators is not None:
        rows.append(("gradient accumulators", plan.accumulators))
    per_device = sum(f.per_device for _, f in rows)
    unsharded = sum(f.replicated for _, f in rows)
    body = [[name, human(f.per_device), human(f.replicated)] for name, f in rows]
    body.append(["total", human(per_device), human(unsharded)])
    return "memory per device", ["", "sharded", "unsharded"], body


def _reshard_text(value) -> str:
    return str(value) if isinstance(value, bool) else f"hpZ {value}"


def _units(plan: Any) -> tuple[str, list[str], list[list[str]]]:
    # A scanned stack's collectives are one layer's: the "layers" column (shown only
    # when a plan has such a unit) says how many run in turn.
    scanned = any(u.layers for u in plan.units)
    body = [
        [
            u.name,
            str(len(u.leaves)),
            "-" if u.name == "root" else _reshard_text(u.reshard_after_forward),
            *([str(u.layers) if u.layers else "-"] if scanned else []),
            human(u.param_bytes),
            human(u.gathered_bytes),
            str(plan.count("all-gather", u.name)),
            human(u.reduce_scatter_bytes),
            str(plan.count("reduce-scatter", u.name)),
        ]
        for u in plan.units
    ]
    headers = [
        "unit",
        "leaves",
        "reshard",
        *(["layers"] if scanned else []),
        "params/dev",
        "gathered",
        "gathers",
        "scattered",
        "scatters",
    ]
    each = "one collective, one layer's for a stack;" if scanned else "one collective,"
    return f"units (bytes of {each} counts per step)", headers, body


def _collectives(plan: Any) -> tuple[str, list[str], list[list[str]]]:
    body = [
        [kind, str(plan.count(kind)), human(plan.bytes(kind)), human(plan.sent_bytes(kind))]
        for kind in KINDS
    ]
    body.append(["total", str(plan.count()), human(plan.bytes()), human(plan.sent_bytes())])
    return "collectives per step", ["", "count", "bytes", "sent/device"], body


def _by_axes(plan: Any) -> tuple[str, list[str], list[list[str]]]:
    """Bytes per set of mesh axes: where model axes leave leaves their own data axes."""
    totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for c in plan.collectives:
        if c.axes:
            entry = totals.setdefault((c.kind, c.axes), [0, 0, 0.0])
            entry[0] += c.times
            entry[1] += c.total_bytes
            entry[2] += c.sent_bytes
    body = [
        [kind, ",".join(axes), str(int(count)), human(int(size)), human(sent)]
        for (kind, axes), (count, size, sent) in sorted(totals.items())
    ]
    return "collectives per mesh axes", ["", "axes", "count", "bytes", "sent/device"], body


def sections(plan: Any) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of each table (per mesh axes only where leaves differ)."""
    found = [_memory(plan), _units(plan), _collectives(plan)]
    sharded = {c.axes for c in plan.collectives if c.kind != "all-reduce" and c.axes}
    used = {a for c in plan.collectives for a in c.axes}
    if len(sharded) > 1 or any(name not in used for name, _ in plan.mesh_shape):
        found.append(_by_axes(plan))  # model axes on the mesh
    return found


def text_table(name: str, headers: list[str], rows: list[list[str]]) -> list[str]:
    table = [headers, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(headers))]

    def line(cells):
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  " + "  ".join([first, *rest]).rstrip()

    return [name, *map(line, table)]


def render_text(plan: Any) -> str:
    """The plan as plain-text tables."""
    lines = [title(plan)]
    for name, headers, rows in sections(plan):
        lines += ["", *text_table(name, headers, rows)]
    return "\n".join(lines)


def render_rich(plan: Any):
    """The plan as a `rich` renderable (rich is imported here, on demand)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    tables = []
    for name, headers, rows in sections(plan):
        table = Table(title=name, title_justify="left", title_style="bold")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*row, style="bold" if row[0] == "total" else None)
        tables.append(table)
    return Group(Text(title(plan), style="bold"), *tables)
