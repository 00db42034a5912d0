"""Text shared by every subpackage's error messages: key paths, process lists, common messages.

Each module builds its own error messages right beside the check that raises them; only
the few pieces several subpackages need live here. Like `_jax_compat`, this module sits at
the root floor: anything may import it, and it imports nothing of funshard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jax.tree_util import keystr


def where(fn: str, path: Sequence[Any] | None) -> str:
    """`fn: leaf <path>` prefix of a message (or just `fn:` at the root)."""
    if path is None:
        return f"{fn}:"
    return f"{fn}: leaf {leaf_name(path)}"


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's key path as `keystr` writes it (`['a'][0]`), `<root>` for the tree itself."""
    return keystr(tuple(path)) or "<root>"


def counted(n: int, one: str, many: str) -> str:
    """`n` and the noun in its number: "1 leaf", "3 leaves"."""
    return f"{n:,} {one if n == 1 else many}"


def joined(messages: Sequence[str]) -> str:
    """Several leaves' messages as one, a line each: every bad leaf is reported at once."""
    return "\n".join(messages)


def process_list(ranks: Iterable[int]) -> str:
    """ "process 1" / "processes 0, 2-5": ranks with runs shortened to ranges."""
    ranks = sorted(ranks)
    parts: list[list[int]] = []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
    return f"process{'es' if len(ranks) > 1 else ''} {text}"


def no_sharded(fn: str) -> str:
    """The tree given to `fn` holds no `Sharded` leaf: it is plain parameters, not state."""
    return (
        f"{fn}: the tree has no fs.Sharded leaves, so there is nothing to gather. Pass the "
        "state returned by fs.shard(params, mesh), not the plain parameters."
    )


def nested_units(how: str) -> str:
    """A `fully_shard` unit nested in another (refused where it is built, and where it runs)."""
    return (
        f"fully_shard: units cannot be nested ({how}): the outer unit has already gathered "
        "every parameter it was given, so the inner one receives full arrays, not fs.Sharded "
        "leaves. Call each unit from the loss function, or pass the inner unit's sharded "
        "parameters to the outer unit as an argument (not inside its params) so that the "
        "outer unit gathers only the parameters it owns, as FSDP2 does."
    )
