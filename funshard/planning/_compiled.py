"""What a compiled step really runs: its collectives, read from the compiled HLO.

The compiled half of checking a step against its policy (issue: `fs.check`). Each
collective is attributed to the funshard unit whose scope names it (`funshard/<unit>/...`,
see `funshard.comm`), or, for one funshard did not issue, to the source line it was
written at (the module's stack-frame tables), so that a user's `lax.psum` in the loss
shows up with its file and line. Every figure is per device and per step: ops in loops
count once per trip.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
from collections.abc import Sequence

import jax

from funshard import _hlo

# Library code, looked through when naming where a collective was written: funshard
# (this file is funshard/planning/_compiled.py), JAX, and the installed packages.
_FUNSHARD = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = tuple(
    os.path.abspath(path) + os.sep
    for path in (
        _FUNSHARD,
        os.path.dirname(jax.__file__ or ""),
        *(sysconfig.get_paths()[name] for name in ("purelib", "platlib", "stdlib")),
    )
)


@dataclasses.dataclass(frozen=True)
class StepCollective:
    """One collective of a compiled step (one part of a combined, tuple-shaped one).

    Attributes:
      kind: "all-gather", "reduce-scatter", "all-reduce", "all-to-all" or
        "collective-permute".
      unit: the funshard unit whose scope names it, or None for a collective funshard
        did not label.
      role: for a unit's collective, "forward" or "backward" (all-gathers), "gradients"
        (reduce-scatters) or "replicas" (HSDP all-reduces); else "loss" (written in
        the loss, forward), "autodiff" (made by differentiating: the gradients of
        values kept whole, the transposes of the loss's collectives), "step" (XLA's
        partitioning of the train step's math around the loss, e.g. a gradient norm
        of sharded gradients) or "library" (written inside funshard, JAX or another
        installed package, e.g. the step's loss average).
      axes: the mesh axes it runs over (None: its groups match no set of axes).
      group: devices in each group.
      dtype: its element type.
      bytes: one execution's buffer (an all-gather's output, a reduce-scatter's input,
        an all-reduce's buffer).
      times: executions per step (while-loop trips multiplied in).
      conditional: whether it sits in a conditional branch (`times` is then the most
        it can run).
      source: "file:line (function)" of the user code it was written at, where the
        module's metadata has it.
    """

    kind: str
    unit: str | None
    role: str
    axes: tuple[str, ...] | None
    group: int
    dtype: str
    bytes: int
    times: int
    conditional: bool
    source: str | None = None


def step_collectives(text: str, mesh_shape: Sequence[tuple[str, int]]) -> list[StepCollective]:
    """Every collective a compiled step runs per device, attributed.

    Args:
      text: the compiled module's text (`compiled.as_text()`).
      mesh_shape: (axis name, size) of each axis of the step's mesh, in mesh order.

    Returns:
      One record per collective (per part of a combined one), in module order.
    """
    devices = 1
    for _, size in mesh_shape:
        devices *= size
    comps = _hlo.computations(text)
    mult, conditional, _ = _hlo.multiplicities(comps)
    frames = _hlo.stack_frames(text)
    out = []
    for name, lines in comps.items():
        for c in _hlo.parse_collectives(lines):
            groups = c.groups
            axes = _hlo.mesh_axes_of(groups, mesh_shape) if groups is not None else None
            group = c.group_size(devices)
            source = _hlo.source_of(c.frame, frames, _LIBRARIES)
            where = f"{source.file}:{source.line} ({source.function})" if source else None
            # Written by the user when the innermost frame is theirs (JAX leaves its own
            # frames out of the metadata; funshard's stay, and name its own collectives).
            written = source is not None and c.frame in frames and frames[c.frame] == source
            parts = _hlo.op_name_parts(c.op_name)
            # A combined op lists one op_name per operand: pair them with the results.
            arrays: list[tuple[tuple[str, str], ...]] = [(part,) for part in c.arrays]
            if len(parts) == 1:  # combined ops of one name (a unit's HSDP all-reduces)
                parts = parts * len(arrays)
            elif len(parts) != len(arrays):
                parts, arrays = [c.op_name], [c.arrays]
            for op_name, part in zip(parts, arrays, strict=True):
                scope = _hlo.funshard_scope(op_name)
                # A combined op keeps the stack frame of its first part only.
                same = op_name == parts[0]
                here, mine = (where, written) if same else (None, False)
                nbytes = sum(_hlo.dtype_bytes(dt) * _elements(dims) for dt, dims in part)
                if c.kind == "reduce-scatter":
                    nbytes *= group
                out.append(
                    StepCollective(
                        kind=c.kind,
                        unit=scope[0] if scope else None,
                        role=_role(c.kind, op_name, scope, mine),
                        axes=axes,
                        group=group,
                        dtype="+".join(sorted({dt for dt, _ in part})),
                        bytes=nbytes,
                        times=mult.get(name, 1),
                        conditional=name in conditional,
                        source=here,
                    )
                )
    return out


def _elements(dims: str) -> int:
    count = 1
    for d in dims.split(","):
        if d:
            count *= int(d)
    return count


def _role(kind: str, op_name: str, scope: tuple[str, str] | None, written: bool) -> str:
    if scope is not None:
        if scope[1] == "all_gather":
            return "backward" if _hlo.is_backward(op_name) else "forward"
        return "gradients" if kind == "reduce-scatter" else "replicas"
    if _hlo.is_backward(op_name):
        return "autodiff"
    if "shard_map" not in op_name:
        # Partitioned by XLA around the step's shard_map: the train step's own math on
        # sharded arrays (a gradient norm, an optimizer's statistics).
        return "step"
    return "loss" if written else "library"
