"""Structural facts of the compiled training step, read from the HLO and XLA's analyses."""

import re

import _models
import jax
import jax.numpy as jnp
import pytest
from _hlo import collectives, compiled, count_by_kind
from _models import HEADS, block_apply
from conftest import mesh_for
from jax.ad_checkpoint import checkpoint_name

import funshard as fs

pytestmark = pytest.mark.slow

LAYERS, WIDTH, ROWS = 5, 256, 256


def _deep_mlp(policy=None, mesh_name="8"):
    keys = jax.random.split(jax.random.key(0), LAYERS)
    params = [{"w": jax.random.normal(k, (WIDTH, WIDTH)) / 16, "b": jnp.zeros(WIDTH)} for k in keys]
    batch = (jnp.ones((ROWS, WIDTH)), jnp.ones((ROWS, WIDTH)))
    return fs.shard(params, mesh_for(mesh_name), mp_policy=policy), batch


def _step(reshard_after_forward=True, units=True):
    layer = fs.fully_shard(
        lambda p, h: jnp.tanh(h @ p["w"] + p["b"]), reshard_after_forward=reshard_after_forward
    )

    def loss(state, batch):
        h, y = batch
        if units:
            for p in state:
                h = layer(p, h)
        else:
            for p in fs.unshard(state):
                h = jnp.tanh(h @ p["w"] + p["b"])
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    return fs.value_and_grad(loss)


@pytest.fixture(scope="module")
def programs():
    state, batch = _deep_mlp()
    return {rf: compiled(_step(rf), state, batch) for rf in (True, False)}


def test_reduce_scatter_and_no_parameter_sized_all_reduce(programs):
    _, text = programs[True]
    found = collectives(text)
    assert any(c["kind"] == "reduce-scatter" for c in found)
    all_reduces = [c for c in found if c["kind"] == "all-reduce"]
    assert all(c["elements"] <= 1 for c in all_reduces), all_reduces  # only the loss mean
    assert not any(c["kind"] in ("all-to-all", "collective-permute") for c in found)


def test_one_collective_per_unit_not_per_leaf(programs):
    counts = count_by_kind(programs[False][1])
    # 5 units of 2 leaves each: 5 gathers forward, 5 reduce-scatters backward.
    assert counts["all-gather"] == LAYERS and counts["reduce-scatter"] == LAYERS


def test_whole_model_unshard_is_one_collective():
    state, batch = _deep_mlp()
    counts = count_by_kind(compiled(_step(units=False), state, batch)[1])
    assert counts["all-gather"] == 1 and counts["reduce-scatter"] == 1


def test_reshard_after_forward_regathers_saves_memory_and_not_flops(programs):
    exe_true, text_true = programs[True]
    exe_false, text_false = programs[False]
    gathers_true = count_by_kind(text_true)["all-gather"]
    gathers_false = count_by_kind(text_false)["all-gather"]
    assert gathers_false == LAYERS
    # Every unit but possibly the last (whose backward starts right after its forward)
    # gathers again for backward.
    assert gathers_true >= 2 * LAYERS - 1
    temp_true = exe_true.memory_analysis().temp_size_in_bytes
    temp_false = exe_false.memory_analysis().temp_size_in_bytes
    assert temp_true < 0.6 * temp_false, (temp_true, temp_false)
    flops_true = exe_true.cost_analysis()["flops"]
    flops_false = exe_false.cost_analysis()["flops"]
    assert abs(flops_true - flops_false) <= 0.02 * flops_false, (flops_true, flops_false)


def _block_stack(blocks, width, ff, seq):
    """Compiled gradient programs of a stack of transformer blocks: (plain jax.grad on
    one device's rows on one device, the funshard step over 8 devices, unit bytes)."""
    keys = jax.random.split(jax.random.key(0), blocks)
    params = [_models.block_params(k, d=width, ff=ff)["block"] for k in keys]
    x = jax.random.normal(jax.random.key(1), (8, seq, width))
    apply = lambda p, h: block_apply(p, h, HEADS)  # noqa: E731
    unit = fs.fully_shard(apply)

    def plain_loss(params, h):
        for p in params:
            h = apply(p, h)
        return jnp.mean(h**2)

    def loss(state, h):
        for p in state:
            h = unit(p, h)
        return jnp.mean(h**2)

    plain, _ = compiled(jax.grad(plain_loss), params, x[:1])
    exe, _ = compiled(fs.grad(loss), fs.shard(params, mesh_for("8")), x)
    return plain, exe, 4 * sum(v.size for v in params[0].values())


def test_only_a_few_units_are_ever_gathered_at_once():
    """FSDP2's memory promise, from the compiled program: with reshard_after_forward=True
    the step's temp bytes exceed plain JAX's (one device, same local batch, parameters
    and gradients outside temp) by a few units' worth (the flat buffer and its copy-out,
    the gradients and the reduce-scatter's copy-in), not by the whole model.

    Transformer blocks use their small leaves (LayerNorm gains, biases) in elementwise
    ops whose results the backward pass needs: if XLA may read those leaves straight out
    of the gathered flat buffer, every block's buffer stays alive until the backward
    pass (10 units here instead of 3.4).

    A unit's backward residuals are what plain JAX's fused program keeps: saving every
    value of its `jax.vjp` (the GELU's internals, the LayerNorm's centred values, ...)
    held 3.4 units' worth more (3.6 on the wider stack)."""
    for blocks, width, ff, seq in ((6, 64, 256, 16), (4, 128, 512, 64)):
        plain, exe, unit_bytes = _block_stack(blocks, width, ff, seq)
        temps = (
            exe.memory_analysis().temp_size_in_bytes,
            plain.memory_analysis().temp_size_in_bytes,
        )
        assert temps[0] - temps[1] <= 2.5 * unit_bytes, ((temps[0] - temps[1]) / unit_bytes, width)


def test_unit_boundaries_stop_recomputation_chains():
    """Per-device FLOPs of a deep residual stack stay within 2% of plain JAX's on the
    same local batch.

    Without a fusion boundary at unit outputs XLA recomputes the residual stream
    `h + a_1 + a_2 + ...` from all its terms inside every later block's backward fusions:
    4% more FLOPs than plain JAX here, growing with the square of the depth (and about
    twice the memory traffic on the benchmark model)."""
    plain, exe, _ = _block_stack(blocks=10, width=16, ff=40, seq=32)
    ours, reference = exe.cost_analysis()["flops"], plain.cost_analysis()["flops"]
    assert ours <= 1.02 * reference, ours / reference


def test_fusion_boundaries_per_platform():
    """Each unit has 4 fusion boundaries (forward and backward copy-out, its output and
    that output's cotangent). XLA GPU keeps `optimization_barrier` through fusion, so
    that is what a GPU program gets; XLA CPU deletes barriers first, so on CPU they are
    conditionals on the device index (never used on GPU: a GPU conditional syncs with
    the host). Lowered, not compiled, so no GPU is needed."""
    units = 3
    params = [
        _models.block_params(k, d=16, ff=40)["block"]
        for k in jax.random.split(jax.random.key(0), units)
    ]
    unit = fs.fully_shard(lambda p, h: block_apply(p, h, HEADS))

    def loss(state, h):
        for p in state:
            h = unit(p, h)
        return jnp.mean(h**2)

    traced = jax.jit(fs.grad(loss)).trace(fs.shard(params, mesh_for("8")), jnp.ones((8, 4, 16)))
    count = {}
    for platform in ("cpu", "cuda"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        count[platform] = {
            op: text.count(f"stablehlo.{op}")
            for op in ("optimization_barrier", "case", "partition_id")
        }
    cpu, gpu = count["cpu"], count["cuda"]
    assert cpu["optimization_barrier"] == 0, count
    assert cpu["case"] - gpu["case"] == 4 * units, count  # the others fold: constant index
    assert gpu["optimization_barrier"] == 4 * units and gpu["partition_id"] == 0, count


def test_activation_checkpointing_is_a_separate_choice(programs):
    """jax.checkpoint around a unit recomputes it: more FLOPs than plain resharding."""
    state, batch = _deep_mlp()
    layer = fs.fully_shard(jax.checkpoint(lambda p, h: jnp.tanh(h @ p["w"] + p["b"])))

    def loss(state, batch):
        h, y = batch
        for p in state:
            h = layer(p, h)
        return jnp.mean((h - y) ** 2)

    exe, _ = compiled(fs.value_and_grad(loss), state, batch)
    assert exe.cost_analysis()["flops"] > 1.1 * programs[True][0].cost_analysis()["flops"]


@pytest.mark.parametrize("saved", [(), ("first",)])
def test_a_checkpoint_inside_a_scanned_layer_is_the_users_choice(saved):
    """`fs.scan` saves a layer's non-elementwise values; a layer the user wrapped in
    `jax.checkpoint` recomputes what the user's policy says instead (under an outer policy
    JAX would save the inner matmul outputs, and the checkpoint would recompute nothing)."""
    state, batch = _deep_mlp()
    layers = jax.tree.map(lambda *xs: jnp.stack(xs), *fs.unshard(state))
    stack = fs.shard(layers, mesh_for("8"), stacked=True)

    def layer(p, h):
        first = checkpoint_name(jnp.tanh(h @ p["w"] + p["b"]), "first")
        return jnp.tanh(first @ p["w"])

    def step(layer):
        def loss(stack, batch):
            h, y = batch
            return jnp.mean((fs.scan(layer, stack, h) - y) ** 2)

        return fs.value_and_grad(loss)

    policy = jax.checkpoint_policies.save_only_these_names(*saved)
    flops = {
        name: compiled(step(fn), stack, batch)[0].cost_analysis()["flops"]
        for name, fn in (("plain", layer), ("checkpoint", jax.checkpoint(layer, policy=policy)))
    }
    # 2 matmuls per layer forward and 4 backward; the checkpoint recomputes the second
    # (7/6), or both (8/6) where nothing is saved.
    assert flops["checkpoint"] > (1.1 if saved else 1.25) * flops["plain"], flops


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_bf16_param_dtype_gathers_16_bit(reshard_after_forward):
    state, batch = _deep_mlp(fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16))
    _, text = compiled(_step(reshard_after_forward), state, batch)
    gathers = [c for c in collectives(text) if c["kind"] == "all-gather"]
    assert gathers and all(c["dtype"] in ("bf16", "u16") for c in gathers), gathers


@pytest.mark.parametrize(
    "policy,reduce_type",
    [
        (fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16), "bf16"),
        (fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32), "f32"),
        (None, "f32"),
    ],
)
def test_reduce_scatter_runs_in_reduce_dtype(policy, reduce_type):
    # XLA CPU widens bf16 reductions after lowering, so read the program as funshard
    # emitted it (StableHLO) for the reduction dtype.
    state, batch = _deep_mlp(policy)
    lowered = jax.jit(_step(True)).lower(state, batch).as_text()
    operand_types = re.findall(
        r'"stablehlo\.reduce_scatter".*?\}\) : \(tensor<[0-9x]*x(\w+)>\)', lowered, re.DOTALL
    )
    assert operand_types == [reduce_type] * LAYERS


def test_hsdp_reduce_scatter_then_all_reduce_of_the_shard():
    state, batch = _deep_mlp(mesh_name="2x4")
    _, text = compiled(_step(True), state, batch)
    found = collectives(text)
    scatters = [c for c in found if c["kind"] == "reduce-scatter"]
    reduces = [c for c in found if c["kind"] == "all-reduce" and c["elements"] > 1]
    assert len(scatters) == LAYERS
    shard_elements = (WIDTH * WIDTH + WIDTH) // 4
    # XLA CPU combines the per-unit all-reduces into tuples; in total they move exactly
    # the scattered shards, never a full-size gradient.
    assert all(c["groups"] == "{{0,4},{1,5},{2,6},{3,7}}" for c in reduces), reduces
    assert sum(c["elements"] for c in reduces) == LAYERS * shard_elements
