"""Compile time and program size of `fs.value_and_grad(loss, microbatches=k)` against k.

funshard runs the microbatches as a `lax.scan` (one microbatch's step in a loop body,
run k times), so lowering + compile time and the compiled program should stay flat in
k, where unrolling would make both grow with k. This probe measures that: for variant 1's
loss (`fs.fully_shard` per block, `reshard_after_forward=True`; no optimizer update, the
gradient step alone) and each k in `KS`, with `sync_every_microbatch` True and False, it
jits `fs.value_and_grad(loss, microbatches=k)` and lowers and compiles it `repeats`
times (`jax.clear_caches()` and fresh function objects before each, the compiles of all
(sync, k) interleaved round by round so a change in the machine's load hits them alike),
then reads the last compiled program's HLO with `benchmarks/hlo.py`.

The global batch scales with k: k x the run's batch, so every microbatch has the run's
rows per device and the loop body is the same program at every k (the batch is a
multiple of 8 x k since the run's batch is a multiple of 8).
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from hlo import computations, executed_collectives, parse_collectives  # benchmarks/hlo.py
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

from .measure import log
from .variants import AXIS, Context
from .variants.funshard_units import funshard_loss

KS = (1, 2, 8)
SYNCS = (True, False)
TIME_RATIO = 1.5  # target: lower+compile at the largest k within this x that at k=1
LINES_RATIO = 1.2  # target: HLO lines at the largest k within this x those at k=1


def _compile_once(ctx: Context, k: int, sync: bool, state, tokens) -> tuple[float, float, str]:
    """(lowering s, compile s, compiled HLO text) of one fresh jit of the gradient step."""
    jax.clear_caches()
    grad_step = fs.value_and_grad(
        funshard_loss(ctx.cfg, True), microbatches=k, sync_every_microbatch=sync
    )
    t0 = time.perf_counter()
    lowered = jax.jit(grad_step).lower(state, tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, compiled.as_text()


def _hlo_facts(text: str, n: int) -> dict:
    """Program size, while loops and collectives of a compiled module's text."""
    comps = computations(text)
    whiles = sum(" while(" in line for lines in comps.values() for line in lines)
    static = {}
    for c in parse_collectives(text.splitlines()):
        static[c.kind] = static.get(c.kind, 0) + 1
    executed = {}
    for op in executed_collectives(text, n)[0]:
        executed[op["kind"]] = executed.get(op["kind"], 0) + op["times"]
    return {
        "lines": len(text.splitlines()),
        "whiles": whiles,
        "static": static,
        "executed": executed,
    }


def microbatch_rows(ctx: Context, repeats: int = 3) -> list[dict]:
    """One row per (sync, k): batch, median lowering / compile seconds, HLO facts.

    Args:
        ctx: the run's context (model, parameters, batch, devices).
        repeats: compiles per (sync, k); the medians are over these.
    """
    n = len(ctx.devices)
    mesh = fs.make_mesh(devices=ctx.devices)
    state = fs.shard(ctx.params, mesh)
    batch = NamedSharding(mesh, P(AXIS))
    tokens = {k: jax.device_put(np.concatenate([ctx.tokens] * k), batch) for k in KS}
    runs = {(s, k): [] for s in SYNCS for k in KS}
    text = {}
    for r in range(repeats):
        for sync, k in runs:
            lower_s, compile_s, text[sync, k] = _compile_once(ctx, k, sync, state, tokens[k])
            runs[sync, k].append((lower_s, compile_s))
        log(
            f"microbatch compiles, round {r + 1}/{repeats}: "
            + ", ".join(f"sync={s} k={k} {sum(t[-1]):.1f} s" for (s, k), t in runs.items())
        )
    rows = []
    for (sync, k), times in runs.items():
        rows.append(
            {
                "sync": sync,
                "k": k,
                "batch": int(tokens[k].shape[0]),
                "repeats": repeats,
                "lower_s": statistics.median(t[0] for t in times),
                "compile_s": statistics.median(t[1] for t in times),
                "total_s": statistics.median(t[0] + t[1] for t in times),
                "fastest_s": min(t[0] + t[1] for t in times),
                **_hlo_facts(text[sync, k], n),
            }
        )
    return rows
