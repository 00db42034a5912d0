"""Per-device memory against the number of devices: funshard vs replicated data parallelism.

Run from the repository root (8 simulated CPU devices, about a minute on 2 cores):

    python benchmarks/plot_memory.py                      # writes docs/img/memory_vs_devices.png
    python benchmarks/plot_memory.py --out /tmp/mem.png   # somewhere else

For N = 1, 2, 4, 8 (meshes over the first N devices of one process), the script builds
two training steps of the benchmark's GPT-style model (`fsdp/model.py`, a smaller
configuration than `bench_fsdp.py`'s), each loss + gradients + an AdamW update:

- funshard: one `fs.fully_shard` unit per block, `reshard_after_forward=True`
  (variant 1 of `bench_fsdp.py`);
- replicated data parallelism: parameters and AdamW state replicated on every device,
  gradients averaged with one all-reduce (variant 5 of `bench_fsdp.py`).

Each device processes the same number of rows at every N (the global batch grows with
N), so the activations per device stay the same and the difference between the bars
is what sharding saves. The steps are compiled, never run. Per device, the plot stacks:

- parameters + optimizer state: the bytes of the step's state (parameters, AdamW's two
  moments and its step count) that live on device 0, summed over the arrays'
  `addressable_shards`;
- temporaries: `compiled.memory_analysis().temp_size_in_bytes`, what XLA allocates
  inside the step (activations, gathered parameters, gradients before their reduction).

A Markdown table of the same numbers is printed to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import matplotlib
import numpy as np
import optax
from fsdp import NUM_DEVICES  # configures 8 simulated CPU devices before JAX starts

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from fsdp.measure import bytes_on, log
from fsdp.model import Config, init_params
from fsdp.variants import Context
from fsdp.variants.data_parallel import variant_data_parallel
from fsdp.variants.funshard_units import build_funshard

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), "..", "docs", "img", "memory_vs_devices.png")
COUNTS = (1, 2, 4, 8)
MIB = 2**20
# A smaller model than bench_fsdp.py's default, so that the eight compiles stay quick.
CONFIG = Config(blocks=4, width=384, heads=4, vocab=256, seq=64, mlp=4)


def measure(ctx: Context, build) -> dict:
    """Compiles one variant's step and reads its per-device memory (nothing is run)."""
    variant = build(ctx)
    t0 = time.perf_counter()
    compiled = variant.step.lower(variant.state, *variant.const).compile()
    mem = compiled.memory_analysis()
    log(
        f"{variant.name} on {len(ctx.devices)} device(s): compiled in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return {"state": bytes_on(variant.state, ctx.devices[0]), "temp": mem.temp_size_in_bytes}


def collect(rows_per_device: int) -> tuple[dict, int]:
    """{(variant, N): {"state", "temp"}} for every N, and the model's parameter bytes."""
    params = init_params(CONFIG, seed=0)
    devices = jax.devices()[:NUM_DEVICES]
    rng = np.random.default_rng(1)
    out = {}
    for n in COUNTS:
        cfg = dataclasses.replace(CONFIG, batch=rows_per_device * n)
        tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq), np.int32)
        ctx = Context(cfg, params, tokens, devices[:n], optax.adamw(1e-3, weight_decay=0.01))
        out["funshard", n] = measure(ctx, lambda c: build_funshard(c, True))
        out["replicated", n] = measure(ctx, variant_data_parallel)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    return out, param_bytes


def table(facts: dict) -> str:
    """The numbers behind the plot, as a Markdown table (MiB per device)."""
    lines = [
        "| N | funshard state | funshard temp | funshard total | replicated state "
        "| replicated temp | replicated total | funshard / replicated |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in COUNTS:
        f, r = facts["funshard", n], facts["replicated", n]
        ft, rt = f["state"] + f["temp"], r["state"] + r["temp"]
        lines.append(
            f"| {n} | {f['state'] / MIB:.1f} | {f['temp'] / MIB:.1f} | {ft / MIB:.1f} "
            f"| {r['state'] / MIB:.1f} | {r['temp'] / MIB:.1f} | {rt / MIB:.1f} "
            f"| {ft / rt:.2f} |"
        )
    return "\n".join(lines)


def plot(facts: dict, param_bytes: int, rows_per_device: int, path: str) -> None:
    """Grouped, stacked bars: per N, funshard and replicated, state below temporaries."""
    fig, ax = plt.subplots(figsize=(8, 5.4), dpi=120)
    x = np.arange(len(COUNTS))
    width = 0.38
    styles = {
        "funshard": ("funshard", "#1f4e9c", "#8fb0e6", -width / 2),
        "replicated": ("replicated DP", "#b35a00", "#f2b77a", width / 2),
    }
    for name, (label, dark, light, offset) in styles.items():
        state = np.array([facts[name, n]["state"] for n in COUNTS]) / MIB
        temp = np.array([facts[name, n]["temp"] for n in COUNTS]) / MIB
        ax.bar(x + offset, state, width, color=dark, label=f"{label}: parameters + AdamW state")
        ax.bar(x + offset, temp, width, bottom=state, color=light, label=f"{label}: temporaries")
        for xi, total in zip(x + offset, state + temp, strict=True):
            ax.annotate(
                f"{total:.0f}",
                (xi, total),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_xticks(x, [str(n) for n in COUNTS])
    ax.set_xlabel("devices (N)")
    ax.set_ylabel("MiB per device")
    ax.set_title(
        "Per-device memory of one training step vs number of devices\n"
        f"GPT-style model, {CONFIG.blocks} blocks, width {CONFIG.width}, vocab {CONFIG.vocab}: "
        f"{param_bytes / MIB:.1f} MiB of f32 parameters\n"
        f"AdamW; {rows_per_device} rows x {CONFIG.seq} tokens per device; compiled for XLA CPU",
        fontsize=10,
    )
    top = max(f["state"] + f["temp"] for f in facts.values()) / MIB
    ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def main(argv=None) -> None:
    """Measures, plots, and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the PNG to write")
    parser.add_argument("--rows-per-device", type=int, default=2)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    facts, param_bytes = collect(args.rows_per_device)
    plot(facts, param_bytes, args.rows_per_device, args.out)
    print(table(facts))
    log(f"wrote {os.path.normpath(args.out)} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
