"""GPU check: funshard and torch_frontend on ONE GPU, against plain JAX, FSDP2 and torch.

One command, at most 8 minutes on one GPU (world size 1), from the repository root:

    python benchmarks/gpu_check.py --out-json gpu_check.json --out-md gpu_check.md

On a machine without a GPU it exits at once (status 2) saying so; `--cpu-smoke` runs
the same code on CPU with tiny models in seconds (a check of the script, not a
measurement). Parts, each in a process of its own with its own time budget; a part
that fails or runs out of time records its error in the table and the run goes on:

1. `probe`: JAX's backend and device, torch's CUDA.
2. `dlpack`: torch CUDA tensors -> JAX and back through torch_frontend's bridge, each
   crossing checked for no copy (pointer equality), and timed.
3. `tests`: the GPU test subset, `pytest -m gpu tests/test_gpu.py` (JAX_PLATFORMS=cuda).
4. `jax-plain` / `jax-funshard`: a bf16 GPT of about 1B parameters (fp32 master
   weights, AdamW), one training step compiled and timed: plain JAX (parameters cast
   to bf16 in the loss) and funshard (`fs.fully_shard` per block, `param_dtype`
   bf16, `reduce_dtype` f32). Step time, FLOPs from `compiled.cost_analysis()`, MFU
   against the GPU's peak bf16 TFLOPS (`PEAK_BF16_TFLOPS`, or `--peak-tflops`), and
   peak memory (`memory_stats()["peak_bytes_in_use"]`, one process per variant).
5. `torch-plain` / `torch-fsdp2` / `torch-frontend`: a torch GPT (fp32, TF32 matmuls),
   the same weights and batches: plain torch, FSDP2 (`fully_shard` per block, NCCL)
   and torch_frontend (its collectives on JAX). Per-step losses (compared), step
   time, and peak `torch.cuda.max_memory_allocated` (plus JAX's peak for the frontend,
   whose gathered parameters live in JAX's memory).

Targets (GPU only): funshard step <= 1.05x plain JAX; torch_frontend <= 1.1x FSDP2;
MFU of the 1B bf16 step >= 35% on an H100/H200-class GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # examples.models: the model of every part
EXIT_NO_GPU = 2
# Dense bf16 tensor-core peaks (no sparsity), TFLOPS, by a substring of the device name
# JAX reports (`device_kind`); the first match wins. From NVIDIA's data sheets.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
)
TARGETS = {"funshard / plain JAX": 1.05, "torch_frontend / FSDP2": 1.10, "MFU": 0.35}
# Seconds per part (their sum stays under the 8-minute total with a margin).
BUDGETS = {"probe": 40, "dlpack": 30, "tests": 90, "jax-plain": 85, "jax-funshard": 95,
           "torch-plain": 35, "torch-fsdp2": 40, "torch-frontend": 50}
TORCH_PARTS = ("torch-plain", "torch-fsdp2", "torch-frontend")
JAX_PARTS = ("jax-plain", "jax-funshard")


@dataclasses.dataclass(frozen=True)
class GPT:
    """A GPT's shape and its global batch (world size 1: all of it on the one device)."""

    blocks: int
    width: int
    heads: int
    vocab: int
    seq: int
    batch: int

    def params(self) -> int:
        d = self.width
        return self.blocks * (12 * d * d + 13 * d) + (2 * self.vocab + self.seq + 2) * d

    def model_flops(self) -> float:
        """Training FLOPs per step: 6 per matmul parameter per token, plus attention
        (12 * blocks * width * seq per token, counted without the causal half)."""
        tokens = self.batch * self.seq
        matmul = self.blocks * 12 * self.width ** 2 + self.width * self.vocab
        return 6.0 * matmul * tokens + 12.0 * self.blocks * self.width * self.seq * tokens


JAX_GPT = GPT(blocks=18, width=2048, heads=16, vocab=32768, seq=2048, batch=8)  # 1.04B
TORCH_GPT = GPT(blocks=12, width=1024, heads=16, vocab=32768, seq=1024, batch=8)  # 218M
SMOKE_JAX_GPT = GPT(blocks=2, width=64, heads=2, vocab=128, seq=32, batch=4)
SMOKE_TORCH_GPT = GPT(blocks=2, width=64, heads=2, vocab=128, seq=32, batch=4)


# ------------------------------------------------------------------------- pure helpers


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (None: not in `PEAK_BF16_TFLOPS`)."""
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_kind:
            return value
    return None


def mfu(flops: float | None, seconds: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation: `flops` per `seconds` over `peak` TFLOPS (None if unknown)."""
    if not flops or not seconds or not peak:
        return None
    return flops / seconds / (peak * 1e12)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def no_gpu_reason(environ, distribution_names) -> str | None:
    """Why JAX cannot run on a GPU here, known without starting JAX (None: it may).

    Args:
      environ: the environment (JAX_PLATFORMS).
      distribution_names: the names of the installed Python distributions.
    """
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(p in platforms.split(",") for p in ("cuda", "gpu", "rocm")):
        return f"JAX_PLATFORMS={platforms!r} leaves out the GPU"
    names = {n.lower().replace("_", "-") for n in distribution_names}
    if not any(n.startswith(("jax-cuda", "jax-rocm")) and n.endswith("-plugin") for n in names):
        return "JAX's GPU plugin is not installed (jax-cuda12-plugin)"
    return None


# ------------------------------------------------------------------------- parts (child)


def _median_step(run: Callable[[int], float], warmup: int, steps: int, deadline: float):
    """Runs `run(i)` (returns the loss) `warmup` times, then times up to `steps` runs
    (fewer if `deadline` comes first); returns (median seconds, times, losses)."""
    losses, times = [], []
    for i in range(warmup):
        losses.append(run(i))
    for i in range(warmup, warmup + steps):
        if times and time.monotonic() > deadline:
            break
        start = time.perf_counter()
        losses.append(run(i))
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, losses


def part_probe(args) -> dict:
    import jax

    device = jax.devices()[0]
    out = {"backend": jax.default_backend(), "device_kind": device.device_kind,
           "devices": jax.device_count(), "jax": jax.__version__}
    try:
        import torch

        out.update(torch=torch.__version__, torch_cuda=torch.cuda.is_available(),
                   torch_cuda_version=torch.version.cuda)
    except ImportError:
        out.update(torch=None, torch_cuda=False)
    return out


def _jax_model(cfg: GPT):
    """(init(key) -> f32 params, block(p, h), loss(root, blocks, tokens, block)) for `cfg`.

    The model is `examples/models/jax_gpt.py`'s, with fused attention; its parameters
    are drawn on the device (`jax.random`), the host being too slow for 1B of them.
    """
    import jax
    import jax.numpy as jnp

    from examples.models import jax_gpt

    d, v = cfg.width, cfg.vocab

    def init(key):
        keys = iter(jax.random.split(key, 4 * cfg.blocks + 3))

        def normal(shape, std):
            return jax.random.normal(next(keys), shape, jnp.float32) * std

        def dense(shape, scale=1.0):
            return normal(shape, scale / math.sqrt(shape[0]))

        out_scale = 1.0 / math.sqrt(2 * cfg.blocks)
        blocks = [{
            "ln1_g": jnp.ones((d,)), "ln1_b": jnp.zeros((d,)),
            "qkv": dense((d, 3 * d)), "qkv_b": jnp.zeros((3 * d,)),
            "proj": dense((d, d), out_scale), "proj_b": jnp.zeros((d,)),
            "ln2_g": jnp.ones((d,)), "ln2_b": jnp.zeros((d,)),
            "ff1": dense((d, 4 * d)), "ff1_b": jnp.zeros((4 * d,)),
            "ff2": dense((4 * d, d), out_scale), "ff2_b": jnp.zeros((d,)),
        } for _ in range(cfg.blocks)]
        root = {"embed": normal((v, d), 0.02), "pos": normal((cfg.seq, d), 0.02),
                "lnf_g": jnp.ones((d,)), "lnf_b": jnp.zeros((d,)), "head": dense((d, v))}
        return {"root": root, "blocks": blocks}

    return init, jax_gpt.make_block(cfg.heads, fused_attention=True), jax_gpt.lm_loss


def _flops_of(compiled) -> float | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = (cost or {}).get("flops")
    return float(flops) if flops else None


def _jax_peak_bytes(device) -> int | None:
    stats = device.memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def part_jax(args, variant: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import funshard as fs

    cfg = SMOKE_JAX_GPT if args.cpu_smoke else JAX_GPT
    deadline = time.monotonic() + args.part_seconds * 0.8
    device = jax.devices()[0]
    init, block, lm_loss = _jax_model(cfg)
    params = jax.jit(init, out_shardings=jax.sharding.SingleDeviceSharding(device))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq), 0, cfg.vocab)
    opt = optax.adamw(1e-4)
    bf16 = jnp.bfloat16

    if variant == "plain":
        def loss_fn(params, tokens):
            p = jax.tree.map(lambda x: x.astype(bf16), params)
            return lm_loss(p["root"], p["blocks"], tokens, block)

        state, value_and_grad = params, jax.value_and_grad(loss_fn)
        opt_state = opt.init(state)
    else:
        policy = fs.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=jnp.float32)
        mesh = fs.make_mesh(devices=[device])
        state = fs.shard(params, mesh, mp_policy=policy)
        del params
        unit = fs.fully_shard(block)

        def loss_fn(state, tokens):
            return lm_loss(fs.unshard(state["root"]), state["blocks"], tokens, unit)

        value_and_grad = fs.value_and_grad(loss_fn)
        opt_state = fs.init_optimizer(opt, state)

    def step(state, opt_state, tokens):
        loss, grads = value_and_grad(state, tokens)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(state, opt_state, tokens).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    carry = [state, opt_state]
    del state, opt_state

    def run(i):
        carry[0], carry[1], loss = compiled(carry[0], carry[1], tokens)
        return float(loss)  # waits for the step

    median, times, losses = _median_step(run, args.warmup, args.steps, deadline)
    flops = _flops_of(compiled)
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    return {
        "variant": variant, "device_kind": device.device_kind, "params": cfg.params(),
        "config": dataclasses.asdict(cfg), "compile_s": compile_s, "median_s": median,
        "times_s": times, "losses": losses, "flops_compiled": flops,
        "flops_model": cfg.model_flops(), "peak_tflops": peak,
        "mfu_compiled": mfu(flops, median, peak), "mfu_model": mfu(cfg.model_flops(), median, peak),
        "peak_bytes": _jax_peak_bytes(device),
        "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
        # The step's own footprint, from the compiled program (the process peak above
        # also holds whatever setup allocated, e.g. the f32 parameters before sharding).
        "step_bytes": (memory.argument_size_in_bytes + memory.output_size_in_bytes
                       + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
    }


def _torch_model(cfg: GPT):
    """`examples/models/torch_gpt.py`'s GPT for `cfg`, torch's default biases kept."""
    import torch

    from examples.models.torch_gpt import GPT as TorchGPT

    torch.manual_seed(0)
    return TorchGPT(width=cfg.width, depth=cfg.blocks, heads=cfg.heads, context=cfg.seq,
                    vocab=cfg.vocab, zero_biases=False)


def part_torch(args, variant: str) -> dict:
    import torch
    import torch.distributed as dist

    cfg = SMOKE_TORCH_GPT if args.cpu_smoke else TORCH_GPT
    deadline = time.monotonic() + args.part_seconds * 0.8
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    torch.backends.cuda.matmul.allow_tf32 = True  # the same kernels in every variant
    torch.backends.cudnn.allow_tf32 = True
    jax_device = None
    if variant == "frontend":
        from torch_frontend import _cuda

        _cuda.configure_allocator()  # before JAX's backend starts (init_distributed's job)
        import jax

        import torch_frontend

        jax_device = jax.local_devices()[0]
        _cuda.set_torch_device(jax_device)
        torch_frontend.init_distributed()
        device = _cuda.torch_device(jax_device)
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
    model = _torch_model(cfg).to(device)
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(),
                                    rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif variant == "frontend":
        from torch_frontend import fully_shard

        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
               for _ in range(args.warmup + args.steps)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def run(i):
        batch = batches[i].to(device)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().item()  # waits for the step (a host sync in every variant)

    median, times, losses = _median_step(run, args.warmup, args.steps, deadline)
    return {
        "variant": variant, "params": cfg.params(), "config": dataclasses.asdict(cfg),
        "device": str(device), "median_s": median, "times_s": times, "losses": losses,
        "torch_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "jax_peak_bytes": _jax_peak_bytes(jax_device) if jax_device is not None else None,
    }


def part_dlpack(args) -> dict:
    import jax
    import torch

    import funshard as fs
    from torch_frontend import _bridge, _cuda

    _cuda.configure_allocator()
    jax_device = jax.local_devices()[0]
    _cuda.set_torch_device(jax_device)
    device = _cuda.torch_device(jax_device)
    layout = _bridge.layout_of(fs.make_mesh(devices=[jax_device]), _bridge.CommContext())
    out = {"device": str(device), "checks": {}}
    tensor = torch.arange(1 << 20, dtype=torch.float32, device=device)
    array = _bridge._import(layout, tensor)
    out["checks"]["torch -> jax shares memory"] = array.unsafe_buffer_pointer() == tensor.data_ptr()
    out["checks"]["torch -> jax values"] = bool((jax.numpy.asarray(array)[-1] == (1 << 20) - 1))
    result = jax.numpy.asarray(array) * 2
    back = _bridge._export(result)
    out["checks"]["jax -> torch shares memory"] = back.data_ptr() == result.unsafe_buffer_pointer()
    out["checks"]["jax -> torch values"] = bool(torch.equal(back, tensor * 2))
    block = _bridge.global_block(layout, tensor)
    shard = block.addressable_shards[0].data
    checks = out["checks"]
    checks["global block aliases the shard"] = shard.unsafe_buffer_pointer() == tensor.data_ptr()
    gathered = _bridge._gather_now(layout, [block], [tensor.shape[0]], None)[0]
    full = _bridge._export(gathered)
    checks["gathered buffer crosses without a copy"] = (
        full.data_ptr() == gathered.unsafe_buffer_pointer())
    checks["gather values"] = bool(torch.equal(full, tensor))
    out["import_us"] = _time_us(lambda: _bridge._import(layout, tensor))
    out["export_us"] = _time_us(lambda: _bridge._export(result))
    out["ok"] = all(out["checks"].values())
    return out


def _time_us(fn, repeat: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def part_tests(args) -> dict:
    env = _child_env(args, "tests")
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "tests/test_gpu.py"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=max(1.0, args.part_seconds - 5))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"command": " ".join(command[1:]), "returncode": proc.returncode,
            "summary": lines[-1] if lines else "", "tail": proc.stdout[-3000:] + proc.stderr[-1000:],
            "ok": proc.returncode == 0}


PARTS = {
    "probe": part_probe,
    "dlpack": part_dlpack,
    "tests": part_tests,
    "jax-plain": lambda a: part_jax(a, "plain"),
    "jax-funshard": lambda a: part_jax(a, "funshard"),
    "torch-plain": lambda a: part_torch(a, "plain"),
    "torch-fsdp2": lambda a: part_torch(a, "fsdp2"),
    "torch-frontend": lambda a: part_torch(a, "frontend"),
}


# ------------------------------------------------------------------------- driver (parent)


def _child_env(args, part: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
    elif part == "tests":
        env["JAX_PLATFORMS"] = "cuda"  # tests/conftest.py defaults to cpu otherwise
    if part in ("tests", "dlpack", *TORCH_PARTS):
        # torch shares the GPU: JAX must not take 75% of it (torch_frontend's default).
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def run_part(args, part: str, seconds: float) -> dict:
    """Runs one part in a child process within `seconds`; its result, or its error."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--part", part,
                   "--result", str(result_file), "--part-seconds", str(seconds),
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
        if args.cpu_smoke:
            command.append("--cpu-smoke")
        if args.peak_tflops:
            command += ["--peak-tflops", str(args.peak_tflops)]
        try:
            proc = subprocess.run(command, cwd=ROOT, env=_child_env(args, part),
                                  capture_output=True, text=True, timeout=seconds)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {seconds:.0f} s (its budget)",
                    "wall_s": time.monotonic() - start}
        if result_file.exists():
            out = json.loads(result_file.read_text())
        else:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            out = {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    out["wall_s"] = time.monotonic() - start
    return out


def run_in_process(args, part: str, seconds: float) -> dict:
    """`--cpu-smoke`: a part in this process (tiny models; no isolation needed)."""
    start = time.monotonic()
    args.part_seconds = seconds
    try:
        out = PARTS[part](args)
    except Exception as exc:  # noqa: BLE001 -- recorded in the table, the run goes on
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["wall_s"] = time.monotonic() - start
    return out


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
        worst = max(abs(a - b) / max(abs(b), 1e-12) for other in losses[1:]
                    for a, b in zip(other, ref))
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
    lines += [f"- command: `{report['command']}`",
              f"- device: {probe.get('device_kind', '-')} ({probe.get('backend', '-')}), "
              f"jax {probe.get('jax', '-')}, torch {probe.get('torch', '-')}",
              f"- total wall time: {report['wall_s']:.0f} s (budget {report['budget_s']:.0f} s)", ""]
    if report["mode"] != "gpu":
        lines += ["**CPU smoke run: tiny models on CPU. It checks that the script runs; none "
                  "of its numbers is a GPU measurement.**", ""]
    lines += ["| part | status | step | compile | peak memory | notes |", "|---|---|---|---|---|---|"]
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
            notes.append(f"{res['params'] / 1e9:.2f}B params, GFLOP {_fmt(gflop)}, "
                         f"MFU {_fmt(res['mfu_compiled'], 'pct')} "
                         f"(model FLOPs: {_fmt(res['mfu_model'], 'pct')}), "
                         f"compiled step {_fmt(res['step_bytes'], 'bytes')}")
        if name in TORCH_PARTS:
            notes.append(f"{res['params'] / 1e6:.1f}M params, losses "
                         + ", ".join(f"{x:.4f}" for x in res["losses"][:3]) + " ...")
            if res.get("jax_peak_bytes") is not None:
                notes.append(f"JAX peak {_fmt(res['jax_peak_bytes'], 'bytes')}")
        if name == "dlpack":
            notes.append(", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in res["checks"].items()))
            notes.append(f"import {res['import_us']:.0f} us, export {res['export_us']:.0f} us")
        if name == "tests":
            notes.append(res["summary"])
        status = "ok" if res.get("ok", True) else "failed"
        lines.append(f"| {name} | {status} | {_fmt(res.get('median_s'), 'ms')} | "
                     f"{_fmt(res.get('compile_s'))} | {_fmt(peak, 'bytes')} | {'; '.join(notes)} |")
    lines += ["", "| target | value | limit | result |", "|---|---|---|---|"]
    for name, limit in TARGETS.items():
        value = ev.get(name)
        shown = _fmt(value, "pct") if name == "MFU" else _fmt(value)
        bound = f">= {limit:.0%}" if name == "MFU" else f"<= {limit:.2f}x"
        lines.append(f"| {name} | {shown} | {bound} | {ev['targets'][name]} |")
    for name in ("torch_frontend / plain torch", "FSDP2 / plain torch",
                 "torch losses max relative difference", "jax first loss relative difference"):
        if ev.get(name) is not None:
            lines.append(f"| {name} | {_fmt(ev[name])} | - | - |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny models on CPU in this process: checks the script, measures nothing")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 peak, when its name is not in the table")
    p.add_argument("--only", default="", help="comma-separated parts to run (default all)")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--part-seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.cpu_smoke else 10
    if args.warmup is None:
        args.warmup = 1 if args.cpu_smoke else 2
    return args


def child(args) -> int:
    try:
        out = PARTS[args.part](args)
    except Exception as exc:  # noqa: BLE001 -- the parent records it in the table
        out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    args.result.write_text(json.dumps(out, default=str))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.part:
        return child(args)
    if args.cpu_smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts in this process
    start = time.monotonic()
    deadline = start + args.budget
    runner = run_in_process if args.cpu_smoke else run_part
    reason = None
    if not args.cpu_smoke:
        from importlib import metadata

        names = (d.metadata["Name"] or "" for d in metadata.distributions())
        reason = no_gpu_reason(os.environ, names)
    results = {"probe": runner(args, "probe", BUDGETS["probe"])} if reason is None else {}
    probe = results.get("probe", {})
    gpu = probe.get("backend") == "gpu"
    if not args.cpu_smoke and not gpu:
        reason = reason or (f"JAX's backend is {probe.get('backend')!r} "
                            f"({probe.get('error') or probe.get('device_kind')})")
        print(f"gpu_check: no GPU: {reason}. Run it on a GPU machine after "
              "`pip install -e '.[cuda]'` (docs/gpu.md), or pass --cpu-smoke for a tiny CPU "
              "run of the same code paths.", file=sys.stderr)
        return EXIT_NO_GPU
    wanted = [p for p in BUDGETS if p != "probe" and (not args.only or p in args.only.split(","))]
    for part in wanted:
        if args.cpu_smoke and part == "tests":
            results[part] = {"skipped": True, "ok": True, "median_s": None,
                             "summary": "skipped in --cpu-smoke (tests/test_gpu.py skips on CPU)"}
            continue
        left = deadline - time.monotonic() - 5
        if left < 10:
            results[part] = {"error": "not run: the run's time budget was spent"}
            continue
        print(f"gpu_check: {part} (up to {min(BUDGETS[part], left):.0f} s)", file=sys.stderr)
        results[part] = runner(args, part, min(BUDGETS[part], left))
    report = {
        "mode": "gpu" if gpu and not args.cpu_smoke else "cpu-smoke",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]) if argv is None
        else "gpu_check.main(" + repr(argv) + ")",
        "machine": platform.platform(), "budget_s": args.budget,
        "wall_s": time.monotonic() - start, "results": results,
        "evaluation": evaluate(results, gpu and not args.cpu_smoke),
    }
    if args.out_json:
        args.out_json.write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    if args.out_md:
        args.out_md.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
