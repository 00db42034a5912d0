"""The ways of training the benchmark's model, one builder each.

Every variant trains the same GPT from the same initial weights on the same batches
with AdamW (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01: torch's defaults,
and optax's `adamw` with those numbers). A variant's `step(local_rows, global_batch)`
runs one training step and returns the loss it saw.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from . import model as gpt

LR = 1e-3
FSDP2 = "FSDP2 reshard=True"  # the peer every ratio is taken against (FSDP2's default)


@dataclasses.dataclass
class Variant:
    """One way of training the model, as this rank runs it.

    Attributes:
      name: the row's name in the report.
      peer: the variant its step time is divided by (None: not compared).
      note: how it is built, for the report.
      step: `step(local_rows, global_batch) -> loss`.
      state_bytes: this rank's parameters and optimizer state between steps.
      loss_scope: "local" (this rank's rows), "global" (the global batch's mean) or
        "rank 0" (only rank 0 trains; others return NaN).
      facts: anything else worth reporting (compile time, compiled memory).
    """

    name: str
    peer: str | None
    note: str
    step: Callable[[torch.Tensor, np.ndarray], float]
    state_bytes: Callable[[], int]
    loss_scope: str = "local"
    facts: dict = dataclasses.field(default_factory=dict)


def _torch_step(model, opt, threads: int | None = None, whole_batch: bool = False):
    def step(local: torch.Tensor, batch: np.ndarray) -> float:
        tokens = torch.from_numpy(batch) if whole_batch else local
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
        finally:
            torch.set_num_threads(before)

    return step


def _torch_variant(name, peer, note, model, threads=None, whole_batch=False, scope="local"):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return Variant(
        name,
        peer,
        note,
        _torch_step(model, opt, threads, whole_batch),
        lambda: gpt.nbytes(model.parameters()) + gpt.adam_bytes(opt),
        scope,
    )


def no_mark(phase: str) -> None:
    """The default `mark`: records nothing."""


def frontend(
    cfg: gpt.Config,
    reshard: bool,
    compile_blocks: bool = False,
    mark: Callable[[str], None] = no_mark,
) -> Variant:
    """torch_frontend: fully_shard per block (reshard_after_forward=reshard), then the root.

    With `compile_blocks`, each block is `block.compile()`d (Inductor) after fully_shard.
    `mark("model")` runs once the plain model is built, `mark("first_shard")` after the
    first `fully_shard` call.
    """
    from torch_frontend import fully_shard

    model = gpt.build(cfg)
    mark("model")
    for i, block in enumerate(model.blocks):
        fully_shard(block, reshard_after_forward=reshard)
        if i == 0:
            mark("first_shard")
        if compile_blocks:
            block.compile()
    fully_shard(model)
    return _torch_variant(
        f"torch_frontend reshard={reshard}",
        f"FSDP2 reshard={reshard}",
        "fully_shard per block, then the root; collectives on JAX (gloo)",
        model,
    )


def fsdp2(
    cfg: gpt.Config,
    reshard: bool,
    mesh,
    compile_blocks: bool = False,
    mark: Callable[[str], None] = no_mark,
) -> Variant:
    """PyTorch FSDP2 on gloo, sharded exactly as `frontend` (and `mark`ed as there)."""
    from torch.distributed.fsdp import fully_shard

    model = gpt.build(cfg)
    mark("model")
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        if i == 0:
            mark("first_shard")
        if compile_blocks:
            block.compile()
    fully_shard(model, mesh=mesh)
    return _torch_variant(
        f"FSDP2 reshard={reshard}",
        None,
        "torch.distributed.fsdp.fully_shard per block, then the root; gloo",
        model,
    )


def ddp(cfg: gpt.Config) -> Variant:
    """DistributedDataParallel on gloo: replicated parameters, all-reduced gradients."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(gpt.build(cfg))
    return _torch_variant(
        "DDP", FSDP2, "DistributedDataParallel, gloo all-reduce (25 MiB buckets)", model
    )


def compute_floor(cfg: gpt.Config) -> Variant:
    """Plain torch on this rank's rows, nothing communicated: what every step computes."""
    return _torch_variant(
        "compute floor (1 rank's rows)",
        FSDP2,
        "plain torch, this rank's rows only, no communication "
        "(a yardstick: it does not train the global batch)",
        gpt.build(cfg),
    )


def single_process(cfg: gpt.Config, rank: int, threads: int) -> Variant:
    """Plain torch in ONE process (rank 0) on the whole global batch; others wait."""
    name, note = (
        "1 process alone",
        (
            f"plain torch on rank 0, whole global batch, "
            f"{threads} threads (the whole machine); rank 1 idles"
        ),
    )
    if rank == 0:
        return _torch_variant(name, FSDP2, note, gpt.build(cfg), threads, True, "rank 0")
    return Variant(name, FSDP2, note, lambda local, batch: float("nan"), lambda: 0, "rank 0")


def funshard_jax(cfg: gpt.Config, mesh, reshard: bool = True) -> Variant:
    """funshard's JAX step on the same processes: `fs.value_and_grad`, AOT-compiled."""
    import jax
    import optax

    import funshard as fs
    import funshard.distributed

    state = fs.shard(gpt.jax_params(gpt.build(cfg)), mesh)
    opt = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    opt_state = fs.init_optimizer(opt, state)
    loss_grad = fs.value_and_grad(gpt.jax_loss(cfg, reshard))

    def train_step(state, opt_state, tokens):
        loss, grads = loss_grad(state, tokens)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    world = jax.process_count()
    rows = cfg.batch // world

    def place(batch):
        return fs.distributed.shard_batch(
            batch[jax.process_index() * rows : (jax.process_index() + 1) * rows].astype(np.int32),
            mesh,
        )

    t0 = time.perf_counter()
    compiled = (
        jax.jit(train_step, donate_argnums=(0, 1))
        .lower(state, opt_state, place(gpt.batch_at(0, cfg)))
        .compile()
    )
    memory = compiled.memory_analysis()
    facts = {
        "compile_s": time.perf_counter() - t0,
        "compiled_temp": memory.temp_size_in_bytes,
        "compiled_arg": memory.argument_size_in_bytes,
    }
    held = {"state": state, "opt": opt_state}

    def step(local: torch.Tensor, batch: np.ndarray) -> float:
        held["state"], held["opt"], loss = compiled(held["state"], held["opt"], place(batch))
        return float(loss)

    def state_bytes() -> int:
        device = mesh.devices.flat[jax.process_index()]
        return sum(
            s.data.nbytes
            for leaf in jax.tree.leaves((held["state"], held["opt"]))
            for s in leaf.addressable_shards
            if s.device == device
        )

    return Variant(
        f"funshard JAX step reshard={reshard}",
        FSDP2,
        "fs.value_and_grad, fs.fully_shard per block, root via fs.unshard; "
        "optax.adamw; one compiled program",
        step,
        state_bytes,
        "global",
        facts,
    )
