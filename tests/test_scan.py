"""fs.scan over stacked layers: parity with the Python loop, prefetching gathers in the loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import compiled, computations, count_by_kind
from conftest import mesh_for

import funshard as fs

pytestmark = pytest.mark.slow

LAYERS, WIDTH = 4, 67


def _layers():
    keys = jax.random.split(jax.random.key(0), LAYERS)
    return [
        {
            "w": jax.random.normal(k, (WIDTH, WIDTH)) / 8,
            "b": jnp.full((WIDTH,), 0.1),
            "gain": jnp.float32(1.0 + i / 4),
        }
        for i, k in enumerate(keys)
    ]


def _layer(p, h):
    return jnp.tanh(h @ p["w"] + p["b"]) * p["gain"]


def _stack(trees):
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _x():
    return jax.random.normal(jax.random.key(5), (32, WIDTH))


def _scan_loss(reshard):
    def loss(state, h):
        return jnp.mean(fs.scan(_layer, state, h, reshard_after_forward=reshard) ** 2)

    return loss


def _loop_loss(state, h):
    unit = fs.fully_shard(_layer)
    for p in state:
        h = unit(p, h)
    return jnp.mean(h**2)


def test_stacked_shard_layout():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    assert state["w"].dim == 1 and state["w"].data.shape == (LAYERS, 72, WIDTH)
    assert state["w"].local_shape == (LAYERS, 9, WIDTH)
    assert not isinstance(state["gain"], fs.Sharded)  # one value per layer: replicated
    back = fs.unshard(state)
    np.testing.assert_array_equal(back["w"], _stack(_layers())["w"])


# The references and the loop of units below do not depend on the case's reshard (or
# scan style, or mesh): each is computed once and shared by the cases (eagerly, a
# lax.scan compiles anew per call).
@functools.cache
def _scan_reference():
    return jax.value_and_grad(
        lambda ps, h: jnp.mean(jax.lax.scan(lambda c, p: (_layer(p, c), None), h, ps)[0] ** 2)
    )(_stack(_layers()), _x())


@functools.cache
def _compiled_step(make_loss, reshard, mesh_name):
    """(executable, HLO text) of the step of `make_loss(reshard)` on the stacked layers on
    `mesh_name` and `_x()`: one compile shared by the test that runs it and the one that
    reads its HLO."""
    state = fs.shard(_stack(_layers()), mesh_for(mesh_name), stacked=True)
    return compiled(fs.value_and_grad(make_loss(reshard)), state, _x())


@functools.cache
def _loop_of_units(mesh_name):
    step = jax.jit(fs.value_and_grad(_loop_loss))
    return step(fs.shard(_layers(), mesh_for(mesh_name)), _x())


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("reshard", [True, False])
def test_scan_matches_python_loop_and_reference(mesh_name, reshard):
    mesh = mesh_for(mesh_name)
    stacked_state = fs.shard(_stack(_layers()), mesh, stacked=True)
    loss, grads = _compiled_step(_scan_loss, reshard, mesh_name)[0](stacked_state, _x())
    loop_loss, loop_grads = _loop_of_units(mesh_name)
    ref_loss, ref_grads = _scan_reference()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(loop_loss, ref_loss, rtol=1e-6)
    got = fs.unshard(grads)
    for name in ("w", "b", "gain"):
        np.testing.assert_allclose(got[name], ref_grads[name], atol=1e-6, rtol=1e-5)
        np.testing.assert_allclose(
            got[name], _stack(fs.unshard(loop_grads))[name], atol=1e-6, rtol=1e-5
        )


def test_scan_outside_a_step_evaluates():
    state = fs.shard(_stack(_layers()), mesh_for("4"), stacked=True)
    h = _x()
    want = h
    for p in _layers():
        want = _layer(p, want)
    np.testing.assert_allclose(fs.scan(_layer, state, h), want, rtol=1e-5, atol=1e-6)


def test_gathers_and_reduce_scatters_run_inside_the_loop():
    text = _compiled_step(_scan_loss, True, "8")[1]
    comps = computations(text)
    entry = count_by_kind(comps["ENTRY"])
    total = count_by_kind(text)
    # Outside the loops: the first layer's gather (forward) and the last layer's
    # (backward). Every other gather is a prefetch inside a loop body, and each layer's
    # reduce-scatter runs inside the backward loop.
    assert entry["all-gather"] == 2 and total["all-gather"] == 4
    assert entry["reduce-scatter"] == 0 and total["reduce-scatter"] == 1
    assert " while(" in comps["ENTRY"]


def test_scan_reshard_saves_memory_without_recompute():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    x = jax.random.normal(jax.random.key(5), (256, WIDTH))
    exe = {r: compiled(fs.value_and_grad(_scan_loss(r)), state, x)[0] for r in (True, False)}
    temp = {r: e.memory_analysis().temp_size_in_bytes for r, e in exe.items()}
    flops = {r: e.cost_analysis()["flops"] for r, e in exe.items()}
    assert temp[True] < temp[False], temp
    assert abs(flops[True] - flops[False]) <= 0.02 * flops[False], flops


def _gelu_block(p, h):
    return h + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]


def test_scan_and_loop_hold_the_temp_of_plain_jax():
    # A GELU MLP whose activations outweigh its parameters, against plain JAX on one
    # device's 64 rows (jax 0.10.2's MiB; 0.12's in brackets). The scan used to stack
    # every residual of the layer's vjp (GELU's tanh and its powers, 6 hidden-sized
    # stacks: 3.7 MiB of temp, as plain JAX's own lax.scan holds 3.6 (3.0)); now it keeps
    # the matmul outputs and recomputes the elementwise values in the backward loop: 1.2
    # (1.8). The loop of units held 2.0 where plain JAX's unrolled loop holds 0.8; now
    # 0.9 (1.4).
    keys = jax.random.split(jax.random.key(0), 8)
    layers = [
        {
            "w1": jax.random.normal(k, (64, 256)) / 8,
            "b1": jnp.full((256,), 0.1),
            "w2": jax.random.normal(jax.random.fold_in(k, 1), (256, 64)) / 16,
        }
        for k in keys
    ]
    x = jax.random.normal(jax.random.key(5), (512, 64))
    mesh = mesh_for("8")
    unit = fs.fully_shard(_gelu_block)

    def loop_loss(state, h):
        for p in state:
            h = unit(p, h)
        return jnp.mean(h**2)

    def scan_loss(state, h):
        return jnp.mean(fs.scan(_gelu_block, state, h) ** 2)

    def plain_loss(params, h):
        return jnp.mean(jax.lax.scan(lambda c, p: (_gelu_block(p, c), None), h, params)[0] ** 2)

    def plain_loop_loss(params, h):
        for p in params:
            h = _gelu_block(p, h)
        return jnp.mean(h**2)

    stacked = fs.shard(_stack(layers), mesh, stacked=True)
    scan_exe = compiled(fs.value_and_grad(scan_loss), stacked, x)[0]
    loop_exe = compiled(fs.value_and_grad(loop_loss), fs.shard(layers, mesh), x)[0]
    rows = x[: len(x) // 8]
    temp = {
        "scan": scan_exe.memory_analysis().temp_size_in_bytes,
        "loop": loop_exe.memory_analysis().temp_size_in_bytes,
        "plain scan": compiled(jax.value_and_grad(plain_loss), _stack(layers), rows)[0],
        "plain loop": compiled(jax.value_and_grad(plain_loop_loss), layers, rows)[0],
    }
    temp |= {k: temp[k].memory_analysis().temp_size_in_bytes for k in ("plain scan", "plain loop")}
    assert temp["scan"] <= 0.6 * temp["plain scan"], temp
    assert temp["loop"] <= 2 * temp["plain loop"], temp

    _, grads = scan_exe(stacked, x)
    _, loop_grads = loop_exe(fs.shard(layers, mesh), x)
    _, plain_grads = jax.jit(jax.value_and_grad(plain_loss))(_stack(layers), x)
    got, loop_stacked = fs.unshard(grads), _stack(fs.unshard(loop_grads))
    for name in ("w1", "b1", "w2"):
        np.testing.assert_allclose(got[name], loop_stacked[name], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[name], plain_grads[name], rtol=1e-5, atol=1e-7)


def test_scan_requires_a_stacked_state():
    state = fs.shard(_stack(_layers()), mesh_for("8"))
    with pytest.raises(ValueError, match=r"stacked=True"):
        fs.scan(_layer, state, _x())


# fs.lax_scan: jax.lax.scan's calling convention over the same sharded stack. The model
# below is written as outside code writes it (a GPT-2-like residual block with a
# per-layer auxiliary output), scanned with jax.lax.scan on plain parameters.


def _block(h, x):
    """One residual block in lax.scan's order: (carry, layer) -> (carry, per-layer y)."""
    p, scale = x["params"], x["scale"]
    out = h + jnp.tanh(h @ p["w"] + p["b"]) * p["gain"] * scale
    return out, {"aux": jnp.mean(out**2), "first": out[:, 0]}


def _per_layer_scale():
    # An extra per-layer input (not a parameter) in xs beside the stacked layers.
    return jnp.linspace(0.5, 1.5, LAYERS)


def _model_loss(scan, blocks, h):
    h, ys = scan(_block, h, {"params": blocks, "scale": _per_layer_scale()})
    # The per-layer outputs enter the loss, so their cotangents flow back per layer.
    return jnp.mean(h**2) + 0.1 * jnp.sum(ys["aux"]) + 0.01 * jnp.mean(ys["first"] ** 3)


def _lax_scan_loss(reshard):
    def scan(f, init, xs):
        return fs.lax_scan(f, init, xs, reshard_after_forward=reshard)

    return lambda state, h: _model_loss(scan, state, h)


@functools.cache
def _model_reference():
    # Shared by the cases (see _scan_reference).
    return jax.value_and_grad(lambda ps, h: _model_loss(jax.lax.scan, ps, h))(
        _stack(_layers()), _x()
    )


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("reshard", [True, False])
def test_lax_scan_matches_jax_lax_scan(mesh_name, reshard):
    state = fs.shard(_stack(_layers()), mesh_for(mesh_name), stacked=True)
    loss, grads = _compiled_step(_lax_scan_loss, reshard, mesh_name)[0](state, _x())
    ref_loss, ref_grads = _model_reference()
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    got = fs.unshard(grads)
    assert jax.tree.structure(got) == jax.tree.structure(ref_grads)
    for name in ("w", "b", "gain"):
        np.testing.assert_allclose(got[name], ref_grads[name], atol=1e-6, rtol=1e-5)


def test_lax_scan_outside_a_step_returns_what_jax_lax_scan_returns():
    stack = _stack(_layers())
    state = fs.shard(stack, mesh_for("4"), stacked=True)
    xs = {"params": state, "scale": _per_layer_scale()}
    got = fs.lax_scan(_block, _x(), xs)
    want = jax.lax.scan(_block, _x(), {"params": stack, "scale": _per_layer_scale()})
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_lax_scan_takes_the_stacked_state_as_xs_and_no_per_layer_output():
    # The one-call port: jax.lax.scan(block, h, params) -> fs.lax_scan(block, h, state).
    def block(h, p):
        return _layer(p, h), None

    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    loss, grads = jax.jit(
        fs.value_and_grad(lambda s, h: jnp.mean(fs.lax_scan(block, h, s, length=LAYERS)[0] ** 2))
    )(state, _x())
    ref_loss, ref_grads = jax.value_and_grad(
        lambda s, h: jnp.mean(jax.lax.scan(block, h, s)[0] ** 2)
    )(_stack(_layers()), _x())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(fs.unshard(grads)["w"], ref_grads["w"], atol=1e-6, rtol=1e-5)
    assert fs.lax_scan(block, _x(), state)[1] is None


def test_lax_scan_gathers_each_layer_once_inside_the_loop():
    text = _compiled_step(_lax_scan_loss, True, "8")[1]
    comps = computations(text)
    entry, total = count_by_kind(comps["ENTRY"]), count_by_kind(text)
    # As for fs.scan: the first layer's gather (forward) and the last layer's (backward)
    # outside the loops, every other gather a prefetch inside a loop body (one per
    # layer: the unit's leaves travel in one collective), each layer's reduce-scatter
    # inside the backward loop.
    assert entry["all-gather"] == 2 and total["all-gather"] == 4
    assert entry["reduce-scatter"] == 0 and total["reduce-scatter"] == 1
    assert " while(" in comps["ENTRY"]


def test_lax_scan_reshard_saves_memory_without_recompute():
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    x = jax.random.normal(jax.random.key(5), (256, WIDTH))
    exe = {r: compiled(fs.value_and_grad(_lax_scan_loss(r)), state, x)[0] for r in (True, False)}
    temp = {r: e.memory_analysis().temp_size_in_bytes for r, e in exe.items()}
    flops = {r: e.cost_analysis()["flops"] for r, e in exe.items()}
    assert temp[True] < temp[False], temp
    assert abs(flops[True] - flops[False]) <= 0.02 * flops[False], flops


def _pair_block(h, p):
    return _layer(p, h), None


def _carry_only_block(h, p):
    return _layer(p, h)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda s, h: fs.lax_scan(_pair_block, s, h),
            ValueError,
            r"passed as init.*xs \(the\s+third argument\).*fs\.scan",
        ),
        (lambda s, h: fs.scan(_layer, h, s), ValueError, r"passed as the carry.*fs\.lax_scan"),
        (
            lambda s, h: fs.lax_scan(_carry_only_block, h, s),
            TypeError,
            r"_carry_only_block returned .*, not a pair \(carry, y\).*fs\.scan",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, s, reverse=True),
            NotImplementedError,
            r"reverse=True",
        ),
        (lambda s, h: fs.lax_scan(_pair_block, h, s, unroll=2), NotImplementedError, r"unroll=2"),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, s, length=LAYERS + 1),
            ValueError,
            rf"length={LAYERS + 1}, but xs stacks {LAYERS} layers",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, (s, jnp.ones(LAYERS + 1))),
            ValueError,
            r"disagree on the number of layers",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, (s, jnp.float32(2.0))),
            ValueError,
            r"leaf \[1\] of xs has shape \(\), no layer axis",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, (s, "mlp")),
            ValueError,
            r"leaf \[1\] of xs has a str, no layer axis",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, _stack(_layers())),
            ValueError,
            r"no fs\.Sharded leaves",
        ),
        (
            lambda s, h: fs.lax_scan(_pair_block, h, s, reshard_after_forward=2),
            NotImplementedError,
            r"lax_scan: reshard_after_forward=2 \(hpZ\)",
        ),
    ],
    ids=[
        "init-holds-layers",
        "scan-carry-holds-layers",
        "not-a-pair",
        "reverse",
        "unroll",
        "length",
        "extra-layer-count",
        "extra-0d",
        "extra-str",
        "plain-params",
        "hpz",
    ],
)
def test_lax_scan_misuse_raises_clear_errors(call, error, match):
    state = fs.shard(_stack(_layers()), mesh_for("8"), stacked=True)
    with pytest.raises(error, match=match):
        call(state, _x())


def test_lax_scan_requires_a_stacked_state():
    state = fs.shard(_stack(_layers()), mesh_for("8"))
    with pytest.raises(ValueError, match=r"lax_scan: leaf .* stacked=True"):
        fs.lax_scan(_pair_block, _x(), state)


def test_jax_lax_scan_over_a_stack_names_fs_lax_scan():
    """jax.lax.scan slices a stacked leaf but cannot gather it: the refusal names the
    scans that gather it layer by layer, and following it gives plain JAX's numbers
    with less memory than the whole-stack fs.unshard it warns about."""
    stack = _stack(_layers())
    state = fs.shard(stack, mesh_for("8"), stacked=True)
    x = jax.random.normal(jax.random.key(5), (256, WIDTH))

    def loss(scan):
        return lambda s, h: jnp.mean(scan(_pair_block, h, s)[0] ** 2)

    with pytest.raises(fs.errors.ShardingTypeError) as info:
        jax.jit(fs.value_and_grad(loss(jax.lax.scan)))(state, x)
    message = str(info.value)
    for fragment in (
        "h @ p['w']",  # the user's expression, from _layer
        "a stack of layers (fs.shard(..., stacked=True))",
        "fs.lax_scan(f, init, xs), which takes jax.lax.scan's arguments",
        "fs.scan(fn, stacked, carry)",
        "gathers the whole stack at once",
    ):
        assert fragment in message, (fragment, message)
    # A leaf sharded on dim 0 gets the leaf's own fix, with nothing about stacks.
    one_layer = fs.shard(_layers()[0], mesh_for("8"))
    with pytest.raises(fs.errors.ShardingTypeError) as info:
        jax.jit(fs.value_and_grad(lambda p, h: jnp.mean(_layer(p, h))))(one_layer, x)
    assert "fs.unshard(p['w'])" in str(info.value) and "lax_scan" not in str(info.value)

    # One compile of the fs.lax_scan step: run here, its temp compared below.
    lax_scan_exe = compiled(fs.value_and_grad(loss(fs.lax_scan)), state, x)[0]
    got, grads = lax_scan_exe(state, x)
    want, want_grads = jax.value_and_grad(loss(jax.lax.scan))(stack, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(fs.unshard(grads)["w"], want_grads["w"], atol=1e-6, rtol=1e-5)
    whole = lambda s, h: loss(jax.lax.scan)(fs.unshard(s), h)  # noqa: E731
    temp = {
        "lax_scan": lax_scan_exe.memory_analysis().temp_size_in_bytes,
        "unshard": compiled(fs.value_and_grad(whole), state, x)[0]
        .memory_analysis()
        .temp_size_in_bytes,
    }
    assert temp["lax_scan"] < temp["unshard"], temp


def test_lax_scan_integer_outputs_and_inputs_under_bf16_params():
    # Integer per-layer outputs (argmax-like routing) and inputs (layer ids) have no
    # gradient; a floating per-layer input that varies with the batch meets bf16 compute.
    def block(h, x):
        p, layer_id, noise = x
        out = jnp.tanh(h @ p["w"] + p["b"]) + 0.1 * noise
        return out, (jnp.argmax(out, axis=-1), layer_id * 2, jnp.mean(out))

    def loss(scan, stack, h):
        noise = jnp.stack([h * (i + 1) for i in range(LAYERS)])
        h, (_, ids, means) = scan(block, h, (stack, jnp.arange(LAYERS), noise))
        return jnp.mean(h**2) + jnp.sum(means) + 0 * jnp.sum(ids)

    stack = _stack(_layers())
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    state = fs.shard(stack, mesh_for("8"), stacked=True, mp_policy=policy)
    got, grads = jax.jit(fs.value_and_grad(lambda s, h: loss(fs.lax_scan, s, h)))(state, _x())
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), stack)
    want, want_grads = jax.value_and_grad(lambda s, h: loss(jax.lax.scan, s, h))(
        bf16, _x().astype(jnp.bfloat16)
    )
    assert grads["w"].dtype == jnp.float32
    np.testing.assert_allclose(got, want.astype(jnp.float32), rtol=2e-2)
    np.testing.assert_allclose(
        fs.unshard(grads)["w"], want_grads["w"].astype(jnp.float32), atol=2e-2, rtol=5e-2
    )


# The GPT-2-like model of docs/training.md, written for jax.lax.scan: porting it to
# funshard changes the scan call only.
D, HEADS, T, VOCAB = 32, 4, 8, 64


def _layer_norm(x, g):
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x**2).mean(-1, keepdims=True) + 1e-5) * g


def _gpt2_block(h, p):
    b, t, d = h.shape
    q, k, v = jnp.split(_layer_norm(h, p["ln_1"]) @ p["c_attn"], 3, axis=-1)
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // HEADS)
    att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
    y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
    h = h + y @ p["attn_proj"]
    h = h + jax.nn.gelu(_layer_norm(h, p["ln_2"]) @ p["c_fc"]) @ p["mlp_proj"]
    return h, jnp.mean(h**2)


def _gpt2_loss(params, tokens, scan=jax.lax.scan):
    h = params["wte"][tokens[:, :-1]] + params["wpe"][: tokens.shape[1] - 1]
    h, act_sq = scan(_gpt2_block, h, params["blocks"])
    logits = _layer_norm(h, params["ln_f"]) @ params["wte"].T
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
    return nll.mean() + 1e-3 * act_sq.sum()


def _gpt2_params():
    keys = iter(jax.random.split(jax.random.key(0), 8))

    def normal(*shape):
        return jax.random.normal(next(keys), shape) * 0.02

    blocks = {
        "ln_1": jnp.ones((LAYERS, D)),
        "ln_2": jnp.ones((LAYERS, D)),
        "c_attn": normal(LAYERS, D, 3 * D),
        "attn_proj": normal(LAYERS, D, D),
        "c_fc": normal(LAYERS, D, 4 * D),
        "mlp_proj": normal(LAYERS, 4 * D, D),
    }
    return {"wte": normal(VOCAB, D), "wpe": normal(T, D), "ln_f": jnp.ones(D), "blocks": blocks}


def test_gpt2_style_model_ports_with_one_call():
    mesh = mesh_for("2x4")  # HSDP: the parity tests above cover the 1-D mesh
    params = _gpt2_params()
    tokens = jax.random.randint(jax.random.key(1), (16, T + 1), 0, VOCAB)
    state = fs.shard({k: v for k, v in params.items() if k != "blocks"}, mesh)
    state["blocks"] = fs.shard(params["blocks"], mesh, stacked=True)

    def sharded_loss(state, tokens):
        rest = fs.unshard({k: v for k, v in state.items() if k != "blocks"})
        return _gpt2_loss({**rest, "blocks": state["blocks"]}, tokens, scan=fs.lax_scan)

    loss, grads = jax.jit(fs.value_and_grad(sharded_loss))(state, tokens)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(_gpt2_loss))(params, tokens)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    got = fs.unshard(grads)
    for path, want in jax.tree_util.tree_leaves_with_path(ref_grads):
        np.testing.assert_allclose(
            _at(got, path), want, atol=1e-7, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
        )


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


# ---- scans and loops as plain JAX writes them (issue 42, section 6) ---------------------


def _with_context(key: int = 9):
    """The stacked layers beside two leaves the layers read through a closure: `mix`
    (gathered outside the scan) and `enc` (an encoder whose output each layer attends
    to, as in cross-attention), and a 0-d `start` (replicated)."""
    k1, k2 = jax.random.split(jax.random.key(key))
    return {
        "blocks": _stack(_layers()),
        "mix": jax.random.normal(k1, (WIDTH, WIDTH)) / 8,
        "enc": jax.random.normal(k2, (WIDTH, WIDTH)) / 8,
        "start": jnp.float32(0.5),
    }


def _shard_with_context(params, mesh):
    state = fs.shard({k: v for k, v in params.items() if k != "blocks"}, mesh)
    return {**state, "blocks": fs.shard(params["blocks"], mesh, stacked=True)}


def _closure_loss(scan, params, h, scan_style):
    """Layers closing over a gathered parameter and an encoder output (cross-attention)."""
    mix, enc = params["mix"], jnp.tanh(h @ params["enc"])

    def layer(p, h):
        # Each example attends over its own encoder features (no mixing across rows).
        attention = jax.nn.softmax(h * enc, axis=-1) * enc
        return _layer(p, h @ mix + attention)

    if scan_style == "fs.scan":
        out = scan(layer, params["blocks"], h)
    else:
        out = scan(lambda c, p: (layer(p, c), None), h, params["blocks"])[0]
    return jnp.mean(out**2)


@functools.cache
def _closure_reference(scan_style):
    # Shared by the meshes and reshard values (see _scan_reference).
    plain = jax.lax.scan if scan_style == "fs.lax_scan" else _plain_scan
    return jax.value_and_grad(lambda p, h: _closure_loss(plain, p, h, scan_style))(
        _with_context(), _x()
    )


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("reshard", [True, False])
@pytest.mark.parametrize("scan_style", ["fs.scan", "fs.lax_scan"])
def test_layers_closing_over_differentiated_values_match_plain_jax(mesh_name, reshard, scan_style):
    params = _with_context()
    scan = functools.partial(
        fs.scan if scan_style == "fs.scan" else fs.lax_scan, reshard_after_forward=reshard
    )

    def loss(state, h):
        outside = fs.unshard({"mix": state["mix"], "enc": state["enc"]})
        return _closure_loss(scan, {**outside, "blocks": state["blocks"]}, h, scan_style)

    state = _shard_with_context(params, mesh_for(mesh_name))
    value, grads = jax.jit(fs.value_and_grad(loss))(state, _x())
    ref_value, ref_grads = _closure_reference(scan_style)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    got = fs.unshard(grads)
    for path, want in jax.tree_util.tree_leaves_with_path(ref_grads):
        np.testing.assert_allclose(
            _at(got, path), want, atol=1e-6, rtol=1e-5, err_msg=jax.tree_util.keystr(path)
        )
    assert float(jnp.abs(got["enc"]).sum()) > 0 and float(jnp.abs(got["mix"]).sum()) > 0


def _plain_scan(fn, stacked, carry):
    """fs.scan's convention in plain JAX."""
    return jax.lax.scan(lambda c, p: (fn(p, c), None), carry, stacked)[0]


def _statistic_loss(scan, params, h, loop):
    """A statistic accumulated from constants (0.0, and the replicated `start`) in the
    loop the model scans its layers with, in a jax.lax.scan and in a fori_loop."""

    def layer(c, p):
        h, total = c
        h = _layer(p, h)
        return (h, total + jnp.mean(h**2)), jnp.mean(h)

    (h, total), means = scan(layer, (h, 0.0), params["blocks"])
    if loop == "jax.lax.scan":
        decayed = jax.lax.scan(lambda a, m: (0.9 * a + m, None), params["start"], means)[0]
    else:
        decayed = jax.lax.fori_loop(0, 3, lambda i, a: a + jnp.mean(jnp.sin(h * (i + 1))), 0.0)
    return jnp.mean(h**2) + 0.1 * total + 0.2 * decayed


@functools.cache
def _statistic_reference(loop):
    # Shared by the meshes (see _scan_reference).
    return jax.value_and_grad(lambda p, h: _statistic_loss(jax.lax.scan, p, h, loop))(
        _with_context(), _x()
    )


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("loop", ["jax.lax.scan", "lax.fori_loop"])
def test_carries_started_from_constants_match_plain_jax(mesh_name, loop):
    params = _with_context()
    state = _shard_with_context(params, mesh_for(mesh_name))

    def loss(state, h):
        return _statistic_loss(fs.lax_scan, {**state, "start": state["start"]}, h, loop)

    value, grads = jax.jit(fs.value_and_grad(loss))(state, _x())
    ref_value, ref_grads = _statistic_reference(loop)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    got = fs.unshard(grads)
    for name in ("w", "b", "gain"):
        want = ref_grads["blocks"][name]
        np.testing.assert_allclose(got["blocks"][name], want, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(got["start"], ref_grads["start"], rtol=1e-5)
