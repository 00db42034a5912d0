"""Multi-process start-up that cannot complete, and batches that differ between processes.

Each case starts real processes (`tests/_startup_worker.py`, one CPU device each) on
127.0.0.1 with torchrun's environment variables set by hand and a start-up timeout of a
few seconds. Measured on jax 0.10.2 before funshard's rendezvous existed: a missing peer
or coordinator, or an unresolvable MASTER_ADDR, made JAX's client abort the process
(SIGABRT) after about twice the timeout, blaming "another task", with nothing printed
while waiting; and `shard_batch` accepted different row counts per process.
"""

import sys
import time
from pathlib import Path

import _launch
import jax
import pytest
from _launch import free_port, launch, rank_env

import funshard.distributed

WORKER = Path(__file__).with_name("_startup_worker.py")
HARD_CAP_S = 45  # per job: a hung start-up fails the test instead of the run
TIMEOUT_S = 4  # the start-up timeout the workers get
# Python and JAX import in every worker; the 2 cores are shared with other jobs.
SLACK_S = 20
LAUNCH_VARS = (*_launch.LAUNCH_VARS, "FUNSHARD_INITIALIZATION_TIMEOUT")


def _env(rank: int, world: int, port: int, **extra: str) -> dict:
    # A start-up timeout only where a test gives one.
    env = rank_env(rank, world, port)
    env.pop("FUNSHARD_INITIALIZATION_TIMEOUT", None)
    return {**env, **extra}


def _run(tmp_path: Path, ranks: dict) -> tuple[dict, dict, float]:
    """Runs one worker per `ranks` entry (rank -> (env, args)); always kills leftovers.

    Returns ({rank: exit code, None if still running after HARD_CAP_S}, {rank: stdout +
    stderr}, seconds until all ended).
    """
    commands = {r: ([sys.executable, str(WORKER), *args], env) for r, (env, args) in ranks.items()}
    with launch(tmp_path, commands, HARD_CAP_S) as job:
        codes = job.wait()
    return codes, job.logs(), job.elapsed


def _waiting_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("funshard: process")]


@pytest.mark.multiprocess
def test_missing_peer_is_named_on_every_process(tmp_path):
    # WORLD_SIZE=3, but process 2 never starts.
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    args = ["--timeout", str(TIMEOUT_S)]
    codes, logs, elapsed = _run(tmp_path, {r: (_env(r, 3, port), args) for r in (0, 1)})
    assert codes == {0: 1, 1: 1}, (codes, logs)  # a Python exception, not SIGABRT (-6)
    assert elapsed < TIMEOUT_S + SLACK_S, (elapsed, logs)
    assert _waiting_lines(logs[0]) == [
        f"funshard: process 0 of 3 waiting for process 2 at 127.0.0.1:{port + 1}, "
        f"timeout {TIMEOUT_S} s"
    ], logs[0]
    assert (
        f"TimeoutError: initialize: process 0 of 3 gave up after {TIMEOUT_S} s: "
        f"process 2 never reached the coordinator at 127.0.0.1:{port + 1}"
    ) in logs[0]
    assert (
        "TimeoutError: initialize: process 1 of 3: process 0 gave up waiting: "
        "process 2 never reached the coordinator"
    ) in logs[1], logs[1]
    assert "another task" not in logs[0] + logs[1]


@pytest.mark.multiprocess
def test_missing_coordinator_times_out_in_python(tmp_path):
    # Process 1 alone; the timeout comes from the environment variable this time.
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    env = _env(1, 2, port, FUNSHARD_INITIALIZATION_TIMEOUT=str(TIMEOUT_S))
    codes, logs, elapsed = _run(tmp_path, {1: (env, [])})
    assert codes == {1: 1}, (codes, logs)
    assert elapsed < TIMEOUT_S + SLACK_S, (elapsed, logs)
    assert _waiting_lines(logs[1]) == [
        f"funshard: process 1 of 2 waiting for process 0 (the coordinator) and the others "
        f"at 127.0.0.1:{port + 1}, timeout {TIMEOUT_S} s"
    ], logs[1]
    assert (
        f"TimeoutError: initialize: process 1 of 2 could not reach the coordinator "
        f"(process 0) at 127.0.0.1:{port + 1} within {TIMEOUT_S} s (Connection refused)"
    ) in logs[1], logs[1]


@pytest.mark.multiprocess
def test_processes_that_disagree_on_the_world_size(tmp_path):
    # Process 1 believes in 3 processes, process 0 in 2: process 1 is refused at once,
    # process 0 names it as missing when its timeout expires.
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    args = ["--timeout", str(TIMEOUT_S)]
    codes, logs, _ = _run(tmp_path, {0: (_env(0, 2, port), args), 1: (_env(1, 3, port), args)})
    assert codes == {0: 1, 1: 1}, (codes, logs)
    assert (
        "DistributedError: initialize: process 0 of 2 rejected this process: a process "
        "started as rank 1 of 3 processes, but process 0 expects 2"
    ) in logs[1], logs[1]
    assert "gave up after 4 s: process 1 never reached" in logs[0], logs[0]
    assert "WORLD_SIZE differs between processes" in logs[0]


@pytest.mark.multiprocess
def test_late_peer_is_awaited_and_uneven_batches_are_refused_everywhere(tmp_path):
    # Process 1 starts 2 s late: process 0 says once what it waits for, then both start.
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    codes, logs, _ = _run(
        tmp_path,
        {
            0: (_env(0, 2, port), ["--timeout", "30", "--batches"]),
            1: (_env(1, 2, port), ["--timeout", "30", "--batches", "--delay", "2"]),
        },
    )
    assert codes == {0: 0, 1: 0}, (codes, logs)
    assert _waiting_lines(logs[0]) == [
        f"funshard: process 0 of 2 waiting for process 1 at 127.0.0.1:{port + 1}, timeout 30 s"
    ]
    for rank in (0, 1):
        log = logs[rank]
        assert "uneven batch 0 refused: shard_batch: the processes passed batches" in log, log
        assert "local_batch['x']: 4 rows on process 0; 2 rows on process 1" in log
        assert "local_batch['x']: float32 (2, 3) on process 0; float32 (2, 5) on process 1" in log
        assert "local_batch['y']: int32 (2,) on process 0; float32 (2,) on process 1" in log
        assert "local_batch['y']" not in log.split("uneven batch 1")[0]  # it agreed
        assert "accepted" not in log
        # The failed checks left the processes in step: the next batch works.
        assert f"rank {rank}: even batch (4, 3) sum 66.0" in log, log


# ---- In this process: what fails before anything is started ----


@pytest.fixture
def clean_launch_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    jax.devices()  # started: a call that got past the checks below would be refused
    return monkeypatch


def test_unresolvable_coordinator_fails_fast(clean_launch_env):
    clean_launch_env.setenv("RANK", "1")
    clean_launch_env.setenv("WORLD_SIZE", "2")
    clean_launch_env.setenv("MASTER_ADDR", "no-such-host.invalid")
    clean_launch_env.setenv("MASTER_PORT", "29500")
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"coordinator host 'no-such-host.invalid' \(from "
        r"MASTER_ADDR / MASTER_PORT\) does not resolve",
    ):
        funshard.distributed.initialize(initialization_timeout=TIMEOUT_S)
    assert time.monotonic() - start < 2
    with pytest.raises(ValueError, match="from the coordinator_address argument"):
        funshard.distributed.initialize("no-such-host.invalid:1", 2, 0)
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "address,kwargs,env,match",
    [
        (
            "127.0.0.1:99999",
            {},
            {},
            r"'127.0.0.1:99999' \(from the coordinator_address argument\)"
            r" is not 'host:port'",
        ),
        ("127.0.0.1:1", {"initialization_timeout": -1}, {}, "initialization_timeout=-1 is not"),
        (
            "127.0.0.1:1",
            {},
            {"FUNSHARD_INITIALIZATION_TIMEOUT": "soon"},
            "FUNSHARD_INITIALIZATION_TIMEOUT='soon' is not a positive number",
        ),
    ],
)
def test_bad_start_up_settings_are_refused(clean_launch_env, address, kwargs, env, match):
    for name, value in env.items():
        clean_launch_env.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        funshard.distributed.initialize(address, 2, 1, **kwargs)
