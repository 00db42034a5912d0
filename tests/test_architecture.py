"""The package's layers, checked from its import graph (docs/architecture.md draws it).

Every `import` / `from ... import` in `funshard/` and `torch_frontend/` (at module level
or inside a function) is an edge between two parts. A part may import its own modules
and any part on a lower floor, but only through that part's `__init__` names: never a
module of another part's private (`_`) modules, never a private name of another
module, never upwards.

Run as a script (`python tests/test_architecture.py`) to print the graph between parts.
"""

from __future__ import annotations

import ast
import collections
import pathlib

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
FRONTEND_MAY_IMPORT = {"funshard", "funshard.comm", "funshard.distributed", "funshard.io",
                       "funshard.errors"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
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


def _is_package(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").exists()


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports() -> list[tuple[str, str, str | None, int]]:
    """(importer, imported module, imported name or None, line) for every internal import."""
    found = []
    for path in sorted([*ROOT.glob("funshard/**/*.py"), *ROOT.glob("torch_frontend/**/*.py")]):
        importer = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(importer, a.name, None, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(importer, node)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    if _is_package(sub) or (ROOT / (sub.replace(".", "/") + ".py")).exists():
                        found.append((importer, sub, None, node.lineno))
                    else:
                        found.append((importer, module, alias.name, node.lineno))
    return [f for f in found if f[1].split(".")[0] in ("funshard", "torch_frontend")]


def _private_module_of_other_part(importer: str, module: str) -> bool:
    """Whether `module` is a private module inside a part that is not `importer`'s."""
    part = _part(module)
    if part in (_part(importer), "funshard.<floor>") or part == module:
        return False
    inside = module[len(part) + 1:].split(".")
    return any(p.startswith("_") for p in inside)


def violations() -> list[str]:
    found = []
    for importer, module, name, line in imports():
        src, dst = _part(importer), _part(module)
        where = f"{importer}:{line} imports {module}{'.' + name if name else ''}"
        if src != dst and FLOORS[dst] > FLOORS[src]:
            found.append(f"{where}: upward ({src} is below {dst})")
        if _private_module_of_other_part(importer, module):
            found.append(f"{where}: a private module of {dst}; import {dst}'s own names")
        if name is not None and name.startswith("_") and module != importer:
            found.append(f"{where}: a private name of another module")
        if src == "torch_frontend" and dst != "torch_frontend" and dst not in FRONTEND_MAY_IMPORT \
                and module not in FRONTEND_MAY_IMPORT:
            found.append(f"{where}: torch_frontend may import only {sorted(FRONTEND_MAY_IMPORT)}")
    return found


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
