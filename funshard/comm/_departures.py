"""Which processes left the job: their notes in JAX's coordination service, read.

A process of a funshard job posts a note in the coordination service's key-value store
when it leaves (`funshard/left/<rank>`: how many steps it counted and how it ended);
process 0 posts one for a process that died without a word (`Board.post_death`).
This module is the reading side every layer needs: the cross-process agreement checks
(`_agreement`, `_state_agreement`), `shard_batch`'s wait, the torch frontend's
collective futures, and the departure watchdog of `funshard.distributed`, which opens
the board (`open_board`) when it starts a job and writes the notes.

Nothing here runs per step beyond `count_step` (an integer increment) and the
`collective_running` counter: no collective, no host synchronisation. Steps are what
the caller counts: `shard_batch` calls in JAX programs, backward passes in the torch
frontend. See docs/distributed.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

# How long a process that others left may stay stuck before it gives up, in seconds
# (`departure_timeout`'s default; `funshard.distributed` parses the setting).
DEPARTURE_TIMEOUT = 30.0
NOTES = "funshard/left/"
FAILING = "funshard/failing/"  # processes about to raise an error every process raises
# How long process 0 keeps the coordination service up for the processes leaving with it.
SERVICE_GRACE_S = 5.0
POLL_S = 0.05


class KeyValueStore(Protocol):
    """The part of JAX's coordination service client the notes use."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = ...) -> None: ...

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...


@dataclasses.dataclass(frozen=True)
class Note:
    """What a process that left the job said about it.

    Attributes:
      rank: the process that left.
      step: how many steps it had counted (`count_step`).
      kind: what a step is ("shard_batch call", "backward pass", or "step").
      how: how it ended ("returned normally", "raised KeyError", ...).
      barrier: whether it waits in JAX's shutdown barrier (False: it is gone at once).
      died: posted by process 0 for a process that ended without running its exit
        (`Board.post_death`); its step is then unknown.
    """

    rank: int
    step: int
    kind: str
    how: str
    barrier: bool
    died: bool = False

    def text(self) -> str:
        """The note as posted: JSON of its fields."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def parse(cls, text: str) -> Note | None:
        """The note posted as `text`, or None if it is not one."""
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError):
            return None


def _steps(count: int, kind: str) -> str:
    """ "3 steps (shard_batch calls)": a step count and what funshard counted as a step."""
    return f"{count} step{'' if count == 1 else 's'} ({kind}{'es' if kind.endswith('s') else 's'})"


def departure_text(note: Note) -> str:
    """ "process 1 returned normally and left the job after 2 steps (shard_batch calls)"."""
    if note.died:
        return (
            f"process {note.rank} died (it ended without running its exit: killed by a "
            "signal such as SIGKILL or the out-of-memory killer, or crashed; its own log or "
            "its launcher says which)"
        )
    text = f"process {note.rank} {note.how} and left the job"
    return text if note.kind == "step" else f"{text} after {_steps(note.step, note.kind)}"


def last_common_step(step: int, kind: str, notes: Iterable[Note]) -> str:
    """ "The last step both reached is step 2.", or why it cannot be named."""
    notes = list(notes)
    dead = [n.rank for n in notes if n.died]
    if dead:
        return (
            f"funshard cannot tell which steps process {', '.join(map(str, dead))} "
            "finished before it died."
        )
    counted = [n.step for n in notes if n.kind != "step"] + ([step] if kind != "step" else [])
    if not counted:
        return (
            "funshard names steps by counting calls of fs.distributed.shard_batch (or a "
            "torch_frontend model's backward passes); this job made none, so it cannot "
            "name the last step both reached (call fs.distributed.count_step() once per "
            "step to have it named)."
        )
    return f"The last step both reached is step {min(counted)}."


def same_steps_hint(timeout: float | None, verb: str = "Gave up") -> str:
    """What every process must do, and (with `timeout`) after how long this one acted."""
    text = (
        "Every process must run the same steps, with the same collectives in the same "
        "order; one that stops early (fewer steps, or an exception it caught before "
        "returning) leaves the others waiting."
    )
    if timeout is not None:
        text += (
            f" {verb} after departure_timeout={timeout:g} s (an argument of "
            "funshard.distributed.initialize, or FUNSHARD_DEPARTURE_TIMEOUT)."
        )
    return text


def _at_step(step: int, kind: str) -> str:
    return "" if kind == "step" else f", at step {step},"


def _batch_peer_left(rank: int, count: int, notes: list[Note], step: int, kind: str) -> str:
    return (
        f"shard_batch: process {rank} of {count}, at step {step}: "
        f"{'; '.join(departure_text(n) for n in notes)}, so this step's batch (and its "
        f"collectives) will never be complete. {last_common_step(step, kind, notes)} "
        f"{same_steps_hint(None)}"
    )


class Board:
    """This process's view of the notes, and its own step count.

    Attributes:
      client: JAX's coordination service client (its key-value store).
      rank: this process's rank.
      count: processes in the job.
      timeout: `departure_timeout` in seconds.
      step: steps this process has counted (`count_step`).
      kind: what a step is, in messages.
      leaving: this process posted its own note: nothing left to watch.
      python_waits: waits in progress that raise by themselves (`python_wait`).
      seen: rank -> when this process first saw that process's note.
      notes: the other processes' notes, by rank.
      reachable: False once the coordination service failed to answer.
    """

    def __init__(self, client: Any, rank: int, count: int, timeout: float) -> None:
        self.client, self.rank, self.count, self.timeout = client, rank, count, timeout
        self.step, self.kind = 0, "step"
        self.leaving = False
        self.python_waits = 0
        self.seen: dict[int, float] = {}
        self.notes: dict[int, Note] = {}
        self.reachable = True

    def post(self, how: str, barrier: bool) -> None:
        """Posts (or replaces) this process's note: it leaves, `how`."""
        self.leaving = True
        note = Note(self.rank, self.step, self.kind, how, barrier)
        with contextlib.suppress(Exception):  # the service may be gone already
            self.client.key_value_set(f"{NOTES}{self.rank}", note.text(), True)

    def post_death(self, rank: int) -> bool:
        """Process 0: posts that `rank` died, unless it posted a note of its own first.

        Returns:
          Whether the note was posted (False: `rank` had left with its own note, or the
          service is gone).
        """
        note = Note(rank, 0, "step", "died", barrier=False, died=True)
        try:  # never overwrites: the process's own note says more
            self.client.key_value_set(f"{NOTES}{rank}", note.text(), False)
        except Exception:
            return False
        return True

    def refresh(self) -> dict[int, Note]:
        """The other processes' notes, read again from the service (kept if it is gone)."""
        try:
            pairs = self.client.key_value_dir_get(NOTES)
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

    def situation(self, waited_s: float, what: str) -> str:
        """Who left after which step, and that `what` of this process waits for them."""
        notes = sorted(self.notes.values(), key=lambda n: n.rank)
        who = ", ".join(str(n.rank) for n in notes)
        return (
            f"{'; '.join(departure_text(n) for n in notes)}, and {what} of this "
            f"process{_at_step(self.step, self.kind)} has made no progress for "
            f"{waited_s:.0f} s since: it is waiting in a collective that "
            f"process{'es' if len(notes) > 1 else ''} {who} will never join. "
            f"{last_common_step(self.step, self.kind, notes)}"
        )

    def message(self, waited_s: float, what: str) -> str:
        """The error of a wait (or process) that gives up on the processes that left."""
        return (
            f"funshard.distributed: process {self.rank} of {self.count} gives up: "
            f"{self.situation(waited_s, what)} {same_steps_hint(self.timeout)}"
        )

    def failing(self) -> set[int]:
        """The other processes that announced an error of their own (`announce_failure`)."""
        try:
            pairs = self.client.key_value_dir_get(FAILING)
        except Exception:
            return set()
        return {int(key.rsplit("/", 1)[1]) for key, _ in pairs} - {self.rank}


_board: Board | None = None
_running = 0  # collectives running now on funshard's worker threads, over the process
_running_lock = threading.Lock()


def open_board(client: Any, rank: int, count: int, timeout: float) -> Board:
    """This process's board, opened on the first call (later calls return it).

    Args:
      client: JAX's coordination service client.
      rank: this process's rank.
      count: processes in the job.
      timeout: `departure_timeout` in seconds.

    Returns:
      The board every reader of this module consults from now on.
    """
    global _board
    if _board is None:
        _board = Board(client, rank, count, timeout)
    return _board


def board() -> Board | None:
    """This process's board; None where no funshard job was started."""
    return _board


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
    if _board is not None:
        _board.step += 1
        _board.kind = kind


def announce_failure() -> None:
    """Says that this process is about to raise an error that every process raises.

    Process 0, leaving on its own copy of that error, then keeps the coordination
    service up (at most a few seconds) until this process has left too, so that each
    process ends on its own message rather than on JAX's "the distributed service
    detected fatal errors".
    """
    if _board is not None:
        with contextlib.suppress(Exception):  # the service may be gone already
            _board.client.key_value_set(f"{FAILING}{_board.rank}", "1", True)


def await_failures(ranks: Iterable[int]) -> None:
    """On process 0: waits (a few seconds at most) until `ranks` announced their failure.

    Process 0 hosts the coordination service: leaving before the others have said they
    are failing too would end them with JAX's message instead of their own.
    """
    current = _board
    if current is None or current.rank != 0:
        return
    deadline = time.monotonic() + SERVICE_GRACE_S
    while not set(ranks) - {0} <= current.failing() and time.monotonic() < deadline:
        time.sleep(POLL_S)


def departed() -> dict[int, Note]:
    """The notes of the processes that have left, by rank (read again from the service)."""
    return {} if _board is None else _board.refresh()


def left_before_this_step() -> str | None:
    """The error for this process's current step if a process left before reaching it.

    A process that left after fewer steps than this one has counted will never join
    this step (steps counted alike on every process: `shard_batch` calls).

    Returns:
      The message, or None when no process left that early.
    """
    current = _board
    if current is None:
        return None
    early = [n for _, n in sorted(current.refresh().items()) if n.died or n.step < current.step]
    if not early:
        return None
    return _batch_peer_left(current.rank, current.count, early, current.step, current.kind)


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
    current = _board
    if current is None or not current.refresh():
        return None
    waited = current.stuck_for(since)
    return current.message(waited, what) if waited >= current.timeout else None


def wait_limit() -> float:
    """This job's `departure_timeout` (its default where no funshard job was started)."""
    return DEPARTURE_TIMEOUT if _board is None else _board.timeout


@contextlib.contextmanager
def python_wait() -> Iterator[None]:
    """Marks a wait that checks `stuck_error` itself: the watchdog leaves it alone."""
    current = _board
    if current is None:
        yield
        return
    current.python_waits += 1
    try:
        yield
    finally:
        current.python_waits -= 1


@contextlib.contextmanager
def collective_running() -> Iterator[None]:
    """Marks a collective running on a worker thread (the torch frontend's).

    At exit, one still running is stuck on a process that left: the exit protocol then
    skips JAX's shutdown barrier (`running_collectives`).
    """
    global _running
    with _running_lock:
        _running += 1
    try:
        yield
    finally:
        with _running_lock:
            _running -= 1


def running_collectives() -> int:
    """How many collectives `collective_running` marks as running now."""
    return _running
