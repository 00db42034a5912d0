"""torch_frontend's gradients against FSDP2's, bit for bit, step by step (2 ranks).

    torchrun --nproc-per-node 2 benchmarks/torch_bench/grad_probe.py [--steps 12]
        [--no-prefetch forward|backward|both] [--hold-gradients] [--recheck-outputs]
        [--blocks 4 --width 1024]

Builds the benchmark's GPT twice from the same weights, shards one with torch_frontend
and one with `torch.distributed.fsdp.fully_shard` (reshard_after_forward=True, FSDP2's
default recipe), and steps them alternately on the same batches with AdamW. After each
backward, every rank compares its local shard gradients and prints the step's loss
difference and the parameters whose gradients differ (largest difference first). FSDP2
itself is deterministic here (its losses equal DDP's to the last bit), so any
difference is the frontend's. `--no-prefetch` turns the frontend's forward and/or
backward prefetch off (`set_modules_to_*_prefetch([])`); `--hold-gradients` and
`--recheck-outputs` wrap `torch_frontend._bridge.start_reduce_scatter` /
`finish_reduce_scatter` (in this process only) to keep its inputs alive until the step
ends, or to re-read its results after a pause.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the package

import torch

from torch_bench import model as gpt


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def build(cfg: gpt.Config, shard, no_prefetch: str | None):
    """The GPT sharded per block then at the root by `shard`, and its AdamW."""
    model = gpt.build(cfg)
    for block in model.blocks:
        shard(block)
    shard(model)
    if no_prefetch:
        for unit in [*model.blocks, model]:
            if no_prefetch in ("forward", "both"):
                unit.set_modules_to_forward_prefetch([])
            if no_prefetch in ("backward", "both"):
                unit.set_modules_to_backward_prefetch([])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--no-prefetch", choices=["forward", "backward", "both"], default=None)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument(
        "--hold-gradients",
        action="store_true",
        help="keep every tensor the frontend reduce-scatters alive until the "
        "step ends (tells whether their lifetime matters)",
    )
    p.add_argument(
        "--recheck-outputs",
        action="store_true",
        help="read every reduce-scatter result again 50 ms after it returned "
        "and report results that changed meanwhile",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    import torch_frontend

    torch_frontend.init_distributed()
    held: list = []
    if args.hold_gradients:
        from torch_frontend import _bridge

        reduce_scatter = _bridge.start_reduce_scatter

        def holding(layout, fulls, *rest, **kwargs):
            held.append(list(fulls))
            return reduce_scatter(layout, fulls, *rest, **kwargs)

        _bridge.start_reduce_scatter = holding
    changed: list[str] = []
    if args.recheck_outputs:
        import time

        from torch_frontend import _bridge

        scatter = _bridge.finish_reduce_scatter

        def rechecking(pending):
            out = scatter(pending)
            first = [o.clone() for o in out]
            time.sleep(0.05)
            changed.extend(
                f"output {i} ({tuple(o.shape)}): {(o - f).abs().max().item():.1e}"
                for i, (o, f) in enumerate(zip(out, first, strict=True))
                if not torch.equal(o, f)
            )
            return out

        _bridge.finish_reduce_scatter = rechecking
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = gpt.Config(blocks=args.blocks, width=args.width)
    models = {
        "frontend": build(cfg, lambda m: torch_frontend.fully_shard(m), args.no_prefetch),
        "fsdp2": build(cfg, lambda m: fsdp2_shard(m, mesh=mesh), None),
    }
    rows = cfg.batch // world
    differing_steps = 0
    for step in range(args.steps):
        batch = torch.from_numpy(gpt.batch_at(step, cfg)[rank * rows : (rank + 1) * rows])
        losses, grads = {}, {}
        for name, (model, opt) in models.items():
            dist.barrier()
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            grads[name] = {n: _local(q.grad) for n, q in model.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name] = loss.item()
        held.clear()
        if changed:
            print(
                f"rank {rank} step {step}: reduce-scatter results changed after returning: "
                + "; ".join(changed),
                flush=True,
            )
            changed.clear()
        diffs = sorted(
            ((g - grads["fsdp2"][n]).abs().max().item(), n)
            for n, g in grads["frontend"].items()
            if not torch.equal(g, grads["fsdp2"][n])
        )[::-1]
        differing_steps += bool(diffs)
        shown = ", ".join(f"{n} {d:.1e}" for d, n in diffs[:4])
        print(
            f"rank {rank} step {step}: loss diff {losses['frontend'] - losses['fsdp2']:+.2e}; "
            f"{len(diffs)} gradients differ{': ' + shown if diffs else ''}",
            flush=True,
        )
    dist.destroy_process_group()
    print(f"rank {rank}: gradients differed at {differing_steps} of {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
