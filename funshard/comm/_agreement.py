"""Collectives issued outside a compiled step: every process must issue the same one.

Inside a jitted step the collectives are part of one program that every process runs
whole. Outside it (an eager `fs.unshard` to export the parameters, say) each call is
its own collective, issued from Python, and nothing stops one process from issuing one
the others never will (`if jax.process_index() == 0: fs.unshard(state)`). gloo then
pairs it with whatever collective the others run next: measured, an extra eager
`fs.unshard` on one process matched the next training step's all-gather of the same
size and both processes waited for each other without a word for more than 150 s.

So before such a collective each process posts what it is about to issue in the
coordination service and reads the others' posts: one that posted something else is
an error on every process at once; one that posts nothing within `departure_timeout`
is an error on the waiting process (which then leaves the job, so that the others,
stuck inside XLA, are ended by the departure watchdog with a message naming it). This
costs a key-value round trip per eager collective of a multi-process job, never a
step's: compiled steps and the torch frontend's collectives do not come here.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import math
import time
from collections.abc import Collection, Sequence

import jax

from funshard import _jax_compat, errors
from funshard.comm import _departures, _key_value

_ROOT = "funshard/eager/"
_calls: dict[tuple[int, ...], itertools.count] = {}


def same_collective(
    fn: str,
    leaves: Sequence[tuple],
    processes: Collection[int],
    noun: tuple[str, str] = ("leaf", "leaves"),
) -> None:
    """Returns once every process of `processes` issues the same eager all-gather.

    Args:
      fn: the public function issuing it, for messages ("unshard").
      leaves: `(shape, sharded dim, dtype)` of each gathered leaf, in order; every
        process must pass the same.
      processes: the processes taking part (those with devices in the mesh).
      noun: what a leaf is called in messages, singular and plural.

    Raises:
      DistributedError: another process issues a different collective, or left the job.
      DistributedTimeoutError: another process has not issued it within
        `departure_timeout` seconds.
    """
    client = _jax_compat.coordination_client()
    group = tuple(sorted(processes))
    if client is None or len(group) < 2:
        return
    signature = _describe(leaves, noun)
    rank = jax.process_index()
    call = next(_calls.setdefault(group, itertools.count()))
    prefix = f"{_ROOT}{'-'.join(map(str, group))}/"
    client.key_value_set(f"{prefix}{call}/{rank}", signature)
    if call >= 2:  # every process has read call - 2: it has posted call - 1
        with contextlib.suppress(Exception):
            client.key_value_delete(f"{prefix}{call - 2}/{rank}")
    since = time.monotonic()
    deadline = since + _departures.wait_limit()
    with _departures.python_wait():
        for other in group:
            if other == rank:
                continue
            left = functools.partial(_left, fn, other)
            theirs = _key_value.await_key(client, f"{prefix}{call}/{other}", deadline, left)
            if theirs is None:
                raise errors.DistributedTimeoutError(
                    _not_issued(fn, rank, other, signature, call, time.monotonic() - since)
                )
            if theirs != signature:  # every process sees it and raises
                _departures.announce_failure()
                _departures.await_failures(group)
                raise errors.DistributedError(_issued_other(fn, rank, other, signature, theirs))


def _describe(leaves: Sequence[tuple], noun: tuple[str, str]) -> str:
    """ "an all-gather of 2 leaves (272 elements in all, layout digest 4d8c6bf2)"."""
    exact = ";".join(f"{tuple(shape)}/{dim}/{dtype}" for shape, dim, dtype in leaves)
    digest = hashlib.sha256(exact.encode()).hexdigest()[:8]
    elements = sum(math.prod(shape) for shape, _, _ in leaves)
    return (
        f"an all-gather of {len(leaves)} {noun[len(leaves) != 1]} ({elements:,} elements "
        f"in all, layout digest {digest})"
    )


def _left(fn: str, other: int) -> str | None:
    """The error once `other` left the job (None while it has not)."""
    left = _departures.departed().get(other)
    if left is None:
        return None
    return (
        f"{fn} outside a step: process {jax.process_index()} issued a collective "
        f"that {_departures.departure_text(left)} will never join."
    )


def _not_issued(fn: str, rank: int, other: int, signature: str, call: int, waited_s: float) -> str:
    return (
        f"{fn} outside a step: process {rank} of {jax.process_count()} is about to issue "
        f"{signature} (its collective number {call + 1} outside a compiled step), and "
        f"process {other} has not issued it after {waited_s:.0f} s. Outside a compiled "
        "step every process must issue the same collectives in the same order: one issued "
        "by some processes only pairs with whatever collective the others run next (a "
        "training step's all-gather of the same size: wrong values or a hang). Call "
        f"{fn} on every process (not under `if jax.process_index() == 0:`), or raise "
        "departure_timeout (an argument of fs.distributed.initialize, or "
        f"FUNSHARD_DEPARTURE_TIMEOUT) if process {other} is legitimately that far behind."
    )


def _issued_other(fn: str, rank: int, other: int, mine: str, theirs: str) -> str:
    return (
        f"{fn} outside a step: process {rank} is about to issue {mine}, but process "
        f"{other} issues {theirs} at the same point. Every process must issue the same "
        "collectives, on the same shapes and dtypes, in the same order: pass the same "
        f"tree to {fn} on every process."
    )
