"""Ranks that issue different collectives end in a named error on every rank, not a hang.

Four gloo jobs at once (tests/_torch_mismatch_worker.py; 2 ranks, 4 for the second),
default settings: a unit swapped on one rank in the script's last step (same shapes:
FSDP2 computes on, with wrong numbers; here the step's own backward fails, before its
optimizer step), with and without re-gathering in the backward, an extra
`no_grad` forward on one rank (FSDP2 hangs), and a mixture of experts whose ranks use
different experts without `set_reduce_scatter_unused_params` (with the setting,
tests/test_torch_surface.py trains the same model equal to FSDP2).
"""

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import Job, free_port

pytestmark = [pytest.mark.torch, pytest.mark.multiprocess]

WORKER = Path(__file__).with_name("_torch_mismatch_worker.py")
CASES = {"swapped": 2, "swapped_kept": 4, "extra_forward": 2, "unused": 2}  # case: ranks
TIMEOUT_S = 120
DEPARTURE_TIMEOUT_S = 6


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's job (all at once), each rank's outcome."""
    outs = {case: tmp_path_factory.mktemp(case) for case in CASES}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FUNSHARD_DEPARTURE_TIMEOUT", str(DEPARTURE_TIMEOUT_S))  # read by clean_env
        jobs = {
            case: Job(WORKER, out, CASES[case], free_port(pair=True), TIMEOUT_S, "--case", case)
            for case, out in outs.items()
        }
    try:
        for case, job in jobs.items():
            assert job.wait() == 0, f"{case}: {job.failure()}"
    finally:
        for job in jobs.values():
            job.kill()
    return {
        case: [json.loads((out / f"rank{r}.json").read_text()) for r in range(CASES[case])]
        for case, out in outs.items()
    }


def _messages(results, case) -> list[str]:
    """Each rank's message, once both raised the named error in bounded time."""
    for rank, result in enumerate(results[case]):
        assert result.get("error") == "DistributedError", (rank, result)
        # Bounded (the case's steps included; alone about 2 to 5 s), where FSDP2 hangs:
        # generous, for three jobs sharing the test run's cores.
        assert result["seconds"] < 45, (rank, result)
    messages = [r["message"] for r in results[case]]
    for rank, message in enumerate(messages):
        assert message.startswith("torch_frontend: the ranks issued different collectives")
        assert f"\n  rank {rank}: " in message and f"\n  rank {1 - rank}: " in message
    return messages


def test_a_unit_swapped_on_one_rank_is_named_on_both(results):
    messages = _messages(results, "swapped")
    # In the last step's backward: its forward's gathers completed (same shapes), its
    # optimizer step never ran.
    assert [(r["steps"], r["pass"]) for r in results["swapped"]] == [(3, "backward")] * 2
    for rank, message in enumerate(messages):
        mine = message.split(f"\n  rank {rank}: ")[1].split("\n")[0]
        theirs = message.split(f"\n  rank {1 - rank}: ")[1].split("\n")[0]
        assert mine.startswith("an all-gather of 'layers.") and "of step 4" in mine, message
        assert theirs.startswith("an all-gather of 'layers.") and mine != theirs, message


def test_a_unit_swapped_in_a_history_of_the_same_length_is_named_on_all_ranks(results):
    """4 ranks, rank 1 swaps, no gather in the backward: every rank issues as many
    collectives of the same sizes, and the digests compared at the end of the backward
    find them on every rank, those whose digests equal the first rank's included."""
    outcomes = results["swapped_kept"]
    assert [(r["steps"], r["pass"], r.get("error")) for r in outcomes] == [
        (3, "backward", "DistributedError")
    ] * 4
    for rank, result in enumerate(outcomes):
        message = result["message"]
        assert result["seconds"] < 45, (rank, result)
        assert (
            "the check at the end of a backward (ranks 0, 1, 2, 3) found the ranks' "
            "histories differ" in message
        ), message
        assert f"\n  rank {rank}: a reduce-scatter of 'layers." in message, message
        swapped = "rank 1: a reduce-scatter of 'layers.0' ((128,)/0/float32) in the backward"
        assert f"{swapped} of step 4" in message, message


def test_an_extra_no_grad_forward_on_one_rank_is_named_on_both(results):
    assert [r["pass"] for r in results["extra_forward"]] == ["forward"] * 2
    for message in _messages(results, "extra_forward"):
        assert (
            "rank 0: an all-gather of 'layers.0' ((72,)/0/float32) in a forward under "
            "torch.no_grad() of step 3" in message
        ), message
        assert (
            "rank 1: an all-gather of 'layers.0' ((72,)/0/float32) in the forward of step 3"
            in message
        ), message
        assert "One rank ran a forward under torch.no_grad()" in message


def test_unused_experts_without_the_setting_name_the_parameters_and_the_setting(results):
    # The reduce-scatters leave out different parameters (same shapes): the check at the
    # end of the backward finds them.
    assert [(r["steps"], r["pass"]) for r in results["unused"]] == [(0, "backward")] * 2
    for message in _messages(results, "unused"):
        for rank in range(2):
            assert (
                f"rank {rank}: a reduce-scatter of 'moe' ((96,)/0/float32) in the backward of "
                f"step 1, without 'moe.experts.{1 - rank}.weight', "
                f"'moe.experts.{1 - rank}.bias' (no gradient here)"
            ) in message, message
        assert "call set_reduce_scatter_unused_params(True) on the module" in message


def test_sigterm_ends_a_rank_stuck_waiting_for_a_peer(tmp_path):
    """Rank 1 sleeps (alive, in no collective); rank 0's next all-gather waits for it.
    JAX's runtime catches SIGTERM for its preemption notice: the frontend gives SIGTERM
    back its handler from before (here the default), so torchrun's SIGTERM ends rank 0."""
    with Job(WORKER, tmp_path, 2, free_port(pair=True), TIMEOUT_S, "--case", "sleeper") as job:
        deadline = time.monotonic() + 60
        while "rank 0: step 0 done" not in job.log() or "rank 1: sleeping" not in job.log():
            assert time.monotonic() < deadline, job.log()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # rank 0 is in its next all-gather's wait
        pid = int((tmp_path / "pid-rank0").read_text())
        os.kill(pid, signal.SIGTERM)
        ended = time.monotonic() + 5
        while Path(f"/proc/{pid}").exists() and time.monotonic() < ended:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), job.log()[-3000:]


def _zombie(pid: int) -> bool:
    """Whether `pid` has ended but its parent (torchrun) has not reaped it yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"
    except OSError:
        return True
