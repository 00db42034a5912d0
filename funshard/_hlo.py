"""Reading the replica groups of a collective out of compiled HLO text.

XLA writes a collective's `replica_groups=` attribute in one of three forms:

* explicit: `{{0,1,2,3},{4,5,6,7}}` (what jax 0.10's XLA prints);
* iota: `[2,4]<=[8]` or `[2,4]<=[4,2]T(1,0)`: the device ids `0 .. prod(reshape
  dims)-1` in order, reshaped to the dims after `<=`, transposed by the permutation in
  `T(...)` if one is given, then reshaped to `[groups, size]`;
* mesh axes: `mesh['r'=2,'f'=4] {'f'}` (what jax 0.12's XLA prints for shard_map
  collectives): the logical ids `0 .. prod(sizes)-1` laid out over the mesh in order;
  each group is one position of the axes not listed, its members run over the listed
  axes, the first listed slowest (`{'f','r'}` on that mesh is `{{0,4,1,5,2,6,3,7}}`,
  as jax 0.10's XLA wrote it).

`replica_groups` reads all three into the same tuple of groups, so that what funshard, its
tests and its benchmarks learn from a compiled program does not depend on the form.
Standard library only: the benchmarks' HLO reader (`benchmarks/hlo.py`) uses it too.
"""

from __future__ import annotations

import itertools
import math
import re

# The attribute's value: an explicit list (no spaces inside), or the iota form.
_ATTRIBUTE = re.compile(
    r"replica_groups=(\{[0-9,{}]*\}|\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?"
    r"|mesh\[[^\]]*\] \{[^}]*\})"
)
_MESH = re.compile(r"^mesh\[([^\]]*)\] \{([^}]*)\}$")
_MESH_AXIS = re.compile(r"^'([^']+)'=(\d+)$")
_EXPLICIT = re.compile(r"^\{(\{[0-9,]*\}(,\{[0-9,]*\})*)?\}$")
_IOTA = re.compile(r"^\[([0-9,]*)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?$")


def replica_groups_attribute(instruction: str) -> str | None:
    """The `replica_groups=` attribute of an HLO instruction as written, or None."""
    m = _ATTRIBUTE.search(instruction)
    return m.group(1) if m else None


def replica_groups(value: str) -> tuple[tuple[int, ...], ...]:
    """The replica groups an attribute value names, in any of the three forms.

    Args:
      value: `{{0,1},{2,3}}`, `{}` (no groups: all devices), `[2,2]<=[4]`,
        `[2,2]<=[2,2]T(1,0)` or `mesh['r'=2,'f'=2] {'f'}`.

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
    if value.startswith("mesh["):
        return _mesh_groups(value)
    m = _IOTA.match(value)
    if not m:
        raise ValueError(
            f"replica groups {value!r}: neither {{{{...}}}}, [g,s]<=[...] nor mesh[...] {{...}}"
        )
    shape = _ints(m.group(1))
    dims = _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) is not None else list(range(len(dims)))
    if (
        len(shape) != 2
        or math.prod(shape) != math.prod(dims)
        or sorted(perm) != list(range(len(dims)))
    ):
        raise ValueError(f"replica groups {value!r}: the iota dims do not agree")
    ids = _transposed_iota(dims, perm)
    size = shape[1]
    return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def _mesh_groups(value: str) -> tuple[tuple[int, ...], ...]:
    m = _MESH.match(value)
    parts = m.group(1).split(",") if m else []
    axes = [a for a in (_MESH_AXIS.match(p.strip()) for p in parts) if a is not None]
    if not m or len(axes) != len(parts):
        raise ValueError(f"replica groups {value!r}: not mesh['a'=n,...] {{'a',...}}")
    names = [a.group(1) for a in axes]
    dims = [int(a.group(2)) for a in axes]
    listed = [a.strip().strip("'") for a in m.group(2).split(",") if a.strip()]
    if len(set(listed)) != len(listed) or not set(listed) <= set(names):
        raise ValueError(f"replica groups {value!r}: the listed axes are not the mesh's")
    chosen = [names.index(a) for a in listed]
    perm = [i for i in range(len(names)) if i not in chosen] + chosen
    ids = _transposed_iota(dims, perm)
    size = math.prod(dims[i] for i in chosen)
    return tuple(tuple(ids[i : i + size]) for i in range(0, len(ids), size))


def format_groups(groups: tuple[tuple[int, ...], ...]) -> str:
    """Groups in the explicit form, `{{0,1},{2,3}}` (`{}` for none)."""
    return "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"


def _ints(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _transposed_iota(dims: list[int], perm: list[int]) -> list[int]:
    """`iota(prod(dims)).reshape(dims).transpose(perm).ravel()` without numpy."""
    strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
    out_dims = [dims[p] for p in perm]
    return [
        sum(idx[k] * strides[p] for k, p in enumerate(perm))
        for idx in itertools.product(*(range(d) for d in out_dims))
    ]
