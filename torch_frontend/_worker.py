"""The torch frontend's collective thread: one worker, its jobs in order, futures that give up.

Every process must launch its collectives in the same order, and a prefetched gather
overlaps torch's compute only from another thread (`_bridge.CommContext`). A plain
one-thread `ThreadPoolExecutor` would do, except on a process whose peer left the job:
its collective then never completes, the executor's thread would hold up the
interpreter's exit, and `result()` would wait forever. So the thread is a daemon, each
running job is marked with `funshard.comm.collective_running` (the exit protocol reads
it), and the futures give up through `funshard.comm.stuck_error`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from funshard import comm, errors

_WAIT_SLICE_S = 0.5


class Pending(Future):
    """A future whose `result()` gives up (RuntimeError) on a process that left the job.

    Waits without a timeout go in slices of half a second; after each,
    `funshard.comm.stuck_error` decides. Outside a funshard job it behaves as a plain
    `concurrent.futures.Future`.
    """

    what = "a collective"
    # Called every slice of a long wait with (start, `what`): a message ends the wait
    # (`_recorder.Recorder.stalled`: the ranks issued different collectives).
    stalled: Callable[[float, str], str | None] | None = None

    def result(self, timeout: float | None = None) -> Any:
        """The job's result; raises `DistributedError` once a process that left is awaited."""
        if timeout is not None or self.done() or comm.board() is None:
            return super().result(timeout)
        since = time.monotonic()
        with comm.python_wait():
            while True:
                try:
                    return super().result(_WAIT_SLICE_S)
                except TimeoutError:
                    if self.done():  # the function itself raised a TimeoutError
                        raise
                    error = comm.stuck_error(since, self.what)
                    if error is None and self.stalled is not None:
                        error = self.stalled(since, self.what)
                    if error is not None:
                        raise errors.DistributedError(error) from None


class OrderedWorker:
    """Runs submitted functions one at a time, in order, on one daemon thread.

    Like a one-thread `ThreadPoolExecutor`, but its futures are `Pending` and its thread
    is a daemon: a collective stuck on a process that left never holds up the
    interpreter's exit (the executor's thread would be joined before atexit runs).
    """

    def __init__(self, name: str, stalled: Callable[[float, str], str | None] | None = None):
        self._stalled = stalled
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Pending:
        """Queues `fn(*args, **kwargs)` behind everything submitted before; its future."""
        future = Pending()
        future.stalled = self._stalled
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            with comm.collective_running():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # handed to whoever waits for the future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs
