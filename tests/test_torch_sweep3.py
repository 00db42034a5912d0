"""Issue 34's torch_frontend items against PyTorch's FSDP2, in two torchrun jobs.

One job (`tests/_torch_sweep3_worker.py --mode cases`, 2 gloo ranks) runs every case
with torch_frontend and then with FSDP2, and records what each returned or raised;
the tests compare. Where FSDP2 raises, torch_frontend raises FSDP2's built-in type
(a funshard error class that is also that type) and names the parameter and the fix;
where FSDP2 computes silently wrong numbers or fails obscurely, the reference is plain
torch or FSDP2's own run of the case. A second job has one rank return early.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from _launch import Job, free_port

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("_torch_sweep3_worker.py")
TIMEOUT_S = 150
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, monkeypatch_module) -> Path:
    out = tmp_path_factory.mktemp("torch_sweep3")
    monkeypatch_module.setenv("FUNSHARD_DEPARTURE_TIMEOUT", "3")  # read by clean_env
    job = Job(WORKER, out, 2, free_port(pair=True), TIMEOUT_S, "--mode", "cases")
    assert job.wait() == 0, job.failure()
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _results(out: Path, impl: str, rank: int = 0) -> dict:
    return json.loads((out / f"{impl}-rank{rank}.json").read_text())


def _arrays(out: Path, impl: str, rank: int) -> dict[str, np.ndarray]:
    with np.load(out / f"{impl}-rank{rank}.npz") as data:
        return dict(data)


def _raised(result: dict, builtin: str) -> str:
    assert "error" in result, f"expected {builtin}, got {result}"
    assert builtin in result["bases"], result
    return result["message"]


def test_requires_grad_toggled_between_steps_matches_fsdp2(sweep):
    # Frozen at step 1, trainable again at step 3: no gradient and no move while
    # frozen, as FSDP2 (torch_frontend used to move the frozen weight by 0.2176).
    for rank in range(2):
        ours, theirs = _results(sweep, "frontend", rank), _results(sweep, "fsdp2", rank)
        assert ours["freeze"]["ok"] == theirs["freeze"]["ok"] == [False, True, True, False, False]
        moved = _arrays(sweep, "frontend", rank)["freeze_moved"]
        np.testing.assert_allclose(
            moved, _arrays(sweep, "fsdp2", rank)["freeze_moved"], rtol=0, atol=TOLERANCE
        )
        assert moved[1] == moved[2] == 0 and moved[3] > 0


def test_group_of_frozen_and_trainable_parameters_matches_fsdp2(sweep):
    for rank in range(2):
        assert _results(sweep, "frontend", rank)["mixed_group"] == {"ok": True}
        ours, theirs = _arrays(sweep, "frontend", rank), _arrays(sweep, "fsdp2", rank)
        for name in (k for k in theirs if k.startswith("mixed/")):
            np.testing.assert_allclose(
                ours[name], theirs[name], rtol=0, atol=TOLERANCE, err_msg=name
            )


@pytest.mark.parametrize("case", ["bias_none_before_forward", "bias_none_root_before_forward"])
def test_parameter_set_to_none_before_first_forward_raises_as_fsdp2(sweep, case):
    theirs = _raised(_results(sweep, "fsdp2")[case], "AttributeError")
    ours = _raised(_results(sweep, "frontend")[case], "AttributeError")
    assert ours.startswith(theirs), ours
    assert "parameter 'lin1.bias' was set to None after fully_shard" in ours
    assert "`lin1.bias = None` before calling fully_shard" in ours


@pytest.mark.parametrize("case", ["bias_none_after_step", "bias_none_kept_gathered"])
def test_parameter_set_to_none_after_a_step_raises_where_fsdp2_adds_it_back(sweep, case):
    # FSDP2 binds the removed bias again at its next gather and adds it silently;
    # torch_frontend raises there, naming it.
    assert "ok" in _results(sweep, "fsdp2")[case]
    for rank in range(2):
        message = _raised(_results(sweep, "frontend", rank)[case], "AttributeError")
        assert "parameter 'lin1.bias' was set to None after fully_shard" in message


def test_forward_while_kept_gathered_after_removal_computes_without_the_bias(sweep):
    # The root stays gathered after forward: the forward right after `bias = None`
    # runs without it (FSDP2 too); only the next gather raises.
    for rank in range(2):
        np.testing.assert_array_equal(
            _arrays(sweep, "frontend", rank)["kept_gathered_out"],
            _arrays(sweep, "fsdp2", rank)["kept_gathered_out"],
        )


def test_to_float64_after_fully_shard_fails_as_fsdp2_with_a_note(sweep):
    ours, theirs = _results(sweep, "frontend"), _results(sweep, "fsdp2")
    message = _raised(ours["to_float64"], "RuntimeError")
    assert message == _raised(theirs["to_float64"], "RuntimeError")
    note = " ".join(ours["to_float64"]["notes"])
    assert "parameter '0.weight'" in note and "became torch.float64 after fully_shard" in note
    assert "Cast the inputs to torch.float64" in note
    assert ours["to_float64_inputs"]["ok"] == pytest.approx(
        theirs["to_float64_inputs"]["ok"], abs=1e-12
    )


def test_module_list_without_forward_raises_fsdp2s_value_error(sweep):
    theirs = _raised(_results(sweep, "fsdp2")["module_list"], "ValueError")
    ours = _raised(_results(sweep, "frontend")["module_list"], "ValueError")
    sentence = "fully_shard does not support containers that do not implement forward"
    assert theirs.startswith(sentence) and ours.startswith(sentence)
    assert "for block in model.blocks: fully_shard(block)" in ours


@pytest.mark.parametrize(
    "case,builtin,words",
    [
        ("empty_list", "IndexError", "empty list of modules"),
        ("same_module_twice", "AssertionError", "listed twice in one call"),
        ("deepcopy", "AssertionError", "FSDP does not support deepcopy. Please use state dict"),
        (
            "two_parents",
            "TypeError",
            "shared with a parameter already managed by another FSDP group",
        ),
    ],
)
def test_obscure_fsdp2_errors_keep_their_type_and_say_why(sweep, case, builtin, words):
    _raised(_results(sweep, "fsdp2")[case], builtin)
    ours = _raised(_results(sweep, "frontend")[case], builtin)
    assert words in ours, ours
    assert "ValueError" in _results(sweep, "frontend")[case]["bases"] or case == "deepcopy"


def test_shared_module_sharded_first_trains_as_fsdp2(sweep):
    # The remedy the two-parents message names.
    for rank in range(2):
        ours = _results(sweep, "frontend", rank)["shared_module_first"]["ok"]
        theirs = _results(sweep, "fsdp2", rank)["shared_module_first"]["ok"]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(
            _arrays(sweep, "frontend", rank)["shared_first/weight"],
            _arrays(sweep, "fsdp2", rank)["shared_first/weight"],
            rtol=0,
            atol=TOLERANCE,
        )


def test_zero_row_parameter_with_a_gradient_trains_where_fsdp2_fails(sweep):
    # FSDP2: "_chunk_cat expects non-empty tensor" in backward. Reference: plain torch.
    assert "_chunk_cat" in _raised(_results(sweep, "fsdp2")["zero_rows"], "RuntimeError")
    for rank in range(2):
        assert _results(sweep, "frontend", rank)["zero_rows"] == {"ok": [0, 4]}
        arrays = _arrays(sweep, "frontend", rank)
        np.testing.assert_allclose(
            arrays["zero_rows/lin.weight"], arrays["zero_rows/reference"], rtol=0, atol=TOLERANCE
        )


def test_collective_check_names_the_units_each_rank_issues(sweep):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL: rank 1 skips 'layers.1' in step 1; both ranks
    # raise before the mismatched all-gather, naming their own unit and the other's.
    checks = [json.loads((sweep / f"check-rank{r}.json").read_text()) for r in range(2)]
    assert [c["steps"] for c in checks] == [1, 1], checks
    for rank, mine, theirs in ((0, "layers.1", "layers.0"), (1, "layers.0", "layers.1")):
        message = checks[rank]["message"]
        assert checks[rank]["error"] == "DistributedError", message
        assert "the ranks do not issue the same collectives" in message
        assert (
            f"process {rank} is about to issue an all-gather of 1 tensor for the "
            f"all-gather of '{mine}'" in message
        ), message
        assert f"issues an all-gather of 1 tensor for the all-gather of '{theirs}'" in message


def test_rank_that_runs_fewer_steps_is_named_on_the_survivor(tmp_path, monkeypatch):
    # Uncaught on rank 0: it used to end with status 1 and no output at all (torch's
    # excepthook buffered funshard's fail-fast output, which then exited).
    monkeypatch.setenv("FUNSHARD_DEPARTURE_TIMEOUT", "3")  # read by clean_env
    job = Job(WORKER, tmp_path, 2, free_port(pair=True), 90, "--mode", "fewer")
    code = job.wait()
    log = job.log()
    assert code not in (0, -1), log[-4000:]
    assert "rank 1: step 1 done" in log and "rank 0: step 2 done" not in log, log[-4000:]
    assert (
        "DistributedError: funshard.distributed: process 0 of 2 gives up: process 1 "
        "returned normally and left the job after 2 steps (backward passes)"
    ) in log, log[-4000:]
    assert "The last step both reached is step 2" in log
    assert re.search(r"process 0 of 2 stops on an uncaught DistributedError", log), log[-4000:]
