"""A process's life in a job: its departure note, the watchdog, and how it ends.

JAX's runtime does not notice a process that returns from its script early: at exit it
waits in JAX's shutdown barrier (`shutdown_timeout`, 300 s) with its gloo connections
open, while the others block in a collective it will never join, silently. So in a
funshard job (started by `funshard.distributed.initialize`) every process:

- posts a note in the coordination service's key-value store when it leaves
  (`funshard.comm`'s board: how many steps it counted and how it ended), at exit or
  just before `fail_fast` or the watchdog ends it;
- at exit, waits for every other process's note before JAX's shutdown barrier (so the
  others see it has left, and process 0 keeps the service up for them);
- keeps its start-up connection(s) to process 0 open (`_links`): a process that dies
  without running its exit closes them at once, and a thread then names it on stderr
  within a fraction of a second (process 0 also posts a "died" note for it);
- runs a watchdog thread that reads the notes every second or so. When a process has
  left and this one has made no progress since (its main thread at the same place, the
  process using almost no CPU) for `departure_timeout` seconds, it prints, once, who left
  after which step. Waits that funshard itself runs in Python (the torch frontend's
  collectives, the agreement checks) raise a RuntimeError instead.

Ending the process is the user's choice: `fail_fast` (default False) is the one switch
for everything process-wide. Only with it does funshard replace `sys.excepthook` (print
a summary, exit with status 1 without JAX's shutdown barrier), let the watchdog exit with
status 1, and let the exit protocol skip JAX's shutdown barrier when some process left
without it. Without it, funshard never calls `os._exit`: it writes notes and says what
it sees, and JAX's own timeouts end a job whose process left. See docs/distributed.md.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from funshard import _jax_compat, _py_compat, comm
from funshard.distributed._launch import Launch
from funshard.distributed._links import Links

# Below this share of one core a process is idle: a blocked collective uses ~0.3 %
# (heartbeats, this watchdog), any computation far more.
_IDLE_CPU_SHARE = 0.05
_EXIT_LAG_S = 1.0  # process 0's wait, once the others' notes are in, for them to exit
# The longest exit waits for the watchdog thread: one call on a live service (ms); a
# dead service is left to JAX, which ends the process itself.
_WATCHDOG_JOIN_S = 2.0
_LINK_POLL_S = 0.2  # the liveness thread's longest wait, so that it stops quickly
_NOTES_POLL_S = 1.0  # how often a process other than 0 reads process 0's "died" notes

ExceptHook = Callable[[type[BaseException], BaseException, TracebackType | None], object]

# What the watchdog does about a process that left (`watchdog_action`).
WAIT, EXIT, WARN, DONE = "wait", "exit", "warn", "done"


def watchdog_action(waited_s: float, timeout: float, fail_fast: bool, warned: bool) -> str:
    """What the watchdog does now, this process having waited `waited_s` for one that left.

    Args:
      waited_s: seconds without progress since a process left (0: none left).
      timeout: `departure_timeout`.
      fail_fast: `initialize`'s switch: whether funshard may end the process.
      warned: whether the watchdog already said that this process is stuck.

    Returns:
      WAIT (not stuck long enough), EXIT (print, post a note, exit with status 1: only
      with `fail_fast`), WARN (print once what happens, do not exit) or DONE (said it
      already: nothing left to do).
    """
    if waited_s < timeout:
        return WAIT
    if fail_fast:
        return EXIT
    return DONE if warned else WARN


def _stays(board: comm.Board, heartbeat_s: float, shutdown_s: float) -> str:
    # Measured (2 CPU processes, one returning after 2 of 6 steps, shutdown_timeout=10):
    # it waited 10 s at exit for the other's note, 10 s in JAX's shutdown barrier, and
    # the barrier's failure made JAX terminate both (SIGABRT) about 26 s after it left.
    return (
        "This process does not exit by itself (funshard.distributed.initialize("
        "fail_fast=False), the default): it stays in that collective until JAX ends the "
        f"job. A process that left waits up to shutdown_timeout={shutdown_s:g} s at its "
        "exit for the others' notes, then up to as long again in JAX's shutdown barrier, "
        "whose failure makes JAX terminate every process of the job (status 134); a "
        f"process that died is declared dead after heartbeat_timeout={heartbeat_s:g} s. "
        "Pass fail_fast=True to initialize (torchrun and SLURM jobs usually want it) to "
        "exit with status 1 as soon as this is noticed."
    )


def stuck_notice(board: comm.Board, waited_s: float, heartbeat_s: float, shutdown_s: float) -> str:
    """What the watchdog prints, once, without `fail_fast`: who left, and what happens."""
    return (
        f"funshard.distributed: process {board.rank} of {board.count} is stuck: "
        f"{board.situation(waited_s, 'the main thread')} "
        f"{comm.same_steps_hint(board.timeout, 'Noticed')} "
        f"{_stays(board, heartbeat_s, shutdown_s)}"
    )


def _barrier_notice(board: comm.Board, shutdown_s: float) -> str:
    left = [n for _, n in sorted(board.notes.items()) if not n.barrier]
    missing = sorted(set(range(board.count)) - set(board.notes) - {board.rank})
    who = "; ".join(
        [
            comm.departure_text(n)
            if n.died
            else f"process {n.rank} left without JAX's shutdown barrier"
            for n in left
        ]
        + ([f"{_processes(missing)} posted no note within {shutdown_s:g} s"] if missing else [])
    )
    return (
        f"funshard.distributed: process {board.rank} of {board.count} at exit: {who}. "
        f"It now waits in JAX's shutdown barrier (up to shutdown_timeout={shutdown_s:g} s), "
        "whose failure makes JAX terminate every process of the job (fail_fast=False, "
        "the default; initialize(fail_fast=True) skips the barrier and exits at once)."
    )


_SEEN_LINK = "its start-up connection to this process closed without a goodbye"
_SEEN_NOTE = "process 0 saw its start-up connection close without a goodbye"


def died_notice(
    board: comm.Board, rank: int, seen: str, heartbeat_s: float, fail_fast: bool
) -> str:
    """What the liveness thread prints, at once, about process `rank` that died."""
    note = comm.Note(rank, 0, "step", "died", barrier=False, died=True)
    if rank == 0:
        then = (
            "Process 0 ran JAX's coordination service, so JAX now terminates this process "
            'too (status 134, "the JAX distributed service detected fatal errors").'
        )
    elif fail_fast:
        then = (
            'A collective with it fails (gloo: "Connection reset by peer" or "closed '
            'by peer"), and fail_fast then exits with status 1.'
        )
    else:
        then = (
            'A collective with it fails (gloo: "Connection reset by peer" or "closed '
            'by peer"). funshard does not end this process (fail_fast=False, the '
            "default): JAX's coordination service declares the dead process after "
            f"heartbeat_timeout={heartbeat_s:g} s and then terminates every process of the "
            "job. Pass fail_fast=True to initialize to exit with status 1 as soon as a "
            "collective fails."
        )
    return (
        f"funshard.distributed: process {board.rank} of {board.count}: "
        f"{comm.departure_text(note)}: {seen} (noticed at {time.strftime('%H:%M:%S')}). "
        f"{then}"
    )


def _processes(ranks: list[int]) -> str:
    return f"process{'es' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _main_place() -> tuple | None:
    """Where the main thread is: (frame identity, instruction, code); None if nowhere."""
    return _py_compat.thread_position(threading.main_thread().ident)


def _exit_now(code: int) -> None:
    """Flushes the logs and streams, and ends the process at once, skipping atexit."""
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


class Lifecycle:
    """This process's side of the protocol (see the module docstring).

    Attributes:
      board: the notes (`funshard.comm`'s board for this job).
      shutdown_s: the longest this process waits at exit for the others' notes.
      heartbeat_s: JAX's heartbeat timeout, named in messages.
      fail_fast: whether funshard may end the process (`os._exit`).
      warned: the watchdog said once that this process is stuck (without `fail_fast`).
      links: the liveness links (`_links`); None in a process started without them.
      named: the processes this one has said died.
    """

    def __init__(
        self,
        board: comm.Board,
        shutdown_s: float,
        heartbeat_s: float,
        fail_fast: bool,
        links: Links | None = None,
    ) -> None:
        self.board, self.shutdown_s, self.heartbeat_s = board, shutdown_s, heartbeat_s
        self.fail_fast = fail_fast
        self.warned = False
        self.links = links
        self.named: set[int] = set()
        self.stop = threading.Event()  # set at exit: the threads return at once
        self.watchdog: threading.Thread | None = None
        self.liveness: threading.Thread | None = None

    def exit(self, code: int) -> None:
        """Ends the process with `code`, skipping JAX's shutdown barrier: `fail_fast` only."""
        if self.fail_fast:
            self.say_bye()
            _exit_now(code)

    def say_bye(self) -> None:
        """Tells the linked processes that this one leaves through Python, not dying."""
        if self.links is not None:
            self.links.say_bye()

    def watch_links(self) -> None:
        """The liveness thread: names a process whose link ended without a bye, at once."""
        board, last_read = self.board, time.monotonic()
        while not self.stop.is_set():
            self.check_links(_LINK_POLL_S)
            # Process 0 posts the deaths it sees; the others read them (a third process's
            # death closes no link of theirs).
            if board.rank and board.count > 2 and time.monotonic() - last_read > _NOTES_POLL_S:
                last_read = time.monotonic()
                for rank, note in board.refresh().items():
                    if note.died:
                        self.on_death(rank, _SEEN_NOTE)

    def check_links(self, timeout: float) -> None:
        """Waits up to `timeout` s on the links, and acts on every death they show."""
        if self.links is None:
            time.sleep(timeout)
            return
        for rank in self.links.dropped(timeout):
            self.on_death(rank, _SEEN_LINK)

    def on_death(self, rank: int, seen: str) -> None:
        """Says, once, that process `rank` died, and how it was `seen`; process 0 posts it.

        Said first: the survivor's failing collective races this line to stderr.
        """
        if rank in self.named:
            return
        self.named.add(rank)
        board = self.board
        notice = died_notice(board, rank, seen, self.heartbeat_s, self.fail_fast)
        print(notice, file=sys.stderr, flush=True)
        if board.rank == 0:
            board.post_death(rank)  # never over a note of its own, which says more

    def watch(self) -> None:
        """The watchdog thread: acts once this process is stuck on one that left."""
        board = self.board
        poll = min(1.0, board.timeout / 5)
        place, cpu, quiet_since = _main_place(), time.process_time(), time.monotonic()
        while not board.leaving:
            if self.stop.wait(poll):
                return
            if _jax_compat.coordination_client() is not board.client:
                return  # the script shut jax.distributed down itself
            now_place, now_cpu = _main_place(), time.process_time()
            if now_place != place or now_cpu - cpu > _IDLE_CPU_SHARE * poll:
                quiet_since = time.monotonic()
            place, cpu = now_place, now_cpu
            if not board.refresh() or board.python_waits or board.leaving:
                continue
            if self.on_stuck(board.stuck_for(quiet_since)) == DONE:
                return

    def on_stuck(self, waited_s: float) -> str:
        """Acts on `watchdog_action` for a process stuck `waited_s` seconds; returns it."""
        action = watchdog_action(waited_s, self.board.timeout, self.fail_fast, self.warned)
        if action == EXIT:
            print(self.board.message(waited_s, "the main thread"), file=sys.stderr, flush=True)
            left = ", ".join(str(r) for r in sorted(self.board.notes))
            self.leave(f"gave up waiting for process {left}")
            self.exit(1)
        elif action == WARN:
            notice = stuck_notice(self.board, waited_s, self.heartbeat_s, self.shutdown_s)
            print(notice, file=sys.stderr, flush=True)
            self.warned = True
        return action

    def leave(self, how: str) -> None:
        """Notes that this process ends now, without JAX's shutdown barrier.

        Process 0 runs the coordination service, whose end terminates every process
        still connected ("the JAX distributed service detected fatal errors"): it first
        lets those already leaving (waiting at exit) see its note and go.
        """
        board = self.board
        board.post(how, barrier=False)
        deadline = time.monotonic() + (comm.SERVICE_GRACE_S if board.rank == 0 else 0)
        while time.monotonic() < deadline:
            notes = board.refresh()
            if all(not n.barrier for n in notes.values()) and board.failing() <= set(notes):
                if notes:
                    # A process posts its note just before it exits: between the two,
                    # the service's end would still abort it (seen once in ~10 CI runs
                    # of a loaded machine). The service cannot tell when it has gone
                    # (a dead task stays live until its heartbeat times out, ~100 s).
                    time.sleep(_EXIT_LAG_S)
                return
            time.sleep(comm.POLL_S)

    def at_exit(self) -> None:
        """Posts this process's note; waits for every other one before JAX's barrier."""
        self.stop_watchdog()
        self.say_bye()
        board = self.board
        if _jax_compat.coordination_client() is not board.client:
            return  # the script shut jax.distributed down itself
        failed = getattr(sys, "last_value", None)  # set for an uncaught exception
        how = "returned normally" if failed is None else f"raised {type(failed).__name__}"
        # A collective still running here is stuck on a process that left; the
        # interpreter's teardown would crash under it, so with fail_fast this process
        # skips the barrier, and says so in its first note (another may read it at once).
        stuck = comm.running_collectives() > 0
        board.post(how, barrier=not (stuck and self.fail_fast))
        deadline = time.monotonic() + self.shutdown_s
        while (
            len(board.refresh()) < board.count - 1
            and board.reachable
            and time.monotonic() < deadline
        ):
            self.check_links(comm.POLL_S)  # a death ends the wait: process 0 notes it
        gone = len(board.notes) < board.count - 1 or not all(
            n.barrier for n in board.notes.values()
        )
        if not (stuck or gone):
            return
        if not self.fail_fast:
            print(_barrier_notice(board, self.shutdown_s), file=sys.stderr, flush=True)
            return
        # JAX's shutdown barrier would wait for a process that will never arrive.
        self.leave(how)
        self.exit(0 if failed is None else 1)

    def stop_watchdog(self) -> None:
        """Ends the watchdog and liveness threads before JAX's shutdown, waiting a bounded time.

        A daemon thread still inside a call on the coordination client when JAX shuts the
        client down, or when the interpreter finalizes, aborts the whole process at exit
        ("terminate called ... FATAL: exception not rethrown") after the script's work
        is done: seen under load in 4-process jobs.
        """
        self.stop.set()
        for thread in (self.watchdog, self.liveness):
            if thread is not None and thread is not threading.current_thread():
                thread.join(_WATCHDOG_JOIN_S)


_current: Lifecycle | None = None


def start(
    client: Any,
    launch: Launch,
    departure_s: float,
    shutdown_s: float,
    heartbeat_s: float,
    fail_fast: bool,
    rendezvous_s: float,
    links: Links | None = None,
) -> None:
    """Starts this process's side: notes, exit protocol, threads, and `fail_fast`'s hook.

    Args:
      client: JAX's coordination service client (its key-value store).
      launch: where this process sits in the job.
      departure_s: `departure_timeout` in seconds (inf: no watchdog).
      shutdown_s: the longest this process waits at exit for the others' notes.
      heartbeat_s: JAX's heartbeat timeout, named in messages.
      fail_fast: whether funshard may end the process (excepthook, `os._exit`).
      rendezvous_s: bound of the hosts' exchange `fail_fast` makes (start-up timeout).
      links: the rendezvous connections, kept open (`_links`): the liveness thread
        watches them.
    """
    global _current
    if _current is not None or client is None:
        if links is not None:
            links.close()
        return
    board = comm.open_board(client, launch.process_id, launch.num_processes, departure_s)
    _current = Lifecycle(board, shutdown_s, heartbeat_s, fail_fast, links)
    # Registered after JAX's own exit handler, so it runs before JAX's shutdown barrier.
    atexit.register(_current.at_exit)
    if links is not None:
        _current.liveness = threading.Thread(
            target=_current.watch_links, name="funshard-liveness", daemon=True
        )
        _current.liveness.start()
    if math.isfinite(departure_s):
        _current.watchdog = threading.Thread(
            target=_current.watch, name="funshard-departure-watchdog", daemon=True
        )
        _current.watchdog.start()
    if fail_fast:
        hosts = _exchange_hosts(client, launch, rendezvous_s)
        sys.excepthook = _fail_fast_hook(sys.excepthook, launch, hosts, _current)


def _my_address(coordinator_address: str) -> str:
    """The IP this host uses to reach the coordinator (what peers see as its address)."""
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 1, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: picks the route, sends nothing
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _exchange_hosts(client: Any, launch: Launch, timeout_s: float) -> dict[int, str]:
    """Every process's IP, by rank, through JAX's coordination service ({} if unavailable).

    Only used to name the process behind a failed connection in error messages. Every
    process has connected by now, so the barrier is short.
    """
    try:
        me = _my_address(launch.coordinator_address or "")
        client.key_value_set(f"funshard/host/{launch.process_id}", me)
        client.wait_at_barrier("funshard/hosts", int(min(timeout_s, 60) * 1000))
        pairs = client.key_value_dir_get("funshard/host/")
        return {int(key.rsplit("/", 1)[1]): ip for key, ip in pairs}
    except Exception:
        return {}


# A peer's address in gloo's errors: "... Connection closed by peer [10.0.0.2]:7042".
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_LOST = re.compile(r"(?i)connection (closed|reset|refused)|broken pipe|by peer")


def _dead_peer(message: str, launch: Launch, hosts: dict[int, str]) -> str | None:
    """Who the failed connection in `message` led to, e.g. "process 1 (127.0.0.1:7042)"."""
    match = _PEER.search(message)
    if match is None:
        return None
    ip, port = match.groups()
    ranks = [r for r, h in sorted(hosts.items()) if h == ip and r != launch.process_id]
    where = f"{ip}:{port}"
    if len(ranks) == 1:
        return f"process {ranks[0]} ({where})"
    if ranks:
        return f"one of processes {', '.join(map(str, ranks))} ({where})"
    return f"the process at {where}"


def failure_summary(
    exc: BaseException,
    launch: Launch,
    hosts: dict[int, str],
    departed: Mapping[int, comm.Note] | None = None,
) -> str:
    """The one-paragraph explanation `fail_fast` prints after the traceback.

    Args:
      exc: the uncaught exception.
      launch: where this process sits in the job.
      hosts: every process's IP, by rank (`_exchange_hosts`).
      departed: the notes of the processes that said they left the job
        (`funshard.comm.departed()`): they name the process behind a lost connection.

    Returns:
      The summary.
    """
    me = f"funshard.distributed: process {launch.process_id} of {launch.num_processes}"
    text = str(exc)
    if _LOST.search(text):
        if departed:
            why = "; ".join(comm.departure_text(n) for _, n in sorted(departed.items()))
        else:
            who = _dead_peer(text, launch, hosts) or "another process"
            why = f"{who} is gone (it exited or crashed; its own log says why)"
        return (
            f"{me} stops: a collective failed because {why}. Exiting now with status 1 "
            "instead of waiting for it in JAX's shutdown barrier."
        )
    dead = [n for _, n in sorted((departed or {}).items()) if n.died]
    if dead:  # funshard's own error about it (shard_batch's), or one it caused
        return (
            f"{me} stops on an uncaught {type(exc).__name__}, after "
            f"{'; '.join(map(comm.departure_text, dead))}. Exiting now with status 1 "
            "instead of waiting for it in JAX's shutdown barrier."
        )
    return (
        f"{me} stops on an uncaught {type(exc).__name__}. Exiting now with status 1, "
        "without JAX's shutdown barrier, so that the other processes fail at their next "
        "collective instead of waiting for this one."
    )


def _fail_fast_hook(
    previous: ExceptHook, launch: Launch, hosts: dict[int, str], lifecycle: Lifecycle
) -> ExceptHook:
    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        previous(exc_type, exc, tb)
        try:
            lifecycle.leave(f"raised {exc_type.__name__}")
            print(failure_summary(exc, launch, hosts, comm.departed()), file=sys.stderr)
        finally:
            # The client's destructor would block in the shutdown barrier until the
            # dead process's heartbeat times out; nothing else is left to do here.
            lifecycle.exit(1)

    return hook
