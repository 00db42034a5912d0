"""The package as pip installs it: the wheel's files and metadata, and the optional extras.

The wheel is built from a copy of the sources (the repository's own build/ and egg-info
stay untouched) without build isolation, so nothing is downloaded: the dev extra brings
a setuptools that reads the SPDX licence. A missing extra is simulated in a fresh
interpreter by `sys.modules[name] = None`, which makes `import name` fail as if the
package were not installed.
"""

import email.parser
import json
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "funshard", "torch_frontend"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """The wheel that `pip wheel` builds from a copy of the package's sources."""
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__")
            shutil.copytree(ROOT / name, source / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*command, "--quiet", "--wheel-dir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (path,) = out.glob("funshard-*.whl")
    with zipfile.ZipFile(path) as archive:
        yield archive


def _metadata(wheel: zipfile.ZipFile):
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def test_wheel_ships_py_typed_and_the_licence(wheel):
    names = set(wheel.namelist())
    assert "funshard/py.typed" in names
    assert "torch_frontend/py.typed" in names
    (licence,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert wheel.read(licence) == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in wheel.read(licence)
    assert "funshard/flax/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/"))]


def test_wheel_metadata(wheel):
    metadata = _metadata(wheel)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["Requires-Python"] == ">=3.11"
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]
    requires = [r.replace(" ", "") for r in metadata.get_all("Requires-Dist")]
    # The torch extra admits the versions torch_frontend supports, not one pinned build.
    (torch,) = [r.split(";")[0] for r in requires if r.endswith('extra=="torch"')]
    assert sorted(torch.removeprefix("torch").split(",")) == ["<2.15", ">=2.13"]


def _import_without(module: str, missing: str) -> tuple[str, str, str | None]:
    """Imports `module` (or runs a script's path) in an interpreter without `missing`."""
    if module.endswith(".py"):
        # --help: were the check missing, argparse would exit instead of training.
        load = f"sys.argv = [{module!r}, '--help']; runpy.run_path({module!r}, run_name='__main__')"
    else:
        load = f"import {module}"
    code = textwrap.dedent(
        f"""
        import json, runpy, sys
        sys.modules[{missing!r}] = None
        try:
            {load}
        except BaseException as error:
            name = getattr(error, "name", None)
            result = [type(error).__name__, isinstance(error, ImportError), name, str(error)]
        else:
            result = None
        print("RESULT", json.dumps(result))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert result is not None, f"{module} loaded without {missing}"
    kind, is_import_error, name, message = result
    assert is_import_error, f"{kind} is not an ImportError: {message}"
    return kind, message, name


@pytest.mark.parametrize(
    "module, missing, extra",
    [
        ("torch_frontend", "torch", "funshard[torch]"),
        ("funshard.flax", "flax", "funshard[flax]"),
        ("examples/train_lm.py", "flax", "funshard[examples]"),
        ("examples/train_lm.py", "rich", "funshard[examples]"),
    ],
)
def test_missing_extra_names_it(module, missing, extra):
    kind, message, name = _import_without(module, missing)
    assert kind == "ModuleNotFoundError"
    assert name == missing
    assert f'pip install "{extra}"' in message, message
    assert "halted; None in sys.modules" not in message
