"""Collectives under control flow that differs between devices: a clear error, never a mix.

Inside the root every device runs the loss on its own rows. A `lax.cond` / `lax.switch`
whose predicate reads the batch, or a `lax.while_loop` whose trip count does, can then
take different branches (or iteration counts) on different devices. A collective inside
such a branch (a unit's all-gather, its gradient's reduce-scatter, a user's `psum`) is
entered by some devices and not by others, so XLA pairs it with whatever collective the
others run next: the numbers match no assignment of branches to devices, or the program
hangs. The root reads the traced program of each microbatch and refuses it at trace
time when a collective over an axis sits under a predicate that varies over that axis.
Control flow whose predicate is the same on every device (computed from replicated
values or from gathered parameters, or made so with `jax.lax.pmax` over the data axes)
is untouched.

Which values vary is a dataflow analysis over the program, bounded by JAX's
varying-axes types: the types alone would not do, since a unit's all-gather is typed
varying on purpose (so that its transpose is a reduce-scatter), yet every device holds
the same gathered parameter. A value varies over an axis when the type says it may and
something it is computed from does: the batch and the local shards do, a tiled
all-gather makes its input equal over the gathered axes, and a loop's carry varies
where any iteration makes it vary.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from typing import Any

from funshard import _jax_compat, comm, errors

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


# Primitives whose output may differ between devices although their inputs do not: the
# analysis takes their type as it is.
_DEVICE_DEPENDENT = (_COMMUNICATING - {"all_gather"}) | {"axis_index"}

Variation = dict  # a jaxpr variable -> the mesh axes its value varies over


def _axes_in(env: Variation, var: Any) -> frozenset[str]:
    if hasattr(var, "val"):  # a literal: the same everywhere
        return frozenset()
    return env.get(var, _jax_compat.aval_varying_axes(var.aval))


def _jaxpr_of(value: Any) -> Any:
    return getattr(value, "jaxpr", value)


def _loop_carry(body: Any, fixed: list, carry: list, extra: list | None = None) -> list:
    """The axes a loop's carry varies over after any number of iterations of `body`
    (inputs: `fixed`, the carry, then `extra`; outputs start with the new carry)."""
    while True:
        outs = _outputs(body, [*fixed, *carry, *(extra or [])])
        grown = [c | o for c, o in zip(carry, outs, strict=False)]
        if grown == carry:
            return carry
        carry = grown


def _sub_inputs(eqn: Any, env: Variation) -> list[tuple[Any, list | None]]:
    """Each jaxpr nested in `eqn` with the axes its inputs vary over (None: their types)."""
    ins = [_axes_in(env, v) for v in eqn.invars]
    name, p = eqn.primitive.name, eqn.params
    if name == "cond":
        return [(_jaxpr_of(b), ins[1:]) for b in p["branches"]]
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond, body = _jaxpr_of(p["cond_jaxpr"]), _jaxpr_of(p["body_jaxpr"])
        carry = _loop_carry(body, ins[nc : nc + nb], ins[nc + nb :])
        return [(cond, [*ins[:nc], *carry]), (body, [*ins[nc : nc + nb], *carry])]
    if name == "scan":
        consts, ncarry = _jax_compat.scan_counts(p)
        body = _jaxpr_of(p["jaxpr"])
        xs = ins[consts + ncarry :]
        carry = _loop_carry(body, ins[:consts], ins[consts : consts + ncarry], xs)
        return [(body, [*ins[:consts], *carry, *xs])]
    subs = list(sub_jaxprs(eqn))
    if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        return [(subs[0], ins)]  # a call: pjit, custom_vjp / custom_jvp, checkpoint
    return [(sub, None) for sub in subs]


def _outputs(jaxpr: Any, ins: list | None) -> list[frozenset[str]]:
    """The axes the outputs of `jaxpr` vary over, given its inputs' (None: their types)."""
    env = _variation(jaxpr, ins)
    return [_axes_in(env, v) for v in jaxpr.outvars]


def _variation(jaxpr: Any, ins: list | None) -> Variation:
    """The axes each variable of `jaxpr` varies over (its nested jaxprs' excluded)."""
    env: Variation = {}
    if ins is not None:
        env.update(zip(jaxpr.invars, ins, strict=True))
    for eqn in jaxpr.eqns:
        for var, axes in zip(eqn.outvars, _equation_outputs(eqn, env), strict=True):
            env[var] = axes & _jax_compat.aval_varying_axes(var.aval)
    return env


def _equation_outputs(eqn: Any, env: Variation) -> list[frozenset[str]]:
    name = eqn.primitive.name
    ins = [_axes_in(env, v) for v in eqn.invars]
    typed = [_jax_compat.aval_varying_axes(v.aval) for v in eqn.outvars]
    if name in _DEVICE_DEPENDENT or "callback" in name:
        return typed
    if name == "all_gather":
        if eqn.params.get("axis_index_groups") is not None:
            return typed
        return [ins[0] - _axes_of(eqn)]
    subs = _sub_inputs(eqn, env)
    if not subs:  # computed from its inputs alone
        return [frozenset().union(*ins)] * len(eqn.outvars)
    if name == "cond":  # either branch's outputs, chosen by the predicate
        branches = [_outputs(sub, sub_ins) for sub, sub_ins in subs]
        return [_predicate(eqn, env).union(*column) for column in zip(*branches, strict=True)]
    if name == "while":
        cond, (_, body_ins) = subs
        assert body_ins is not None, "a while loop's inputs are analysed"
        carry = body_ins[eqn.params["body_nconsts"] :]
        return [c | _outputs(*cond)[0] for c in carry]  # the trip count chooses the carry
    if name == "scan":  # the carry after any iteration, then each iteration's ys
        consts, ncarry = _jax_compat.scan_counts(eqn.params)
        body, body_ins = subs[0]
        assert body_ins is not None, "a scan's inputs are analysed"
        return body_ins[consts : consts + ncarry] + _outputs(body, body_ins)[ncarry:]
    if len(subs) == 1 and subs[0][1] is not None:
        outs = _outputs(*subs[0])
        if len(outs) == len(eqn.outvars):
            return outs
    return typed


def _predicate(eqn: Any, env: Variation) -> frozenset[str]:
    """The axes a cond's predicate varies over (none for funshard's own always-true
    predicates, which read the device's index)."""
    if comm.PRESENT_SCOPE in str(eqn.source_info.name_stack):
        return frozenset()
    return _axes_in(env, eqn.invars[0])


def _branching(eqn: Any, env: Variation) -> tuple[_Branching | None, list[tuple[Any, list | None]]]:
    """(what varies, the jaxprs it guards with their inputs' axes) for a cond or while
    equation, else (None, [])."""
    name = eqn.primitive.name
    if name == "cond":
        axes = _predicate(eqn, env)
        kind = "lax.cond / lax.switch"
    elif name == "while":
        axes = _outputs(*_sub_inputs(eqn, env)[0])[0]
        kind = "lax.while_loop"
    else:
        return None, []
    if not axes:
        return None, []
    return _Branching(kind, frozenset(axes), _jax_compat.source_line(eqn)), _sub_inputs(eqn, env)


def _first_conflict(jaxpr: Any, ins: list | None = None) -> tuple[_Branching, list[Any]] | None:
    """The first control flow that guards collectives over an axis its predicate varies
    over, with those collectives; None if there is none."""
    env = _variation(jaxpr, ins)
    for eqn in jaxpr.eqns:
        branching, guarded = _branching(eqn, env)
        if branching is not None:
            hits = [
                c for sub, _ in guarded for c in _collectives(sub) if _axes_of(c) & branching.axes
            ]
            if hits:
                return branching, hits
        for sub, sub_ins in _sub_inputs(eqn, env):
            found = _first_conflict(sub, sub_ins)
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
