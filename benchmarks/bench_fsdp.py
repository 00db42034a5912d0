"""FSDP benchmark: funshard against JAX's own data-parallel forms, side by side, in ONE run.

Run from the repository root (8 simulated CPU devices):

    python benchmarks/bench_fsdp.py                 # default GPT-style model (~15 min, 2 cores)
    python benchmarks/bench_fsdp.py --quick         # tiny model, smoke run (~45 s)
    python benchmarks/bench_fsdp.py --out bench.md  # also write the Markdown report

Every number printed is measured in this run: collectives are read from each variant's
compiled HLO (`jax.jit(step).lower(...).compile().as_text()`), memory from
`compiled.memory_analysis()`, FLOPs from `compiled.cost_analysis()`, per-device state from
the arrays' `addressable_shards`, step times with `jax.block_until_ready`. All programs
are compiled first; then the variants' steps run interleaved (round r runs step r of
every variant), so that other load on the machine hits all variants alike. Besides the
variants, the run compiles (never executes) plain `jax.grad` of one device's batch slice
on one device (its temp bytes are the activation term of the memory target), variant 1
with twice the batch (temp-byte growth with the batch, for comparison) and variant 1 on
1, 2 and 4 devices (scaling table).

The model is a GPT-style decoder: learned token and positional embeddings, pre-LN blocks
(causal multi-head attention, 4x GELU MLP), a final LayerNorm and an untied head; the loss
is the mean next-token cross-entropy in f32. Every step is loss + gradients + an
`optax.adamw` update returning the new parameters and optimizer state. Block parameters
are a Python list of per-block dicts and every matmul is written `x @ w` (the orientation
in which funshard keeps no derived copy of a gathered weight).

Variants (see the `VARIANTS` list after the builders; each is one builder function
`variant_xxx(ctx) -> Variant`, so a new one, e.g. an `fs.scan` form, is one more function
appended to that list):

1. funshard, one `fs.fully_shard` unit per block, `reshard_after_forward=True`.
2. the same with `reshard_after_forward=False`.
3. JAX automatic sharding ("FSDP by annotation"): plain `jax.jit`, parameters and Adam
   state `P('fsdp')` on dim 0 where 8 divides it (else replicated), batch `P('fsdp')`.
4. replicated data parallel: `jax.shard_map`, parameters replicated, gradients `pmean`.
5. single device: plain `jax.jit` on `jax.devices()[0]`, the whole batch.
6. communication-free floor: ONE device runs what one FSDP device computes, with every
   collective removed (see `variant_floor`).
7. collectives only: the all-gathers / reduce-scatters of variant 1 and nothing else
   (see `variant_collectives_only`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from typing import Any, Callable

# 8 simulated CPU devices; both settings must happen before JAX initialises a backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

NUM_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import funshard as fs  # noqa: E402

MIB = 1024 * 1024
AXIS = "fsdp"
ROOT_KEYS = ("embed", "pos", "lnf_g", "lnf_b", "head")
BASELINE = "funshard reshard=True"
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    blocks: int = 8
    width: int = 512
    heads: int = 8
    vocab: int = 4096
    seq: int = 128
    batch: int = 16
    mlp: int = 4

    @property
    def ff(self) -> int:
        return self.mlp * self.width


def init_params(cfg: Config, seed: int = 0) -> dict:
    """Full f32 parameters (host numpy): root leaves plus a Python list of per-block dicts.

    Drawn with numpy, so that building them compiles nothing."""
    d, f, v, t = cfg.width, cfg.ff, cfg.vocab, cfg.seq
    rng = np.random.default_rng(seed)

    def normal(shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)

    def dense(shape, scale=1.0):
        return normal(shape, scale / math.sqrt(shape[0]))

    def ones(k):
        return np.ones((k,), np.float32)

    def zeros(k):
        return np.zeros((k,), np.float32)

    out_scale = 1.0 / math.sqrt(2 * cfg.blocks)
    blocks = [
        {
            "ln1_g": ones(d), "ln1_b": zeros(d),
            "qkv": dense((d, 3 * d)), "qkv_b": zeros(3 * d),
            "proj": dense((d, d), out_scale), "proj_b": zeros(d),
            "ln2_g": ones(d), "ln2_b": zeros(d),
            "ff1": dense((d, f)), "ff1_b": zeros(f),
            "ff2": dense((f, d), out_scale), "ff2_b": zeros(d),
        }
        for _ in range(cfg.blocks)
    ]
    return {
        "embed": normal((v, d), 0.02),
        "pos": normal((t, d), 0.02),
        "blocks": blocks,
        "lnf_g": ones(d), "lnf_b": zeros(d),
        "head": dense((d, v)),
    }


def layer_norm(x, g, b):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g + b


def make_block(heads: int) -> Callable:
    """`block(p, h)`: one pre-LN transformer block, every matmul as `x @ w`."""

    def block(p, h):
        b, t, d = h.shape
        hd = d // heads
        x = layer_norm(h, p["ln1_g"], p["ln1_b"])
        q, k, v = jnp.split(x @ p["qkv"] + p["qkv_b"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, hd) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(v.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d)
        h = h + o @ p["proj"] + p["proj_b"]
        x = layer_norm(h, p["ln2_g"], p["ln2_b"])
        return h + jax.nn.gelu(x @ p["ff1"] + p["ff1_b"]) @ p["ff2"] + p["ff2_b"]

    return block


def lm_loss(root: dict, blocks, tokens, apply_block: Callable) -> jax.Array:
    """Mean next-token cross-entropy (f32) of `tokens` (rows, seq)."""
    t = tokens.shape[1]
    h = root["embed"][tokens] + root["pos"][None, :t]
    for p in blocks:
        h = apply_block(p, h)
    logits = layer_norm(h, root["lnf_g"], root["lnf_b"]) @ root["head"]
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def root_of(params: dict) -> dict:
    return {k: params[k] for k in ROOT_KEYS}


def model_loss(cfg: Config) -> Callable:
    block = make_block(cfg.heads)
    return lambda params, tokens: lm_loss(root_of(params), params["blocks"], tokens, block)


# --------------------------------------------------------------------------------------
# Reading the compiled program
# --------------------------------------------------------------------------------------

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPCODE = re.compile(r"\s(" + "|".join(KINDS) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")


def _dtype_bytes(dtype: str) -> int:
    if dtype == "pred" or dtype.startswith(("f8", "f4", "s4", "u4")):
        return 1
    bits = re.search(r"(\d+)$", dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 4


def _array_bytes(arrays) -> int:
    total = 0
    for dtype, dims in arrays:
        total += math.prod(int(x) for x in dims.split(",") if x) * _dtype_bytes(dtype)
    return total


def _computations(text: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = [current]
        elif line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _multiplicities(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str], dict]:
    """How many times each computation runs per step (while bodies x known trip count).

    Returns (multiplicity by computation, the computations reached through a
    `conditional` branch, facts): a branch is counted as running every time its caller
    runs, an upper bound (fs.scan's prefetch gathers sit in such branches). facts:
    `while` (the program has a while loop), `unknown_trip` (some while loop had no known
    trip count; its body is counted once).
    """
    entry = comps.get("__entry__", [None])[0]
    calls: dict[str, list[tuple[str, int, bool]]] = {}
    facts = {"while": False, "unknown_trip": False}
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        for line in lines:
            trip = 1
            if " while(" in line:
                facts["while"] = True
                m = _TRIP.search(line)
                if m:
                    trip = int(m.group(1))
                else:
                    facts["unknown_trip"] = True
            for role, callee in _CALLEE.findall(line):
                branch = role in ("true_computation", "false_computation")
                calls.setdefault(name, []).append(
                    (callee, trip if role == "body" else 1, branch))
            for group in _BRANCHES.findall(line):
                for callee in group.split(","):
                    calls.setdefault(name, []).append((callee.strip().lstrip("%"), 1, True))
    mult: dict[str, int] = {}
    conditional: set[str] = set()

    def visit(name: str, times: int, in_branch: bool, depth: int = 0) -> None:
        if depth > 64:
            return
        mult[name] = mult.get(name, 0) + times
        if in_branch:
            conditional.add(name)
        for callee, trip, branch in calls.get(name, []):
            visit(callee, times * trip, in_branch or branch, depth + 1)

    if entry is not None:
        visit(entry, 1, False)
    return mult, conditional, facts


def collectives(text: str, num_devices: int) -> tuple[list[dict], dict]:
    """Every collective executed by one step, per device, from compiled HLO text.

    Each op: kind, dtypes, `times` it runs per step (ops inside a while body count
    trip-count times), `conditional` (inside a conditional branch: `times` is then an
    upper bound), group size G, `bytes` and `moved` (both per execution):

    * all-gather: `bytes` = the OUTPUT (gathered, full) buffer.
    * reduce-scatter: `bytes` = the INPUT (full, pre-scatter) buffer = output x G.
    * all-reduce, all-to-all, collective-permute: `bytes` = the buffer (output) size.
      XLA CPU combines all-reduces into tuple-shaped ops: all parts are summed.
    * `moved`: bytes one device sends in a ring implementation: (G-1)/G x full buffer for
      all-gather, reduce-scatter and all-to-all, 2(G-1)/G x buffer for all-reduce, the
      buffer for collective-permute.

    Async `-start` forms are counted once (their `-done` halves are skipped). Returns
    (ops, facts about loops; see `_multiplicities`).
    """
    comps = _computations(text)
    mult, conditional, facts = _multiplicities(comps)
    ops = []
    for name, lines in comps.items():
        if name == "__entry__":
            continue
        times = mult.get(name, 1)
        for line in lines:
            if " = " not in line:
                continue
            rhs = line.split(" = ", 1)[1]
            m = _OPCODE.search(" " + rhs)
            if not m:
                continue
            kind, start = m.group(1), bool(m.group(2))
            arrays = _ARRAY.findall(rhs[: m.start()])
            if start and kind == "all-gather":  # ((operands...), (outputs...)) or (in, out)
                arrays = arrays[len(arrays) // 2:]
            elif start and kind == "collective-permute":  # (in, out, u32[], u32[])
                arrays = arrays[1:2]
            g = _group_size(rhs, num_devices)
            out = _array_bytes(arrays)
            full = out * g if kind == "reduce-scatter" else out
            factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(
                kind, (g - 1) / g
            )
            ops.append({
                "kind": kind, "dtypes": sorted({a[0] for a in arrays}), "times": times,
                "conditional": name in conditional, "group": g, "bytes": full,
                "moved": factor * full,
            })
    return ops, facts


def _group_size(rhs: str, default: int) -> int:
    m = _GROUPS_LIST.search(rhs)
    if m:
        return max(1, len([x for x in m.group(1).split(",") if x]))
    m = _GROUPS_IOTA.search(rhs)
    if m:
        return int(m.group(2))
    return default


def summarize(ops: list[dict]) -> dict:
    by_kind = {
        k: {"count": 0, "bytes": 0.0, "moved": 0.0, "dtypes": set(), "upper": False}
        for k in KINDS
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
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float((cost or {}).get("flops", float("nan")))


def bytes_on(tree: Any, device) -> int:
    """Bytes of `tree`'s arrays that live on `device` (its addressable shards there)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == device)
    return total


# --------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What every variant builder gets: the config, the host-side full parameters and batch."""

    cfg: Config
    params: dict  # full f32 parameters (numpy, host)
    tokens: np.ndarray  # (batch, seq) int32, the global batch
    devices: list
    opt: optax.GradientTransformation


@dataclasses.dataclass
class Variant:
    """One jitted train step `step(state, *const) -> (new_state, loss)`.

    `state` (parameters + optimizer state, or the buffers for collectives-only) is fed
    back each step; `const` (the batch, ...) is not.
    """

    name: str
    step: Callable
    state: Any
    const: tuple
    devices: int
    note: str = ""
    has_loss: bool = True  # False: the step's scalar output is not a training loss


def funshard_train_step(loss_fn: Callable, opt) -> Callable:
    """`step((state, opt_state), tokens)` for a per-device funshard loss."""

    def step(train_state, tokens):
        state, opt_state = train_state
        loss, grads = fs.value_and_grad(loss_fn)(state, tokens)
        updates, opt_state = opt.update(grads, opt_state, state)
        return (optax.apply_updates(state, updates), opt_state), loss

    return step


def fs_mesh(devices) -> Any:
    return fs.make_mesh(devices=devices)


def _funshard(ctx: Context, reshard_after_forward: bool) -> Variant:
    """funshard on `ctx.devices`: one `fs.fully_shard` unit per block, the root's
    parameters (embeddings, final LayerNorm, head) gathered by `fs.unshard`."""
    devices = ctx.devices
    mesh = fs_mesh(devices)
    unit = fs.fully_shard(make_block(ctx.cfg.heads), reshard_after_forward=reshard_after_forward)

    def loss_fn(state, tokens):  # per device, on its local batch slice
        root = fs.unshard(root_of(state))
        return lm_loss(root, state["blocks"], tokens, unit)

    opt = ctx.opt
    step = funshard_train_step(loss_fn, opt)
    state = fs.shard(ctx.params, mesh)
    opt_state = opt.init(state)
    tokens = jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS)))
    return Variant(
        f"funshard reshard={reshard_after_forward}", jax.jit(step), (state, opt_state),
        (tokens,), len(devices),
        "fully_shard per block; root (embed, pos, final LN, head) via fs.unshard",
    )


def variant_funshard_reshard(ctx: Context) -> Variant:
    return _funshard(ctx, True)


def variant_funshard_keep(ctx: Context) -> Variant:
    return _funshard(ctx, False)


def variant_auto(ctx: Context) -> Variant:
    mesh = jax.make_mesh(
        (len(ctx.devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
        devices=ctx.devices,
    )
    n = len(ctx.devices)

    def sharding(x):
        split = getattr(x, "ndim", 0) >= 1 and x.shape[0] % n == 0
        return NamedSharding(mesh, P(AXIS) if split else P())

    loss = model_loss(ctx.cfg)
    opt = ctx.opt
    params = jax.device_put(ctx.params, jax.tree.map(sharding, ctx.params))
    opt_state = opt.init(params)
    opt_state = jax.device_put(opt_state, jax.tree.map(sharding, opt_state))
    state_sh = jax.tree.map(sharding, (params, opt_state))
    batch_sh = NamedSharding(mesh, P(AXIS))

    def step(train_state, tokens):
        params, opt_state = train_state
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    jitted = jax.jit(
        step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, NamedSharding(mesh, P()))
    )
    return Variant(
        "jax auto-sharding", jitted, (params, opt_state),
        (jax.device_put(ctx.tokens, batch_sh),), n,
        "plain jit; params/Adam P('fsdp') on dim 0 where divisible, else replicated",
    )


def variant_data_parallel(ctx: Context) -> Variant:
    mesh = jax.make_mesh(
        (len(ctx.devices),), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
        devices=ctx.devices,
    )
    loss = model_loss(ctx.cfg)
    opt = ctx.opt

    def body(params, opt_state, tokens):
        local = jax.tree.map(lambda x: jax.lax.pcast(x, (AXIS,), to="varying"), params)
        value, grads = jax.value_and_grad(loss)(local, tokens)
        grads = jax.lax.pmean(grads, AXIS)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), jax.lax.pmean(value, AXIS)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=((P(), P()), P())
    )

    def step(train_state, tokens):
        return mapped(*train_state, tokens)

    replicated = NamedSharding(mesh, P())
    params = jax.device_put(ctx.params, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    return Variant(
        "replicated DP", jax.jit(step), (params, opt_state),
        (jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS))),), len(ctx.devices),
        "shard_map, params P(), grads pmean, replicated AdamW",
    )


def variant_single(ctx: Context) -> Variant:
    device = ctx.devices[0]
    loss = model_loss(ctx.cfg)
    opt = ctx.opt

    def step(train_state, tokens):
        params, opt_state = train_state
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    params = jax.device_put(ctx.params, device)
    opt_state = jax.device_put(opt.init(params), device)
    return Variant(
        "single device", jax.jit(step), (params, opt_state),
        (jax.device_put(ctx.tokens, device),), 1, "plain jit on devices[0], whole batch",
    )


def _rows(x, n: int) -> int:
    return -(-x.shape[0] // n)


def variant_floor(ctx: Context) -> Variant:
    """What ONE FSDP device computes, on one device, with every collective removed.

    Forward + backward on the local batch slice (global batch / N rows) with the full,
    unsharded parameters as inputs (the gathers' results, for free). Each full-size
    gradient is then reduced to its 1/N shard locally: zero-padded to N * ceil(dim0/N)
    rows and summed over its N row chunks, the arithmetic a reduce-scatter does, without
    communication (a bare slice would let XLA skip part of the gradient computation).
    AdamW then updates 1/N of the parameters (the first ceil(dim0/N) rows of each leaf)
    and its state. The full parameters are constant inputs; only the shards train.
    """
    n = len(ctx.devices)
    device = ctx.devices[0]
    loss = model_loss(ctx.cfg)
    opt = ctx.opt

    def scatter_locally(g):
        rows = _rows(g, n)
        g = jnp.pad(g, [(0, n * rows - g.shape[0])] + [(0, 0)] * (g.ndim - 1))
        return g.reshape(n, rows, *g.shape[1:]).sum(0) / n

    def step(train_state, full, tokens):
        shards, opt_state = train_state
        value, grads = jax.value_and_grad(loss)(full, tokens)
        grads = jax.tree.map(scatter_locally, grads)
        updates, opt_state = opt.update(grads, opt_state, shards)
        return (optax.apply_updates(shards, updates), opt_state), value

    full = jax.device_put(ctx.params, device)
    shards = jax.device_put(jax.tree.map(lambda x: x[: _rows(x, n)], ctx.params), device)
    opt_state = jax.device_put(opt.init(shards), device)
    local = ctx.tokens[: ctx.tokens.shape[0] // n]
    return Variant(
        "comm-free floor (1 device)", jax.jit(step), (shards, opt_state),
        (full, jax.device_put(local, device)), 1,
        f"one device's work: batch/{n} rows, full params, grads summed over row chunks, "
        f"AdamW on 1/{n}",
    )


def unit_local_elements(ctx: Context, n: int) -> list[int]:
    """Elements of each FSDP unit's local shard buffer (root first, then each block)."""

    def local(tree):
        return sum(_rows(x, n) * math.prod(x.shape[1:]) for x in jax.tree.leaves(tree))

    return [local(root_of(ctx.params))] + [local(b) for b in ctx.params["blocks"]]


def variant_collectives_only(ctx: Context) -> Variant:
    """Only the communication of variant 1: for each unit, its f32 shard buffer of the
    same size funshard gathers is all-gathered (twice for each block: forward and the
    backward re-gather; once for the root), then a same-size full buffer is
    reduce-scattered; plus the scalar all-reduce of the loss. Each second gather is tied
    to the first one's result so XLA cannot merge them (as funshard does)."""
    n = len(ctx.devices)
    mesh = fs_mesh(ctx.devices)
    sizes = unit_local_elements(ctx, n)

    def body(buffers):
        out = []
        for u, buf in enumerate(buffers):
            full = jax.lax.all_gather(buf, AXIS, axis=0, tiled=True)
            if u > 0:  # blocks: reshard_after_forward=True gathers again for backward
                again = jnp.where(full[0] == full[0], buf, jnp.zeros_like(buf))
                full = jax.lax.all_gather(again, AXIS, axis=0, tiled=True)
            out.append(jax.lax.psum_scatter(full, AXIS, scatter_dimension=0, tiled=True) / n)
        return out, jax.lax.psum(buffers[0][0], AXIS)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=([P(AXIS)] * len(sizes),),
        out_specs=([P(AXIS)] * len(sizes), P()),
    )
    sharding = NamedSharding(mesh, P(AXIS))
    buffers = [
        jax.device_put(np.full((n * s,), 0.5, np.float32), sharding) for s in sizes
    ]
    return Variant(
        "collectives only", jax.jit(mapped), buffers, (), n,
        "variant 1's AG/RS byte counts (f32), no compute", has_loss=False,
    )


def variant_funshard_scan(ctx: Context) -> Variant:
    """funshard with the blocks stacked on a layer axis and run by `fs.scan` (prefetching
    each layer's gather inside the loop); the root as in variant 1."""
    mesh = fs_mesh(ctx.devices)
    block = make_block(ctx.cfg.heads)

    def loss_fn(state, tokens):  # per device, on its local batch slice
        root = fs.unshard(state["root"])
        return lm_loss(root, [state["blocks"]], tokens,
                       lambda stack, h: fs.scan(block, stack, h))

    opt = ctx.opt
    step = funshard_train_step(loss_fn, opt)
    stacked = {k: np.stack([b[k] for b in ctx.params["blocks"]]) for k in ctx.params["blocks"][0]}
    state = {
        "root": fs.shard(root_of(ctx.params), mesh),
        "blocks": fs.shard(stacked, mesh, stacked=True),
    }
    opt_state = opt.init(state)
    tokens = jax.device_put(ctx.tokens, NamedSharding(mesh, P(AXIS)))
    return Variant(
        "funshard fs.scan", jax.jit(step), (state, opt_state), (tokens,), len(ctx.devices),
        "blocks stacked, fs.scan (reshard_after_forward=True, prefetch in the loop); root "
        "via fs.unshard",
    )


# Add a variant by writing one builder `variant_xxx(ctx) -> Variant` and listing it here.
VARIANTS: list[Callable[[Context], Variant]] = [
    variant_funshard_reshard,
    variant_funshard_keep,
    variant_funshard_scan,
    variant_auto,
    variant_data_parallel,
    variant_single,
    variant_floor,
    variant_collectives_only,
]


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def lower(v: Variant):
    return v.step.lower(v.state, *v.const)


def compile_all(lowered: dict[str, Any]) -> dict[str, tuple[Any, float]]:
    """Compiles every lowered program, one after another (compiling two at once on this
    machine was slower). Returns name -> (executable, seconds its compile took)."""
    out = {}
    for name, low in lowered.items():
        t0 = time.perf_counter()
        exe = low.compile()
        out[name] = (exe, time.perf_counter() - t0)
        log(f"compiled {name} ({out[name][1]:.1f} s)")
    return out


def static_facts(v: Variant, compiled) -> dict:
    """Everything read from the compiled program and the placed state (no execution)."""
    ops, loops = collectives(compiled.as_text(), v.devices)
    mem = compiled.memory_analysis()
    return {
        "name": v.name, "note": v.note, "devices": v.devices, "has_loss": v.has_loss,
        "ops": ops, "by_kind": summarize(ops), "unknown_trip": loops["unknown_trip"],
        "while": loops["while"],
        "arg": mem.argument_size_in_bytes, "out": mem.output_size_in_bytes,
        "temp": mem.temp_size_in_bytes, "flops": flops_of(compiled),
        "state_bytes": bytes_on(v.state, jax.devices()[0]),
    }


def time_steps(variants: list[Variant], compiled: dict, warmup: int, steps: int) -> dict:
    """Runs `warmup` untimed then `steps` timed steps of every variant, INTERLEAVED: round
    r runs step r of each variant in turn, so that a change in the machine's load during
    the run hits all variants alike. Each step is fed the previous step's state and
    waited for with `jax.block_until_ready`. Returns name -> timing and losses."""
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
        log(f"round {i + 1}/{warmup + steps} ({kind}): " + ", ".join(
            f"{v.name} {elapsed_of(out, v.name, i, warmup)}"
            for v in variants))
    for r in out.values():
        times, losses = r["times"], r["losses"]
        r.update(
            median=statistics.median(times) if times else float("nan"),
            first_loss=losses[0] if losses else float("nan"),
            last_loss=losses[-1] if losses else float("nan"),
        )
    return out


def elapsed_of(out: dict, name: str, i: int, warmup: int) -> str:
    times = out[name]["times"]
    return f"{times[-1] * 1e3:,.0f} ms" if i >= warmup and times else "done"


def plain_grad_program(ctx: Context):
    """Plain JAX's forward+backward for ONE device's local batch (global/N rows) on one
    device, parameters as arguments and gradients as outputs: its temp bytes are what XLA
    keeps besides parameters and gradients when nothing is sharded (the activation term
    of the memory target)."""
    n = len(ctx.devices)
    device = ctx.devices[0]
    grad = jax.jit(jax.grad(model_loss(ctx.cfg)))
    params = jax.device_put(ctx.params, device)
    local = jax.device_put(ctx.tokens[: ctx.tokens.shape[0] // n], device)
    return grad.lower(params, local)


def double_batch_variant(ctx: Context) -> Variant:
    """Variant 1 with every device's batch slice doubled. temp(this) - temp(variant 1) is
    how the temp bytes grow with the batch: activations grow with the rows, parameter,
    gradient and optimizer buffers do not (but XLA's schedule changes too, so this is
    not a clean activation measure; the memory target uses `plain_grad_program`)."""
    double = dataclasses.replace(ctx, tokens=np.concatenate([ctx.tokens, ctx.tokens]))
    v = _funshard(double, True)
    v.name = "activation probe: funshard reshard=True, 2x batch"
    return v


def scaling_variants(ctx: Context, counts: list[int]) -> list[Variant]:
    """funshard (reshard_after_forward=True) on the first N devices, for each N."""
    out = []
    for n in counts:
        v = _funshard(dataclasses.replace(ctx, devices=ctx.devices[:n]), True)
        v.name = f"scaling N={n}"
        out.append(v)
    return out


def scaling_row(ctx: Context, facts: dict) -> dict:
    n = facts["devices"]
    return {
        "n": n, "state_bytes": facts["state_bytes"], "ag": facts["by_kind"]["all-gather"],
        "rs": facts["by_kind"]["reduce-scatter"], "temp": facts["temp"],
        "ideal_comm": ideal_comm(ctx, n, True),
    }


def gathered_unit_bytes(ctx: Context, n: int) -> list[int]:
    """Bytes of each unit's gathered (padded, full) f32 buffer: root first, then blocks."""
    return [n * e * 4 for e in unit_local_elements(ctx, n)]


def ideal_comm(ctx: Context, n: int, reshard: bool) -> float:
    """AG+RS bytes one device moves (ring) in the schedule the step asks for: the root
    (fs.unshard, kept through backward) is gathered once and reduce-scattered once; each
    block 2 gathers + 1 reduce-scatter with reshard_after_forward=True, else 1 + 1."""
    units = gathered_unit_bytes(ctx, n)
    per_block = 3 if reshard else 2
    return (n - 1) / n * (2 * units[0] + per_block * sum(units[1:]))


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def bound(summary: dict) -> str:
    """'≤ ' when a collective total is an upper bound (see `collectives`)."""
    return "≤ " if summary["upper"] else ""


def mib(x: float) -> str:
    return f"{x / MIB:,.2f}"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def report(args, cfg: Config, ctx: Context, results: list[dict], scale: list[dict],
           act: dict, wall: float) -> str:
    n = len(ctx.devices)
    by_name = {r["name"]: r for r in results}
    base = by_name.get(BASELINE)
    param_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(ctx.params))
    param_count = sum(int(x.size) for x in jax.tree.leaves(ctx.params))
    units = gathered_unit_bytes(ctx, n)
    block_bytes = max(units[1:]) if len(units) > 1 else 0
    largest = max(units)
    lines = [
        "# funshard FSDP benchmark",
        "",
        f"- machine: `{platform.platform()}`, {os.cpu_count()} CPU cores, "
        f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"optax {optax.__version__}",
        f"- devices: {len(jax.devices())} x {jax.devices()[0].platform} "
        f"(simulated: all share the cores above)",
        f"- command: `python {shlex.join(sys.argv)}`",
        f"- model: GPT-style, {cfg.blocks} blocks, width {cfg.width}, {cfg.heads} heads, "
        f"MLP {cfg.mlp}x, vocab {cfg.vocab}, seq {cfg.seq}, global batch {cfg.batch} "
        f"({cfg.batch // n} rows per device); untied head; f32; AdamW",
        f"- parameters: {param_count:,} ({param_bytes:,} bytes = {mib(param_bytes)} MiB); "
        f"one block {mib(block_bytes)} MiB, root unit (embed, pos, final LN, head) "
        f"{mib(units[0])} MiB; largest unit gathered: {mib(largest)} MiB",
        f"- timing: median of {args.steps} steps after {args.warmup} warm-up steps, the "
        "variants' steps interleaved (round r runs step r of every variant); "
        f"total wall time of the run {wall:.0f} s; 1-minute load average "
        f"{args.load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end "
        "(this run adds about 1-2; more means other processes shared the cores)",
        "",
        "## Collectives per device per step (compiled HLO)",
        "",
        "count / MiB per kind. Bytes convention: all-gather = output (gathered) buffer; "
        "reduce-scatter = input (full, pre-scatter) buffer; all-reduce, all-to-all, "
        "collective-permute = buffer size (combined tuple all-reduces: all parts). "
        "`AG+RS moved` = sum of (N-1)/N x full buffer over all-gathers and "
        "reduce-scatters (ring); `all moved` adds 2(N-1)/N x buffer per all-reduce, "
        "(N-1)/N per all-to-all and the buffer per collective-permute.",
        "",
    ]
    rows = []
    for r in results:
        k = r["by_kind"]
        dtypes = sorted(set().union(*(s["dtypes"] for s in k.values())))
        cells = [r["name"], str(r["devices"])]
        cells += [f"{bound(k[x])}{k[x]['count']} / {mib(k[x]['bytes'])}" if k[x]["count"]
                  else "-" for x in KINDS]
        ag_rs = k["all-gather"]["moved"] + k["reduce-scatter"]["moved"]
        total = sum(s["moved"] for s in k.values())
        ag_rs_bound = bound(k["all-gather"]) or bound(k["reduce-scatter"])
        total_bound = "≤ " if any(s["upper"] for s in k.values()) else ""
        cells += [", ".join(dtypes) or "-", ag_rs_bound + mib(ag_rs), total_bound + mib(total)]
        rows.append(cells)
    lines += table(
        ["variant", "dev", "all-gather", "reduce-scatter", "all-reduce", "all-to-all",
         "coll-permute", "dtypes", "AG+RS moved MiB", "all moved MiB"], rows)
    if any(s["upper"] for r in results for s in r["by_kind"].values()):
        lines += ["≤: an upper bound. Collectives inside a `conditional` branch (e.g. "
                  "fs.scan's prefetch gathers, whose branch need not run on every "
                  "iteration) are counted as if it ran on every loop iteration; collectives "
                  "in while-loop bodies are counted trip-count times.", ""]
    if any(r["unknown_trip"] for r in results):
        lines += ["Note: some while loop had no known trip count; its body counted once.", ""]

    lines += ["## Memory, FLOPs and step time (per device)", "",
              "argument / output / temp: `compiled.memory_analysis()`; state: parameters + "
              "optimizer state (or buffers) held on device 0, from `addressable_shards`; "
              "GFLOP: `cost_analysis()['flops']` of one device's program; compile s: "
              "wall time of `.compile()`.", ""]
    rows = []
    for r in results:
        ratio = r["median"] / base["median"] if base else float("nan")
        rows.append([
            r["name"], mib(r["arg"]), mib(r["out"]), mib(r["temp"]), mib(r["state_bytes"]),
            f"{r['flops'] / 1e9:,.2f}" + ("*" if r["while"] else ""),
            f"{r['compile_s']:.1f}", f"{r['median'] * 1e3:,.1f}",
            f"{min(r['times']) * 1e3:,.1f}" if r["times"] else "-",
            f"{ratio:.2f}",
            f"{r['first_loss']:.4f} -> {r['last_loss']:.4f}" if r["has_loss"] else "-",
        ])
    lines += table(
        ["variant", "arg MiB", "out MiB", "temp MiB", "state MiB", "GFLOP", "compile s",
         "median ms", "min ms", "time / funshard", "loss first -> last"], rows)
    if any(r["while"] for r in results):
        lines += ["*: the program has a while loop, and XLA's cost analysis counts a loop "
                  "body once, not once per iteration: these FLOPs are too low.", ""]
    lines += ["Variant notes:", ""]
    lines += [f"- **{r['name']}**: {r['note']}" for r in results]
    lines += [
        "",
        f"Reading the times: the {n} simulated devices run concurrently on the same "
        f"{os.cpu_count()} cores and a collective is a memory copy on those cores, so a "
        "multi-device step costs roughly the sum of all devices' work. The floor is ONE "
        "device's share run alone on one device (XLA may spread it over all cores); "
        f"{n} x floor is what the {n} devices' compute costs run one after another, which "
        "the concurrent device programs can beat, so on CPU it is a yardstick, not a "
        "lower bound. Replicated DP does the same per-device FLOPs with one full-size "
        "all-reduce in place of funshard's gathers and reduce-scatters, which "
        "collectives-only times alone. On a real accelerator each device has its own "
        "compute, so bytes moved, memory and FLOPs are the portable numbers here, not "
        "CPU step times. The floor's loss is that of its 1/N batch slice and stays flat: "
        "it trains only its shards.",
        "",
    ]
    floor = next((r for r in results if r["name"].startswith("comm-free")), None)
    if floor:
        lines += [f"Floor: {floor['median'] * 1e3:,.1f} ms; {n} x floor = "
                  f"{n * floor['median'] * 1e3:,.1f} ms.", ""]

    lines += ["## Scaling: funshard reshard_after_forward=True on N devices", "",
              "state = parameters + AdamW state on device 0 (ideal 3 x params / N); AG/RS "
              "from the compiled HLO (full-buffer bytes, the same at every N), moved = "
              "(N-1)/N x full buffer; ideal as in the targets below.", ""]
    rows = []
    for s in scale:
        ideal_state = 3 * param_bytes / s["n"]
        moved = s["ag"]["moved"] + s["rs"]["moved"]
        rows.append([
            str(s["n"]), mib(s["state_bytes"]), mib(ideal_state),
            f"{s['state_bytes'] / ideal_state:.3f}",
            f"{s['ag']['count']} / {mib(s['ag']['bytes'])}",
            f"{s['rs']['count']} / {mib(s['rs']['bytes'])}",
            mib(moved), mib(s["ideal_comm"]), mib(s["temp"]),
        ])
    lines += table(["N", "state MiB", "ideal MiB", "ratio", "AG count / MiB",
                    "RS count / MiB", "AG+RS moved MiB", "ideal moved MiB", "temp MiB"], rows)

    lines += ["## Targets", ""]
    lines += targets(ctx, by_name, param_bytes, units, act, n)
    return "\n".join(lines)


def targets(ctx, by_name, param_bytes, units, act, n) -> list[str]:
    out = []

    def check(label: str, ok: bool, detail: str) -> None:
        out.append(f"- **{'PASS' if ok else 'MISS'}** {label}: {detail}")

    t, f = by_name.get(BASELINE), by_name.get("funshard reshard=False")
    auto = by_name.get("jax auto-sharding")
    largest = max(units)
    if t and act.get("plain") is not None:
        a = act["plain"]
        bound = a + 4 * largest
        rest = t["temp"] - a
        rows = ctx.cfg.batch // n
        check("memory", t["temp"] <= bound,
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
              + (f"; temp(True, {2 * rows} rows per device) - temp(True) = "
                 f"{act['slope']:,} B (growth with the batch; XLA's schedule changes "
                 "with it, so this is not a clean activation measure)"
                 if act.get("slope") is not None else "")
              + ".")
        for name, reshard in ((BASELINE, True), ("funshard reshard=False", False)):
            r = by_name.get(name)
            if not r:
                continue
            k = r["by_kind"]
            moved = k["all-gather"]["moved"] + k["reduce-scatter"]["moved"]
            ideal = ideal_comm(ctx, n, reshard)
            naive = (3 if reshard else 2) * (n - 1) / n * param_bytes
            check(f"comm bytes ({name})", abs(moved - ideal) <= 0.02 * ideal,
                  f"AG+RS moved/device {moved:,.0f} B vs ideal {ideal:,.0f} B "
                  f"({moved / ideal - 1:+.2%}); ideal = (N-1)/N x (2 x root unit + "
                  f"{3 if reshard else 2} x each block), since the root is gathered once. "
                  f"For reference {3 if reshard else 2}(N-1)/N x params = {naive:,.0f} B "
                  f"({moved / naive - 1:+.2%}). {k['all-gather']['count']} all-gathers, "
                  f"{k['reduce-scatter']['count']} reduce-scatters.")
        ideal_state = 3 * param_bytes / n
        check("per-device state", t["state_bytes"] <= 1.05 * ideal_state,
              f"params + AdamW state on device 0 = {t['state_bytes']:,} B <= 1.05 x "
              f"3 x {param_bytes:,} / {n} = {1.05 * ideal_state:,.0f} B "
              f"(ratio {t['state_bytes'] / ideal_state:.4f})")
    if t and f:
        check("FLOPs", abs(t["flops"] - f["flops"]) <= 0.02 * f["flops"],
              f"FLOPs(True) = {t['flops']:,.0f} vs FLOPs(False) = {f['flops']:,.0f} "
              f"({t['flops'] / f['flops'] - 1:+.2%}; within 2%)")
    if t and auto:
        ratio = t["median"] / auto["median"]
        best = min(t["times"]) / min(auto["times"]) if t["times"] and auto["times"] else 0
        check("speed vs automatic sharding", ratio <= 1.0,
              f"funshard {t['median'] * 1e3:,.1f} ms / auto-sharding "
              f"{auto['median'] * 1e3:,.1f} ms = {ratio:.2f} median over median (target "
              f"<= 1.00); fastest over fastest step {best:.2f}. CPU-simulated devices, see "
              "the note on times.")
    return out + [""]


# --------------------------------------------------------------------------------------


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: tiny model, 3 steps, scaling for N=4 and 8 only")
    parser.add_argument("--no-scaling", action="store_true", help="skip the N=1,2,4,8 table")
    args = parser.parse_args(argv)

    defaults = Config(blocks=2, width=64, vocab=256, seq=16) if args.quick else Config()
    cfg = Config(**{
        field.name: getattr(args, field.name) if getattr(args, field.name, None) is not None
        else getattr(defaults, field.name)
        for field in dataclasses.fields(Config)
    })
    if args.steps is None:
        args.steps = 3 if args.quick else 10
    devices = jax.devices()[:NUM_DEVICES]
    n = len(devices)
    if cfg.batch % n or cfg.width % cfg.heads:
        parser.error(f"--batch must be a multiple of {n} and --width of --heads")

    start = time.perf_counter()
    args.load_start = os.getloadavg()[0]
    params = init_params(cfg, seed=0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab, (cfg.batch, cfg.seq), np.int32)
    ctx = Context(cfg, params, tokens, devices, optax.adamw(1e-3, weight_decay=0.01))

    variants = [build(ctx) for build in VARIANTS]
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must be unique: {names}")
    baseline = next((v for v in variants if v.name == BASELINE), None)
    extra = []  # programs only compiled and read, never run
    if baseline is not None:
        extra.append(double_batch_variant(ctx))
        if not args.no_scaling:
            counts = (4,) if args.quick else (1, 2, 4)  # N = all devices: variant 1 itself
            extra += scaling_variants(ctx, [c for c in counts if c < n])
    log(f"lowering {len(variants) + len(extra) + 1} programs")
    lowered = {v.name: lower(v) for v in variants + extra}
    lowered["plain grad"] = plain_grad_program(ctx)
    compiled = compile_all(lowered)

    timing = time_steps(variants, compiled, args.warmup, args.steps)
    results = []
    for v in variants:
        results.append(static_facts(v, compiled[v.name][0]))
        results[-1].update(compile_s=compiled[v.name][1], **timing[v.name])
    by_name = {r["name"]: r for r in results}
    facts = {v.name: static_facts(v, compiled[v.name][0]) for v in extra}
    plain = compiled.get("plain grad")
    act = {"plain": plain[0].memory_analysis().temp_size_in_bytes if plain else None,
           "slope": None}
    scale = []
    if baseline is not None:
        double = facts[extra[0].name]
        act["slope"] = double["temp"] - by_name[BASELINE]["temp"]
        if not args.no_scaling:
            rows = [facts[v.name] for v in extra[1:]] + [by_name[BASELINE]]
            scale = [scaling_row(ctx, f) for f in rows]
    text = report(args, cfg, ctx, results, scale, act, time.perf_counter() - start)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
