"""The GPU code paths are chosen correctly, checked on CPU.

No GPU runs here. What is checked: the pure functions that choose between the CPU and
GPU paths (gloo workaround, allocator settings, torch's backend and device), the GPU
branch of the DLPack import with a fake device and producer (the arguments it passes:
an honest check of the plumbing, not of CUDA), the stream-order bookkeeping with fake
events, and the StableHLO of funshard's step lowered for "cuda" (`lower(lowering_platforms=)`,
`jax.export`: no GPU needed; XLA GPU's compiler never runs). tests/test_gpu.py runs the real
thing on a GPU.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import json
import os
import sys
import types
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import run
from jax.sharding import PartitionSpec as P

import funshard as fs
from funshard import _jax_compat
from funshard.comm import _lowering
from torch_frontend import _bridge, _cuda

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"


# ---- the gloo workaround: only CPU programs of a distributed gloo job ------------------


@pytest.mark.parametrize(
    "platform, distributed, implementation, want",
    [
        ("cpu", True, "gloo", True),
        ("cpu", False, "gloo", False),  # single process: XLA's in-process collectives
        ("cpu", True, "mpi", False),
        ("cpu", True, "megascale", False),
        ("cuda", True, "gloo", False),  # a GPU program runs NCCL whatever the CPU setting
        ("cuda", False, "gloo", False),
        ("rocm", True, "gloo", False),
        ("tpu", True, "gloo", False),
    ],
)
def test_collectives_over_gloo_only_for_cpu_programs_of_a_gloo_job(
    platform, distributed, implementation, want
):
    got = _jax_compat.collectives_over_gloo(
        platform, distributed=distributed, cpu_implementation=implementation
    )
    assert got is want


def test_cpu_collectives_over_gloo_reads_this_process(monkeypatch):
    assert jax.config.jax_cpu_collectives_implementation == "gloo"  # JAX's default
    assert not _jax_compat.cpu_collectives_over_gloo()  # no jax.distributed in the tests
    monkeypatch.setattr(_jax_compat, "coordination_client", lambda: object())
    assert _jax_compat.cpu_collectives_over_gloo()


def test_reduce_scatter_by_permutes_only_for_cpu_programs_of_a_gloo_job(monkeypatch):
    from funshard import comm

    assert not comm.reduce_scatter_by_permutes("cpu")  # one process, no jax.distributed
    monkeypatch.setattr(_jax_compat, "coordination_client", lambda: object())
    assert comm.reduce_scatter_by_permutes("cpu")
    assert not comm.reduce_scatter_by_permutes("gpu")  # NCCL keeps its reduce-scatter


def _reduce_scatter_fn(mesh):
    # A fresh function each call: jit's cache must not hand back an earlier trace, made
    # under the other answer of `cpu_collectives_over_gloo`.
    def body(stacked):
        return _lowering.reduce_scatter_blocks([stacked.reshape(stacked.shape[1:])], ("fsdp",))[0]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp")))


@pytest.mark.parametrize("gloo", [False, True])
def test_a_gpu_program_keeps_its_reduce_scatter_in_a_gloo_job(monkeypatch, gloo):
    if gloo:  # a multi-process job with CPU collectives over gloo, as far as funshard sees
        monkeypatch.setattr(_jax_compat, "coordination_client", lambda: object())
    mesh = fs.make_mesh(devices=jax.devices()[:2])
    x = jnp.ones((2, 4, 3))
    cuda = jax.export.export(_reduce_scatter_fn(mesh), platforms=["cuda"])(x).mlir_module()
    assert "stablehlo.reduce_scatter" in cuda and "stablehlo.collective_permute" not in cuda
    cpu = _reduce_scatter_fn(mesh).lower(x).compile().as_text()
    assert ("collective-permute(" in cpu) is gloo
    assert "all-reduce(" not in cpu
    assert ("reduce-scatter(" in cpu) is not gloo


def _gpt_parts(width=32, heads=2, vocab=64, blocks=2):
    rng = np.random.default_rng(0)  # numpy: building the model compiles nothing

    def dense(shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    layers = [
        {
            "qkv": dense((width, 3 * width)),
            "proj": dense((width, width)),
            "up": dense((width, 4 * width)),
            "down": dense((4 * width, width)),
            "gain": np.ones((width,), np.float32),
        }
        for _ in range(blocks)
    ]
    root = {"embed": dense((vocab, width)), "head": dense((width, vocab))}

    def block(p, h):
        b, t, d = h.shape
        x = h * p["gain"]
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in jnp.split(x @ p["qkv"], 3, -1))
        h = h + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d) @ p["proj"]
        return h + jax.nn.gelu(h @ p["up"]) @ p["down"]

    def logits_loss(root, h, tokens):
        logp = jax.nn.log_softmax((h @ root["head"]).astype(jnp.float32), -1)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], tokens[:, 1:, None], -1))

    return root, layers, block, logits_loss


@pytest.mark.parametrize("use_scan", [False, True])
def test_the_step_lowered_for_cuda_has_barriers_bf16_gathers_and_f32_reduce_scatters(use_scan):
    root, layers, block, logits_loss = _gpt_parts()
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    mesh = fs.make_mesh(devices=jax.devices()[:2])
    if use_scan:
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *layers)
        state = {
            "root": fs.shard(root, mesh, mp_policy=policy),
            "blocks": fs.shard(stacked, mesh, mp_policy=policy, stacked=True),
        }
    else:
        state = fs.shard({"root": root, "blocks": layers}, mesh, mp_policy=policy)
    unit = fs.fully_shard(block)

    def loss_fn(state, tokens):
        r = fs.unshard(state["root"])
        h = r["embed"][tokens]
        if use_scan:
            h = fs.scan(block, state["blocks"], h)
        else:
            for p in state["blocks"]:
                h = unit(p, h)
        return logits_loss(r, h, tokens)

    tokens = np.zeros((4, 8), np.int32)
    traced = jax.jit(fs.value_and_grad(loss_fn)).trace(state, tokens)
    cuda = _ops(traced.lower(lowering_platforms=("cuda",)).as_text())  # no GPU needed
    cpu = _ops(traced.lower().as_text())
    # GPU programs materialise unit outputs with barriers, never with conditionals (a
    # GPU conditional waits for the host); the CPU program does the opposite, its
    # conditionals' predicate reading the device's position (partition_id).
    assert cuda.count("stablehlo.optimization_barrier") > 0 and "partition_id" not in cuda
    assert cpu.count("stablehlo.optimization_barrier") == 0 and "partition_id" in cpu
    lines = cuda.splitlines()
    gathers = [line for line in lines if '"stablehlo.all_gather"' in line]
    scatters = [
        lines[i + 1] for i, line in enumerate(lines) if '"stablehlo.reduce_scatter"' in line
    ]
    assert gathers and scatters
    assert all(line.endswith("xui16>") for line in gathers)  # bf16 bits: half-width traffic
    assert all("tensor<f32>" in line for line in scatters)  # the reduction runs in f32


def _ops(text: str) -> str:
    """StableHLO text without its location lines."""
    keep = (
        line.split(" loc(")[0].rstrip()
        for line in text.splitlines()
        if not line.lstrip().startswith("#loc")
    )
    return "\n".join(keep)


# ---- the DLPack import's GPU branch, with a fake GPU device and producer ----------------


class _FakeGpu:
    platform = "gpu"

    def __init__(self, local_hardware_id=0, stream=4242):
        self.local_hardware_id = local_hardware_id
        self._stream = stream

    def get_stream_for_external_ready_events(self):
        return self._stream

    def __repr__(self):
        return f"FakeGpu({self.local_hardware_id})"


class _FakeProducer:
    def __init__(self, kind=2, index=0):
        self.kind, self.index, self.streams = kind, index, []

    def __dlpack_device__(self):
        return (self.kind, self.index)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return "capsule"


class _FakeJaxLib:
    def __init__(self):
        self.calls = []

    def dlpack_managed_tensor_to_buffer(self, *args):
        self.calls.append(args)
        return jnp.zeros(3)


def test_gpu_import_hands_jax_stream_to_the_producer_and_to_jax():
    device, producer, lib = _FakeGpu(0, stream=4242), _FakeProducer(2, 0), _FakeJaxLib()
    out = _jax_compat._gpu_import(lib, producer, device)
    assert out.shape == (3,)
    # The producer waits for nothing itself: it makes JAX's stream 4242 wait for its own
    # current stream; JAX then defines the buffer on 4242 (same stream, same call).
    assert producer.streams == [4242]
    assert lib.calls == [("capsule", device, 4242, None, 2)]


def test_gpu_import_of_rocm_memory_passes_its_device_type():
    lib = _FakeJaxLib()
    _jax_compat._gpu_import(lib, _FakeProducer(10, 1), _FakeGpu(1, stream=7))
    assert lib.calls[0][2:] == (7, None, 10)


@pytest.mark.parametrize("kind, index", [(2, 1), (1, 0), (13, 0)])
def test_gpu_import_refuses_memory_of_another_device(kind, index):
    with pytest.raises(ValueError, match=r"same GPU"):
        _jax_compat._gpu_import(_FakeJaxLib(), _FakeProducer(kind, index), _FakeGpu(0))


def test_dlpack_import_takes_the_gpu_branch_for_a_gpu_device(monkeypatch):
    from jax._src.lib import _jax

    calls = []
    monkeypatch.setattr(
        _jax, "dlpack_managed_tensor_to_buffer", lambda *args: calls.append(args) or jnp.ones(2)
    )
    producer = _FakeProducer(2, 3)
    out = _jax_compat.dlpack_import(producer, _FakeGpu(3, stream=99))
    assert np.asarray(out).tolist() == [1.0, 1.0]
    assert producer.streams == [99] and calls[0][2:] == (99, None, 2)


def test_dlpack_import_on_cpu_passes_no_stream(monkeypatch):
    from jax._src.lib import _jax

    calls, real = [], _jax.dlpack_managed_tensor_to_buffer
    monkeypatch.setattr(
        _jax, "dlpack_managed_tensor_to_buffer", lambda *args: calls.append(args[2:]) or real(*args)
    )
    tensor = torch.arange(16, dtype=torch.float32)
    array = _jax_compat.dlpack_import(tensor, jax.devices()[0])
    assert calls == [(None, None, 1)]  # today's CPU call, unchanged
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()


# ---- torch_frontend's CUDA choices -----------------------------------------------------


@pytest.mark.parametrize(
    "environ, cuda, want",
    [
        ({}, True, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
        ({}, False, {}),  # CPU: JAX's allocator is of no concern to torch
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, True, {}),  # the user's choice stands
        ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".3"}, True, {}),
        ({"XLA_CLIENT_MEM_FRACTION": ".3"}, True, {}),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, True, {}),
        ({"PATH": "/bin"}, True, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
    ],
)
def test_allocator_env(environ, cuda, want):
    before = dict(environ)
    assert _cuda.allocator_env(environ, cuda) == want
    assert environ == before


def test_configure_allocator_sets_the_environment_before_the_backend_starts():
    environ = {}
    got = _cuda.configure_allocator(environ, cuda=True, backend_started=lambda: False)
    assert got == environ == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert _cuda.configure_allocator(environ, cuda=True, backend_started=lambda: False) == {}


def test_configure_allocator_too_late_warns_and_changes_nothing():
    environ = {}
    with pytest.warns(RuntimeWarning, match="preallocating 75%.*XLA_PYTHON_CLIENT_PREALLOCATE"):
        got = _cuda.configure_allocator(environ, cuda=True, backend_started=lambda: True)
    assert got == environ == {}


def test_configure_allocator_on_a_cpu_only_machine_does_nothing():
    environ = {}
    assert _cuda.configure_allocator(environ, backend_started=lambda: True) == {}  # no warning
    assert environ == {}


def test_the_allocator_variables_are_the_ones_jaxlib_reads():
    import inspect

    from jaxlib import xla_client

    source = inspect.getsource(xla_client.generate_pjrt_gpu_plugin_options)
    for name in _cuda.ALLOCATOR_VARS:
        assert f"'{name}'" in source, name
    assert "'false'" in source  # the value allocator_env sets means "no preallocation"


GPU0, GPU3 = (
    types.SimpleNamespace(platform="gpu", local_hardware_id=0),
    types.SimpleNamespace(platform="gpu", local_hardware_id=3),
)


def test_devices_and_backend_follow_the_jax_device():
    cpu = jax.devices()[0]
    assert _cuda.device_type(cpu) == "cpu" and _cuda.device_type(GPU3) == "cuda"
    assert _cuda.torch_device(cpu) == torch.device("cpu")
    assert _cuda.torch_device(GPU3) == torch.device("cuda", 3)
    assert _cuda.torch_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert _cuda.torch_backend("cpu") == "gloo"
    _cuda.set_torch_device(cpu)  # no-op without CUDA


def test_check_same_device():
    cpu = jax.devices()[0]
    _cuda.check_same_device(torch.zeros(2), cpu)
    with pytest.raises(ValueError, match=r"on cpu .*must be on cuda:3.*LOCAL_RANK"):
        _cuda.check_same_device(torch.zeros(2), GPU3)
    on_gpu1 = types.SimpleNamespace(device=torch.device("cuda", 1))  # a CUDA tensor's device
    with pytest.raises(ValueError, match=r"on cuda:1 .*must be on cuda:0"):
        _cuda.check_same_device(on_gpu1, GPU0)
    _cuda.check_same_device(types.SimpleNamespace(device=torch.device("cuda", 3)), GPU3)
    with pytest.raises(ValueError, match=r"\.\[cuda\]"):
        _cuda.check_same_device(on_gpu1, cpu)


def test_importing_a_cpu_tensor_switches_no_device():
    import contextlib

    assert isinstance(_cuda.importing(torch.zeros(1)), contextlib.nullcontext)


@pytest.mark.parametrize("handle, want", [(0, 1), (1, 1), (0x7F00DEAD, 0x7F00DEAD)])
def test_dlpack_stream(handle, want):
    assert _cuda.dlpack_stream(handle) == want


class _FakeEvent:
    def __init__(self, stream):
        self.stream, self.done = stream, False

    def query(self):
        return self.done


def test_retirement_keeps_jax_buffers_until_torch_is_done_with_them():
    events = []
    retirement = _cuda.Retirement(record=lambda s: events.append(_FakeEvent(s)) or events[-1])
    array = jnp.arange(64.0) + 1  # a fresh buffer nothing else holds
    alive = weakref.ref(array)
    tensor = torch.from_dlpack(array)
    view = tensor[8:]
    retirement.keep(array, tensor, "torch-stream")
    del array, tensor
    gc.collect()
    assert alive() is not None and retirement.held == 0 and not events  # view still alive
    del view
    gc.collect()
    assert [e.stream for e in events] == ["torch-stream"] and retirement.held == 1
    assert retirement.release_finished() == 1 and alive() is not None  # event pending
    events[0].done = True
    assert retirement.release_finished() == 0
    gc.collect()
    assert alive() is None


def test_export_and_import_of_cpu_memory_share_it_and_retire_nothing():
    mesh = fs.make_mesh(devices=jax.devices()[:1])
    layout = _bridge.layout_of(mesh, _bridge.CommContext())
    tensor = torch.arange(32, dtype=torch.float32)
    array = _bridge._import(layout, tensor)
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    back = _bridge._export(array)
    assert back.data_ptr() == tensor.data_ptr()
    assert _cuda.RETIREMENT.held == 0


def test_import_refuses_a_tensor_on_another_device():
    layout = types.SimpleNamespace(device=GPU0)
    with pytest.raises(ValueError, match="without a copy"):
        _bridge._import(
            layout,
            types.SimpleNamespace(
                detach=lambda: types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 2))
            ),
        )


# ---- benchmarks/gpu_check.py without a GPU --------------------------------------------


@functools.cache
def _gpu_check_module():
    """benchmarks/gpu_check.py, loaded by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("funshard_benchmarks_gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "kind, want",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", None),
    ],
)
def test_gpu_check_peak_tflops_by_device_name(kind, want):
    assert _gpu_check_module().peak_tflops(kind) == want


def test_gpu_check_mfu():
    check = _gpu_check_module()
    assert check.mfu(flops=500e12, seconds=1.0, peak=1000.0) == pytest.approx(0.5)
    assert check.mfu(flops=1e12, seconds=1.0, peak=None) is None


@pytest.mark.multiprocess
def test_gpu_check_on_a_cpu_only_machine_exits_at_once_saying_why(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["JAX_PLATFORMS"] = "cpu"
    proc = run(
        [
            sys.executable,
            str(GPU_CHECK),
            "--out-json",
            str(tmp_path / "r.json"),
            "--out-md",
            str(tmp_path / "r.md"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no GPU" in proc.stderr and "--cpu-smoke" in proc.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize(
    "environ, names, want",
    [
        ({}, ["jax", "jax-cuda12-plugin", "jax-cuda12-pjrt"], None),
        ({"JAX_PLATFORMS": "cuda,cpu"}, ["jax_cuda12_plugin"], None),
        ({"JAX_PLATFORMS": "cpu"}, ["jax-cuda12-plugin"], "leaves out the GPU"),
        ({}, ["jax", "jaxlib", "torch"], "plugin is not installed"),
        ({}, ["jax-rocm7-plugin"], None),
    ],
)
def test_gpu_check_knows_without_starting_jax_when_there_is_no_gpu(environ, names, want):
    got = _gpu_check_module().no_gpu_reason(environ, names)
    assert got is None if want is None else want in got


@pytest.mark.slow
@pytest.mark.multiprocess
def test_gpu_check_cpu_smoke_runs_the_bridge_and_the_frontend(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    out = tmp_path / "r.json"
    proc = run(
        [
            sys.executable,
            str(GPU_CHECK),
            "--cpu-smoke",
            "--only",
            "dlpack,torch-frontend",
            "--steps",
            "1",
            "--out-json",
            str(out),
            "--out-md",
            str(tmp_path / "r.md"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu-smoke"
    assert report["results"]["dlpack"]["ok"], report["results"]["dlpack"]
    frontend = report["results"]["torch-frontend"]
    assert "error" not in frontend and len(frontend["losses"]) == 2
    assert set(report["evaluation"]["targets"].values()) == {"n/a"}  # no GPU, no verdict
    assert "none of its numbers is a GPU measurement" in (tmp_path / "r.md").read_text()
