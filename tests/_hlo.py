"""Reading collectives out of compiled (and lowered) programs."""

import re
from collections import Counter

_COLLECTIVE = re.compile(
    r"= (?P<type>\([^)]*\)|[a-z0-9]+\[[0-9,]*\][^ ]*) "
    r"(?P<kind>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\((?P<rest>[^\n]*)"
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def collectives(hlo_text: str) -> list[dict]:
    """Every collective in an HLO module: kind, dtype, element count, replica groups.

    A combined (tuple-shaped) collective counts once, with the elements of all parts.
    """
    out = []
    for m in _COLLECTIVE.finditer(hlo_text):
        arrays = _ARRAY.findall(m["type"])  # a tuple when XLA combined several
        count = 0
        for _, dims in arrays:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            count += n
        dtype = arrays[0][0]
        groups = re.search(r"replica_groups=(\{[^ ]*\}|\[[^ ]*\][^ ,]*)", m["rest"])
        out.append(
            {"kind": m["kind"], "dtype": dtype, "elements": count,
             "groups": groups.group(1) if groups else None}
        )
    return out


def count_by_kind(hlo_text: str) -> Counter:
    return Counter(c["kind"] for c in collectives(hlo_text))


def compiled(fn, *args):
    """(compiled executable, its HLO text) of `jax.jit(fn)` on `args`."""
    import jax

    exe = jax.jit(fn).lower(*args).compile()
    return exe, exe.as_text()


def computations(hlo_text: str) -> dict[str, str]:
    """HLO computations by name ("ENTRY" for the entry computation)."""
    out, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header and not line.startswith(" "):
            name, lines = ("ENTRY" if header.group(1) else header.group(2)), []
        elif line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out
