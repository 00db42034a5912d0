"""How `plan` reads its `units` argument: key-path prefixes, and the leaves each selects.

A unit is named by the part of the parameter tree its `fs.fully_shard` function is
called on, written as a key-path prefix. Key entries compare by their name as a string
(a dict key, a sequence index, an attribute name), so `("layers", 0)`, `"layers.0"` and
`"['layers'][0]"` all select `params["layers"][0]`, and flax nnx state paths (which end
in `.value`) are selected by the same prefixes as the module tree. Prefixes may nest, as
FSDP2's units do: a leaf belongs to the unit with the longest prefix above it, so
`{"model": "", "block0": "blocks.0"}` gives the model's unit every parameter outside its
blocks.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Mapping
from typing import Any

from funshard import _text, comm, core, errors
from funshard.core import LeafRoute, Sharded

ROOT = "root"

_KEYSTR_PART = re.compile(r"\[(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\]|\.([^.\[\]]+)")


def key_name(entry: Any) -> str:
    """A key-path entry (`DictKey`, `SequenceKey`, `GetAttrKey`, ...) as a string."""
    for field in ("key", "idx", "name"):
        if hasattr(entry, field):
            return str(getattr(entry, field))
    return str(entry)


def _parse(text: str) -> tuple[str, ...] | None:
    """`"a.0"` or `"['a'][0]"` as `("a", "0")`; None if it is neither."""
    if not text:
        return ()  # the whole tree: the model's own unit
    if not text.startswith(("[", ".")):
        parts = tuple(text.split("."))
        return parts if all(parts) else None
    keys: list[str] = []
    pos = 0
    while pos < len(text):
        m = _KEYSTR_PART.match(text, pos)
        if not m:
            return None
        keys.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return tuple(keys)


def _as_prefix(unit: str, spec: Any) -> tuple[str, ...]:
    if isinstance(spec, str):
        parsed = _parse(spec)
        if parsed is not None:
            return parsed
    elif isinstance(spec, tuple) and all(
        (isinstance(k, (str, numbers.Integral)) and not isinstance(k, bool))
        or hasattr(k, "key")
        or hasattr(k, "idx")
        or hasattr(k, "name")
        for k in spec
    ):
        return tuple(key_name(k) for k in spec)
    raise errors.ShardingTypeError(_bad_prefix(unit, spec))


def _bad_prefix(unit, spec) -> str:
    return (
        f"plan: unit {unit!r} selects {spec!r}, which is not a key-path prefix; give a "
        "tuple of keys such as ('layers', 0), a string such as 'layers.0' or "
        "\"['layers'][0]\", or a non-empty list of those."
    )


def display(prefix: tuple[str, ...]) -> str:
    """A prefix as the dotted string users may also write it as."""
    return ".".join(prefix)


def _check_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise errors.ShardingTypeError(_bad_unit_name(name))
    if name == ROOT:
        raise errors.ShardingValueError(_bad_unit_name(name))


def _bad_unit_name(name) -> str:
    return (
        f"plan: unit names must be non-empty strings other than 'root' (the name of the "
        f"parameters in no unit), got {name!r}; name the unit e.g. 'block0'."
    )


def unit_specs(units: Any) -> list[tuple[str, list[tuple[str, ...]]]]:
    """`units` as `[(name, [prefix, ...]), ...]` in the order given."""
    if units is None:
        return []
    if isinstance(units, Mapping):
        specs = []
        for name, spec in units.items():
            _check_name(name)
            prefixes = spec if isinstance(spec, list) else [spec]
            if not prefixes:
                raise errors.ShardingTypeError(_bad_prefix(name, spec))
            specs.append((name, [_as_prefix(name, p) for p in prefixes]))
        return specs
    if isinstance(units, (list, tuple)):
        specs, seen = [], set()
        for spec in units:
            prefix = _as_prefix(str(spec), spec)
            name = display(prefix)
            _check_name(name)  # the whole tree ("") or a key called "root": name it
            if name in seen:
                raise errors.ShardingValueError(_duplicate_unit(name))
            seen.add(name)
            specs.append((name, [prefix]))
        return specs
    raise errors.ShardingTypeError(_units_type(units))


def _duplicate_unit(name: str) -> str:
    return (
        f"plan: units lists {name!r} twice; list each unit once (a list of prefixes, "
        "given as a mapping's value, makes one unit of several subtrees)."
    )


def _units_type(units) -> str:
    return (
        f"plan: units must be a mapping from unit name to key-path prefix, or a list of "
        f"prefixes, got {type(units).__name__}; e.g. units={{'block0': ('blocks', 0)}} "
        "or units=['blocks.0', 'blocks.1']."
    )


def reshard_by_unit(value: Any, names: list[str]) -> dict[str, bool | int]:
    """`reshard_after_forward` (one value, or a mapping by unit name) for each unit."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise errors.ShardingValueError(_unknown_units(unknown, names))
        for v in value.values():
            core.check_reshard_after_forward("plan", v)
        return {name: value.get(name, True) for name in names}
    core.check_reshard_after_forward("plan", value)
    return dict.fromkeys(names, value)


def collectives_by_unit(value: Any, names: list[str], arg: str, cls: type) -> dict[str, Any]:
    """A unit's own `all_gather` / `reduce_scatter` (one for every unit, or a mapping
    by unit name; None: the default) for each unit."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise errors.ShardingValueError(_unknown_units(unknown, names, arg))
        found = {name: value.get(name) for name in names}
    else:
        found = dict.fromkeys(names, value)
    for custom in found.values():
        if custom is not None and not isinstance(custom, cls):
            raise errors.ShardingTypeError(
                f"plan: {arg} must be a funshard.{cls.__name__}, a mapping from unit name "
                f"to one, or None; got {type(custom).__name__}."
            )
    return found


def _unknown_units(unknown, names, arg: str = "reshard_after_forward") -> str:
    return (
        f"plan: {arg} names {sorted(unknown)}, which are not units "
        f"(the units are {list(names)}); use the names given in units=."
    )


@dataclasses.dataclass(frozen=True)
class LeafGroup:
    """One unit's leaves (or the root's), split into sharded and replicated ones.

    Attributes:
      name: the unit's name, or "root".
      paths: key paths of every array leaf in it.
      sharded: its `Sharded` leaves.
      replicated: `(array, route)` for each array leaf kept whole (its `LeafRoute`).
      layout: the gather layout of `sharded` (frozen leaves marked), or None.
      reshard_after_forward: the unit's value (the root keeps what it gathers: False).
      policy: the mixed-precision policy of a unit's sharded leaves (None for the root,
        whose leaves are each gathered in their own policy's dtype).
      layers: for a stack of layers (every sharded leaf `stacked=True`), which
        `fs.scan` / `fs.lax_scan` gathers and reduces one layer at a time: the number of
        layers; None for a unit called once.
    """

    name: str
    paths: tuple
    sharded: tuple[Sharded, ...]
    replicated: tuple
    layout: comm.GroupLayout | None
    reshard_after_forward: bool | int
    policy: Any
    layers: int | None = None


def _names(paths) -> list[tuple[str, ...]]:
    return [tuple(key_name(e) for e in path) for path in paths]


def _not_found_hint(prefix, names) -> tuple[str, list[str]]:
    """The longest part of `prefix` that exists, and the keys found below it."""
    for depth in range(len(prefix) - 1, -1, -1):
        head = prefix[:depth]
        below = sorted(
            {n[depth] for n in names if n[:depth] == head and len(n) > depth}, key=_natural
        )
        if below:
            return ("params" if not head else display(head)), below
    return "params", []


def _natural(key: str):
    # Sequence indices in numeric order (2 before 10), then names.
    digits = key.lstrip("-").isdigit()
    return (not digits, int(key) if digits else 0, key)


def _owners(specs, names, paths) -> dict[int, str]:
    """Each selected leaf's unit: the one whose prefix is longest (FSDP2's rule: a unit
    owns the parameters below it that no nested unit owns)."""
    owner: dict[int, tuple[int, str]] = {}
    for name, prefixes in specs:
        for prefix in prefixes:
            hits = [i for i, n in enumerate(names) if n[: len(prefix)] == prefix]
            if not hits:
                at, below = _not_found_hint(prefix, names)
                raise errors.ShardingValueError(_prefix_not_found(name, display(prefix), at, below))
            for i in hits:
                depth, other = owner.get(i, (-1, name))
                if depth == len(prefix) and other != name:
                    raise errors.ShardingValueError(_leaf_in_two_units(paths[i], other, name))
                if len(prefix) > depth:
                    owner[i] = (len(prefix), name)
    return {i: name for i, (_, name) in owner.items()}


def _prefix_not_found(unit: str, prefix: str, at: str, below) -> str:
    found = ", ".join(repr(k) for k in below[:12]) + (", ..." if len(below) > 12 else "")
    return (
        f"plan: unit {unit!r} selects {prefix!r}, which matches no array leaf of params; "
        f"{at} holds {found or 'no array leaves'}. Give the prefix of the subtree the "
        "unit is called on."
    )


def _leaf_in_two_units(path, first: str, second: str) -> str:
    return (
        f"{_text.where('plan', path)} is selected by units {first!r} and {second!r} "
        "through the same prefix; a parameter belongs to one unit (the one with the "
        "longest prefix above it). Give each unit its own prefix."
    )


def _group(name, idx, paths, items, routes: tuple[LeafRoute, ...], reshard) -> LeafGroup:
    sharded = [i for i in idx if isinstance(items[i], Sharded)]
    policy = None
    layout = None
    if sharded:
        if name != ROOT:
            policy = core.policy_of(
                f"plan: unit {name!r}", [paths[i] for i in sharded], [items[i] for i in sharded]
            )
        layout = core.layout_of([items[i] for i in sharded], skip_replicate_reduce=False, name=name)
        frozen = tuple(
            dataclasses.replace(leaf, frozen=not routes[i].trainable)
            for leaf, i in zip(layout.leaves, sharded, strict=True)
        )
        layout = dataclasses.replace(layout, leaves=frozen)
    elif name != ROOT and idx:
        raise errors.ShardingValueError(_unit_not_sharded(name, [paths[i] for i in idx]))
    replicated = tuple((items[i], routes[i]) for i in idx if not isinstance(items[i], Sharded))
    return LeafGroup(
        name,
        tuple(paths[i] for i in idx),
        tuple(items[i] for i in sharded),
        replicated,
        layout,
        reshard,
        policy,
        _layers(name, [paths[i] for i in sharded], [items[i] for i in sharded]),
    )


def _layers(name: str, paths, items) -> int | None:
    """The number of layers of a unit whose sharded leaves are stacked, else None.

    A stack is what `fs.scan` / `fs.lax_scan` run, and they refuse a stack mixed with
    leaves sharded otherwise; the root gathers with `fs.unshard`, which would gather a
    stack whole, so a stack left to the root is a unit the caller forgot to name.
    """
    # An expert stack split over a model axis on dim 0 and FSDP-sharded on dim 1 (FSDP2's
    # Shard(1) for experts) is one array, not layers: no one splits layers over a model axis.
    stacked = [x.dim == 1 and not (x.model_axes and x.model_axes[0]) for x in items]
    if not any(stacked):
        return None
    if name == ROOT:
        raise errors.ShardingValueError(_stack_in_no_unit(paths, stacked))
    if not all(stacked):
        raise errors.ShardingValueError(_stack_mixed(name, paths, stacked))
    counts = {x.shape[0] for x in items}
    if len(counts) > 1:
        raise errors.ShardingValueError(_layer_counts(name, paths, items))
    return counts.pop()


def _listed(paths, pick) -> str:
    chosen = [_text.leaf_name(p) for p, keep in zip(paths, pick, strict=True) if keep]
    return ", ".join(chosen[:6]) + (", ..." if len(chosen) > 6 else "")


def _stack_in_no_unit(paths, stacked) -> str:
    names = [n for n, s in zip(_names(paths), stacked, strict=True) if s]
    # The subtree above every stacked leaf (never a leaf itself): the unit's prefix.
    common = names[0][: min(map(len, names)) - 1]
    while any(n[: len(common)] != common for n in names):
        common = common[:-1]
    unit = {common[-1] if common else "stack": display(common)}
    return (
        f"plan: {_listed(paths, stacked)} are stacked layers (fs.shard(..., stacked=True)) "
        "in no unit. fs.scan / fs.lax_scan run a stack as one unit, gathering one layer at "
        f"a time: name it in units= by its prefix, e.g. units={unit!r}."
    )


def _layer_counts(name: str, paths, items) -> str:
    listing = ", ".join(
        f"{_text.leaf_name(p)} {tuple(x.shape)}" for p, x in zip(paths, items, strict=True)
    )
    return (
        f"plan: the stacked leaves of unit {name!r} disagree on the number of layers (dim "
        f"0): {listing}. Stack every leaf over the same layers, as fs.scan requires."
    )


def _stack_mixed(name: str, paths, stacked) -> str:
    flat = [not s for s in stacked]
    return (
        f"plan: unit {name!r} holds stacked layers ({_listed(paths, stacked)}) and leaves "
        f"sharded otherwise ({_listed(paths, flat)}); fs.scan / fs.lax_scan need every "
        "sharded leaf of their stack stacked. Give the stack a unit of its own (its "
        "prefix in units=)."
    )


def _unit_not_sharded(unit: str, paths) -> str:
    listing = ", ".join(_text.leaf_name(p) for p in paths[:6]) + (", ..." if len(paths) > 6 else "")
    return (
        f"plan: unit {unit!r} holds no sharded parameter ({listing}: "
        "0-d or replicated leaves only), and fs.fully_shard refuses such a unit. Leave "
        "these leaves to the root, or widen the unit's prefix."
    )


def group_leaves(
    state: Any, specs, reshard: dict, routes: tuple[LeafRoute, ...]
) -> list[LeafGroup]:
    """The state's traced leaves grouped by unit (in `specs` order), then the root's.

    `routes` are the state's `LeafRoute`s, as `fs.value_and_grad` will build them.
    """
    paths, items, _ = core.sharded_leaves(state)
    arrays = [i for i, r in enumerate(routes) if r.traced]
    if not any(routes[i].sharded for i in arrays):
        raise errors.ShardingValueError(_nothing_sharded())
    core.state_axes("plan", paths, items)
    names = _names(paths)
    owner = _owners(specs, [names[i] for i in arrays], [paths[i] for i in arrays])
    owner = {arrays[j]: name for j, name in owner.items()}
    groups = [
        _group(
            name, [i for i in arrays if owner.get(i) == name], paths, items, routes, reshard[name]
        )
        for name, _ in specs
    ]
    rest = [i for i in arrays if i not in owner]
    if rest:
        groups.append(_group(ROOT, rest, paths, items, routes, False))
    return groups


def _nothing_sharded() -> str:
    return (
        "plan: params has no array leaf that fs.shard would shard (only 0-d or "
        "replicated leaves, or none at all); pass the model's parameter tree."
    )
