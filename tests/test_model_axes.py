"""FSDP composed with tensor and expert parallelism: per-leaf model axes on N-D meshes.

Every number is compared with the same model on one device (`jax.value_and_grad` of the
global-batch mean loss, with the full parameters); every structural claim (which
collectives, over which devices, how many elements) is read from the compiled HLO.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import funshard as fs
from funshard import errors
from tests import _hlo

# ---- meshes -----------------------------------------------------------------------------


def _mesh(**axes):
    names = tuple(axes)
    return jax.make_mesh(tuple(axes.values()), names, axis_types=(AxisType.Auto,) * len(names))


def _groups(mesh, axes) -> str:
    """The replica groups of a collective over `axes` of `mesh`, as the HLO spells them."""
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    order = [mesh.axis_names.index(a) for a in mesh.axis_names if a not in axes]
    order += [mesh.axis_names.index(a) for a in axes]
    size = math.prod(mesh.shape[a] for a in axes)
    rows = np.transpose(ids, order).reshape(-1, size)
    rows = sorted(tuple(sorted(r)) for r in rows.tolist())
    return "{" + ",".join("{" + ",".join(map(str, r)) + "}" for r in rows) + "}"


def _collectives(step, *args):
    """The collectives of the jitted `step` on `args`: the program it just ran (its own
    lowering hits jit's cache; wrapping it in another jit would compile it again)."""
    return _hlo.collectives(step.lower(*args).compile().as_text())


# ---- a Megatron-style GPT block ---------------------------------------------------------

D, HEADS, HEAD_DIM, FF, SEQ = 16, 4, 4, 18, 4

GPT_SPEC = {
    "ln1": None,
    "wq": P(None, "tensor"),
    "wk": P(None, "tensor"),
    "wv": P(None, "tensor"),
    "wo": P("tensor", None),
    "ln2": None,
    "w_in": P(None, "tensor"),
    "b_in": P("tensor"),
    "w_out": P("tensor", None),
    "b_out": None,
}


def gpt_params(seed=0):
    return _gpt_params(seed)


@jax.jit  # one program for every seed, not a compile per eager op and leaf shape
def _gpt_params(seed):
    k = jax.random.split(jax.random.key(seed), 10)
    inner = HEADS * HEAD_DIM
    return {
        "ln1": 1.0 + 0.1 * jax.random.normal(k[0], (D,)),
        "wq": jax.random.normal(k[1], (D, inner)) / 4,
        "wk": jax.random.normal(k[2], (D, inner)) / 4,
        "wv": jax.random.normal(k[3], (D, inner)) / 4,
        "wo": jax.random.normal(k[4], (inner, D)) / 4,
        "ln2": 1.0 + 0.1 * jax.random.normal(k[5], (D,)),
        "w_in": jax.random.normal(k[6], (D, FF)) / 4,
        "b_in": 0.1 * jax.random.normal(k[7], (FF,)),
        "w_out": jax.random.normal(k[8], (FF, D)) / 4,
        "b_out": 0.1 * jax.random.normal(k[9], (D,)),
    }


def _norm(x, scale):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def gpt_block(p, x, tensor=None):
    """One pre-norm block; `tensor` names the model axis the per-device version splits
    heads and the MLP over (None: the plain model on one device)."""

    def row(h, w, b=None):
        return fs.row_parallel(h, w, b, axis=tensor) if tensor else fs.column_parallel(h, w, b)

    b, s, _ = x.shape
    h = _norm(x, p["ln1"])
    q, k, v = (fs.column_parallel(h, p[n]).reshape(b, s, -1, HEAD_DIM) for n in ("wq", "wk", "wv"))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, -1)
    x = x + row(o, p["wo"])
    h = _norm(x, p["ln2"])
    h = jax.nn.gelu(fs.column_parallel(h, p["w_in"], p["b_in"]))
    return x + row(h, p["w_out"], p["b_out"])


def gpt_loss(p, x, tensor=None):
    return jnp.mean(gpt_block(p, x, tensor) ** 2)


# The sharded step most tests run: one jitted function, so tests on the same mesh, shapes
# and dtypes share one compile.
gpt_step = jax.jit(fs.value_and_grad(lambda s, b: gpt_loss(fs.unshard(s), b, "tensor")))


def _batch(n=16, seed=7):
    return _batch_of(n, seed)


@functools.partial(jax.jit, static_argnums=0)
def _batch_of(n, seed):
    return jax.random.normal(jax.random.key(seed), (n, SEQ, D))


# The one-device references, jitted: one program each instead of a compile per eager op.
gpt_value_and_grad = jax.jit(jax.value_and_grad(gpt_loss))


@functools.partial(jax.jit, static_argnums=0)
def _optax_step(opt, grads, params):
    """Plain optax's first step from `opt.init(params)`: the updated parameters."""
    updates, _ = opt.update(grads, opt.init(params), params)
    return optax.apply_updates(params, updates)


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


GPT_MESHES = {
    "fsdp4_tensor2": dict(fsdp=4, tensor=2),
    "replicate2_fsdp2_tensor2": dict(replicate=2, fsdp=2, tensor=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("axes", GPT_MESHES.values(), ids=GPT_MESHES.keys())
def test_gpt_block_matches_one_device_and_gathers_over_data_axes_only(axes):
    mesh = _mesh(**axes)
    params, x = gpt_params(), _batch()
    want_loss, want = gpt_value_and_grad(params, x)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    step = gpt_step
    loss, grads = step(state, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)

    found = _collectives(step, state, x)
    shard_groups = _groups(mesh, ("fsdp",))
    gathers = [c for c in found if c["kind"] == "all-gather"]
    scatters = [c for c in found if c["kind"] == "reduce-scatter"]
    assert gathers and scatters
    assert {c["groups"] for c in gathers + scatters} == {shard_groups}
    # One gather per group of leaves (split over tensor or not), each moving the model
    # blocks' padded elements: the bytes of a leaf over the tensor size.
    leaves = jax.tree.leaves(state, is_leaf=lambda a: isinstance(a, fs.Sharded))
    local = sum(math.prod(leaf.local_shape) for leaf in leaves)
    assert sum(c["elements"] for c in gathers) == local * mesh.shape["fsdp"]
    assert sum(c["elements"] for c in scatters) == local  # a reduce-scatter's result
    blocks = {n: math.prod(state[n].block_shape) for n in params}
    assert blocks["wq"] * 2 == params["wq"].size and blocks["ln1"] == params["ln1"].size
    # The tensor-parallel sums run over `tensor` only; the rest over data axes.
    allowed = {_groups(mesh, ("tensor",)), _groups(mesh, tuple(a for a in axes if a != "tensor"))}
    if "replicate" in axes:
        allowed.add(_groups(mesh, ("replicate",)))
    reductions = {c["groups"] for c in found if c["kind"] == "all-reduce"}
    assert _groups(mesh, ("tensor",)) in reductions and reductions <= allowed
    assert not [c for c in found if c["kind"] not in ("all-gather", "reduce-scatter", "all-reduce")]


@pytest.mark.slow
def test_gpt_block_compositions_on_fsdp4_tensor2():
    """Units with reshard_after_forward, microbatches with and without per-microbatch
    sync, a frozen leaf, and an optax step from fs.init_optimizer: plain JAX's numbers."""
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(1), _batch(16, 3)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    block = fs.fully_shard(lambda p, b: gpt_block(p, b, "tensor"), reshard_after_forward=True)

    def loss(s, b):
        return jnp.mean(block(s, b) ** 2)

    want_loss, want = gpt_value_and_grad(params, x)
    plain = None
    for options in ({}, {"microbatches": 2}, {"microbatches": 2, "sync_every_microbatch": False}):
        got_loss, grads = jax.jit(fs.value_and_grad(loss, **options))(state, x)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, err_msg=str(options))
        _assert_close(fs.unshard(grads), want)
        plain = grads if not options else plain

    frozen = {n: n != "wq" for n in params}
    _, grads = jax.jit(fs.value_and_grad(loss, trainable=frozen))(state, x)
    full = fs.unshard(grads)
    assert not np.any(np.asarray(full["wq"]))
    trained = [n for n in params if n != "wq"]
    _assert_close({n: full[n] for n in trained}, {n: want[n] for n in trained})

    opt = optax.adamw(1e-2)
    opt_state = fs.init_optimizer(opt, state)
    updates, _ = opt.update(plain, opt_state, state)  # the step's gradients, no options
    new = fs.unshard(optax.apply_updates(state, updates))
    _assert_close(new, _optax_step(opt, want, params))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_whole_matrix_optimizers_see_each_model_blocks_logical_rows(name):
    """fs.shard_optimizer cuts each model block's own padding (per-block padded leaves:
    b_in, w_out) and gives plain optax's update."""
    base = {"adafactor": optax.adafactor(1e-2), "muon": optax.contrib.muon(1e-2)}[name]
    params, x = gpt_params(), _batch()
    want = _optax_step(base, gpt_value_and_grad(params, x)[1], params)
    state = fs.shard(params, _mesh(fsdp=4, tensor=2), model_spec=GPT_SPEC)
    assert state["b_in"].padded_shape == (24,)  # blocks of 9 padded to 12
    opt = fs.shard_optimizer(base)
    opt_state = fs.init_optimizer(opt, state)
    _, grads = gpt_step(state, x)
    updates, _ = jax.jit(opt.update)(grads, opt_state, state)
    _assert_close(fs.unshard(optax.apply_updates(state, updates)), want, rtol=1e-4, atol=1e-5)
    # The bare transform: refused where the padding probe finds its update reading the
    # padding (adafactor; muon on jax 0.10.2), else plain optax's numbers (muon on jax
    # 0.12, where the probe finds these leaves exact), never anything else.
    try:
        bare = fs.init_optimizer(base, state)
    except errors.ShardingValueError as refusal:
        assert "zero padding rows" in str(refusal)
    else:
        updates, _ = jax.jit(base.update)(grads, bare, state)
        new = fs.unshard(optax.apply_updates(state, updates))
        _assert_close(new, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_vocabulary_parallel_head_gathered_by_gather_columns():
    """Logits split over `tensor` (a column-parallel head), gathered whole for the loss."""
    head, labels = jax.jit(
        lambda: (
            jax.random.normal(jax.random.key(9), (D, 10)) / 4,
            jax.random.randint(jax.random.key(8), (16, SEQ), 0, 10),
        )
    )()
    params, x = {**gpt_params(6), "head": head}, _batch()
    spec = {**GPT_SPEC, "head": P(None, "tensor")}

    def loss(p, x, labels, tensor=None):
        logits = fs.column_parallel(gpt_block(p, x, tensor), p["head"])
        if tensor:
            logits = fs.gather_columns(logits, axis=tensor)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    want_loss, want = jax.jit(jax.value_and_grad(loss))(params, x, labels)
    state = fs.shard(params, _mesh(fsdp=4, tensor=2), model_spec=spec)
    step = fs.value_and_grad(lambda s, b: loss(fs.unshard(s), b[0], b[1], "tensor"))
    got_loss, grads = jax.jit(step)(state, (x, labels))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


@pytest.mark.slow
def test_dropout_draws_per_data_parallel_slice_not_per_tensor_rank():
    """A draw on activations replicated over `tensor` is the global draw's rows for the
    device's data-parallel slice, the same on both tensor ranks: plain JAX's numbers."""

    def loss(p, x, key, tensor=None):
        x = x * jax.random.bernoulli(key, 0.8, x.shape) / 0.8
        return jnp.mean(gpt_block(p, x, tensor) ** 2)

    params, x, key = gpt_params(5), _batch(), jax.random.key(3)
    want_loss, want = jax.jit(jax.value_and_grad(loss))(params, x, key)
    state = fs.shard(params, _mesh(fsdp=4, tensor=2), model_spec=GPT_SPEC)
    step = fs.value_and_grad(lambda s, b, k: loss(fs.unshard(s), b, k, "tensor"))
    got_loss, grads = jax.jit(step)(state, x, key)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


@pytest.mark.slow
def test_mixed_precision_gathers_model_blocks_in_param_dtype():
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(2), _batch()
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC, mp_policy=policy)
    step = gpt_step
    loss, grads = step(state, x)
    # Rounded to bf16 in numpy (ml_dtypes): inside a jit XLA may drop the round trip.
    low = jax.tree.map(lambda a: np.asarray(a).astype(jnp.bfloat16).astype(np.float32), params)
    want_loss, want = gpt_value_and_grad(low, x)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-2)
    _assert_close(fs.unshard(grads), want, rtol=5e-2, atol=5e-3)
    found = _collectives(step, state, x)
    # bf16 travels as its 16-bit pattern on CPU; gradients are reduced in f32.
    assert {c["dtype"] for c in found if c["kind"] == "all-gather"} == {"u16"}
    assert {c["dtype"] for c in found if c["kind"] == "reduce-scatter"} == {"f32"}


@pytest.mark.slow
def test_scanned_stack_on_an_explicit_mesh():
    """`jax.make_mesh`'s own (Explicit) mesh and `fs.lax_scan` over a stack of blocks
    sharded with `stacked=True`: each layer's model block gathered in the loop."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"))
    stack = jax.jit(lambda *p: jax.tree.map(lambda *a: jnp.stack(a), *p))(
        gpt_params(1), gpt_params(2)
    )
    spec = {k: None if v is None else P(None, *v) for k, v in GPT_SPEC.items()}
    state = fs.shard(stack, mesh, model_spec=spec, stacked=True)
    x = _batch()

    def reference(p, x):
        h, _ = jax.lax.scan(lambda h, layer: (gpt_block(layer, h), None), x, p)
        return jnp.mean(h**2)

    def loss(s, b):
        h, _ = fs.lax_scan(lambda h, layer: (gpt_block(layer, h, "tensor"), None), b, s)
        return jnp.mean(h**2)

    want_loss, want = jax.jit(jax.value_and_grad(reference))(stack, x)
    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


# ---- a mixture-of-experts layer ---------------------------------------------------------

EXPERTS, TOP_K, EXPERT_FF = 4, 2, 8


@jax.jit
def moe_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "ln": 1.0 + 0.1 * jax.random.normal(k[0], (D,)),
        "router": jax.random.normal(k[1], (D, EXPERTS)),
        "w_in": jax.random.normal(k[2], (EXPERTS, D, EXPERT_FF)) / 4,
        "w_out": jax.random.normal(k[3], (EXPERTS, EXPERT_FF, D)) / 4,
    }


def moe_reference(p, x):
    """Each token through its top-k experts, weighted, on one device (no dispatch)."""
    h = _norm(x, p["ln"]).reshape(-1, D)
    index, weights = fs.route_top_k(h @ p["router"], TOP_K)
    w_in, w_out = p["w_in"][index], p["w_out"][index]  # (tokens, k, ...)
    out = jnp.einsum("tkf,tkfd->tkd", jax.nn.gelu(jnp.einsum("td,tkdf->tkf", h, w_in)), w_out)
    y = jnp.sum(out * weights[..., None], axis=1)
    return jnp.mean((y + h) ** 2)


def moe_loss(p, x, tensor=None):
    h = _norm(x, p["ln"]).reshape(-1, D)
    index, weights = fs.route_top_k(h @ p["router"], TOP_K)
    inputs, mask = fs.expert_dispatch(h, index, EXPERTS, axis="expert")
    hidden = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", inputs, p["w_in"]))
    out = jnp.einsum("ecf,efd->ecd", hidden, p["w_out"])
    if tensor:  # experts' hidden dim split over `tensor`: row-parallel out-projection
        out = jax.lax.psum(out, tensor)
    y = fs.expert_combine(out, mask, weights, axis="expert")
    return jnp.mean((y + h) ** 2)


MOE_MESHES = {
    "fsdp2_expert4": (dict(fsdp=2, expert=4), None),
    "fsdp2_expert2_tensor2": (dict(fsdp=2, expert=2, tensor=2), "tensor"),
}


@pytest.mark.slow
@pytest.mark.parametrize("axes, tensor", MOE_MESHES.values(), ids=MOE_MESHES.keys())
def test_moe_matches_one_device_with_expert_leaves_on_their_own_data_axes(axes, tensor):
    mesh = _mesh(**axes)
    params, x = moe_params(), _batch()
    want_loss, want = jax.jit(jax.value_and_grad(moe_reference))(params, x)
    expert = ("expert", None, tensor) if tensor else ("expert",)
    spec = {"ln": None, "router": None, "w_in": P(*expert), "w_out": P("expert", tensor)}
    # Each device of `expert` holds one expert: FSDP shards the stack on dim 1, as
    # torchtitan's Shard(1) for experts fewer than the data-parallel ranks.
    state = fs.shard(
        params,
        mesh,
        shard_axis=("fsdp", "expert"),
        model_spec=spec,
        placement=lambda path, a: fs.Shard(1) if a.ndim == 3 else None,
    )
    assert state["w_in"].shard_axis == ("fsdp",) and state["router"].shard_axis == (
        "fsdp",
        "expert",
    )
    assert state["w_in"].dim == 1
    step = jax.jit(fs.value_and_grad(lambda s, b: moe_loss(fs.unshard(s), b, tensor)))
    loss, grads = step(state, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)

    found = _collectives(step, state, x)
    dense, sparse = _groups(mesh, ("fsdp", "expert")), _groups(mesh, ("fsdp",))
    assert {c["groups"] for c in found if c["kind"] in ("all-gather", "reduce-scatter")} == {
        dense,
        sparse,
    }
    assert {c["groups"] for c in found if c["kind"] == "all-to-all"} == {_groups(mesh, ("expert",))}
    # The plan counts the same collectives, each over its own data axes.
    plan = fs.plan(state)
    planned = [c for c in plan.collectives if c.kind == "all-gather"]
    assert {c.axes for c in planned} == {("fsdp",), ("fsdp", "expert")}
    gathered = sum(c["elements"] for c in found if c["kind"] == "all-gather")
    assert sum(c.bytes for c in planned) == 4 * gathered  # float32
    assert "collectives per mesh axes" in str(plan)
    # Planned from the unsharded parameters, without building the state.
    again = fs.plan(
        params,
        mesh,
        shard_axis=("fsdp", "expert"),
        model_spec=spec,
        placement=lambda path, a: fs.Shard(1) if a.ndim == 3 else None,
    )
    assert again.collectives == plan.collectives
    # A unit of expert leaves only gathers over their own data axes, in groups of 2.
    experts = fs.plan(state, units={"experts": ["w_in", "w_out"]})
    assert experts.num_shards == mesh.shape["fsdp"] * mesh.shape["expert"]
    unit_gathers = [c for c in experts.collectives if c.unit == "experts"]
    assert unit_gathers and {(c.axes, c.group) for c in unit_gathers} == {(("fsdp",), 2)}


# ---- the layout as a property -----------------------------------------------------------

MESHES = [
    dict(fsdp=8),
    dict(fsdp=4, tensor=2),
    dict(fsdp=2, tensor=4),
    dict(replicate=2, fsdp=2, tensor=2),
    dict(fsdp=1, tensor=8),
]


@pytest.mark.slow  # 12 compiled steps on 8 devices: about 30 s
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    axes=st.sampled_from(MESHES),
    rows=st.integers(0, 3),
    cols=st.integers(1, 3),
    which=st.sampled_from([None, 0, 1]),
    dim=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
)
def test_shard_unshard_and_linear_gradient_on_any_mesh(axes, rows, cols, which, dim, seed):
    """Round trip exact for every split, and the gradient of a linear loss in a step is
    its coefficient (each model block gathered and reduced on its own)."""
    mesh = _mesh(**axes)
    tensor = axes.get("tensor", 1)
    shape = [rows * tensor, cols * tensor]
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=shape).astype(np.float32))
    c = rng.normal(size=shape).astype(np.float32)  # numpy: c / 8 is exact either way
    spec = None if which is None or "tensor" not in axes else P(*([None] * which), "tensor")
    block = [shape[0], shape[1]]
    if spec is not None:
        block[which] //= tensor
    placement = None
    if dim == 1 and block[1] % axes["fsdp"] == 0:
        placement = lambda path, a: fs.Shard(1)  # noqa: E731
    state = fs.shard({"w": w}, mesh, model_spec={"w": spec}, placement=placement)
    np.testing.assert_array_equal(fs.unshard(state)["w"], w)
    assert state["w"].data.shape == state["w"].padded_shape
    assert state["w"].block_shape == tuple(block)
    if w.size:  # JAX gives each device the whole (empty) block of a size-0 array
        data_shape = {s.data.shape for s in state["w"].data.addressable_shards}
        assert data_shape == {state["w"].local_shape}

    def loss(s, batch):
        p = fs.unshard(s)["w"]  # this device's model block
        coefficient = batch[0]  # the batch is replicated over `tensor`: take its block
        if spec is None:
            return jnp.sum(p * coefficient) / 8
        start = jax.lax.axis_index("tensor") * block[which]
        coefficient = jax.lax.dynamic_slice_in_dim(coefficient, start, block[which], which)
        return jax.lax.psum(jnp.sum(p * coefficient), "tensor") / 8

    world = math.prod(size for a, size in axes.items() if a != "tensor")
    grads = jax.jit(fs.grad(loss))(state, jnp.asarray(np.broadcast_to(c, (world, *shape))))
    np.testing.assert_allclose(fs.unshard(grads)["w"], c / 8, rtol=1e-6, atol=1e-7)


# ---- state dicts and checkpoints across meshes ------------------------------------------


@pytest.mark.slow
def test_state_dict_and_checkpoint_move_between_nd_meshes(tmp_path):
    params = gpt_params(4)
    mesh = _mesh(fsdp=4, tensor=2)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    sd = fs.state_dict(state)
    for name, value in params.items():
        np.testing.assert_array_equal(sd[f"['{name}']"], value)
    fs.save(str(tmp_path / "ckpt"), state)
    for axes, spec in (
        (dict(fsdp=8), None),
        (dict(fsdp=2, tensor=4), {**GPT_SPEC, "b_in": None, "w_out": None, "w_in": None}),
        (dict(fsdp=4, tensor=2), GPT_SPEC),
    ):
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        like = fs.shard(abstract, _mesh(**axes), model_spec=spec)
        restored = fs.restore(str(tmp_path / "ckpt"), like)
        for name, value in params.items():
            np.testing.assert_array_equal(fs.unshard(restored)[name], value, err_msg=name)
    # And back: written on fsdp=8 (padded at the end), read per model block.
    fs.save(str(tmp_path / "flat"), fs.shard(params, _mesh(fsdp=8)))
    like = fs.shard(params, mesh, model_spec=GPT_SPEC)
    restored = fs.unshard(fs.restore(str(tmp_path / "flat"), like))
    for name, value in params.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def test_arrays_that_carry_a_model_split_keep_it():
    mesh = _mesh(fsdp=4, tensor=2)
    w = jax.device_put(jnp.arange(48.0).reshape(4, 12), NamedSharding(mesh, P(None, "tensor")))
    state = fs.shard({"w": w}, mesh)
    assert state["w"].model_axes == ((), ("tensor",))
    assert state["w"].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_array_equal(fs.unshard(state)["w"], w)
    # Sharded over a data axis only: FSDP reshards it, nothing is dropped.
    v = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("fsdp")))
    assert fs.shard({"v": v}, mesh)["v"].model_axes == ()


# ---- bad input --------------------------------------------------------------------------


def test_bad_model_axes_are_refused_naming_the_leaf():
    mesh = _mesh(fsdp=4, tensor=2)
    w = jnp.zeros((4, 6))
    cases = [
        (P(None, "expert"), "model axis 'expert' is not an axis of the mesh"),
        (P("tensor", "tensor"), "names a mesh axis more than once"),
        (P(None, None, "tensor"), "names 3"),
    ]
    for spec, text in cases:
        with pytest.raises(errors.ShardingValueError, match=text) as info:
            fs.shard({"w": w}, mesh, model_spec={"w": spec})
        assert "['w']" in str(info.value)
    with pytest.raises(errors.ShardingValueError, match="size 5 on dim 1, which its model axes"):
        fs.shard({"w": jnp.zeros((4, 5))}, mesh, model_spec={"w": P(None, "tensor")})
    with pytest.raises(errors.ShardingValueError, match="nothing to FSDP-shard it over"):
        fs.shard({"w": w}, mesh, shard_axis="tensor", model_spec={"w": P("tensor")})
    carried = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
    with pytest.raises(errors.ShardingValueError, match="which fs.shard would drop"):
        fs.shard({"w": carried}, mesh, model_spec={"w": P("tensor")})
    with pytest.raises(errors.ShardingTypeError, match="expected a jax.sharding.PartitionSpec"):
        fs.shard({"w": w}, mesh, model_spec={"w": "tensor"})


def test_a_loss_that_varies_over_a_model_axis_is_refused():
    mesh = _mesh(fsdp=4, tensor=2)
    state = fs.shard(gpt_params(), mesh, model_spec=GPT_SPEC)

    def partial_sum(s, b):  # the row-parallel psum forgotten
        p = fs.unshard(s)
        return jnp.mean(jax.nn.gelu(b.reshape(-1, D) @ p["w_in"]) @ p["w_out"])

    with pytest.raises(errors.ShardingValueError, match="model axes \\('tensor',\\)"):
        jax.jit(fs.value_and_grad(partial_sum))(state, _batch())


def test_a_unit_under_a_device_dependent_cond_is_refused_on_a_tensor_mesh():
    """The control-flow check holds on model meshes: a predicate read from this device's
    rows (varying over `fsdp`) guarding a unit's collectives is refused at trace time."""
    state = fs.shard(gpt_params(), _mesh(fsdp=4, tensor=2), model_spec=GPT_SPEC)
    unit = fs.fully_shard(lambda p, b: gpt_block(p, b, "tensor"))

    def loss(s, b):
        y = jax.lax.cond(b.sum() > 0, lambda: unit(s, b), lambda: b)
        return jnp.mean(y**2)

    with pytest.raises(errors.ShardingValueError, match="predicate differs between devices"):
        jax.jit(fs.value_and_grad(loss))(state, _batch())


@pytest.mark.slow
def test_compositions_on_a_tensor_mesh_are_plain_jax():
    """jax.checkpoint around the block, a psum-normalised loss, a frozen integer leaf split
    over `tensor`, vmap over whole steps, and a NaN in the batch: plain JAX's numbers
    (NaN where it has NaN)."""
    params, x = gpt_params(), _batch()
    want_loss, want = gpt_value_and_grad(params, x)
    mesh = _mesh(fsdp=4, tensor=2)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)

    def checkpointed(s, b):
        block = jax.checkpoint(lambda p, b: gpt_block(p, b, "tensor"))
        return jnp.mean(block(fs.unshard(s), b) ** 2)

    def normalised(s, b):
        y = gpt_block(fs.unshard(s), b, "tensor")
        count = jax.lax.psum(jnp.asarray(y.size, jnp.float32), "fsdp")
        return jax.lax.psum(jnp.sum(y**2), "fsdp") / count

    for loss in (checkpointed, normalised):
        got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, x)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6, err_msg=loss.__name__)
        _assert_close(fs.unshard(grads), want)

    step = fs.value_and_grad(lambda s, b: gpt_loss(fs.unshard(s), b, "tensor"))
    batches = jax.jit(lambda: jnp.stack([_batch(seed=1), _batch(seed=2)]))()
    losses, grads = jax.jit(jax.vmap(step, in_axes=(None, 0)))(state, batches)
    for k in range(2):
        one_loss, one = gpt_value_and_grad(params, batches[k])
        np.testing.assert_allclose(losses[k], one_loss, rtol=1e-6, err_msg=f"vmap {k}")
        _assert_close(fs.unshard(jax.tree.map(lambda g, k=k: g[k], grads)), one)

    ids = jnp.asarray(np.arange(16, dtype=np.int32).reshape(4, 4))
    spec = {**GPT_SPEC, "ids": P(None, "tensor")}
    with_ids = fs.shard({**params, "ids": ids}, mesh, model_spec=spec)
    trainable = {name: name != "ids" for name in with_ids}
    step = fs.value_and_grad(lambda s, b: gpt_loss(fs.unshard(s), b, "tensor"), trainable=trainable)
    _, grads = jax.jit(step)(with_ids, x)
    _assert_close({n: fs.unshard(grads)[n] for n in params}, want)
    np.testing.assert_array_equal(fs.unshard(with_ids)["ids"], ids)

    bad = jax.jit(lambda x: x.at[0, 0, 0].set(jnp.nan))(x)
    want_loss, want = gpt_value_and_grad(params, bad)
    got_loss, grads = gpt_step(state, bad)
    assert np.isnan(got_loss) and np.isnan(want_loss)
    got = fs.unshard(grads)
    assert {n: bool(np.isnan(got[n]).any()) for n in want} == {
        n: bool(np.isnan(want[n]).any()) for n in want
    }
