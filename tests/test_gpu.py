"""On a GPU: funshard's step against plain JAX, torch_frontend's CUDA path against torch.

Every test here is marked `gpu` and skipped, saying why, where JAX runs on CPU.
tests/conftest.py picks JAX_PLATFORMS=cpu unless the variable is set, so on a GPU
machine (with `pip install -e ".[cuda]"`, and a CUDA build of torch for the torch tests)
run:

    JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest -m gpu tests/test_gpu.py

as `benchmarks/gpu_check.py` does. The choices between the CPU and GPU code paths are
tested on CPU by tests/test_cuda_paths.py; this file runs the GPU paths themselves.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hlo import collectives, computations
from _launch import run

import funshard as fs

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
BF16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
WIDTH, HEADS, VOCAB, SEQ, BLOCKS = 128, 4, 256, 64, 3


@pytest.fixture(autouse=True)
def _needs_a_gpu():
    if jax.default_backend() == "cpu":
        pytest.skip(
            "needs a GPU: JAX runs on cpu here (tests/conftest.py picks cpu unless "
            "JAX_PLATFORMS is set). On a GPU machine with .[cuda]: JAX_PLATFORMS=cuda "
            "python -m pytest -m gpu tests/test_gpu.py"
        )


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA (a CUDA wheel from PyTorch's index; see README)")
    return torch


# ---- the JAX core ---------------------------------------------------------------------


def _init(key):
    keys = iter(jax.random.split(key, 4 * BLOCKS + 2))
    d = WIDTH

    def dense(shape):
        return jax.random.normal(next(keys), shape) / math.sqrt(shape[0])

    blocks = [
        {
            "ln_g": jnp.ones((d,)),
            "ln_b": jnp.zeros((d,)),
            "qkv": dense((d, 3 * d)),
            "proj": dense((d, d)),
            "up": dense((d, 4 * d)),
            "down": dense((4 * d, d)),
        }
        for _ in range(BLOCKS)
    ]
    root = {"embed": dense((VOCAB, d)) * 4, "head": dense((d, VOCAB))}
    return root, blocks


def _layer_norm(x, g, b):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g + b


def _block(p, h):
    b, t, d = h.shape
    x = _layer_norm(h, p["ln_g"], p["ln_b"])
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in jnp.split(x @ p["qkv"], 3, -1))
    h = h + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d) @ p["proj"]
    return h + jax.nn.gelu(h @ p["up"]) @ p["down"]


def _head_loss(root, h, tokens):
    logp = jax.nn.log_softmax((h @ root["head"]).astype(jnp.float32)[:, :-1], -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def _plain_loss(params, tokens):
    """The reference: plain JAX on one device, parameters cast to bf16 in the loss."""
    root, blocks = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    h = root["embed"][tokens]
    for p in blocks:
        h = _block(p, h)
    return _head_loss(root, h, tokens)


def _tokens():
    rows = 2 * jax.device_count()
    return jax.random.randint(jax.random.key(3), (rows, SEQ), 0, VOCAB)


def _funshard_loss(use_scan: bool):
    unit = fs.fully_shard(_block)

    def loss(state, tokens):
        root = fs.unshard(state["root"])
        h = root["embed"][tokens]
        if use_scan:
            h = fs.scan(_block, state["blocks"], h)
        else:
            for p in state["blocks"]:
                h = unit(p, h)
        return _head_loss(root, h, tokens)

    return loss


def _sharded_state(root, blocks, use_scan, mesh):
    if use_scan:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
        return {
            "root": fs.shard(root, mesh, mp_policy=BF16),
            "blocks": fs.shard(stacked, mesh, mp_policy=BF16, stacked=True),
        }
    return {
        "root": fs.shard(root, mesh, mp_policy=BF16),
        "blocks": fs.shard(blocks, mesh, mp_policy=BF16),
    }


def _relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


@pytest.mark.parametrize("use_scan", [False, True], ids=["fully_shard", "scan"])
def test_bf16_gpt_step_matches_plain_jax_on_the_gpu(use_scan):
    root, blocks = _init(jax.random.key(0))
    tokens = _tokens()
    mesh = fs.make_mesh()  # every GPU this process sees (world size 1 on one GPU)
    state = _sharded_state(root, blocks, use_scan, mesh)
    assert {d.platform for d in state["root"]["embed"].data.devices()} == {"gpu"}
    loss, grads = jax.jit(fs.value_and_grad(_funshard_loss(use_scan)))(state, tokens)
    ref_loss, (ref_root, ref_blocks) = jax.jit(jax.value_and_grad(_plain_loss))(
        (root, blocks), tokens
    )
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)
    full = fs.unshard(grads)
    got_blocks = full["blocks"]
    if use_scan:
        got_blocks = [jax.tree.map(lambda x, i=i: x[i], got_blocks) for i in range(BLOCKS)]
    for got, want in zip(
        jax.tree.leaves((full["root"], got_blocks)),
        jax.tree.leaves((ref_root, ref_blocks)),
        strict=True,
    ):
        assert got.dtype == jnp.float32  # the reduction and master weights stay f32
        assert _relative_error(got, want) < 3e-2


@pytest.mark.parametrize("use_scan", [False, True], ids=["fully_shard", "scan"])
def test_bf16_gpt_trains_like_plain_jax_on_the_gpu(use_scan):
    root, blocks = _init(jax.random.key(1))
    tokens = _tokens()
    opt = optax.adamw(3e-3)
    state = _sharded_state(root, blocks, use_scan, fs.make_mesh())
    opt_state = fs.init_optimizer(opt, state)
    params, ref_opt_state = (root, blocks), opt.init((root, blocks))
    value_and_grad = fs.value_and_grad(_funshard_loss(use_scan))

    @jax.jit
    def step(state, opt_state):
        loss, grads = value_and_grad(state, tokens)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    @jax.jit
    def ref_step(params, opt_state):
        loss, grads = jax.value_and_grad(_plain_loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses, ref_losses = [], []
    for _ in range(4):
        state, opt_state, loss = step(state, opt_state)
        params, ref_opt_state, ref_loss = ref_step(params, ref_opt_state)
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
    assert losses[-1] < losses[0]


def test_the_compiled_gpu_step_keeps_no_conditional_and_gathers_bf16_bits():
    root, blocks = _init(jax.random.key(0))
    state = _sharded_state(root, blocks, False, fs.make_mesh())
    text = (
        jax.jit(fs.value_and_grad(_funshard_loss(False)))
        .lower(state, _tokens())
        .compile()
        .as_text()
    )
    # XLA GPU keeps the optimization barriers at unit boundaries; CPU programs use
    # conditionals instead, which on a GPU would wait for the host.
    assert " conditional(" not in text
    gathers = [c for c in collectives(text) if c["kind"] == "all-gather"]
    if jax.device_count() > 1:
        assert gathers and all(c["dtype"] in ("u16", "bf16") for c in gathers)
        scatters = [c for c in collectives(text) if c["kind"] == "reduce-scatter"]
        assert scatters and all(c["dtype"] == "f32" for c in scatters)
    assert computations(text)  # the program parses


# ---- torch_frontend with CUDA tensors ---------------------------------------------------


def _layout():
    from torch_frontend import _bridge

    mesh = fs.make_mesh(devices=jax.local_devices()[:1])
    return _bridge.layout_of(mesh, _bridge.CommContext())


def test_cuda_tensors_cross_to_jax_and_back_without_a_copy(torch_cuda):
    torch = torch_cuda
    from torch_frontend import _bridge, _cuda

    layout = _layout()
    device = _cuda.torch_device(layout.device)
    assert device.type == "cuda"
    tensor = torch.arange(1 << 16, dtype=torch.float32, device=device)
    array = _bridge._import(layout, tensor)
    assert array.unsafe_buffer_pointer() == tensor.data_ptr()
    assert array.devices() == {layout.device}
    doubled = jnp.asarray(array) * 2
    back = _bridge._export(doubled)
    assert back.device == device and back.data_ptr() == doubled.unsafe_buffer_pointer()
    assert torch.equal(back, tensor * 2)


def test_jax_reads_what_torch_wrote_on_a_busy_side_stream(torch_cuda):
    torch = torch_cuda
    from torch_frontend import _bridge, _cuda

    layout = _layout()
    device = _cuda.torch_device(layout.device)
    tensor = torch.zeros(1 << 20, device=device)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the stream busy for ~0.1 s
        tensor.fill_(7.0)
        array = _bridge._import(layout, tensor)  # no host sync in between
        total = float(jnp.sum(jnp.asarray(array)))
    assert total == 7.0 * tensor.numel()


def test_torch_reads_what_jax_wrote_without_a_host_wait(torch_cuda):
    torch = torch_cuda
    from torch_frontend import _bridge

    layout = _layout()
    x = jax.device_put(jnp.ones((2048, 2048)), layout.device)
    y = x @ x + 1.0  # dispatched asynchronously; the export must not overtake it
    side = torch.cuda.Stream(_device(layout))
    with torch.cuda.stream(side):
        out = _bridge._export(y).sum().item()
    assert out == (2048.0 + 1.0) * 2048 * 2048


def _device(layout):
    from torch_frontend import _cuda

    return _cuda.torch_device(layout.device)


def test_a_dead_torch_view_keeps_jax_memory_until_torch_has_read_it(torch_cuda):
    torch = torch_cuda
    from torch_frontend import _bridge, _cuda

    layout = _layout()
    device = _device(layout)
    results = []
    for i in range(8):
        source = jax.device_put(jnp.full((1 << 22,), float(i)), layout.device)
        view = _bridge._export(source)
        torch.cuda._sleep(50_000_000)  # torch's read below is queued behind this
        results.append(view.sum())
        del view, source  # JAX's memory is free for reuse once the event has passed
        jax.block_until_ready(jnp.full((1 << 22,), -1.0, device=layout.device) * 3)
    torch.cuda.synchronize(device)
    assert [r.item() for r in results] == [float(i) * (1 << 22) for i in range(8)]
    _cuda.RETIREMENT.release_finished()
    assert _cuda.RETIREMENT.held == 0


def test_frontend_trains_a_cuda_model_like_plain_torch(torch_cuda):
    torch = torch_cuda
    import copy

    import torch_frontend
    from torch_frontend import _cuda

    torch_frontend.init_distributed()
    device = _cuda.torch_device(jax.local_devices()[0])
    torch.manual_seed(0)
    reference = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(3)],
        torch.nn.Linear(64, 8),
    ).to(device)
    model = copy.deepcopy(reference)
    for block in model[:3]:
        torch_frontend.fully_shard(block)
    torch_frontend.fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    x = torch.randn(16, 64, device=device)
    for _ in range(3):
        losses = []
        for m, opt in zip((model, reference), opts, strict=True):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)


@pytest.mark.multiprocess
def test_the_frontend_leaves_the_gpu_memory_to_torch(torch_cuda):
    # A fresh process: the allocator settings only count before JAX's backend starts.
    code = (
        "import os, torch\n"
        "from torch_frontend import _cuda\n"
        "print(_cuda.configure_allocator())\n"
        "import jax, jax.numpy as jnp\n"
        "jnp.ones(1024).block_until_ready()\n"
        "free, total = torch.cuda.mem_get_info()\n"
        "print(free / total)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT")}
    env.update(JAX_PLATFORMS="cuda", PYTHONPATH=str(ROOT))
    out = run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "{'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}"
    assert float(out[1]) > 0.5  # JAX's default would have taken 75%
