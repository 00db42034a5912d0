"""`examples/train_lm.py` stopped by real signals, and two runs on one run folder.

One chain of processes on one run folder, each step a real `train_lm.py` process:
a run gets SIGTERM after its first logged step (while it trains, a second run on the same
folder is refused); the command it prints resumes it, and that run gets SIGINT; the next
is killed with SIGKILL once it holds the folder; the last trains to the end. The runs
share a JAX compilation cache: only the first compiles. Its metrics must be those of one
uninterrupted run, step by step, bit for bit (same mesh, same program). A second signal's
"exit at once" runs in a small process of its own (a race inside a training run).
"""

import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import clean_env, kill_group, run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
STEPS = 30  # long enough that a run is still training when the test's signal arrives
# Every step logged and evaluated: the first line appears after step 1, and the metrics
# of the chain and of the uninterrupted run have the same rows.
FLAGS = ["--tiny", "--steps", str(STEPS), "--eval-every", "1", "--batch", "8", "--sample", ""]
TIMEOUT_S = 240
STEP_LINE = re.compile(r"^step\s+(\d+)\s+train ", re.M)
STOPPED = re.compile(
    r"^(SIG\w+): stopped after step (\d+) of (\d+); checkpoint (\S+)\. "
    r"Resume with:\n(.+)$",
    re.M,
)


class Example:
    """`train_lm.py` started in a session of its own, its output in files; killed on exit."""

    def __init__(self, command: list[str], cwd: Path, name: str):
        self.out, self.err = cwd / f"{name}.out", cwd / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                command, cwd=cwd, env=env(cwd), stdout=out, stderr=err, start_new_session=True
            )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            kill_group(self.proc.pid)
        self.proc.wait()

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def first_step(self) -> int:
        """Waits for the first logged step's line; returns its step."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            found = STEP_LINE.search(self.out.read_text(errors="replace"))
            if found:
                return int(found.group(1))
            assert self.proc.poll() is None, f"ended before a step:\n{self.output()}"
            time.sleep(0.02)
        pytest.fail(f"no step within {TIMEOUT_S} s:\n{self.output()}")

    def holds(self, lock: Path) -> None:
        """Waits until the process holds `lock` (its note there names it)."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(lock.read_text()).get("pid") == self.proc.pid:
                    return
            assert self.proc.poll() is None, f"ended before taking the lock:\n{self.output()}"
            time.sleep(0.02)
        pytest.fail(f"no lock within {TIMEOUT_S} s:\n{self.output()}")

    def wait(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {TIMEOUT_S} s:\n{self.output()}")


def env(cwd: Path) -> dict:
    """The runs' environment: one compilation cache, so that only the first run compiles."""
    return clean_env(
        JAX_COMPILATION_CACHE_DIR=str(cwd / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )


def train_lm(run_dir: Path) -> list[str]:
    """The command of a run of the chain's settings in `run_dir`."""
    return [sys.executable, str(EXAMPLE), *FLAGS, "--run-dir", str(run_dir)]


def stopped(example: Example) -> tuple[str, int, Path, str]:
    """(signal, step, checkpoint, resume command) of a run's stop message."""
    found = STOPPED.search(example.out.read_text())
    assert found, example.output()
    name, step, steps, checkpoint, command = found.groups()
    assert int(steps) == STEPS
    return name, int(step), Path(checkpoint), command


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def finished(command: list[str], cwd: Path) -> str:
    proc = run(command, cwd=cwd, env=env(cwd), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("this process ignores SIGINT, and so would the runs it starts")
    cwd = tmp_path_factory.mktemp("train_lm_stop")
    folder = cwd / "run"
    found = {"reference": finished(train_lm(cwd / "reference"), cwd)}

    with Example(train_lm(folder), cwd, "sigterm") as first:
        first.first_step()
        # Frozen (still holding its lock) while the second run starts up: else it could
        # train to the end meanwhile.
        first.proc.send_signal(signal.SIGSTOP)
        second_started = time.monotonic()
        second = run(
            train_lm(folder),
            cwd=cwd,
            env=env(cwd),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        found["second"] = (second, time.monotonic() - second_started, first.proc.pid)
        first.proc.send_signal(signal.SIGTERM)  # pending until it runs again
        first.proc.send_signal(signal.SIGCONT)
        found["sigterm"] = (first.wait(), first.output(), stopped(first))

    resume_with = shlex.split(found["sigterm"][2][3])
    with Example(resume_with, cwd, "sigint") as resumed:
        found["sigint first step"] = resumed.first_step()
        assert resumed.proc.poll() is None, "the resumed run ended before the test's SIGINT"
        resumed.proc.send_signal(signal.SIGINT)
        found["sigint"] = (resumed.wait(), resumed.output(), stopped(resumed))

    with Example(train_lm(folder), cwd, "sigkill") as killed:
        killed.holds(folder / "lock")
        killed.proc.send_signal(signal.SIGKILL)
        found["sigkill"] = killed.wait()

    found["last"] = finished(train_lm(folder), cwd)
    return found, folder, cwd


def test_a_second_run_on_the_folder_is_refused_at_once(chain):
    found, folder, _ = chain
    second, seconds, holder = found["second"]
    assert second.returncode == 2, second.stdout + second.stderr
    message = second.stderr.strip()
    assert message.startswith(
        f"train_lm.py: error: --run-dir {folder} is in use by pid {holder} on host "
    ), message
    assert re.search(r", started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} \(\d+ s ago\)\.", message)
    assert "Traceback" not in message and len(message.splitlines()) == 1
    assert second.stdout == ""  # refused before building anything
    assert seconds < 60


def test_sigterm_saves_the_step_and_prints_the_resume_command(chain):
    found, folder, _ = chain
    status, output, (name, step, checkpoint, command) = found["sigterm"]
    assert status == 128 + signal.SIGTERM, output
    assert name == "SIGTERM" and 1 <= step < STEPS
    assert checkpoint == folder / "checkpoints" / f"step_{step:06d}" and checkpoint.is_dir()
    assert "finishing the current step, then saving a checkpoint" in output
    assert "Traceback" not in output
    assert shlex.split(command) == [sys.executable, str(EXAMPLE), *FLAGS, "--run-dir", str(folder)]


def test_the_printed_command_resumes_and_sigint_stops_it_too(chain):
    found, folder, _ = chain
    saved = found["sigterm"][2][1]
    status, output, (name, step, checkpoint, _) = found["sigint"]
    assert f"resumed at step {saved} from {folder / 'checkpoints'}" in output
    assert found["sigint first step"] == saved + 1
    assert status == 128 + signal.SIGINT, output
    assert name == "SIGINT" and saved < step < STEPS and checkpoint.is_dir()
    assert "press Ctrl-C again to exit at once" in output and "Traceback" not in output


def test_a_run_killed_with_sigkill_leaves_no_lock_behind(chain):
    found, folder, _ = chain
    assert found["sigkill"] == -signal.SIGKILL
    assert (folder / "lock").exists()  # the file stays; the kernel dropped the lock
    saved = found["sigint"][2][1]
    assert f"resumed at step {saved} from" in found["last"]
    assert (folder / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def test_the_interrupted_chain_trains_as_one_uninterrupted_run(chain):
    _, folder, cwd = chain
    got, want = metrics(folder), metrics(cwd / "reference")
    assert [r["step"] for r in want if "loss" in r] == list(range(1, STEPS + 1))
    # Each step once (no duplicated rows from a second writer or a redone step), and
    # the same loss, learning rate, gradient norm and validation loss.
    keys = ("step", "loss", "lr", "grad_norm", "val")
    assert [{k: r[k] for k in keys if k in r} for r in got] == [
        {k: r[k] for k in keys if k in r} for r in want
    ]


SECOND_SIGNAL = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("train_lm", sys.argv[1])
train_lm = importlib.util.module_from_spec(spec)
sys.modules["train_lm"] = train_lm
spec.loader.exec_module(train_lm)
with train_lm.StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    print("first:", stop.received, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    print("still running after the second", flush=True)
print("still running after the block", flush=True)
"""


def test_a_second_signal_exits_at_once(tmp_path):
    proc = run(
        [sys.executable, "-c", SECOND_SIGNAL, str(EXAMPLE)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout == f"first: {int(signal.SIGTERM)}\n"
    assert "send SIGTERM again to exit at once" in proc.stderr
