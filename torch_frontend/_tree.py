"""The tensors inside a module's inputs and outputs: torch's pytree containers and dataclasses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to every tensor in it.

    Reaches into torch's pytree containers (tuples, lists, dicts, NamedTuples) and, as
    FSDP2 does, into dataclass instances, which torch's pytree treats as leaves: a
    module returning a dataclass of activations needs its hooks on those tensors too.
    A dataclass is rebuilt with `dataclasses.replace` only where a field changed.
    """

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            changes = {}
            for field in dataclasses.fields(leaf):
                if not field.init:
                    continue
                old = getattr(leaf, field.name)
                new = map_tensors(fn, old)
                if new is not old:
                    changes[field.name] = new
            return dataclasses.replace(leaf, **changes) if changes else leaf
        return leaf

    return pytree.tree_map(visit, tree)


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in `map_tensors`' order."""
    found: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(keep, tree)
    return found
