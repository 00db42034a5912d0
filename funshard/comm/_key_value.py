"""Processes agreeing through the coordination service's key-value store.

The agreement checks (`same_collective`, `same_state`) and `shard_batch`'s batch check
share these steps: wait for a key, agree on a digest, exchange texts. None is a
collective barrier: a process that died would hold a barrier until its heartbeat times
out (100 s by default), where these waits look at the departure notes between short
slices and raise at once when a process they wait for has left.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import jax

from funshard import errors

# How long one blocking read waits before the departure notes are read again.
_SLICE_S = 0.5

# Says why a wait can no longer end (a process it waits for left the job), or None.
Departed = Callable[[], "str | None"]


def await_key(client: Any, key: str, deadline: float, departed: Departed) -> str | None:
    """`key`'s value once some process posts it; None if none did by `deadline`.

    Args:
      client: JAX's coordination-service client.
      key: the key to read.
      deadline: a `time.monotonic()` time.
      departed: read between slices; its message, when it returns one, is raised.

    Raises:
      DistributedError: `departed()` named a process that left.
    """
    while True:
        slice_ms = max(1, int(min(deadline - time.monotonic(), _SLICE_S) * 1000))
        with contextlib.suppress(Exception):  # not posted within the slice
            return client.blocking_key_value_get(key, slice_ms)
        error = departed()
        if error is not None:
            raise errors.DistributedError(error)
        if time.monotonic() >= deadline:
            return None


def agree_on_digest(
    client: Any,
    root: str,
    digest: str,
    deadline: float,
    departed: Departed,
    drop: str | None = None,
) -> bool | None:
    """Whether every process posted `digest` under `root` (None: no verdict by `deadline`).

    Each process adds 1 to a counter keyed by its digest and to an arrival counter. The
    last to arrive knows every process has counted: its digest's count equals the
    process count exactly when all agree, and it posts that verdict, which the others
    wait for. A process later than `deadline` still gets the verdict (it arrives last).

    Args:
      client: JAX's coordination-service client.
      root: the key prefix of this one agreement (unique per call).
      digest: this process's digest of what must agree.
      deadline: a `time.monotonic()` time for the wait for the verdict.
      departed: as in `await_key`.
      drop: a key prefix the last process to arrive deletes (every process is past it).
    """
    count = jax.process_count()
    client.key_value_increment(f"{root}digest/{digest}", 1)
    if client.key_value_increment(f"{root}arrived", 1) == count:
        agreed = client.key_value_try_get(f"{root}digest/{digest}") == str(count)
        client.key_value_set(f"{root}verdict", "same" if agreed else "different")
        if drop is not None:
            client.key_value_delete(drop)
        return agreed
    posted = await_key(client, f"{root}verdict", deadline, departed)
    return None if posted is None else posted == "same"


def exchange_texts(
    client: Any, root: str, text: str, deadline: float, departed: Departed
) -> dict[int, str]:
    """Every process's `text` (rank -> text), after a disagreement, to say what differs.

    Returns what was posted by `deadline`: a process that never posts is missing, and
    the caller's message names who did answer.
    """
    client.key_value_set(f"{root}full/{jax.process_index()}", text)
    if client.key_value_increment(f"{root}described", 1) == jax.process_count():
        client.key_value_set(f"{root}all_described", "1")
    else:
        await_key(client, f"{root}all_described", deadline, departed)
    posted = client.key_value_dir_get(f"{root}full/")
    return dict(sorted((int(key.rsplit("/", 1)[1]), value) for key, value in posted))
