"""The collectives this process issued, and what to say when the ranks' differ.

gloo pairs collectives by their order alone. When ranks issue different ones (a module
run on one rank only, an extra `no_grad` forward for a metric on rank 0, a unit skipped
on one rank, a parameter that got no gradient on one rank), the pairs are wrong: a
gather of the same size silently mixes two units' shards, one of another size or kind
waits forever. FSDP2 hangs or computes on (torch's check exists only under
`TORCH_DISTRIBUTED_DEBUG=DETAIL`, at a round trip per collective).

Here every collective is recorded as it is submitted (a few microseconds, no
communication), and the records fold into a rolling digest of the history of the
processes the collective runs over (its group: a data-parallel group of a 2-D mesh,
not the tensor-parallel peers', whose collectives differ by design):

- the first all-gather of each root forward carries that digest as one more float32
  per rank, so every rank sees every rank's digest with the gathered values: a history
  that differs anywhere (kind, unit, shapes, dtypes, phase, parameters reduced) is
  caught there, same shapes or not (in every all-gather it cost 8 to 18% of a step);
- at the end of each backward (the root's final callback) every rank posts its digest
  in torch's TCPStore (torchrun's rendezvous); the group's first rank reads them all
  and posts them back, and every rank reads that (no collective, so it cannot pair
  with one of another size): a forward whose ranks gathered different units of the
  same shapes fails on every rank in its own backward, before the optimizer applies
  its gradients, the script's last step too;
- a wait that stalls (a collective of another size or kind never completes) publishes
  this process's records through JAX's coordination service and reads the others'.

Either way the ranks then compare their records, find the first collective that
differs, and every rank raises the same `DistributedError` naming each rank's unit,
kind and step. Records are exchanged only once a digest differs or a wait stalls.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import os
import threading
import time
import zlib
from typing import Any

import torch

from funshard import comm

_LOGS = "funshard/torch_frontend/collectives/"
# The digests posted at the end of each backward, at `<group>/<check>/<rank>`, and the
# group's verdict beside them; each is deleted two checks later, once read.
_DIGESTS = "funshard/torch_frontend/digests/"
# How long one read of a digest or verdict waits before the wait is checked (a stall,
# a departure) and the read resumed.
_READ_MS = 500
_KEPT = 256  # records kept and published: enough to reach back to the first difference
# A wait this long publishes the records and reads the others' (at most, and at most
# half the departure timeout, so that a mismatch ends within that timeout).
_STALL_S = 5.0


@dataclasses.dataclass(frozen=True)
class Record:
    """One collective as this process submitted it."""

    seq: int
    step: int
    kind: str
    unit: str
    operands: str  # shapes and dtypes
    phase: str  # "forward", "no_grad forward" or "backward"
    missing: tuple[str, ...] = ()  # parameters with no gradient (a reduce-scatter's)
    group: tuple[int, ...] = ()  # the processes it runs over; `seq` counts within them

    def same(self, other: Record) -> bool:
        """Whether both ranks issued the same collective here."""
        return (self.kind, self.unit, self.operands, self.phase, self.missing) == (
            other.kind,
            other.unit,
            other.operands,
            other.phase,
            other.missing,
        )

    def describe(self) -> str:
        what = f"{'an' if self.kind[0] in 'aeiou' else 'a'} {self.kind} of {self.unit}"
        if self.phase == "no_grad forward":
            where = "a forward under torch.no_grad()"
        else:
            where = f"the {self.phase}"
        text = f"{what} ({self.operands}) in {where} of step {self.step + 1}"
        if self.missing:
            text += f", without {', '.join(repr(m) for m in self.missing)} (no gradient here)"
        return text


def phase() -> str:
    """What the calling thread is running: a backward pass, or a forward (and its mode)."""
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if torch.is_grad_enabled() else "no_grad forward"


def _parsed(row: list) -> Record:
    """A record as `Recorder._publish` wrote it (`dataclasses.astuple`, in JSON)."""
    seq, step, kind, unit, operands, phase, missing, group = row
    return Record(seq, step, kind, unit, operands, phase, tuple(missing), tuple(group))


class Recorder:
    """This process's collectives, oldest dropped after `_KEPT`.

    Histories are kept per group of processes a collective runs over: on a 2-D mesh a
    process's data-parallel group and its tensor-parallel peer's issue collectives of
    other shapes by design, and a process may gather over several groups (a 1-D model
    beside a 2-D one, hpZ's inner groups). Only the members of a group compare its
    history.
    """

    def __init__(self) -> None:
        self._records: collections.deque[Record] = collections.deque(maxlen=_KEPT)
        self._count = 0
        self._seqs: dict[tuple[int, ...], int] = {}
        self._digests: dict[tuple[int, ...], int] = {}
        self._checks: dict[tuple[int, ...], int] = {}  # backward-end checks (`agree`)
        self._store: Any = None  # where the checks post their digests (`_store`)
        self._published = -1
        # Records are added on the submitting thread and read on the collective thread.
        self._lock = threading.Lock()

    def record(
        self, kind: str, unit: str, operands: list[tuple], group: tuple[int, ...], missing=()
    ) -> int:
        """Records one collective over `group`; returns the group's rolling digest.

        The digest is a CRC-32 of every record of the group so far (`_bridge._gather_now`
        sends its low 23 bits as a float32).
        """
        board = comm.board()
        shapes = ", ".join(
            f"{tuple(s)}/{d}/{str(t).removeprefix('torch.')}" for s, d, t in operands
        )
        now = phase()
        key = f"{kind}|{unit}|{shapes}|{now}|{','.join(missing)}".encode()
        with self._lock:
            step = board.step if board else 0
            seq = self._seqs.get(group, 0)
            self._records.append(Record(seq, step, kind, unit, shapes, now, missing, group))
            self._seqs[group] = seq + 1
            self._count += 1
            digest = self._digests[group] = zlib.crc32(key, self._digests.get(group, 0))
            return digest

    def _snapshot(self) -> tuple[int, list[Record]]:
        with self._lock:
            return self._count, list(self._records)

    def _publish(self, client: Any, rank: int) -> None:
        seq, records = self._snapshot()
        if self._published == seq:
            return
        rows = [dataclasses.astuple(r) for r in records]
        client.key_value_set(f"{_LOGS}{rank}", json.dumps(rows), True)
        self._published = seq

    def _others(self, client: Any, rank: int) -> dict[int, list[Record]]:
        try:
            pairs = client.key_value_dir_get(_LOGS)
        except Exception:
            return {}
        out = {}
        for key, text in pairs:
            other = int(key.rsplit("/", 1)[1])
            if other != rank:
                out[other] = [_parsed(row) for row in json.loads(text)]
        return out

    def first_difference(self, theirs: dict[int, list[Record]]) -> tuple[Record, dict] | None:
        """(this process's record, {rank: theirs}) at the first collective that differs.

        Records are compared within the groups both processes ran collectives over.
        """
        mine = {(r.group, r.seq): r for r in self._snapshot()[1]}
        found: tuple[Record, dict] | None = None
        for other, records in sorted(theirs.items()):
            for r in records:
                own = mine.get((r.group, r.seq))
                if own is not None and not own.same(r):
                    if found is None or r.seq < found[0].seq:
                        found = (own, {other: r})
                    elif r.seq == found[0].seq:
                        found[1][other] = r
                    break
        return found

    def stalled(self, since: float, what: str) -> str | None:
        """The error for a wait that began at `since`, once the ranks' records differ.

        Called every half second of a wait (`_worker.Pending`); nothing happens before
        the wait has lasted `_STALL_S` (or half the departure timeout).
        """
        board = comm.board()
        if board is None or time.monotonic() - since < min(_STALL_S, board.timeout / 2):
            return None
        self._publish(board.client, board.rank)
        found = self.first_difference(self._others(board.client, board.rank))
        if found is None:
            return None
        return self._fail(board, found, f"{what} has waited {time.monotonic() - since:.0f} s")

    def agree(self) -> str | None:
        """At the end of a backward, the error once the ranks' digests differ.

        For each group this process ran collectives over (every member of a group checks
        it at each backward), compares the members' digests of the group (`_agree`). A
        member still in its backward, or stuck in a collective that does not pair, is
        waited for as a stalled collective is (`stalled`, then the departure notes).
        None where all agree.
        """
        board = comm.board()
        assert board is not None, "digests are compared only in a funshard job"
        with self._lock:
            due = []
            for group, digest in sorted(self._digests.items()):
                if len(group) > 1:
                    check = self._checks.get(group, 0)
                    self._checks[group] = check + 1
                    due.append((group, digest, check))
        for group, digest, check in due:
            error = self._agree(board, group, digest, check)
            if error is not None:
                return error
        return None

    def _agree(self, board, group: tuple[int, ...], digest: int, check: int) -> str | None:
        """`agree` for one group: every member posts its digest; the group's first member
        reads them all and posts them as the verdict, which the others read. So every
        member learns every digest (a member that agreed with a neighbour only would go
        on unaware), at one key written and one read per member, and the first member's
        reads, per check."""
        if self._store is None:
            self._store = _store()
        store = self._store
        # torchrun's store outlives a restarted attempt: its keys are the attempt's own.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = f"{_DIGESTS}{attempt}/{zlib.crc32(repr(group).encode()):08x}/"
        what = "the check at the end of a backward"
        if board.rank != group[0]:
            store.set(f"{name}{check}/{board.rank}", str(digest))
            verdict, error = self._read(store, f"{name}{check}/verdict", what)
            if error is not None:
                return error
            digests = [int(d) for d in verdict.split(",")]
            if check >= 2:  # the first member read it two checks ago
                store.delete_key(f"{name}{check - 2}/{board.rank}")
        else:
            digests = [digest]
            for member in group[1:]:
                value, error = self._read(store, f"{name}{check}/{member}", what)
                if error is not None:
                    return error
                digests.append(int(value))
            store.set(f"{name}{check}/verdict", ",".join(map(str, digests)))
            if check >= 2:  # every member posted after reading it
                store.delete_key(f"{name}{check - 2}/verdict")
        if len(set(digests)) == 1:
            return None
        ranks = ", ".join(map(str, group))
        return self.mismatch(digests, f"{what} (ranks {ranks})")

    def _read(self, store: Any, key: str, what: str) -> tuple[str, str | None]:
        """(`key`'s value once posted, None), or ("", the error) where the wait stalls
        on ranks that differ or on a process that left."""
        since = time.monotonic()
        while True:
            try:
                if not isinstance(store, _OwnStore):  # torch's: its timeout stays its own
                    store.wait([key], datetime.timedelta(milliseconds=_READ_MS))
                return store.get(key).decode(), None
            except RuntimeError:  # torch's DistStoreError: not posted within _READ_MS
                error = self.stalled(since, what) or comm.stuck_error(since, what)
                if error is not None:
                    return "", error

    def mismatch(self, digests: list[int], where: str = "an all-gather") -> str:
        """The error once the `digests` (one per rank) gathered by `where` differ.

        Every rank sees the same digests and comes here: each publishes its records and
        waits (up to the departure timeout) for the others'.
        """
        board = comm.board()
        assert board is not None, "digests ride only in a funshard job"
        self._publish(board.client, board.rank)
        deadline = time.monotonic() + board.timeout
        found = None
        while found is None and time.monotonic() < deadline:
            others = self._others(board.client, board.rank)
            found = self.first_difference(others)
            if found is None:
                time.sleep(comm.POLL_S)
        why = f"{where} found the ranks' histories differ (digests {digests})"
        if found is None:
            return (
                f"torch_frontend: rank {board.rank}: {why}, but the other ranks' records "
                f"did not arrive within {board.timeout:.0f} s. {_HINT}"
            )
        return self._fail(board, found, why)

    def _fail(self, board, found: tuple[Record, dict], why: str) -> str:
        comm.announce_failure()
        comm.await_failures(range(board.count))
        own, theirs = found
        lines = [f"rank {board.rank}: {own.describe()}"]
        lines += [f"rank {r}: {rec.describe()}" for r, rec in sorted(theirs.items())]
        return (
            f"torch_frontend: the ranks issued different collectives ({why}). gloo pairs "
            f"collectives by their order alone, so these would have been paired: the "
            f"first that differs is collective {own.seq + 1} of this process over processes "
            f"{', '.join(map(str, own.group))}:\n  "
            + "\n  ".join(lines)
            + f"\n{_hint(own, list(theirs.values()))}"
        )


_HINT = (
    "Every rank must issue the same collectives in the same order: run each FSDP module "
    "on every rank (no module, forward or backward on some ranks only)."
)


def _hint(own: Record, theirs: list[Record]) -> str:
    records = [own, *theirs]
    missing = sorted({m for r in records for m in r.missing})
    if missing:
        return (
            f"Parameter(s) {', '.join(repr(m) for m in missing)} got no gradient on some "
            "ranks (a mixture of experts whose ranks route to different experts, a branch "
            "taken on some ranks): call set_reduce_scatter_unused_params(True) on the "
            "module (FSDP2's setting), so that every rank reduces zeros for them. " + _HINT
        )
    phases = {r.phase for r in records}
    if "no_grad forward" in phases and len(phases) > 1:
        return (
            "One rank ran a forward under torch.no_grad() (a metric or an evaluation on "
            "one rank only?) where another trained: run it on every rank. " + _HINT
        )
    return _HINT


def _store() -> Any:
    """A client of torch's TCPStore, the one `init_process_group`'s env:// rendezvous
    serves (torchrun's agent, or rank 0): a request costs a few microseconds of CPU, where
    one to JAX's coordination service (gRPC) cost about 0.2 ms, several per step. Where
    the script started torch's group another way (no MASTER_ADDR), its default store."""
    import torch.distributed as dist

    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
            wait_for_workers=False,
        )
        store.set_timeout(datetime.timedelta(milliseconds=_READ_MS))  # a `get`'s wait
        return _OwnStore(store)
    return dist.distributed_c10d._get_default_store()


class _OwnStore:
    """This process's own client of the store, whose `get` waits `_READ_MS` at most."""

    def __init__(self, store: Any) -> None:
        self.get, self.set, self.delete_key = store.get, store.set, store.delete_key
