"""A process that dies is named at once: the liveness links, in-process.

The rendezvous connections stay open (funshard/distributed/_links.py): a link that ends
without "bye" leads to a process that died. Here the links are socket pairs and the
coordination service is a fake; tests/test_departed_peer.py kills a real process.
"""

import atexit
import math
import socket
import time

import pytest
from _departure_fakes import FakeService, fake_lifecycle_service

import funshard as fs
from funshard import comm
from funshard.comm import _departures
from funshard.distributed import _lifecycle
from funshard.distributed._links import Links


@pytest.fixture
def pairs():
    """Three socket pairs: this process's ends, as links to ranks 1..3, and the peers' ends."""
    made = [socket.socketpair() for _ in range(3)]
    for mine, _ in made:
        mine.setblocking(False)
    yield {rank: mine for rank, (mine, _) in enumerate(made, 1)}, [p for _, p in made]
    for mine, theirs in made:
        mine.close()
        theirs.close()


def test_a_link_ending_without_bye_is_a_death_reported_once(pairs):
    mine, theirs = pairs
    links = Links(mine)
    assert links.dropped(0.05) == []  # all alive: waits, says nothing
    theirs[0].sendall(b"bye\n")  # rank 1 leaves through Python...
    theirs[0].close()  # ...then ends
    theirs[2].close()  # rank 3 dies: no bye
    assert links.dropped(0.5) + links.dropped(0.1) == [3]
    assert links.dropped(0.05) == []  # neither is watched any more
    theirs[1].close()
    assert links.dropped(0.5) == [2]


def test_bye_goes_to_every_link_once_and_never_from_a_forked_child(pairs, monkeypatch):
    mine, theirs = pairs
    links = Links(mine)
    links.say_bye()
    links.say_bye()
    for peer in theirs:
        peer.settimeout(1.0)
        assert peer.recv(64) == b"bye\n"
    child = Links(mine)
    monkeypatch.setattr("os.getpid", lambda: -1)  # a fork shares the sockets
    child.say_bye()
    for peer in theirs:
        peer.setblocking(False)
        with pytest.raises(BlockingIOError):
            peer.recv(64)


@pytest.fixture
def lifecycle(monkeypatch):
    """A lifecycle of process `rank` of 4 on a fake service, with socket-pair links."""
    service, _ = fake_lifecycle_service(monkeypatch)
    made = []

    def make(rank: int, links: Links, fail_fast: bool = False) -> _lifecycle.Lifecycle:
        launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 4, rank, None)
        _lifecycle.start(service, launch, math.inf, 0.3, 100, fail_fast, 1.0, links)
        life = _lifecycle._current
        assert life is not None
        made.append(life)
        return life

    yield make, service
    for life in made:
        life.stop_watchdog()
        atexit.unregister(life.at_exit)


def _died_line(err: str, rank: int) -> str:
    lines = [line for line in err.splitlines() if f"process {rank} died (" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_process_0_names_a_dead_process_at_once_and_posts_its_note(pairs, lifecycle, capsys):
    make, service = lifecycle
    mine, theirs = pairs
    life = make(0, Links(mine))
    # Rank 2 left with a note of its own, then died before saying bye; rank 3 just dies.
    service.leave(2, 5, how="raised KeyError", barrier=False)
    theirs[1].close()
    theirs[2].close()
    deadline = time.monotonic() + 5
    while life.named != {2, 3} and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # the note is posted just after the line
    err = capsys.readouterr().err
    _died_line(err, 2)
    line = _died_line(err, 3)
    assert line.startswith("funshard.distributed: process 0 of 4: process 3 died (it ended "), line
    assert "killed by a signal such as SIGKILL" in line, line
    assert "its start-up connection to this process closed without a goodbye" in line, line
    assert "heartbeat_timeout=100 s" in line and "fail_fast=True" in line, line
    note = comm.Note.parse(service.kv["funshard/left/3"])
    assert note is not None and note.died and note.rank == 3 and not note.barrier
    # A note of the process's own is never overwritten (it says more).
    assert comm.Note.parse(service.kv["funshard/left/2"]).how == "raised KeyError"
    # The exit protocol does not wait shutdown_timeout for the dead process's note.
    service.leave(1, 5)
    life.at_exit()
    err = capsys.readouterr().err
    assert "at exit: process 2 left without JAX's shutdown barrier; process 3 died (" in err, err
    assert "posted no note" not in err, err
    assert theirs[0].recv(64) == b"bye\n"  # it left through Python: no one reports it


def test_a_death_during_the_exit_wait_ends_it(pairs, lifecycle, capsys):
    make, service = lifecycle
    mine, theirs = pairs
    life = make(0, Links(mine))
    life.stop_watchdog()  # the exit handler watches the links itself
    life.shutdown_s = 30.0
    service.leave(1, 5)
    service.leave(2, 5)
    theirs[2].close()
    start = time.monotonic()
    life.at_exit()
    assert time.monotonic() - start < 5
    assert "at exit: process 3 died (" in capsys.readouterr().err


def test_other_processes_name_process_0_and_deaths_it_posted(pairs, lifecycle, capsys):
    make, service = lifecycle
    mine, theirs = pairs
    life = make(2, Links({0: mine[1]}))
    service.kv["funshard/left/3"] = comm.Note(3, 0, "step", "died", False, died=True).text()
    theirs[0].close()  # rank 0 dies
    deadline = time.monotonic() + 5
    while life.named != {0, 3} and time.monotonic() < deadline:
        time.sleep(0.02)
    err = capsys.readouterr().err
    zero, three = _died_line(err, 0), _died_line(err, 3)
    assert zero.startswith("funshard.distributed: process 2 of 4: process 0 died ("), zero
    assert "JAX now terminates this process too" in zero, zero
    assert "process 0 saw its start-up connection close without a goodbye" in three, three
    assert "funshard/left/0" not in service.kv  # only process 0 posts (it has the service)


def test_a_dead_process_in_the_messages_of_the_other_checks(monkeypatch):
    service = FakeService()
    monkeypatch.setattr(_departures, "_board", None)
    board = comm.open_board(service, 0, 2, 30.0)
    board.step, board.kind = 4, "shard_batch call"
    assert board.post_death(1)
    assert not board.post_death(1)  # posted already
    error = comm.left_before_this_step()  # a dead process never joins any step
    assert error is not None
    assert "shard_batch: process 0 of 2, at step 4: process 1 died (it ended" in error, error
    assert "funshard cannot tell which steps process 1 finished before it died" in error
    launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 2, 0, None)
    gloo = RuntimeError("Gloo AllGather failed: Read error [127.0.0.1]:4411: Connection reset")
    summary = _lifecycle.failure_summary(gloo, launch, {}, comm.departed())
    assert "a collective failed because process 1 died (it ended without running" in summary
    own = _lifecycle.failure_summary(fs.errors.DistributedError(error), launch, {}, comm.departed())
    assert "stops on an uncaught DistributedError, after process 1 died (it ended" in own, own
