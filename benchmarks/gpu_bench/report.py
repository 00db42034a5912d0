"""The targets' evaluation and the Markdown table of a run's report."""

from __future__ import annotations

from .config import JAX_PARTS, TARGETS, TORCH_PARTS
from .measure import ratio


def evaluate(results: dict, gpu: bool) -> dict:
    """The targets' ratios from the parts' results, and whether each is met."""
    jp, jf = results.get("jax-plain", {}), results.get("jax-funshard", {})
    tp, t2, tf = (results.get(p, {}) for p in TORCH_PARTS)
    out = {
        "funshard / plain JAX": ratio(jf.get("median_s"), jp.get("median_s")),
        "torch_frontend / FSDP2": ratio(tf.get("median_s"), t2.get("median_s")),
        "torch_frontend / plain torch": ratio(tf.get("median_s"), tp.get("median_s")),
        "FSDP2 / plain torch": ratio(t2.get("median_s"), tp.get("median_s")),
        "MFU": jf.get("mfu_compiled"),
    }
    losses = [r.get("losses") for r in (tp, t2, tf)]
    if all(losses):
        ref = losses[0]
        worst = max(
            abs(a - b) / max(abs(b), 1e-12)
            for other in losses[1:]
            for a, b in zip(other, ref, strict=True)
        )
        out["torch losses max relative difference"] = worst
        out["torch losses equal"] = worst <= 1e-3
    if jp.get("losses") and jf.get("losses"):
        first, ref = jf["losses"][0], jp["losses"][0]
        out["jax first loss relative difference"] = abs(first - ref) / abs(ref)
    met = {}
    for name, limit in TARGETS.items():
        value = out.get(name)
        if not gpu or value is None:
            met[name] = "n/a"
        elif name == "MFU":
            met[name] = "met" if value >= limit else "missed"
        else:
            met[name] = "met" if value <= limit else "missed"
    out["targets"] = met
    return out


def _fmt(value, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / 2**30:.2f} GiB"
    if kind == "ms":
        return f"{value * 1e3:,.1f} ms"
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def markdown(report: dict) -> str:
    r, ev = report["results"], report["evaluation"]
    lines = [f"# GPU check ({report['mode']})", ""]
    probe = r.get("probe", {})
    lines += [
        f"- command: `{report['command']}`",
        (
            f"- device: {probe.get('device_kind', '-')} ({probe.get('backend', '-')}), "
            f"jax {probe.get('jax', '-')}, torch {probe.get('torch', '-')}"
        ),
        f"- total wall time: {report['wall_s']:.0f} s (budget {report['budget_s']:.0f} s)",
        "",
    ]
    if report["mode"] != "gpu":
        lines += [
            (
                "**CPU smoke run: tiny models on CPU. It checks that the script runs; none "
                "of its numbers is a GPU measurement.**"
            ),
            "",
        ]
    lines += [
        "| part | status | step | compile | peak memory | notes |",
        "|---|---|---|---|---|---|",
    ]
    for name, res in r.items():
        if name == "probe":
            continue
        if "error" in res:
            lines.append(f"| {name} | error | - | - | - | {res['error'][:300]} |")
            continue
        peak = res.get("peak_bytes", res.get("torch_peak_bytes"))
        notes = []
        if name in JAX_PARTS:
            gflop = (res["flops_compiled"] or 0) / 1e9
            notes.append(
                f"{res['params'] / 1e9:.2f}B params, GFLOP {_fmt(gflop)}, "
                f"MFU {_fmt(res['mfu_compiled'], 'pct')} "
                f"(model FLOPs: {_fmt(res['mfu_model'], 'pct')}), "
                f"compiled step {_fmt(res['step_bytes'], 'bytes')}"
            )
        if name in TORCH_PARTS:
            notes.append(
                f"{res['params'] / 1e6:.1f}M params, losses "
                + ", ".join(f"{x:.4f}" for x in res["losses"][:3])
                + " ..."
            )
            if res.get("jax_peak_bytes") is not None:
                notes.append(f"JAX peak {_fmt(res['jax_peak_bytes'], 'bytes')}")
        if name == "dlpack":
            notes.append(
                ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in res["checks"].items())
            )
            notes.append(f"import {res['import_us']:.0f} us, export {res['export_us']:.0f} us")
        if name == "tests":
            notes.append(res["summary"])
        status = "ok" if res.get("ok", True) else "failed"
        lines.append(
            f"| {name} | {status} | {_fmt(res.get('median_s'), 'ms')} | "
            f"{_fmt(res.get('compile_s'))} | {_fmt(peak, 'bytes')} | {'; '.join(notes)} |"
        )
    lines += ["", "| target | value | limit | result |", "|---|---|---|---|"]
    for name, limit in TARGETS.items():
        value = ev.get(name)
        shown = _fmt(value, "pct") if name == "MFU" else _fmt(value)
        bound = f">= {limit:.0%}" if name == "MFU" else f"<= {limit:.2f}x"
        lines.append(f"| {name} | {shown} | {bound} | {ev['targets'][name]} |")
    for name in (
        "torch_frontend / plain torch",
        "FSDP2 / plain torch",
        "torch losses max relative difference",
        "jax first loss relative difference",
    ):
        if ev.get(name) is not None:
            lines.append(f"| {name} | {_fmt(ev[name])} | - | - |")
    return "\n".join(lines) + "\n"
