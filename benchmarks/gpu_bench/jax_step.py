"""The `jax-plain` / `jax-funshard` parts: one training step of a bf16 GPT of about 1B
parameters, plain JAX against funshard, compiled and timed."""

from __future__ import annotations

import dataclasses
import math
import time

from .config import GPT, JAX_GPT, SMOKE_JAX_GPT
from .measure import flops_of, jax_peak_bytes, median_step, mfu, peak_tflops


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
        blocks = [
            {
                "ln1_g": jnp.ones((d,)),
                "ln1_b": jnp.zeros((d,)),
                "qkv": dense((d, 3 * d)),
                "qkv_b": jnp.zeros((3 * d,)),
                "proj": dense((d, d), out_scale),
                "proj_b": jnp.zeros((d,)),
                "ln2_g": jnp.ones((d,)),
                "ln2_b": jnp.zeros((d,)),
                "ff1": dense((d, 4 * d)),
                "ff1_b": jnp.zeros((4 * d,)),
                "ff2": dense((4 * d, d), out_scale),
                "ff2_b": jnp.zeros((d,)),
            }
            for _ in range(cfg.blocks)
        ]
        root = {
            "embed": normal((v, d), 0.02),
            "pos": normal((cfg.seq, d), 0.02),
            "lnf_g": jnp.ones((d,)),
            "lnf_b": jnp.zeros((d,)),
            "head": dense((d, v)),
        }
        return {"root": root, "blocks": blocks}

    return init, jax_gpt.make_block(cfg.heads, fused_attention=True), jax_gpt.lm_loss


def part_jax(args, variant: str) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    import funshard as fs

    cfg = SMOKE_JAX_GPT if args.cpu_smoke else JAX_GPT
    deadline = time.monotonic() + args.part_seconds * 0.8
    device = jax.devices()[0]
    init, block, lm_loss = _jax_model(cfg)
    params = jax.jit(init, out_shardings=jax.sharding.SingleDeviceSharding(device))(
        jax.random.key(0)
    )
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

    median, times, losses = median_step(run, args.warmup, args.steps, deadline)
    flops = flops_of(compiled)
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    return {
        "variant": variant,
        "device_kind": device.device_kind,
        "params": cfg.params(),
        "config": dataclasses.asdict(cfg),
        "compile_s": compile_s,
        "median_s": median,
        "times_s": times,
        "losses": losses,
        "flops_compiled": flops,
        "flops_model": cfg.model_flops(),
        "peak_tflops": peak,
        "mfu_compiled": mfu(flops, median, peak),
        "mfu_model": mfu(cfg.model_flops(), median, peak),
        "peak_bytes": jax_peak_bytes(device),
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        # The step's own footprint, from the compiled program (the process peak above
        # also holds whatever setup allocated, e.g. the f32 parameters before sharding).
        "step_bytes": (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes
        ),
    }
