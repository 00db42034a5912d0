"""A process that leaves the job early never leaves the others waiting.

Real processes on 127.0.0.1. One process returns from its script after fewer steps (or
after catching its own exception); before funshard/_departure.py the others blocked in a
collective until JAX's shutdown barrier gave up (~300 s), silently. Now the survivors
end within FUNSHARD_DEPARTURE_TIMEOUT (set short here) with an error naming the process
that left and the last step both reached, and the one that left exits 0.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _torchrun
import numpy as np
import pytest

WORKER = Path(__file__).with_name("_departed_worker.py")
TORCH_WORKER = Path(__file__).with_name("_departed_torch_worker.py")
TIMEOUT_S = 3  # FUNSHARD_DEPARTURE_TIMEOUT in the jobs
HARD_CAP_S = 90  # a job still running then is a hang: killed, and the test fails


def _env(rank: int, world: int, port: int) -> dict:
    env = _torchrun.clean_env()
    env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), FUNSHARD_DEPARTURE_TIMEOUT=str(TIMEOUT_S))
    return env


@contextlib.contextmanager
def _job(tmp_path: Path, *args: str, processes: int = 2):
    """Starts the JAX workers; always kills what is left of them on the way out."""
    port, procs = _torchrun.free_port_pair(), []
    try:
        for rank in range(processes):
            with open(tmp_path / f"rank{rank}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), *args], env=_env(rank, processes, port),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _finish(procs, tmp_path: Path) -> tuple[list[int], list[str]]:
    deadline = time.monotonic() + HARD_CAP_S
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            logs = "\n".join((tmp_path / f"rank{r}.log").read_text() for r in range(len(procs)))
            pytest.fail(f"still running after {HARD_CAP_S} s (killed): a hang\n{logs[-4000:]}")
    return codes, [(tmp_path / f"rank{r}.log").read_text() for r in range(len(procs))]


@pytest.mark.parametrize("leaving,shard_batch", [(1, True), (0, False)],
                         ids=["rank1-leaves-shard_batch-raises", "rank0-leaves-watchdog"])
def test_jax_survivor_gives_up_naming_who_left(tmp_path, leaving, shard_batch):
    # rank 0 is also the coordination service: when it leaves, it must stay up until the
    # survivor has given up, or JAX would terminate the survivor with its own message.
    survivor = 1 - leaving
    args = ["--steps", "6", "--leaving-rank", str(leaving), "--leaving-steps", "2"]
    start = time.monotonic()
    with _job(tmp_path, *args, *([] if shard_batch else ["--no-shard-batch"])) as procs:
        codes, logs = _finish(procs, tmp_path)
    elapsed = time.monotonic() - start
    assert codes[leaving] == 0, logs[leaving]
    assert codes[survivor] == 1, logs[survivor]
    text = logs[survivor]
    if shard_batch:  # a Python exception, raised by shard_batch as soon as it waits
        assert "RuntimeError: shard_batch: process" in text, text
        assert (f"process {leaving} returned normally and left the job after 2 steps "
                "(shard_batch calls)") in text, text
        assert "The last step both reached is step 2" in text, text
    else:  # the main thread is stuck in XLA: the watchdog ends the process
        assert f"process {leaving} returned normally and left the job, and" in text, text
        assert "cannot name the last step both reached" in text, text  # none were counted
        assert re.search(r"has made no progress for \d+ s", text), text
        assert "departure_timeout=3 s" in text, text
    assert "Terminating process because the JAX distributed service" not in text, text
    assert elapsed < 60, elapsed


def test_torch_frontend_survivor_raises_naming_who_left(tmp_path, monkeypatch):
    # The leaving rank raises an exception of its own and catches it before returning
    # (running fewer steps is the same to the others); the survivor catches the
    # frontend's RuntimeError and returns too, with its collective still stuck: both
    # must still exit 0 (torchrun's status), never hang or crash in the teardown.
    # Processes that finish together exit 0 too: tests/test_multiprocess.py.
    monkeypatch.setenv("FUNSHARD_DEPARTURE_TIMEOUT", str(TIMEOUT_S))  # read by clean_env
    job = _torchrun.Job(TORCH_WORKER, tmp_path, 2, _torchrun.free_port_pair(), HARD_CAP_S,
                        "--steps", "6", "--leaving-rank", "1", "--leaving-steps", "2",
                        "--how", "caught")
    try:
        _, ranks = job.result()
    finally:
        job.kill()
    survivor, leaver = ranks
    assert int(leaver["done"]) == 2 and str(leaver["error"]) == ""
    error = str(survivor["error"])
    assert int(survivor["done"]) == 2, error
    assert "process 1 returned normally and left the job after 2 steps (backward passes)" in error
    assert "The last step both reached is step 2" in error
    assert re.search(r"has made no progress for \d+ s", error), error
    # Bounded: the survivor gave up a few seconds after the other rank left.
    assert float(survivor["left_at"]) - float(leaver["left_at"]) < 30
