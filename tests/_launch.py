"""Starting real processes on 127.0.0.1 for the tests: ports, environment, bounded waits.

The one place the tests start other processes. Every process starts in a process group
(a session) of its own, every wait is bounded, and whatever is still running when its
test is done is killed with everything it started: a hung job fails its test, never the
test run.

* `launch`: N processes, one per rank, with torchrun's environment variables set by hand
  (`rank_env`); a context manager that kills them all on the way out.
* `Job` / `run_bounded`: a torchrun job (torchrun, and its workers in sessions of their
  own), or any one command, killed as a whole tree.
* `run`: one short-lived child (`subprocess.run`'s interface), its group killed on timeout.
* `start_worker`: a torchrun test worker's own start (its pid file, its watchdog).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]  # the torchrun command
# Variables a launcher sets: a started process must not inherit this process's.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "JAX_COORDINATOR_ADDRESS",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_ID",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
)


# --------------------------------------------------------------------- ports, environment


def free_port(pair: bool = False) -> int:
    """A free TCP port on 127.0.0.1.

    Args:
      pair: also require `port + 1` to be free (torchrun's store listens on the port,
        JAX's coordinator on the next one).
    """
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if not pair:
                return port
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def port_pairs(count: int) -> list[int]:
    """`count` ports p, each with p + 1 free too, no two pairs overlapping."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(pair=True)
        if all(abs(port - other) > 1 for other in ports):
            ports.append(port)
    return ports


def cache_env() -> dict[str, str]:
    """The variables that point a started process's JAX at the test session's persistent
    compilation cache (made by tests/conftest.py), caching every program; none outside a
    test session."""
    cache = os.environ.get("FUNSHARD_TEST_COMPILATION_CACHE")
    if not cache:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": cache,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def clean_env(**extra: str) -> dict:
    """This environment without launcher variables or the tests' simulated devices.

    A started process asks for its own CPU device count (a forced one would conflict),
    runs JAX on the CPU with one OpenMP thread, and imports the repository's packages.
    It caches what it compiles in the test session's persistent compilation cache
    (tests/conftest.py), as do all the processes of the session: `extra` may name
    another `JAX_COMPILATION_CACHE_DIR`.
    """
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | cache_env()
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONIOENCODING="utf-8",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
    )
    env.update(extra)
    return env


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict:
    """`clean_env` plus the variables torchrun would set for `rank` of `world` on 127.0.0.1."""
    return clean_env(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


# ------------------------------------------------------------------------------- killing


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun's workers run in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            # The fields after the command's closing parenthesis: state, ppid, ...
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_group(pid: int) -> None:
    """Kills the process group `pid` leads (a process started by this module)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill_tree(pid: int, pid_dir: Path | None = None) -> None:
    """Kills `pid`'s group and every process below it, by pid.

    Args:
      pid: a process started by this module (it leads its own group).
      pid_dir: a folder where workers wrote `pid-rank*` files (torchrun's workers, which
        outlive a killed torchrun in sessions of their own).
    """
    below = descendants(pid)  # before the kill: orphans lose their parent link
    if pid_dir is not None:
        below += [int(f.read_text()) for f in pid_dir.glob("pid-rank*") if f.read_text()]
    kill_group(pid)
    for child in below:
        kill_group(child)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


# ----------------------------------------------------------------------- N rank processes


class Launched:
    """The processes `launch` started: one per rank, each leading its own process group."""

    def __init__(self, out: Path, timeout_s: float, separate_stderr: bool):
        self.out, self.timeout_s, self.separate_stderr = out, timeout_s, separate_stderr
        self.procs: dict[int, subprocess.Popen] = {}
        self.start = time.monotonic()
        self.elapsed: float | None = None

    def wait(self) -> dict[int, int | None]:
        """Each rank's exit status, waiting until `timeout_s` after the start at most.

        Returns:
          `{rank: status}`; None for a process still running at the deadline (killed when
          the `launch` block ends).
        """
        codes: dict[int, int | None] = {}
        for rank, proc in self.procs.items():
            left = self.start + self.timeout_s - time.monotonic()
            try:
                codes[rank] = proc.wait(timeout=max(0.0, left))
            except subprocess.TimeoutExpired:
                codes[rank] = None
        self.elapsed = time.monotonic() - self.start
        return codes

    def log(self, rank: int, stream: str = "") -> str:
        """What `rank` printed: both streams, or only `stream` ("out" or "err")."""
        if not self.separate_stderr:
            return (self.out / f"rank{rank}.log").read_text()
        streams = [stream] if stream else ["out", "err"]
        return "".join((self.out / f"rank{rank}.{s}").read_text() for s in streams)

    def logs(self) -> dict[int, str]:
        """`{rank: log}` of every rank."""
        return {rank: self.log(rank) for rank in self.procs}

    def kill(self) -> None:
        """Kills every process group still running, and reaps the processes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_group(proc.pid)
            proc.wait()


@contextlib.contextmanager
def launch(
    out: Path,
    commands: Mapping[int, tuple[Sequence[str], Mapping[str, str]]],
    timeout_s: float,
    separate_stderr: bool = False,
) -> Iterator[Launched]:
    """Starts one process per rank; always kills what is left of them on the way out.

    Args:
      out: the folder for each rank's output: `rank{r}.log` (stdout and stderr), or
        `rank{r}.out` and `rank{r}.err` with `separate_stderr`.
      commands: `{rank: (argv, environment)}`, e.g. with `rank_env`'s environment.
      timeout_s: how long `Launched.wait` waits, from the start.
      separate_stderr: keep stderr apart from stdout.

    Yields:
      The started processes.
    """
    launched = Launched(out, timeout_s, separate_stderr)
    try:
        for rank, (argv, env) in commands.items():
            if separate_stderr:
                with (
                    open(out / f"rank{rank}.out", "w") as stdout,
                    open(out / f"rank{rank}.err", "w") as stderr,
                ):
                    proc = subprocess.Popen(
                        list(argv),
                        env=dict(env),
                        stdout=stdout,
                        stderr=stderr,
                        start_new_session=True,
                    )
            else:
                with open(out / f"rank{rank}.log", "w") as log:
                    proc = subprocess.Popen(
                        list(argv),
                        env=dict(env),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
            launched.procs[rank] = proc
        yield launched
    finally:
        launched.kill()


# ------------------------------------------------------------------- torchrun, one command


def settle_gc() -> None:
    """A started process's garbage collector, after its imports: it leaves the imported
    modules' objects alone and collects the youngest objects less often.

    torch's eager dispatch (DTensor above all) allocates many short-lived objects, and
    with torch and JAX imported each full collection walks millions of long-lived ones:
    a tenth of the parity job's time went to the collector. Measured on that job (26
    cases, 2 and 4 ranks): 290 s of CPU, 152 s wall with the defaults; 233 s and 123 s
    frozen with a youngest generation of 50,000. The processes are short-lived, so the
    garbage the collector misses in the frozen objects is bounded.
    """
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def start_worker(out: Path, deadline: float) -> int:
    """A torchrun test worker's start: its `pid-rank{r}` file in `out` (so that the test
    can kill it), and a watchdog that ends it after `deadline` seconds, never outliving
    the test. Returns its rank."""
    import threading

    rank = int(os.environ["RANK"])
    (out / f"pid-rank{rank}").write_text(str(os.getpid()))
    watchdog = threading.Timer(deadline, os._exit, args=(3,))
    watchdog.daemon = True
    watchdog.start()
    return rank


def torchrun_command(script: Path, processes: int, port: int, *args: str) -> list[str]:
    """torchrun's command line for `processes` ranks of `script` on 127.0.0.1."""
    return [
        *TORCHRUN,
        f"--nproc-per-node={processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        str(script),
        *args,
    ]


def run_bounded(
    command: Sequence[str], cwd: Path, timeout_s: float, log: Path | None = None
) -> tuple[int, str]:
    """Runs `command`; on the way out kills it and every process it started.

    Returns:
      `(exit status, output)`; the status is -1 if it ran past `timeout_s`.
    """
    log = log or cwd / f"job-{time.monotonic_ns()}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            env=clean_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = -1
    finally:
        kill_tree(proc.pid)
        proc.wait()
    return code, log.read_text(errors="replace")


class Job:
    """A torchrun job of a test `worker`, started at once; `wait()` ends it, bounded.

    The worker gets `--out OUT --deadline TIMEOUT_S` and writes `rank{r}.npz` and its
    `pid-rank{r}` there. torchrun and every worker are killed on the way out of `wait()`,
    of a `with Job(...)` block, or of `kill()` (for a job started in a fixture).
    """

    def __init__(
        self, worker: Path, out: Path, processes: int, port: int, timeout_s: float, *args: str
    ):
        self.out, self.processes, self.timeout_s, self.code = out, processes, timeout_s, None
        self.killed = False
        command = torchrun_command(
            worker, processes, port, "--out", str(out), "--deadline", str(timeout_s), *args
        )
        self.start = time.monotonic()
        with open(out / "torchrun.log", "w") as sink:
            self.proc = subprocess.Popen(
                command,
                env=clean_env(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """Kills torchrun and every worker (once: pids are reused later); reaps torchrun."""
        if not self.killed:
            self.killed = True
            kill_tree(self.proc.pid, self.out)
        self.proc.wait()

    def wait(self) -> int:
        """torchrun's exit status (-1: still running at the deadline); then kills the job."""
        if self.code is None:
            try:
                left = self.start + self.timeout_s - time.monotonic()
                self.code = self.proc.wait(timeout=max(1.0, left))
            except subprocess.TimeoutExpired:
                self.code = -1
            finally:
                self.kill()
        return self.code

    def log(self) -> str:
        """What torchrun and the workers printed."""
        return (self.out / "torchrun.log").read_text(errors="replace")

    def failure(self, tail: int = 6000) -> str:
        """The message of a failed job: its status, how long it ran, its log's end."""
        took = time.monotonic() - self.start
        return f"torchrun job failed (exit {self.code}) after {took:.0f} s:\n{self.log()[-tail:]}"

    def result(self) -> tuple[Path, list[dict]]:
        """(output directory, each rank's arrays); fails the test if the job failed."""
        assert self.wait() == 0, self.failure()
        ranks = []
        for rank in range(self.processes):
            with np.load(self.out / f"rank{rank}.npz") as data:
                ranks.append(dict(data))
        return self.out, ranks


# ------------------------------------------------------------------ one short-lived child


def run(
    command: Sequence[str],
    timeout: float,
    capture_output: bool = False,
    check: bool = False,
    **kwargs,
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, timeout=..., ...)` in a process group of its own.

    On a timeout the whole group is killed (`subprocess.run` kills only the child) and
    `subprocess.TimeoutExpired` propagates with the output read so far.

    Raises:
      subprocess.TimeoutExpired: it ran past `timeout`.
      subprocess.CalledProcessError: `check` and a non-zero exit status.
    """
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with subprocess.Popen(list(command), start_new_session=True, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as timed_out:
            kill_group(proc.pid)
            timed_out.stdout, timed_out.stderr = proc.communicate()
            raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, stdout, stderr)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
