"""Reading collectives out of compiled HLO text: the one parser of this repository.

The FSDP benchmark (`benchmarks/fsdp/`) and the tests (`tests/_hlo.py`) both read their
collective facts through this module, so a change in XLA's text format is fixed once.
It imports nothing but the standard library and `funshard._hlo` (the replica-group
parser, which reads XLA's explicit, iota and mesh-axes forms alike): the tests load it
by path, without the benchmark package and its device setup.

Three layers, each usable on its own:

* `computations(text)`: the module's computations, name -> instruction lines
  (`"ENTRY"` for the entry computation).
* `parse_collectives(lines)`: every collective instruction in some lines (a whole
  module's text or one computation's), as `Collective` records.
* `executed_collectives(text, num_devices)`: what ONE step runs per device: each
  collective with the number of times it executes (while-loop trip counts) and its
  bytes, the benchmark's reading.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator

from funshard import _hlo

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPCODE = re.compile(r"\s(" + "|".join(KINDS) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction.

    Attributes:
        kind: one of `KINDS`.
        start: whether it is an async `-start` form (its `-done` half is never listed).
        arrays: (dtype, dims) of each part of its result: one part, or several when XLA
            combined collectives into a tuple-shaped one. For async forms only the
            results proper (not the operand aliases or sync flags of the start tuple).
        rest: the instruction text after the opcode (operands and attributes).
    """

    kind: str
    start: bool
    arrays: tuple[tuple[str, str], ...]
    rest: str

    @property
    def elements(self) -> int:
        """Elements of all result parts together."""
        return sum(math.prod(_dims(dims)) for _, dims in self.arrays)

    @property
    def nbytes(self) -> int:
        """Bytes of all result parts together."""
        return sum(math.prod(_dims(dims)) * dtype_bytes(dtype) for dtype, dims in self.arrays)

    @property
    def replica_groups(self) -> str | None:
        """The `replica_groups=` attribute as written (`{{0,1},{2,3}}`, `[2,4]<=[8]`)."""
        return _hlo.replica_groups_attribute(self.rest)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...] | None:
        """The replica groups, whichever form XLA wrote them in (None: no attribute;
        `()`: `{}`, all devices)."""
        value = self.replica_groups
        return None if value is None else _hlo.replica_groups(value)

    def group_size(self, default: int) -> int:
        """Devices in each replica group; `default` (all devices) when none is given."""
        groups = self.groups
        return max(1, len(groups[0])) if groups else default


def _dims(dims: str) -> list[int]:
    return [int(d) for d in dims.split(",") if d]


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of an HLO element type (`f32` -> 4; sub-byte types -> 1)."""
    if dtype == "pred" or dtype.startswith(("f8", "f4", "s4", "u4")):
        return 1
    bits = re.search(r"(\d+)$", dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 4


def parse_collectives(lines: Iterable[str]) -> Iterator[Collective]:
    """Yields every collective instruction in `lines`, in order.

    Args:
        lines: HLO text lines: a whole module or the body of one computation.

    Yields:
        One `Collective` per instruction; async forms once (at their `-start`).
    """
    for line in lines:
        if " = " not in line:
            continue
        # The instruction's name is left of the first " = "; metadata further right
        # may hold more of them, so split once.
        rhs = line.split(" = ", 1)[1]
        m = _OPCODE.search(" " + rhs)
        if not m:
            continue
        kind, start = m.group(1), bool(m.group(2))
        arrays = _ARRAY.findall(rhs[: m.start()])
        if start and kind == "all-gather":  # ((operands...), (outputs...)) or (in, out)
            arrays = arrays[len(arrays) // 2 :]
        elif start and kind == "collective-permute":  # (in, out, u32[], u32[])
            arrays = arrays[1:2]
        yield Collective(kind, start, tuple(arrays), rhs[m.end() - 1 :])


def computations(hlo_text: str) -> dict[str, list[str]]:
    """Splits an HLO module into its computations.

    Args:
        hlo_text: the module's text (`compiled.as_text()`).

    Returns:
        Computation name -> its instruction lines, in module order; the entry
        computation is under `"ENTRY"` (nothing calls it, so its own name is not needed).
    """
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = "ENTRY" if m.group(1) else m.group(2)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _call_edges(comps: dict[str, list[str]]) -> tuple[dict[str, list], dict[str, bool]]:
    """Who calls whom: caller -> [(callee, times per caller run, through a branch)].

    Also returns facts: `while` (the program has a while loop), `unknown_trip` (some
    while loop had no known trip count; its body is then counted once).
    """
    calls: dict[str, list[tuple[str, int, bool]]] = {}
    facts = {"while": False, "unknown_trip": False}
    for name, lines in comps.items():
        edges = calls.setdefault(name, [])
        for line in lines:
            trip = 1
            if " while(" in line:
                facts["while"] = True
                m = _TRIP.search(line)
                if m:
                    trip = int(m.group(1))
                else:
                    facts["unknown_trip"] = True
            for role, callee in _CALLEE.findall(line):
                branch = role in ("true_computation", "false_computation")
                edges.append((callee, trip if role == "body" else 1, branch))
            for group in _BRANCHES.findall(line):
                edges += [(c.strip().lstrip("%"), 1, True) for c in group.split(",")]
    return calls, facts


def multiplicities(comps: dict[str, list[str]]) -> tuple[dict[str, int], set[str], dict]:
    """How many times each computation runs per step (while bodies x known trip count).

    Args:
        comps: the output of `computations`.

    Returns:
        (multiplicity by computation, the computations reached through a `conditional`
        branch, facts from `_call_edges`). A branch is counted as running every time its
        caller runs, an upper bound (fs.scan's prefetch gathers sit in such branches).
    """
    calls, facts = _call_edges(comps)
    mult: dict[str, int] = {}
    conditional: set[str] = set()

    def visit(name: str, times: int, in_branch: bool, depth: int = 0) -> None:
        if depth > 64:  # a guard against call cycles, which valid HLO does not have
            return
        mult[name] = mult.get(name, 0) + times
        if in_branch:
            conditional.add(name)
        for callee, trip, branch in calls.get(name, []):
            visit(callee, times * trip, in_branch or branch, depth + 1)

    if "ENTRY" in comps:
        visit("ENTRY", 1, False)
    return mult, conditional, facts


def executed_collectives(text: str, num_devices: int) -> tuple[list[dict], dict]:
    """Every collective executed by one step, per device, from compiled HLO text.

    Each op: kind, dtypes, `times` it runs per step (ops inside a while body count
    trip-count times), `conditional` (inside a conditional branch: `times` is then an
    upper bound), group size G, `bytes` and `moved` (both per execution):

    * all-gather: `bytes` = the OUTPUT (gathered, full) buffer.
    * reduce-scatter: `bytes` = the INPUT (full, pre-scatter) buffer = output x G.
    * all-reduce, all-to-all, collective-permute: `bytes` = the buffer (output) size.
      XLA CPU combines all-reduces into tuple-shaped ops: all parts are summed.
    * `moved`: bytes one device sends in a ring implementation: (G-1)/G x full buffer for
      all-gather, reduce-scatter and all-to-all, 2(G-1)/G x buffer for all-reduce, the
      buffer for collective-permute.

    Args:
        text: the compiled module's text.
        num_devices: the group size of collectives that name no replica groups.

    Returns:
        (ops, facts about loops; see `multiplicities`).
    """
    comps = computations(text)
    mult, conditional, facts = multiplicities(comps)
    ops = []
    for name, lines in comps.items():
        for c in parse_collectives(lines):
            ops.append(_executed(c, mult.get(name, 1), name in conditional, num_devices))
    return ops, facts


def _executed(c: Collective, times: int, conditional: bool, num_devices: int) -> dict:
    g = c.group_size(num_devices)
    full = c.nbytes * g if c.kind == "reduce-scatter" else c.nbytes
    factor = {"all-reduce": 2 * (g - 1) / g, "collective-permute": 1.0}.get(c.kind, (g - 1) / g)
    return {
        "kind": c.kind,
        "dtypes": sorted({dtype for dtype, _ in c.arrays}),
        "times": times,
        "conditional": conditional,
        "group": g,
        "bytes": full,
        "moved": factor * full,
    }
