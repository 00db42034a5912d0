"""FSDP x tensor parallelism: funshard on fsdp=8 and on fsdp=4 x tensor=2 against JAX's
automatic sharding on the same 4x2 mesh, side by side, in ONE run.

Run from the repository root (8 simulated CPU devices):

    python benchmarks/bench_parallel.py                 # 4 Megatron blocks (~3 min, 2 cores)
    python benchmarks/bench_parallel.py --quick         # tiny model, smoke run (~1 min)
    python benchmarks/bench_parallel.py --out par.md    # also write the Markdown report

The model is a GPT-style decoder whose blocks are written as Megatron writes them: Q, K
and V column-parallel (each tensor rank computes its heads), the attention and MLP
out-projections row-parallel (one `psum` over `tensor`), the MLP's first layer
column-parallel, and a vocabulary-parallel head and cross-entropy (each rank holds its
columns of the logits; the softmax's max and sum and the target's logit are combined over
`tensor`). On one device the same functions are the plain model. The variants:

1. funshard fsdp=8: every leaf FSDP-sharded over 8 devices, one `fs.fully_shard` unit
   per block (`reshard_after_forward=True`), the rest gathered by `fs.unshard`.
2. funshard fsdp=4 x tensor=2: the same, with `fs.shard(..., model_spec=...)` splitting
   every block over `tensor` and FSDP-sharding each leaf's model block over `fsdp`; the
   loss runs per device on its model blocks (`fs.column_parallel`, `fs.row_parallel`).
3. funshard fsdp=4 x tensor=2, sequence-parallel: variant 2 with Megatron's sequence
   parallelism (`sequence_axis=1` on the column- and row-parallel linears): the
   residual stream, LayerNorms and the embedding's output are split over `tensor` along
   the sequence, all-gathered before each column-parallel linear and reduce-scattered
   after each row-parallel one.
4. JAX automatic sharding on the same 4x2 mesh: plain `jax.jit` of the plain model, the
   parameters and AdamW state placed with `NamedSharding` as variant 2 splits them
   (column-parallel kernels `P('fsdp', 'tensor')`, row-parallel `P('tensor', 'fsdp')`,
   the rest `P('fsdp')` on dim 0), the batch `P('fsdp')`; XLA's partitioner chooses the
   collectives.

Every step is loss + gradients + an `optax.adamw` update, returning the new state. All
four programs are compiled first; then their steps run interleaved (round r runs step r
of every variant) and the report gives medians, with the ratios against automatic
sharding from this one run. Collectives are read from each compiled program's HLO
(`benchmarks/hlo.py`, with while-loop trip counts) and attributed to the mesh axes their
replica groups span; memory is `compiled.memory_analysis()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import platform
import sys
import time

import fsdp  # noqa: F401  (configures 8 simulated CPU devices before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from fsdp.measure import compile_all, lower, time_steps
from fsdp.report import mib, table
from fsdp.variants import Variant, train_step
from hlo import computations, multiplicities, parse_collectives
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs

TENSOR = "tensor"


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's shape and the global batch."""

    blocks: int = 4
    width: int = 512
    heads: int = 8
    ff: int = 2048
    vocab: int = 4096
    seq: int = 128
    batch: int = 16


# ---- the model --------------------------------------------------------------------------

# Per block: which dim of each leaf tensor parallelism splits (None: replicated over it).
BLOCK_SPEC = {
    "ln1_g": None,
    "ln1_b": None,
    "wq": P(None, TENSOR),
    "wk": P(None, TENSOR),
    "wv": P(None, TENSOR),
    "wo": P(TENSOR, None),
    "wo_b": None,
    "ln2_g": None,
    "ln2_b": None,
    "w_in": P(None, TENSOR),
    "b_in": P(TENSOR),
    "w_out": P(TENSOR, None),
    "b_out": None,
}
ROOT_SPEC = {"embed": None, "pos": None, "lnf_g": None, "lnf_b": None, "head": P(None, TENSOR)}


def model_spec(cfg: Config) -> dict:
    """`fs.shard`'s `model_spec` for the whole parameter tree."""
    return {**ROOT_SPEC, "blocks": [BLOCK_SPEC] * cfg.blocks}


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Full f32 parameters (host numpy, so that building them compiles nothing)."""
    d, f = cfg.width, cfg.ff
    rng = np.random.default_rng(seed)

    def dense(shape, scale=1.0):
        return (rng.standard_normal(shape, np.float32) * scale / math.sqrt(shape[0])).astype(
            np.float32
        )

    out_scale = 1.0 / math.sqrt(2 * cfg.blocks)
    ones, zeros = np.ones(d, np.float32), np.zeros(d, np.float32)
    blocks = [
        {
            "ln1_g": ones,
            "ln1_b": zeros,
            "wq": dense((d, d)),
            "wk": dense((d, d)),
            "wv": dense((d, d)),
            "wo": dense((d, d), out_scale),
            "wo_b": zeros,
            "ln2_g": ones,
            "ln2_b": zeros,
            "w_in": dense((d, f)),
            "b_in": np.zeros(f, np.float32),
            "w_out": dense((f, d), out_scale),
            "b_out": zeros,
        }
        for _ in range(cfg.blocks)
    ]
    return {
        "embed": dense((cfg.vocab, d), 0.02 * math.sqrt(cfg.vocab)),
        "pos": dense((cfg.seq, d), 0.02 * math.sqrt(cfg.seq)),
        "blocks": blocks,
        "lnf_g": ones,
        "lnf_b": zeros,
        "head": dense((d, cfg.vocab)),
    }


def layer_norm(x, g, b):
    """LayerNorm over the last axis (examples/models/jax_gpt.py's, in f32)."""
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def make_block(cfg: Config, tensor: str | None, sequence_parallel: bool = False):
    """`block(p, x)`: one pre-LN block; split over `tensor` per device, or whole (None).
    With `sequence_parallel`, `x` and the output are this rank's block of the sequence."""
    head_dim = cfg.width // cfg.heads
    seq = {"sequence_axis": 1} if sequence_parallel else {}

    def out_proj(h, w, b):
        return fs.row_parallel(h, w, b, axis=tensor, **seq) if tensor else h @ w + b

    def block(p, x):
        b, s = x.shape[0], cfg.seq  # q, k and v cover the whole sequence
        h = layer_norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = (
            fs.column_parallel(h, p[n], **seq).reshape(b, s, -1, head_dim)
            for n in ("wq", "wk", "wv")
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, s, -1)
        x = x + out_proj(o, p["wo"], p["wo_b"])
        h = jax.nn.gelu(
            fs.column_parallel(layer_norm(x, p["ln2_g"], p["ln2_b"]), p["w_in"], p["b_in"], **seq)
        )
        return x + out_proj(h, p["w_out"], p["b_out"])

    return block


def cross_entropy(logits, targets, tensor: str | None):
    """Mean cross-entropy; with `tensor`, of logits split over it by vocabulary columns
    (Megatron's vocabulary-parallel loss: no device holds all the logits)."""
    if not tensor:
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    cols = logits.shape[-1]
    local = targets - jax.lax.axis_index(tensor) * cols
    mine = (local >= 0) & (local < cols)
    top = jax.lax.pmax(jax.lax.stop_gradient(logits.max(-1, keepdims=True)), tensor)
    shifted = logits - top
    total = jax.lax.psum(jnp.exp(shifted).sum(-1), tensor)
    picked = jnp.take_along_axis(shifted, jnp.where(mine, local, 0)[..., None], axis=-1)
    target = jax.lax.psum(jnp.where(mine, picked[..., 0], 0.0), tensor)
    return jnp.mean(jnp.log(total) - target)


def local_sequence(h, tensor: str):
    """This tensor rank's block of the sequence (dim 1) of `h`, replicated over `tensor`."""
    n = h.shape[1] // jax.lax.axis_size(tensor)
    return jax.lax.dynamic_slice_in_dim(h, jax.lax.axis_index(tensor) * n, n, axis=1)


def lm_loss(root, blocks, tokens, apply_block, tensor: str | None, sequence_parallel=False):
    """Mean next-token cross-entropy of `tokens` (rows, seq), in f32. With
    `sequence_parallel`, the blocks and the final LayerNorm run on this rank's block of
    the sequence, and the head gathers it."""
    h = root["embed"][tokens] + root["pos"][None, : tokens.shape[1]]
    seq = {"sequence_axis": 1} if sequence_parallel else {}
    if sequence_parallel:
        h = local_sequence(h, tensor)
    for p in blocks:
        h = apply_block(p, h)
    logits = fs.column_parallel(layer_norm(h, root["lnf_g"], root["lnf_b"]), root["head"], **seq)
    return cross_entropy(logits[:, :-1], tokens[:, 1:], tensor)


def plain_loss(cfg: Config):
    """The whole model on whatever devices JAX places it: `loss(params, tokens)`."""
    block = make_block(cfg, None)

    def loss(params, tokens):
        root = {k: v for k, v in params.items() if k != "blocks"}
        return lm_loss(root, params["blocks"], tokens, block, None)

    return loss


# ---- the variants -----------------------------------------------------------------------


def _mesh(devices, **axes) -> jax.sharding.Mesh:
    shape, names = tuple(axes.values()), tuple(axes)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def funshard_variant(cfg, params, tokens, opt, devices, tensor: int, sequence_parallel=False):
    """(variant, mesh): funshard on fsdp=8 (`tensor=1`) or fsdp=8/tensor x tensor,
    with Megatron's sequence parallelism if `sequence_parallel`."""
    axes = {"fsdp": len(devices) // tensor} | ({TENSOR: tensor} if tensor > 1 else {})
    mesh = _mesh(devices, **axes)
    name = TENSOR if tensor > 1 else None
    state = fs.shard(params, mesh, model_spec=model_spec(cfg) if name else None)
    unit = fs.fully_shard(make_block(cfg, name, sequence_parallel), reshard_after_forward=True)

    def loss(state, tokens):  # per device: its rows, its model blocks
        root = fs.unshard({k: v for k, v in state.items() if k != "blocks"})
        return lm_loss(root, state["blocks"], tokens, unit, name, sequence_parallel)

    step = train_step(fs.value_and_grad(loss), opt)
    opt_state = fs.init_optimizer(opt, state)
    batch = jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))
    label = " x ".join(f"{a}={s}" for a, s in axes.items())
    note = "fully_shard per block; root via fs.unshard"
    if name:
        note += "; model_spec: Megatron column/row-parallel blocks, vocabulary-parallel head"
    if sequence_parallel:
        label += ", sequence-parallel"
        note += "; sequence_axis=1: norms and residuals on 1/tensor of the sequence"
    return Variant(f"funshard {label}", jax.jit(step), (state, opt_state), (batch,), 8, note), mesh


def auto_spec(path, x, fsdp_size: int) -> P:
    """Variant 2's split in plain `NamedSharding` terms: the model axis where the model
    spec puts it, `fsdp` on the first other dim it divides (else none)."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    spec = (ROOT_SPEC if keys[0] != "blocks" else BLOCK_SPEC)[keys[-1]]
    entries = list(spec or ()) + [None] * (x.ndim - len(spec or ()))
    for d in range(x.ndim):
        if entries[d] is None and x.shape[d] % fsdp_size == 0:
            entries[d] = "fsdp"
            break
    return P(*entries)


def auto_variant(cfg, params, tokens, opt, devices, tensor: int):
    """(variant, mesh): JAX's automatic sharding of the plain model on fsdp x tensor."""
    fsdp_size = len(devices) // tensor
    mesh = _mesh(devices, fsdp=fsdp_size, **{TENSOR: tensor})
    specs = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, auto_spec(p, x, fsdp_size)), params
    )
    placed = jax.device_put(params, specs)
    # AdamW's moments are shaped like the parameters: the same split; its count replicated.
    opt_specs = _like_params(jax.eval_shape(opt.init, placed), specs, mesh)
    opt_state = jax.jit(opt.init, out_shardings=opt_specs)(placed)
    batch_sh = NamedSharding(mesh, P("fsdp"))
    step = train_step(jax.value_and_grad(plain_loss(cfg)), opt)
    jitted = jax.jit(
        step,
        in_shardings=((specs, opt_specs), batch_sh),
        out_shardings=((specs, opt_specs), NamedSharding(mesh, P())),
    )
    note = (
        "plain jit of the plain model; params/AdamW column-parallel P('fsdp','tensor'), "
        "row-parallel P('tensor','fsdp'), head P('fsdp','tensor'), rest P('fsdp'); batch P('fsdp')"
    )
    label = f"jax auto-sharding fsdp={fsdp_size} x tensor={tensor}"
    batch = jax.device_put(tokens, batch_sh)
    return Variant(label, jitted, (placed, opt_state), (batch,), 8, note), mesh


def _like_params(opt_shape, specs, mesh):
    """Shardings for an optax state: subtrees shaped like the parameters get theirs."""
    params_def = jax.tree.structure(specs)

    def place(node):
        if jax.tree.structure(node) == params_def:
            return specs
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), node)

    return jax.tree.map(place, opt_shape, is_leaf=lambda n: jax.tree.structure(n) == params_def)


# ---- reading the programs ---------------------------------------------------------------


def axes_of_groups(mesh) -> dict[tuple, str]:
    """Replica groups (as `hlo.Collective.groups` gives them) -> the mesh axes they span."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    names = list(mesh.axis_names)
    out = {}
    for r in range(1, len(names) + 1):
        for axes in itertools.combinations(names, r):
            rest = [names.index(a) for a in names if a not in axes]
            order = rest + [names.index(a) for a in axes]
            size = math.prod(mesh.shape[a] for a in axes)
            rows = np.transpose(ids, order).reshape(-1, size)
            key = tuple(sorted(tuple(sorted(row)) for row in rows.tolist()))
            out[key] = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
    return out


def collectives_by_axes(text: str, mesh) -> dict[tuple[str, str], dict]:
    """(kind, axes) -> executions per step and bytes per device per step (all-gather: the
    output; reduce-scatter: the input; others: the buffer), from compiled HLO text."""
    known = axes_of_groups(mesh)
    comps = computations(text)
    mult, _, _ = multiplicities(comps)
    out: dict[tuple[str, str], dict] = {}
    for name, lines in comps.items():
        for c in parse_collectives(lines):
            groups = c.groups
            if not groups:  # `{}` or none: every device
                axes = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
                size = mesh.devices.size
            else:
                key = tuple(sorted(tuple(sorted(g)) for g in groups))
                axes = known.get(key, f"groups of {len(groups[0])}")
                size = len(groups[0])
            full = c.nbytes * size if c.kind == "reduce-scatter" else c.nbytes
            entry = out.setdefault((c.kind, axes), {"count": 0, "bytes": 0})
            times = mult.get(name, 1)
            entry["count"] += times
            entry["bytes"] += times * full
    return out


def facts(v: Variant, compiled, mesh) -> dict:
    """Memory and collectives of one compiled step."""
    mem = compiled.memory_analysis()
    return {
        "temp": mem.temp_size_in_bytes,
        "arg": mem.argument_size_in_bytes,
        "by_axes": collectives_by_axes(compiled.as_text(), mesh),
    }


# ---- the run ----------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 timed steps")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 7)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    args = parser.parse_args(argv)
    cfg = Config(blocks=2, width=64, heads=4, ff=256, vocab=256, seq=16) if args.quick else Config()
    if args.blocks is not None:
        cfg = dataclasses.replace(cfg, blocks=args.blocks)
    if args.steps is None:
        args.steps = 2 if args.quick else 7
    return args, cfg


def main(argv=None) -> None:
    args, cfg = parse_args(argv)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    devices = jax.devices()[:8]
    params = init_params(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (cfg.batch, cfg.seq), np.int32)
    opt = optax.adamw(1e-3, weight_decay=0.01)
    built = [
        funshard_variant(cfg, params, tokens, opt, devices, 1),
        funshard_variant(cfg, params, tokens, opt, devices, 2),
        funshard_variant(cfg, params, tokens, opt, devices, 2, sequence_parallel=True),
        auto_variant(cfg, params, tokens, opt, devices, 2),
    ]
    variants = [v for v, _ in built]
    compiled = compile_all({v.name: lower(v) for v in variants})
    read = {v.name: facts(v, compiled[v.name][0], mesh) for v, mesh in built}
    timing = time_steps(variants, compiled, args.warmup, args.steps)
    text = report(args, cfg, params, variants, read, timing, compiled, start, load_start)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


def report(args, cfg, params, variants, read, timing, compiled, start, load_start) -> str:
    auto = variants[-1].name
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    lines = [
        f"- date: {time.strftime('%Y-%m-%d')}; machine: `{platform.platform()}`, "
        f"{os.cpu_count()} CPU cores, Python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}",
        "- devices: 8 x cpu (simulated: all share the cores above)",
        f"- command: `python {' '.join(['benchmarks/bench_parallel.py', *sys.argv[1:]])}`",
        f"- model: GPT-style, {cfg.blocks} Megatron blocks, width {cfg.width}, {cfg.heads} heads, "
        f"MLP {cfg.ff}, vocab {cfg.vocab}, seq {cfg.seq}, global batch {cfg.batch}; f32; AdamW; "
        f"{n_params:,} parameters ({mib(4 * n_params)} MiB)",
        f"- timing: median of {args.steps} steps after {args.warmup} warm-up steps, interleaved "
        f"(round r runs step r of every variant); wall time of the run "
        f"{time.perf_counter() - start:.0f} s; 1-minute load average {load_start:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end",
        "",
    ]
    rows = []
    for v in variants:
        t, f = timing[v.name], read[v.name]
        a, fa = timing[auto], read[auto]
        rows.append(
            [
                v.name,
                f"{t['median'] * 1e3:,.1f}",
                f"{t['median'] / a['median']:.2f}",
                mib(f["temp"]),
                f"{f['temp'] / fa['temp']:.2f}",
                mib(f["arg"]),
                f"{compiled[v.name][1]:.1f}",
                f"{t['first_loss']:.4f} -> {t['last_loss']:.4f}",
            ]
        )
    lines += table(
        [
            "variant",
            "median ms",
            "time / auto",
            "temp MiB",
            "temp / auto",
            "arg MiB",
            "compile s",
            "loss first -> last",
        ],
        rows,
    )
    lines += ["Collectives per device per step (count / MiB), by the mesh axes they run over:", ""]
    kinds = sorted({key for v in variants for key in read[v.name]["by_axes"]})
    rows = []
    for v in variants:
        by = read[v.name]["by_axes"]
        row = [v.name]
        for key in kinds:
            e = by.get(key)
            row.append(f"{e['count']} / {mib(e['bytes'])}" if e else "-")
        rows.append(row)
    lines += table(["variant", *[f"{k} over {a}" for k, a in kinds]], rows)
    for v in variants[1:-1]:
        t2 = timing[v.name]["median"] / timing[auto]["median"]
        m2 = read[v.name]["temp"] / read[auto]["temp"]
        lines += [
            f"- {'**PASS**' if t2 <= 1.0 else '**MISS**'} step time: {v.name} / "
            f"{auto} = {t2:.2f} (target <= 1.0)",
            f"- {'**PASS**' if m2 <= 0.5 else '**MISS**'} temp memory: {v.name} / "
            f"{auto} = {m2:.2f} (target <= 0.5)",
        ]
    spread = [
        f"{v.name} {min(t) * 1e3:,.0f}-{max(t) * 1e3:,.0f}"
        for v in variants
        for t in [timing[v.name]["times"]]
    ]
    lines += ["- step time range (ms): " + ", ".join(spread)]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
