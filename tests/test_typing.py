"""The public API is fully annotated: every parameter and return of every public name.

Walks the namespaces users import (`funshard.__all__`, `funshard.errors`,
`funshard.distributed`, `funshard.flax`) with `inspect`: each public function, each
public class's `__init__`, public methods and properties (those funshard defines, its
own or inherited from a funshard base, not ones from Python or a dependency) must annotate
every parameter but `self` / `cls`, and its return. A failure names each gap.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import funshard as fs


def _namespaces() -> list[types.ModuleType]:
    modules = [fs, fs.errors, fs.distributed]
    pytest.importorskip("flax")
    import funshard.flax

    return [*modules, funshard.flax]


def _callables(
    name: str, obj: Any, package: str = "funshard"
) -> Iterator[tuple[str, Callable, bool]]:
    """(qualified name, function, is a method) of `obj` and, for a class, its members.

    A class's `__init__` counts when `package` defines it (its own or a dataclass's),
    not when it is inherited from Python or a dependency.
    """
    if inspect.isclass(obj):
        if getattr(obj.__init__, "__module__", "").startswith(package):
            yield f"{name}.__init__", obj.__init__, True
        members: dict[str, Any] = {}
        for klass in reversed(obj.__mro__):  # a subclass's member replaces its base's
            if klass.__module__.startswith(package):
                members.update(vars(klass))
        for attr, member in members.items():
            if attr.startswith("_"):
                continue
            if isinstance(member, property) and member.fget is not None:
                yield f"{name}.{attr}", member.fget, True
            elif isinstance(member, (staticmethod, classmethod)):
                yield f"{name}.{attr}", member.__func__, isinstance(member, classmethod)
            elif inspect.isfunction(member):
                yield f"{name}.{attr}", member, True
    elif callable(obj) and not isinstance(obj, types.ModuleType):
        yield name, obj, False


def _gaps(name: str, fn: Callable, is_method: bool) -> list[str]:
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    if is_method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    gaps = [
        f"{name}: parameter {p.name!r} has no annotation"
        for p in params
        if p.annotation is inspect.Parameter.empty
    ]
    if signature.return_annotation is inspect.Signature.empty:
        gaps.append(f"{name}: no return annotation")
    return gaps


def _public_callables() -> Iterator[tuple[str, Callable, bool]]:
    for module in _namespaces():
        for attr in module.__all__:
            obj = getattr(module, attr)
            if isinstance(obj, types.ModuleType):
                continue  # walked as a namespace of its own (or left out above)
            yield from _callables(f"{module.__name__}.{attr}", obj)


def test_public_api_is_fully_annotated() -> None:
    found = list(_public_callables())
    assert len(found) > 30, "the walk found the public functions and methods"
    gaps = [gap for entry in found for gap in _gaps(*entry)]
    assert not gaps, "unannotated public API:\n" + "\n".join(gaps)


def test_the_walk_finds_a_gap() -> None:
    def unannotated(x, *, y: int = 0):
        return x

    class Public:
        def __init__(self, a: int):
            self.a = a

        def method(self, b) -> int:
            return b

    assert _gaps("unannotated", unannotated, False) == [
        "unannotated: parameter 'x' has no annotation",
        "unannotated: no return annotation",
    ]
    found = _callables("Public", Public, package=Public.__module__)
    assert [gap for entry in found for gap in _gaps(*entry)] == [
        "Public.__init__: no return annotation",
        "Public.method: parameter 'b' has no annotation",
    ]
