"""Every example runs as a user runs it: a subprocess from the command line, a few steps.

`examples/train_lm.py` (the main job) is checked on what it prints and writes: the
logged losses are finite and fall, the summary's memory and collective counts are those
of FSDP (or HSDP), a rerun with the same run folder resumes from the last checkpoint,
the loss plot is a PNG, and a sample continues the prompt. `examples/quickstart.py`
must train too. (`examples/train_torch.py` needs torchrun: tests/test_train_torch.py.)
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 300
LOGGED = re.compile(r"^step\s+(\d+)\s+train (\S+)\s+val (\S+)$", re.M)
TINY_DEPTH = 2  # train_lm.py's --tiny model


def run_example(script: str, *args: str, cwd: Path) -> str:
    """Runs `examples/<script>` with `args`; returns its output, failing with it on error."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def logged(out: str) -> list[tuple[int, float, float]]:
    """The (step, train loss, validation loss) lines train_lm.py printed."""
    return [(int(s), float(t), float(v)) for s, t, v in LOGGED.findall(out)]


def summary_value(out: str, row: str) -> str:
    """The 'this run' cell of a row of train_lm.py's summary table."""
    match = re.search(rf"{re.escape(row)}\s*│\s*([^│]*?)\s*│", out)
    assert match, f"no {row!r} row in:\n{out}"
    return match.group(1)


def assert_learns(lines, steps):
    assert [s for s, _, _ in lines] == steps
    assert all(math.isfinite(x) for _, t, v in lines for x in (t, v))
    (_, train0, val0), (_, train1, val1) = lines[0], lines[-1]
    assert train1 < train0 and val1 < val0, lines


def assert_png(path: Path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


TINY = ["--tiny", "--eval-every", "4", "--checkpoint-every", "4"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """8 steps of FSDP on 8 devices; then the same run folder again, to step 12, on an
    HSDP mesh with bf16 all-gathers (the checkpoint is resharded on load), with a sample."""
    cwd = tmp_path_factory.mktemp("train_lm")
    run_dir = cwd / "run"
    first = run_example("train_lm.py", *TINY, "--steps", "8", "--sample", "",
                        "--run-dir", str(run_dir), cwd=cwd)
    second = run_example("train_lm.py", *TINY, "--steps", "12", "--replicate", "2",
                         "--param-dtype", "bf16", "--sample", "ROMEO:",
                         "--sample-length", "40", "--run-dir", str(run_dir), cwd=cwd)
    return first, second, run_dir


def test_train_lm_fsdp_learns_and_reports(fsdp_run):
    out, _, run_dir = fsdp_run
    assert "mesh {'fsdp': 8}" in out
    assert_learns(logged(out), [4, 8])
    assert summary_value(out, "parameters per device").endswith("KiB")
    assert "(1/8.0)" in out  # 8 shards of every parameter and moment
    # Each block is a unit: gathered for forward and again for backward; the root
    # (embeddings, head) once; one reduce-scatter per unit; the loss's all-reduce.
    assert summary_value(out, "all-gathers per step") == str(1 + 2 * TINY_DEPTH)
    assert summary_value(out, "reduce-scatters per step") == str(1 + TINY_DEPTH)
    assert summary_value(out, "all-reduces per step") == "1"
    assert_png(run_dir / "loss.png")
    saved = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"step_000004", "step_000008"} <= saved


def test_train_lm_resumes_on_another_mesh_and_samples(fsdp_run):
    first, second, run_dir = fsdp_run
    assert re.search(r"resumed at step 8 from \S+step_000008$", second, re.M)
    assert "mesh {'replicate': 2, 'fsdp': 4}" in second
    assert [s for s, _, _ in logged(second)] == [12]  # steps 9..12 only
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val" in r] == [4, 8, 12]
    assert rows[-1]["val"] < logged(first)[0][2]
    assert (run_dir / "checkpoints" / "step_000012").is_dir()
    assert "(1/4.0)" in second  # HSDP: sharded over 4 devices, replicated over 2 groups
    # HSDP all-reduces each scattered gradient over the replicas too.
    assert int(summary_value(second, "all-reduces per step")) > 1
    sample = second.split("sample:\n", 1)[1].split("\nwall time", 1)[0]
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:") + 10


def test_train_lm_scan(tmp_path):
    out = run_example("train_lm.py", *TINY, "--steps", "8", "--scan", "--sample", "",
                      "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert_learns(logged(out), [4, 8])
    assert "(1/8.0)" in out
    assert int(summary_value(out, "reduce-scatters per step")) >= 1
    assert_png(tmp_path / "run" / "loss.png")


def test_quickstart_learns(tmp_path):
    out = run_example("quickstart.py", "--steps", "41", cwd=tmp_path)
    losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss (\S+)$", out, re.M)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert re.search(r"per device: [\d,]+ bytes of parameters", out)


def test_every_example_is_run_by_a_test():
    # Here, or in a test file of its own (examples/train_torch.py needs torchrun:
    # tests/test_train_torch.py). Helper modules (_name.py) are not examples.
    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    examples = [p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")]
    assert "train_lm.py" in examples and "quickstart.py" in examples
    assert [name for name in examples if f'"{name}"' not in tests] == []
