"""Reading the replica groups of a collective out of compiled HLO text.

XLA writes a collective's `replica_groups=` attribute in one of two forms:

* explicit: `{{0,1,2,3},{4,5,6,7}}` (what jax 0.10's XLA prints);
* iota: `[2,4]<=[8]` or `[2,4]<=[4,2]T(1,0)` (what jax 0.12's XLA prints): the device
  ids `0 .. prod(reshape dims)-1` in order, reshaped to the dims after `<=`, transposed
  by the permutation in `T(...)` if one is given, then reshaped to `[groups, size]`.

`replica_groups` reads both into the same tuple of groups, so that what funshard, its
tests and its benchmarks learn from a compiled program does not depend on the form.
Standard library only: the benchmarks' HLO reader (`benchmarks/hlo.py`) uses it too.
"""

from __future__ import annotations

import itertools
import math
import re

# The attribute's value: an explicit list (no spaces inside), or the iota form.
_ATTRIBUTE = re.compile(r"replica_groups=(\{[0-9,{}]*\}|\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?)")
_EXPLICIT = re.compile(r"^\{(\{[0-9,]*\}(,\{[0-9,]*\})*)?\}$")
_IOTA = re.compile(r"^\[([0-9,]*)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?$")


def replica_groups_attribute(instruction: str) -> str | None:
    """The `replica_groups=` attribute of an HLO instruction as written, or None."""
    m = _ATTRIBUTE.search(instruction)
    return m.group(1) if m else None


def replica_groups(value: str) -> tuple[tuple[int, ...], ...]:
    """The replica groups an attribute value names, in either form.

    Args:
      value: `{{0,1},{2,3}}`, `{}` (no groups: all devices), `[2,2]<=[4]` or
        `[2,2]<=[2,2]T(1,0)`.

    Returns:
      One tuple of device ids per group; `()` for `{}`.

    Raises:
      ValueError: `value` is in neither form, or its iota dims do not agree.
    """
    value = value.strip()
    if value.startswith("{"):
        if not _EXPLICIT.match(value):
            raise ValueError(f"replica groups {value!r}: not a list of {{...}} groups")
        groups = re.findall(r"\{([0-9,]*)\}", value[1:-1])
        return tuple(tuple(int(d) for d in g.split(",") if d) for g in groups)
    m = _IOTA.match(value)
    if not m:
        raise ValueError(f"replica groups {value!r}: neither {{{{...}}}} nor [g,s]<=[...]")
    shape = _ints(m.group(1))
    dims = _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) is not None else list(range(len(dims)))
    if len(shape) != 2 or math.prod(shape) != math.prod(dims) or sorted(perm) != list(
            range(len(dims))):
        raise ValueError(f"replica groups {value!r}: the iota dims do not agree")
    ids = _transposed_iota(dims, perm)
    size = shape[1]
    return tuple(tuple(ids[i:i + size]) for i in range(0, len(ids), size))


def format_groups(groups: tuple[tuple[int, ...], ...]) -> str:
    """Groups in the explicit form, `{{0,1},{2,3}}` (`{}` for none)."""
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """`iota(prod(dims)).reshape(dims).transpose(perm).ravel()` without numpy."""
    strides = [math.prod(dims[i + 1:]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    return [sum(idx[k] * strides[p] for k, p in enumerate(perm))
            for idx in itertools.product(*(range(d) for d in out_dims))]
