"""Launching test jobs under torchrun on 127.0.0.1: ports, a clean environment, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
from pathlib import Path

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
