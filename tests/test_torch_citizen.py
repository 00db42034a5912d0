"""torch_frontend as a citizen of torch.distributed, against PyTorch's FSDP2 and plain torch.

A torchtitan-style script (`tests/_torch_citizen_worker.py`: `init_device_mesh`,
per-block `fully_shard`, stock `clip_grad_norm_`, `dist.all_reduce` for logging,
`torch.distributed.checkpoint` of `get_state_dict`) runs with FSDP2's `fully_shard` and
with ours in the same torchrun job, on 2 processes and on 2x2 HSDP. Its checkpoints are
loaded here on one process, and a checkpoint written here is loaded on two. The
in-process tests (world size 1) run FSDP2 beside the frontend on the same process group.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from _launch import Job, port_pairs
from _torch_citizen_worker import (
    FP16_GRAD,
    INT64,
    LR,
    MAX_NORM,
    SAVE_AT,
    STEPS,
    Ints,
    Titan,
    batch,
    build,
    full_state,
    load,
    save,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_shard
from torch.distributed.tensor import DTensor, Shard

import torch_frontend as tf

pytestmark = pytest.mark.torch

WORKER = Path(__file__).with_name("_torch_citizen_worker.py")
JOB_TIMEOUT_S = 150
WORLD = 2
IMPLS = ("frontend", "fsdp2")


def _mesh1():
    tf.init_distributed()
    return init_device_mesh("cpu", (1,))


def _shard_fn(impl: str):
    return tf.fully_shard if impl == "frontend" else fsdp2_shard


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """A one-process checkpoint written here, then the 2-process and HSDP jobs, together."""
    one = tmp_path_factory.mktemp("citizen_one")
    mesh = _mesh1()
    model = build(tf.fully_shard, mesh, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    F.cross_entropy(model(batch(0, 0)[0]).flatten(0, 1), batch(0, 0)[1].flatten()).backward()
    opt.step()
    save(model, opt, one / "dcp")
    one_state = full_state(model)
    pair, hsdp = tmp_path_factory.mktemp("citizen_pair"), tmp_path_factory.mktemp("citizen_hsdp")
    ports = port_pairs(2)
    started = {
        "pair": Job(
            WORKER, pair, WORLD, ports[0], JOB_TIMEOUT_S, "--one-process-ckpt", str(one / "dcp")
        ),
        "hsdp": Job(WORKER, hsdp, 4, ports[1], JOB_TIMEOUT_S, "--replicate", "2"),
    }
    yield started, one_state
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def pair(jobs):
    return jobs[0]["pair"].result()


@pytest.fixture(scope="module")
def hsdp(jobs):
    return jobs[0]["hsdp"].result()


def _global_batch(step: int, world: int = WORLD):
    parts = [batch(step, rank) for rank in range(world)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])


@pytest.fixture(scope="module")
def plain():
    """The script's model in plain torch on the global batch: losses and grad norms."""
    torch.manual_seed(0)
    model = Titan()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _global_batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return np.asarray(losses), np.asarray(norms)


def _assert_same(ours: dict, theirs: dict, ours_prefix: str, theirs_prefix: str, **tol):
    keys = [k[len(theirs_prefix) :] for k in theirs if k.startswith(theirs_prefix)]
    assert keys
    for key in keys:
        np.testing.assert_allclose(
            ours[ours_prefix + key], theirs[theirs_prefix + key], err_msg=key, **tol
        )


# ---- the torchtitan-style script on two processes ----


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_script_logs_global_losses_and_grad_norms_as_plain_torch(pair, plain, impl):
    # Stock clip_grad_norm_ over DTensor gradients: the norm is global, not the shard's.
    _, ranks = pair
    for r in ranks:
        np.testing.assert_allclose(r[f"{impl}/loss"], plain[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(r[f"{impl}/norm"], plain[1], rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_script_is_bit_equal_to_fsdp2(pair):
    _, ranks = pair
    for r in ranks:
        for what in ("loss", "norm", "resumed_loss"):
            np.testing.assert_array_equal(r[f"frontend/{what}"], r[f"fsdp2/{what}"], err_msg=what)
        _assert_same(r, r, "frontend/final/", "fsdp2/final/", rtol=0, atol=0)
        _assert_same(r, r, "frontend/saved/", "fsdp2/saved/", rtol=0, atol=0)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_checkpoint_resumes_on_two_processes(pair, impl):
    _, ranks = pair
    for r in ranks:
        np.testing.assert_array_equal(r[f"{impl}/resumed_loss"], r[f"{impl}/loss"][SAVE_AT:])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_dcp_metadata_records_global_shapes(pair):
    out, _ = pair
    shapes = {}
    for impl in IMPLS:
        metadata = dcp.FileSystemReader(str(out / f"dcp-{impl}")).read_metadata()
        shapes[impl] = {
            k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")
        }
    assert shapes["frontend"]["model.emb.weight"] == (47, 16)
    assert shapes["frontend"]["optim.state.emb.weight.exp_avg"] == (47, 16)
    assert shapes["frontend"] == shapes["fsdp2"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("writer", IMPLS)
@pytest.mark.parametrize("reader", IMPLS)
def test_dcp_checkpoint_of_two_processes_loads_on_one(pair, writer, reader):
    out, ranks = pair
    model = build(_shard_fn(reader), _mesh1(), seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    load(model, opt, out / f"dcp-{writer}")
    got = {f"got/{k}": v for k, v in full_state(model).items()}
    _assert_same(got, ranks[0], "got/", f"{writer}/saved/", rtol=0, atol=0)
    # The optimizer state came along: the next steps on the global batch are the same.
    losses = []
    for step in range(SAVE_AT, STEPS):
        x, y = _global_batch(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, ranks[0][f"{writer}/loss"][SAVE_AT:], rtol=0, atol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_dcp_checkpoint_of_one_process_loads_on_two(jobs, pair, impl):
    _, one_state = jobs
    _, ranks = pair
    for r in ranks:
        for key, want in one_state.items():
            np.testing.assert_array_equal(r[f"{impl}/from_one/{key}"], want, err_msg=key)
    np.testing.assert_array_equal(
        ranks[0]["frontend/from_one_loss"], ranks[0]["fsdp2/from_one_loss"]
    )


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_script_with_init_device_mesh_is_bit_equal_to_fsdp2(hsdp):
    _, ranks = hsdp
    for r in ranks:
        for what in ("loss", "norm", "resumed_loss"):
            np.testing.assert_array_equal(r[f"frontend/{what}"], r[f"fsdp2/{what}"], err_msg=what)
        _assert_same(r, r, "frontend/final/", "fsdp2/final/", rtol=0, atol=0)
        np.testing.assert_array_equal(r["frontend/resumed_loss"], r["frontend/loss"][SAVE_AT:])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hsdp_dcp_checkpoint_loads_on_one_process(hsdp):
    out, ranks = hsdp
    model = build(tf.fully_shard, _mesh1(), seed=5)
    load(model, torch.optim.AdamW(model.parameters(), lr=LR), out / "dcp-frontend")
    got = {f"got/{k}": v for k, v in full_state(model).items()}
    _assert_same(got, ranks[0], "got/", "fsdp2/saved/", rtol=0, atol=0)


# ---- dtypes on two processes ----


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_int64_parameters_keep_their_values_on_two_processes(pair, impl):
    _, ranks = pair
    for r in ranks:
        assert r[f"{impl}/int64/seen"].dtype == np.int64
        np.testing.assert_array_equal(r[f"{impl}/int64/seen"], INT64)
        np.testing.assert_array_equal(r[f"{impl}/int64/full"], INT64)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_reduce_dtype_pre_divides_as_fsdp2(pair, impl):
    # 40000 + 40000 overflows float16; halving each first (FSDP2) keeps the mean exact.
    _, ranks = pair
    for r in ranks:
        np.testing.assert_array_equal(r[f"{impl}/fp16/grad"], [FP16_GRAD, FP16_GRAD])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_float64_model_trains_in_float64_as_fsdp2(pair):
    _, ranks = pair
    for r in ranks:
        assert set(r["frontend/dtypes/float64"]) == {"torch.float64"}
        np.testing.assert_array_equal(r["frontend/float64/loss"], r["fsdp2/float64/loss"])
        _assert_same(r, r, "frontend/float64/", "fsdp2/float64/", rtol=0, atol=0)
        assert r["frontend/float64/emb.weight"].dtype == np.float64


# ---- one process, beside FSDP2 ----


def test_init_distributed_opens_torch_default_process_group():
    tf.init_distributed()
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (0, 1)
    total = torch.tensor([3.0])
    dist.all_reduce(total)
    dist.barrier()
    assert total.item() == 3.0
    mesh = tf.device_mesh()
    # Equal to FSDP2's default mesh (no dim names), so DTensors of the two compare equal.
    assert mesh == init_device_mesh("cpu", (1,)) and mesh.size() == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_parameters_are_dtensors_sharded_on_the_mesh(impl):
    mesh = _mesh1()
    model = build(_shard_fn(impl), mesh)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.placements == (Shard(0),) and param.device_mesh == mesh, name
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for v in sd.values())
    torch.manual_seed(0)
    for (name, ours), theirs in zip(model.named_parameters(), Titan().parameters(), strict=True):
        torch.testing.assert_close(ours.full_tensor(), theirs.detach(), rtol=0, atol=0, msg=name)


def test_int64_parameter_round_trips_on_one_process():
    model = tf.fully_shard(Ints(), mesh=_mesh1(), reshard_after_forward=False)
    model(torch.ones(2)).backward()
    assert model.seen.dtype == torch.int64 and model.seen.tolist() == INT64
    assert tf.full_state_dict(model)["table"].tolist() == INT64


def test_float64_model_refuses_float32_input_like_plain_torch():
    tf.init_distributed()
    torch.manual_seed(0)
    plain = nn.Linear(4, 3).to(torch.float64)
    model = tf.fully_shard(copy.deepcopy(plain))
    with pytest.raises(RuntimeError, match="dtype"):
        plain(torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.ones(2, 4))
    x = torch.randn(2, 4, dtype=torch.float64)
    out = model(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, plain(x), rtol=0, atol=0)
    assert tf.full_state_dict(model)["weight"].dtype == torch.float64


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Linear(9, 5))


def _shard_mlp(model: nn.Sequential, shard_fn, mesh) -> nn.Sequential:
    for layer in (model[0], model[2]):
        shard_fn(layer, mesh=mesh)
    return shard_fn(model, mesh=mesh)


def _train_mlp(model, dtype, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_to_float64_after_fully_shard_is_honoured_as_by_fsdp2():
    # PyTorch's test_to_float64_after_init: the gathers must move the float64 data.
    mesh = _mesh1()
    plain = _mlp().to(torch.float64)
    runs = {}
    for impl in IMPLS:
        model = _shard_mlp(_mlp(), _shard_fn(impl), mesh).to(torch.float64)
        assert all(p.dtype == torch.float64 and isinstance(p, DTensor) for p in model.parameters())
        runs[impl] = (_train_mlp(model, torch.float64), model)
    want = _train_mlp(plain, torch.float64)
    assert runs["frontend"][0] == runs["fsdp2"][0]
    np.testing.assert_allclose(runs["frontend"][0], want, rtol=0, atol=1e-12)
    model = runs["frontend"][1]
    for (name, ours), theirs in zip(
        model.named_parameters(), runs["fsdp2"][1].parameters(), strict=True
    ):
        assert ours.dtype == torch.float64, name
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=0, atol=0)


def test_get_and_set_model_state_dict_full_and_sharded_as_fsdp2():
    mesh = _mesh1()
    source = _mlp(seed=3)
    models = {impl: _shard_mlp(_mlp(), _shard_fn(impl), mesh) for impl in IMPLS}
    for model in models.values():
        set_model_state_dict(
            model, source.state_dict(), options=StateDictOptions(full_state_dict=True)
        )
    x = torch.randn(3, 6)
    for impl, model in models.items():
        torch.testing.assert_close(model(x), source(x), rtol=0, atol=0, msg=impl)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        assert all(not isinstance(v, DTensor) for v in full.values())
        for key, value in source.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=0)
        sharded = get_model_state_dict(model)
        assert all(
            isinstance(v, DTensor) and v.shape == source.state_dict()[k].shape
            for k, v in sharded.items()
        )
    # A sharded state dict of one loads into the other.
    target = _shard_mlp(_mlp(seed=9), tf.fully_shard, mesh)
    set_model_state_dict(target, get_model_state_dict(models["fsdp2"]))
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
def test_meta_device_init_recipe_matches_fsdp2():
    # FSDP2's recipe for a model larger than a host: build on meta, shard, then
    # materialise each rank's shard with to_empty and initialise it in place.
    mesh = _mesh1()
    results = {}
    for impl in IMPLS:
        with torch.device("meta"):
            model = Titan()
        for block in model.blocks:
            _shard_fn(impl)(block, mesh=mesh)
        _shard_fn(impl)(model, mesh=mesh)
        assert all(p.is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        torch.manual_seed(11)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        x, y = batch(0, 0)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        results[impl] = (
            loss.item(),
            full_state(model),
            {n: p.grad.full_tensor() for n, p in model.named_parameters()},
        )
    assert results["frontend"][0] == results["fsdp2"][0]
    for key, value in results["fsdp2"][1].items():
        np.testing.assert_array_equal(results["frontend"][1][key], value, err_msg=key)
    for key, value in results["fsdp2"][2].items():
        torch.testing.assert_close(results["frontend"][2][key], value, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support")
def test_fully_shard_first_called_under_the_meta_device_context(monkeypatch):
    # FSDP2's recipe may call fully_shard (mesh=None) for the first time inside
    # `with torch.device("meta")`, where the default torch mesh is made: it failed
    # with "Cannot copy out of meta tensor" unless an earlier call had made it.
    from torch_frontend import _distributed

    tf.init_distributed()
    monkeypatch.setattr(_distributed, "_device_meshes", {})
    monkeypatch.setattr(_distributed, "_jax_meshes", {})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        tf.fully_shard(model[0])
        tf.fully_shard(model)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert all(p.device.type == "cpu" for p in model.parameters())
    model(torch.ones(2, 4)).sum().backward()


def test_load_state_dict_assign_on_a_meta_model_adopts_the_new_dtensors():
    # FSDP2's rank-0 broadcast recipe: a sharded state dict of DTensors loaded with
    # assign=True into a meta-device model. The parameters must become those DTensors
    # (device cpu, not meta, as FSDP2's), and train as the plain model.
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh1()
    torch.manual_seed(0)
    reference = _mlp()
    with torch.device("meta"):
        model = _mlp()
    tf.fully_shard(model, mesh=mesh)
    sharded = {
        name: nn.Parameter(distribute_tensor(value.detach().clone(), mesh, [Shard(0)]))
        for name, value in reference.state_dict().items()
    }
    model.load_state_dict(sharded, assign=True)
    for name, param in model.named_parameters():
        assert param is sharded[name] and param.device.type == "cpu", name
    x = torch.randn(3, 6)
    model(x).sum().backward()
    reference(x).sum().backward()
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad.full_tensor(), theirs.grad, rtol=0, atol=0, msg=name)


def test_a_0d_parameter_is_a_value_error_in_fsdp2s_words():
    tf.init_distributed()
    model = nn.Linear(2, 2)
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="Change scale to a 1D tensor with numel equal to 1"):
        tf.fully_shard(model)


def test_a_3d_mesh_is_a_value_error_in_fsdp2s_words():
    _mesh1()
    mesh = init_device_mesh("cpu", (1, 1, 1))
    for shard in (tf.fully_shard, fsdp2_shard):
        with pytest.raises(
            ValueError,
            match=r"fully_shard expects a 1D or 2D DeviceMesh but "
            r"got DeviceMesh",
        ):
            shard(nn.Linear(2, 2), mesh=mesh)


def test_forward_on_meta_parameters_is_a_clear_error():
    tf.init_distributed()
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    tf.fully_shard(model)
    with pytest.raises(RuntimeError, match=r"still on meta device: \['weight', 'bias'\]"):
        model(torch.ones(2, 4))


def test_a_parameter_replaced_after_fully_shard_is_an_error_at_the_next_forward():
    tf.init_distributed()
    model = _shard_mlp(_mlp(), tf.fully_shard, None)
    model(torch.ones(2, 6))
    model[0].weight = nn.Parameter(torch.zeros(9, 6))
    with pytest.raises(ValueError, match=r"parameter '0\.weight' was replaced after fully_shard"):
        model(torch.ones(2, 6))


def test_layer_by_layer_sharding_with_gc_has_no_false_positive():
    # PyTorch's test_layer_by_layer_shard_no_false_positive: a freed parameter's id()
    # comes back for the next layer's; identity must not be judged by it.
    # Whether the next layer's parameters land in the freed slots depends on what else
    # was allocated meanwhile, so layers are added until one does (at least 8).
    tf.init_distributed()
    layers, ids = [], []
    while len(layers) < 8 or (len(set(ids)) == len(ids) and len(layers) < 64):
        layer = nn.Linear(8, 8)
        ids += [id(p) for p in layer.parameters()]
        tf.fully_shard(layer)
        layers.append(layer)
        gc.collect()
    assert len(set(ids)) < len(ids)  # a freed parameter's id was reused: the case at hand
    model = tf.fully_shard(nn.Sequential(*layers))
    reference = nn.Sequential(*(nn.Linear(8, 8) for _ in layers))
    reference.load_state_dict(tf.full_state_dict(model))
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_fully_shard_of_a_child_after_its_parent_is_an_error():
    # FSDP2 would build a second group over the same parameters (on 2 ranks: a gloo
    # size mismatch, then an abort); every rank raises here, at the call.
    tf.init_distributed()
    model = tf.fully_shard(_mlp())
    with pytest.raises(ValueError, match=r"'weight' is already managed by another FSDP group"):
        tf.fully_shard(model[0])


# torch 2.14's Dynamo, wrapping a compiled block's non-leaf input (model[2] gets model[1]'s
# output), reads its `.grad` in `wrap_tensor`: `hasattr(t, "grad")` in `safe_has_grad`
# (torch/_dynamo/variables/builder.py:376 in 2.14.1), then `t.grad` in `safe_grad`
# (torch/_subclasses/meta_utils.py:103). Both hide the non-leaf `.grad` warning by swapping
# `warnings.showwarning` (`torch._logging.hide_warnings`), which a filter that turns
# warnings into errors runs before, so it raises here. Plain torch does the same (an
# `nn.Linear`'s `.compile()` fed a non-leaf, no fully_shard), as does FSDP2; on 2.13 this
# test does not reach them. Ignored only where those two modules warn: an access from
# torch_frontend or the test is still an error.
_NON_LEAF_GRAD = "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning:"


@pytest.mark.filterwarnings(_NON_LEAF_GRAD + r"torch\._dynamo\.variables\.builder\Z")
@pytest.mark.filterwarnings(_NON_LEAF_GRAD + r"torch\._subclasses\.meta_utils\Z")
def test_torch_compile_per_block_trains_as_fsdp2():
    # `block.compile()` after fully_shard compiles the module's call, hooks included:
    # Dynamo must run the frontend's hooks eagerly (FSDP2's default) rather than trace
    # them into JAX (it failed on an internal NameError). "aot_eager" traces exactly as
    # Inductor does, without its C++ compile, which takes minutes on these machines.
    mesh = _mesh1()
    runs = {}
    for impl in IMPLS:
        torch._dynamo.reset()
        model = _mlp()
        for layer in (model[0], model[2]):
            _shard_fn(impl)(layer, mesh=mesh)
            layer.compile(backend="aot_eager")
        runs[impl] = _train_mlp(_shard_fn(impl)(model, mesh=mesh), torch.float32)
    torch._dynamo.reset()
    assert runs["frontend"] == runs["fsdp2"]
    np.testing.assert_allclose(runs["frontend"], _train_mlp(_mlp(), torch.float32), rtol=1e-6)
