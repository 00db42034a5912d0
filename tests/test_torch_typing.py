"""torch_frontend's public API is fully annotated: every parameter and every return.

Walks `torch_frontend.__all__` with `inspect`: each public function, and for each class
that torch_frontend defines its `__init__` (when torch_frontend defines it), `__call__`
and public methods and properties (defined by torch_frontend, not inherited from torch or
Python). Every parameter but `self` / `cls` (`*args` and `**kwargs` included) and every
return must be annotated; a failure names each gap. Classes torch_frontend re-exports
from FSDP2 (`CPUOffloadPolicy`, `OffloadPolicy`) are torch's own and not checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch extra is not installed")

import torch_frontend

pytestmark = pytest.mark.torch

PACKAGE = "torch_frontend"


def _ours(obj: Any) -> bool:
    return getattr(obj, "__module__", "").split(".")[0] == PACKAGE


def _members(name: str, cls: type) -> Iterator[tuple[str, Callable[..., Any], bool]]:
    """(qualified name, function, is a method) of each checked member of `cls`."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):  # a subclass's member replaces its base's
        if _ours(klass):
            members.update(vars(klass))
    for attr, member in members.items():
        if attr.startswith("_") and attr not in ("__init__", "__call__"):
            continue
        if isinstance(member, property):
            if member.fget is not None:
                yield f"{name}.{attr}", member.fget, True
        elif isinstance(member, staticmethod):
            yield f"{name}.{attr}", member.__func__, False
        elif isinstance(member, classmethod):
            yield f"{name}.{attr}", member.__func__, True
        elif inspect.isfunction(member) and _ours(member):
            yield f"{name}.{attr}", member, True


def _callables() -> Iterator[tuple[str, Callable[..., Any], bool]]:
    for name in torch_frontend.__all__:
        obj = getattr(torch_frontend, name)
        if inspect.isclass(obj):
            if _ours(obj):
                yield from _members(name, obj)
        elif callable(obj):
            yield name, obj, False


def _gaps(name: str, func: Callable[..., Any], is_method: bool) -> list[str]:
    """Each unannotated parameter and return of `func`, as "name: parameter x"."""
    gaps = []
    params = list(inspect.signature(func).parameters.values())
    if is_method and params and params[0].name in ("self", "cls"):
        params = params[1:]
    for param in params:
        if param.annotation is inspect.Parameter.empty:
            gaps.append(f"{name}: parameter {param.name!r}")
    if inspect.signature(func).return_annotation is inspect.Signature.empty:
        gaps.append(f"{name}: return")
    return gaps


def test_the_walk_finds_the_public_api() -> None:
    names = {name for name, _, _ in _callables()}
    assert {
        "fully_shard",
        "FSDPModule.unshard",
        "FSDPModule.set_requires_gradient_sync",
        "UnshardHandle.wait",
        "MixedPrecisionPolicy.__init__",
        "clip_grad_norm_",
        "save",
        "restore",
    } <= names


def test_every_public_function_and_method_is_fully_annotated() -> None:
    gaps = [gap for name, func, is_method in _callables() for gap in _gaps(name, func, is_method)]
    assert not gaps, "unannotated in torch_frontend's public API:\n  " + "\n  ".join(gaps)


def test_a_gap_is_named() -> None:
    def partly(a: int, b, *args, **kwargs: int):  # b, *args and the return: unannotated
        return a

    assert _gaps("partly", partly, False) == [
        "partly: parameter 'b'",
        "partly: parameter 'args'",
        "partly: return",
    ]
