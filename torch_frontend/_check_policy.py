"""What FSDP2's policy declares for one step of an FSDP module, and the comparison.

The declared side is the policy as each parameter group holds it after the step's lazy
initialisation (`declared`): a gather per group in forward, a re-gather in backward
where `reshard_after_forward` frees the parameters, one reduce-scatter (and an HSDP
all-reduce) per group unless `set_requires_gradient_sync(False)`, in the mixed-precision
dtypes and with the frontend's flat-buffer sizes. `compare` sets what ran (`Ran`,
from `_check_ran`) beside it: the report's rows and its mismatches, each explained.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter

import torch

from funshard.planning import CheckedCollective, Mismatch, human
from torch_frontend import _bridge, _flat
from torch_frontend._check_ran import Ran, Units, label
from torch_frontend._group import FSDPParamGroup
from torch_frontend._param import FSDPParam

# Kinds whose run over the data-parallel ranks is FSDP's business (as `funshard.check`:
# an all_to_all, expert dispatch, never is).
_REDUCING = ("all-reduce", "all-gather", "reduce-scatter")


# ---- what the policy declares -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Planned:
    """One collective the policy declares, `times` per step."""

    kind: str
    unit: str
    role: str
    axes: tuple[str, ...] | None
    dtype: str
    bytes: int
    times: int = 1


def _regather_world(group: FSDPParamGroup) -> int | None:
    """The ranks of the backward's re-gather (the world, or hpZ's k); None: none."""
    k, world = group.reshard_after_forward, group.layout.world
    if k is True or k == world:
        return world
    if k is not False and k > 1:
        return k
    return None


def _gather_sizes(group: FSDPParamGroup) -> list[tuple[int, torch.dtype]]:
    """(bytes, dtype) of each flat buffer of the group's all-gather (the gathered output)."""
    params = group.fsdp_params
    dtypes = [group.param_dtype(p) for p in params]
    blocks = [p._padded_shape() for p in params]
    world = group.layout.world
    return [(world * b.total * b.dtype.itemsize, b.dtype) for b in _flat.buckets(dtypes, blocks)]


def _gathers(group: FSDPParamGroup, unit: str, role: str) -> list[Planned]:
    sizes = _gather_sizes(group)
    if group.custom_all_gather is not None:  # the user's collective, once per buffer
        return [Planned("all-gather", unit, role, None, label([d]), b) for b, d in sizes]
    dtype = label([d for _, d in sizes])
    axes = group.layout.shard_axes
    return [Planned("all-gather", unit, role, axes, dtype, sum(b for b, _ in sizes))]


def _hpz_regather(group: FSDPParamGroup, unit: str, k: int) -> Planned:
    """hpZ's re-gather: one operand per parameter, its padded full tensor (`keep_part`)."""
    world, sizes, dtypes = group.layout.world, 0, []
    for p in group.fsdp_params:
        dtype = group.param_dtype(p)
        shape = p._padded_shape()
        shape[p.dim] *= world
        sizes += math.prod(shape) * dtype.itemsize
        dtypes.append(_flat.crossing_dtype(dtype))
    return Planned("all-gather", unit, "backward", (_bridge.HPZ_INNER_AXIS,), label(dtypes), sizes)


def _reductions(group: FSDPParamGroup, unit: str, reduced: list[FSDPParam]) -> list[Planned]:
    """The group's reduce-scatter (one per buffer for a custom one), its HSDP all-reduce,
    and the torch all-reduces of 64-bit gradients."""
    layout, world = group.layout, group.layout.world
    all_reduce = group.all_reduce_grads or not layout.replicate_axes
    custom = group.custom_reduce_scatter is not None
    totals: dict[torch.dtype, int] = {}
    out = []
    for p in reduced:
        dtype = group.reduce_dtype(p)
        block = math.prod(_flat.block_shape(p.shape, p.dim, world))
        if block and dtype.itemsize == 8 and not custom:
            shape = list(p.shape)
            shape[p.dim] = layout.padded_size(p.rows)
            size = math.prod(shape) * dtype.itemsize
            out.append(Planned("all-reduce", unit, "gradients", None, label([dtype]), size))
            mesh = group.device_mesh
            if all_reduce and mesh is not None and mesh.ndim > 1:
                out.append(Planned("all-reduce", unit, "replicas", None, label([dtype]), size))
        elif block or custom:
            totals[dtype] = totals.get(dtype, 0) + block
    if custom:
        return out + [
            Planned("reduce-scatter", unit, "gradients", None, label([d]), world * n * d.itemsize)
            for d, n in totals.items()
        ]
    if not totals:
        return out
    size = 0
    for dtype, n in totals.items():
        align = _bridge.row_align(layout, dtype)
        size += world * (-(-n // align) * align) * dtype.itemsize
    dtype_label = label(list(totals))
    out.append(Planned("reduce-scatter", unit, "gradients", layout.shard_axes, dtype_label, size))
    if all_reduce and layout.replicate_axes:
        replicas = layout.replicate_axes
        out.append(Planned("all-reduce", unit, "replicas", replicas, dtype_label, size // world))
    return out


def declared(
    units: Units, gathered_before: set[FSDPParamGroup], without_grad: dict[str, set[str]]
) -> list[Planned]:
    """The collectives FSDP2's policy implies for one forward and backward of the model.

    Args:
      units: the groups.
      gathered_before: groups gathered when the step began (no forward gather).
      without_grad: by unit, the parameters that got no gradient (left out of its
        reduce-scatter, as the records say).
    """
    out: list[Planned] = []
    for group in units.groups:
        if not group.fsdp_params:
            continue
        unit = units.name(group)
        trainable = [p for p in group.fsdp_params if p.sharded_param.requires_grad]
        if group not in gathered_before:
            out += _gathers(group, unit, "forward")
        k = _regather_world(group)
        # A frozen group is gathered again too where a gradient flows through its module.
        if group.unshard_in_backward and k is not None:
            world = group.layout.world
            out += (
                _gathers(group, unit, "backward") if k == world else [_hpz_regather(group, unit, k)]
            )
        if trainable and group.reduce_grads:
            skipped = without_grad.get(unit, set())
            reduced = [p for p in trainable if p._param_fqn not in skipped]
            out += _reductions(group, unit, reduced)
    return out


def gathered_at_once(units: Units) -> int:
    """The largest resharded group's gather plus every kept group's, per rank."""
    resharded, kept = 0, 0
    for group in units.groups:
        if not group.fsdp_params:
            continue
        size = sum(b for b, _ in _gather_sizes(group))
        if _regather_world(group) is None:
            kept += size
        else:
            resharded = max(resharded, size)
    return resharded + kept


# ---- comparing ----------------------------------------------------------------------------


def compare(
    planned: list[Planned], ran: list[Ran], peers: set[int], units: Units | None = None
) -> tuple[list, list]:
    """(rows, mismatches): each collective beside its plan, and the differences.

    Rows come unit by unit in the model's order, forward to gradients within each.
    Mismatches of kind "unneeded" are notes (`check` moves them).
    """
    order = [] if units is None else [units.name(g) for g in units.groups]
    frozen = set() if units is None else units.frozen()
    checked = CheckedCollective
    want: dict[tuple, Counter] = {}
    want_dtype: dict[tuple, str] = {}
    for p in planned:
        want.setdefault((p.unit, p.kind, p.role), Counter())[p.bytes] += p.times
        want_dtype[(p.unit, p.kind, p.role)] = p.dtype
    got: dict[tuple, Counter] = {}
    first: dict[tuple, Ran] = {}
    others: Counter = Counter()  # collectives of no group's plan, alike ones summed
    rows, mismatches = [], []
    for r in ran:
        if r.unit is None or r.role == "library":
            others[r] += 1
            continue
        got.setdefault((r.unit, r.kind, r.role), Counter())[r.bytes] += 1
        first.setdefault((r.unit, r.kind, r.role), r)
    for r, times in others.items():
        rows.append(
            checked(r.kind, r.unit, r.role, r.axes, r.dtype, r.bytes, times, 0, None, r.source)
        )
        if r.unit is not None:
            continue  # the module's all-reduce hook, or another collective it asked for
        if r.role == "library":
            mismatches.append(_unknown(r, times))
        elif r.kind in _REDUCING and (r.ranks is None or len(peers & set(r.ranks)) > 1):
            mismatches.append(_unplanned(r, times))
    for key in sorted(set(want) | set(got), key=functools.partial(_order, order)):
        planned_times, ran_times = want.get(key, Counter()), got.get(key, Counter())
        seen, dtype = first.get(key), want_dtype.get(key)
        for size in sorted(set(planned_times) | set(ran_times)):
            rows.append(
                checked(
                    kind=key[1],
                    unit=key[0],
                    role=key[2],
                    axes=seen.axes if seen else _axes_of(planned, key),
                    dtype=seen.dtype if seen else (dtype or "?"),
                    bytes=size,
                    times=ran_times[size],
                    planned_times=planned_times[size],
                    planned_dtype=dtype,
                )
            )
        found = _differences(key, planned_times, ran_times, dtype, seen)
        if key[0] in frozen and key[1:] == ("all-gather", "backward"):
            found = [_unneeded(key[0]) if m.kind == "missing" else m for m in found]
        mismatches += found
    return rows, mismatches


_ROLES = ("forward", "backward", "gradients", "replicas")


def _order(units: list[str], key: tuple) -> tuple:
    unit, kind, role = key
    at = units.index(unit) if unit in units else len(units)
    return (at, _ROLES.index(role) if role in _ROLES else len(_ROLES), kind, str(unit))


def _axes_of(planned: list[Planned], key: tuple) -> tuple[str, ...] | None:
    return next((p.axes for p in planned if (p.unit, p.kind, p.role) == key), None)


def _differences(
    key: tuple, want: Counter, got: Counter, dtype: str | None, seen: Ran | None
) -> list:
    """The mismatches of one (unit, collective, role)."""
    mismatch = Mismatch
    unit, kind, role = key
    name = f"unit {unit!r}: its {kind} ({role})"
    total_want, total_got = sum(want.values()), sum(got.values())
    bytes_want = sum(s * n for s, n in want.items())
    bytes_got = sum(s * n for s, n in got.items())
    found = []
    if seen is not None and dtype is not None and seen.dtype != dtype:
        found.append(
            mismatch(
                "dtype",
                unit,
                kind,
                max(bytes_got - bytes_want, 0),
                f"{name} runs in {seen.dtype} ({human(bytes_got)} in the step), but its "
                f"policy declares {dtype} ({human(bytes_want)}). Check the module's "
                "MixedPrecisionPolicy (param_dtype for gathers, reduce_dtype for gradients).",
            )
        )
    if not total_want:
        found.append(
            mismatch(
                "unplanned",
                unit,
                kind,
                bytes_got,
                f"{name} runs {total_got} times in the step, but its policy declares none"
                f"{_why_none(kind, role)}.",
            )
        )
    elif total_got == total_want:
        if set(want) != set(got) and not found:
            found.append(
                mismatch(
                    "bytes",
                    unit,
                    kind,
                    abs(bytes_got - bytes_want),
                    f"{name} moves {human(bytes_got)} in the step, but its policy declares "
                    f"{human(bytes_want)}.",
                )
            )
    elif total_got > total_want:
        factor = f" ({total_got // total_want}x)" if total_got % total_want == 0 else ""
        found.append(
            mismatch(
                "multiplied",
                unit,
                kind,
                max(bytes_got - bytes_want, 0),
                f"{name} runs {total_got} times in the step where its policy declares "
                f"{total_want}{factor}: {_why_more(role)}",
            )
        )
    else:
        found.append(
            mismatch(
                "missing",
                unit,
                kind,
                sum(s * max(want[s] - got[s], 0) for s in want),
                f"{name} runs {total_got} of {total_want} declared times in the step: "
                f"{_why_fewer(role)}",
            )
        )
    return found


def _why_none(kind: str, role: str) -> str:
    if kind == "reduce-scatter" or role in ("gradients", "replicas"):
        return (
            " (set_requires_gradient_sync(False) or set_requires_all_reduce(False) leaves "
            "gradients unreduced)"
        )
    if role == "backward":
        return " (reshard_after_forward=False keeps the gathered parameters for backward)"
    return ""


def _why_more(role: str) -> str:
    if role == "forward":
        return (
            "the module ran forward more than once in the step (the loss function called "
            "it again?), and each forward gathers its parameters again."
        )
    if role == "backward":
        return "its parameters were gathered again in backward more than once."
    return "its gradients were reduced more than once in one backward."


def _why_fewer(role: str) -> str:
    if role == "forward":
        return "its module did not run in forward (an unused module?)."
    if role == "backward":
        return "no gradient reached its module's output, so its backward did not run."
    return "its parameters got no gradient in the step."


def _unneeded(unit: str):
    return Mismatch(
        "unneeded",
        unit,
        "all-gather",
        0,
        f"unit {unit!r}: no gradient reached its module's output (its parameters are "
        "frozen and its input needs no gradient, e.g. a frozen first layer), so its "
        "backward needs no re-gather; nothing is kept. Not a mismatch.",
    )


def _unplanned(r: Ran, times: int):
    where = f" written at {r.source}" if r.source else ""
    ranks = ", ".join(map(str, r.ranks)) if r.ranks is not None else "unknown"
    return Mismatch(
        "unplanned",
        None,
        r.kind,
        r.bytes * times,
        f"torch.distributed.{r.function} ({r.kind}) over processes {ranks}{where}: "
        f"{human(r.bytes)} x {times} in the step that no policy asked for (a collective in "
        "the loss over the data-parallel ranks). FSDP already averages the gradients over "
        "those ranks; remove it, or pass allow=('unplanned',) if the loss needs it (a "
        "token count summed over the ranks).",
        r.source,
    )


def _unknown(r: Ran, times: int):
    return Mismatch(
        "unplanned",
        None,
        r.kind,
        r.bytes * times,
        f"torch_frontend ran {times} {r.kind}(s) of {human(r.bytes)} in the step that no "
        "parameter group's policy declares (a full_state_dict, clip_grad_norm_ or "
        "checkpoint inside the forward or the loss?); move it out of the step.",
    )
