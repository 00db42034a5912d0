"""Measuring the variants: compiling them, reading their programs, timing their steps.

Everything here is measured in the run itself: collectives from each compiled program's
HLO (`benchmarks/hlo.py`), memory from `compiled.memory_analysis()`, FLOPs from
`compiled.cost_analysis()`, per-device state from the arrays' `addressable_shards`, step
times with `jax.block_until_ready`.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import jax
from hlo import KINDS, executed_collectives  # benchmarks/hlo.py, shared with the tests

from .variants import Variant


def log(msg: str) -> None:
    """Prints a time-stamped progress line to stderr (the report goes to stdout)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def lower(v: Variant):
    """Lowers the variant's step on its own state and constants."""
    return v.step.lower(v.state, *v.const)


def compile_all(lowered: dict[str, Any]) -> dict[str, tuple[Any, float]]:
    """Compiles every lowered program, one after another.

    One after another because compiling two at once on this machine was slower.

    Returns:
        name -> (executable, seconds its compile took).
    """
    out = {}
    for name, low in lowered.items():
        t0 = time.perf_counter()
        exe = low.compile()
        out[name] = (exe, time.perf_counter() - t0)
        log(f"compiled {name} ({out[name][1]:.1f} s)")
    return out


def summarize(ops: list[dict]) -> dict:
    """Per kind: executions per step, bytes, bytes moved, dtypes, and whether an upper bound."""
    by_kind = {
        k: {"count": 0, "bytes": 0.0, "moved": 0.0, "dtypes": set(), "upper": False} for k in KINDS
    }
    for op in ops:
        s = by_kind[op["kind"]]
        s["upper"] |= op["conditional"]  # the totals are upper bounds
        s["count"] += op["times"]
        s["bytes"] += op["times"] * op["bytes"]
        s["moved"] += op["times"] * op["moved"]
        s["dtypes"].update(op["dtypes"])
    return by_kind


def flops_of(compiled) -> float:
    """FLOPs of one device's program by XLA's cost analysis (NaN when it has none)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", float("nan")))


def bytes_on(tree: Any, device) -> int:
    """Bytes of `tree`'s arrays that live on `device` (its addressable shards there)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


def static_facts(v: Variant, compiled) -> dict:
    """Everything read from the compiled program and the placed state (no execution)."""
    ops, loops = executed_collectives(compiled.as_text(), v.devices)
    mem = compiled.memory_analysis()
    return {
        "name": v.name,
        "note": v.note,
        "devices": v.devices,
        "has_loss": v.has_loss,
        "ops": ops,
        "by_kind": summarize(ops),
        "unknown_trip": loops["unknown_trip"],
        "while": loops["while"],
        "arg": mem.argument_size_in_bytes,
        "out": mem.output_size_in_bytes,
        "temp": mem.temp_size_in_bytes,
        "flops": flops_of(compiled),
        "state_bytes": bytes_on(v.state, jax.devices()[0]),
    }


def time_steps(variants: list[Variant], compiled: dict, warmup: int, steps: int) -> dict:
    """Runs `warmup` untimed then `steps` timed steps of every variant, interleaved.

    Round r runs step r of each variant in turn, so that a change in the machine's load
    during the run hits all variants alike. Each step is fed the previous step's state
    and waited for with `jax.block_until_ready`.

    Returns:
        name -> {"times", "losses", "median", "first_loss", "last_loss"}.
    """
    states = {v.name: v.state for v in variants}
    out = {v.name: {"times": [], "losses": []} for v in variants}
    for i in range(warmup + steps):
        for v in variants:
            exe = compiled[v.name][0]
            t0 = time.perf_counter()
            states[v.name], loss = jax.block_until_ready(exe(states[v.name], *v.const))
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                out[v.name]["times"].append(elapsed)
            out[v.name]["losses"].append(float(loss))
        kind = "warm-up" if i < warmup else "timed"
        log(
            f"round {i + 1}/{warmup + steps} ({kind}): "
            + ", ".join(f"{v.name} {_elapsed(out, v.name, i, warmup)}" for v in variants)
        )
    for r in out.values():
        times, losses = r["times"], r["losses"]
        r.update(
            median=statistics.median(times) if times else float("nan"),
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
        )
    return out


def _elapsed(out: dict, name: str, i: int, warmup: int) -> str:
    times = out[name]["times"]
    return f"{times[-1] * 1e3:,.0f} ms" if i >= warmup and times else "done"
