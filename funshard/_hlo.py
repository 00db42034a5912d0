"""Reading collectives out of compiled HLO text: the one parser of this repository.

funshard's own checks, its tests (`tests/_hlo.py`) and its benchmarks (`benchmarks/hlo.py`)
all read collective facts through this module, so a change in XLA's text format is fixed
once. Standard library only.

Layers, each usable on its own:

* `replica_groups(value)`: the groups a `replica_groups=` attribute names. XLA writes it
  in one of three forms:
  - explicit: `{{0,1,2,3},{4,5,6,7}}` (what jax 0.10's XLA prints);
  - iota: `[2,4]<=[8]` or `[2,4]<=[4,2]T(1,0)`: the device ids `0 .. prod(reshape
    dims)-1` in order, reshaped to the dims after `<=`, transposed by the permutation in
    `T(...)` if one is given, then reshaped to `[groups, size]`;
  - mesh axes: `mesh['r'=2,'f'=4] {'f'}` (what jax 0.12's XLA prints for shard_map
    collectives): the logical ids `0 .. prod(sizes)-1` laid out over the mesh in order;
    each group is one position of the axes not listed, its members run over the listed
    axes, the first listed slowest (`{'f','r'}` on that mesh is `{{0,4,1,5,2,6,3,7}}`,
    as jax 0.10's XLA wrote it).
  All three read into the same tuple of groups, so that what is learnt from a compiled
  program does not depend on the form; `mesh_axes_of` names the mesh axes they run over.
* `computations(text)`: the module's computations, name -> instruction lines
  (`"ENTRY"` for the entry computation).
* `parse_collectives(lines)`: every collective instruction in some lines (a whole
  module's text or one computation's), as `Collective` records, with the `op_name` and
  stack frame of their metadata.
* `executed_collectives(text, num_devices)`: what ONE step runs per device: each
  collective with the number of times it executes (while-loop trip counts) and its
  bytes.
* `stack_frames(text)` and `source_of`: the file, function and line a collective was
  written at, from the module's `StackFrames` tables.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Sequence

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


# ---- collectives, computations and loops ---------------------------------------------

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OPCODE = re.compile(r"\s(" + "|".join(KINDS) + r")(-start)?\(")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="([^"]*)"')
_FRAME_ID = re.compile(r"metadata=\{[^}]*?stack_frame_id=(\d+)")
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
        return replica_groups_attribute(self.rest)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...] | None:
        """The replica groups, whichever form XLA wrote them in (None: no attribute;
        `()`: `{}`, all devices)."""
        value = self.replica_groups
        return None if value is None else replica_groups(value)

    @property
    def op_name(self) -> str:
        """The `op_name` of its metadata (JAX's name stack), or "" without one."""
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ""

    @property
    def frame(self) -> int | None:
        """The `stack_frame_id` of its metadata (see `stack_frames`), or None."""
        m = _FRAME_ID.search(self.rest)
        return int(m.group(1)) if m else None

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


# ---- where a collective came from ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Frame:
    """One entry of a module's `StackFrames` table.

    Attributes:
        file: the source file.
        function: the function's qualified name.
        line: the line in `file`.
        parent: the calling frame's id, or None at the outermost frame.
    """

    file: str
    function: str
    line: int
    parent: int | None


def _table(text: str, name: str) -> list[str]:
    """The lines of one of the tables XLA prints after a module (`FileNames`, ...)."""
    lines = text.splitlines()
    try:
        start = lines.index(name) + 1
    except ValueError:
        return []
    end = start
    while end < len(lines) and lines[end].strip():
        end += 1
    return lines[start:end]


def _numbered(lines: list[str]) -> dict[int, str]:
    out = {}
    for line in lines:
        number, _, rest = line.strip().partition(" ")
        if number.isdigit():
            out[int(number)] = rest.strip()
    return out


def _fields(value: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", value)}


def stack_frames(text: str) -> dict[int, Frame]:
    """The stack frames a compiled module's metadata refers to, by `stack_frame_id`.

    Args:
        text: the module's text (`compiled.as_text()`), with its `FileNames`,
            `FunctionNames`, `FileLocations` and `StackFrames` tables.

    Returns:
        Frame id -> `Frame`; empty when the module carries no such tables.
    """
    files = {k: v.strip('"') for k, v in _numbered(_table(text, "FileNames")).items()}
    functions = {k: v.strip('"') for k, v in _numbered(_table(text, "FunctionNames")).items()}
    locations = {k: _fields(v) for k, v in _numbered(_table(text, "FileLocations")).items()}
    frames = {}
    for number, value in _numbered(_table(text, "StackFrames")).items():
        fields = _fields(value)
        location = locations.get(fields.get("file_location_id", 0), {})
        parent = fields.get("parent_frame_id")
        frames[number] = Frame(
            file=files.get(location.get("file_name_id", 0), "?"),
            function=functions.get(location.get("function_name_id", 0), "?"),
            line=location.get("line", 0),
            # XLA prints a frame without a caller as its own parent (or as 0).
            parent=None if not parent or parent == number else parent,
        )
    return frames


def source_of(
    frame: int | None, frames: dict[int, Frame], skip: Sequence[str] = ()
) -> Frame | None:
    """The innermost frame of `frame`'s chain whose file is under none of `skip`.

    Args:
        frame: a collective's `stack_frame_id` (None: it has none).
        frames: the output of `stack_frames`.
        skip: path prefixes of library code (funshard's, jax's) to look through.

    Returns:
        The frame, or None when the chain is empty or every frame is skipped.
    """
    seen = set()
    while frame is not None and frame in frames and frame not in seen:
        seen.add(frame)
        found = frames[frame]
        if not any(found.file.startswith(prefix) for prefix in skip):
            return found
        frame = found.parent
    return None


def op_name_parts(op_name: str) -> list[str]:
    """The op_names a combined collective carries, one per operation XLA combined.

    XLA's combiners name a combined op `prefix(a:b:c)` after the common prefix of its
    parts' names, so each part is `prefix` + `a`, ...; the parts may close parentheses
    the prefix opened (`f(g/(x)):y))`).

    Args:
        op_name: a collective's `op_name` (`Collective.op_name`).

    Returns:
        `[op_name]` for an op that was not combined.
    """
    if ":" not in op_name or not op_name.endswith(")"):
        return [op_name]
    for p in (i for i, char in enumerate(op_name[: op_name.index(":")]) if char == "("):
        prefix, parts = op_name[:p], op_name[p + 1 : -1].split(":")
        if all(_balanced(prefix + part) for part in parts):
            return [prefix + part for part in parts]
    return [op_name]


def _balanced(name: str) -> bool:
    depth = 0
    for char in name:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            return False
    return depth == 0


_SCOPE = re.compile(r"funshard/(.+?)/(all_gather|reduce_scatter)(?:[)/]|$)")


def funshard_scope(op_name: str) -> tuple[str, str] | None:
    """(unit, "all_gather" or "reduce_scatter") of a funshard collective's op_name.

    funshard labels its collectives `funshard/<unit>/all_gather` and
    `funshard/<unit>/reduce_scatter` (its HSDP all-reduce sits in the latter).

    Args:
        op_name: one op_name (a part of a combined one: see `op_name_parts`).

    Returns:
        None for a collective funshard did not label (one written in the loss, or an
        autodiff reduction).
    """
    m = _SCOPE.search(op_name)
    return (m.group(1), m.group(2)) if m else None


def is_backward(op_name: str) -> bool:
    """Whether an op was made by transposing (autodiff's backward pass)."""
    return "transpose(" in op_name


def mesh_axes_of(
    groups: tuple[tuple[int, ...], ...], mesh_shape: Sequence[tuple[str, int]]
) -> tuple[str, ...] | None:
    """The mesh axes whose devices make up `groups`, in mesh order.

    Device ids are positions in the mesh's devices, row-major (the logical ids of a
    program compiled for the mesh).

    Args:
        groups: replica groups (`replica_groups`); `()` means every device.
        mesh_shape: (axis name, size) of each mesh axis, in mesh order.

    Returns:
        The axes (an empty tuple for groups of one device), or None when the groups are
        not those of any set of mesh axes.
    """
    names = [name for name, _ in mesh_shape]
    dims = [size for _, size in mesh_shape]
    if not groups:
        return tuple(name for name, size in mesh_shape if size > 1)
    wanted = {frozenset(g) for g in groups}
    for count in range(len(names) + 1):
        for chosen in itertools.combinations(range(len(names)), count):
            perm = [i for i in range(len(names)) if i not in chosen] + list(chosen)
            ids = _transposed_iota(dims, perm)
            size = math.prod(dims[i] for i in chosen)
            found = {frozenset(ids[i : i + size]) for i in range(0, len(ids), size)}
            if found == wanted:
                return tuple(names[i] for i in chosen if dims[i] > 1)
    return None
