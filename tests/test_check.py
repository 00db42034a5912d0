"""`fs.check`: a step's compiled collectives against the policy it declares.

Each planted mistake of issue 46 is found with its classification, bytes and (where the
HLO metadata has it) the line it was written at; a correct step is clean on 1 device,
8 devices and 2x4 HSDP. The references are the compiled programs' own HLO, read by
`funshard._hlo` (tested in test_hlo_parse.py), and `fs.plan`'s rules (test_plan.py
holds them against compiled steps).
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from _models import mlp_layer, mlp_params, mse
from _util import mlp_batch
from conftest import mesh_for

import funshard as fs
from funshard import errors

BF16 = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16)


def _state(mesh_name="8", policy=None):
    return fs.shard(mlp_params(jax.random.key(0)), mesh_for(mesh_name), mp_policy=policy)


def _loss(extra=None, **unit_options):
    """The MLP with one unit per layer; `extra(h)` is added to the loss times 0."""
    unit = fs.fully_shard(mlp_layer, name="mlp_block", **unit_options)

    def loss(state, batch):
        h = batch[0]
        for p in state["layers"]:
            h = unit(p, h)
        out = mse(h * state["scale"], batch[1])
        return out if extra is None else out + 0.0 * extra(h)

    return loss


def _train(step, opt):
    def train(state, opt_state, batch):
        loss, grads = step(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    return train


@pytest.mark.parametrize(
    "mesh_name, microbatches, sync", [("1", 1, True), ("8", 1, True), ("2x4", 2, False)]
)
def test_a_correct_step_is_clean(mesh_name, microbatches, sync):
    state = _state(mesh_name)
    step = fs.value_and_grad(_loss(), microbatches=microbatches, sync_every_microbatch=sync)
    report = fs.check(step, state, mlp_batch())
    assert report.ok, report.table()
    assert report.mismatches == ()
    assert report.table().splitlines()[0].endswith("✓ the compiled step matches its policy")
    units = [c for c in report.collectives if c.unit == "mlp_block"]
    if mesh_name == "1":
        assert not units  # nothing moves on one device
        return
    # Every gather and reduce-scatter of the unit ran as often as the policy declares.
    forward = [c for c in units if c.role == "forward"]
    assert len(forward) == 3 and all(c.times == c.planned_times == microbatches for c in forward)
    scatters = [c for c in units + list(report.collectives) if c.kind == "reduce-scatter"]
    assert scatters and all(c.times == c.planned_times for c in scatters)
    assert all(c.axes == ("fsdp",) for c in forward)
    assert report.temp_bytes > 0 and report.gathered_bytes > 0


def test_a_whole_train_step_with_donation_is_clean():
    state, opt = _state("2x4"), optax.adamw(1e-3)
    opt_state = fs.init_optimizer(opt, state)
    train = jax.jit(_train(fs.value_and_grad(_loss()), opt), donate_argnums=(0, 1))
    report = fs.check(train, state, opt_state, mlp_batch())
    assert report.ok, report.table()
    # The check compiles; it does not run the step: the donated buffers stay valid.
    leaves = jax.tree.leaves((state, opt_state))
    assert not any(x.is_deleted() for x in leaves if isinstance(x, jax.Array))


@pytest.mark.parametrize("kind", ["psum", "all_gather"])
def test_a_collective_in_the_loss_is_unplanned_with_its_bytes_and_line(kind):
    def extra(h):
        if kind == "psum":
            return jax.lax.psum(jnp.sum(h), "fsdp")  # 4 bytes
        return jnp.sum(jax.lax.all_gather(h, "fsdp", tiled=True))

    line = extra.__code__.co_firstlineno + (2 if kind == "psum" else 3)
    report = fs.check(fs.value_and_grad(_loss(extra)), _state("8"), mlp_batch())
    assert not report.ok
    [found] = report.mismatches
    assert found.kind == "unplanned" and found.unit is None
    assert found.collective == ("all-reduce" if kind == "psum" else "all-gather")
    assert found.source == f"{__file__}:{line} ({extra.__qualname__})"
    # A psum of one f32; a gather of the (16, 5) f32 activations (2 rows per device).
    assert found.bytes == (4 if kind == "psum" else 16 * 5 * 4)
    assert "fsdp" in found.explanation and f"{__file__}:{line}" in found.explanation
    allowed = fs.check(
        fs.value_and_grad(_loss(extra)), _state("8"), mlp_batch(), allow=["unplanned"]
    )
    # (jax 0.11+ also notes the first unit's re-gather, left out as dead code)
    assert allowed.ok and "unplanned" in [m.kind for m in allowed.notes]


def test_hand_written_accumulation_reduces_every_microbatch():
    """The accumulation loop of NVIDIA/cosmos-framework #161, around fs.value_and_grad:
    the reduce-scatters run once per microbatch, not once per step."""
    step = fs.value_and_grad(_loss())

    def accumulated(state, batch):
        def body(total, microbatch):
            loss, grads = step(state, microbatch)
            return jax.tree.map(jnp.add, total, grads), loss

        split = jax.tree.map(lambda x: x.reshape(4, -1, *x.shape[1:]), batch)
        grads, losses = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, state), split)
        return losses.mean(), grads

    state = _state("8")
    report = fs.check(accumulated, state, mlp_batch(32))
    multiplied = {m.collective: m for m in report.mismatches if m.kind == "multiplied"}
    assert "reduce-scatter" in multiplied, report.table()
    assert "runs 12 times per step where its policy declares 3 (4x)" in (
        multiplied["reduce-scatter"].explanation
    )
    reduced = fs.plan(state, units={"mlp_block": "layers"}).bytes("reduce-scatter")
    assert multiplied["reduce-scatter"].bytes == 3 * reduced
    # The same accumulation as the policy: one reduce-scatter per leaf group and step.
    deferred = fs.value_and_grad(_loss(), microbatches=4, sync_every_microbatch=False)
    assert fs.check(deferred, state, mlp_batch(32)).ok


def test_a_bf16_reduction_on_the_cpu_is_a_platform_note():
    report = fs.check(fs.value_and_grad(_loss()), _state("8", BF16), mlp_batch())
    assert report.ok, report.table()
    [note] = [m for m in report.notes if m.kind == "platform"]
    assert note.collective == "reduce-scatter" and "bf16" in note.explanation
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert {(c.dtype, c.planned_dtype) for c in scatters} == {("f32", "bf16")}


def test_a_custom_gather_that_ignores_its_declared_float8_is_found():
    """torchtitan #3123: an fp8 all-gather flag ignored moves 4x the bytes declared."""

    def ignored(block, axes):
        return jax.lax.all_gather(block, axes, tiled=True)

    def fp8(block, axes):
        low = jax.lax.all_gather(block.astype(jnp.float8_e4m3fn), axes, tiled=True)
        return low.astype(block.dtype)

    declared = dict(bytes_per_element=1, label="float8_e4m3fn")
    wrong = fs.value_and_grad(_loss(all_gather=fs.AllGather(ignored, **declared)))
    report = fs.check(wrong, _state("8"), mlp_batch())
    assert {(m.kind, m.collective) for m in report.mismatches} == {("dtype", "all-gather")}
    assert all("f8e4m3fn" in m.explanation for m in report.mismatches)
    right = fs.value_and_grad(_loss(all_gather=fs.AllGather(fp8, **declared)))
    assert fs.check(right, _state("8"), mlp_batch()).ok  # f8 moves as f16 on the CPU


def test_an_updated_state_that_is_not_donated_is_found():
    state, opt = _state("8"), optax.sgd(0.1)
    opt_state = fs.init_optimizer(opt, state)
    train = jax.jit(_train(fs.value_and_grad(_loss()), opt))
    report = fs.check(train, state, opt_state, mlp_batch())
    [found] = report.mismatches  # sgd keeps no per-parameter state
    assert found.kind == "donation" and "donate_argnums=0" in found.explanation
    assert found.bytes == fs.plan(state).params.per_device


def test_strict_raises_listing_every_mismatch():
    step = fs.value_and_grad(_loss(lambda h: jax.lax.psum(jnp.sum(h), "fsdp")))
    with pytest.raises(errors.PolicyMismatchError, match="unplanned: all-reduce"):
        fs.check(step, _state("8"), mlp_batch(), strict=True)
    fs.check(fs.value_and_grad(_loss()), _state("8"), mlp_batch(), strict=True)


def test_bad_input_is_a_typed_error_saying_what_check_expects():
    state = _state("8")
    with pytest.raises(TypeError, match="function you would jax.jit"):
        fs.check(3, state)
    with pytest.raises(TypeError, match="no fs.value_and_grad"):
        fs.check(lambda x: x * 2, jnp.ones(3))
    with pytest.raises(TypeError, match="does not lower for the arguments given"):
        fs.check(fs.value_and_grad(_loss()), state)  # the batch is missing
    with pytest.raises(ValueError, match="names no mismatch kind"):
        fs.check(fs.value_and_grad(_loss()), state, mlp_batch(), allow=["typo"])


@pytest.mark.parametrize(
    "case", ["microbatches-one-unit-keeps", "hsdp-frozen-all-reduce-at-end", "hpz", "scan"]
)
def test_the_plan_tests_steps_are_clean(case):
    """test_plan.py's steps (their collectives hold against fs.plan there): units that
    keep their parameters, frozen leaves with the HSDP all-reduce at the end, hpZ, and a
    stack under fs.scan in bf16 on HSDP."""
    import test_plan as tp

    if case == "scan":
        state = tp._stacked_state(mesh_for("2x4"), tp.BF16)
        step = tp._scanned_step("scan", True, microbatches=2)
    else:
        spec = dict(tp.CASES[case])
        name = spec.pop("mesh")
        mesh = tp._split_mesh() if name == "split" else mesh_for(name)
        layout = {"shard_axis": spec.pop("shard_axis")} if "shard_axis" in spec else {}
        reshard = spec.pop("reshard", True)
        by_unit = reshard if isinstance(reshard, dict) else dict.fromkeys(tp.UNITS, reshard)
        state = fs.shard(tp._params(), mesh, **layout)
        step = tp._step(by_unit, **spec)
    report = fs.check(step, state, tp.BATCH)
    assert report.ok, report.table()
    assert any(c.unit and c.times for c in report.collectives)


def test_a_tensor_parallel_block_on_an_nd_mesh_is_clean():
    """The Megatron block of test_model_axes.py on (replicate=2, fsdp=2, tensor=2): its
    gathers run over `fsdp`, its HSDP all-reduces over `replicate`, and the
    tensor-parallel sums over `tensor` are the model's own, not a mismatch."""
    import test_model_axes as tm

    mesh = tm._mesh(replicate=2, fsdp=2, tensor=2)
    state = fs.shard(tm.gpt_params(), mesh, model_spec=tm.GPT_SPEC)
    block = fs.fully_shard(lambda p, b: tm.gpt_block(p, b, "tensor"), name="block")
    step = fs.value_and_grad(lambda s, b: jnp.mean(block(s, b) ** 2), microbatches=2)
    report = fs.check(step, state, tm._batch())
    assert report.ok, report.table()
    axes = {(c.kind, c.role): c.axes for c in report.collectives if c.unit == "block"}
    assert axes[("all-gather", "forward")] == ("fsdp",)
    assert axes[("all-reduce", "replicas")] == ("replicate",)
    assert any(c.axes == ("tensor",) and c.unit is None for c in report.collectives)


def test_jaxs_unusable_donation_warning_becomes_a_mismatch():
    """Where JAX finds a donated buffer no output can reuse, it warns 'Some donated
    buffers were not usable'; the check reports that as a donation mismatch. (On the
    CPU, XLA keeps such buffers as donors for its temporaries and JAX stays silent, so
    the warning's text is handed in here.)"""
    from funshard.planning import _check

    step = jax.jit(fs.value_and_grad(_loss()), donate_argnums=1)
    lowered = step.lower(_state("8"), mlp_batch())
    warned = "Some donated buffers were not usable: float32[16,13].\nSee an explanation at ..."
    [found] = _check._donation(lowered, [warned], step, ())
    assert found.kind == "donation" and "float32[16,13]" in found.explanation
    assert "See an explanation" not in found.explanation


@pytest.mark.parametrize(
    "options",
    [dict(sync_every_microbatch=False), dict(all_reduce_every_microbatch=False)],
    ids=["deferred-reduce-scatter", "postponed-all-reduce"],
)
def test_identical_layers_of_one_unit_reduced_after_the_loop_are_clean(options):
    """Three layers of one shape through one unit: the reductions after the microbatch
    loop cover every layer's gradient, not one per distinct layout."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"layers": [{"w": jax.random.normal(k, (16, 16)), "b": jnp.zeros(16)} for k in keys]}
    block = fs.fully_shard(lambda p, h: jnp.tanh(h @ p["w"] + p["b"]), name="block")

    def loss(state, batch):
        h, y = batch
        for p in state["layers"]:
            h = block(p, h)
        return jnp.mean((h - y) ** 2)

    state = fs.shard(params, mesh_for("2x4"))
    batch = (jnp.ones((16, 16)), jnp.ones((16, 16)))
    report = fs.check(fs.value_and_grad(loss, microbatches=2, **options), state, batch)
    assert report.ok, report.table()
    after = [c for c in report.collectives if c.unit == "root"]
    assert after and all(c.times == c.planned_times for c in after)
