"""The torchrun job that measures, run and read from here; the machine it ran on.

`run_job` starts `worker.py` under torchrun on 127.0.0.1 and kills every process it
started on the way out; `measure` reads back each rank's raw result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "worker.py"
# A launcher around this process may have set these; the job's torchrun sets its own.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "JAX_COORDINATOR_ADDRESS",
)


def _free_port_pair() -> int:
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


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    # One compute thread per rank, in torch and in XLA: the ranks share the cores.
    flags.append("--xla_cpu_multi_thread_eigen=false")
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
    )
    return env


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _worker_command(
    args: argparse.Namespace, out: Path, only: str, compile_blocks: bool, sample_memory: bool
) -> list[str]:
    """The torchrun command line of one job."""
    model = [
        f"--{k}={getattr(args, k)}"
        for k in ("blocks", "width", "heads", "seq", "batch")
        if getattr(args, k) is not None
    ]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={args.processes}",
        "--master-addr=127.0.0.1",
        f"--master-port={_free_port_pair()}",
        str(WORKER),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--profile-steps",
        str(args.profile_steps),
        "--deadline",
        str(args.timeout),
        *(["--only", only] if only else []),
        *(["--compile"] if compile_blocks else []),
        *(["--sample-memory"] if sample_memory else []),
        "--malloc",
        args.malloc,
        *model,
    ]


def run_job(
    args: argparse.Namespace,
    out: Path,
    only: str,
    compile_blocks: bool = False,
    sample_memory: bool = False,
) -> int:
    """Runs the torchrun job; kills torchrun and its workers (by pid) on the way out.

    Args:
      args: the parsed flags (model, steps, processes, timeout, malloc).
      out: the folder the ranks write their results and pid files into.
      only: comma-separated variant keys to build ("": every variant).
      compile_blocks: `block.compile()` every block, with an Inductor cache of its own.
      sample_memory: sample each rank's resident memory while it runs.

    Returns:
      torchrun's exit status, or -1 when it timed out or was interrupted.
    """
    command = _worker_command(args, out, only, compile_blocks, sample_memory)
    env = _env()
    if compile_blocks:  # a cold start for every job: nothing compiled by an earlier one
        env["TORCHINDUCTOR_CACHE_DIR"] = str(out / "inductor-cache")
    proc = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
    try:
        return proc.wait(timeout=args.timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        return -1
    finally:
        _kill(proc.pid)
        for pid_file in out.glob("pid-rank*"):  # the workers run in sessions of their own
            _kill(int(pid_file.read_text()))
        proc.wait()


def measure(
    args: argparse.Namespace,
    only: str = "",
    compile_blocks: bool = False,
    sample_memory: bool = False,
) -> list[dict] | None:
    """Runs the job; returns every rank's raw result (None if the job failed).

    Args:
      args: the parsed flags; with `--keep`, each rank's result is also kept there.
      only: comma-separated variant keys to build ("": every variant).
      compile_blocks: `block.compile()` every block (see `run_job`).
      sample_memory: sample each rank's resident memory (see `run_job`).
    """
    load_start, started = command_output("uptime"), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_torch-") as tmp:
        out = Path(tmp)
        code = run_job(args, out, only, compile_blocks, sample_memory)
        files = sorted(out.glob("rank*.json"))
        if code != 0 or len(files) != args.processes:
            print(f"bench_torch: the torchrun job failed (exit {code})", file=sys.stderr)
            return None
        ranks = [json.loads(f.read_text()) for f in files]
    for r in ranks:
        r["load"] = (load_start, command_output("uptime"))
        r["job_wall_s"] = time.perf_counter() - started
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        for r in ranks:
            (args.keep / f"rank{r['rank']}.json").write_text(json.dumps(r, indent=1))
    return ranks


def command_output(*cmd: str) -> str:
    """What `cmd` printed, stripped ("" if it could not run)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    """The machine and the software the numbers were measured on."""
    # Imported here, not at module level: only the report needs them in this process.
    import jax
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "nproc": command_output("nproc"),
        "free": command_output("free", "-h"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "jax": jax.__version__,
        "commit": command_output("git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"),
    }
