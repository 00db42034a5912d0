"""Depth benchmark: a deep stack as fs.fully_shard units in a loop, as fs.scan, and as
JAX's automatic FSDP, at several depths.

Run from the repository root (8 simulated CPU devices):

    python benchmarks/bench_depth.py                         # MLP, 8/32/64/128 layers
    python benchmarks/bench_depth.py --model gpt --layers 8 32
    python benchmarks/bench_depth.py --forms loop scan --steps 5
    python benchmarks/bench_depth.py --plot docs/img/depth.png  # and draw it

Each form is one jitted training step of the same model (public API only): loss,
gradients and an `optax.adamw` update, the parameters and optimizer state donated:

- loop: one `fs.fully_shard` unit per layer, called in a Python loop;
- scan: the layers stacked (`fs.shard(..., stacked=True)`) and run by `fs.scan`;
- automatic: plain `jax.jit` over the stacked layers in `jax.lax.scan`, every leaf
  `NamedSharding(P(None, "fsdp"))` (the layer's dim 0 split over the devices, where 8
  divides it), the batch `P("fsdp")`: FSDP by annotation;
- unrolled (`--forms ... unrolled`): automatic sharding of the loop form, plain
  `jax.jit` over the Python loop of layers, each leaf `P("fsdp")` where 8 divides its
  dim 0: the compiler's own cost of an unrolled program, the loop's peer.

Reported per form and depth: compile seconds (`trace(...).lower().compile()`, and the
same split into trace, lower and XLA compile), temp MiB
(`compiled.memory_analysis().temp_size_in_bytes`) and the median step time over
`--steps` steps after one warm-up step, the forms interleaved step by step.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))  # examples.models
import funshard as fs  # noqa: E402
from examples.models.jax_gpt import make_block  # noqa: E402

FORMS = ("loop", "scan", "automatic")
# Not run unless asked for: automatic sharding of the loop form (see `build`).
UNROLLED = "unrolled"


def mlp_block(p, h):
    """A residual MLP block: `h + relu(h @ w1 + b1) @ w2 + b2`."""
    return h + jax.nn.relu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def mlp_layers(depth: int, width: int, rng: np.random.Generator) -> list[dict]:
    """Per-layer parameters of the residual MLP (host numpy)."""

    def dense():
        return (rng.standard_normal((width, width)) / math.sqrt(width)).astype(np.float32)

    return [
        {
            "w1": dense(),
            "b1": np.zeros(width, np.float32),
            "w2": dense() / math.sqrt(2 * depth),
            "b2": np.zeros(width, np.float32),
        }
        for _ in range(depth)
    ]


def gpt_layers(depth: int, width: int, rng: np.random.Generator) -> list[dict]:
    """Per-block parameters of the example GPT (`examples/models/jax_gpt.py`), MLP 4x."""

    def dense(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / math.sqrt(shape[0])).astype(np.float32)

    d, f = width, 4 * width
    ones, zeros = np.ones(d, np.float32), np.zeros(d, np.float32)
    return [
        {
            "ln1_g": ones,
            "ln1_b": zeros,
            "qkv": dense((d, 3 * d)),
            "qkv_b": np.zeros(3 * d, np.float32),
            "proj": dense((d, d), 1 / math.sqrt(2 * depth)),
            "proj_b": zeros,
            "ln2_g": ones,
            "ln2_b": zeros,
            "ff1": dense((d, f)),
            "ff1_b": np.zeros(f, np.float32),
            "ff2": dense((f, d), 1 / math.sqrt(2 * depth)),
            "ff2_b": zeros,
        }
        for _ in range(depth)
    ]


def model(args: argparse.Namespace, depth: int) -> tuple[Callable, list[dict], np.ndarray]:
    """(block, per-layer parameters, global input batch) of the chosen model."""
    rng = np.random.default_rng(0)
    if args.model == "mlp":
        x = rng.standard_normal((args.batch, args.width)).astype(np.float32)
        return mlp_block, mlp_layers(depth, args.width, rng), x
    x = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    return make_block(args.heads), gpt_layers(depth, args.width, rng), x


def stack(layers: list[dict]) -> dict:
    return {k: np.stack([p[k] for p in layers]) for k in layers[0]}


def loss_of(h) -> jax.Array:
    return jnp.mean(h.astype(jnp.float32) ** 2)


def train_step(value_and_grad: Callable, opt: optax.GradientTransformation) -> Callable:
    """`step((params, opt_state), x) -> ((params, opt_state), loss)`: loss, gradients and
    the optimizer's update, as a training loop runs them."""

    def step(train_state, x):
        params, opt_state = train_state
        loss, grads = value_and_grad(params, x)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def build(form: str, block: Callable, layers: list[dict], x: np.ndarray, mesh):
    """(jitted train step, its train state, its batch) of one form; the state is donated."""
    opt = optax.adamw(1e-3)
    batch = jax.device_put(x, NamedSharding(mesh, P("fsdp")))
    if form == "loop":
        unit = fs.fully_shard(block)

        def loop_loss(state, h):
            for p in state:
                h = unit(p, h)
            return loss_of(h)

        state = fs.shard(layers, mesh)
        step = train_step(fs.value_and_grad(loop_loss), opt)
        return jax.jit(step, donate_argnums=0), (state, opt.init(state)), batch
    if form == "scan":

        def scan_loss(state, h):
            return loss_of(fs.scan(block, state, h))

        state = fs.shard(stack(layers), mesh, stacked=True)
        step = train_step(fs.value_and_grad(scan_loss), opt)
        return jax.jit(step, donate_argnums=0), (state, opt.init(state)), batch

    def auto_loss(params, h):
        return loss_of(jax.lax.scan(lambda c, p: (block(p, c), None), h, params)[0])

    def unrolled_loss(params, h):
        for p in params:
            h = block(p, h)
        return loss_of(h)

    # A stacked leaf is split on its layer's dim 0 (the stack's dim 1), a layer's leaf
    # on its dim 0, where the device count divides it; the rest is replicated.
    dim = 0 if form == UNROLLED else 1

    def sharding(a):
        split = a.ndim > dim and a.shape[dim] % mesh.size == 0
        return NamedSharding(mesh, P(*[None] * dim, "fsdp") if split else P())

    loss = unrolled_loss if form == UNROLLED else auto_loss
    model_params = layers if form == UNROLLED else stack(layers)
    params = jax.device_put(model_params, jax.tree.map(sharding, model_params))
    opt_state = opt.init(params)
    opt_state = jax.device_put(opt_state, jax.tree.map(sharding, opt_state))
    shardings = jax.tree.map(sharding, (params, opt_state))
    step = jax.jit(
        train_step(jax.value_and_grad(loss), opt),
        in_shardings=(shardings, batch.sharding),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    return step, (params, opt_state), batch


def measure(args: argparse.Namespace, depth: int, mesh) -> dict[str, dict]:
    """Compile seconds, temp MiB and step times of every form at one depth."""
    block, layers, x = model(args, depth)
    rows, runs = {}, {}
    for form in args.forms:
        step, train_state, batch = build(form, block, layers, x, mesh)
        start = time.perf_counter()
        traced = step.trace(train_state, batch)
        after_trace = time.perf_counter()
        lowered = traced.lower()
        after_lower = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
        rows[form] = {
            "compile_s": end - start,
            "trace_s": after_trace - start,
            "lower_s": after_lower - after_trace,
            "xla_s": end - after_lower,
            "temp_mib": temp,
            "times": [],
        }
        train_state = jax.block_until_ready(compiled(train_state, batch)[0])  # warm-up
        runs[form] = [compiled, train_state, batch]
    for _ in range(args.steps):  # interleaved: other load hits every form alike
        for form, run in runs.items():
            compiled, train_state, batch = run
            start = time.perf_counter()
            run[1] = jax.block_until_ready(compiled(train_state, batch)[0])
            rows[form]["times"].append(time.perf_counter() - start)
    return rows


def table(results: dict[int, dict[str, dict]], forms) -> str:
    names = " / ".join(forms)
    lines = [
        f"| layers | compile s: {names} | temp MiB: {names} | step ms (median): {names} |",
        "|---|---|---|---|",
    ]
    for depth, rows in results.items():
        compile_s = " / ".join(f"{rows[f]['compile_s']:.1f}" for f in forms)
        temp = " / ".join(f"{rows[f]['temp_mib']:.1f}" for f in forms)
        step = " / ".join(
            f"{1e3 * statistics.median(rows[f]['times']):.1f}" if rows[f]["times"] else "-"
            for f in forms
        )
        lines.append(f"| {depth} | {compile_s} | {temp} | {step} |")
    return "\n".join(lines)


def split_table(results: dict[int, dict[str, dict]], forms) -> str:
    """The compile seconds of `table` split into tracing (Python: JAX's transforms and
    funshard's), lowering to StableHLO, and XLA's compilation."""
    lines = ["| layers | form | trace s | lower s | XLA compile s |", "|---|---|---|---|---|"]
    for depth, rows in results.items():
        for f in forms:
            r = rows[f]
            lines.append(
                f"| {depth} | {f} | {r['trace_s']:.2f} | {r['lower_s']:.2f} | {r['xla_s']:.2f} |"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--forms", nargs="+", choices=(*FORMS, UNROLLED), default=list(FORMS))
    parser.add_argument("--width", type=int, default=None, help="256 (mlp), 128 (gpt)")
    parser.add_argument("--batch", type=int, default=None, help="global rows: 64 (mlp), 16 (gpt)")
    parser.add_argument("--seq", type=int, default=64, help="gpt only")
    parser.add_argument("--heads", type=int, default=4, help="gpt only")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per form")
    parser.add_argument("--plot", default=None, help="also draw temp and compile s here (PNG)")
    args = parser.parse_args(argv)
    gpt = args.model == "gpt"
    args.width = args.width or (128 if gpt else 256)
    args.batch = args.batch or (16 if gpt else 64)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    mesh = fs.make_mesh()
    print(
        f"jax {jax.__version__}, {args.model}, width {args.width}, batch {args.batch}, "
        f"{mesh.size} devices",
        flush=True,
    )
    results = {}
    for depth in args.layers:
        results[depth] = measure(args, depth, mesh)
        print(table({depth: results[depth]}, args.forms).splitlines()[-1], flush=True)
    print(table(results, args.forms))
    print(split_table(results, args.forms))
    if args.plot:
        plot(results, args, args.plot)


def plot(results: dict[int, dict[str, dict]], args: argparse.Namespace, path: str) -> None:
    """Temp MiB and compile seconds against the depth, one line per form (log-log)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, key, label in (
        (axes[0], "temp_mib", "temp MiB per device"),
        (axes[1], "compile_s", "compile s (trace included)"),
    ):
        for form in args.forms:
            ax.plot(depths, [results[d][form][key] for d in depths], marker="o", label=form)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_xlabel("layers")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{args.model}, width {args.width}, batch {args.batch}, jax {jax.__version__}, "
        f"8 CPU devices"
    )
    fig.savefig(path, metadata={"Software": None})


if __name__ == "__main__":
    main()
