"""The report's targets: each a PASS/MISS line with the figures it compared."""

from __future__ import annotations

import jax

from .microbatches import LINES_RATIO, TIME_RATIO
from .model import gathered_unit_bytes, ideal_comm
from .variants import BASELINE, Context

KEEP = "funshard reshard=False"  # variant 2, compared with the baseline
AUTO = "jax auto-sharding"


def check(label: str, ok: bool, detail: str) -> str:
    """One target's line of the report."""
    return f"- **{'PASS' if ok else 'MISS'}** {label}: {detail}"


def targets(
    ctx: Context, by_name: dict[str, dict], act: dict, micro: list[dict] | None = None
) -> list[str]:
    """The target lines for the variants present, then a blank line.

    Args:
        ctx: what the variants were built from.
        by_name: per variant name, its facts and timing (as in `report.report`).
        act: the activation probes (`plain`, `slope`; see `report.report`).
        micro: the microbatch rows (`microbatches.microbatch_rows`), or None.
    """
    t, f, auto = by_name.get(BASELINE), by_name.get(KEEP), by_name.get(AUTO)
    out = []
    if t and act.get("plain") is not None:
        out.append(_memory(ctx, t, f, auto, act))
        out += [
            _comm(ctx, name, by_name[name], reshard)
            for name, reshard in ((BASELINE, True), (KEEP, False))
            if name in by_name
        ]
        out.append(_state(ctx, t))
    if t and f:
        out.append(
            check(
                "FLOPs",
                abs(t["flops"] - f["flops"]) <= 0.02 * f["flops"],
                f"FLOPs(True) = {t['flops']:,.0f} vs FLOPs(False) = "
                f"{f['flops']:,.0f} ({t['flops'] / f['flops'] - 1:+.2%}; within 2%)",
            )
        )
    if t and auto:
        out.append(_speed(t, auto))
    if micro:
        out.append(_microbatches(micro))
    return [*out, ""]


def _param_bytes(ctx: Context) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(ctx.params))


def _memory(ctx: Context, t: dict, f: dict | None, auto: dict | None, act: dict) -> str:
    """temp(True) within the activations plus 4 x the largest unit."""
    n = len(ctx.devices)
    largest = max(gathered_unit_bytes(ctx.params, n))
    a = act["plain"]
    bound = a + 4 * largest
    rest = t["temp"] - a
    rows = ctx.cfg.batch // n
    return check(
        "memory",
        t["temp"] <= bound,
        f"temp(True) = {t['temp']:,} B <= activations {a:,} B + 4 x largest unit "
        f"{largest:,} B = {bound:,} B (ratio {t['temp'] / bound:.3f}). Activations = "
        f"the temp bytes of plain jax.grad on one device's {rows} rows on one device "
        "(parameters as arguments, gradients as outputs): what XLA holds besides "
        "parameters and gradients when nothing is sharded. The rest, "
        f"{rest:,} B = {rest / largest:.2f} x largest unit, is what FSDP holds on "
        "top: gathered parameters (the root unit, i.e. embed, pos, final LN and "
        "head, counted as a unit as FSDP2 does, for the whole step; blocks one at a "
        "time), their copy-outs, and full-size gradients until their reduce-scatter."
        + (f" For comparison: temp(reshard=False) = {f['temp']:,} B" if f else "")
        + (f", temp(automatic sharding) = {auto['temp']:,} B" if auto else "")
        + (
            f"; temp(True, {2 * rows} rows per device) - temp(True) = "
            f"{act['slope']:,} B (growth with the batch; XLA's schedule changes "
            "with it, so this is not a clean activation measure)"
            if act.get("slope") is not None
            else ""
        )
        + ".",
    )


def _comm(ctx: Context, name: str, r: dict, reshard: bool) -> str:
    """AG+RS bytes moved within 2% of funshard's ideal schedule."""
    n = len(ctx.devices)
    k = r["by_kind"]
    moved = k["all-gather"]["moved"] + k["reduce-scatter"]["moved"]
    ideal = ideal_comm(ctx.params, n, reshard)
    naive = (3 if reshard else 2) * (n - 1) / n * _param_bytes(ctx)
    return check(
        f"comm bytes ({name})",
        abs(moved - ideal) <= 0.02 * ideal,
        f"AG+RS moved/device {moved:,.0f} B vs ideal {ideal:,.0f} B "
        f"({moved / ideal - 1:+.2%}); ideal = (N-1)/N x (2 x root unit + "
        f"{3 if reshard else 2} x each block), since the root is gathered once. "
        f"For reference {3 if reshard else 2}(N-1)/N x params = {naive:,.0f} B "
        f"({moved / naive - 1:+.2%}). {k['all-gather']['count']} all-gathers, "
        f"{k['reduce-scatter']['count']} reduce-scatters.",
    )


def _state(ctx: Context, t: dict) -> str:
    """Parameters + AdamW state per device within 5% of 3 x params / N."""
    param_bytes = _param_bytes(ctx)
    ideal_state = 3 * param_bytes / len(ctx.devices)
    return check(
        "per-device state",
        t["state_bytes"] <= 1.05 * ideal_state,
        f"params + AdamW state on device 0 = {t['state_bytes']:,} B <= 1.05 x "
        f"3 x {param_bytes:,} / {len(ctx.devices)} = {1.05 * ideal_state:,.0f} B "
        f"(ratio {t['state_bytes'] / ideal_state:.4f})",
    )


def _speed(t: dict, auto: dict) -> str:
    """funshard's median step no slower than automatic sharding's."""
    ratio = t["median"] / auto["median"]
    best = min(t["times"]) / min(auto["times"]) if t["times"] and auto["times"] else 0
    return check(
        "speed vs automatic sharding",
        ratio <= 1.0,
        f"funshard {t['median'] * 1e3:,.1f} ms / auto-sharding "
        f"{auto['median'] * 1e3:,.1f} ms = {ratio:.2f} median over median (target "
        f"<= 1.00); fastest over fastest step {best:.2f}. CPU-simulated devices, see "
        "the note on times.",
    )


def _microbatches(micro: list[dict]) -> str:
    """Compile time and HLO lines at the largest k within a bound of k=1, per sync."""
    ok, parts = True, []
    for sync in sorted({r["sync"] for r in micro}, reverse=True):
        rows = sorted((r for r in micro if r["sync"] == sync), key=lambda r: r["k"])
        one, big = rows[0], rows[-1]
        t, lines = big["total_s"] / one["total_s"], big["lines"] / one["lines"]
        ok &= t <= TIME_RATIO and lines <= LINES_RATIO
        parts.append(
            f"sync_every_microbatch={sync}: lower+compile k={big['k']} "
            f"{big['total_s']:.2f} s / k={one['k']} {one['total_s']:.2f} s = {t:.2f}, "
            f"HLO lines {big['lines']:,} / {one['lines']:,} = {lines:.2f}"
        )
    return check(
        "microbatches compile flat in k",
        ok,
        "; ".join(parts) + f" (targets: time <= {TIME_RATIO}x, lines <= {LINES_RATIO}x; "
        "median of the compiles, see the microbatch table)",
    )
