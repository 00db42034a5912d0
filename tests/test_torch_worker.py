"""The torch frontend's collective thread (`torch_frontend/_worker.py`), in process.

Its futures give up, naming who left, when a process of the job left and the wait has
lasted `departure_timeout`; its jobs run in order; and a running job is counted by
`funshard.comm.collective_running`, which the exit protocol reads.
"""

from __future__ import annotations

import threading
import time

import pytest
from _departure_fakes import FakeService

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

from funshard import comm
from funshard.comm import _departures
from torch_frontend._worker import OrderedWorker

pytestmark = pytest.mark.torch


@pytest.fixture
def board(monkeypatch):
    service = FakeService()
    mon = comm.Board(service, rank=0, count=2, timeout=0.6)
    monkeypatch.setattr(_departures, "_board", mon)
    return mon, service


def test_a_collective_future_gives_up_on_a_process_that_left(board):
    mon, service = board
    worker, release = OrderedWorker("test"), threading.Event()
    assert worker.submit(lambda: 41 + 1).result() == 42  # no one left: a plain future
    stuck = worker.submit(release.wait)  # a collective the other process never joins
    mon.step, mon.kind = 3, "backward pass"
    service.leave(1, 2, kind="backward pass")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        stuck.result()
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert (
        "process 0 of 2 gives up: process 1 returned normally and left the job after "
        "2 steps (backward passes)" in text
    ), text
    assert "The last step both reached is step 2." in text
    assert "departure_timeout=0.6 s" in text
    assert comm.running_collectives() == 1  # still stuck: the exit protocol sees it
    release.set()
    assert stuck.result() is True  # the job itself finished meanwhile
    assert worker.submit(lambda: 1).result() == 1  # the worker goes on, in order
    assert comm.running_collectives() == 0


def test_a_collective_future_keeps_its_own_exceptions(board):
    worker = OrderedWorker("test")

    def late():
        time.sleep(0.7)
        raise TimeoutError("the job's own timeout")

    with pytest.raises(TimeoutError, match="the job's own timeout"):
        worker.submit(late).result()


def test_jobs_run_in_submission_order_on_one_thread():
    worker, seen = OrderedWorker("test"), []
    futures = [
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        for i in range(20)
    ]
    for future in futures:
        future.result()
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"test"}
