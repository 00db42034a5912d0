"""One torchrun job for tests/test_torch_frontend.py: the frontend, then PyTorch's FSDP2.

    torchrun --nproc-per-node 2 tests/_torch_worker.py --out DIR [--cases seq,uneven,...]

(or one process per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set by hand;
`--group-first` opens torch's process group before the frontend starts JAX's runtime).

Every case trains one model for STEPS AdamW steps on per-rank data, first with
torch_frontend (collectives through JAX; its `init_distributed` also opens torch's
default process group), then with `torch.distributed.fsdp.fully_shard` on gloo (on
that same group). Each rank writes, per case and implementation,
`{case}-{impl}-rank{r}.npz`: the per-step losses, the local gradients of the first step
and the final local shard of every parameter.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.utils.checkpoint
from _launch import settle_gc
from torch import nn

STEPS = 10
LR = 1e-2
MICROBATCHES = 3


class Block(nn.Module):
    """A pre-norm residual MLP block (a transformer block without attention)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.fail = False  # set by the raise_then_reset case: the forward raises

    def forward(self, x):
        if self.fail:
            raise PlannedFailure("a block's forward raised on purpose")
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class PlannedFailure(RuntimeError):
    pass


class Stack(nn.Module):
    def __init__(self, inputs: int = 8, width: int = 16, outputs: int = 4, depth: int = 3):
        super().__init__()
        self.emb = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class CheckpointedStack(Stack):
    """Stack with `torch.utils.checkpoint` (non-reentrant) around each block."""

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
        return self.head(h)


VOCAB, TOKENS = 12, 5


class TiedLM(nn.Module):
    """A tiny language model whose output head shares the input embedding's weight."""

    def __init__(self, width: int = 16, depth: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = self.emb(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _tokens(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 100 * step + 10 * micro + rank)
    return (
        torch.randint(0, VOCAB, (4, TOKENS), generator=g),
        torch.randn(4, TOKENS, VOCAB, generator=g),
    )


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


@dataclasses.dataclass(frozen=True)
class Case:
    """A model, its units (each gets its own fully_shard before the root) and options."""

    build: Callable[[], nn.Module]
    units: Callable[[nn.Module], list[nn.Module]]
    unit_kwargs: dict = dataclasses.field(default_factory=dict)
    policy: dict | None = None  # MixedPrecisionPolicy fields, for every unit and the root
    microbatches: int = 1
    configure: Callable[[nn.Module], None] | None = None  # after fully_shard
    data: Callable[[int, int, int], tuple] | None = None  # (step, micro, rank) -> (x, y)
    fail_at: int | None = None  # this step's forward raises in blocks[1]: reset, skip it
    eval_block: bool = False  # after every step, blocks[0] alone under no_grad
    flat_mesh: bool = False  # a 1-D mesh over every rank, even in an HSDP job
    frontend_only: bool = False  # FSDP2 refuses it: compared with another case instead
    sync: str = "set_requires_gradient_sync"  # the method that skips sync on microbatches


def _explicit_prefetch(model: nn.Module) -> None:
    blocks = list(model.blocks)
    for before, after in itertools.pairwise(blocks):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model if isinstance(m, nn.Linear)]


def _shard_columns(param: nn.Parameter):
    """FSDP2's shard_placement_fn: weights on dim 1, biases on dim 0."""
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim == 2 else None


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks)


CASES = {
    "seq": Case(lambda: _mlp(16, 15, 8), _linears),
    "uneven": Case(lambda: _mlp(7, 15, 3, 1), _linears),
    "shard_dim1": Case(lambda: _mlp(16, 14, 8), _linears, {"shard_placement_fn": _shard_columns}),
    # Uneven columns (16 and 15 over 2 ranks), which FSDP2 refuses: same model as "seq".
    "shard_dim1_uneven": Case(
        lambda: _mlp(16, 15, 8),
        _linears,
        {"shard_placement_fn": _shard_columns},
        frontend_only=True,
    ),
    "blocks_reshard": Case(Stack, _blocks, {"reshard_after_forward": True}),
    "blocks_keep": Case(Stack, _blocks, {"reshard_after_forward": False}),
    "accum": Case(lambda: _mlp(16, 15, 8), _linears, microbatches=MICROBATCHES),
    # HSDP: reduce-scatter every microbatch, all-reduce over the replicas on the last.
    "accum_all_reduce": Case(
        lambda: _mlp(16, 15, 8), _linears, microbatches=MICROBATCHES, sync="set_requires_all_reduce"
    ),
    "bf16": Case(
        Stack, _blocks, policy={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    ),
    "prefetch": Case(Stack, _blocks, configure=_explicit_prefetch),
    "raise_then_reset": Case(Stack, _blocks, fail_at=3),
    "tied_embeddings": Case(TiedLM, lambda m: [[m.emb, m.head], *m.blocks], data=_tokens),
    "submodule_forward": Case(Stack, _blocks, eval_block=True),
    "checkpointed_blocks": Case(CheckpointedStack, _blocks),
    # hpZ: keep 1/2 after forward; the backward gathers within pairs of ranks.
    "blocks_hpz": Case(Stack, _blocks, {"reshard_after_forward": 2}, flat_mesh=True),
}


def _input_width(model: nn.Module) -> int:
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    return first.in_features


def _batch(step: int, micro: int, rank: int, width: int, outputs: int):
    g = torch.Generator().manual_seed(1000 + 100 * step + 10 * micro + rank)
    return torch.randn(4, width, generator=g), torch.randn(4, outputs, generator=g)


def _output_width(model: nn.Module) -> int:
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    return last.out_features


def train(case: str, shard, policy_cls, rank: int) -> dict[str, np.ndarray]:
    """Trains `case` with `shard` (a fully_shard); returns losses, gradients and shards."""
    spec = CASES[case]
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = spec.build()
    if spec.data is None:
        width, outputs = _input_width(model), _output_width(model)
        data = lambda step, m: _batch(step, m, rank, width, outputs)  # noqa: E731
    else:
        data = lambda step, m: spec.data(step, m, rank)  # noqa: E731
    kwargs = {} if spec.policy is None else {"mp_policy": policy_cls(**spec.policy)}
    kwargs["flat"] = spec.flat_mesh
    for unit in spec.units(model):
        shard(unit, **spec.unit_kwargs, **kwargs)
    shard(model, **kwargs)
    if spec.configure is not None:
        spec.configure(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, times, evals = [], [], []
    for step in range(STEPS):
        start = time.perf_counter()
        total = 0.0
        if step == spec.fail_at:
            model.blocks[1].fail = True
            try:
                x, y = data(step, 0)
                (model(x).float() - y).pow(2).mean().backward()
                raise AssertionError("the planned failure did not happen")
            except PlannedFailure:
                model.reset_iter_state()  # on the root: as if the step never ran
                opt.zero_grad()
            finally:
                model.blocks[1].fail = False
            continue
        for m in range(spec.microbatches):
            getattr(model, spec.sync)(m == spec.microbatches - 1)
            x, y = data(step, m)
            loss = (model(x).float() - y).pow(2).mean() / spec.microbatches
            loss.backward()
            total += loss.item()
        if step == 0:  # AdamW hides a gradient's scale: compare gradients themselves too
            grads = {f"grad/{n}": _local(p.grad) for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
        times.append(time.perf_counter() - start)
        if spec.eval_block:  # e.g. evaluating one block: that forward's root is the block
            h = torch.randn(
                3, model.blocks[0].up.in_features, generator=torch.Generator().manual_seed(step)
            )
            with torch.no_grad():
                evals.append(model.blocks[0](h).numpy().copy())
    out = {"loss": np.asarray(losses), **grads}
    if evals:
        out["eval"] = np.stack(evals)
    out["step_seconds"] = np.asarray(times)  # for reports: not compared
    for name, param in model.named_parameters():
        out[f"param/{name}"] = _local(param)
    return out


def _local(tensor: torch.Tensor) -> np.ndarray:
    """This rank's shard of a parameter or gradient (FSDP2's are DTensors)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().numpy().copy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--impls", default="frontend,fsdp2")
    ap.add_argument("--deadline", type=float, default=300.0)
    ap.add_argument("--replicate", type=int, default=None, help="HSDP: number of replicas")
    ap.add_argument(
        "--group-first", action="store_true", help="open torch's process group before JAX's"
    )
    args = ap.parse_args()
    out, cases, impls = Path(args.out), args.cases.split(","), args.impls.split(",")
    rank = int(os.environ.get("RANK", "0"))
    # torchrun starts each worker in a session of its own: the test kills these by pid,
    # and a worker whose peers died (blocked in a collective) ends itself.
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(args.deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    if args.group_first:  # as an FSDP2 script does, before init_distributed
        import torch.distributed as dist

        dist.init_process_group("gloo")

    if "frontend" in impls:
        import funshard
        import torch_frontend
        from torch_frontend import _bridge

        mesh = torch_frontend.init_distributed(replicate=args.replicate)
        flat_mesh = funshard.make_mesh() if args.replicate else mesh
        gather_worlds: list[int] = []  # the group size of every all-gather, in order
        all_reduces: list[bool] = []  # whether each reduce-scatter all-reduced (HSDP)
        start_all_gather, reduce_scatter = _bridge.start_all_gather, _bridge.start_reduce_scatter

        def recording(layout, *args):
            gather_worlds.append(layout.world)
            return start_all_gather(layout, *args)

        def recording_reduce(layout, fulls, dims=None, all_reduce=True):
            all_reduces.append(all_reduce)
            return reduce_scatter(layout, fulls, dims, all_reduce)

        _bridge.start_all_gather, _bridge.start_reduce_scatter = recording, recording_reduce

        from funshard import comm
        from torch_frontend import _flat

        flats: list[tuple[int, int]] = []  # (address, bytes) of each flat gradient buffer
        rows_in_place: list[bool] = []  # per reduce-scatter by rows: rows read in place
        reduce_input, reduce_rows = _flat.reduce_input, comm.eager_reduce_scatter_rows

        def recording_input(*args):
            flat = reduce_input(*args)
            flats.append((flat.data_ptr(), flat.numel() * flat.element_size()))
            return flat

        def recording_rows(rows, *args, **kwargs):
            def inside(row) -> bool:
                at = row.addressable_shards[0].data.unsafe_buffer_pointer()
                return any(start <= at < start + size for start, size in flats)

            rows_in_place.append(all(inside(r) for parts in rows for r in parts))
            return reduce_rows(rows, *args, **kwargs)

        _flat.reduce_input, comm.eager_reduce_scatter_rows = recording_input, recording_rows
        settle_gc()
        for case in cases:
            gather_worlds.clear()
            all_reduces.clear()
            rows_in_place.clear()
            result = train(
                case,
                lambda m, flat=False, **kw: torch_frontend.fully_shard(
                    m, mesh=flat_mesh if flat else mesh, **kw
                ),
                torch_frontend.MixedPrecisionPolicy,
                rank,
            )
            np.savez(
                out / f"{case}-frontend-rank{rank}.npz",
                gather_worlds=np.asarray(gather_worlds),
                all_reduces=np.asarray(all_reduces),
                rows_in_place=np.asarray(rows_in_place),
                **result,
            )
    if "fsdp2" in impls:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():  # the frontend opened the default group already
            dist.init_process_group("gloo")
        world = dist.get_world_size()
        if args.replicate is None:
            mesh = init_device_mesh("cpu", (world,))
        else:  # HSDP: replicas of a model sharded over world // replicate ranks
            mesh = init_device_mesh(
                "cpu",
                (args.replicate, world // args.replicate),
                mesh_dim_names=("replicate", "shard"),
            )
        flat_mesh = init_device_mesh("cpu", (world,)) if args.replicate else mesh
        for case in (c for c in cases if not CASES[c].frontend_only):
            np.savez(
                out / f"{case}-fsdp2-rank{rank}.npz",
                **train(
                    case,
                    lambda m, flat=False, **kw: fully_shard(
                        m, mesh=flat_mesh if flat else mesh, **kw
                    ),
                    MixedPrecisionPolicy,
                    rank,
                ),
            )
        dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
