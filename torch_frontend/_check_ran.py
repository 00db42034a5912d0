"""What one step of an FSDP module ran: every collective, read while the step runs.

The collectives come from two places:

- every collective the frontend submits is already recorded (`_recorder.Recorder`, for
  the ranks' agreement check); the records appended during the step are read
  (`recorded`), and the HSDP all-reduce, which runs inside a reduce-scatter's program,
  is noted with it;
- torch.distributed's collectives (a `dist.all_reduce` in the loss, the frontend's own
  64-bit gradient reductions and custom collectives) are wrapped for the step's duration
  (`TorchCollectives`).

`ran` turns both into `Ran` entries, named by the model's units (`Units`). Also the
dtype names of the report (`label`: XLA's, as `funshard.check` writes them).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from torch_frontend import _bridge, _recorder
from torch_frontend._fully_shard import FSDPModule
from torch_frontend._group import FSDPParamGroup

# torch.distributed's collectives, by the name `funshard.check` gives their kind.
_TORCH_KINDS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_into_tensor": "all-gather",
    "all_gather_object": "all-gather",
    "_all_gather_base": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "reduce_scatter_tensor": "reduce-scatter",
    "_reduce_scatter_base": "reduce-scatter",
    "all_to_all": "all-to-all",
    "all_to_all_single": "all-to-all",
    "broadcast": "broadcast",
    "broadcast_object_list": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "gather_object": "gather",
    "scatter": "scatter",
    "scatter_object_list": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
}
_FRONTEND_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OPERAND = re.compile(r"\(([\d, ]*)\)/-?\d+/([\w.]+)")
_HLO_PREFIXES = {"bfloat": "bf", "float": "f", "int": "s", "uint": "u", "complex": "c"}
_ROOT = "root"  # the unit name of the root module's groups


def _hlo_name(dtype: torch.dtype | str) -> str:
    """A dtype as XLA's HLO names it ("bf16", "f32", "s32"), as `funshard.check` reports."""
    name = str(dtype).removeprefix("torch.")
    if name == "bool":
        return "pred"
    found = re.fullmatch(r"(bfloat|float|uint|int|complex)(\d+)_?(\w*)", name)
    return f"{_HLO_PREFIXES[found[1]]}{found[2]}{found[3].replace('_', '')}" if found else name


def label(dtypes: Collection[torch.dtype | str]) -> str:
    """The dtypes' HLO names, sorted and joined by "+" (a buffer of several: "bf16+f32")."""
    return "+".join(sorted({_hlo_name(d) for d in dtypes})) or "?"


class Units:
    """The model's parameter groups, by the unit names of the report and record labels."""

    def __init__(self, model: FSDPModule) -> None:
        self.groups = model._fsdp_groups(recurse=True)
        self._root = set(model._get_fsdp_state()._fsdp_param_groups)
        # Records name a group by its label (`FSDPParamGroup.unshard`); set at lazy init.
        self.by_label: dict[str, FSDPParamGroup] = {}
        for group in reversed(self.groups):
            self.by_label[repr(group.name)] = group
            self.by_label[f"{group.name!r} (hpZ re-gather)"] = group

    def name(self, group: FSDPParamGroup) -> str:
        return _ROOT if group in self._root else group.name

    def frozen(self) -> set[str]:
        """The units none of whose parameters is trained."""
        trained = {
            self.name(g)
            for g in self.groups
            if any(p.sharded_param.requires_grad for p in g.fsdp_params)
        }
        return {self.name(g) for g in self.groups} - trained


# ---- what ran -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ran:
    """One collective of the step, as it ran (`CheckedCollective`'s fields, less counts)."""

    kind: str
    unit: str | None
    role: str
    axes: tuple[str, ...] | None
    dtype: str
    bytes: int
    source: str | None = None
    ranks: tuple[int, ...] | None = None  # a torch collective's processes
    function: str | None = None  # a torch collective's torch.distributed name


@dataclasses.dataclass(frozen=True)
class _TorchCall:
    """One torch.distributed collective called during the step."""

    function: str
    kind: str
    bytes: int
    dtype: str
    ranks: tuple[int, ...] | None
    process_group: Any
    phase: str
    owner: FSDPParamGroup | None  # the frontend's group that issued it, if any
    method: str | None  # the group's method it was issued in
    source: str | None


class TorchCollectives:
    """Wraps torch.distributed's collectives while the step runs, and restores them.

    Only the outermost call of a thread is recorded (`all_gather_object` calls
    `all_gather` inside).
    """

    def __init__(self) -> None:
        self.calls: list[_TorchCall] = []
        self._local = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> TorchCollectives:
        for module in (dist, distributed_c10d):
            for name, kind in _TORCH_KINDS.items():
                fn = getattr(module, name, None)
                if callable(fn):
                    self._saved.append((module, name, fn))
                    setattr(module, name, self._wrap(name, kind, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, kind: str, fn: Callable) -> Callable:
        try:
            names = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):  # no signature to read: the group only by keyword
            names = []
        at = names.index("group") if "group" in names else None

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            try:
                group = kwargs.get("group", args[at] if at is not None and at < len(args) else None)
                self.calls.append(_torch_call(name, kind, args, kwargs, group, sys._getframe(1)))
                return fn(*args, **kwargs)
            finally:
                self._local.inside = False

        return recorded


def _torch_call(
    name: str, kind: str, args: tuple, kwargs: dict, group: Any, frame: Any
) -> _TorchCall:
    size, dtype = _payload((*args, *kwargs.values()))
    try:
        ranks: tuple[int, ...] | None = tuple(
            dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        )
    except (RuntimeError, ValueError, AttributeError):
        ranks = None
    owner, method, source = _caller(frame)
    return _TorchCall(
        name, kind, size, dtype, ranks, group, _recorder.phase(), owner, method, source
    )


def _payload(values: tuple) -> tuple[int, str]:
    """(bytes, dtype) of the largest tensor or list of tensors among a call's arguments:
    an all-gather's output, a reduce-scatter's input, an all-reduce's buffer."""
    found: list[tuple[int, str]] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            group = [value]
        elif isinstance(value, (list, tuple)):
            group = [v for v in value if isinstance(v, torch.Tensor)]
        else:
            continue
        if group:
            found.append(
                (sum(t.numel() * t.element_size() for t in group), _hlo_name(group[0].dtype))
            )
    return max(found, key=lambda f: f[0]) if found else (0, "?")


def _caller(frame: Any) -> tuple[FSDPParamGroup | None, str | None, str | None]:
    """(the frontend group on the stack, its method, the nearest caller outside torch and
    the frontend as "file:line (function)")."""
    source = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_FRONTEND_DIR):
            owner = frame.f_locals.get("self")
            if isinstance(owner, FSDPParamGroup):
                return owner, frame.f_code.co_name, source
        elif source is None and not path.startswith(_TORCH_DIR):
            source = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return None, None, source


@contextlib.contextmanager
def recorded(recorder: _recorder.Recorder) -> Iterator[tuple[list, dict[int, bool]]]:
    """The records the frontend appends inside the block, and for each reduce-scatter
    (by its position among them) whether it all-reduced over the HSDP replicas.

    The recorder keeps its last records only; inside the block it keeps them all.
    """
    taken: list[_recorder.Record] = []
    all_reduced: dict[int, bool] = {}
    start_reduce_scatter = _bridge.start_reduce_scatter

    def noted(layout, fulls, dims=None, all_reduce=True):
        pending = start_reduce_scatter(layout, fulls, dims, all_reduce)
        all_reduced[recorder._count - 1 - start] = all_reduce and bool(layout.replicate_axes)
        return pending

    with recorder._lock:
        start, kept = recorder._count, recorder._records.maxlen
        recorder._records = collections.deque(recorder._records)
    _bridge.start_reduce_scatter = noted
    try:
        yield taken, all_reduced
    finally:
        _bridge.start_reduce_scatter = start_reduce_scatter
        with recorder._lock:
            records = list(recorder._records)
            taken.extend(records[len(records) - (recorder._count - start) :])
            recorder._records = collections.deque(records, maxlen=kept)


def _operands(text: str) -> list[tuple[int, str]]:
    """(bytes, dtype name) of each operand of a record (`Recorder.record`'s text)."""
    out = []
    for dims, dtype in _OPERAND.findall(text):
        shape = [int(d) for d in dims.replace(" ", "").split(",") if d]
        out.append((math.prod(shape) * getattr(torch, dtype).itemsize, dtype))
    return out


def ran(
    records: list, all_reduced: dict[int, bool], calls: list[_TorchCall], units: Units
) -> list[Ran]:
    """Every collective of the step: the frontend's records, then torch's calls."""
    out = []
    for i, record in enumerate(records):
        group = units.by_label.get(record.unit)
        operands = _operands(record.operands)
        size, dtype = sum(b for b, _ in operands), label([d for _, d in operands])
        if group is None:
            out.append(Ran(record.kind, None, "library", None, dtype, size))
            continue
        unit, layout = units.name(group), group.layout
        if record.kind == "reduce-scatter":
            out.append(Ran(record.kind, unit, "gradients", layout.shard_axes, dtype, size))
            if all_reduced.get(i):
                replicas = layout.replicate_axes
                out.append(
                    Ran("all-reduce", unit, "replicas", replicas, dtype, size // layout.world)
                )
            continue
        role = "backward" if record.phase == "backward" else "forward"
        hpz = record.unit.endswith("(hpZ re-gather)")
        axes = (_bridge.HPZ_INNER_AXIS,) if hpz else layout.shard_axes
        out.append(Ran(record.kind, unit, role, axes, dtype, size))
    return out + [_torch_ran(call, units) for call in calls]


def _torch_ran(call: _TorchCall, units: Units) -> Ran:
    owner = call.owner
    if owner is None:
        role = "backward" if call.phase == "backward" else "loss"
        return Ran(
            call.kind,
            None,
            role,
            None,
            call.dtype,
            call.bytes,
            call.source,
            call.ranks,
            call.function,
        )
    unit, kind = units.name(owner), call.kind
    if call.method == "_torch_reduce_scatter":  # 64-bit gradients, summed in torch
        mesh = owner.device_mesh
        replicas = mesh is not None and mesh.ndim > 1 and call.process_group is mesh.get_group(0)
        kind, role = "all-reduce", "replicas" if replicas else "gradients"
    elif call.method == "_custom_gather":
        kind, role = "all-gather", "backward" if call.phase == "backward" else "forward"
    elif call.method == "_custom_reduce_scatter":
        kind, role = "reduce-scatter", "gradients"
    else:  # the module's all-reduce hook, or another collective it asked for
        role = "library"
    return Ran(kind, unit, role, None, call.dtype, call.bytes, call.source, call.ranks)
