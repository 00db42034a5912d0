"""torch_frontend against PyTorch itself: FSDP2 on gloo (2 processes) and plain torch (1).

The multi-process cases run in ONE torchrun job (`tests/_torch_worker.py`): each rank
trains every case with torch_frontend, then with `torch.distributed.fsdp.fully_shard`,
and writes per-step losses and its local shards; the tests compare them. The
single-process tests (world size 1) run in this process.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import Job, clean_env, free_port, run
from _torch_worker import Stack
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import torch_frontend
from torch_frontend import FSDPModule, MixedPrecisionPolicy, fully_shard

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_torch_worker.py")
JOB_TIMEOUT_S = 180
CASES = (
    "seq",
    "uneven",
    "shard_dim1",
    "shard_dim1_uneven",
    "blocks_reshard",
    "blocks_keep",
    "accum",
    "bf16",
    "prefetch",
    "raise_then_reset",
    "tied_embeddings",
    "submodule_forward",
    "checkpointed_blocks",
)
HSDP_CASES = ("seq", "uneven", "blocks_reshard")
FOUR_PROCESS_CASES = (*HSDP_CASES, "accum_all_reduce", "blocks_hpz")  # hpz: a 1-D mesh
TOLERANCE = 1e-5


def _job(tmp_path_factory, name: str, processes: int, cases, *args: str) -> Path:
    out = tmp_path_factory.mktemp(name)
    job = Job(
        WORKER,
        out,
        processes,
        free_port(pair=True),
        JOB_TIMEOUT_S,
        "--cases",
        ",".join(cases),
        *args,
    )
    assert job.wait() == 0, job.failure()
    return out


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory) -> Path:
    return _job(tmp_path_factory, "torch_parity", 2, CASES)


@pytest.fixture(scope="module")
def hsdp_dir(tmp_path_factory) -> Path:
    return _job(tmp_path_factory, "torch_hsdp", 4, FOUR_PROCESS_CASES, "--replicate", "2")


def _load(out: Path, case: str, impl: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{case}-{impl}-rank{rank}.npz") as data:
        return dict(data)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "shard_dim1_uneven"])
def test_matches_fsdp2_on_two_processes(parity_dir, case):
    _assert_matches_fsdp2(parity_dir, case, 2)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", (*HSDP_CASES, "accum_all_reduce"))
def test_hsdp_2x2_matches_fsdp2_on_four_processes(hsdp_dir, case):
    _assert_matches_fsdp2(hsdp_dir, case, 4)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_shards_on_dim_1_train_like_fsdp2_on_dim_0(parity_dir):
    # FSDP2 refuses uneven Shard(1); torch_frontend takes it (torch.chunk on dim 1): the
    # same model and data as "seq" must give FSDP2's losses and full parameters.
    for rank in range(2):
        ours = _load(parity_dir, "shard_dim1_uneven", "frontend", rank)
        theirs = _load(parity_dir, "seq", "fsdp2", rank)
        np.testing.assert_allclose(ours["loss"], theirs["loss"], rtol=0, atol=TOLERANCE)
        assert ours["param/2.weight"].shape == (8, 8 - rank)  # 15 columns: 8 + 7
    for name in ("0.weight", "2.weight"):
        ours = np.concatenate(
            [
                _load(parity_dir, "shard_dim1_uneven", "frontend", r)[f"param/{name}"]
                for r in range(2)
            ],
            axis=1,
        )
        theirs = np.concatenate(
            [_load(parity_dir, "seq", "fsdp2", r)[f"param/{name}"] for r in range(2)], axis=0
        )
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOLERANCE, err_msg=name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_set_requires_all_reduce_false_skips_only_the_replica_all_reduce(hsdp_dir):
    # 2 units x 3 microbatches per step: only the last microbatch all-reduces.
    ours = _load(hsdp_dir, "accum_all_reduce", "frontend", 0)
    steps = len(ours["loss"])
    assert ours["all_reduces"].tolist() == [False, False, False, False, True, True] * steps


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hpz_reshard_after_forward_2_matches_fsdp2_on_four_processes(hsdp_dir):
    _assert_matches_fsdp2(hsdp_dir, "blocks_hpz", 4)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hpz_backward_gathers_within_pairs_of_ranks(hsdp_dir):
    # Per step: the root (kept gathered) and 3 blocks gather over all 4 ranks in
    # forward; each block gathers its kept halves within its pair (2 ranks) in backward.
    worlds = _load(hsdp_dir, "blocks_hpz", "frontend", 0)["gather_worlds"]
    steps = len(_load(hsdp_dir, "blocks_hpz", "frontend", 0)["loss"])
    assert worlds.tolist() == [4, 4, 4, 4, 2, 2, 2] * steps


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gradients_cross_to_the_gloo_reduce_scatter_in_place(parity_dir, hsdp_dir):
    # Over gloo a reduce-scatter is collective permutes of rows (jax-ml/jax#40830); the
    # flat gradient buffer's rows are 64-byte aligned, so every row JAX sends or adds
    # is read where torch wrote it, with no copy (a misaligned import would copy).
    for out, case in (
        (parity_dir, "blocks_reshard"),
        (parity_dir, "bf16"),
        (parity_dir, "shard_dim1"),
        (hsdp_dir, "blocks_reshard"),
    ):
        ours = _load(out, case, "frontend", 1)
        steps = len(ours["loss"])
        assert len(ours["rows_in_place"]) >= steps and ours["rows_in_place"].all(), case


def _assert_matches_fsdp2(out: Path, case: str, processes: int):
    for rank in range(processes):
        ours, theirs = _load(out, case, "frontend", rank), _load(out, case, "fsdp2", rank)
        del ours["step_seconds"], theirs["step_seconds"], ours["gather_worlds"], ours["all_reduces"]
        del ours["rows_in_place"]
        assert sorted(ours) == sorted(theirs)
        np.testing.assert_allclose(
            ours["loss"],
            theirs["loss"],
            rtol=0,
            atol=TOLERANCE,
            err_msg=f"{case}: per-step loss, rank {rank}",
        )
        for name, shard in theirs.items():
            # Same local shard shapes (torch.chunk's, empty ones included) and values.
            assert ours[name].shape == shard.shape, (case, rank, name)
            np.testing.assert_allclose(
                ours[name], shard, rtol=0, atol=TOLERANCE, err_msg=f"{case}: {name}, rank {rank}"
            )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_uneven_shards_follow_torch_chunk(parity_dir):
    # Linear(3, 1) on 2 ranks: rank 1's chunk of the (1, 3) weight and (1,) bias is empty.
    shapes = [
        {k: v.shape for k, v in _load(parity_dir, "uneven", "frontend", r).items()}
        for r in range(2)
    ]
    assert shapes[0]["param/2.weight"] == (2, 15) and shapes[1]["param/2.weight"] == (1, 15)
    assert shapes[0]["param/4.weight"] == (1, 3) and shapes[1]["param/4.weight"] == (0, 3)
    assert shapes[1]["param/4.bias"] == (0,)


# ---- one process (world size 1), in this process ----


def _full(tensor: torch.Tensor) -> np.ndarray:
    """A managed parameter or gradient (a DTensor) as the whole array; plain tensors as-is."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().numpy()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 8))


def _shard_mlp(model: nn.Sequential, **kwargs) -> nn.Sequential:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    return fully_shard(model)


def _batches(steps: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]


def _train(model, batches, fail_at: int | None = None, fail_in: str = "forward") -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(batches):
        if step == fail_at:
            with pytest.raises(ZeroDivisionError):
                _failing_step(model, x, fail_in)
            opt.zero_grad()
            model.reset_iter_state()
            continue
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _fail(*_):
    return 1 / 0


def _hook_fail(out: torch.Tensor) -> None:
    out.register_hook(_fail)


def _failing_step(model, x, where: str):
    """A step that raises inside the last unit's forward, or in backward between units."""
    if where == "forward":
        handle = model[2].register_forward_hook(_fail)
    else:  # after the last unit's post-backward, before the first unit's backward
        handle = model[1].register_forward_hook(lambda _m, _i, out: _hook_fail(out))
    try:
        model(x).pow(2).mean().backward()
    finally:
        handle.remove()


def test_single_process_matches_plain_torch():
    torch_frontend.init_distributed()
    reference, model = _mlp(), _shard_mlp(_mlp())
    assert type(model).__name__ == "FSDPSequential" and isinstance(model, FSDPModule)
    assert isinstance(model[0], FSDPModule) and isinstance(model[0], nn.Linear)
    batches = _batches(10)
    np.testing.assert_allclose(_train(model, batches), _train(reference, batches), atol=1e-6)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert ours.shape == theirs.shape, name
        np.testing.assert_allclose(_full(ours), theirs.detach(), atol=1e-6, err_msg=name)


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_reset_iter_state_after_an_exception_trains_as_if_the_step_never_ran(fail_in):
    batches = _batches(6)
    reference = _mlp()
    expected = _train(reference, batches[:2] + batches[3:])
    model = _shard_mlp(_mlp())
    got = _train(model, batches, fail_at=2, fail_in=fail_in)
    np.testing.assert_allclose(got, expected, atol=1e-6)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(_full(ours), theirs.detach(), atol=1e-6)


def test_reshard_after_forward_false_keeps_parameters_gathered():
    model = _shard_mlp(_mlp(), reshard_after_forward=False)
    model(torch.randn(2, 16))
    assert model[0].weight.shape == (15, 16)  # the unsharded parameter stays bound
    model.reshard()
    model[0].reshard()
    model[0].unshard()
    assert model[0].weight.shape == (15, 16)
    model[0].reshard()
    assert model[0].weight is next(model[0].parameters())


def test_child_forward_before_root_is_an_error():
    model = _shard_mlp(_mlp())
    model[0](torch.randn(2, 16))
    with pytest.raises(RuntimeError, match=r"module '0' already ran forward on its own"):
        model(torch.randn(2, 16))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_parameter_in_two_groups_is_an_error_naming_it():
    model = _Tied()
    fully_shard(model.emb)
    fully_shard(model.head)
    fully_shard(model)
    with pytest.raises(
        ValueError,
        match=(
            r"'head\.weight' is shared with a parameter already managed by another FSDP "
            r"group \(as 'emb\.weight'\).*fully_shard\(\[module_a, module_b\]\)"
        ),
    ):
        model(torch.randn(2, 4))


def test_tied_parameters_grouped_in_one_list_train_like_plain_torch():
    torch.manual_seed(0)
    reference = _Tied()
    model = copy.deepcopy(reference)
    fully_shard([model.emb, model.head])
    fully_shard(model)
    assert len(list(model.parameters())) == 1
    x = torch.randn(3, 4)
    for m in (model, reference):
        m(x).pow(2).sum().backward()
    np.testing.assert_allclose(
        _full(next(model.parameters()).grad), reference.emb.weight.grad, atol=1e-6
    )


def test_reset_iter_state_on_a_non_root_is_an_error():
    model = _shard_mlp(_mlp())
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match=r"module '2' is not the root"):
        model[2].reset_iter_state()


def test_group_of_modules_as_root_is_an_error():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fully_shard([a, b])
    with pytest.raises(RuntimeError, match="the root must be a single module"):
        a(torch.randn(2, 4))


def test_errors_keep_fsdp2s_builtin_types():
    from funshard import errors

    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="must be a callable") as info:
        fully_shard(model, shard_placement_fn="dim 1")
    assert isinstance(info.value, errors.FunshardError)  # and still FSDP2's TypeError
    fully_shard(model)
    with pytest.raises(ValueError, match="already fully sharded") as info:
        fully_shard(model)
    assert isinstance(info.value, errors.FunshardError)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    fully_shard([a, b])
    with pytest.raises(RuntimeError, match="the root must be a single module") as info:
        a(torch.randn(2, 4))
    assert type(info.value) is RuntimeError  # FSDP2's state errors stay plain


def test_policy_validates_its_dtypes():
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)


@pytest.mark.multiprocess
def test_import_funshard_does_not_import_torch():
    code = "import sys, funshard, funshard.distributed; sys.exit('torch' in sys.modules)"
    done = run(
        [sys.executable, "-c", code], env=clean_env(), timeout=120, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:] or "import funshard imported torch"


def test_one_core_collective_per_group_and_none_without_gradient_sync(monkeypatch):
    # One collective of ONE operand per group (its parameters in one flat buffer):
    # over gloo each operand of a collective costs a round of its own.
    from funshard import comm

    calls = []
    for name in ("eager_all_gather", "eager_reduce_scatter"):
        real = getattr(comm, name)

        def counted(datas, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, len(datas)))
            return _real(datas, *args, **kwargs)

        monkeypatch.setattr(comm, name, counted)
    model = _shard_mlp(_mlp())  # two units of 2 parameters each; the root has none
    model.set_requires_gradient_sync(False)
    model(torch.randn(2, 16)).sum().backward()
    # Forward: one gather per unit; backward: one re-gather per unit, no reduction.
    assert calls == [("eager_all_gather", 1)] * 4
    calls.clear()
    model.set_requires_gradient_sync(True)
    model(torch.randn(2, 16)).sum().backward()
    gather, reduce = ("eager_all_gather", 1), ("eager_reduce_scatter", 1)
    # Backward: each gather is dispatched one unit ahead (the default prefetch: the root
    # prefetches the last unit, which prefetches the first); the last unit reduces when
    # its backward is done, the first (whose input needs no gradient) in the root's
    # final callback.
    assert calls == [gather, gather, gather, gather, reduce, reduce]
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


class _CheckpointedStack(Stack):
    """Stack whose blocks are recomputed in backward (non-reentrant checkpointing)."""

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return self.head(h)


def _stack_pair(cls=Stack, **kwargs):
    torch.manual_seed(0)
    reference = Stack()
    model = cls()
    model.load_state_dict(reference.state_dict())
    for block in model.blocks:
        fully_shard(block, **kwargs)
    return reference, fully_shard(model, **kwargs)


def _assert_same(model, reference, what: str = "grad"):
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        ours, theirs = (ours.grad, theirs.grad) if what == "grad" else (ours, theirs)
        np.testing.assert_allclose(_full(ours), theirs.detach(), atol=1e-6, err_msg=name)


def test_activation_checkpointing_finds_parameters_gathered():
    reference, model = _stack_pair(_CheckpointedStack)
    runs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, _: runs.append(m))
    shards = list(model.parameters())
    x = torch.randn(3, 8)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    assert len(runs) == 6  # every block ran again in backward, its parameters gathered
    _assert_same(model, reference)
    assert all(p is q for p, q in zip(model.parameters(), shards, strict=True))  # resharded


def test_forward_of_a_submodule_alone_between_steps():
    reference, model = _stack_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(3, 8)
        for m, o in ((model, opt), (reference, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        h = torch.randn(3, 16)
        with torch.no_grad():  # e.g. evaluating one block: it is this forward's root
            np.testing.assert_allclose(model.blocks[1](h), reference.blocks[1](h), atol=1e-6)
        # Resharded after its forward: the block holds the optimizer's shards again.
        assert any(model.blocks[1].up.weight is p for p in opt.param_groups[0]["params"])
    _assert_same(model, reference, "param")


def test_mixed_precision_gathers_in_param_dtype_and_keeps_fp32_shards():
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )
    model = _shard_mlp(_mlp(), mp_policy=policy, reshard_after_forward=False)
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    out = model(torch.randn(2, 16))
    assert seen == [(torch.bfloat16, torch.bfloat16)] and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())


def test_gathered_parameters_and_shards_cross_dlpack_without_copies(monkeypatch):
    # As FSDP2's, a group's shards are copied into one flat buffer (copy-in) and the
    # gathered buffer into the parameters (copy-out); between the two, the buffers
    # cross to JAX and back through DLPack, without a copy.
    from funshard import comm
    from torch_frontend import _flat

    inputs, outputs, flats, gathered = [], [], [], []
    real, copy_in, copy_out = comm.eager_all_gather, _flat.copy_in, _flat.copy_out

    def recording(datas, *args, **kwargs):
        fulls = real(datas, *args, **kwargs)
        inputs.extend(d.addressable_shards[0].data.unsafe_buffer_pointer() for d in datas)
        outputs.extend(f.addressable_shards[0].data.unsafe_buffer_pointer() for f in fulls)
        return fulls

    def recording_in(*args):
        flat = copy_in(*args)
        flats.append(flat.data_ptr())
        return flat

    def recording_out(bucket, full, *args):
        gathered.append(full.data_ptr())
        return copy_out(bucket, full, *args)

    monkeypatch.setattr(comm, "eager_all_gather", recording)
    monkeypatch.setattr(_flat, "copy_in", recording_in)
    monkeypatch.setattr(_flat, "copy_out", recording_out)
    model = _shard_mlp(_mlp(), reshard_after_forward=False)
    model(torch.randn(2, 16))
    assert len(inputs) == 2 and inputs == flats  # JAX read torch's flat buffers
    assert outputs == gathered  # torch copied out of JAX's own output buffers
    assert not set(outputs) & set(inputs)


def test_reduce_scatter_overlaps_the_next_groups_backward(monkeypatch):
    # FSDP2's schedule: a group's reduce-scatter is started at its post-backward and
    # completed at the next group's, before that group's own starts (at most one in
    # flight, and its buffers freed before the next are allocated), the last one at the
    # end of the backward, before the optimizer can read the gradients.
    from torch_frontend import _bridge

    reference, model = _stack_pair()
    events = []
    start, finish = _bridge.start_reduce_scatter, _bridge.finish_reduce_scatter
    monkeypatch.setattr(
        _bridge, "start_reduce_scatter", lambda *a, **k: events.append("start") or start(*a, **k)
    )
    monkeypatch.setattr(
        _bridge, "finish_reduce_scatter", lambda pending: events.append("finish") or finish(pending)
    )
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    groups = len(model.blocks) + 1  # the blocks and the root
    assert events == ["start"] + ["finish", "start"] * (groups - 1) + ["finish"]
    _assert_same(model, reference)


def test_resharded_modules_keep_no_gathered_bytes_in_autograd():
    # A linear saves `weight.t()`, a view, for its backward. With reshard_after_forward
    # the view must hold the parameter's own storage (freed, re-filled by the backward's
    # gather, as FSDP2's copy-out), never the gather's buffer: else every block's full
    # weights stay alive from forward to backward (the 2x step peak once measured).
    model, reference = _shard_mlp(_mlp(), reshard_after_forward=True), _mlp()
    weights = [model[0], model[2]]
    saved = []
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(x)
    shapes = {tuple(m.weight.shape[::-1]) for m in weights}
    # Sizes only: printing a tensor whose storage is freed would read freed memory.
    held = [t.untyped_storage().nbytes() for t in saved if tuple(t.shape) in shapes]
    assert held == [0, 0]
    out.sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    reference(x_ref).sum().backward()
    np.testing.assert_allclose(x.grad, x_ref.grad, atol=1e-6)
    for mine, theirs in zip(weights, [reference[0], reference[2]], strict=True):
        np.testing.assert_allclose(mine.weight.grad.full_tensor(), theirs.weight.grad, atol=1e-6)


@pytest.mark.parametrize(
    "policy", [MixedPrecisionPolicy(), MixedPrecisionPolicy(param_dtype=torch.bfloat16)]
)
def test_no_jax_array_holds_a_shard_when_the_optimizer_writes_it(policy):
    # JAX treats its arrays as immutable: the arrays over the shards (and over their
    # cast buffers) live only while a gather runs, never across optimizer.step().
    import jax

    model = _shard_mlp(_mlp(), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    states = [m._get_fsdp_state() for m in (model[0], model[2], model)]
    for _ in range(2):
        model(torch.randn(2, 16)).pow(2).sum().backward()
        torch_buffers = {
            p._sharded_param_data.untyped_storage().data_ptr()
            for s in states
            for p in s._fsdp_param_group.fsdp_params
        }
        jax_buffers = {
            shard.data.unsafe_buffer_pointer()
            for a in jax.live_arrays()
            for shard in a.addressable_shards
        }
        assert torch_buffers and not torch_buffers & jax_buffers
        opt.step()
        opt.zero_grad()


def test_fsdp2s_private_names_reach_the_same_state():
    # Code written against FSDP2's internals (PyTorch's own FSDP2 tests, debugging
    # scripts) walks module._get_fsdp_state()._fsdp_param_group.fsdp_params[i]...
    from torch_frontend._state import get_module_fsdp_state

    model = _shard_mlp(_mlp())
    root, inner = model._get_fsdp_state(), model[0]._get_fsdp_state()
    assert get_module_fsdp_state(model) is root and get_module_fsdp_state(model[1]) is None
    group = inner._fsdp_param_group
    sharded = [p.sharded_param for p in group.fsdp_params]
    assert sharded[0] is model[0].weight and sharded[1] is model[0].bias
    assert group.is_sharded and not group.is_unsharded and root._is_root is None
    model(torch.randn(2, 16)).sum().backward()
    assert root._is_root is True and inner._is_root is False
    assert root._state_ctx.all_states == [root, inner, model[2]._get_fsdp_state()]
    assert group._module_fqn == "0" and group._training_state.name == "IDLE"
    model[0].unshard()
    param = group.fsdp_params[0]
    assert group.is_unsharded
    assert model[0].weight is param._unsharded_param is param.unsharded_param
    assert param._sharded_local_tensor.data_ptr() == param._sharded_param_data.data_ptr()
    model[0].reshard()
    assert group.is_sharded and model[0].weight is param.sharded_param


def _record_gathers(monkeypatch) -> list[int]:
    """The number of tensors of every group all-gather started, in order."""
    from torch_frontend import _flat

    gathers = []
    real = _flat.copy_in
    monkeypatch.setattr(
        _flat, "copy_in", lambda bucket, *a: gathers.append(len(bucket.members)) or real(bucket, *a)
    )
    return gathers


def test_default_forward_prefetch_follows_the_last_iterations_order(monkeypatch):

    reference, model = _stack_pair()
    gathers = _record_gathers(monkeypatch)
    entered = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, _: entered.append(len(gathers)))
    for step in range(2):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        for m in (model, reference):
            m(x).pow(2).mean().backward()
        _assert_same(model, reference)
    # 7 gathers a step: root, 3 blocks in forward, 3 blocks again in backward. At a
    # block's entry (after its own pre-forward hook) iteration 1 has started the root's
    # and that block's own gathers; iteration 2 (order learned) has also started the
    # next block's, so blocks 1 and 2 find theirs dispatched a block earlier.
    assert len(gathers) == 14
    assert entered[:3] == [2, 3, 4]
    assert [e - 7 for e in entered[3:]] == [3, 4, 4]


def test_only_the_last_backward_ends_the_iteration(monkeypatch):
    # Two microbatches, the first backward marked not last: its gradients add up as in
    # plain torch, and the forward order is learned once, from one pass (the default
    # prefetch of the next iteration starts each block's gather one block early).

    reference, model = _stack_pair()
    gathers = _record_gathers(monkeypatch)
    entered = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, _: entered.append(len(gathers)))
    for step in range(2):
        for micro in range(2):
            model.set_is_last_backward(micro == 1)
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            for m in (model, reference):
                m(x).pow(2).mean().backward()
        _assert_same(model, reference)
    assert len(gathers) == 28  # 7 a microbatch
    assert [e - 21 for e in entered[9:]] == [3, 4, 4]  # step 2, microbatch 2


def test_explicit_prefetch_dispatches_the_next_gathers_early(monkeypatch):

    reference, model = _stack_pair()
    blocks = list(model.blocks)
    blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])
    gathers = _record_gathers(monkeypatch)
    entered = []
    for block in blocks:
        block.register_forward_pre_hook(lambda m, _: entered.append(len(gathers)))
    x = torch.randn(3, 8)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    # Root (emb + head: 4 tensors), block 0, then blocks 1 and 2 at once; each block has
    # 6 tensors. Blocks 1 and 2 found their gathers dispatched already.
    assert gathers[:4] == [4, 6, 6, 6] and entered == [4, 4, 4]
    _assert_same(model, reference)


def test_unshard_async_op_returns_a_handle_that_binds_on_wait():
    model = _shard_mlp(_mlp(), reshard_after_forward=False)
    shard = model[0].weight
    handle = model[0].unshard(async_op=True)
    assert model[0].weight is shard  # dispatched only
    handle.wait()
    full = model[0].weight
    assert full is not shard and torch.equal(full, shard.full_tensor())
    model[0].unshard()  # already gathered: nothing happens
    assert model[0].weight is full
    model[0].reshard()
    assert model[0].weight is shard


class _Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def generate(self, x):
        return self.proj.weight @ x.T


def test_register_fsdp_forward_method_gathers_for_that_method():
    torch.manual_seed(0)
    reference = _Generator()
    model = copy.deepcopy(reference)
    fully_shard(model, reshard_after_forward=True)
    torch_frontend.register_fsdp_forward_method(model, "generate")
    x = torch.randn(2, 4)
    np.testing.assert_allclose(
        model.generate(x).detach(), reference.generate(x).detach(), atol=1e-6
    )


def test_register_fsdp_forward_method_as_in_fsdp2():
    plain = _Generator()
    torch_frontend.register_fsdp_forward_method(plain, "generate")  # not sharded: a no-op
    assert "generate" not in vars(plain)
    model = fully_shard(_Generator())
    with pytest.raises(ValueError, match="_Generator has no method 'sample'"):
        torch_frontend.register_fsdp_forward_method(model, "sample")


def test_ignored_params_are_left_alone():
    torch.manual_seed(0)
    reference = _mlp()
    model = copy.deepcopy(reference)
    frozen = model[2].bias
    fully_shard(model[0])
    fully_shard(model, ignored_params={frozen})
    x = torch.randn(3, 16)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    assert model[2].bias is frozen  # never swapped for a shard or a gathered copy
    _assert_same(model, reference)


class _HeadOutside(nn.Module):
    """Embedding and head in one group; the loss applies the head outside forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 4, bias=False)

    def forward(self, x):
        return self.mid(self.emb(x))


def test_group_whose_modules_did_not_all_run_forward_is_completed_by_the_root():
    torch.manual_seed(0)
    reference = _HeadOutside()
    model = copy.deepcopy(reference)
    fully_shard([model.emb, model.head])
    fully_shard(model)
    shards = (model.emb.weight, model.head.weight)
    x = torch.randn(3, 4)
    for m in (model, reference):
        h = m(x)
        if m is model:  # head never ran: the root's post-forward resharded the group
            assert m.emb.weight is shards[0] and m.head.weight is shards[1]
        (m.head(h[:2]).pow(2).sum() + m.head(h[2:]).pow(2).sum()).backward()
    assert model.emb.weight is shards[0] and model.head.weight is shards[1]
    _assert_same(model, reference)


def test_an_output_that_is_a_view_warns():
    class Viewing(nn.Linear):
        def forward(self, x):
            return super().forward(x)[:, :2]

    model = fully_shard(Viewing(4, 4))
    with pytest.warns(UserWarning, match="returned a view tensor"):
        model(torch.randn(2, 4))


def test_dp_mesh_dims_must_be_fsdp2s_type():
    # The forms FSDP2 takes are tested against it in tests/test_torch_2d.py.
    with pytest.raises(TypeError, match="dp_mesh_dims must be a .*DataParallelMeshDims"):
        fully_shard(nn.Linear(2, 2), dp_mesh_dims=object())


def test_cpu_offload_on_a_cpu_mesh_trains_as_plain_torch():
    # FSDP2's CPUOffloadPolicy keeps shards, gradients and the optimizer step in host
    # memory: on a CPU mesh, where they already are, training is unchanged (as FSDP2's).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    policy = torch_frontend.CPUOffloadPolicy(pin_memory=False)
    for layer in (model[0], model[2]):
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    for _ in range(3):
        x = torch.randn(5, 4)
        for m, opt in zip((model, reference), opts, strict=True):
            opt.zero_grad()
            m(x).pow(2).sum().backward()
        _assert_same(model, reference)
        for opt in opts:
            opt.step()
    _assert_same(model, reference, what="param")


def test_offload_policies_that_cannot_hold_here_are_errors_that_change_nothing():
    model = nn.Linear(2, 2)
    weight = model.weight
    custom = type("MyOffload", (torch_frontend.OffloadPolicy,), {})()
    with pytest.raises(
        NotImplementedError,
        match=r"offload_policy=.*MyOffload.* is not supported by torch_frontend",
    ):
        fully_shard(model, offload_policy=custom)
    assert type(model) is nn.Linear and model.weight is weight
    pinned = torch_frontend.CPUOffloadPolicy()  # pin_memory=True: needs an accelerator
    if torch.accelerator.is_available():
        fully_shard(model, offload_policy=pinned)  # host memory, pinnable: accepted
        return
    with pytest.raises(
        RuntimeError,
        match=r"CPUOffloadPolicy\(pin_memory=True\) pins host "
        r"memory .* none is available",
    ):
        fully_shard(model, offload_policy=pinned)
    assert type(model) is nn.Linear and model.weight is weight


@pytest.mark.parametrize(
    "placement, error, match",
    [
        (lambda p: 1, TypeError, r"returned 1 for parameter 'weight'; return torch.distributed"),
        (lambda p: Shard(2), ValueError, r"Shard\(2\) for parameter 'weight' of shape \(3, 2\)"),
        ("dim 1", TypeError, "must be a callable"),
    ],
)
def test_bad_shard_placement_is_an_error_that_changes_nothing(placement, error, match):
    model = nn.Linear(2, 3)
    weight = model.weight
    with pytest.raises(error, match=match):
        fully_shard(model, shard_placement_fn=placement)
    assert type(model) is nn.Linear and model.weight is weight


def test_shard_placement_on_dim_1_trains_like_plain_torch():
    reference = _mlp()
    model = copy.deepcopy(reference)
    for layer in (model[0], model[2]):
        fully_shard(layer, shard_placement_fn=lambda p: Shard(-1) if p.ndim == 2 else None)
    fully_shard(model)
    for m in (model, reference):
        (m(torch.randn(2, 16, generator=torch.Generator().manual_seed(0)))).pow(2).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(_full(ours.grad), theirs.grad, atol=1e-6)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (2, ValueError, r"reshard_after_forward=2 must divide the number of shards \(1\)"),
        (0, ValueError, r"reshard_after_forward=0 must divide"),
        ("yes", TypeError, r"True, False, None or an int group size, got 'yes'"),
        (1.0, TypeError, r"got 1.0 \(float\)"),
    ],
)
def test_bad_reshard_after_forward_is_an_error_that_changes_nothing(value, error, match):
    model = nn.Linear(2, 2)
    weight = model.weight
    with pytest.raises(error, match=match):
        fully_shard(model, reshard_after_forward=value)
    assert type(model) is nn.Linear and model.weight is weight


def test_reshard_after_forward_1_warns_and_keeps_parameters_gathered():
    model = _mlp()
    with pytest.warns(UserWarning, match="behaves as False"):
        fully_shard(model[0], reshard_after_forward=1)
    fully_shard(model)
    shard = model[0].weight
    model(torch.randn(2, 16))
    assert model[0].weight is not shard  # the gathered parameter stays bound


def test_accumulation_without_reshard_after_backward_gathers_once(monkeypatch):
    from torch_frontend import _bridge

    torch.manual_seed(0)
    reference = _mlp()
    model = _shard_mlp(copy.deepcopy(reference))
    started = []
    real = _bridge.start_all_gather
    monkeypatch.setattr(
        _bridge,
        "start_all_gather",
        lambda layout, blocks, *a: started.append(1) or real(layout, blocks, *a),
    )
    batches = _batches(3)
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        model.set_reshard_after_forward(False)
        for m in (model, reference):
            (m(x) - y).pow(2).mean().backward()
    assert len(started) == 2  # each unit gathered once for all three microbatches
    _assert_same(model, reference)


def test_gradient_divide_factor_replaces_the_world_size():
    torch.manual_seed(0)
    reference = _mlp()
    model = _shard_mlp(copy.deepcopy(reference))
    model[0].set_gradient_divide_factor(4.0)  # this module only, as in FSDP2
    x = torch.randn(3, 16)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    np.testing.assert_allclose(_full(model[0].weight.grad), reference[0].weight.grad / 4, atol=1e-7)
    np.testing.assert_allclose(_full(model[2].weight.grad), reference[2].weight.grad, atol=1e-7)


def test_set_reduce_scatter_divide_factor_is_the_older_name():
    torch.manual_seed(0)
    reference = _mlp()
    model = _shard_mlp(copy.deepcopy(reference))
    model[2].set_reduce_scatter_divide_factor(2.0)
    x = torch.randn(3, 16)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    np.testing.assert_allclose(_full(model[2].weight.grad), reference[2].weight.grad / 2, atol=1e-7)


def test_set_force_sum_reduction_for_comms_keeps_the_numbers():
    # Reductions here are always a sum then a division: either value trains the same.
    torch.manual_seed(0)
    reference = _mlp()
    model = _shard_mlp(copy.deepcopy(reference))
    model.set_force_sum_reduction_for_comms(True)
    x = torch.randn(3, 16)
    for m in (model, reference):
        m(x).pow(2).mean().backward()
    _assert_same(model, reference)
    with pytest.raises(TypeError, match="expected a bool, got 'yes'"):
        model.set_force_sum_reduction_for_comms("yes")


class _Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


def test_set_unshard_in_backward_false_skips_the_backward_gather(monkeypatch):

    reference = _Embedder()
    model = copy.deepcopy(reference)
    fully_shard(model.emb)
    fully_shard(model)
    model.emb.set_unshard_in_backward(False)  # the lookup's backward needs the ids only
    gathers = _record_gathers(monkeypatch)
    tokens = torch.tensor([1, 2, 3, 3, 4, 9])
    for m in (model, reference):
        m(tokens).pow(2).sum().backward()
    assert gathers == [2, 1]  # forward only: the root (head), the embedding; none in backward
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(_full(ours.grad), theirs.grad, atol=1e-6)


def test_gradients_enter_jax_in_one_flat_buffer_without_another_copy(monkeypatch):
    # A group's gradients are packed rank-major into one buffer (FSDP2's chunk-cat),
    # which JAX reads in place.
    from funshard import comm
    from torch_frontend import _flat

    flats, inputs = [], []
    real, reduce_input = comm.eager_reduce_scatter, _flat.reduce_input

    def recording_input(*args):
        flat = reduce_input(*args)
        flats.append(flat.data_ptr())
        return flat

    def recording_reduce(stacked, *args, **kwargs):
        inputs.extend(s.addressable_shards[0].data.unsafe_buffer_pointer() for s in stacked)
        return real(stacked, *args, **kwargs)

    monkeypatch.setattr(_flat, "reduce_input", recording_input)
    monkeypatch.setattr(comm, "eager_reduce_scatter", recording_reduce)
    model = _shard_mlp(_mlp())
    model(torch.randn(2, 16)).sum().backward()
    assert len(inputs) == 2 and inputs == flats
