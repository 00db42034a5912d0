"""The package's layers, checked from its import graph (docs/architecture.md draws it).

Every `import` / `from ... import` in `funshard/` and `torch_frontend/` (at module level
or inside a function) is an edge between two parts. A part may import its own modules
and any part on a lower floor, but only through that part's `__init__` names: never a
module of another part's private (`_`) modules, never a private name of another
module, never upwards, never sideways (a part on its own floor). No module takes part
in an import cycle, not even through an import inside a function.

Run as a script (`python tests/test_architecture.py`) to print the graph between parts.
"""

from __future__ import annotations

import ast
import collections
import pathlib
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Floors, lowest first. Root-level private modules (`funshard/_jax_compat.py` ...) are
# the floor every part stands on.
FLOORS = {
    "funshard.<floor>": 0,
    "funshard.errors": 0,
    "funshard.comm": 1,
    "funshard.core": 2,
    "funshard.distributed": 2,
    "funshard.io": 3,
    "funshard.planning": 3,
    "funshard.flax": 6,  # adapters over the public face, as torch_frontend
    "funshard": 5,  # the public face: re-exports only
    "torch_frontend": 6,
}
# What torch_frontend may import: public and semi-public names only.
FRONTEND_MAY_IMPORT = {
    "funshard",
    "funshard.comm",
    "funshard.distributed",
    "funshard.io",
    "funshard.errors",
    "funshard.planning",  # the step report torch_frontend.check shares with fs.check
}
# Sideways edges (between two parts on one floor) that stand for now, and the modules
# that make them: none. (The last one, the core calling funshard.distributed's
# agreement checks, ended when they moved below the core, into funshard.comm.)
KNOWN_SIDEWAYS: dict[tuple[str, str], set[str]] = {}


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str:
    """The part (subpackage, floor or face) a module belongs to."""
    parts = module.split(".")
    if parts[0] == "torch_frontend":
        return "torch_frontend"
    if len(parts) == 1:
        return "funshard"
    if f"funshard.{parts[1]}" in FLOORS:
        return f"funshard.{parts[1]}"
    return "funshard.<floor>"  # funshard/_jax_compat.py, _text.py, ...


def _is_package(module: str, root: pathlib.Path = ROOT) -> bool:
    return (root / module.replace(".", "/") / "__init__.py").exists()


def _is_module(module: str, root: pathlib.Path = ROOT) -> bool:
    return _is_package(module, root) or (root / (module.replace(".", "/") + ".py")).exists()


def _resolve(importer: str, node: ast.ImportFrom, root: pathlib.Path = ROOT) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer, root):
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(root: pathlib.Path = ROOT) -> list[tuple[str, str, str | None, int]]:
    """(importer, imported module, imported name or None, line) for every internal import
    of the package under `root` (the repository; a test gives a planted one)."""
    found = []
    for path in sorted([*root.glob("funshard/**/*.py"), *root.glob("torch_frontend/**/*.py")]):
        importer = _module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(importer, a.name, None, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(importer, node, root)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    if _is_module(sub, root):
                        found.append((importer, sub, None, node.lineno))
                    else:
                        found.append((importer, module, alias.name, node.lineno))
    return [f for f in found if f[1].split(".")[0] in ("funshard", "torch_frontend")]


def _private_module_of_other_part(importer: str, module: str) -> bool:
    """Whether `module` is a private module inside a part that is not `importer`'s."""
    part = _part(module)
    if part in (_part(importer), "funshard.<floor>") or part == module:
        return False
    inside = module[len(part) + 1 :].split(".")
    return any(p.startswith("_") for p in inside)


def _sideways(importer: str, module: str) -> bool:
    """Whether the edge joins two parts on one floor, above floor 0 (whose loose modules
    and `errors` are one floor that every part stands on), and is not a known exception."""
    src, dst = _part(importer), _part(module)
    if src == dst or FLOORS[src] != FLOORS[dst] or FLOORS[src] == 0:
        return False
    return importer not in KNOWN_SIDEWAYS.get((src, dst), ())


def violations(root: pathlib.Path = ROOT) -> list[str]:
    found = []
    for importer, module, name, line in imports(root):
        src, dst = _part(importer), _part(module)
        where = f"{importer}:{line} imports {module}{'.' + name if name else ''}"
        if src != dst and FLOORS[dst] > FLOORS[src]:
            found.append(f"{where}: upward ({src} is below {dst})")
        if _sideways(importer, module):
            found.append(f"{where}: sideways ({src} and {dst} share floor {FLOORS[src]})")
        if _private_module_of_other_part(importer, module):
            found.append(f"{where}: a private module of {dst}; import {dst}'s own names")
        if name is not None and name.startswith("_") and module != importer:
            found.append(f"{where}: a private name of another module")
        if (
            src == "torch_frontend"
            and dst != "torch_frontend"
            and dst not in FRONTEND_MAY_IMPORT
            and module not in FRONTEND_MAY_IMPORT
        ):
            found.append(f"{where}: torch_frontend may import only {sorted(FRONTEND_MAY_IMPORT)}")
    return found


def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Importer -> the modules it imports (inside functions too) in the package at `root`."""
    edges = collections.defaultdict(set)
    for importer, module, _, _ in imports(root):
        edges[importer].add(module)
    return dict(edges)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `edges`: every strongly connected set of modules (Tarjan's
    algorithm) of two or more, or one that imports itself; each sorted, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            members = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(members) > 1 or node in edges.get(node, ()):
                found.append(sorted(members))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def graph() -> dict[tuple[str, str], int]:
    """Number of import statements from each part to each other part."""
    edges = collections.Counter()
    for importer, module, _, _ in imports():
        src, dst = _part(importer), _part(module)
        if src != dst:
            edges[src, dst] += 1
    return dict(edges)


def test_every_module_belongs_to_a_floor():
    for importer, module, _, _ in imports():
        assert _part(importer) in FLOORS and _part(module) in FLOORS


def test_no_upward_or_private_imports():
    assert violations() == []


def test_the_comm_layer_knows_no_step():
    # The gather and the collectives take what they need as arguments (a GroupLayout),
    # never the running step: the core builds that from the step's view of each leaf.
    stepwise = {"funshard.core", "funshard.planning", "funshard.io"}
    assert not [i for i in imports() if _part(i[0]) == "funshard.comm" and _part(i[1]) in stepwise]


def test_no_sideways_imports_beyond_the_known_exception():
    # Asserted beside the violations so that the exception can only shrink: a new module
    # of the core importing funshard.distributed is a violation, and once the two above
    # stop, the entry in KNOWN_SIDEWAYS must go.
    for (src, dst), modules in KNOWN_SIDEWAYS.items():
        making = {i for i, m, _, _ in imports() if _part(i) == src and _part(m) == dst}
        assert making, f"{src} -> {dst} is gone: delete it from KNOWN_SIDEWAYS"
        assert making <= modules, making - modules


def test_no_import_cycles():
    # Across the whole package, so also inside every part; function-level imports count
    # (one hid the cycle between core/_context.py and core/_sharded.py).
    assert cycles(module_graph()) == []


def test_the_cycle_finder_on_a_known_graph():
    edges = {
        "p.a": {"p.b"},
        "p.b": {"p.c", "p.d"},
        "p.c": {"p.a"},  # a -> b -> c -> a
        "p.d": {"p.e"},
        "p.e": set(),  # below the cycle, in none
        "p.f": {"p.f"},  # a module importing itself
        "p.g": {"p.a"},  # into a cycle, not part of it
    }
    assert cycles(edges) == [["p.a", "p.b", "p.c"], ["p.f"]]
    assert cycles({"p.a": {"p.b"}, "p.b": set()}) == []


def _plant(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    """A package tree under `root`: each path (relative to it) with its source."""
    for relative, source in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


def test_the_checker_sees_a_cycle_through_a_function_level_import(tmp_path):
    root = _plant(
        tmp_path,
        {
            "funshard/__init__.py": "",
            "funshard/core/__init__.py": "from funshard.core._leaf import Leaf as Leaf\n",
            "funshard/core/_leaf.py": """
            def in_step(leaf):
                from funshard.core import _step  # it imports this module

                return isinstance(leaf, _step.StepLeaf)
        """,
            "funshard/core/_step.py": "from funshard.core._leaf import Leaf\n",
        },
    )
    assert cycles(module_graph(root)) == [["funshard.core._leaf", "funshard.core._step"]]


def test_the_checker_sees_a_sideways_import(tmp_path, monkeypatch):
    # A known exception, as KNOWN_SIDEWAYS may list one, covers the modules it names only.
    known = {("funshard.core", "funshard.distributed"): {"funshard.core._shard"}}
    monkeypatch.setattr(sys.modules[__name__], "KNOWN_SIDEWAYS", known)
    root = _plant(
        tmp_path,
        {
            "funshard/__init__.py": "",
            "funshard/io/__init__.py": "from funshard import planning\n",
            "funshard/planning/__init__.py": "",
            # The known exception covers core/_shard.py, not a new module of the core.
            "funshard/core/__init__.py": "from funshard import distributed\n",
            "funshard/core/_shard.py": "from funshard import distributed\n",
            "funshard/distributed/__init__.py": "",
        },
    )
    found = violations(root)
    assert [v for v in found if "sideways" in v] == [
        (
            "funshard.core:1 imports funshard.distributed: sideways (funshard.core and "
            "funshard.distributed share floor 2)"
        ),
        (
            "funshard.io:1 imports funshard.planning: sideways (funshard.io and "
            "funshard.planning share floor 3)"
        ),
    ]


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    # The graph is read from real files: an upward, private import is reported.
    fake = ROOT / "funshard" / "comm" / "_architecture_probe.py"
    fake.write_text("from funshard.core._step import _dp_axes\n")
    try:
        found = "\n".join(violations())
    finally:
        fake.unlink()
    assert "upward" in found and "private module" in found and "private name" in found


if __name__ == "__main__":
    for (src, dst), n in sorted(graph().items(), key=lambda e: (FLOORS[e[0][0]], e[0])):
        print(f"{src:22s} -> {dst:22s} {n:3d}")
    for v in violations():
        print("VIOLATION", v)
    for cycle in cycles(module_graph()):
        print("CYCLE", " <-> ".join(cycle))
