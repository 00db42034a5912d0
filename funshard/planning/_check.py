"""`check`: a step's compiled collectives set beside those its policy declares, before it runs.

The declared half comes from the step itself: lowering it inside `core.recording()`
writes down the root's options and every unit call (its layout, `reshard_after_forward`,
its layers), and `fs.plan`'s rules (`_plan._unit_collectives`) state the collectives each
implies. The compiled half is read from the compiled program (`_compiled`). Nothing runs:
the step is lowered and compiled only, so its arguments (donated ones included) stay valid.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np

from funshard import comm, core, errors
from funshard.planning import _plan
from funshard.planning._compiled import StepCollective, step_collectives
from funshard.planning._render import human, text_table

# What a mismatch can be (`Mismatch.kind`).
MISMATCH_KINDS = ("unplanned", "multiplied", "missing", "kept", "dtype", "bytes", "donation")

# numpy's dtype names as XLA's HLO writes them.
_HLO_DTYPES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "s64",
    "int32": "s32",
    "int16": "s16",
    "int8": "s8",
    "uint64": "u64",
    "uint32": "u32",
    "uint16": "u16",
    "uint8": "u8",
    "bool": "pred",
    "float8_e4m3fn": "f8e4m3fn",
    "float8_e5m2": "f8e5m2",
}


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One way the compiled step differs from what its policy declares.

    Attributes:
      kind: "unplanned" (a collective no policy asked for: one written in the loss over
        a data axis), "multiplied" (a declared collective runs more often than
        declared, e.g. gradients reduced every microbatch of a hand-written
        accumulation loop), "missing" (a declared collective does not run), "kept"
        (XLA dropped a unit's backward re-gather: its gathered parameters live from
        forward to backward), "dtype", "bytes" (a declared collective moves another
        dtype or size) or "donation" (an argument the step updates is not donated, or
        a donated one is not reused).
      unit: the unit concerned, or None.
      collective: the HLO collective ("all-gather", ...), or None (donation).
      bytes: the bytes per step the difference is about (the extra, missing or
        undonated bytes).
      explanation: one line saying what was found and what to do.
      source: where the collective was written ("file:line (function)"), if known.
    """

    kind: str
    unit: str | None
    collective: str | None
    bytes: int
    explanation: str
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class CheckedCollective:
    """One collective of the step: the compiled one beside the planned one.

    Attributes:
      kind: the HLO collective ("all-gather", "reduce-scatter", "all-reduce", ...).
      unit: the funshard unit it belongs to, or None for one funshard did not issue.
      role: "forward", "backward", "gradients", "replicas" (a unit's), "loss" (written
        in the loss), "autodiff" (a gradient reduction autodiff made: values kept
        whole, the transpose of a loss's collective), "step" (XLA's partitioning of
        the train step's math around the loss, e.g. a gradient norm) or "library"
        (written inside funshard, JAX or another installed package).
      axes: the mesh axes it runs over (None: not a set of mesh axes).
      dtype: the element type compiled (HLO's name, e.g. "bf16"), or planned where it
        does not run.
      bytes: one execution's buffer, compiled (or planned where it does not run).
      times: executions per step in the compiled program (0: it does not run).
      planned_times: executions per step the policy declares (0: none declared).
      planned_dtype: the element type declared, or None.
      source: where it was written, for one funshard did not issue.
    """

    kind: str
    unit: str | None
    role: str
    axes: tuple[str, ...] | None
    dtype: str
    bytes: int
    times: int
    planned_times: int
    planned_dtype: str | None = None
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What `funshard.check` found: the step's collectives, planned and compiled.

    `print(report)` (or `report.table()`) shows it as text; with `rich` installed,
    `rich.print(report)` shows the same table in colour.

    Attributes:
      mesh_shape: the step's mesh axes and sizes.
      platform: the backend it was compiled for ("cpu", "gpu", "tpu").
      collectives: every collective of one step, compiled beside planned.
      mismatches: each difference between the compiled step and its policy.
      notes: differences that are not the policy's to fix (known platform behaviour,
        collectives XLA moved out of a loop), and the kinds passed as `allow`.
      temp_bytes: the compiled program's temporary memory per device (None where no
        program is compiled: `torch_frontend.check`).
      gathered_bytes: the gathered parameters the policy holds at once per device (the
        largest resharded unit's plus every kept unit's): the part of `temp_bytes`
        FSDP controls; activations and gradients make up the rest.
      compiled: the compiled step the report was read from (a `jax.stages.Compiled`):
        call it with the arguments' values to run the step without compiling it again.
    """

    mesh_shape: tuple[tuple[str, int], ...]
    platform: str
    collectives: tuple[CheckedCollective, ...]
    mismatches: tuple[Mismatch, ...]
    notes: tuple[Mismatch, ...]
    temp_bytes: int | None
    gathered_bytes: int
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Whether the compiled step matches its policy (no mismatch)."""
        return not self.mismatches

    def table(self) -> str:
        """The report as plain text: a verdict, the collectives, mismatches and notes."""
        axes = ", ".join(f"{a}={s}" for a, s in self.mesh_shape)
        verdict = (
            "✓ the compiled step matches its policy"
            if self.ok
            else f"✗ {len(self.mismatches)} mismatch{'es' if len(self.mismatches) > 1 else ''}"
        )
        lines = [f"funshard check: mesh ({axes}) on {self.platform}: {verdict}", ""]
        lines += text_table("collectives per step", *_rows(self.collectives))
        for title, found, mark in (
            ("mismatches", self.mismatches, "✗"),
            ("notes", self.notes, "·"),
        ):
            if found:
                lines += ["", title]
                lines += [f"  {mark} {m.kind}: {m.explanation}" for m in found]
        held = f"gathered parameters at once per the policy: {human(self.gathered_bytes)}"
        if self.temp_bytes is not None:
            held = f"temp memory per device: {human(self.temp_bytes)} compiled; {held}"
        lines += ["", held]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(self.table())

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        head, rest = self.table().split("\n", 1)
        headers, rows = _rows(self.collectives)
        table = Table(title="collectives per step", title_justify="left")
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i < 4 else "right")
        for row, c in zip(rows, self.collectives, strict=True):
            table.add_row(*row, style=None if _status(c) == "ok" else "bold")
        tail = rest.split("\n\n", 2)[-1] if "\n\n" in rest else ""
        style = "bold green" if self.ok else "bold red"
        return Group(Text(head, style=style), table, Text(tail))


def _status(c: CheckedCollective) -> str:
    if c.unit is None:
        return "not declared" if c.role == "loss" else "-"
    return "ok" if c.times == c.planned_times else f"planned {c.planned_times}"


def _rows(found: tuple[CheckedCollective, ...]) -> tuple[list[str], list[list[str]]]:
    headers = ["collective", "unit", "role", "axes", "dtype", "bytes", "per step", "check"]
    rows = [
        [
            c.kind,
            c.unit or (c.source or "-").rsplit("/", 1)[-1],
            c.role,
            ",".join(c.axes) if c.axes is not None else "?",
            c.dtype,
            human(c.bytes),
            str(c.times),
            _status(c),
        ]
        for c in found
    ]
    return headers, rows


# ---- the declared side --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Unit:
    """What `_plan._unit_collectives` reads of a unit."""

    name: str
    reshard_after_forward: bool | int
    layers: int | None


def _declared(recording: Any) -> list[_plan.Collective]:
    """The collectives the recorded steps declare."""
    out: list[_plan.Collective] = []
    for traced in recording.steps:
        for call in traced.units:
            layout = call.layout
            replicas = comm.axes_size(traced.mesh, layout.replicate_axes)
            unit = _Unit(call.name, call.reshard_after_forward, call.layers)
            dims = (layout.num_shards, replicas)
            out += _plan._unit_collectives(unit, layout, traced.opts, dims)
        reduced = traced.reduced
        if reduced is not None:
            dims = (reduced.num_shards, comm.axes_size(traced.mesh, reduced.replicate_axes))
            for c in _plan._step_collectives([reduced], traced.opts, dims):
                # The step's own reductions after its microbatch loop, labelled "root".
                out.append(dataclasses.replace(c, unit="root", axes=reduced.shard_axes))
    return out


def _same_wire(kind: str, declared: str, compiled: str) -> bool:
    """Whether a compiled dtype is the declared one; funshard packs an all-gather's
    leaves into one buffer of unsigned words of their width (bytes are checked apart)."""
    return declared == compiled or (kind == "all-gather" and compiled in ("u8", "u16", "u32"))


def _hlo_dtype(label: str) -> str | None:
    names = [_HLO_DTYPES.get(part) for part in label.split("+")]
    return "+".join(sorted(n for n in names if n)) if all(names) else None


# ---- comparing ----------------------------------------------------------------------------


def _key(c: Any) -> tuple[str | None, str, str]:
    return (c.unit, c.kind, c.role)


def _layers_of(recording: Any) -> dict[str, int]:
    return {
        call.name: call.layers
        for traced in recording.steps
        for call in traced.units
        if call.layers is not None
    }


def _compiled_times(c: StepCollective, layers: dict[str, int]) -> int:
    """Executions per step; a stack's prefetch sits in a branch that runs on every trip
    but the last, which the HLO reader counts on every trip."""
    n = layers.get(c.unit or "")
    if c.conditional and n and c.times % n == 0:
        return c.times // n * (n - 1)
    return c.times


def _compare(
    declared: list[_plan.Collective],
    compiled: list[StepCollective],
    layers: dict[str, int],
    data_axes: set[str],
    platform: str,
    lowered: Counter,
) -> tuple[list[CheckedCollective], list[Mismatch], list[Mismatch]]:
    planned: dict[tuple, Counter] = {}
    planned_dtype: dict[tuple, str | None] = {}
    for p in declared:
        planned.setdefault(_key(p), Counter())[p.bytes] += p.times
        planned_dtype[_key(p)] = _hlo_dtype(p.dtype)
    ran: dict[tuple, Counter] = {}
    compiled_regathers = _regathers(compiled)
    first: dict[tuple, StepCollective] = {}
    rows, mismatches, notes = [], [], []
    others: Counter = Counter()  # collectives funshard did not issue, alike ones summed
    for c in compiled:
        if c.unit is None:
            others[dataclasses.replace(c, times=0)] += c.times
            continue
        times = _compiled_times(c, layers)
        ran.setdefault(_key(c), Counter())[c.bytes] += times
        first.setdefault(_key(c), c)
    for c, times in others.items():
        c = dataclasses.replace(c, times=times)
        rows.append(_row(c, times, 0, None))
        # Reductions and gathers over a data axis are FSDP's business; an all_to_all
        # (expert dispatch) or a permute never is.
        reducing = c.kind in ("all-reduce", "all-gather", "reduce-scatter")
        if c.role == "loss" and reducing and c.axes is not None and data_axes & set(c.axes):
            mismatches.append(_unplanned(c))
    for key in sorted(set(planned) | set(ran), key=lambda k: tuple(map(str, k))):
        want, got = planned.get(key, Counter()), ran.get(key, Counter())
        dtype = planned_dtype.get(key)
        seen = first.get(key)
        ratio = _cpu_widening(key[1], dtype, seen.dtype if seen else None, platform)
        widened = ratio > 1
        if widened:
            got = Counter({size // ratio: n for size, n in got.items()})
            notes.append(_widened(key, dtype, seen.dtype if seen else "?"))
        other_dtype = (
            not widened
            and seen is not None
            and dtype is not None
            and not _same_wire(key[1], dtype, seen.dtype)
        )
        if other_dtype:
            assert seen is not None and dtype is not None
            mismatches.append(_other_dtype(key, dtype, seen.dtype, _total(want), _total(got)))
        if key[1] == "all-reduce" and _total(want) == _total(got):
            # XLA combines all-reduces into tuple-shaped ones (and funshard's per-leaf
            # ones of a step into one per dtype): only their bytes are comparable.
            want = got
        for size in sorted(set(want) | set(got)):
            rows.append(
                CheckedCollective(
                    kind=key[1],
                    unit=key[0],
                    role=key[2],
                    axes=seen.axes if seen else None,
                    dtype=seen.dtype if seen else (dtype or "?"),
                    bytes=size * ratio,
                    times=got[size],
                    planned_times=want[size],
                    planned_dtype=dtype,
                )
            )
        removed = {s for s in want if compiled_regathers[(key[0], s)] < lowered[(key[0], s)]}
        found = _differences(key, want, got, removed)
        for m in found if not other_dtype else [m for m in found if m.kind != "bytes"]:
            (notes if m.kind in ("hoisted", "unneeded") else mismatches).append(m)
    return rows, mismatches, notes


def _row(c: StepCollective, times: int, planned: int, dtype: str | None) -> CheckedCollective:
    return CheckedCollective(
        c.kind, c.unit, c.role, c.axes, c.dtype, c.bytes, times, planned, dtype, c.source
    )


def _unplanned(c: StepCollective) -> Mismatch:
    what = {"all-reduce": "a psum", "all-gather": "an all_gather"}.get(c.kind, f"a {c.kind}")
    where = f" written at {c.source}" if c.source else ""
    return Mismatch(
        "unplanned",
        None,
        c.kind,
        c.bytes * c.times,
        f"{c.kind} over {_axes(c.axes)}{where}: {human(c.bytes)} x {c.times} per step that "
        f"no policy asked for ({what} in the loss over a data axis). fs.value_and_grad "
        "already averages the loss and reduces the gradients over the data axes; remove "
        "it, or pass allow=('unplanned',) if the loss needs it (a token count summed "
        "over the batch).",
        c.source,
    )


def _axes(axes: tuple[str, ...] | None) -> str:
    return "mesh axes " + ",".join(axes) if axes else "groups that are no set of mesh axes"


def _cpu_widening(kind: str, declared: str | None, compiled: str | None, platform: str) -> int:
    """How many times wider XLA's CPU backend runs a collective than declared (1: not).

    It reduces 16-bit floats in f32, and moves float8 values as f16.
    """
    if platform != "cpu" or declared is None or compiled is None:
        return 1
    if declared in ("bf16", "f16") and compiled == "f32" and kind != "all-gather":
        return 2
    if declared.startswith("f8") and compiled == "f16":
        return 2
    return 1


def _widened(key: tuple, dtype: str | None, compiled: str) -> Mismatch:
    return Mismatch(
        "platform",
        key[0],
        key[1],
        0,
        f"unit {key[0]!r}: its {key[1]} ({key[2]}) is declared in {dtype} and runs in "
        f"{compiled}: XLA's CPU backend reduces 16-bit floats in f32 and moves float8 as "
        f"f16. A GPU or TPU runs it in {dtype}; not a mismatch.",
    )


def _other_dtype(key: tuple, want: str, got: str, planned: int, compiled: int) -> Mismatch:
    return Mismatch(
        "dtype",
        key[0],
        key[1],
        max(compiled - planned, 0),
        f"unit {key[0]!r}: its {key[1]} ({key[2]}) runs in {got} ({human(compiled)} per "
        f"step), but its policy declares {want} ({human(planned)}). Check the unit's "
        "MixedPrecisionPolicy and its own collectives (fs.AllGather / fs.ReduceScatter).",
    )


def _total(sizes: Counter) -> int:
    return sum(size * times for size, times in sizes.items())


def _regathers(found: list) -> Counter:
    """(unit, bytes) -> backward all-gather instructions (not executions)."""
    return Counter(
        (c.unit, c.bytes) for c in found if c.kind == "all-gather" and c.role == "backward"
    )


def _differences(key: tuple, want: Counter, got: Counter, removed: set[int]) -> list[Mismatch]:
    """The mismatches of one (unit, collective, role); `removed`: the sizes of which
    XLA's compiler removed backward re-gathers the lowered program still had."""
    unit, kind, role = key
    name = f"unit {unit!r}: {kind} ({role})"
    total_want, total_got = sum(want.values()), sum(got.values())
    if kind == "all-reduce" and total_want:
        w, g = _total(want), _total(got)
        if g == w:
            return []
        loop = (
            f" ({g // w}x: the step runs it inside a loop of its own)"
            if g > w and g % w == 0
            else ""
        )
        return [
            Mismatch(
                "multiplied" if g > w else "missing",
                unit,
                kind,
                abs(g - w),
                f"{name} moves {human(g)} per step where its policy declares {human(w)}{loop}.",
            )
        ]
    if not total_want:
        return [
            Mismatch(
                "unplanned",
                unit,
                kind,
                sum(s * n for s, n in got.items()),
                f"{name} runs {total_got} times per step, but the step declares none.",
            )
        ]
    if total_got and total_got == total_want and set(want) != set(got):
        extra = sum(s * n for s, n in got.items()) - sum(s * n for s, n in want.items())
        return [
            Mismatch(
                "bytes",
                unit,
                kind,
                abs(extra),
                f"{name} moves {human(sum(s * n for s, n in got.items()))} per step, but "
                f"its policy declares {human(sum(s * n for s, n in want.items()))}.",
            )
        ]
    if total_got > total_want:
        factor = f" ({total_got // total_want}x)" if total_got % total_want == 0 else ""
        extra = sum(s * n for s, n in got.items()) - sum(s * n for s, n in want.items())
        return [
            Mismatch(
                "multiplied",
                unit,
                kind,
                max(extra, 0),
                f"{name} runs {total_got} times per step where its policy declares "
                f"{total_want}{factor}: the step runs it inside a loop of its own (a "
                "hand-written accumulation loop around fs.value_and_grad?). Give "
                "fs.value_and_grad the whole batch with microbatches=k and "
                "sync_every_microbatch=False to reduce once per step.",
            )
        ]
    if total_got == total_want:
        return []
    short = sum(s * max(want[s] - got[s], 0) for s in want)
    counted = f"runs {total_got} of {total_want} declared times per step"
    if kind == "all-gather" and role == "backward":
        if not removed:
            return [
                Mismatch(
                    "unneeded",
                    unit,
                    kind,
                    0,
                    f"{name} {counted}: JAX left the others out of the program as dead "
                    "code (that backward needs no gathered parameters, e.g. the first "
                    "unit's, whose input gets no gradient); nothing is kept. Not a "
                    "mismatch.",
                )
            ]
        return [
            Mismatch(
                "kept",
                unit,
                kind,
                short,
                f"{name} {counted}: XLA reused the forward's gathered parameters "
                f"instead of gathering them again, so {human(short)} of them stay in "
                "memory from forward to backward, against reshard_after_forward=True.",
            )
        ]
    if kind == "all-gather" and role == "forward" and total_got:
        return [
            Mismatch(
                "hoisted",
                unit,
                kind,
                0,
                f"{name} {counted}: XLA moved it out of a loop (its input does not "
                "change between trips); not a mismatch.",
            )
        ]
    return [Mismatch("missing", unit, kind, short, f"{name} {counted}.")]


# ---- donation -----------------------------------------------------------------------------


def _device_bytes(tree: Any) -> int:
    """Bytes of the arrays of `tree` on one device (their shard where they have one)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = getattr(x, "shape", None)
        if shape is None:
            continue
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _donation(lowered: Any, unusable: list[str], step: Callable, args: tuple) -> list[Mismatch]:
    """Donation asked for but not usable (`unusable`: JAX's warnings), and, for a
    jitted step, arguments it returns updated without donating them."""
    args_info = lowered.args_info
    positional = args_info[0] if isinstance(args_info, tuple) and len(args_info) == 2 else ()
    donated = [a for a in jax.tree.leaves(args_info) if getattr(a, "donated", False)]
    out = []
    for message in unusable:
        # JAX's own finding: it knows the outputs it forwards and the inputs it drops.
        found = message.split("\n", 1)[0].removeprefix("Some donated buffers were not usable:")
        out.append(
            Mismatch(
                "donation",
                None,
                None,
                0,
                f"donated arguments the compiled step cannot reuse:{found} No output has "
                "the same shape, dtype and sharding; donate only what the step returns "
                "updated (JAX warned: 'Some donated buffers were not usable').",
            )
        )
    if donated or not hasattr(step, "lower") or _is_value_and_grad(step):
        return out  # donation is decided where the step is jitted
    outputs = lowered.out_info
    children = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for i, arg in enumerate(positional):
        leaves = jax.tree.leaves(arg)
        if not leaves:
            continue
        for child in children:
            same = jax.tree.structure(child) == jax.tree.structure(arg)  # type: ignore[operator]
            if same and all(
                (a.shape, a.dtype) == (b.shape, b.dtype)
                for a, b in zip(leaves, jax.tree.leaves(child), strict=True)
            ):
                size = _device_bytes(args[i]) if i < len(args) else 0
                out.append(
                    Mismatch(
                        "donation",
                        None,
                        None,
                        size,
                        f"argument {i} comes back updated ({human(size)} per device), but is "
                        "not donated, so the step holds the old and the new copy at once: "
                        f"jax.jit(step, donate_argnums={i}) (if that output is gradients, "
                        "not a new state, pass allow=('donation',)).",
                    )
                )
                break
    return out


def _is_value_and_grad(step: Callable) -> bool:
    """Whether `step` is a bare `fs.value_and_grad` step (under `jax.jit` or wraps)."""
    found: Any = step
    for _ in range(8):
        if found is None:
            break
        if getattr(found, "_funshard_value_and_grad", False):
            return True
        found = getattr(found, "__wrapped__", None)
    return False


# ---- the public function ------------------------------------------------------------------


def check_allow(allow: Collection[str]) -> None:
    """Raises `ShardingValueError` unless `allow` is a collection of mismatch kinds."""
    unknown = sorted(set(allow) - set(MISMATCH_KINDS))
    if isinstance(allow, str) or unknown:
        raise errors.ShardingValueError(
            f"check: allow={allow!r} names no mismatch kind; the kinds are "
            f"{', '.join(MISMATCH_KINDS)}."
        )


def check(
    step: Callable,
    *args: Any,
    strict: bool = False,
    allow: Collection[str] = (),
    **kwargs: Any,
) -> StepReport:
    """Checks a step's compiled collectives against the policy it declares, before it runs.

    Lowers and compiles `step` for the arguments given (nothing runs), lists every
    collective of the compiled program (kind, unit, mesh axes, dtype, bytes per execution,
    executions per step) and sets beside it what the step's policy declares: each
    `fs.fully_shard` unit's gathers and reduce-scatters, as `fs.plan` states them for its
    layout, `reshard_after_forward`, mixed precision and the step's microbatch options.

    Args:
      step: the function you would `jax.jit`: a `fs.value_and_grad` step, or a whole
        train step calling one (with optax, `fs.shard_optimizer` included), or a
        `jax.jit` of either (its `donate_argnums` are then checked too).
      *args: its arguments: arrays, `Sharded` states, or `jax.ShapeDtypeStruct`s.
      strict: raise `funshard.errors.PolicyMismatchError` listing every mismatch
        instead of returning a report that has some.
      allow: mismatch kinds to list as notes instead (e.g. `("unplanned",)` for a loss
        that sums a token count over the data axes on purpose).
      **kwargs: its keyword arguments.

    Returns:
      A `StepReport`: `.ok`, `.mismatches` (each with a one-line explanation),
      `.notes`, and `.table()` (also what `print(report)` shows).

    Raises:
      TypeError: `step` is not callable, traces no `fs.value_and_grad` step, or does not
        lower for these arguments (the message says what `check` expects).
      ValueError: `allow` names a kind that is not a mismatch kind.
      PolicyMismatchError: with `strict=True`, when the step does not match its policy.
    """
    if not callable(step):
        raise errors.ShardingTypeError(
            f"check: step must be the function you would jax.jit, not {type(step).__name__}."
        )
    check_allow(allow)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowered, recording, compiled, found = _lower_and_compile(step, args, kwargs)
    unusable = []
    for w in caught:
        if "donated buffers were not usable" in str(w.message):
            unusable.append(str(w.message))  # reported as a mismatch, not warned twice
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    mesh = recording.steps[0].mesh
    mesh_shape = tuple((str(a), int(s)) for a, s in mesh.shape.items())
    platform = mesh.devices.flat[0].platform
    moving = [c for c in found if c.axes != ()]
    data_axes = {
        a for traced in recording.steps for call in traced.units for a in call.layout.dp_axes
    } or {a for a, _ in mesh_shape}
    # The program as lowered, before XLA optimised it: which re-gathers JAX itself
    # left out as dead code, and which XLA's compiler removed.
    lowered_text = lowered.as_text(dialect="hlo", debug_info=True)
    rows, mismatches, notes = _compare(
        [c for c in _declared(recording) if c.group > 1],
        moving,
        _layers_of(recording),
        data_axes,
        platform,
        _regathers(step_collectives(lowered_text, mesh_shape)),
    )
    mismatches += _donation(lowered, unusable, step, args)
    allowed = [m for m in mismatches if m.kind in allow]
    mismatches = [m for m in mismatches if m.kind not in allow]
    memory = compiled.memory_analysis()
    report = StepReport(
        mesh_shape=mesh_shape,
        platform=platform,
        collectives=tuple(rows),
        mismatches=tuple(mismatches),
        notes=tuple(notes + allowed),
        temp_bytes=int(getattr(memory, "temp_size_in_bytes", 0) or 0),
        gathered_bytes=_gathered_at_once(recording),
        compiled=compiled,
    )
    if strict and mismatches:
        raise errors.PolicyMismatchError(
            "check: the compiled step does not match its policy:\n"
            + "\n".join(f"  {m.kind}: {m.explanation}" for m in mismatches)
        )
    return report


def _lower_and_compile(step: Callable, args: tuple, kwargs: dict) -> tuple:
    """(lowered, recording, compiled, its collectives) of `step` on the args."""
    lowered, recording = _lower(step, args, kwargs)
    if not recording.steps:
        raise errors.ShardingTypeError(
            "check: the step runs no fs.value_and_grad (or fs.grad) step, so it declares "
            "no policy to check. Pass the function you would jax.jit: a fs.value_and_grad "
            "step or a train step that calls one."
        )
    mesh = recording.steps[0].mesh
    mesh_shape = tuple((str(a), int(s)) for a, s in mesh.shape.items())
    compiled, _, found = _compile(lowered, mesh_shape, _unit_names(recording))
    return lowered, recording, compiled, found


def _lower(step: Callable, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    with core.recording() as recording:
        try:
            lowered = jitted.lower(*args, **kwargs)
        except errors.FunshardError:
            raise  # funshard's own errors already say what is wrong and how to fix it
        except (TypeError, ValueError) as e:
            raise errors.ShardingTypeError(
                f"check: the step does not lower for the arguments given ({e}). Pass the "
                "step and the arguments you would call it with: arrays, Sharded states or "
                "jax.ShapeDtypeStructs of the same structure."
            ) from e
    return lowered, recording


def _unit_names(recording: Any) -> set[str]:
    names = {call.name for traced in recording.steps for call in traced.units}
    return names | {"root"}  # the step's own reductions after its microbatch loop


def _compile(
    lowered: Any, mesh_shape: tuple, units: set[str]
) -> tuple[Any, str, list[StepCollective]]:
    """(the compiled step, its text, its collectives).

    A hit in JAX's persistent compilation cache hands back the executable of an earlier
    program of the same fingerprint, whose metadata (unit names) may be another
    program's: one that names units this step does not have is compiled again with the
    cache off.
    """
    compiled = lowered.compile()
    text = compiled.as_text()
    found = step_collectives(text, mesh_shape)
    if {c.unit for c in found if c.unit is not None} <= units:
        return compiled, text, found
    enabled = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined, unused-ignore]
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    text = compiled.as_text()
    return compiled, text, step_collectives(text, mesh_shape)


def _gathered_at_once(recording: Any) -> int:
    """The largest resharded unit's gather plus every kept one's, per device."""
    resharded, kept = 0, 0
    for traced in recording.steps:
        for call in traced.units:
            layout = call.layout if call.layers is None else call.layout.layer()
            size = _plan._gathered_bytes(layout.leaves, layout.num_shards)
            if call.reshard_after_forward is False:
                kept += size
            else:
                resharded = max(resharded, size * (2 if call.layers else 1))
    return resharded + kept
