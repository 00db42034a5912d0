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

First, in the same job, the parameter-group cases (`groups_and_spmd`): torchtitan's MoE
sharding (experts on a sparse `(efsdp, ep)` mesh through `ShardPlacementResult`, two
groups per block), an HSDP group beside an FSDP one, and `dp_mesh_dims` on the full
`(dp, tp)` mesh (FSDP, HSDP, both dims flattened), with the same records, plus the
mistakes of both APIs.
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
from _launch import settle_gc
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
    """An input layer, `layers` blocks (`Block(hidden)`, or `make_block()`), a head."""

    def __init__(self, hidden: int = 0, layers: int = 2, make_block=None):
        super().__init__()
        self.inp = nn.Linear(5, DIM)
        make_block = make_block or (lambda: Block(hidden))
        self.blocks = nn.ModuleList(make_block() for _ in range(layers))
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


def _record_run(record: dict, prefix: str, model, losses: list, norms: list) -> None:
    """A run's losses, grad norms, full state dict and placements, under `prefix`."""
    record[f"{prefix}/loss"], record[f"{prefix}/norm"] = np.asarray(losses), np.asarray(norms)
    for key, value in full_state(model).items():
        record[f"{prefix}/full/{key}"] = value
    for key, value in placements(model).items():
        record[f"{prefix}/placement/{key}"] = np.asarray(value)


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
    _record_run(record, prefix, model, losses, norms)
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
    """torch_frontend's own checkpoints refuse TP parameters."""
    import torch_frontend as tf

    _raised(record, "tf_save", lambda: tf.save(out / "tf_ckpt", model))


def frontend_tp_tools(
    model: nn.Module, fresh: nn.Module, record: dict, prefix: str, mesh=None, layout=()
) -> None:
    """torch_frontend's full state dict, its load into `fresh` (a 2-D model of other
    values) and clipping, on TP parameters: after one backward (`global_loss`'s with a
    mesh), the norm torchtitan computes and the one `clip_grad_norm_` returns (max_norm
    0.1: it clips), then the norm of the clipped gradients."""
    import torch_frontend as tf

    dp_rank = dist.get_rank() // 2  # init_device_mesh's (dp=2, tp=2) grid, row-major
    global_loss(model, 0, dp_rank, mesh, layout).backward()
    record[f"frontend/{prefix}/norm"] = np.asarray(grad_norm(model))
    record[f"frontend/{prefix}/clip_norm"] = np.asarray(
        tf.clip_grad_norm_(model.parameters(), 0.1).item()
    )
    record[f"frontend/{prefix}/clipped_norm"] = np.asarray(grad_norm(model))
    model.zero_grad()
    full = tf.full_state_dict(model)
    for key, value in full.items():
        record[f"frontend/{prefix}/tf_full/{key}"] = value.detach().numpy().copy()
    tf.load_full_state_dict(fresh, full)
    for key, value in full_state(fresh).items():
        record[f"frontend/{prefix}/tf_loaded/{key}"] = value


def frontend_group_refusals(mesh, record: dict) -> None:
    """What torch_frontend refuses of `dp_mesh_dims` and `ShardPlacementResult` (FSDP2 runs
    some of these): a typed error naming what to do."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    import torch_frontend as tf

    info = FSDPMeshInfo(mesh["dp"], shard_mesh_dim=0)
    dims = DataParallelMeshDims(shard=("tp", "dp"))
    _raised(record, "dims_unordered", lambda: spmd(mesh, tf.fully_shard, dims))
    _raised(
        record,
        "dims_with_result",
        lambda: tf.fully_shard(
            build(16).blocks[0],
            mesh=mesh,
            dp_mesh_dims=DataParallelMeshDims(shard="dp"),
            shard_placement_fn=lambda p: ShardPlacementResult(None, info),
        ),
    )
    _raised(
        record,
        "result_not_info",
        lambda: tf.fully_shard(
            build(16).blocks[0],
            mesh=mesh["dp"],
            shard_placement_fn=lambda p: ShardPlacementResult(None, mesh["dp"]),
        ),
    )


EXPERTS = 4  # the expert stack's leading dim, split over ep (2 per ep rank)


class MoE(nn.Module):
    """A residual block with a dense norm and a stack of experts (`(EXPERTS, DIM, DIM)`).

    Under expert parallelism the stack is a DTensor `Shard(0)` on the `ep` dim of the
    sparse mesh; each rank runs its tokens through its own experts (the ep-local block),
    which is what the parameter groups are about (no token dispatch).
    """

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) / math.sqrt(DIM))

    def forward(self, x):
        from torch.distributed.tensor import DTensor

        experts = self.experts
        local = experts.to_local() if isinstance(experts, DTensor) else experts
        return x + torch.relu(torch.einsum("bd,edh->beh", self.norm(x), local)).mean(1)


def expert_parallel(fully_shard, reshard: bool) -> nn.Module:
    """torchtitan's MoE sharding: dense parameters over all 4 ranks (`dp`), the experts
    split over `ep` and FSDP-sharded on dim 1 over `efsdp` of a sparse `(efsdp, ep)`
    view of the same ranks, through `ShardPlacementResult` (two parameter groups)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard, distribute_tensor

    dense = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    info = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0)
    torch.manual_seed(3)
    model = Model(make_block=MoE)
    for block in model.blocks:
        stack = distribute_tensor(block.experts.detach(), sparse["ep"], [Shard(0)])
        block.experts = nn.Parameter(stack)

    def placement(param):
        return ShardPlacementResult(Shard(1), info) if param.ndim == 3 else None

    for block in model.blocks:
        fully_shard(block, mesh=dense, reshard_after_forward=reshard, shard_placement_fn=placement)
    return fully_shard(model, mesh=dense, reshard_after_forward=reshard)


def groups(model: nn.Module, record: dict, prefix: str) -> None:
    """Each block's parameter groups: how many, and `_fsdp_param_group` refusing them."""
    state = model.blocks[0]._get_fsdp_state()
    record[f"{prefix}/groups"] = np.asarray(len(state._fsdp_param_groups))
    _raised(record, f"{prefix}_one_group", lambda: state._fsdp_param_group)
    fqns = [sorted(p._param_fqn for p in g.fsdp_params) for g in state._fsdp_param_groups]
    record[f"{prefix}/group_fqns"] = np.asarray([", ".join(f) for f in fqns])
    for i, group in enumerate(state._fsdp_param_groups):
        if hasattr(group, "layout"):  # torch_frontend's: where each group's gathers run
            processes = [d.process_index for d in group.layout.mesh.devices.flat]
            record[f"frontend/{prefix}/gather_processes/{i}"] = np.asarray(processes)


def train_global(
    model: nn.Module, record: dict, prefix: str, data_rank: int, mesh=None, layout=()
) -> None:
    """As `train`, on `batch(step, data_rank)`. With a mesh, the input is a DTensor on it
    (placements `layout`) and the loss is the mean over the full output: every data rank's batch
    in rank order, as `full_tensor()` gathers them."""

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        loss = global_loss(model, step, data_rank, mesh, layout)
        loss.backward()
        norms.append(grad_norm(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    _record_run(record, prefix, model, losses, norms)


def global_loss(model: nn.Module, step: int, data_rank: int, mesh=None, layout=()):
    """`train_global`'s loss at `step` (see there)."""
    from torch.distributed.tensor import DTensor

    x, y = batch(step, data_rank)
    if mesh is None:
        out = model(x)
    else:
        out = model(DTensor.from_local(x, mesh, layout)).full_tensor()
        y = torch.cat([batch(step, d)[1] for d in range(len(out) // len(y))])
    return (out - y).pow(2).mean()


# The full-mesh placements of `dp_mesh_dims`' parameters (Replicate on dp): in_proj
# column-parallel, out_proj row-parallel, everything else replicated.
SPMD_TP = {"in_proj.weight": 0, "in_proj.bias": 0, "out_proj.weight": 1}


def spmd(
    mesh, fully_shard, dims, reshard=True, tp=True, on=None, split_dp=False, seed=0
) -> nn.Module:
    """`fully_shard(block, mesh=mesh, dp_mesh_dims=...)` on DTensors of the full mesh.

    `tp=False` replicates every parameter over tp too. The mistakes: `on` another mesh
    than the parameters', `split_dp` a parameter split over dp already.
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = build(16, seed)
    for name, param in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        dim = next((d for k, d in SPMD_TP.items() if name.endswith(k)), None) if tp else None
        placement = [Replicate(), Replicate() if dim is None else Shard(dim)]
        if split_dp and name.endswith("in_proj.weight"):
            placement[0] = Shard(1)
        dtensor = distribute_tensor(param.detach(), mesh, placement)
        setattr(model.get_submodule(owner), attr, nn.Parameter(dtensor))
    on = mesh if on is None else on
    for block in model.blocks:
        fully_shard(block, mesh=on, dp_mesh_dims=dims, reshard_after_forward=reshard)
    return fully_shard(model, mesh=on, dp_mesh_dims=dims, reshard_after_forward=reshard)


def own_mesh(fully_shard, seed: int = 5) -> nn.Module:
    """Plain parameters on two meshes of the same 4 ranks: the blocks' linear layers
    HSDP over a `(replicate=2, shard=2)` mesh of their own (`ShardPlacementResult`), the
    rest FSDP over fully_shard's 4-rank mesh. (A second 1-D mesh of the same 4 ranks
    would share its process group, which FSDP2 refuses: one info per process group.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    dp = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    info = HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)

    def placement(param):
        return ShardPlacementResult(None, info) if param.ndim == 2 else None

    model = build(16, seed=seed)
    for block in model.blocks:
        fully_shard(block, mesh=dp, shard_placement_fn=placement)
    return fully_shard(model, mesh=dp)


def groups_dcp(model: nn.Module, fully_shard, out: Path, record: dict) -> None:
    """DCP: save the two-group model, load it into a fresh one (other initial values)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = out / "dcp_own_mesh"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
    fresh = own_mesh(fully_shard, seed=13)
    sd = get_model_state_dict(fresh)
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(fresh, sd)
    for key, value in full_state(fresh).items():
        record[f"own_mesh/dcp/{key}"] = value


def group_methods(model: nn.Module, record: dict, prefix: str) -> None:
    """FSDPModule's methods on a block of two groups: `unshard(async_op=True)` and
    `reshard` (what the block holds after each), and gradient accumulation without sync
    (`set_requires_gradient_sync(False)` for one microbatch, then a synchronised one)."""

    def held(block: nn.Module) -> np.ndarray:
        return np.asarray([f"{type(p).__name__} {tuple(p.shape)}" for p in block.parameters()])

    block = model.blocks[0]
    handle = block.unshard(async_op=True)
    handle.wait()
    record[f"{prefix}/unsharded"] = held(block)
    block.reshard()
    record[f"{prefix}/resharded"] = held(block)
    rank = dist.get_rank()
    model.set_requires_gradient_sync(False)
    for step in (10, 11):
        if step == 11:
            model.set_requires_gradient_sync(True)
        x, y = batch(step, rank)
        (model(x) - y).pow(2).mean().backward()
    record[f"{prefix}/accumulated_norm"] = np.asarray(grad_norm(model))
    model.zero_grad()


def stock_tools(
    model: nn.Module, fresh: nn.Module, out: Path, record: dict, prefix: str, dp_rank: int
) -> None:
    """PyTorch's own tools on a trained model: `torch.nn.utils.clip_grad_norm_` on the
    next step's gradients (the norm it returns, the norm after), then DCP into `fresh`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import Replicate, Shard

    mesh = next(iter(model.parameters())).device_mesh
    global_loss(model, STEPS, dp_rank, mesh, [Shard(0), Replicate()]).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    record[f"{prefix}/stock/clip_norm"] = np.asarray(float(norm))
    record[f"{prefix}/stock/clipped_norm"] = np.asarray(grad_norm(model))
    path = out / f"dcp_{prefix}"
    dcp.save(get_model_state_dict(model), checkpoint_id=str(path))
    sd = get_model_state_dict(fresh)
    dcp.load(sd, checkpoint_id=str(path))
    set_model_state_dict(fresh, sd)
    for key, value in full_state(fresh).items():
        record[f"{prefix}/stock/dcp/{key}"] = value


def frontend_tools(model: nn.Module, record: dict, prefix: str) -> None:
    """torch_frontend's own full state dict and clipping over a state's several groups."""
    import torch_frontend as tf

    x, y = batch(0, dist.get_rank())
    (model(x) - y).pow(2).mean().backward()
    record[f"frontend/{prefix}/norm"] = np.asarray(grad_norm(model))
    record[f"frontend/{prefix}/clip_norm"] = np.asarray(
        tf.clip_grad_norm_(model.parameters(), 1e9).item()
    )
    for key, value in tf.full_state_dict(model).items():
        record[f"frontend/{prefix}/tf_full/{key}"] = value.detach().numpy().copy()


def groups_and_spmd(mesh, fully_shard, dp_rank: int, record: dict, impl: str, out: Path) -> None:
    """The parameter-group cases: experts on a mesh of their own, and `dp_mesh_dims`."""
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Replicate, Shard

    rank = dist.get_rank()
    for reshard in (True, False):
        prefix = f"moe_{'reshard' if reshard else 'keep'}"
        model = expert_parallel(fully_shard, reshard)
        train_global(model, record, prefix, rank)
        groups(model, record, prefix)
    model = own_mesh(fully_shard)
    train_global(model, record, "own_mesh", rank)
    groups(model, record, "own_mesh")
    groups_dcp(model, fully_shard, out, record)
    group_methods(model, record, "own_mesh")
    if impl == "frontend":
        frontend_tools(model, record, "own_mesh")
    model = spmd(mesh, fully_shard, DataParallelMeshDims(shard="dp"))
    train_global(model, record, "spmd", dp_rank, mesh, [Shard(0), Replicate()])
    groups(model, record, "spmd")
    # HSDP on the full mesh: replicas over dp, shards over tp; each rank its own batch.
    model = spmd(mesh, fully_shard, DataParallelMeshDims(shard="tp", replicate="dp"), tp=False)
    train_global(model, record, "spmd_hsdp", rank, mesh, [Shard(0), Shard(0)])
    # Both dims flattened into one shard dim of 4 ranks.
    model = spmd(mesh, fully_shard, DataParallelMeshDims(shard=("dp", "tp")), tp=False)
    train_global(model, record, "spmd_flat", rank, mesh, [Shard(0), Shard(0)])
    # FSDP2's DDP mode: replication only, over dp (TP over tp stays), and over both dims.
    dims = DataParallelMeshDims(replicate="dp")
    model = spmd(mesh, fully_shard, dims)
    train_global(model, record, "spmd_ddp", dp_rank, mesh, [Shard(0), Replicate()])
    groups(model, record, "spmd_ddp")
    if impl == "frontend":
        fresh = spmd(mesh, fully_shard, dims, seed=7)
        frontend_tp_tools(model, fresh, record, "spmd_ddp", mesh, [Shard(0), Replicate()])
    stock_tools(model, spmd(mesh, fully_shard, dims, seed=11), out, record, "spmd_ddp", dp_rank)
    model = spmd(mesh, fully_shard, DataParallelMeshDims(replicate=("dp", "tp")), tp=False)
    train_global(model, record, "spmd_ddp_flat", rank, mesh, [Shard(0), Shard(0)])
    group_mistakes(mesh, fully_shard, record)


def group_mistakes(mesh, fully_shard, record: dict) -> None:
    """Bad parameter groups and `dp_mesh_dims`: both implementations raise (types compared)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    dims = DataParallelMeshDims(shard="dp")
    cases = {
        "spmd_plain": lambda: fully_shard(build(16).blocks[0], mesh=mesh, dp_mesh_dims=dims),
        "spmd_split_dp": lambda: spmd(mesh, fully_shard, dims, split_dp=True),
        "spmd_unknown_dim": lambda: spmd(mesh, fully_shard, DataParallelMeshDims(shard="x")),
        "spmd_hpz": lambda: spmd(mesh, fully_shard, dims, reshard=2),
        "spmd_unnamed": lambda: spmd(mesh, fully_shard, dims, on=init_device_mesh("cpu", (4,))),
    }
    # One process group, two info objects (the default one and another).
    info = FSDPMeshInfo(mesh["dp"], shard_mesh_dim=0)
    two = lambda p: ShardPlacementResult(None, info) if p.ndim == 2 else None  # noqa: E731
    cases["two_infos"] = lambda: fully_shard(
        build(16).blocks[0], mesh=mesh["dp"], shard_placement_fn=two
    )
    for name, fn in cases.items():
        _raised(record, name, fn)


def run(impl: str, out: Path, rank: int) -> dict[str, np.ndarray]:
    from torch.distributed.device_mesh import init_device_mesh

    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from torch_frontend import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    record: dict[str, np.ndarray] = {}
    groups_and_spmd(mesh, fully_shard, dp_rank, record, impl, out)
    models = {}
    for name, (hidden, reshard, ac, dim1, seq) in CASES.items():
        models[name] = parallelize(build(hidden), mesh, fully_shard, reshard, ac, dim1, seq)
        train(models[name], dp_rank, record, name)
    mistakes(mesh, fully_shard, record)
    if impl == "frontend":
        frontend_refusals(models["ac"], out, record)
        frontend_group_refusals(mesh, record)
        for name in ("ac", "dim1", "seq"):
            hidden, reshard, ac, dim1, seq = CASES[name]
            fresh = parallelize(build(hidden, seed=7), mesh, fully_shard, reshard, ac, dim1, seq)
            frontend_tp_tools(models[name], fresh, record, name)
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
    if args.impl == "frontend":
        import torch_frontend  # noqa: F401  (imported before the collector settles)
    settle_gc()
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
