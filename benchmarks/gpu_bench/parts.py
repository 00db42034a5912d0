"""The `probe`, `dlpack` and `tests` parts, every part by name, and each part's environment."""

from __future__ import annotations

import os
import subprocess
import sys

from . import ROOT
from .config import TORCH_PARTS
from .jax_step import part_jax
from .measure import time_us
from .torch_step import part_torch


def child_env(args, part: str) -> dict:
    """The environment of `part`'s process (and of the GPU tests' pytest)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if args.cpu_smoke:
        env["JAX_PLATFORMS"] = "cpu"
    elif part == "tests":
        env["JAX_PLATFORMS"] = "cuda"  # tests/conftest.py defaults to cpu otherwise
    if part in ("tests", "dlpack", *TORCH_PARTS):
        # torch shares the GPU: JAX must not take 75% of it (torch_frontend's default).
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return env


def part_probe(args) -> dict:
    import jax

    device = jax.devices()[0]
    out = {
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "jax": jax.__version__,
    }
    try:
        import torch

        out.update(
            torch=torch.__version__,
            torch_cuda=torch.cuda.is_available(),
            torch_cuda_version=torch.version.cuda,
        )
    except ImportError:
        out.update(torch=None, torch_cuda=False)
    return out


def part_dlpack(args) -> dict:
    import jax
    import torch

    import funshard as fs
    from torch_frontend import _bridge, _cuda

    _cuda.configure_allocator()
    jax_device = jax.local_devices()[0]
    _cuda.set_torch_device(jax_device)
    device = _cuda.torch_device(jax_device)
    layout = _bridge.layout_of(fs.make_mesh(devices=[jax_device]), _bridge.CommContext())
    out = {"device": str(device), "checks": {}}
    tensor = torch.arange(1 << 20, dtype=torch.float32, device=device)
    array = _bridge._import(layout, tensor)
    out["checks"]["torch -> jax shares memory"] = array.unsafe_buffer_pointer() == tensor.data_ptr()
    out["checks"]["torch -> jax values"] = bool(jax.numpy.asarray(array)[-1] == (1 << 20) - 1)
    result = jax.numpy.asarray(array) * 2
    back = _bridge._export(result)
    out["checks"]["jax -> torch shares memory"] = back.data_ptr() == result.unsafe_buffer_pointer()
    out["checks"]["jax -> torch values"] = bool(torch.equal(back, tensor * 2))
    block = _bridge.global_block(layout, tensor)
    shard = block.addressable_shards[0].data
    checks = out["checks"]
    checks["global block aliases the shard"] = shard.unsafe_buffer_pointer() == tensor.data_ptr()
    gathered = _bridge._gather_now(layout, [block], [tensor.shape[0]], None)[0]
    full = _bridge._export(gathered)
    checks["gathered buffer crosses without a copy"] = (
        full.data_ptr() == gathered.unsafe_buffer_pointer()
    )
    checks["gather values"] = bool(torch.equal(full, tensor))
    out["import_us"] = time_us(lambda: _bridge._import(layout, tensor))
    out["export_us"] = time_us(lambda: _bridge._export(result))
    out["ok"] = all(out["checks"].values())
    return out


def part_tests(args) -> dict:
    env = child_env(args, "tests")
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        "-p",
        "no:cacheprovider",
        "tests/test_gpu.py",
    ]
    proc = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=max(1.0, args.part_seconds - 5),
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {
        "command": " ".join(command[1:]),
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else "",
        "tail": proc.stdout[-3000:] + proc.stderr[-1000:],
        "ok": proc.returncode == 0,
    }


PARTS = {
    "probe": part_probe,
    "dlpack": part_dlpack,
    "tests": part_tests,
    "jax-plain": lambda a: part_jax(a, "plain"),
    "jax-funshard": lambda a: part_jax(a, "funshard"),
    "torch-plain": lambda a: part_torch(a, "plain"),
    "torch-fsdp2": lambda a: part_torch(a, "fsdp2"),
    "torch-frontend": lambda a: part_torch(a, "frontend"),
}
