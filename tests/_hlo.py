"""Reading collectives out of compiled programs, for the tests.

A thin face over `benchmarks/hlo.py`, the one HLO parser the tests and the benchmark
share: this module keeps the tests' vocabulary (plain dicts, joined computation text).
"""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

from funshard._hlo import format_groups


def _load_parser():
    """Loads `benchmarks/hlo.py` by path: `benchmarks/` holds scripts, not a package on
    the tests' path, and putting it there would let its modules shadow the tests'."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "hlo.py"
    spec = importlib.util.spec_from_file_location("funshard_benchmarks_hlo", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclass looks its module up in sys.modules.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_parser = _load_parser()


def collectives(hlo_text: str) -> list[dict]:
    """Every collective in an HLO module (or in one computation's text).

    Args:
        hlo_text: HLO text: `compiled.as_text()` or a value of `computations`.

    Returns:
        One dict per collective, in text order: `kind`, `dtype` (of its first result
        part), `elements` (of all result parts: a combined, tuple-shaped collective
        counts once) and `groups` (its replica groups in the explicit form,
        `{{0,1},{2,3}}`, whichever form XLA wrote them in; None without the attribute).
    """
    return [
        {
            "kind": c.kind,
            "dtype": c.arrays[0][0],
            "elements": c.elements,
            "groups": None if c.groups is None else format_groups(c.groups),
        }
        for c in _parser.parse_collectives(hlo_text.splitlines())
    ]


def count_by_kind(hlo_text: str) -> Counter:
    """Number of collective instructions of each kind in `hlo_text`."""
    return Counter(c["kind"] for c in collectives(hlo_text))


def compiled(fn, *args):
    """(compiled executable, its HLO text) of `jax.jit(fn)` on `args`."""
    import jax

    exe = jax.jit(fn).lower(*args).compile()
    return exe, exe.as_text()


def computations(hlo_text: str) -> dict[str, str]:
    """HLO computations by name ("ENTRY" for the entry computation), each as its text."""
    return {name: "\n".join(lines) for name, lines in _parser.computations(hlo_text).items()}
