"""The `torch-plain` / `torch-fsdp2` / `torch-frontend` parts: a torch GPT (fp32, TF32
matmuls) trained on the same weights and batches by plain torch, FSDP2 and
torch_frontend."""

from __future__ import annotations

import dataclasses
import time

from .config import GPT, SMOKE_TORCH_GPT, TORCH_GPT
from .measure import jax_peak_bytes, median_step


def _torch_model(cfg: GPT):
    """`examples/models/torch_gpt.py`'s GPT for `cfg`, torch's default biases kept."""
    import torch

    from examples.models.torch_gpt import GPT as TorchGPT

    torch.manual_seed(0)
    return TorchGPT(
        width=cfg.width,
        depth=cfg.blocks,
        heads=cfg.heads,
        context=cfg.seq,
        vocab=cfg.vocab,
        zero_biases=False,
    )


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
            dist.init_process_group(
                "nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
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
    batches = [
        torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]
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

    median, times, losses = median_step(run, args.warmup, args.steps, deadline)
    return {
        "variant": variant,
        "params": cfg.params(),
        "config": dataclasses.asdict(cfg),
        "device": str(device),
        "median_s": median,
        "times_s": times,
        "losses": losses,
        "torch_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "jax_peak_bytes": jax_peak_bytes(jax_device) if jax_device is not None else None,
    }
