"""torch_frontend's state dicts, checkpoints (shared with JAX) and clip_grad_norm_.

References are independent: plain torch on the unsharded model, numpy, and the JAX core's
own `fs.save` / `fs.restore`. The multi-process cases run in two torchrun jobs started
together (`tests/_torch_state_worker.py`): 2 processes, and HSDP on 4; the rest run in
this process (world size 1).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
from _launch import Job, port_pairs
from _torch_state_worker import CLIPS, LR, STEPS, Net, batch, build, local, loss_of, shard
from conftest import mesh_for
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

import funshard as fs
import torch_frontend as tf

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_torch_state_worker.py")
JOB_TIMEOUT_S = 150
TOLERANCE = 1e-5
WORLD = 2


def _numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _jax_model(sd: dict[str, np.ndarray], mesh) -> dict:
    """The JAX `like`/tree of a module's state dict: fs.shard for what it shards, the
    0-d int64 buffer as numpy (JAX has no int64 without x64)."""
    shardable = {k: v for k, v in sd.items() if v.ndim and v.dtype.itemsize <= 4}
    return {**fs.shard(shardable, mesh), **{k: v for k, v in sd.items() if k not in shardable}}


def _param_groups(optimizer) -> list[dict]:
    return [
        {k: v for k, v in g.items() if isinstance(v, (bool, int, float, tuple))}
        for g in optimizer.param_groups
    ]


@pytest.fixture(scope="module")
def jax_params() -> dict[str, np.ndarray]:
    sd = _numpy_state(build(seed=5))
    sd["version"] = np.asarray(7, np.int64)
    return sd


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, jax_params):
    """Both torchrun jobs, started together: they overlap their start-up on the CPUs."""
    out, hsdp = tmp_path_factory.mktemp("torch_state"), tmp_path_factory.mktemp("torch_state_hsdp")
    jax_checkpoint = out / "jax_ckpt"
    fs.save(jax_checkpoint, {"model": _jax_model(jax_params, mesh_for("8")), "step": 11})
    ports = port_pairs(2)
    started = {
        "pair": Job(
            WORKER, out, WORLD, ports[0], JOB_TIMEOUT_S, "--jax-checkpoint", str(jax_checkpoint)
        ),
        "hsdp": Job(WORKER, hsdp, 4, ports[1], JOB_TIMEOUT_S, "--replicate", "2"),
    }
    yield started
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def job(jobs) -> tuple[Path, list[dict]]:
    return jobs["pair"].result()


@pytest.fixture(scope="module")
def hsdp_job(jobs) -> tuple[Path, list[dict]]:
    return jobs["hsdp"].result()


def _global_batch(step: int, world: int = WORLD):
    xs, ys = zip(*(batch(step, r) for r in range(world)), strict=True)
    return torch.cat(xs), torch.cat(ys)


def _reference(world: int) -> dict:
    """Plain torch on the unsharded model and the global batch, clipping as the worker."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict = {"initial": _numpy_state(model), "loss": []}
    for step in range(STEPS + 1):
        loss = loss_of(model, *_global_batch(step, world))
        loss.backward()
        if step == STEPS - 1:
            out["norms"] = [
                torch.nn.utils.clip_grad_norm_(model.parameters(), m, p).item() for m, p in CLIPS
            ]
            out["grad"] = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["loss"].append(loss.item())
        if step == STEPS - 1:
            out["full"] = _numpy_state(model)
            out["opt"] = {
                n: {k: v.numpy().copy() for k, v in opt.state[p].items()}
                for n, p in model.named_parameters()
            }
    out["final"] = _numpy_state(model)
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference(WORLD)


def _dim(key: str) -> int:
    return 1 if key == "mid.weight" else 0


def _chunk(full: np.ndarray, rank: int, dim: int = 0) -> np.ndarray:
    """`torch.chunk(full, WORLD, dim)[rank]`, empty where torch.chunk has no chunk."""
    size = math.ceil(full.shape[dim] / WORLD)
    start = min(rank * size, full.shape[dim])
    return np.take(full, range(start, min(start + size, full.shape[dim])), axis=dim)


def _assert_state(got: dict, want: dict, prefix: str, what: str, atol=TOLERANCE):
    keys = {k.split("/", 1)[1] for k in got if k.startswith(prefix + "/")}
    assert keys == set(want), what
    for key in want:
        np.testing.assert_allclose(
            got[f"{prefix}/{key}"], want[key], rtol=0, atol=atol, err_msg=f"{what}: {key}"
        )


# ---- two processes (one torchrun job) ----


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_process_training_with_clipping_matches_plain_torch(job, reference):
    _, ranks = job
    np.testing.assert_allclose(
        np.mean([r["loss"] for r in ranks], axis=0), reference["loss"], rtol=0, atol=TOLERANCE
    )
    for rank, r in enumerate(ranks):
        np.testing.assert_allclose(r["norms"], reference["norms"], rtol=1e-5)
        _assert_state(r, reference["full"], "full", "full_state_dict")
        _assert_state(r, reference["final"], "final", "after one more step")
        for name, grad in reference["grad"].items():
            local = r[f"grad/{name}"]
            np.testing.assert_allclose(
                local,
                _chunk(grad, rank, _dim(name)),
                rtol=0,
                atol=1e-6,
                err_msg=f"clipped grad {name}",
            )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_state_dict_after_forward_holds_local_shards(job, reference):
    # Step 0's forward left `inp` and the root gathered: the state dict still has shards.
    _, ranks = job
    params = dict(Net().named_parameters())
    for rank, r in enumerate(ranks):
        for key, full in reference["initial"].items():
            got = r[f"sd_after_forward/{key}"]
            want = _chunk(full, rank, _dim(key)) if key in params else full
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {key}")
    assert ranks[1]["sd_after_forward/out.weight"].shape == (0, 5)  # an empty shard


@pytest.mark.multiprocess
@pytest.mark.slow
def test_full_state_dict_rank0_only_and_load_full_state_dict_on_two_processes(job, reference):
    _, ranks = job
    assert [int(r["rank0_only_keys"]) for r in ranks] == [len(reference["full"]), 0]
    params = dict(Net().named_parameters())
    for rank, r in enumerate(ranks):
        for key, full in reference["full"].items():
            want = _chunk(full, rank, _dim(key)) if key in params else full
            np.testing.assert_allclose(
                r[f"loaded/{key}"], want, rtol=0, atol=TOLERANCE, err_msg=key
            )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpoint_resumes_on_the_same_two_processes(job, reference):
    _, ranks = job
    for r in ranks:
        assert int(r["resumed_step"]) == STEPS
        _assert_state(r, reference["final"], "resumed", "resumed training")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_jax_checkpoint_restores_into_two_processes(job, jax_params):
    _, ranks = job
    for r in ranks:
        assert int(r["from_jax_step"]) == 11
        _assert_state(r, jax_params, "from_jax", "restored from JAX", atol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torch_checkpoint_resumes_on_one_process(job, reference):
    out, ranks = job
    tf.init_distributed()
    model = shard(build(seed=4), tf.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert tf.restore(out / "torch_ckpt", model, opt) == STEPS
    _assert_state(_prefixed(tf.full_state_dict(model), "got"), reference["full"], "got", "restored")
    for name, param in model.named_parameters():
        for key, value in opt.state[param].items():
            shards = [r[f"opt/{name}/{key}"] for r in ranks]
            want = shards[0] if key == "step" else np.concatenate(shards, axis=_dim(name))
            np.testing.assert_array_equal(local(value), want, err_msg=f"{name} {key}")
            np.testing.assert_allclose(
                local(value), reference["opt"][name][key], rtol=0, atol=TOLERANCE
            )
    assert _param_groups(opt) == _param_groups(torch.optim.AdamW(Net().parameters(), lr=LR))
    loss_of(model, *_global_batch(STEPS)).backward()
    opt.step()
    _assert_state(_prefixed(tf.full_state_dict(model), "got"), reference["final"], "got", "resumed")


def _prefixed(sd: dict, prefix: str) -> dict:
    return {f"{prefix}/{k}": v.detach().numpy() for k, v in sd.items()}


def _jax_like(mesh) -> dict:
    template = build()
    zeros = {k: np.zeros_like(v) for k, v in _numpy_state(template).items()}
    params = {n: np.zeros(p.shape, np.float32) for n, p in template.named_parameters()}
    state = {
        n: {
            "exp_avg": fs.shard(z, mesh),
            "exp_avg_sq": fs.shard(z, mesh),
            "step": np.zeros((), np.float32),
        }
        for n, z in params.items()
    }
    groups = _param_groups(torch.optim.AdamW(template.parameters(), lr=LR))
    return {
        "model": _jax_model(zeros, mesh),
        "optimizer": {"state": state, "param_groups": groups},
        "step": 0,
    }


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["torch_ckpt", "torch_ckpt_async"])
def test_torch_checkpoint_restores_into_jax_on_8_devices(job, reference, name):
    out, _ = job
    restored = fs.restore(out / name, _jax_like(mesh_for("8")))
    assert restored["step"] == STEPS
    model = fs.state_dict(restored["model"])
    for key, want in reference["full"].items():
        np.testing.assert_allclose(model[f"['{key}']"], want, rtol=0, atol=TOLERANCE, err_msg=key)
    state = fs.state_dict(restored["optimizer"]["state"])
    for param, values in reference["opt"].items():
        for key, want in values.items():
            np.testing.assert_allclose(state[f"['{param}']['{key}']"], want, rtol=0, atol=TOLERANCE)
    assert restored["optimizer"]["param_groups"][0]["lr"] == LR


# ---- HSDP: 2 replicas x 2 shards (the 4-process job) ----


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_clip_and_checkpoint_match_plain_torch(hsdp_job):
    # The norm comes from the shard axis only: summed over the replicas too, it would
    # be sqrt(2) times torch's and the clipped step would differ.
    out, ranks = hsdp_job
    reference = _reference(4)
    np.testing.assert_allclose(
        np.mean([r["loss"] for r in ranks], axis=0),
        reference["loss"][:STEPS],
        rtol=0,
        atol=TOLERANCE,
    )
    for r in ranks:
        np.testing.assert_allclose(r["norms"], reference["norms"], rtol=1e-5)
        _assert_state(r, reference["full"], "full", "HSDP full_state_dict")
    restored = fs.restore(out / "torch_ckpt_hsdp", _jax_like(mesh_for("2x4")))
    assert restored["step"] == STEPS
    model = fs.state_dict(restored["model"])
    for key, want in reference["full"].items():
        np.testing.assert_allclose(model[f"['{key}']"], want, rtol=0, atol=TOLERANCE, err_msg=key)
    state = fs.state_dict(restored["optimizer"]["state"])
    for param, values in reference["opt"].items():
        for key, want in values.items():
            np.testing.assert_allclose(state[f"['{param}']['{key}']"], want, rtol=0, atol=TOLERANCE)


# ---- one process (world size 1), in this process ----


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 8))


def _sharded_mlp(reference: nn.Module, **kwargs) -> nn.Sequential:
    model = copy.deepcopy(reference)
    for layer in model:
        if isinstance(layer, nn.Linear):
            tf.fully_shard(layer, **kwargs)
    return tf.fully_shard(model)


def _x():
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def test_state_dict_between_forward_and_backward_keeps_training_exact():
    tf.init_distributed()
    reference = _mlp()
    model = _sharded_mlp(reference, reshard_after_forward=False)
    shards = dict(model.named_parameters())
    out = model(_x())
    assert model[0]._parameters["weight"] is not shards["0.weight"]  # the gathered one
    sd = model.state_dict(keep_vars=True)
    assert list(sd) == list(reference.state_dict())
    assert all(sd[k] is shards[k] for k in shards)  # the hooks bound the shards again
    out.pow(2).sum().backward()
    reference(_x()).pow(2).sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(local(ours.grad), theirs.grad, rtol=0, atol=1e-6, err_msg=name)


def test_full_state_dict_loads_into_plain_torch_and_back():
    tf.init_distributed()
    reference = _mlp()
    model = _sharded_mlp(reference)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_x()).sum().backward()
    opt.step()
    plain = _mlp()
    plain.load_state_dict(tf.full_state_dict(model))  # strict: every key, full shapes
    for (name, ours), theirs in zip(model.named_parameters(), plain.parameters(), strict=True):
        np.testing.assert_array_equal(local(ours), theirs.detach(), err_msg=name)
    fresh = _sharded_mlp(nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 8)))
    shards = list(fresh.parameters())
    tf.load_full_state_dict(fresh, plain.state_dict())
    assert all(a is b for a, b in zip(fresh.parameters(), shards, strict=True))  # loaded in place
    for ours, theirs in zip(fresh.parameters(), plain.parameters(), strict=True):
        np.testing.assert_array_equal(local(ours), theirs.detach())


def test_load_full_state_dict_names_every_bad_key():
    tf.init_distributed()
    model = _sharded_mlp(_mlp())
    sd = {k: v.clone() for k, v in _mlp().state_dict().items()}
    del sd["0.bias"]
    sd["2.weight"] = torch.zeros(8, 14)
    sd["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError) as info:
        tf.load_full_state_dict(model, sd)
    message = str(info.value)
    for part in (
        "missing key '0.bias'",
        "unexpected key 'extra.weight'",
        "key '2.weight' has shape (8, 14); the module's full tensor has shape (8, 15)",
    ):
        assert part in message


def test_sharded_load_state_dict_after_forward_and_with_assign():
    tf.init_distributed()
    source = _mlp()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(-2)
    want = source.state_dict()
    for assign in (False, True):
        model = _sharded_mlp(_mlp(), reshard_after_forward=False)
        shards = list(model.parameters())
        model(_x())  # gathered parameters bound: the load goes to the shards all the same
        # As with FSDP2, a sharded load takes DTensors placed as the module's parameters.
        sharded = {k: _like(v.clone(), model.state_dict()[k]) for k, v in want.items()}
        model.load_state_dict(sharded, assign=assign)
        if assign:  # as FSDP2's: the modules hold the assigned DTensors from now on
            assert all(
                a is not b and isinstance(a, DTensor)
                for a, b in zip(model.parameters(), shards, strict=True)
            )
        else:
            assert all(a is b for a, b in zip(model.parameters(), shards, strict=True))
        np.testing.assert_allclose(model(_x()).detach(), source(_x()).detach(), rtol=0, atol=1e-6)


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`full` placed as `target` (a DTensor), or `full` itself for a plain tensor."""
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full, target.device_mesh, target.placements)


def test_plain_tensors_into_a_sharded_load_state_dict_are_refused_as_by_fsdp2():
    tf.init_distributed()
    model = _sharded_mlp(_mlp())
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        model.load_state_dict(_mlp().state_dict())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_clip_grad_norm_matches_torch(norm_type):
    tf.init_distributed()
    reference = _mlp()
    model = _sharded_mlp(reference)
    for m in (model, reference):
        m(_x()).pow(2).sum().backward()
    got = tf.clip_grad_norm_(model.parameters(), 0.5, norm_type)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5, norm_type)
    assert got.shape == () and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(local(ours.grad), theirs.grad, rtol=1e-6, atol=1e-9)


def test_clip_grad_norm_errors():
    tf.init_distributed()
    model = _sharded_mlp(_mlp())
    with pytest.raises(ValueError, match="norm_type=0.0 is not supported"):
        tf.clip_grad_norm_(model.parameters(), 1.0, 0)
    model(_x()).sum().backward()
    model[0].weight.grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite"):
        tf.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)


def test_checkpoint_round_trip_in_one_process(tmp_path):
    tf.init_distributed()
    model = _sharded_mlp(_mlp())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(_x()).sum().backward()
    opt.step()
    opt.zero_grad()
    tf.save(tmp_path / "c", model, opt, step=1)
    with pytest.raises(FileExistsError):
        tf.save(tmp_path / "c", model)
    fresh = _sharded_mlp(nn.Sequential(nn.Linear(16, 15), nn.ReLU(), nn.Linear(15, 8)))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    assert tf.restore(tmp_path / "c", fresh, fresh_opt) == 1
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        np.testing.assert_array_equal(local(a), local(b))
        for key, value in opt.state[a].items():
            np.testing.assert_array_equal(local(value), local(fresh_opt.state[b][key]))
    for a, b in ((model, opt), (fresh, fresh_opt)):  # both train on alike
        a(_x()).sum().backward()
        b.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        np.testing.assert_array_equal(local(a), local(b))
    tf.save(tmp_path / "c", model, opt, step=2, overwrite=True)
    assert tf.restore(tmp_path / "c", fresh, fresh_opt) == 2


def test_restore_errors_name_every_offending_path(tmp_path):
    tf.init_distributed()
    model = _sharded_mlp(_mlp())
    opt = torch.optim.AdamW(model.parameters())
    model(_x()).sum().backward()
    opt.step()
    tf.save(tmp_path / "c", model, opt)
    tf.save(tmp_path / "model_only", model)
    with pytest.raises(ValueError, match="holds optimizer state; pass the optimizer"):
        tf.restore(tmp_path / "c", _sharded_mlp(_mlp()))
    with pytest.raises(ValueError, match="holds no optimizer state"):
        other = _sharded_mlp(_mlp())
        tf.restore(tmp_path / "model_only", other, torch.optim.AdamW(other.parameters()))
    wider = _sharded_mlp(
        nn.Sequential(nn.Linear(16, 14), nn.ReLU(), nn.Linear(14, 8), nn.Linear(8, 2))
    )
    with pytest.raises(ValueError) as info:
        tf.restore(tmp_path / "model_only", wider)
    message = str(info.value)
    for key in (
        "['model']['0.weight']",
        "['model']['0.bias']",
        "['model']['2.weight']",
        "['model']['3.weight']",
        "['model']['3.bias']",
    ):
        assert key in message
    with pytest.raises(FileNotFoundError):
        tf.restore(tmp_path / "nothing", model)


def test_jax_tree_restores_into_a_module_in_one_process(tmp_path):
    tf.init_distributed()
    source = _mlp()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1)
    fs.save(tmp_path / "jax", {"model": _jax_model(_numpy_state(source), mesh_for("2x4"))})
    model = _sharded_mlp(_mlp())
    assert tf.restore(tmp_path / "jax", model) is None
    for a, b in zip(model.parameters(), source.parameters(), strict=True):
        np.testing.assert_array_equal(local(a), local(b))


class _TiedWithIgnored(nn.Module):
    """Tied weights in one group, and a parameter no fully_shard manages."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 6)
        self.head.weight = self.emb.weight
        self.gain = nn.Parameter(torch.linspace(1.0, 2.0, 6))

    def forward(self, x):
        return self.head(self.emb(x)) * self.gain


def _sharded_tied() -> _TiedWithIgnored:
    model = _TiedWithIgnored()
    tf.fully_shard([model.emb, model.head])
    return tf.fully_shard(model, ignored_params={model.gain})


def test_tied_and_unmanaged_parameters_round_trip(tmp_path):
    tf.init_distributed()
    model, plain = _sharded_tied(), _TiedWithIgnored()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 6)
    model(x).sum().backward()
    opt.step()
    full = tf.full_state_dict(model)
    assert list(full) == list(plain.state_dict())  # both names of the tied weight
    assert full["emb.weight"] is full["head.weight"]
    plain.load_state_dict(full)
    tf.save(tmp_path / "c", model, opt, step=2)
    fresh = _sharded_tied()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert tf.restore(tmp_path / "c", fresh, fresh_opt) == 2
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        np.testing.assert_array_equal(local(a), local(b), err_msg=name)
        for key, value in opt.state[a].items():
            np.testing.assert_array_equal(
                local(value), local(fresh_opt.state[b][key]), err_msg=f"{name} {key}"
            )
    np.testing.assert_array_equal(fresh(x).detach(), plain(x).detach())
