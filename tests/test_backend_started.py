"""`import funshard` after JAX's backend started says what is lost and how to fix it.

A script that calls `jax.devices()` before `import funshard` keeps XLA's CPU pool of
max(cores, devices) threads, and an asynchronous loop on 8 simulated devices then ends
in SIGABRT (docs/concepts.md, "Asynchronous steps on CPU devices"); in a multi-process
launch, `fs.distributed.initialize()` can no longer start. Each case runs in a fresh
interpreter: this one (tests/conftest.py) imports funshard before the backend starts.
"""

from __future__ import annotations

import sys

from _launch import clean_env, run

from funshard import _jax_compat

STARTED_FIRST = """
import jax
jax.config.update("jax_num_cpu_devices", {devices})
{touch}
import funshard
from funshard import _jax_compat
print("started", _jax_compat.backends_started())
"""


def _import(devices: int, touch: str, **env: str) -> tuple[int, str, str]:
    script = STARTED_FIRST.format(devices=devices, touch=touch)
    argv = [sys.executable, "-W", "error::RuntimeWarning", "-c", script]
    # NPROC: XLA's core count, so that 8 devices need a wider pool on any machine.
    done = run(argv, timeout=120, capture_output=True, text=True, env=clean_env(NPROC="2", **env))
    return done.returncode, done.stdout, done.stderr


def test_backend_started_before_import_warns_with_the_fix():
    code, _, err = _import(8, "jax.devices()")
    assert code == 1, err  # -W error: the warning is raised at the import
    assert "funshard.errors.BackendStartedWarning: import funshard: JAX's backend" in err, err
    assert "the CPU backend's thread pool for its 8 devices" in err, err
    assert "import funshard right after jax and jax.config.update" in err, err
    # The variable that gives the started-too-early process the pool it lacks.
    assert f"set PJRT_NPROC={_jax_compat.cpu_pool_threads(8, 2)} in the environment" in err
    assert "initialize" not in err.split("BackendStartedWarning")[1], err  # one process


def test_backend_started_in_a_multi_process_launch_names_initialize():
    launch = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    code, _, err = _import(1, "jax.numpy.ones(3)", **launch)
    assert code == 1, err
    assert "this process (torchrun: process 1 of 2) can no longer start" in err, err
    assert "call funshard.distributed.initialize() before any other JAX call" in err, err
    assert "thread pool" not in err, err  # one device: the pool is large enough


def test_import_first_neither_warns_nor_starts_the_backend():
    # The order the docs teach (and tests/conftest.py uses), and a single process whose
    # pool funshard never needed to widen: no warning, no backend started by funshard.
    assert _import(8, "") == (0, "started False\n", "")
    assert _import(1, "jax.devices()")[:2] == (0, "started True\n")
