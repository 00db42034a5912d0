"""The benchmark's command line and the order of a run.

All programs are compiled first; then the variants' steps run interleaved (see
`measure.time_steps`); the probes are only compiled and read.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import numpy as np
import optax

from . import NUM_DEVICES
from .measure import compile_all, log, lower, static_facts, time_steps
from .microbatches import microbatch_rows
from .model import Config, init_params
from .probes import double_batch_variant, plain_grad_program, scaling_row, scaling_variants
from .report import report
from .variants import BASELINE, Context, builders

DESCRIPTION = (
    "FSDP benchmark: funshard against JAX's own data-parallel forms, side by side, in ONE run."
)


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
    """Parses the flags; returns them and the model config they select."""
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny model, 3 steps, scaling for N=4 and 8 only",
    )
    parser.add_argument("--no-scaling", action="store_true", help="skip the N=1,2,4,8 table")
    parser.add_argument(
        "--no-microbatches", action="store_true", help="skip the compile time vs microbatches table"
    )
    args = parser.parse_args(argv)

    defaults = Config(blocks=2, width=64, vocab=256, seq=16) if args.quick else Config()
    cfg = Config(
        **{
            field.name: getattr(args, field.name)
            if getattr(args, field.name, None) is not None
            else getattr(defaults, field.name)
            for field in dataclasses.fields(Config)
        }
    )
    if args.steps is None:
        args.steps = 3 if args.quick else 10
    n = min(NUM_DEVICES, len(jax.devices()))
    if cfg.batch % n or cfg.width % cfg.heads:
        parser.error(f"--batch must be a multiple of {n} and --width of --heads")
    return args, cfg


def build_variants(ctx: Context) -> list:
    """Every registered variant that its builder did not leave out, names unique."""
    variants = [v for v in (build(ctx) for build in builders()) if v is not None]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must be unique: {names}")
    return variants


def build_probes(ctx: Context, args, variants: list) -> list:
    """The programs only compiled and read: the double batch, then the scaling runs."""
    if not any(v.name == BASELINE for v in variants):
        return []
    extra = [double_batch_variant(ctx)]
    if not args.no_scaling:
        counts = (4,) if args.quick else (1, 2, 4)  # N = all devices: variant 1 itself
        extra += scaling_variants(ctx, [c for c in counts if c < len(ctx.devices)])
    return extra


def probe_facts(args, results: list[dict], extra: list, facts: dict, compiled: dict):
    """(activation probe figures, scaling rows) from the probes' compiled programs."""
    plain = compiled.get("plain grad")
    act = {"plain": plain[0].memory_analysis().temp_size_in_bytes if plain else None, "slope": None}
    if not extra:
        return act, []
    base = next(r for r in results if r["name"] == BASELINE)
    act["slope"] = facts[extra[0].name]["temp"] - base["temp"]
    if args.no_scaling:
        return act, []
    return act, [facts[v.name] for v in extra[1:]] + [base]


def main(argv=None) -> None:
    """Runs the benchmark: prints the report and, with `--out`, writes it there too."""
    args, cfg = parse_args(argv)
    start = time.perf_counter()
    args.load_start = os.getloadavg()[0]
    params = init_params(cfg, seed=0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (cfg.batch, cfg.seq), np.int32)
    ctx = Context(
        cfg, params, tokens, jax.devices()[:NUM_DEVICES], optax.adamw(1e-3, weight_decay=0.01)
    )

    variants = build_variants(ctx)
    extra = build_probes(ctx, args, variants)
    log(f"lowering {len(variants) + len(extra) + 1} programs")
    lowered = {v.name: lower(v) for v in variants + extra}
    lowered["plain grad"] = plain_grad_program(ctx)
    compiled = compile_all(lowered)

    timing = time_steps(variants, compiled, args.warmup, args.steps)
    results = [
        dict(static_facts(v, compiled[v.name][0]), compile_s=compiled[v.name][1], **timing[v.name])
        for v in variants
    ]
    facts = {v.name: static_facts(v, compiled[v.name][0]) for v in extra}
    act, scale_facts = probe_facts(args, results, extra, facts, compiled)
    scale = [scaling_row(ctx, f) for f in scale_facts]
    del compiled, lowered  # the variants' programs are done with
    micro = None if args.no_microbatches else microbatch_rows(ctx)
    text = report(args, cfg, ctx, results, scale, act, time.perf_counter() - start, micro)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
