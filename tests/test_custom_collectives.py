"""Units' own collectives (`fs.AllGather`, `fs.ReduceScatter`): FSDP2's custom comm hooks.

Numbers are compared with the same model on one device (`jax.value_and_grad` of the
global-batch mean loss); bytes and kinds of collectives are read from the compiled HLO;
docs/training.md's two worked examples run as printed.
"""

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _docs import python_block
from conftest import MESHES, mesh_for
from flax import nnx
from hypothesis import given, settings
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import funshard as fs
from funshard import errors
from tests import _hlo

PAGE = "training.md"
BF16, INT8 = "A bf16 reduce-scatter", "An int8 block-quantized reduce-scatter"


def _example(heading: str) -> str:
    """The first Python block under the `### ` heading that starts with `heading`."""
    return python_block(PAGE, heading, level=3)


_RAN: dict[str, dict] = {}


def _ran(heading: str) -> dict:
    """The namespace of the example under `heading`, run once per session (it checks
    itself against the f32 model on one device as it runs)."""
    if heading not in _RAN:
        namespace: dict = {}
        exec(compile(_example(heading), f"{PAGE}: {heading}", "exec"), namespace)
        _RAN[heading] = namespace
    return _RAN[heading]


@pytest.mark.parametrize("heading", [BF16, INT8])
def test_worked_example_runs_as_printed(heading):
    assert "state" in _ran(heading)


def _step_hlo(ns: dict, reduce_scatter) -> str:
    unit = fs.fully_shard(ns["block"], reduce_scatter=reduce_scatter)
    step = jax.jit(fs.value_and_grad(ns["make_loss"](unit)))
    return step.lower(ns["state"], ns["x"]).compile().as_text()


def _bytes(text: str, kind: str) -> int:
    ops, _ = _hlo._parser.executed_collectives(text, 8)
    return sum(op["bytes"] * op["times"] for op in ops if op["kind"] == kind)


@pytest.mark.parametrize("heading,ratio", [(BF16, 0.5), (INT8, 0.254)])
def test_the_examples_move_their_bytes_in_the_compiled_program(heading, ratio):
    """The custom reductions are all-to-alls of bf16 / int8 + f32 scales, and no
    reduce-scatter is left; their bytes against the default f32 reduce-scatter's are
    what the page and the plan say (int8: <= 0.3x, the issue's bound)."""
    ns = _ran(heading)
    custom = ns["BF16_REDUCTION" if heading == BF16 else "INT8_REDUCTION"]
    text, default = _step_hlo(ns, custom), _step_hlo(ns, None)
    assert _hlo.count_by_kind(text)["reduce-scatter"] == 0
    assert _hlo.count_by_kind(default)["reduce-scatter"] == 2  # one per unit
    dtypes = {c["dtype"] for c in _hlo.collectives(text) if c["kind"] == "all-to-all"}
    assert dtypes == ({"u16"} if heading == BF16 else {"s8", "f32"})  # bf16 as its bits
    sent, f32 = _bytes(text, "all-to-all"), _bytes(default, "reduce-scatter")
    assert sent / f32 == pytest.approx(ratio, rel=0.02)
    assert heading == BF16 or sent / f32 <= 0.3
    units = {"block0": (0,), "block1": (1,)}
    planned = fs.plan(ns["state"], units=units, reduce_scatter=custom)
    assert planned.bytes("reduce-scatter") == pytest.approx(sent, rel=0.02)
    assert fs.plan(ns["state"], units=units).bytes("reduce-scatter") == f32
    labels = {c.dtype for c in planned.collectives if c.kind == "reduce-scatter"}
    assert labels == {"bfloat16" if heading == BF16 else "int8"}


def test_int8_reduction_error_is_within_its_bound_value_by_value():
    """|quantized sum - exact sum| <= sum over devices of half the scale of the block
    each value travelled in, for every value; gradients of very different magnitudes
    per device and per block, a block of zeros, and a buffer that is not a multiple of
    the block size."""
    ns = _ran(INT8)
    block = ns["BLOCK"]
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Explicit,))
    cols = 3 * block + 17
    keys = jax.random.split(jax.random.key(1), 2)
    data = jax.random.normal(keys[0], (8, 8 * cols))
    data = data * jnp.exp(3 * jax.random.normal(keys[1], (8, 1)))  # magnitudes per device
    data = data.reshape(8, 8, cols).at[:, :, :block].set(0.0).reshape(8, 8 * cols)
    data = jax.device_put(data, jax.NamedSharding(mesh, P("fsdp")))

    def both(x):
        x = x[0]
        return (
            ns["int8_reduce_scatter"](x, ("fsdp",))[None],
            jax.lax.psum_scatter(x, "fsdp", tiled=True)[None],
        )

    spec = P("fsdp")
    quantized, exact = jax.jit(
        jax.shard_map(both, mesh=mesh, in_specs=spec, out_specs=(spec, spec))
    )(data)
    # The bound, from the values each device sent: its block scales, per receiving device.
    rows = np.asarray(data).reshape(8, 8, cols)  # [sender, receiver, value]
    padded = np.pad(rows, ((0, 0), (0, 0), (0, -cols % block)))
    scales = np.abs(padded.reshape(8, 8, -1, block)).max(-1) / 127
    half = np.repeat(scales, block, axis=-1)[..., :cols] / 2
    bound = half.sum(0)  # [receiver, value]
    err = np.abs(np.asarray(quantized) - np.asarray(exact))
    assert np.all(err <= bound * (1 + 1e-5) + 1e-6), (err / np.maximum(bound, 1e-30)).max()
    assert np.all(np.asarray(quantized)[:, :block] == 0.0)
    assert 0.1 < (err / np.maximum(bound, 1e-30))[:, block:].max() <= 1.0  # a real bound


# ---- identity collectives: every form of unit gives plain JAX's numbers --------------------


class Recorder:
    """A collective that runs the default's JAX call and records what it was given."""

    def __init__(self, kind: str):
        self.kind, self.calls = kind, []

    def __call__(self, buffer, axes):
        self.calls.append((buffer.shape, np.dtype(buffer.dtype), axes))
        if self.kind == "all-gather":
            return jax.lax.all_gather(buffer, axes, tiled=True)
        return jax.lax.psum_scatter(buffer, axes, tiled=True)


def _collectives():
    gather, reduce = Recorder("all-gather"), Recorder("reduce-scatter")
    return (
        gather,
        reduce,
        dict(all_gather=fs.AllGather(gather), reduce_scatter=fs.ReduceScatter(reduce)),
    )


WIDTH = 12
F32 = np.dtype("float32")


def _block(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]


def _layers(n=3, seed=0):
    k = jax.random.split(jax.random.key(seed), 3 * n)
    return [
        {
            "w": jax.random.normal(k[3 * i], (WIDTH, 2 * WIDTH)) / 4,
            "b": 0.1 * jax.random.normal(k[3 * i + 1], (2 * WIDTH,)),
            "v": jax.random.normal(k[3 * i + 2], (2 * WIDTH, WIDTH)) / 5,
        }
        for i in range(n)
    ]


def _x():
    return jax.random.normal(jax.random.key(7), (16, WIDTH))


def _loop_loss(run):
    def loss_fn(layers, x):
        for p in layers:
            x = run(p, x)
        return jnp.mean(x**2)

    return loss_fn


def _assert_close(grads, ref, rtol=1e-5, atol=1e-6):
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(g, r, rtol=rtol, atol=atol)


FORMS = ["unit", "unit-keep", "hsdp", "scan", "lax_scan"]


@pytest.mark.parametrize("form", FORMS)
def test_identity_collectives_give_plain_jax_numbers(form):
    """A unit whose own collectives run the default's JAX calls trains as plain JAX,
    and each of them is called once per gather / reduction, on the buffer the page
    documents (f32, the unit's elements per device, the shard axes)."""
    gather, reduce, custom = _collectives()
    layers, x = _layers(), _x()
    ref_loss, ref = jax.value_and_grad(_loop_loss(_block))(layers, x)
    mesh = fs.make_mesh(2 if form == "hsdp" else None)
    if form in ("scan", "lax_scan"):
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
        state = fs.shard(stacked, mesh, stacked=True)
        if form == "scan":

            def loss_fn(s, x):
                return jnp.mean(fs.scan(lambda p, h: _block(p, h), s, x, **custom) ** 2)

        else:

            def loss_fn(s, x):
                h, _ = fs.lax_scan(lambda h, p: (_block(p, h), None), x, s, **custom)
                return jnp.mean(h**2)

        loss, grads = jax.jit(fs.value_and_grad(loss_fn))(state, x)
        ref = jax.tree.map(lambda *a: jnp.stack(a), *ref)
    else:
        unit = fs.fully_shard(_block, reshard_after_forward=form != "unit-keep", **custom)
        state = fs.shard(layers, mesh)
        loss, grads = jax.jit(fs.value_and_grad(_loop_loss(unit)))(state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), ref)
    # One layer's rows per device: w (12, 24) and v (24, 12) and b (24,), each padded
    # to a multiple of the shard count on dim 0 (8 shards: 2 + 3 + 3 rows; 4: 3 + 6 + 6).
    shards, n = (4, 3 * 24 + 6 * 12 + 6) if form == "hsdp" else (8, 2 * 24 + 3 * 12 + 3)
    assert set(gather.calls) == {((n,), np.dtype("float32"), ("fsdp",))}
    assert set(reduce.calls) == {((shards * n,), np.dtype("float32"), ("fsdp",))}


def test_a_unit_of_bf16_parameters_hands_its_gather_bf16_values():
    """Under a bf16 `param_dtype` the gather buffer travels as bf16 (uint16 bits inside
    funshard); the user's function sees bf16 values, and its result is what the default
    gives, bit for bit."""
    gather, reduce, custom = _collectives()
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    state = fs.shard(_layers(2), fs.make_mesh(), mp_policy=policy)
    x = _x()
    out = {}
    for name, kwargs in (("custom", custom), ("default", {})):
        unit = fs.fully_shard(_block, **kwargs)
        out[name] = jax.jit(fs.value_and_grad(_loop_loss(unit)))(state, x)
    assert {c[1] for c in gather.calls} == {np.dtype(jnp.bfloat16)}
    assert {c[1] for c in reduce.calls} == {np.dtype("float32")}
    assert out["custom"][0] == out["default"][0]
    for a, b in zip(
        jax.tree.leaves(out["custom"][1]), jax.tree.leaves(out["default"][1]), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_outside_a_step_the_units_gather_runs_too():
    """Evaluation (a unit called outside `fs.value_and_grad`) gathers with the unit's
    own all-gather, so a lossy gather evaluates as it trains: here one that rounds to
    bf16, against the same rounding done by hand."""

    def bf16_gather(block, axes):
        rounded = block.astype(jnp.bfloat16).astype(block.dtype)
        return jax.lax.all_gather(rounded, axes, tiled=True)

    layers, x = _layers(1), _x()
    unit = fs.fully_shard(_block, all_gather=fs.AllGather(bf16_gather))
    state = fs.shard(layers[0], fs.make_mesh())
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), layers[0])
    np.testing.assert_allclose(unit(state, x), _block(rounded, x), rtol=1e-6, atol=1e-6)
    assert not np.allclose(unit(state, x), _block(layers[0], x), rtol=1e-6, atol=1e-6)


def test_tensor_split_leaves_run_the_units_collectives_over_their_data_axes():
    """On `fsdp=4 x tensor=2` a unit holds a column- and a row-parallel kernel beside a
    replicated bias: both sets of leaves go through the unit's own collectives, each
    over its own data axes, and the gradients are plain JAX's."""
    gather, reduce, custom = _collectives()
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
    k = jax.random.split(jax.random.key(3), 3)
    params = {
        "w": jax.random.normal(k[0], (WIDTH, 2 * WIDTH)) / 4,
        "v": jax.random.normal(k[1], (2 * WIDTH, WIDTH)) / 5,
        "b": 0.1 * jax.random.normal(k[2], (WIDTH,)),
    }
    spec = {"w": P(None, "tensor"), "v": P("tensor", None), "b": None}

    def block(p, x):  # Megatron's MLP: the row-parallel output summed over "tensor"
        return x + jax.lax.psum(jnp.tanh(x @ p["w"]) @ p["v"], "tensor") + p["b"]

    def plain(p, x):
        return x + jnp.tanh(x @ p["w"]) @ p["v"] + p["b"]

    x = _x()
    ref_loss, ref = jax.value_and_grad(lambda p, x: jnp.mean(plain(p, x) ** 2))(params, x)
    unit = fs.fully_shard(block, **custom)
    state = fs.shard(params, mesh, shard_axis="fsdp", model_spec=spec)
    loss, grads = jax.jit(fs.value_and_grad(lambda s, x: jnp.mean(unit(s, x) ** 2)))(state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), ref)
    # Two collectives of each kind per trace, one per set of leaves: (w, v), split over
    # "tensor" (blocks of 12 x 12: 3 rows each per device), and b (3 rows), both over
    # "fsdp" only.
    assert set(gather.calls) == {((2 * 3 * 12,), F32, ("fsdp",)), ((3,), F32, ("fsdp",))}
    assert set(reduce.calls) == {((4 * 72,), F32, ("fsdp",)), ((4 * 3,), F32, ("fsdp",))}


# ---- Flax units -------------------------------------------------------------------------


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
        self.out = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + self.out(jnp.tanh(self.fc(x)))


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(WIDTH)(jnp.tanh(nn.Dense(2 * WIDTH)(x)))


def test_nnx_unit_runs_its_own_collectives():
    gather, reduce, custom = _collectives()
    model = _NnxBlock(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    x = _x()

    def loss_fn(state, x):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    ref_loss, ref = jax.value_and_grad(loss_fn)(params, x)
    fs.flax.fully_shard(model, **custom)
    graphdef, state = fs.flax.shard(model, fs.make_mesh())
    loss, grads = jax.jit(fs.value_and_grad(loss_fn))(state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_close(nnx.to_pure_dict(fs.unshard(grads)), nnx.to_pure_dict(ref))
    assert gather.calls and reduce.calls
    planned = fs.flax.plan(model, fs.make_mesh())
    assert planned.count("reduce-scatter") == 1


def test_linen_unit_runs_its_own_collectives():
    gather, reduce, custom = _collectives()
    x = _x()
    variables = _LinenBlock().init(jax.random.key(0), x)

    def loss_with(module):
        return lambda params, x: jnp.mean(module.apply({"params": params}, x) ** 2)

    ref_loss, ref = jax.value_and_grad(loss_with(_LinenBlock()))(variables["params"], x)
    unit = fs.flax.fully_shard(_LinenBlock, **custom)()
    state = fs.shard(variables["params"], fs.make_mesh())
    loss, grads = jax.jit(fs.value_and_grad(loss_with(unit)))(state, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), ref)
    assert gather.calls and reduce.calls


# ---- bad input ------------------------------------------------------------------------------


def test_a_result_of_another_shape_is_an_error_naming_the_unit():
    def short(buffer, axes):
        return jax.lax.psum_scatter(buffer, axes, tiled=True)[:-1]

    unit = fs.fully_shard(_block, reduce_scatter=fs.ReduceScatter(short), name="mlp3")
    state = fs.shard(_layers(1), fs.make_mesh())
    with pytest.raises(
        errors.ShardingValueError, match=r"unit 'mlp3'.*reduce-scatter.*psum_scatter"
    ):
        jax.jit(fs.value_and_grad(_loop_loss(unit)))(state, _x())

    def wide(block, axes):
        return jax.lax.all_gather(block, axes, tiled=True).astype(jnp.float16)

    unit = fs.fully_shard(_block, all_gather=fs.AllGather(wide), name="mlp4")
    with pytest.raises(errors.ShardingValueError, match=r"unit 'mlp4'.*all-gather.*float16"):
        jax.jit(fs.value_and_grad(_loop_loss(unit)))(state, _x())


def test_bad_collective_objects_are_refused_when_the_unit_is_made():
    with pytest.raises(
        TypeError, match=r"all_gather must be a funshard.AllGather.*fs.AllGather\(fn\)"
    ):
        fs.fully_shard(_block, all_gather=lambda b, axes: b)
    with pytest.raises(TypeError, match="reduce_scatter must be a funshard.ReduceScatter"):
        fs.scan(_block, None, None, reduce_scatter=fs.AllGather(lambda b, a: b))
    with pytest.raises(TypeError, match="fn must be a function"):
        fs.AllGather(3)
    with pytest.raises(ValueError, match="bytes_per_element must be a positive number"):
        fs.ReduceScatter(lambda b, a: b, bytes_per_element=0)
    with pytest.raises(TypeError, match="fs.flax.fully_shard: all_gather"):
        fs.flax.fully_shard(_LinenBlock, all_gather="bf16")


def test_what_units_do_not_support_yet_is_refused():
    _, _, custom = _collectives()
    mesh = jax.make_mesh((2, 4), ("outer", "inner"), axis_types=(AxisType.Auto,) * 2)
    state = fs.shard(_layers(1), mesh, shard_axis=("outer", "inner"))
    unit = fs.fully_shard(_block, reshard_after_forward=4, all_gather=custom["all_gather"])
    with pytest.raises(NotImplementedError, match="custom all-gather.*hpZ"):
        jax.jit(fs.value_and_grad(_loop_loss(unit)))(state, _x())
    unit = fs.fully_shard(_block, reduce_scatter=custom["reduce_scatter"])
    step = fs.value_and_grad(_loop_loss(unit), microbatches=2, sync_every_microbatch=False)
    with pytest.raises(NotImplementedError, match="custom reduce-scatter.*sync_every_microbatch"):
        jax.jit(step)(state, _x())
    with pytest.raises(NotImplementedError, match="custom reduce-scatter.*sync_every_microbatch"):
        fs.plan(
            state,
            units={"a": (0,)},
            reduce_scatter=custom["reduce_scatter"],
            sync_every_microbatch=False,
        )
    with pytest.raises(ValueError, match=r"plan: all_gather names \['b'\], which are not units"):
        fs.plan(state, units={"a": (0,)}, all_gather={"b": custom["all_gather"]})


# ---- properties and compositions ----------------------------------------------------------

LEAF_DTYPES = [np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("int32")]


@st.composite
def _units(draw):
    """A unit's leaves (2-D, uneven, size 0 and 1 dims; f32, bf16, int32 mixed) and a mesh."""
    count = draw(st.integers(1, 3))
    shapes = [
        (draw(st.sampled_from([0, 1, 3, 9])), draw(st.sampled_from([1, 4]))) for _ in range(count)
    ]
    dtypes = [draw(st.sampled_from(LEAF_DTYPES)) for _ in range(count)]
    return shapes, dtypes, draw(st.sampled_from(list(MESHES)))


@settings(max_examples=10)
@given(_units())
def test_identity_collectives_are_bit_identical_to_the_defaults(unit_leaves):
    """Over random leaves and every test mesh (1, 2, 4, 8 devices and 2x4 HSDP), a unit
    whose own collectives run the default's JAX calls returns the default's output and
    gradients bit for bit, in a step and outside one; a unit of mixed dtypes hands its
    gather unsigned words, one of a single float dtype that dtype."""
    shapes, dtypes, mesh_name = unit_leaves
    rng = np.random.default_rng(0)
    params = {
        f"p{i}": (rng.standard_normal(s) * 3).astype(d)
        for i, (s, d) in enumerate(zip(shapes, dtypes, strict=True))
    }
    state = fs.shard(params, mesh_for(mesh_name))
    x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)

    def layer(p, x):
        out = x
        for leaf in p.values():
            out = out * jnp.tanh(jnp.sum(leaf.astype(jnp.float32)) / 10 + 1)
        return out

    gather, _, custom = _collectives()
    results = []
    for kwargs in (custom, {}):
        unit = fs.fully_shard(layer, **kwargs)
        step = jax.jit(
            fs.value_and_grad(
                lambda s, x, unit=unit: jnp.mean(unit(s, x) ** 2),
                trainable={k: v.dtype != np.int32 for k, v in params.items()},
            )
        )
        results.append((step(state, x), unit(state, x)))
    (got, got_eval), (want, want_eval) = results
    for a, b in zip(
        jax.tree.leaves((got, got_eval)), jax.tree.leaves((want, want_eval)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    seen = {c[1] for c in gather.calls}
    if len(set(dtypes)) == 1:
        assert seen <= set(dtypes), gather.calls  # f32 as itself, bf16 as bf16 (not bits)
    else:
        assert all(jnp.issubdtype(d, jnp.unsignedinteger) for d in seen), gather.calls


COMPOSITIONS = {
    "checkpoint": lambda unit: jax.checkpoint(unit),
    "vmap": lambda unit: lambda p, h: jax.vmap(lambda row: unit(p, row[None])[0])(h),
    # A predicate equal on every device (one from this device's rows is refused).
    "cond": lambda unit: lambda p, h: jax.lax.cond(jnp.array(True), unit, lambda p, h: h, p, h),
}


@pytest.mark.parametrize("form", [*COMPOSITIONS, "microbatches"])
def test_compositions_with_the_units_collectives_are_plain_jax(form):
    """The unit's own collectives under jax.checkpoint, vmap, cond and microbatches give
    plain JAX's numbers (the int8 reduction of docs/training.md, to its precision)."""
    int8 = _ran(INT8)["INT8_REDUCTION"]
    gather, _, custom = _collectives()
    unit = fs.fully_shard(_block, all_gather=custom["all_gather"], reduce_scatter=int8)
    run = COMPOSITIONS[form](unit) if form in COMPOSITIONS else unit
    layers, x = _layers(2), _x()
    ref_loss, ref = jax.value_and_grad(_loop_loss(_block))(layers, x)
    step = fs.value_and_grad(_loop_loss(run), microbatches=2 if form == "microbatches" else 1)
    loss, grads = jax.jit(step)(fs.shard(layers, fs.make_mesh()), x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(ref), strict=True):
        assert float(jnp.linalg.norm(g - r) / jnp.linalg.norm(r)) < 2e-2
    assert gather.calls
