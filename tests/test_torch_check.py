"""`torch_frontend.check`: one step's collectives against FSDP2's policy, as `fs.StepReport`.

The 2-rank cases run in ONE torchrun job (`tests/_torch_check_worker.py`, gloo): a clean
two-unit MLP, bf16 gathers, accumulation with and without gradient sync (trained on
after the check, and compared with the same training without it), an all-reduce planted
in the loss, HSDP's replica all-reduce, and a model whose gradients, buffers and random
state must come out of the check unchanged. The references are the models' own shapes
(the bytes each gather and reduce-scatter must move) and the same training run without
the check. The single-process cases (world size 1) run in this process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import Job, free_port
from torch import nn

import funshard as fs
import torch_frontend
from funshard import errors
from torch_frontend import fully_shard

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_torch_check_worker.py")
TIMEOUT_S = 120
UNITS = {"0": (16, 8), "2": (4, 16)}  # the worker's MLP: unit -> Linear (out, in)
ALIGN_BYTES = 64  # a flat gradient buffer's rows start 64-byte aligned over gloo


def _gathered(unit: str, world: int, itemsize: int = 4) -> int:
    """Bytes a unit's all-gather returns: weight and bias, each padded to `world` chunks."""
    out, inp = UNITS[unit]
    return world * math.ceil(out / world) * (inp + 1) * itemsize


def _reduced(unit: str, world: int, itemsize: int = 4) -> int:
    """Bytes of a unit's reduce-scatter input: every rank's row, rounded to 64 bytes."""
    out, inp = UNITS[unit]
    row = math.ceil(out / world) * (inp + 1) * itemsize
    return world * math.ceil(row / ALIGN_BYTES) * ALIGN_BYTES


# ---- two ranks ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("torch_check")
    job = Job(WORKER, out, 2, free_port(pair=True), TIMEOUT_S)
    assert job.wait() == 0, job.failure()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _case(ranks: list[dict], name: str) -> list[dict]:
    """Each rank's result of a case, which must have run without an error."""
    for rank, result in enumerate(ranks):
        assert "ok" in result[name], (rank, result[name])
    return [result[name]["ok"] for result in ranks]


def _rows(report: dict, unit: str, kind: str, role: str) -> list[dict]:
    return [r for r in report["rows"] if (r["unit"], r["kind"], r["role"]) == (unit, kind, role)]


def _assert_unit(report, unit, kind, role, size, dtype="f32", axes=("fsdp",)) -> None:
    """The unit's collective ran once, as its policy declares, with these bytes."""
    (row,) = _rows(report, unit, kind, role)
    assert (row["times"], row["planned_times"]) == (1, 1), row
    assert (row["bytes"], row["dtype"], row["planned_dtype"]) == (size, dtype, dtype), row
    assert tuple(row["axes"]) == axes, row


@pytest.mark.multiprocess
def test_a_correct_two_unit_step_is_clean_with_each_groups_gathers_and_reduce_scatter(ranks):
    for report in _case(ranks, "clean"):
        assert report["ok"] and report["mismatches"] == [], report["table"]
        assert report["table"].splitlines()[0].endswith("✓ the compiled step matches its policy")
        assert report["mesh_shape"] == [["fsdp", 2]]
        for unit in UNITS:
            _assert_unit(report, unit, "all-gather", "forward", _gathered(unit, 2))
            _assert_unit(report, unit, "all-gather", "backward", _gathered(unit, 2))
            _assert_unit(report, unit, "reduce-scatter", "gradients", _reduced(unit, 2))
        # The root holds no parameter: it gathers and reduces nothing.
        assert len(report["rows"]) == 6 and {r["unit"] for r in report["rows"]} == set(UNITS)


@pytest.mark.multiprocess
def test_bf16_param_dtype_gathers_bf16_bytes_and_reduces_in_reduce_dtype(ranks):
    for report in _case(ranks, "bf16"):
        assert report["ok"], report["table"]
        for unit in UNITS:
            for role in ("forward", "backward"):
                _assert_unit(report, unit, "all-gather", role, _gathered(unit, 2, 2), "bf16")
            _assert_unit(report, unit, "reduce-scatter", "gradients", _reduced(unit, 2))


@pytest.mark.multiprocess
def test_accumulation_with_sync_reduces_once_and_trains_on_as_without_the_check(ranks):
    for result in _case(ranks, "accumulate_with_sync"):
        report = result["report"]
        assert report["ok"], report["table"]
        for unit in UNITS:
            _assert_unit(report, unit, "reduce-scatter", "gradients", _reduced(unit, 2))
        # The first microbatch's gradients stayed, and the next one adds to them alone.
        assert result["unchanged"]
        assert result["final"] == result["reference"]


@pytest.mark.multiprocess
def test_accumulation_without_sync_declares_and_runs_no_gradient_collective(ranks):
    for result in _case(ranks, "accumulate_without_sync"):
        report = result["report"]
        assert report["ok"], report["table"]
        assert [r for r in report["rows"] if r["role"] in ("gradients", "replicas")] == []
        for unit in UNITS:
            _assert_unit(report, unit, "all-gather", "forward", _gathered(unit, 2))
            _assert_unit(report, unit, "all-gather", "backward", _gathered(unit, 2))
        # The unreduced gradients accumulated before the check are reduced with the
        # next synchronising backward, as without the check.
        assert result["unchanged"]
        assert result["final"] == result["reference"]


@pytest.mark.multiprocess
def test_an_all_reduce_in_the_loss_is_unplanned_with_the_line_it_was_written_at(ranks):
    for report in _case(ranks, "unplanned"):
        assert not report["ok"]
        (found,) = report["mismatches"]
        assert (found["kind"], found["unit"], found["collective"]) == (
            "unplanned",
            None,
            "all-reduce",
        )
        assert found["bytes"] == 4  # one float32, once
        assert "_torch_check_worker.py" in found["source"]
        assert "(_summed_over_ranks)" in found["source"]
        assert "over processes 0, 1" in found["explanation"]
        (row,) = [r for r in report["rows"] if r["unit"] is None]
        assert (row["kind"], row["role"], row["times"], row["planned_times"]) == (
            "all-reduce",
            "loss",
            1,
            0,
        )
        # FSDP's own collectives are still as declared.
        assert all(r["times"] == r["planned_times"] for r in report["rows"] if r["unit"])
    for report in _case(ranks, "unplanned_allowed"):
        assert report["ok"] and [n["kind"] for n in report["notes"]] == ["unplanned"]


@pytest.mark.multiprocess
def test_hsdp_reduce_scatters_then_all_reduces_over_the_replicas(ranks):
    for report in _case(ranks, "hsdp"):
        assert report["ok"], report["table"]
        assert report["mesh_shape"] == [["replicate", 2], ["fsdp", 1]]
        for unit in UNITS:
            reduced = _reduced(unit, 1)
            _assert_unit(report, unit, "reduce-scatter", "gradients", reduced)
            _assert_unit(report, unit, "all-reduce", "replicas", reduced, axes=("replicate",))


@pytest.mark.multiprocess
def test_the_check_leaves_gradients_buffers_random_state_and_shards_as_they_were(ranks):
    for result in _case(ranks, "unchanged"):
        assert result["report"]["ok"], result["report"]["table"]
        assert result["same_state"]  # every local shard and its .grad
        assert result["same_buffers"]  # the BatchNorm's running statistics
        assert result["same_rng"]  # the dropout drew from a forked generator
        assert result["resharded"]
        assert result["dist_restored"]


# ---- one process --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process() -> None:
    torch_frontend.init_distributed()


def _mlp(skip_last: bool = False) -> nn.Module:
    class Mlp(nn.Sequential):
        def forward(self, x):
            x = self[1](self[0](x))
            return x if skip_last else self[2](x)

    torch.manual_seed(0)
    model = Mlp(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def _x() -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(0))


def test_a_second_forward_in_the_loss_multiplies_the_gathers(one_process):
    model = _mlp()
    x = _x()
    report = torch_frontend.check(model, x, loss_fn=lambda out: out.sum() + model(x).sum())
    assert isinstance(report, fs.StepReport) and not report.ok
    forward = [m for m in report.mismatches if "(forward)" in m.explanation]
    assert {(m.kind, m.unit, m.collective) for m in forward} == {
        ("multiplied", "0", "all-gather"),
        ("multiplied", "2", "all-gather"),
    }
    assert all(
        "2 times in the step where its policy declares 1 (2x)" in m.explanation for m in forward
    )
    with pytest.raises(errors.PolicyMismatchError, match="multiplied") as raised:
        torch_frontend.check(model, x, loss_fn=lambda out: out.sum() + model(x).sum(), strict=True)
    assert isinstance(raised.value, RuntimeError)


def test_a_unit_that_does_not_run_misses_each_of_its_collectives(one_process):
    report = torch_frontend.check(_mlp(skip_last=True), _x())
    missing = {(m.kind, m.unit, m.collective) for m in report.mismatches}
    assert missing == {
        ("missing", "2", "all-gather"),
        ("missing", "2", "reduce-scatter"),
    }
    rows = [(c.kind, c.role, c.times, c.planned_times) for c in report.collectives if c.unit == "2"]
    assert rows == [
        ("all-gather", "forward", 0, 1),
        ("all-gather", "backward", 0, 1),
        ("reduce-scatter", "gradients", 0, 1),
    ]
    assert all(c.times == c.planned_times == 1 for c in report.collectives if c.unit == "0")


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_frozen_first_unit_reduces_nothing_and_needs_no_re_gather(one_process, prefetch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    if not prefetch:  # by default the next unit's backward gathers it ahead, as FSDP2's
        model[2].set_modules_to_backward_prefetch([])
    report = torch_frontend.check(model, _x())
    assert report.ok, report.table()
    rows = [(c.kind, c.role, c.times, c.planned_times) for c in report.collectives if c.unit == "0"]
    assert rows == [
        ("all-gather", "forward", 1, 1),
        ("all-gather", "backward", int(prefetch), 1),
    ]
    notes = [(n.kind, n.unit) for n in report.notes]
    assert notes == ([] if prefetch else [("unneeded", "0")])


def test_an_all_reduce_over_one_process_is_listed_but_runs_over_no_peer(one_process):
    import torch.distributed as dist

    def loss(out):
        total = out.detach().sum()
        dist.all_reduce(total)
        return out.sum()

    report = torch_frontend.check(_mlp(), _x(), loss_fn=loss)
    assert report.ok, report.table()
    (row,) = [c for c in report.collectives if c.unit is None]
    assert (row.kind, row.role, row.times, row.planned_times) == ("all-reduce", "loss", 1, 0)
    assert "test_torch_check.py" in (row.source or "")


def _no_grad_loss(out):
    return out.detach().sum()


TYPE, VALUE = errors.ShardingTypeError, errors.ShardingValueError


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((nn.Linear(2, 2), torch.ones(1, 2)), {}, TYPE, "an FSDPModule"),
        (("child", _x()), {}, VALUE, "not the root"),
        (("model", torch.ones(3, 5)), {}, VALUE, "failed on the example inputs"),
        (("model", _x()), {"loss_fn": lambda out: out}, VALUE, "has shape"),
        (("model", _x()), {"loss_fn": _no_grad_loss}, VALUE, "does not require grad"),
        (("model", _x()), {"loss_fn": "sum"}, TYPE, "loss_fn must be a function"),
        (("model", _x()), {"loss_fn": lambda out: 1.0}, TYPE, "returned a float"),
        (("model", _x()), {"allow": ("unplanned", "typo")}, VALUE, "the kinds are"),
    ],
)
def test_bad_arguments_say_what_check_expects(one_process, args, kwargs, error, words):
    import torch.distributed as dist

    model = _mlp()
    model(_x())  # its lazy initialisation: the root is known
    model.reshard()
    args = tuple(model if a == "model" else model[0] if a == "child" else a for a in args)
    collectives = (dist.all_reduce, dist.barrier)
    with pytest.raises(error, match=words) as raised:
        torch_frontend.check(*args, **kwargs)
    assert isinstance(raised.value, TypeError if error is TYPE else ValueError)
    # Whatever failed, torch.distributed and the model are as they were, and it trains.
    assert (dist.all_reduce, dist.barrier) == collectives
    assert all(p.grad is None for p in model.parameters())
    model(_x()).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_compare_names_each_difference_with_its_kind():
    from torch_frontend._check_policy import Planned, compare
    from torch_frontend._check_ran import Ran

    planned = [
        Planned("all-gather", "u", "forward", ("fsdp",), "bf16", 100),
        Planned("all-gather", "u", "backward", ("fsdp",), "f32", 200),
        Planned("reduce-scatter", "u", "gradients", ("fsdp",), "f32", 200),
    ]
    ran = [
        Ran("all-gather", "u", "forward", ("fsdp",), "f32", 200),  # another dtype
        Ran("all-gather", "u", "backward", ("fsdp",), "f32", 208),  # other bytes
        Ran("all-reduce", "u", "replicas", ("replicate",), "f32", 100),  # none declared
    ]  # and the reduce-scatter did not run
    rows, mismatches = compare(planned, ran, {0})
    assert [(m.kind, m.collective) for m in mismatches] == [
        ("dtype", "all-gather"),
        ("bytes", "all-gather"),
        ("missing", "reduce-scatter"),
        ("unplanned", "all-reduce"),
    ]
    assert [(r.role, r.bytes, r.times, r.planned_times) for r in rows] == [
        ("forward", 100, 0, 1),
        ("forward", 200, 1, 0),
        ("backward", 200, 0, 1),
        ("backward", 208, 1, 0),
        ("gradients", 200, 0, 1),
        ("replicas", 100, 1, 0),
    ]
