"""A process that leaves the job early never leaves the others waiting.

Real processes on 127.0.0.1. One process returns from its script after fewer steps (or
after catching its own exception); before funshard/distributed/_lifecycle.py the others blocked in a
collective until JAX's shutdown barrier gave up (~300 s), silently. Now the survivors
end within FUNSHARD_DEPARTURE_TIMEOUT (set short here) with an error naming the process
that left and the last step both reached, and the one that left exits 0.
"""

import re
import signal
import sys
import time
from pathlib import Path

import pytest
from _launch import Job, free_port, launch, rank_env

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("_departed_worker.py")
TORCH_WORKER = Path(__file__).with_name("_departed_torch_worker.py")
TIMEOUT_S = 3  # FUNSHARD_DEPARTURE_TIMEOUT in the jobs
HARD_CAP_S = 90  # a job still running then is a hang: killed, and the test fails


def _job(tmp_path: Path, *args: str, processes: int = 2):
    """Starts the JAX workers; `launch` kills what is left of them on the way out."""
    port = free_port(pair=True)
    argv = [sys.executable, str(WORKER), *args]
    return launch(
        tmp_path,
        {
            r: (argv, rank_env(r, processes, port, FUNSHARD_DEPARTURE_TIMEOUT=str(TIMEOUT_S)))
            for r in range(processes)
        },
        HARD_CAP_S,
    )


def _finish(job) -> tuple[list[int], list[str]]:
    codes = job.wait()
    if None in codes.values():
        logs = "\n".join(job.logs().values())
        pytest.fail(f"still running after {HARD_CAP_S} s (killed): a hang\n{logs[-4000:]}")
    return list(codes.values()), list(job.logs().values())


@pytest.mark.parametrize(
    "leaving,shard_batch,count_steps",
    [(1, True, False), (0, False, False), (0, False, True)],
    ids=[
        "rank1-leaves-shard_batch-raises",
        "rank0-leaves-watchdog",
        "rank0-leaves-watchdog-count_step",
    ],
)
def test_jax_survivor_gives_up_naming_who_left(tmp_path, leaving, shard_batch, count_steps):
    # rank 0 is also the coordination service: when it leaves, it must stay up until the
    # survivor has given up, or JAX would terminate the survivor with its own message.
    survivor = 1 - leaving
    args = ["--steps", "6", "--leaving-rank", str(leaving), "--leaving-steps", "2"]
    if not shard_batch:
        args += ["--no-shard-batch", *(["--count-steps"] if count_steps else [])]
    start = time.monotonic()
    with _job(tmp_path, *args) as job:
        codes, logs = _finish(job)
    elapsed = time.monotonic() - start
    assert codes[leaving] == 0, logs[leaving]
    assert codes[survivor] == 1, logs[survivor]
    text = logs[survivor]
    if shard_batch:  # a Python exception, raised by shard_batch as soon as it waits
        assert "DistributedError: shard_batch: process" in text, text
        assert (
            f"process {leaving} returned normally and left the job after 2 steps "
            "(shard_batch calls)"
        ) in text, text
        assert "The last step both reached is step 2" in text, text
    elif count_steps:  # stuck in XLA, the watchdog ends it: the loop counted its steps
        assert (
            f"process {leaving} returned normally and left the job after 2 steps "
            "(count_step calls), and"
        ) in text, text
        assert "The last step both reached is step 2" in text, text
    else:  # the main thread is stuck in XLA: the watchdog ends the process
        assert f"process {leaving} returned normally and left the job, and" in text, text
        assert "cannot name the last step both reached" in text, text  # none were counted
        assert "call fs.distributed.count_step() once per step" in text, text
    if not shard_batch:
        assert re.search(r"has made no progress for \d+ s", text), text
        assert "departure_timeout=3 s" in text, text
    assert "Terminating process because the JAX distributed service" not in text, text
    assert elapsed < 60, elapsed


def test_sigkilled_peer_is_named_at_once_without_fail_fast(tmp_path):
    # fail_fast=False (the default) and process 1 SIGKILLs itself after 2 steps. Before
    # the liveness links, process 0 raised gloo's "Connection closed by peer
    # [127.0.0.1]:PORT", which names no process, then waited shutdown_timeout for a note
    # ("process 1 posted no note within 20 s"), or JAX aborted it after ~111 s first.
    # Now it names process 1 within a fraction of a second of the death, funshard does
    # not end it, and its exit handler names process 1 at once too.
    port = free_port(pair=True)
    argv = [sys.executable, str(WORKER), "--steps", "6", "--leaving-rank", "1"]
    argv += ["--leaving-steps", "2", "--sigkill", "--no-fail-fast", "--no-shard-batch"]
    argv += ["--shutdown-timeout", "20"]
    env = {r: rank_env(r, 2, port, FUNSHARD_DEPARTURE_TIMEOUT=str(TIMEOUT_S)) for r in (0, 1)}
    with launch(tmp_path, {r: (argv, env[r]) for r in (0, 1)}, HARD_CAP_S, True) as job:
        assert job.procs[1].wait(timeout=HARD_CAP_S) == -signal.SIGKILL, job.log(1)
        died = time.monotonic()
        while "at exit: process 1 died" not in job.log(0, "err"):
            assert time.monotonic() - died < 15, job.log(0)
            time.sleep(0.05)
        named_after = time.monotonic() - died
        time.sleep(0.5)  # funshard ends no process: it is still running, in JAX's barrier
        running = job.procs[0].poll() is None
        err, out = job.log(0, "err"), job.log(0, "out")
    assert running, err
    assert named_after < TIMEOUT_S, (named_after, err)
    assert "rank 0: step 1 " in out and "rank 0: step 2 " not in out, out
    assert "Gloo AllGather failed" in err, err  # the collective failed, naming an address
    assert (
        "funshard.distributed: process 0 of 2: process 1 died (it ended without running its "
        "exit: killed by a signal such as SIGKILL or the out-of-memory killer, or crashed"
    ) in err, err
    assert "its start-up connection to this process closed without a goodbye" in err, err
    assert "heartbeat_timeout=100 s" in err, err
    assert "funshard.distributed: process 0 of 2 at exit: process 1 died (" in err, err
    assert "posted no note" not in err, err
    # The died line comes before anything JAX does at exit (its barrier has not failed).
    assert "Terminating process" not in err and "Check failure" not in err, err


@pytest.mark.slow
@pytest.mark.torch
def test_torch_frontend_survivor_raises_naming_who_left(tmp_path, monkeypatch):
    # The leaving rank raises an exception of its own and catches it before returning
    # (running fewer steps is the same to the others); the survivor catches the
    # frontend's RuntimeError and returns too, with its collective still stuck: both
    # must still exit 0 (torchrun's status), never hang or crash in the teardown.
    # Processes that finish together exit 0 too: tests/test_multiprocess.py.
    monkeypatch.setenv("FUNSHARD_DEPARTURE_TIMEOUT", str(TIMEOUT_S))  # read by clean_env
    with Job(
        TORCH_WORKER,
        tmp_path,
        2,
        free_port(pair=True),
        HARD_CAP_S,
        "--steps",
        "6",
        "--leaving-rank",
        "1",
        "--leaving-steps",
        "2",
        "--how",
        "caught",
    ) as job:
        _, ranks = job.result()
    survivor, leaver = ranks
    assert int(leaver["done"]) == 2 and str(leaver["error"]) == ""
    error = str(survivor["error"])
    assert int(survivor["done"]) == 2, error
    assert "process 1 returned normally and left the job after 2 steps (backward passes)" in error
    assert "The last step both reached is step 2" in error
    assert re.search(r"has made no progress for \d+ s", error), error
    # Bounded: the survivor gave up a few seconds after the other rank left.
    assert float(survivor["left_at"]) - float(leaver["left_at"]) < 30


@pytest.mark.slow
@pytest.mark.torch
def test_torch_full_state_dict_on_one_rank_only_is_a_bounded_named_error(tmp_path, monkeypatch):
    # FSDP users write `if rank == 0: sd = full_state_dict(model)`: its gathers would
    # pair with the other rank's next training gathers (wrong tensors, or a hang). Now
    # rank 0 raises after departure_timeout naming rank 1, returns, and rank 1 (waiting
    # for its forward's gather) gives up naming rank 0.
    monkeypatch.setenv("FUNSHARD_DEPARTURE_TIMEOUT", str(TIMEOUT_S))  # read by clean_env
    with Job(
        TORCH_WORKER,
        tmp_path,
        2,
        free_port(pair=True),
        HARD_CAP_S,
        "--steps",
        "6",
        "--leaving-rank",
        "-1",
        "--leaving-steps",
        "0",
        "--extra-full-state-dict",
        "0",
    ) as job:
        _, ranks = job.result()
    caller, other = (str(r["error"]) for r in ranks)
    assert [int(r["done"]) for r in ranks] == [2, 2], (caller, other)
    assert (
        "full_state_dict outside a step: process 0 of 2 is about to issue an all-gather" in caller
    ), caller
    assert f"process 1 has not issued it after {TIMEOUT_S} s" in caller, caller
    assert (
        "process 0 returned normally and left the job after 2 steps (backward passes)" in other
    ), other
    assert float(ranks[1]["left_at"]) - float(ranks[0]["left_at"]) < 30


@pytest.mark.parametrize("shard_batch", [True, False], ids=["shard_batch", "own-batch"])
def test_eager_unshard_on_one_process_only_is_a_bounded_named_error(tmp_path, shard_batch):
    # Process 1 alone calls an eager fs.unshard before step 2 while process 0 goes on to
    # the step: before the check, that all-gather paired with the step's first one and
    # both processes waited silently (still waiting after 150 s). Now process 1 raises
    # after departure_timeout naming process 0, and process 0 (waiting in shard_batch,
    # or in the step's collective) fails naming process 1.
    start = time.monotonic()
    with _job(
        tmp_path,
        "--steps",
        "4",
        "--leaving-rank",
        "-1",
        "--leaving-steps",
        "0",
        "--extra-unshard",
        "1",
        *([] if shard_batch else ["--no-shard-batch"]),
    ) as job:
        codes, logs = _finish(job)
    elapsed = time.monotonic() - start
    assert codes == [1, 1], logs
    assert "DistributedTimeoutError: unshard outside a step: process 1 of 2" in logs[1], logs[1]
    assert "process 0 has not issued it after 3 s" in logs[1], logs[1]
    assert "every process must issue the same collectives" in logs[1], logs[1]
    assert "process 1 raised DistributedTimeoutError and left the job" in logs[0], logs[0]
    assert "rank 0: step 2" not in logs[0], logs[0]  # the step never completed
    assert elapsed < 60, elapsed


def test_eager_unshard_of_different_trees_fails_on_every_process_at_once(tmp_path):
    with _job(
        tmp_path,
        "--steps",
        "4",
        "--leaving-rank",
        "-1",
        "--leaving-steps",
        "0",
        "--other-unshard",
        "1",
    ) as job:
        codes, logs = _finish(job)
    assert codes == [1, 1], logs
    for rank, other in ((0, 1), (1, 0)):
        text = logs[rank]
        assert (
            f"DistributedError: unshard outside a step: process {rank} is about to issue" in text
        ), text
        assert f"but process {other} issues an all-gather of 1 leaf" in text, text
        assert "pass the same tree to unshard on every process" in text, text
