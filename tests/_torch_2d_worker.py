"""One torchrun job for tests/test_torch_2d.py: FSDP2's 2-D (dp x tp) recipe, torchtitan's way.

    torchrun --nproc-per-node 4 tests/_torch_2d_worker.py --out DIR --impl fsdp2|frontend

The script is the same for both implementations except for where `fully_shard` comes
from. On a `(dp=2, tp=2)` mesh each block's `in_proj` / `out_proj` are made column- /
row-parallel by `parallelize_module`, then `fully_shard(block, mesh=mesh["dp"])` and
the root over `dp`. Each case trains a few SGD steps on per-dp-rank data (the tp ranks
of a dp rank see the same batch) and records the losses, the grad norm as torchtitan
computes it (per-parameter norms' `full_tensor()`), every parameter's placements and
the full state dict (`get_model_state_dict`). The last case is saved with DCP on the
2-D mesh and loaded into a dp-only (1-D, 4 ranks) model and into a fresh 2-D one; a
dp-only model is saved and loaded into a fresh 2-D one; both loaded 2-D models then
train. Each rank writes `rank{r}.npz`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

DIM, STEPS, LR = 8, 3, 0.1
# name -> (hidden, reshard_after_forward, activation checkpointing, shard on dim 1,
# sequence parallelism)
CASES = {
    "even": (16, True, False, False, False),
    "dim1": (16, True, False, True, False),
    "uneven": (17, True, False, False, False),
    "keep": (17, False, False, False, False),
    "ac": (17, True, True, False, False),
    "seq": (16, True, False, False, True),
}


class Block(nn.Module):
    """A residual MLP block: `in_proj` column-parallel, `out_proj` row-parallel under TP."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.in_proj = nn.Linear(DIM, hidden)
        self.out_proj = nn.Linear(hidden, DIM)

    def forward(self, x):
        return x + self.out_proj(torch.relu(self.in_proj(self.norm(x))))


class Model(nn.Module):
    def __init__(self, hidden: int, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(hidden: int, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(hidden)


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def columns(mesh):
    """shard_placement_fn: FSDP2's `ShardPlacementResult` on the dp mesh, matrices on dim 1.

    Every parameter names the same mesh info: FSDP2 (torch 2.13) refuses a second
    info object on the same process group ("must use the same FSDPMeshInfo object").
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    info = FSDPMeshInfo(mesh["dp"], shard_mesh_dim=0)

    def placement(param):
        return ShardPlacementResult(Shard(1) if param.ndim == 2 else None, info)

    return placement


def sequence_parallel(block: nn.Module, tp_mesh) -> None:
    """torchtitan's sequence parallelism, the rows (tokens) as the sequence: the block's
    input is split over tp by rows, the norm runs on its rows (`SequenceParallel`), the
    column-parallel layer gathers them and the row-parallel one reduce-scatters back to
    rows, and the block returns the residual stream replicated, as a plain tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "norm": SequenceParallel(sequence_dim=0),
        "in_proj": ColwiseParallel(input_layouts=Shard(0)),
        "out_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
    }
    parallelize_module(block, tp_mesh, plan)
    rows = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(0),))
    parallelize_module(block, tp_mesh, rows)
    output = PrepareModuleOutput(output_layouts=(Shard(0),), desired_output_layouts=(Replicate(),))
    parallelize_module(block, tp_mesh, output)


def parallelize(
    model: Model,
    mesh,
    fully_shard,
    reshard: bool,
    ac: bool,
    dim1: bool = False,
    seq: bool = False,
) -> Model:
    """torchtitan's order: TP plan per block, activation checkpointing, fully_shard."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for i, block in enumerate(model.blocks):
        # An uneven hidden size needs the DTensor between the two (a local tensor's
        # global shape would be inferred as tp times the local one): torch's own rule.
        uneven = block.in_proj.out_features % mesh["tp"].size() != 0
        colwise = ColwiseParallel(use_local_output=not uneven)
        if seq:
            sequence_parallel(block, mesh["tp"])
        else:
            plan = {"in_proj": colwise, "out_proj": RowwiseParallel()}
            parallelize_module(block, mesh["tp"], plan)
        if ac:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
            model.blocks[i] = block
        fn = columns(mesh) if dim1 else None
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard, shard_placement_fn=fn)
    return fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)


def grad_norm(model: nn.Module) -> float:
    """torchtitan's: each gradient's norm as a full tensor, then the norm of those."""
    from torch.distributed.tensor import DTensor

    norms = []
    for p in model.parameters():
        norm = torch.linalg.vector_norm(p.grad)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def full_state(model: nn.Module) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().numpy().copy() for k, v in sd.items()}


def placements(model: nn.Module) -> dict[str, str]:
    return {
        n: f"{tuple(p.device_mesh.mesh_dim_names or ())} {tuple(p.placements)}"
        for n, p in model.named_parameters()
    }


def train(model: nn.Module, dp_rank: int, record: dict, prefix: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = batch(step, dp_rank)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        norms.append(grad_norm(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    record[f"{prefix}/loss"], record[f"{prefix}/norm"] = np.asarray(losses), np.asarray(norms)
    for key, value in full_state(model).items():
        record[f"{prefix}/full/{key}"] = value
    for key, value in placements(model).items():
        record[f"{prefix}/placement/{key}"] = np.asarray(value)
    group = model.blocks[0]._get_fsdp_state()._fsdp_param_group
    if hasattr(group, "layout"):  # torch_frontend's: where its gathers run, and what
        processes = [d.process_index for d in group.layout.mesh.devices.flat]
        record[f"frontend/{prefix}/gather_processes"] = np.asarray(processes)
        record[f"frontend/{prefix}/gathered"] = np.asarray(
            [math.prod(p.shape) for p in group.fsdp_params]
        )


def reload_1d(model: nn.Module, fully_shard, out: Path, hidden: int, record: dict) -> None:
    """DCP: save the 2-D model, load it into a dp-only model over all ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    path = out / "dcp_2d"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
    flat = build(hidden, seed=7)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in flat.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(flat, mesh=mesh)
    sd = get_model_state_dict(flat)
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(flat, sd)
    for key, value in full_state(flat).items():
        record[f"reload/full/{key}"] = value
    for key, value in placements(flat).items():
        record[f"reload/placement/{key}"] = np.asarray(value)


def parallelize_2d(model: Model, mesh, fully_shard) -> Model:
    """A fresh 2-D model for the DCP loads: the recipe without activation checkpointing."""
    return parallelize(model, mesh, fully_shard, reshard=True, ac=False)


def load_into_2d(
    path: Path, mesh, fully_shard, hidden: int, dp_rank: int, record: dict, prefix: str
) -> None:
    """DCP: load a checkpoint into a fresh 2-D model (other initial values), then train it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = parallelize_2d(build(hidden, seed=9), mesh, fully_shard)
    sd = get_model_state_dict(model)
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(model, sd)
    for key, value in full_state(model).items():
        record[f"{prefix}/loaded/{key}"] = value
    train(model, dp_rank, record, prefix)


def save_1d(fully_shard, out: Path, hidden: int, record: dict) -> Path:
    """DCP: save a dp-only (1-D, 4 ranks) model, initialised unlike the 2-D ones.

    Untrained: trained over 4 dp ranks, FSDP2's and the frontend's grad norms differ in
    the last bit (1.2e-7, measured; the reduce-scatters sum 4 terms), and the parity
    checks here are bit for bit.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    flat = build(hidden, seed=11)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in flat.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(flat, mesh=mesh)
    for key, value in full_state(flat).items():
        record[f"flat/full/{key}"] = value
    path = out / "dcp_1d"
    dcp.save(get_model_state_dict(flat), checkpoint_id=str(path))
    return path


def _raised(record: dict, name: str, fn) -> None:
    """Records the exception `fn()` raises: its classes (MRO) and its message."""
    try:
        fn()
    except Exception as exc:
        record[f"error/{name}/types"] = np.asarray([c.__name__ for c in type(exc).__mro__])
        record[f"error/{name}/message"] = np.asarray(str(exc))
    else:
        record[f"error/{name}/types"] = np.asarray(["nothing raised"])


def mistakes(mesh, fully_shard, record: dict) -> None:
    """fully_shard before parallelize_module, and TP meshes that do not compose."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    block = build(16).blocks[0]
    fully_shard(block, mesh=mesh["dp"])
    _raised(
        record,
        "parallelize_after",
        lambda: parallelize_module(block, mesh["tp"], {"in_proj": ColwiseParallel()}),
    )
    world = dist.get_world_size()
    others = {
        "other_mesh": init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
        "unnamed_mesh": init_device_mesh("cpu", (world,)),
        "overlapping": mesh["tp"],
    }
    for name, dp_mesh in others.items():
        block = build(16).blocks[0]
        parallelize_module(block, mesh["tp"], {"in_proj": ColwiseParallel()})
        _raised(record, name, lambda b=block, m=dp_mesh: fully_shard(b, mesh=m))


def frontend_refusals(model: nn.Module, out: Path, record: dict) -> None:
    """torch_frontend's own state dicts, checkpoints and clipping refuse TP parameters."""
    import torch_frontend as tf

    _raised(record, "tf_full_state_dict", lambda: tf.full_state_dict(model))
    _raised(record, "tf_load_full_state_dict", lambda: tf.load_full_state_dict(model, {}))
    _raised(record, "tf_save", lambda: tf.save(out / "tf_ckpt", model))
    _raised(record, "tf_clip", lambda: tf.clip_grad_norm_(model.parameters(), 1.0))
    _raised(record, "own_mesh", lambda: own_mesh(tf.fully_shard))


def own_mesh(fully_shard) -> None:
    """A `ShardPlacementResult` on another mesh: FSDP2 makes a second parameter group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("all",))
    dp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    block = build(16).blocks[0]
    fully_shard(block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(None, info))


def run(impl: str, out: Path, rank: int) -> dict[str, np.ndarray]:
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from torch_frontend import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    record: dict[str, np.ndarray] = {}
    models = {}
    for name, (hidden, reshard, ac, dim1, seq) in CASES.items():
        models[name] = parallelize(build(hidden), mesh, fully_shard, reshard, ac, dim1, seq)
        train(models[name], dp_rank, record, name)
    mistakes(mesh, fully_shard, record)
    if impl == "frontend":
        frontend_refusals(models["ac"], out, record)
    hidden = CASES["ac"][0]
    reload_1d(models["ac"], fully_shard, out, hidden, record)
    # DCP into a 2-D model: from the 2-D checkpoint above (2-D -> 2-D) and from a dp-only one.
    load_into_2d(out / "dcp_2d", mesh, fully_shard, hidden, dp_rank, record, "from2d")
    path = save_1d(fully_shard, out, hidden, record)
    load_into_2d(path, mesh, fully_shard, hidden, dp_rank, record, "from1d")
    return record


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--impl", choices=("fsdp2", "frontend"), required=True)
    ap.add_argument("--deadline", type=float, default=120.0)
    args = ap.parse_args()
    out, rank = Path(args.out), int(os.environ.get("RANK", "0"))
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    # A worker whose peer died ends itself.
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    record = run(args.impl, out, rank)
    np.savez(out / f"rank{rank}.npz", **record)
    print(f"rank {rank}: done", flush=True)
    # torch 2.13's gloo teardown sometimes aborts at exit, FSDP2 alone too (DESIGN.md).
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
