"""FSDPModule's communication settings on torch_frontend against PyTorch's FSDP2.

One torchrun job (`tests/_torch_surface_worker.py`, 2 gloo ranks) runs every case with
torch_frontend and then with FSDP2 and records losses, gradients, parameters, what the
all-reduce hooks saw, and what each raised; the tests compare.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _launch import Job, free_port

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("_torch_surface_worker.py")
TIMEOUT_S = 150
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def surface(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torch_surface")
    job = Job(WORKER, out, 2, free_port(pair=True), TIMEOUT_S)
    assert job.wait() == 0, job.failure()
    return out


def _results(out: Path, impl: str, rank: int) -> dict:
    return json.loads((out / f"{impl}-rank{rank}.json").read_text())


def _arrays(out: Path, impl: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{impl}-rank{rank}.npz") as data:
        return dict(data)


def _same_training(out: Path, case: str, prefix: str, atol: float = TOLERANCE) -> None:
    """Equal losses on every rank, and equal gradients and parameters, to FSDP2's."""
    for rank in range(2):
        ours, theirs = _results(out, "frontend", rank)[case], _results(out, "fsdp2", rank)[case]
        assert "ok" in ours and "ok" in theirs, (ours, theirs)
        ours_arr, theirs_arr = _arrays(out, "frontend", rank), _arrays(out, "fsdp2", rank)
        names = [k for k in theirs_arr if k.startswith(f"{prefix}/")]
        assert names and sorted(names) == sorted(k for k in ours_arr if k.startswith(f"{prefix}/"))
        for name in names:
            np.testing.assert_allclose(ours_arr[name], theirs_arr[name], atol=atol, err_msg=name)
        our_losses = ours["ok"]["losses"] if isinstance(ours["ok"], dict) else ours["ok"]
        their_losses = theirs["ok"]["losses"] if isinstance(theirs["ok"], dict) else theirs["ok"]
        np.testing.assert_allclose(our_losses, their_losses, rtol=1e-6)


def test_unused_experts_train_as_fsdp2_with_reduce_scatter_unused_params(surface):
    # Rank 0 routes every token to expert 0, rank 1 to expert 1: each expert's gradient
    # exists on one rank only, and the reduced one is that rank's over 2.
    _same_training(surface, "unused_experts", "unused")
    arrays = _arrays(surface, "frontend", 0)
    for expert in range(2):
        assert np.abs(arrays[f"unused/grad/moe.experts.{expert}.weight"]).max() > 0


def test_all_reduce_hook_sees_and_changes_what_fsdp2s_does(surface):
    _same_training(surface, "all_reduce_hook", "hook")
    for rank in range(2):
        ours = _results(surface, "frontend", rank)["all_reduce_hook"]["ok"]["seen"]
        theirs = _results(surface, "fsdp2", rank)["all_reduce_hook"]["ok"]["seen"]
        assert len(ours) == len(theirs) == 3  # once per backward, for model[2] only
        for (shape, dtype, total), (their_shape, their_dtype, their_total) in zip(
            ours, theirs, strict=True
        ):
            assert (shape, dtype) == (their_shape, their_dtype) == ([102], "torch.float32")
            assert total == pytest.approx(their_total, rel=1e-5, abs=1e-6)


def test_all_reduce_hook_in_fp16_sees_the_pre_divided_sum_as_fsdp2(surface):
    _same_training(surface, "all_reduce_hook_fp16", "hook16", atol=2e-3)
    for rank in range(2):
        ours = _results(surface, "frontend", rank)["all_reduce_hook_fp16"]["ok"]["seen"]
        theirs = _results(surface, "fsdp2", rank)["all_reduce_hook_fp16"]["ok"]["seen"]
        assert [s[:2] for s in ours] == [s[:2] for s in theirs]
        assert all(s[1] == "torch.float16" for s in ours)
        np.testing.assert_allclose([s[2] for s in ours], [s[2] for s in theirs], rtol=2e-3)


@pytest.mark.parametrize(
    ("case", "prefix"),
    [
        ("max_input_buffers", "buffers"),
        ("separate_reduce_scatter_group", "separate"),
        ("post_optim_event", "event"),
        ("allocate_from_process_group", "allocate"),
    ],
)
def test_settings_that_change_no_number_train_as_fsdp2(surface, case, prefix):
    _same_training(surface, case, prefix)


@pytest.mark.parametrize(
    ("case", "builtin", "start"),
    [
        ("max_input_buffers_zero", "ValueError", "max_input_buffers must be a positive int, got 0"),
        ("max_input_buffers_bool", "TypeError", "max_input_buffers must be an int, got bool"),
    ],
)
def test_invalid_settings_raise_fsdp2s_error(surface, case, builtin, start):
    for rank in range(2):
        for impl in ("frontend", "fsdp2"):
            result = _results(surface, impl, rank)[case]
            assert builtin in result.get("bases", []), (impl, result)
            assert result["message"].startswith(start), (impl, result)
        # Ours also names the module.
        assert "FSDPSequential" in _results(surface, "frontend", rank)[case]["message"]


def test_symmetric_memory_is_accepted_or_refused_as_fsdp2_on_this_torch_build(surface):
    # torch's CPU builds have no NCCL symmetric memory (FSDP2 raises RuntimeError);
    # its CUDA builds select it, even on a machine without a GPU (FSDP2 accepts).
    for rank in range(2):
        ours, theirs = (_results(surface, impl, rank)["symm_mem"] for impl in ("frontend", "fsdp2"))
        if "ok" in theirs:
            assert ours == {"ok": None}, ours
        else:
            assert ours["error"] == "RuntimeError" and theirs["bases"][0] == "RuntimeError"
            assert ours["message"].startswith(theirs["message"]), (ours, theirs)
            assert "FSDPSequential" in ours["message"]


def test_custom_collectives_are_called_and_train_as_fsdp2s(surface):
    _same_training(surface, "custom_collectives", "custom")
    for rank in range(2):
        ours = _results(surface, "frontend", rank)["custom_collectives"]["ok"]["log"]
        theirs = _results(surface, "fsdp2", rank)["custom_collectives"]["ok"]["log"]
        # The same allocations (sizes, dtypes), the same calls, layouts and ops: the
        # root's (model[4]'s) 26 values per rank, this rank's slice of the output.
        assert ours == theirs, (ours, theirs)
        gather = [["allocate", [52], "torch.float32"], ["all_gather", [52], 26, 26 * rank]]
        reduce = [["allocate", [52], "torch.float32"], ["allocate", [26], "torch.float32"]]
        reduce.append(["reduce_scatter", 26, 52, "RedOpType.AVG"])
        # Per step one gather (the root stays gathered for its backward) and one reduction.
        assert ours == (gather + reduce) * 3


def test_buffer_settings_after_a_custom_collective_are_fsdp2s_assertion_error(surface):
    for rank in range(2):
        for impl in ("frontend", "fsdp2"):
            result = _results(surface, impl, rank)["allocate_after_custom_all_gather"]
            assert "AssertionError" in result["bases"], (impl, result)
            assert result["message"].startswith(
                "cannot call set_allocate_memory_from_process_group() when all gather comm "
                "is custom: CountingAllGather"
            )


def test_a_custom_collective_of_the_wrong_kind_or_size_is_a_named_error(surface):
    result = _results(surface, "frontend", 0)["frontend_custom_all_gather_of_the_wrong_size"]
    assert "ValueError" in result["bases"], result
    assert "set_custom_all_gather on the root" in result["message"]
    assert "(53,) torch.float32" in result["message"] and "(52,)" in result["message"]
    result = _results(surface, "frontend", 0)["frontend_custom_all_gather_not_a_comm"]
    assert "TypeError" in result["bases"] and "allocate(size" in result["message"], result


@pytest.mark.parametrize("case", ["hook_without_argument", "hook_not_callable"])
def test_a_hook_of_the_wrong_kind_is_a_type_error_when_set(surface, case):
    # FSDP2 accepts it and fails inside the backward; the frontend refuses it at once.
    result = _results(surface, "frontend", 0)[f"frontend_{case}"]
    assert "TypeError" in result["bases"], result
    assert "set_all_reduce_hook" in result["message"]
    assert "hook(reduce_output: torch.Tensor)" in result["message"]


def test_reduce_scatters_in_flight_are_capped_and_finish_oldest_first():
    # The cap `set_reduce_scatter_max_input_buffers` resolves to: a group's post-backward
    # finishes the oldest held reduce-scatters until cap - 1 remain, then holds its own.
    from torch_frontend._bridge import CommContext

    ctx = CommContext()
    done: list[int] = []
    ctx.reduce_scatter_max_input_buffers = 3
    for i in range(5):
        ctx.finish_reduce(keep=ctx.reduce_scatter_max_input_buffers - 1)
        ctx.hold_reduce(None, lambda i=i: done.append(i))
        assert len(ctx._held) == min(i + 1, 3)
    assert done == [0, 1]
    ctx.finish_reduce()  # the end of the backward: all of them
    assert done == [0, 1, 2, 3, 4] and not ctx._held
    ctx.reduce_scatter_max_input_buffers = 1  # FSDP2's default: one in flight
    for i in range(3):
        ctx.hold_reduce(None, lambda i=i: done.append(10 + i))
    assert done[-2:] == [10, 11] and len(ctx._held) == 1


def test_fsdp_module_has_every_public_method_of_fsdp2s_with_its_signature():
    import inspect

    import torch.distributed.fsdp as fsdp2

    import torch_frontend

    theirs = {n for n in dir(fsdp2.FSDPModule) if not n.startswith("_")}
    ours = {n for n in dir(torch_frontend.FSDPModule) if not n.startswith("_")}
    assert theirs - ours == set()
    for name in sorted(theirs):

        def params(cls, name=name):
            sig = inspect.signature(getattr(cls, name))
            return [(p.name, p.kind, p.default) for p in sig.parameters.values()]

        assert params(torch_frontend.FSDPModule) == params(fsdp2.FSDPModule), name
