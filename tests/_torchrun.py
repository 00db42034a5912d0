"""Launching test jobs under torchrun on 127.0.0.1: ports, a clean environment, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # the torchrun command
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "JAX_COORDINATOR_ADDRESS")


def free_port_pair() -> int:
    """A port p with p + 1 free too (torchrun's store on p, JAX's coordinator on p + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def clean_env() -> dict:
    """This environment without launcher variables or the tests' simulated devices."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", PYTHONIOENCODING="utf-8", PYTHONPATH=os.pathsep.join(
                   [str(ROOT), *filter(None, [env.get("PYTHONPATH")])]))
    return env


def kill_group(pid: int) -> None:
    """Kills the process group `pid` leads (a torchrun, or a worker in its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Job:
    """A torchrun job of `worker`, started at once; `result()` waits for it, bounded.

    torchrun and every worker are killed on the way out of `result()` (or of `kill()`,
    for a job nobody waited for).
    """

    def __init__(self, worker: Path, out: Path, processes: int, port: int, timeout_s: float,
                 *args: str):
        self.out, self.processes, self.timeout_s, self.code = out, processes, timeout_s, None
        command = [*TORCHRUN, f"--nproc-per-node={processes}", "--master-addr=127.0.0.1",
                   f"--master-port={port}", str(worker), "--out", str(out),
                   "--deadline", str(timeout_s), *args]
        self.start = time.monotonic()
        with open(out / "torchrun.log", "w") as sink:
            self.proc = subprocess.Popen(command, env=clean_env(), stdout=sink,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        kill_group(self.proc.pid)
        for pid_file in self.out.glob("pid-rank*"):  # workers run in sessions of their own
            kill_group(int(pid_file.read_text()))
        self.proc.wait()

    def result(self) -> tuple[Path, list[dict]]:
        """(output directory, each rank's arrays); fails the test if the job failed."""
        if self.code is None:
            try:
                left = self.start + self.timeout_s - time.monotonic()
                self.code = self.proc.wait(timeout=max(1.0, left))
            except subprocess.TimeoutExpired:
                self.code = -1
            finally:
                self.kill()
        log = (self.out / "torchrun.log").read_text()
        took = time.monotonic() - self.start
        assert self.code == 0, f"torchrun job failed (exit {self.code}) after {took:.0f} s:\n{log[-6000:]}"
        ranks = []
        for rank in range(self.processes):
            with np.load(self.out / f"rank{rank}.npz") as data:
                ranks.append(dict(data))
        return self.out, ranks


def port_pairs(count: int) -> list[int]:
    """`count` ports p, each with p + 1 free too, no two pairs overlapping."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port_pair()
        if all(abs(port - other) > 1 for other in ports):
            ports.append(port)
    return ports
