"""Collectives under control flow that differs between devices: a clear error, never a mix.

Inside the root every device runs the loss on its own rows. A `lax.cond` / `lax.switch`
whose predicate reads the batch, or a `lax.while_loop` whose trip count does, can then
take different branches (or iteration counts) on different devices. A collective inside
such a branch (a unit's all-gather, its gradient's reduce-scatter, a user's `psum`) is
entered by some devices and not by others, so XLA pairs it with whatever collective the
others run next: the numbers match no assignment of branches to devices, or the program
hangs. JAX's varying-axes typing says which values differ between devices, so the root
reads the traced program of each microbatch and refuses it at trace time when a
collective over an axis sits under a predicate that varies over that axis. Control flow
whose predicate is the same on every device (computed from replicated values, or made so
with `jax.lax.pmax` over the data axes) is untouched.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from funshard import _jax_compat, errors

# Primitives that exchange data between devices (jax.lax's parallel operators, in their
# jax 0.10 names). `axis_index` and the varying-type casts move nothing.
_COMMUNICATING = frozenset(
    {
        "all_gather",
        "all_gather_invariant",
        "all_gather_reduced",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "unreduced_reduce_scatter",
        "psum",
        "psum_invariant",
        "unreduced_psum",
        "pmax",
        "pmin",
        "ppermute",
        "psend",
        "precv",
        "pbroadcast",
    }
)
_UNIT = re.compile(r"funshard/([^()]+?)/(?:all_gather|reduce_scatter)")


@dataclasses.dataclass(frozen=True)
class _Branching:
    """One control-flow equation whose predicate varies over some axes."""

    kind: str  # "lax.cond / lax.switch" or "lax.while_loop"
    axes: frozenset[str]
    where: str  # the user's source line of the control flow


def _axes_of(eqn: Any) -> frozenset[str]:
    """The mesh axes a communicating equation runs over."""
    for name in ("axes", "axis_name"):
        axes = eqn.params.get(name)
        if axes is not None:
            return frozenset(axes if isinstance(axes, (tuple, list)) else (axes,))
    return frozenset()


def sub_jaxprs(eqn: Any) -> Iterator[Any]:
    """Every jaxpr among an equation's parameters (branches, bodies, nested calls)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)
            if hasattr(jaxpr, "eqns"):
                yield jaxpr


def _collectives(jaxpr: Any) -> Iterator[Any]:
    """The communicating equations of `jaxpr`, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _COMMUNICATING:
            yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _collectives(sub)


def _branching(eqn: Any) -> tuple[_Branching | None, list[Any]]:
    """(what varies, the jaxprs it guards) for a cond or while equation, else (None, [])."""
    name = eqn.primitive.name
    if name == "cond":
        axes = _jax_compat.aval_varying_axes(eqn.invars[0].aval)
        guarded = [b.jaxpr for b in eqn.params["branches"]]
        kind = "lax.cond / lax.switch"
    elif name == "while":
        cond = eqn.params["cond_jaxpr"].jaxpr
        axes = _jax_compat.aval_varying_axes(cond.outvars[0].aval)
        guarded = [cond, eqn.params["body_jaxpr"].jaxpr]
        kind = "lax.while_loop"
    else:
        return None, []
    if not axes:
        return None, []
    return _Branching(kind, frozenset(axes), _jax_compat.source_line(eqn)), guarded


def _first_conflict(jaxpr: Any) -> tuple[_Branching, list[Any]] | None:
    """The first control flow that guards collectives over an axis its predicate varies
    over, with those collectives; None if there is none."""
    for eqn in jaxpr.eqns:
        branching, guarded = _branching(eqn)
        if branching is not None:
            hits = [c for sub in guarded for c in _collectives(sub) if _axes_of(c) & branching.axes]
            if hits:
                return branching, hits
        for sub in sub_jaxprs(eqn):
            found = _first_conflict(sub)
            if found is not None:
                return found
    return None


def _describe(collectives: list[Any]) -> str:
    """What the collectives are, in the user's terms: units' gathers, plain collectives."""
    units, others = [], []
    for c in collectives:
        match = _UNIT.search(str(c.source_info.name_stack))
        if match:
            units.append(repr(match.group(1)))
        else:
            name = c.primitive.name.removesuffix("_invariant")
            others.append(f"a {name} over {sorted(_axes_of(c))}")
    parts = []
    if units:
        names = ", ".join(dict.fromkeys(units))
        parts.append(f"the all-gathers / reduce-scatters of unit {names}")
    parts.extend(dict.fromkeys(others))
    return " and ".join(parts)


def _varying_control_flow(fn: str, branching: _Branching, collectives: list[Any]) -> str:
    axes = ", ".join(repr(a) for a in sorted(branching.axes))
    return (
        f"{fn}: a {branching.kind} (at {branching.where}) whose predicate differs "
        f"between devices guards {_describe(collectives)}. The predicate varies over the "
        f"data axes {axes}, typically because it reads this device's rows of the batch. "
        "Devices would take different branches, so their collectives would pair with "
        "other collectives and the results would be wrong. Make the predicate the same "
        "on every device (compute it from replicated values, or reduce it first, e.g. "
        f"`jax.lax.pmax(pred, {tuple(sorted(branching.axes))})`), or call every branch's "
        "units unconditionally and select between their outputs with jnp.where."
    )


def check(jaxpr: Any, fn: str = "value_and_grad") -> None:
    """Raises if `jaxpr` (a step's traced microbatch) runs a collective under control flow
    whose predicate varies over that collective's axes.

    Args:
      jaxpr: the microbatch's jaxpr, traced inside the root's `shard_map`.
      fn: the public function to name in the message.

    Raises:
      ShardingValueError: naming the unit (or collective), the control flow's source
        line, the axes its predicate varies over, and how to fix it.
    """
    found = _first_conflict(jaxpr)
    if found is not None:
        raise errors.ShardingValueError(_varying_control_flow(fn, *found))
