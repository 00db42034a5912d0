"""FSDP2's 2-D (dp x tp) recipe on torch_frontend against PyTorch's FSDP2 running it.

One script (`tests/_torch_2d_worker.py`), torchtitan's recipe on 4 gloo ranks, runs in two
torchrun jobs started together: with `torch.distributed.fsdp.fully_shard` (the control) and
with `torch_frontend.fully_shard`. Losses, grad norms, placements, full state dicts and
the DCP 2-D -> 1-D reload must be equal; FSDP2's losses are checked against plain torch
on the global batch, so the control itself is checked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import _torch_2d_worker as w
from _launch import Job, port_pairs

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("_torch_2d_worker.py")
JOB_TIMEOUT_S = 300  # a bound for hung jobs: both jobs start at once, 8 processes on 2 cores
WORLD, DP, TP = 4, 2, 2


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    ports = port_pairs(2)
    started = {
        impl: Job(
            WORKER,
            tmp_path_factory.mktemp(f"torch_2d_{impl}"),
            WORLD,
            port,
            JOB_TIMEOUT_S,
            "--impl",
            impl,
        )
        for impl, port in zip(("fsdp2", "frontend"), ports, strict=True)
    }
    yield started
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def ranks(jobs) -> dict[str, list[dict]]:
    return {impl: job.result()[1] for impl, job in jobs.items()}


def _dp_rank(rank: int) -> int:
    return rank // TP  # init_device_mesh's (dp, tp) grid, row-major


# Cases with a group that reduce-scatters over all 4 ranks: the 4-term sums run in
# another order than gloo's, so they equal FSDP2's to the last bit or two (measured:
# 8e-7 relative at most), and are compared with a tolerance (`test_four_rank_...`).
FOUR_RANK_SUMS = ("moe_reshard/", "moe_keep/", "own_mesh/", "spmd_flat/", "spmd_ddp_flat/")


def _common(record: dict) -> dict:
    """The training and reload records (errors are compared by type, below)."""
    skip = ("frontend/", "error/", *FOUR_RANK_SUMS)
    return {k: v for k, v in record.items() if not k.startswith(skip)}


def test_frontend_equals_fsdp2_on_every_rank(ranks):
    """Losses, grad norms, placements, full state dicts, DCP reload: all equal, bit for bit."""
    for rank in range(WORLD):
        want, got = _common(ranks["fsdp2"][rank]), _common(ranks["frontend"][rank])
        assert set(got) == set(want), set(got) ^ set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank}: {key}")


@pytest.mark.parametrize("case", list(w.CASES))
def test_the_cases_train_and_record_everything(ranks, case):
    record = ranks["frontend"][0]
    hidden = w.CASES[case][0]
    assert record[f"{case}/loss"].shape == record[f"{case}/norm"].shape == (w.STEPS,)
    assert np.all(np.diff(record[f"{case}/loss"]) != 0)  # the parameters changed
    full = {k.split("/", 2)[2]: v for k, v in record.items() if k.startswith(f"{case}/full/")}
    assert full["blocks.0.in_proj.weight"].shape == (hidden, w.DIM)
    assert full["blocks.1.out_proj.weight"].shape == (w.DIM, hidden)


def test_placements_are_fsdp2s_2d_ones(ranks):
    """The DESIGN.md facts, read from the frontend's own parameters."""
    prefix = "uneven/placement/"
    record = ranks["frontend"][0]
    got = {k[len(prefix) :]: str(v) for k, v in record.items() if k.startswith(prefix)}
    two_d = "('dp', 'tp') "
    assert got["blocks.0.in_proj.weight"] == two_d + "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert got["blocks.0.in_proj.bias"] == two_d + "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert got["blocks.0.out_proj.weight"] == two_d + "(Shard(dim=0), Shard(dim=1))"
    assert got["blocks.0.out_proj.bias"] == two_d + "(Shard(dim=0), Replicate())"
    assert got["blocks.0.norm.weight"] == got["head.weight"] == "('dp',) (Shard(dim=0),)"
    assert str(record["reload/placement/blocks.0.in_proj.weight"]) == "() (Shard(dim=0),)"


def test_gathers_run_over_dp_only_and_move_the_tp_local_block(ranks):
    """Each block's group gathers within its dp group (2 processes), the TP-local rows only."""
    for rank in range(WORLD):
        record = ranks["frontend"][rank]
        tp_rank = rank % TP
        peers = [tp_rank + TP * d for d in range(DP)]
        for case, (hidden, *_) in w.CASES.items():
            assert list(record[f"frontend/{case}/gather_processes"]) == peers, (rank, case)
            rows = len(torch.arange(hidden).chunk(TP)[tp_rank])  # torch.chunk's TP split
            # norm weight and bias, in_proj weight and bias (rows), out_proj weight
            # (columns) and its replicated bias
            want = [w.DIM, w.DIM, rows * w.DIM, rows, w.DIM * rows, w.DIM]
            assert list(record[f"frontend/{case}/gathered"]) == want, (rank, case)


def _plain_torch_losses(model, data_ranks: int = DP, lr: float = w.LR) -> list[float]:
    """The losses of `model` unsharded, trained on the data ranks' batches together."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(w.STEPS):
        batches = (w.batch(step, d) for d in range(data_ranks))
        x, y = (torch.cat(t) for t in zip(*batches, strict=True))
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_fsdp2s_losses_are_plain_torchs_on_the_global_batch(ranks):
    """The control is right: one unsharded model on the dp ranks' batches together."""
    for case, (hidden, *_) in w.CASES.items():
        losses = _plain_torch_losses(w.build(hidden))
        # Each dp rank's loss is its batch's mean: the global mean is their mean.
        per_dp = [ranks["fsdp2"][d * TP][f"{case}/loss"] for d in range(DP)]
        np.testing.assert_allclose(np.mean(per_dp, axis=0), losses, rtol=1e-5)


def test_dcp_reload_into_1d_equals_the_saved_2d_model(ranks):
    record = ranks["frontend"][1]
    saved = {k.split("/", 2)[2]: v for k, v in record.items() if k.startswith("ac/full/")}
    loaded = {k.split("/", 2)[2]: v for k, v in record.items() if k.startswith("reload/full/")}
    assert set(saved) == set(loaded)
    for key in saved:
        np.testing.assert_array_equal(loaded[key], saved[key], err_msg=key)


def _error(record: dict, name: str) -> tuple[list[str], str]:
    return list(record[f"error/{name}/types"]), str(record.get(f"error/{name}/message", ""))


@pytest.mark.parametrize("name", ["parallelize_after", "other_mesh", "unnamed_mesh", "overlapping"])
def test_mistakes_raise_fsdp2s_type(ranks, name):
    """What FSDP2 raises (the control's class) is a base of what the frontend raises."""
    fsdp2_types, _ = _error(ranks["fsdp2"][0], name)
    types, message = _error(ranks["frontend"][0], name)
    assert fsdp2_types[0] != "nothing raised"
    assert fsdp2_types[0] in types, (fsdp2_types, types, message)
    if name != "parallelize_after":  # raised by torch's parallelize_module for both
        assert "parameter 'in_proj.weight' is a DTensor on" in message
        assert 'fully_shard(block, mesh=mesh["dp"])' in message


def test_fsdp2_fails_as_recorded_for_these_mistakes(ranks):
    """The types the frontend matches, as measured on torch 2.13 (DESIGN.md style facts)."""
    got = {n: _error(ranks["fsdp2"][0], n)[0][0] for n in ("other_mesh", "unnamed_mesh")}
    assert got == {"other_mesh": "RuntimeError", "unnamed_mesh": "TypeError"}
    assert _error(ranks["fsdp2"][0], "parallelize_after")[0][0] == "ValueError"


def test_frontend_checkpoint_refuses_tensor_parallel_parameters(ranks):
    types, message = _error(ranks["frontend"][0], "tf_save")
    assert "NotImplementedError" in types
    assert "parameter 'blocks.0._checkpoint_wrapped_module.in_proj.weight'" in message
    assert "get_model_state_dict" in message


@pytest.mark.parametrize("case", ["ac", "dim1", "seq", "spmd_ddp"])
def test_frontend_tools_take_tensor_parallel_parameters(ranks, case):
    """torch_frontend's full_state_dict equals get_model_state_dict's full tensors (TP
    column- and row-parallel, uneven 17 on tp=2, FSDP on dim 1, sequence-parallel norms
    split over dp and replicated over tp, DDP on the full mesh); load_full_state_dict
    puts them into a model of other values; clip_grad_norm_ returns torchtitan's norm
    of the same gradients and scales them to max_norm."""
    for rank in range(WORLD):
        record = ranks["frontend"][rank]
        mine = _full(record, f"frontend/{case}/tf_full/")
        saved = _full(record, f"{case}/full/")
        assert mine and set(mine) == set(saved)
        for key, value in mine.items():
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{rank}: {key}")
            loaded = record[f"frontend/{case}/tf_loaded/{key}"]
            np.testing.assert_array_equal(loaded, value, err_msg=f"{rank}: {key}")
        norm = float(record[f"frontend/{case}/norm"])
        assert norm > 0.1
        np.testing.assert_allclose(record[f"frontend/{case}/clip_norm"], norm, rtol=1e-6)
        np.testing.assert_allclose(record[f"frontend/{case}/clipped_norm"], 0.1, rtol=1e-5)


def test_shard_placement_fn_on_tp_parameters_dim_1(ranks):
    """FSDP2's `ShardPlacementResult` on the dp mesh (one group), on dim 1 of TP blocks."""
    record = ranks["frontend"][0]
    got = {k: str(record[f"dim1/placement/blocks.0.{k}.weight"]) for k in ("in_proj", "out_proj")}
    assert got == {
        "in_proj": "('dp', 'tp') (Shard(dim=1), Shard(dim=0))",
        "out_proj": "('dp', 'tp') (_StridedShard(dim=1, sf=2), Shard(dim=1))",
    }


@pytest.mark.parametrize("case", [c.rstrip("/") for c in FOUR_RANK_SUMS])
def test_four_rank_cases_equal_fsdp2(ranks, case):
    """`ShardPlacementResult` on another mesh, and `dp_mesh_dims` flattening both dims:
    losses, grad norms, full state dicts equal FSDP2's (to 1e-6, see FOUR_RANK_SUMS);
    placements, groups and their members exactly."""
    for rank in range(WORLD):
        want, got = ranks["fsdp2"][rank], ranks["frontend"][rank]
        keys = [k for k in want if k.startswith(f"{case}/")]
        assert keys and set(keys) == {k for k in got if k.startswith(f"{case}/")}
        for key in keys:
            if want[key].dtype.kind == "f":
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
            else:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{rank}: {key}")


def test_experts_are_fsdp_sharded_over_efsdp_on_dim_1(ranks):
    """torchtitan's MoE: experts split over ep, FSDP-sharded on dim 1 over efsdp (2 ranks),
    the dense parameters over all 4; two groups per block, experts second (FSDP2's order)."""
    record = ranks["frontend"][0]
    assert str(record["moe_reshard/placement/blocks.0.experts"]) == (
        "('efsdp', 'ep') (Shard(dim=1), Shard(dim=0))"
    )
    assert str(record["moe_reshard/placement/blocks.0.norm.weight"]) == "('dp',) (Shard(dim=0),)"
    assert int(record["moe_reshard/groups"]) == 2
    assert list(record["moe_reshard/group_fqns"]) == [
        "blocks.0.norm.bias, blocks.0.norm.weight",
        "blocks.0.experts",
    ]
    for rank in range(WORLD):
        got = ranks["frontend"][rank]
        assert list(got["frontend/moe_reshard/gather_processes/0"]) == list(range(WORLD))
        ep = rank % 2  # init_device_mesh's (efsdp, ep) grid, row-major
        assert list(got["frontend/moe_reshard/gather_processes/1"]) == [ep, ep + 2]


@pytest.mark.parametrize("case", ["moe_reshard", "own_mesh"])
def test_one_group_accessor_raises_as_fsdp2s_with_several(ranks, case):
    fsdp2_types, fsdp2_message = _error(ranks["fsdp2"][0], f"{case}_one_group")
    types, message = _error(ranks["frontend"][0], f"{case}_one_group")
    assert fsdp2_types[0] == "AssertionError" and "AssertionError" in types
    assert message.startswith(fsdp2_message.split(" when using")[0].split(". Use")[0])
    assert "Use `_fsdp_param_groups` (plural)" in message


def test_methods_cover_every_group(ranks):
    """`unshard(async_op=True)` gathers both groups of the block and `reshard` frees both,
    as FSDP2's; accumulating without sync gives FSDP2's norm (the comparison above)."""
    record = ranks["frontend"][0]
    assert list(record["own_mesh/unsharded"]) == [
        "Parameter (8,)",
        "Parameter (8,)",
        "Parameter (16, 8)",
        "Parameter (16,)",
        "Parameter (8, 16)",
        "Parameter (8,)",
    ]
    assert all(str(h).startswith("DTensor ") for h in record["own_mesh/resharded"])
    assert record["own_mesh/accumulated_norm"] > 0


def test_spmd_has_one_group_and_the_accessor_returns_it(ranks):
    for impl in ("fsdp2", "frontend"):
        assert int(ranks[impl][0]["spmd/groups"]) == 1
        assert _error(ranks[impl][0], "spmd_one_group")[0] == ["nothing raised"]


@pytest.mark.parametrize("impl", ["fsdp2", "frontend"])
def test_dcp_round_trip_of_two_parameter_groups(ranks, impl):
    """DCP saves a model whose blocks' linear layers are an HSDP group beside the FSDP
    group, and loads it into a fresh one: the full state dict is the saved model's, bit
    for bit (FSDP2: the control)."""
    for rank in range(WORLD):
        record = ranks[impl][rank]
        loaded, saved = _full(record, "own_mesh/dcp/"), _full(record, "own_mesh/full/")
        assert loaded and set(loaded) == set(saved)
        for key, value in saved.items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=f"rank {rank}: {key}")


def test_own_mesh_groups_train_as_plain_torch(ranks):
    """The control: an HSDP group beside the FSDP one is plain data parallelism over 4."""
    model = w.build(16, seed=5)
    losses = _plain_torch_losses(model, WORLD)
    per_rank = [ranks["fsdp2"][r]["own_mesh/loss"] for r in range(WORLD)]
    np.testing.assert_allclose(np.mean(per_rank, axis=0), losses, rtol=1e-5)


def test_frontend_tools_take_several_groups(ranks):
    """torch_frontend's full state dict and clip_grad_norm_ over an HSDP and an FSDP group:
    get_model_state_dict's tensors, and torchtitan's norm of the same gradients."""
    for rank in range(WORLD):
        record = ranks["frontend"][rank]
        mine = _full(record, "frontend/own_mesh/tf_full/")
        assert mine and set(mine) == set(_full(record, "own_mesh/full/"))
        for key, value in mine.items():
            np.testing.assert_array_equal(value, record[f"own_mesh/full/{key}"], err_msg=key)
        np.testing.assert_allclose(
            record["frontend/own_mesh/clip_norm"], record["frontend/own_mesh/norm"], rtol=1e-6
        )


def test_dp_mesh_dims_placements_are_fsdp2s(ranks):
    """On the full (dp, tp) mesh: the 2-D recipe's placements; HSDP: Replicate() on dp;
    flattened: a 1-D view of both dims."""
    record = ranks["frontend"][0]
    got = {k: str(record[f"spmd/placement/blocks.0.{k}"]) for k in ("in_proj.weight", "norm.bias")}
    two_d = "('dp', 'tp') "
    assert got == {
        "in_proj.weight": two_d + "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "norm.bias": two_d + "(Shard(dim=0), Replicate())",
    }
    assert str(record["spmd/placement/blocks.0.out_proj.weight"]) == (
        two_d + "(Shard(dim=0), Shard(dim=1))"
    )
    assert str(record["spmd_hsdp/placement/head.weight"]) == two_d + "(Replicate(), Shard(dim=0))"
    # Both dims flattened: FSDP2's one-dim view of them.
    assert str(record["spmd_flat/placement/head.weight"]) == "('dp_tp',) (Shard(dim=0),)"
    # DDP (replication only): the parameters keep their own placements.
    for key, want in {
        "blocks.0.in_proj.weight": "(Replicate(), Shard(dim=0))",
        "blocks.0.out_proj.weight": "(Replicate(), Shard(dim=1))",
        "head.weight": "(Replicate(), Replicate())",
    }.items():
        assert str(record[f"spmd_ddp/placement/{key}"]) == two_d + want


def test_dp_mesh_dims_ddp_all_reduces_over_the_replicas_only(ranks):
    """DDP over dp: each rank's group spans its dp replicas (its tp rank's column of the
    grid), and the model is one group, as FSDP2's."""
    for rank in range(WORLD):
        record = ranks["frontend"][rank]
        tp = rank % TP
        assert list(record["frontend/spmd_ddp/gather_processes/0"]) == [tp, tp + TP]
    for impl in ("fsdp2", "frontend"):
        assert int(ranks[impl][0]["spmd_ddp/groups"]) == 1


def test_stock_tools_in_ddp_mode_equal_fsdp2_and_plain_torch(ranks):
    """FSDP2's DDP mode (`replicate="dp"`, TP over tp): `torch.nn.utils.clip_grad_norm_`
    returns the norm of plain torch's gradient on the global batch, over dp (FSDP2 averages
    the replicas' gradients of the global loss) and clips it to `max_norm`; DCP loads the
    model into a fresh one exactly. The frontend's numbers are FSDP2's, bit for bit
    (`test_frontend_equals_fsdp2_on_every_rank` compares every key)."""
    model = w.build(16)
    _plain_torch_losses(model, DP, lr=w.LR / DP)
    x, y = (torch.cat(t) for t in zip(*(w.batch(w.STEPS, d) for d in range(DP)), strict=True))
    (model(x) - y).pow(2).mean().backward()
    grads = [p.grad.detach() for p in model.parameters()]
    want = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) / DP
    assert want > 0.1  # so the gradients are clipped
    for impl in ("fsdp2", "frontend"):
        for rank in range(WORLD):
            record = ranks[impl][rank]
            np.testing.assert_allclose(record["spmd_ddp/stock/clip_norm"], want, rtol=1e-5)
            np.testing.assert_allclose(record["spmd_ddp/stock/clipped_norm"], 0.1, rtol=1e-5)
            loaded, saved = _full(record, "spmd_ddp/stock/dcp/"), _full(record, "spmd_ddp/full/")
            assert loaded and set(loaded) == set(saved)
            for key, value in saved.items():
                np.testing.assert_array_equal(loaded[key], value, err_msg=f"{impl} {rank}: {key}")


@pytest.mark.parametrize(
    ("case", "data_ranks"),
    [
        ("spmd", DP),
        ("spmd_hsdp", WORLD),
        ("spmd_flat", WORLD),
        ("spmd_ddp", DP),
        ("spmd_ddp_flat", WORLD),
    ],
)
def test_dp_mesh_dims_fsdp2_trains_as_plain_torch(ranks, case, data_ranks):
    """The control: the loss is the global batch's mean on every rank, and FSDP2 still
    divides the gradients summed over the data-parallel ranks by their number: plain SGD
    at lr / data_ranks on the global batch."""
    losses = _plain_torch_losses(w.build(16), data_ranks, lr=w.LR / data_ranks)
    for rank in range(WORLD):
        np.testing.assert_allclose(ranks["fsdp2"][rank][f"{case}/loss"], losses, rtol=1e-5)


@pytest.mark.parametrize(
    "name",
    [
        "spmd_plain",
        "spmd_split_dp",
        "spmd_unknown_dim",
        "spmd_hpz",
        "spmd_unnamed",
        "two_infos",
    ],
)
def test_group_and_dp_mesh_dims_mistakes_raise_fsdp2s_type(ranks, name):
    fsdp2_types, fsdp2_message = _error(ranks["fsdp2"][0], name)
    types, message = _error(ranks["frontend"][0], name)
    assert fsdp2_types[0] != "nothing raised"
    assert fsdp2_types[0] in types, (fsdp2_types, types, message)
    assert message[:40] == fsdp2_message[:40], message  # FSDP2's sentence first
    if name in ("spmd_plain", "spmd_split_dp", "two_infos"):
        assert "parameter '" in message  # named


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("dims_unordered", "shard dims that are not consecutive, in order"),
        ("dims_with_result", "ShardPlacementResult with dp_mesh_dims (parameter 'norm.weight')"),
        ("result_not_info", "must be an FSDPMeshInfo"),
    ],
)
def test_frontend_refuses_what_it_does_not_build_of_groups(ranks, name, words):
    types, message = _error(ranks["frontend"][0], name)
    want = "TypeError" if name == "result_not_info" else "NotImplementedError"
    assert want in types and "FunshardError" in types, types
    assert words in message, message


def _full(record: dict, prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in record.items() if k.startswith(prefix)}


@pytest.mark.parametrize(
    ("loaded", "saved"), [("from2d/loaded/", "ac/full/"), ("from1d/loaded/", "flat/full/")]
)
def test_dcp_into_a_fresh_2d_model_loads_the_saved_parameters(ranks, loaded, saved):
    """2-D -> 2-D and 1-D -> 2-D: every rank's full state dict is the saved model's."""
    for rank in range(WORLD):
        record = ranks["frontend"][rank]
        want, got = _full(record, saved), _full(record, loaded)
        assert want and set(got) == set(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank}: {key}")
    placement = str(ranks["frontend"][0]["from1d/placement/blocks.0.out_proj.weight"])
    assert placement == "('dp', 'tp') (Shard(dim=0), Shard(dim=1))"


def test_a_2d_model_loaded_from_1d_trains_as_plain_torch(ranks):
    """The loaded model's losses: plain torch from the saved parameters, on the global batch."""
    hidden = w.CASES["ac"][0]
    model = w.build(hidden)
    saved = _full(ranks["fsdp2"][0], "flat/full/")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()})
    losses = _plain_torch_losses(model)
    for impl in ("fsdp2", "frontend"):
        per_dp = [ranks[impl][d * TP]["from1d/loss"] for d in range(DP)]
        np.testing.assert_allclose(np.mean(per_dp, axis=0), losses, rtol=1e-5, err_msg=impl)


def test_sequence_parallel_norms_become_2d_dtensors(ranks):
    """`SequenceParallel` replicates the norm over tp: FSDP2 shards it over dp beside that."""
    for impl in ("fsdp2", "frontend"):
        record = ranks[impl][0]
        for name in ("weight", "bias"):
            got = str(record[f"seq/placement/blocks.0.norm.{name}"])
            assert got == "('dp', 'tp') (Shard(dim=0), Replicate())", (impl, name, got)
