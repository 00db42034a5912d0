"""A process that leaves a job early must never leave the others waiting.

JAX's runtime does not notice a process that returns from its script early: at exit it
waits in JAX's shutdown barrier (`shutdown_timeout`, 300 s) with its gloo connections
open, while the others block in a collective it will never join, silently. So in a
funshard job (started by `funshard.distributed.initialize`) every process:

- posts a note in the coordination service's key-value store when it leaves
  (`funshard/left/<rank>`: how many steps it counted and how it ended), at exit or
  just before `fail_fast` or the watchdog ends it;
- at exit, waits for every other process's note before JAX's shutdown barrier (so the
  others see it has left, and process 0 keeps the service up for them), and skips that
  barrier, which could only hang, when some process left without it;
- runs a watchdog thread that reads the notes every second or so. When a process has
  left and this one has made no progress since (its main thread at the same place, the
  process using almost no CPU) for `departure_timeout` seconds, it prints who left after
  which step and exits with status 1. Waits that funshard itself runs in Python (the
  torch frontend's collectives, `OrderedWorker`) raise a RuntimeError instead.

Nothing here runs per step beyond `count_step` (an integer increment): no collective, no
host synchronisation. Steps are what the caller counts: `shard_batch` calls in JAX
programs, backward passes in the torch frontend. See docs/distributed.md.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from funshard import _jax_compat, _py_compat, errors
from funshard.distributed._rendezvous import not_seconds

# How long a process that others left may stay stuck before it gives up, in seconds.
DEPARTURE_TIMEOUT = 30.0
DEPARTURE_TIMEOUT_ENV = "FUNSHARD_DEPARTURE_TIMEOUT"
_NOTES = "funshard/left/"
_FAILING = "funshard/failing/"  # processes about to raise an error every process raises
# Below this share of one core a process is idle: a blocked collective uses ~0.3 %
# (heartbeats, this watchdog), any computation far more.
_IDLE_CPU_SHARE = 0.05
_EXIT_POLL_S = 0.05
# How long process 0 keeps the coordination service up for the processes leaving with it.
_SERVICE_GRACE_S = 5.0
_EXIT_LAG_S = 1.0  # process 0's wait, once the others' notes are in, for them to exit
# The longest exit waits for the watchdog thread: one call on a live service (ms); a
# dead service is left to JAX, which ends the process itself.
_WATCHDOG_JOIN_S = 2.0
_WAIT_SLICE_S = 0.5


def departure_timeout(value, environ: Mapping[str, str]) -> float:
    """Seconds a stuck process waits for one that left: `value`, else the environment.

    Args:
      value: the `departure_timeout` argument (None: not given).
      environ: the environment, read for FUNSHARD_DEPARTURE_TIMEOUT.

    Returns:
      The timeout in seconds (`math.inf`: never give up).

    Raises:
      ValueError: the value is not a positive number of seconds (inf allowed).
    """
    source = "departure_timeout"
    if value is None and DEPARTURE_TIMEOUT_ENV in environ:
        source, value = DEPARTURE_TIMEOUT_ENV, environ[DEPARTURE_TIMEOUT_ENV]
    if value is None:
        return DEPARTURE_TIMEOUT
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not seconds > 0:
        raise errors.ShardingValueError(
            not_seconds(
                source,
                value,
                "departure_timeout=30 (or FUNSHARD_DEPARTURE_TIMEOUT=30), or inf to wait forever",
            )
        )
    return seconds


@dataclasses.dataclass(frozen=True)
class Note:
    """What a process that left the job said about it.

    Attributes:
      rank: the process that left.
      step: how many steps it had counted (`count_step`).
      kind: what a step is ("shard_batch call", "backward pass", or "step").
      how: how it ended ("returned normally", "raised KeyError", ...).
      barrier: whether it waits in JAX's shutdown barrier (False: it is gone at once).
    """

    rank: int
    step: int
    kind: str
    how: str
    barrier: bool

    def text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> Note | None:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError):
            return None


def _steps(count: int, kind: str) -> str:
    """ "3 steps (shard_batch calls)": a step count and what funshard counted as a step."""
    return f"{count} step{'' if count == 1 else 's'} ({kind}{'es' if kind.endswith('s') else 's'})"


def departure_text(note) -> str:
    """ "process 1 returned normally and left the job after 2 steps (shard_batch calls)"."""
    text = f"process {note.rank} {note.how} and left the job"
    return text if note.kind == "step" else f"{text} after {_steps(note.step, note.kind)}"


def _last_common_step(step: int, kind: str, notes) -> str:
    counted = [n.step for n in notes if n.kind != "step"] + ([step] if kind != "step" else [])
    if not counted:
        return (
            "funshard names steps by counting calls of fs.distributed.shard_batch (or a "
            "torch_frontend model's backward passes); this job made none, so it cannot "
            "name the last step both reached (call fs.distributed.count_step() once per "
            "step to have it named)."
        )
    return f"The last step both reached is step {min(counted)}."


def _same_steps_hint(timeout: float | None) -> str:
    text = (
        "Every process must run the same steps, with the same collectives in the same "
        "order; one that stops early (fewer steps, or an exception it caught before "
        "returning) leaves the others waiting."
    )
    if timeout is not None:
        text += (
            f" Gave up after departure_timeout={timeout:g} s (an argument of "
            "funshard.distributed.initialize, or FUNSHARD_DEPARTURE_TIMEOUT)."
        )
    return text


def _at_step(step: int, kind: str) -> str:
    return "" if kind == "step" else f", at step {step},"


def _peer_left(
    rank: int, count: int, notes, step: int, kind: str, waited_s: float, what: str, timeout: float
) -> str:
    who = ", ".join(str(n.rank) for n in notes)
    return (
        f"funshard.distributed: process {rank} of {count} gives up: "
        f"{'; '.join(departure_text(n) for n in notes)}, and {what} of this "
        f"process{_at_step(step, kind)} has made no progress for {waited_s:.0f} s since: "
        f"it is waiting in a collective that process{'es' if len(notes) > 1 else ''} "
        f"{who} will never join. {_last_common_step(step, kind, notes)} "
        f"{_same_steps_hint(timeout)}"
    )


class _Monitor:
    """This process's side of the protocol (see the module docstring)."""

    def __init__(self, client, rank: int, count: int, timeout: float, shutdown_s: float):
        self.client, self.rank, self.count = client, rank, count
        self.timeout, self.shutdown_s = timeout, shutdown_s
        self.step, self.kind = 0, "step"
        self.leaving = False  # this process posted its own note: nothing left to watch
        self.python_waits = 0  # waits in progress that raise by themselves
        self.seen: dict[int, float] = {}  # rank -> when this process first saw its note
        self.notes: dict[int, Note] = {}
        self.reachable = True  # False once the coordination service failed to answer
        self.stop = threading.Event()  # set at exit: the watchdog returns at once
        self.watchdog: threading.Thread | None = None

    def post(self, how: str, barrier: bool) -> None:
        self.leaving = True
        note = Note(self.rank, self.step, self.kind, how, barrier)
        with contextlib.suppress(Exception):  # the service may be gone already
            self.client.key_value_set(f"{_NOTES}{self.rank}", note.text(), True)

    def refresh(self) -> dict[int, Note]:
        """The other processes' notes, read again from the service (kept if it is gone)."""
        try:
            pairs = self.client.key_value_dir_get(_NOTES)
        except Exception:
            self.reachable = False
            return dict(self.notes)
        now = time.monotonic()
        for _, text in pairs:
            note = Note.parse(text)
            if note is not None and note.rank != self.rank:
                self.notes[note.rank] = note
                self.seen.setdefault(note.rank, now)
        return dict(self.notes)

    def stuck_for(self, since: float) -> float:
        """Seconds this process has waited for a process that left, counted from `since`."""
        if not self.seen:
            return 0.0
        return time.monotonic() - max(since, min(self.seen.values()))

    def message(self, waited_s: float, what: str) -> str:
        notes = sorted(self.notes.values(), key=lambda n: n.rank)
        return _peer_left(
            self.rank, self.count, notes, self.step, self.kind, waited_s, what, self.timeout
        )

    def watch(self) -> None:
        """The watchdog thread: gives up when this process is stuck on one that left."""
        poll = min(1.0, self.timeout / 5)
        place, cpu, quiet_since = _main_place(), time.process_time(), time.monotonic()
        while not self.leaving:
            if self.stop.wait(poll):
                return
            if _jax_compat.coordination_client() is not self.client:
                return  # the script shut jax.distributed down itself
            now_place, now_cpu = _main_place(), time.process_time()
            if now_place != place or now_cpu - cpu > _IDLE_CPU_SHARE * poll:
                quiet_since = time.monotonic()
            place, cpu = now_place, now_cpu
            if not self.refresh() or self.python_waits or self.leaving:
                continue
            waited = self.stuck_for(quiet_since)
            if waited >= self.timeout:
                self.give_up(waited)

    def give_up(self, waited_s: float) -> None:
        print(self.message(waited_s, "the main thread"), file=sys.stderr, flush=True)
        left = ", ".join(str(r) for r in sorted(self.notes))
        self.leave(f"gave up waiting for process {left}")
        _exit_now(1)

    def leave(self, how: str) -> None:
        """Notes that this process ends now, without JAX's shutdown barrier.

        Process 0 runs the coordination service, whose end terminates every process
        still connected ("the JAX distributed service detected fatal errors"): it first
        lets those already leaving (waiting at exit) see its note and go.
        """
        self.post(how, barrier=False)
        deadline = time.monotonic() + (_SERVICE_GRACE_S if self.rank == 0 else 0)
        while time.monotonic() < deadline:
            notes = self.refresh()
            if all(not n.barrier for n in notes.values()) and self.failing() <= set(notes):
                if notes:
                    # A process posts its note just before it exits: between the two,
                    # the service's end would still abort it (seen once in ~10 CI runs
                    # of a loaded machine). The service cannot tell when it has gone
                    # (a dead task stays live until its heartbeat times out, ~100 s).
                    time.sleep(_EXIT_LAG_S)
                return
            time.sleep(_EXIT_POLL_S)

    def failing(self) -> set[int]:
        """The other processes that announced an error of their own (`announce_failure`)."""
        try:
            pairs = self.client.key_value_dir_get(_FAILING)
        except Exception:
            return set()
        return {int(key.rsplit("/", 1)[1]) for key, _ in pairs} - {self.rank}

    def at_exit(self) -> None:
        """Posts this process's note; waits for every other one before JAX's barrier."""
        self.stop_watchdog()
        if _jax_compat.coordination_client() is not self.client:
            return  # the script shut jax.distributed down itself
        failed = getattr(sys, "last_value", None)  # set for an uncaught exception
        how = "returned normally" if failed is None else f"raised {type(failed).__name__}"
        # A collective still running here is stuck on a process that left; the
        # interpreter's teardown would crash under it, so this process skips the barrier,
        # and says so in its first note (another may read it at once).
        stuck = OrderedWorker.running > 0
        self.post(how, barrier=not stuck)
        deadline = time.monotonic() + self.shutdown_s
        while (
            len(self.refresh()) < self.count - 1 and self.reachable and time.monotonic() < deadline
        ):
            time.sleep(_EXIT_POLL_S)
        gone = len(self.notes) < self.count - 1 or not all(n.barrier for n in self.notes.values())
        if stuck or gone:
            # JAX's shutdown barrier would wait for a process that will never arrive.
            self.leave(how)
            _exit_now(0 if failed is None else 1)

    def stop_watchdog(self) -> None:
        """Ends the watchdog thread before JAX's shutdown, waiting for it a bounded time.

        A daemon thread still inside a call on the coordination client when JAX shuts the
        client down, or when the interpreter finalizes, aborts the whole process at exit
        ("terminate called ... FATAL: exception not rethrown") after the script's work
        is done: seen under load in 4-process jobs.
        """
        self.stop.set()
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            self.watchdog.join(_WATCHDOG_JOIN_S)


_monitor: _Monitor | None = None


def _main_place() -> tuple | None:
    """Where the main thread is: (frame identity, instruction, code); None if nowhere."""
    return _py_compat.thread_position(threading.main_thread().ident)


def _exit_now(code: int) -> None:
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def start(client, rank: int, count: int, timeout: float, shutdown_timeout: float) -> None:
    """Starts this process's side: the exit protocol, and the watchdog unless `timeout` is inf.

    Args:
      client: JAX's coordination service client (its key-value store).
      rank: this process's rank.
      count: processes in the job.
      timeout: `departure_timeout` in seconds.
      shutdown_timeout: the longest this process waits at exit for the others' notes.
    """
    global _monitor
    if _monitor is not None or client is None:
        return
    _monitor = _Monitor(client, rank, count, timeout, shutdown_timeout)
    # Registered after JAX's own exit handler, so it runs before JAX's shutdown barrier.
    atexit.register(_monitor.at_exit)
    if math.isfinite(timeout):
        _monitor.watchdog = threading.Thread(
            target=_monitor.watch, name="funshard-departure-watchdog", daemon=True
        )
        _monitor.watchdog.start()


def count_step(kind: str = "count_step call") -> None:
    """Counts one step of this process, so that messages about a process that left name it.

    `fs.distributed.shard_batch` and torch_frontend's backward passes count steps by
    themselves. A jitted loop that builds its batches another way has no per-step hook
    funshard could count without a cost; calling this once per step (a Python counter:
    no collective, no host sync) makes the departure messages say "the last step both
    reached is step N" there too.

    Args:
      kind: what a step is, in the messages ("after 4 steps (count_step calls)").
    """
    if _monitor is not None:
        _monitor.step += 1
        _monitor.kind = kind


def announce_failure() -> None:
    """Says that this process is about to raise an error that every process raises.

    Process 0, leaving on its own copy of that error, then keeps the coordination
    service up (at most a few seconds) until this process has left too, so that each
    process ends on its own message rather than on JAX's "the distributed service
    detected fatal errors".
    """
    if _monitor is not None:
        with contextlib.suppress(Exception):  # the service may be gone already
            _monitor.client.key_value_set(f"{_FAILING}{_monitor.rank}", "1", True)


def await_failures(ranks) -> None:
    """On process 0: waits (a few seconds at most) until `ranks` announced their failure.

    Process 0 hosts the coordination service: leaving before the others have said they
    are failing too would end them with JAX's message instead of their own.
    """
    monitor = _monitor
    if monitor is None or monitor.rank != 0:
        return
    deadline = time.monotonic() + _SERVICE_GRACE_S
    while not set(ranks) - {0} <= monitor.failing() and time.monotonic() < deadline:
        time.sleep(_EXIT_POLL_S)


def post_leaving(how: str) -> None:
    """Notes that this process is about to end without JAX's shutdown barrier."""
    if _monitor is not None:
        _monitor.leave(how)


def departed() -> dict[int, Note]:
    """The notes of the processes that have left, by rank (read again from the service)."""
    return {} if _monitor is None else _monitor.refresh()


def _batch_peer_left(rank: int, count: int, notes, step: int, kind: str) -> str:
    return (
        f"shard_batch: process {rank} of {count}, at step {step}: "
        f"{'; '.join(departure_text(n) for n in notes)}, so this step's batch (and its "
        f"collectives) will never be complete. {_last_common_step(step, kind, notes)} "
        f"{_same_steps_hint(None)}"
    )


def left_before_this_step() -> str | None:
    """The error for this process's current step if a process left before reaching it.

    A process that left after fewer steps than this one has counted will never join
    this step (steps counted alike on every process: `shard_batch` calls).

    Returns:
      The message, or None when no process left that early.
    """
    monitor = _monitor
    if monitor is None:
        return None
    early = [n for _, n in sorted(monitor.refresh().items()) if n.step < monitor.step]
    if not early:
        return None
    return _batch_peer_left(monitor.rank, monitor.count, early, monitor.step, monitor.kind)


def stuck_error(since: float, what: str) -> str | None:
    """The error for a wait that began at `since` (time.monotonic) if it must give up.

    A wait gives up once a process has left and the wait has lasted `departure_timeout`
    since both it began and this process first saw the note.

    Args:
      since: when the wait began.
      what: what waits, in the message ("an all-gather", "a collective").

    Returns:
      The message, or None to go on waiting.
    """
    monitor = _monitor
    if monitor is None or not monitor.refresh():
        return None
    waited = monitor.stuck_for(since)
    return monitor.message(waited, what) if waited >= monitor.timeout else None


def wait_limit() -> float:
    """This job's `departure_timeout` (from the environment where no job was started)."""
    if _monitor is not None:
        return _monitor.timeout
    return departure_timeout(None, os.environ)


@contextlib.contextmanager
def python_wait():
    """Marks a wait that checks `stuck_error` itself: the watchdog leaves it alone."""
    monitor = _monitor
    if monitor is None:
        yield
        return
    monitor.python_waits += 1
    try:
        yield
    finally:
        monitor.python_waits -= 1


class Pending(Future):
    """A future whose `result()` gives up (RuntimeError) on a process that left the job.

    Waits without a timeout go in slices of half a second; after each, `stuck_error`
    decides. Outside a funshard job it behaves as a plain `concurrent.futures.Future`.
    """

    what = "a collective"

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None or self.done() or _monitor is None:
            return super().result(timeout)
        since = time.monotonic()
        with python_wait():
            while True:
                try:
                    return super().result(_WAIT_SLICE_S)
                except TimeoutError:
                    if self.done():  # the function itself raised a TimeoutError
                        raise
                    error = stuck_error(since, self.what)
                    if error is not None:
                        raise errors.DistributedError(error) from None


class OrderedWorker:
    """Runs submitted functions one at a time, in order, on one daemon thread.

    Like a one-thread `ThreadPoolExecutor`, but its futures are `Pending` and its thread
    is a daemon: a collective stuck on a process that left never holds up the
    interpreter's exit (the executor's thread would be joined before atexit runs).
    """

    running = 0  # jobs running now, over every worker of the process
    _count_lock = threading.Lock()

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args, **kwargs) -> Pending:
        """Queues `fn(*args, **kwargs)` behind everything submitted before; its future."""
        future = Pending()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            with OrderedWorker._count_lock:
                OrderedWorker.running += 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # handed to whoever waits for the future
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                with OrderedWorker._count_lock:
                    OrderedWorker.running -= 1
            del future, fn, args, kwargs
