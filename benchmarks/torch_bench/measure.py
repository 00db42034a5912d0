"""What a step costs on this rank: wall time, bytes written, resident memory, bridge time.

* Bytes sent: `wchar` of `/proc/self/io`, the bytes this process handed to write-type
  system calls. gloo (torch's and JAX's alike) sends through TCP sockets with
  `writev`, so over a step it is what the rank sent (the benchmark writes no files
  meanwhile).
* Memory: `VmHWM` (peak resident set) of `/proc/self/status`, reset by writing 5 to
  `/proc/self/clear_refs` before a step. glibc is first told to return every block over
  64 KiB to the system on free (`mallopt(M_MMAP_THRESHOLD)`), so the resident set
  follows what is allocated rather than what malloc keeps cached (`--malloc default`
  keeps glibc's defaults, as a training script runs). `ResidentSampler` splits the
  process's peak into anonymous and file-backed memory.
* The frontend's profile: time spent inside `torch_frontend._bridge`'s calls, by
  wrapping them (the files are not touched).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import threading
import time
from pathlib import Path

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def written_bytes() -> int:
    """Bytes this process passed to write-type system calls so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def resident_bytes() -> int:
    return 1024 * _status_kib("VmRSS")


def anonymous_bytes() -> int:
    return 1024 * _status_kib("RssAnon")


def peak_resident_bytes() -> int:
    return 1024 * _status_kib("VmHWM")


def rollup_anonymous_bytes() -> int:
    """Anonymous memory of this process, from `/proc/self/smaps_rollup` (`Anonymous:`).

    The kernel adds up every mapping's anonymous pages at the read, where `RssAnon` is a
    counter it updates lazily per thread; the two agree to a few pages.
    """
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return 1024 * int(line.split()[1])
    return 0


def resident_parts() -> dict:
    """This process's resident memory now: {"rss", "anon", "file"} in bytes."""
    return {
        "rss": resident_bytes(),
        "anon": rollup_anonymous_bytes(),
        "file": 1024 * _status_kib("RssFile"),
    }


class ResidentSampler:
    """The peaks of this process's anonymous and file-backed resident memory.

    The kernel keeps only the total's peak (`VmHWM`). Its two parts differ in kind:
    anonymous memory (`RssAnon`: heaps, tensors, Python objects) is this process's own,
    file-backed memory (`RssFile`: the code pages of torch's and jaxlib's shared
    libraries) is shared with every other process mapping the same files, and the kernel
    can drop it under pressure. A thread reads both every `period_s` seconds, and the
    anonymous part again from `/proc/self/smaps_rollup` (`Anonymous`).
    """

    def __init__(self, period_s: float = 0.005):
        self.peaks = {"RssAnon": 0, "RssFile": 0, "Anonymous": 0}
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            for field in ("RssAnon", "RssFile"):
                self.peaks[field] = max(self.peaks[field], 1024 * _status_kib(field))
            self.peaks["Anonymous"] = max(self.peaks["Anonymous"], rollup_anonymous_bytes())
            if self._stop.wait(self._period_s):
                return

    def stop(self) -> dict:
        """Ends sampling; {"peak_anon", "peak_file", "peak_rollup_anon"} in bytes."""
        self._stop.set()
        self._thread.join()
        return {
            "peak_anon": self.peaks["RssAnon"],
            "peak_file": self.peaks["RssFile"],
            "peak_rollup_anon": self.peaks["Anonymous"],
        }


def reset_peak() -> bool:
    """Resets the peak resident set to the current one; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def return_freed_memory() -> None:
    """Makes glibc hand large freed blocks back to the system at once (see above)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)


def timed(fn, *args) -> tuple[float, float, int]:
    """(seconds, fn's result, bytes written) of one call."""
    sent = written_bytes()
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result, written_bytes() - sent


def step_memory(fn, *args) -> dict:
    """Resident bytes before a call and at its peak."""
    ok = reset_peak()
    before = resident_bytes()  # after the reset: the peak can only be higher
    fn(*args)
    return {"rss_before": before, "rss_peak": peak_resident_bytes() if ok else None}


# ---------------------------------------------------------------- frontend profile


class BridgeProfile:
    """Seconds and calls inside the frontend's bridge functions, while `active`.

    Main thread: `global_block` (DLPack import of a shard, once per parameter),
    `finish_all_gather` (waiting for a gather, and DLPack export), `reduce_scatter`
    (the whole gradient reduction: padding, import, collective, export). Collective
    thread: `_gather_now` / `_reduce_now` (JAX dispatch + the compiled collective),
    of which `eager_all_gather` / `eager_reduce_scatter` is the funshard call.
    `_import` / `_export` are DLPack's share.
    """

    MAIN = (
        "global_block",
        "finish_all_gather",
        "start_reduce_scatter",
        "finish_reduce_scatter",
        "_import",
        "_export",
    )
    THREAD = ("_gather_now", "_reduce_now")

    def __init__(self):
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.active = False

    def install(self) -> None:
        from funshard import comm
        from torch_frontend import _bridge

        for module, names in (
            (_bridge, (*self.MAIN, *self.THREAD)),
            (comm, ("eager_all_gather", "eager_reduce_scatter")),
        ):
            for name in names:
                if hasattr(module, name):  # the bridge's internals may move
                    setattr(module, name, self._wrap(name, getattr(module, name)))

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        return wrapper

    @contextlib.contextmanager
    def recording(self):
        self.seconds.clear()
        self.calls.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False
