"""Every CPython behaviour funshard relies on beyond the language, in one place.

funshard reads one thing the language does not promise: which instruction a caller's
frame is executing, decoded from its bytecode, so that a loss function's `leaf.data`
inside a step (a traced read of the local block, easily mistaken for the parameter) is
told apart from jax's own reads of the same field. The bytecode format changes with
every CPython release; `SUPPORTED_PYTHON` is the range it is known to read correctly,
and `check()` verifies it on first use (the root calls it beside `_jax_compat.check()`),
failing with a message naming the broken assumption, so that moving to a new Python is
a one-file job.
"""

from __future__ import annotations

import dis
import functools
import linecache
import sys
import types
from collections.abc import Callable
from typing import Any

# CPython releases whose bytecode `attribute_read_at` decodes (CI runs each).
SUPPORTED_PYTHON = ">=3.11,<3.14"

# `.get`: a Python without one of them fails in `check()`, never at import.
_LOAD_ATTR = dis.opmap.get("LOAD_ATTR")
_EXTENDED_ARG = dis.opmap.get("EXTENDED_ARG")
_CACHE = dis.opmap.get("CACHE")
# Opcodes that read an attribute by name (`x.data`, `x.data.sum()`). LOAD_METHOD is a
# real opcode on 3.11 only; later ones list it as a pseudo-op (>= 256, never in co_code).
_ATTRIBUTE_READS = frozenset(
    dis.opmap[op] for op in ("LOAD_ATTR", "LOAD_METHOD") if op in dis.opmap and dis.opmap[op] < 256
)
# From 3.12 LOAD_ATTR's argument is `name index << 1 | loads a method`.
_METHOD_BIT = sys.version_info >= (3, 12)


def calling_frame(depth: int = 1) -> types.FrameType:
    """The frame `depth` calls above the function that calls this one.

    Relies on `sys._getframe` (a CPython implementation detail). A property getter
    calling `calling_frame()` gets the frame of the code that read the property.
    """
    return sys._getframe(depth + 1)


def user_frame(frame: types.FrameType | None, libraries: frozenset[str]) -> types.FrameType | None:
    """The innermost frame from `frame` outward whose module's top-level package is not
    one of `libraries` (the code that called into them); None if there is none."""
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in libraries:
        frame = frame.f_back
    return frame


def executing_source(frame: types.FrameType) -> str | None:
    """The source text of the expression `frame` is executing, or None without source.

    Uses PEP 657's positions (`code.co_positions()`, one entry per 2-byte code unit,
    inline caches included, columns in UTF-8 bytes) at `frame.f_lasti`, and the file's
    lines from `linecache`, as tracebacks do for their carets. Guarded by
    tests/test_obscure_errors.py.
    """
    positions = list(frame.f_code.co_positions())
    index = frame.f_lasti // 2
    if not 0 <= index < len(positions):
        return None
    start, end, col, end_col = positions[index]
    if start is None or end is None or col is None or end_col is None:
        return None
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)[start - 1 : end]
    if len(lines) != end - start + 1:
        return None  # no source (an interactive session, exec of a string)
    raw = [line.encode() for line in lines]
    raw[-1] = raw[-1][:end_col]
    raw[0] = raw[0][col:]
    return b"".join(raw).decode(errors="replace")


def thread_position(ident: int | None) -> tuple[int, int, types.CodeType] | None:
    """Where the thread `ident` is executing: (frame identity, instruction, code).

    Two equal results, read a while apart, mean the thread has not moved (the departure
    watchdog's test for a main thread stuck inside one call). None where the thread has
    no Python frame (it ended, or `ident` is None).

    Relies on `sys._current_frames()` (a CPython implementation detail) and on a frame's
    `f_lasti` changing whenever Python code runs in it. Guarded by
    tests/test_py_compat.py and tests/test_departed_peer.py.
    """
    frame = sys._current_frames().get(ident) if ident is not None else None
    return None if frame is None else (id(frame), frame.f_lasti, frame.f_code)


def attribute_read_at(frame: types.FrameType, name: str) -> bool:
    """Whether `frame` is executing, right now, an attribute read `<expr>.<name>`.

    True only for the attribute syntax in `frame`'s own code; `getattr(x, name)` and
    reads from C code (jax's pytree flattening) are calls, not such an instruction.

    Relies on `frame.f_lasti` being the byte offset, in `frame.f_code.co_code`, of the
    instruction being executed or of one of its inline cache entries (3.12 points at
    the last cache entry once it has specialised a read of a property), on 2-byte code
    units with the opcode first, on `CACHE` entries reading as opcode 0 in `co_code`,
    on `EXTENDED_ARG` prefixes carrying an argument's high bytes, and on LOAD_ATTR's
    argument indexing `co_names` (shifted left by one from 3.12). Guarded by
    tests/test_py_compat.py and tests/test_hardening.py.

    Args:
      frame: a frame that is executing (not a finished one).
      name: the attribute name.
    """
    return _attribute_name_at(frame.f_code, frame.f_lasti) == name


def _attribute_name_at(code: types.CodeType, offset: int) -> str | None:
    """The name an attribute-reading instruction at `offset` of `code` reads, else None."""
    ops = code.co_code
    start = _instruction_start(ops, offset)
    if start is None or ops[start] not in _ATTRIBUTE_READS:
        return None
    index = _argument(ops, start)
    if _METHOD_BIT and ops[start] == _LOAD_ATTR:
        index >>= 1
    return code.co_names[index] if index < len(code.co_names) else None


def _instruction_start(ops: bytes, offset: int) -> int | None:
    """The offset of the instruction that owns the code unit at `offset` (itself, or the
    instruction whose inline cache holds it); None outside the code."""
    if not 0 <= offset < len(ops) - 1 or offset % 2:
        return None
    while offset >= 0 and ops[offset] == _CACHE:
        offset -= 2
    return offset if offset >= 0 else None


def _argument(ops: bytes, start: int) -> int:
    """The full argument of the instruction at `start`, its EXTENDED_ARG prefixes included."""
    argument, back, shift = ops[start + 1], start - 2, 8
    while back >= 0 and ops[back] == _EXTENDED_ARG:
        argument, back, shift = argument | ops[back + 1] << shift, back - 2, shift + 8
    return argument


class _Probe:
    """An object whose `seen` and `other` properties say whether their reader's frame
    is executing a `.seen` attribute read, the way a step's leaf asks about `.data`."""

    @property
    def seen(self) -> bool:
        return attribute_read_at(calling_frame(), "seen")

    @property
    def other(self) -> bool:
        return attribute_read_at(calling_frame(), "seen")


def _hot_read(probe: _Probe) -> bool:
    # Enough reads for the interpreter to specialise the instruction (3.12 then moves
    # f_lasti onto its inline cache).
    return all([probe.seen for _ in range(64)][-8:])


def _many_names_read() -> Callable[[Any, bool], bool]:
    """A function whose `.seen` read needs EXTENDED_ARG: its name is the 301st."""
    unused = "\n        ".join(f"probe.unused{i}" for i in range(300))
    source = f"def read(probe, never):\n    if never:\n        {unused}\n    return probe.seen\n"
    namespace: dict[str, Any] = {}
    code = compile(source, "<funshard._py_compat probe>", "exec")
    exec(code, namespace)
    return namespace["read"]


def _probes() -> list[tuple[str, Callable[[_Probe], bool], bool]]:
    """(what is read, how, whether it is an attribute read of `.seen`) for `check()`."""
    return [
        # The second name read: its index (1) is wrong unless LOAD_ATTR's flag bit is dropped.
        ("`x.seen` in the reader's code", lambda p: (p.other, p.seen)[1], True),
        ("`x.seen.real`, a read followed by another", lambda p: p.seen.real == 1, True),
        ("`x.seen` in a hot loop (a specialised instruction)", _hot_read, True),
        (
            "`x.seen` whose name index needs EXTENDED_ARG",
            lambda p: _many_names_read()(p, False),
            True,
        ),
        ("getattr(x, 'seen') (a call, not an attribute read)", lambda p: getattr(p, "seen"), False),  # noqa: B009 - the call is the point
        ("`x.other` (another name)", lambda p: p.other, False),
    ]


@functools.cache
def check() -> None:
    """Verifies the assumptions above once; raises naming the one that broke.

    Raises:
      RuntimeError: an assumption does not hold for the running Python.
    """
    for opname, code in (
        ("LOAD_ATTR", _LOAD_ATTR),
        ("EXTENDED_ARG", _EXTENDED_ARG),
        ("CACHE", _CACHE),
    ):
        if code is None:
            _broken(f"dis.opmap has no {opname}")
    if not hasattr(sys, "_getframe"):
        _broken("sys._getframe is missing")
    if not hasattr(sys, "_current_frames"):
        _broken("sys._current_frames is missing")
    probe = _Probe()
    for what, read, want in _probes():
        if read(probe) != want:
            _broken(
                f"frame.f_lasti and code.co_code {'no longer' if want else 'wrongly'} "
                f"show {what} as an attribute read of that name"
            )


def _broken(what: str) -> None:
    version = ".".join(map(str, sys.version_info[:3]))
    raise RuntimeError(
        f"funshard: an assumption about CPython {version} failed: {what} (funshard reads "
        "the caller's bytecode to refuse a traced `.data` read in a loss function). "
        f"funshard supports Python{SUPPORTED_PYTHON}; install a supported version, or "
        "update funshard/_py_compat.py for this one."
    )
