"""Random draws inside the root: those of plain JAX on the global batch, on any mesh.

A key passed to `fs.value_and_grad` (or made inside the loss) is the same on every
device. Each draw that scales with the batch (a dropout mask) becomes the device's rows
of the draw plain JAX makes on the global batch; draws that do not (a scalar, noise
shaped like a parameter) are the same on every device, as in plain JAX. The reference
everywhere is `jax.value_and_grad` of the same loss on the global batch with the same
key, unsharded (issue 42, section 2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funshard as fs
from funshard import _jax_compat, errors
from tests._util import assert_tree_close
from tests.conftest import mesh_for

ROWS, WIDTH = 32, 6
LAYOUTS = [(m, k) for m in ("1", "2", "4", "8", "2x4") for k in (1, 2, 4)]


def _params():
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    return {
        "w": jax.random.normal(k1, (WIDTH, WIDTH)) / 3.0,
        "v": jax.random.normal(k2, (WIDTH, 1)),
        "u": {"w": jax.random.normal(k3, (WIDTH, WIDTH)) / 3.0},
    }


def _batch(rows=ROWS):
    rng = np.random.default_rng(1)
    return {
        "x": rng.normal(size=(rows, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(rows, 1)).astype(np.float32),
    }


def _dropout(h, key, rate=0.5):
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0.0), keep


def _dropout_loss(p, b, key):
    """Dropout on the hidden layer, written as a user would in plain JAX."""
    h, keep = _dropout(jnp.tanh(b["x"] @ p["w"]), key)
    return jnp.mean((h @ p["v"] - b["y"]) ** 2), keep


def _check(loss, layout, *, has_aux=False, key=None, gathered=None, rows=ROWS):
    """The step's loss, aux and gradients equal plain JAX's on the global batch."""
    mesh, microbatches = layout
    params, batch = _params(), _batch(rows)
    key = jax.random.key(5) if key is None else key
    ref, ref_grads = jax.value_and_grad(loss, has_aux=has_aux)(params, batch, key)

    def sharded(s, b, k):
        return loss(fs.unshard(s) if gathered is None else gathered(s), b, k)

    step = jax.jit(fs.value_and_grad(sharded, has_aux=has_aux, microbatches=microbatches))
    got, grads = step(fs.shard(params, mesh_for(mesh)), batch, key)
    assert_tree_close(got, ref, atol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads, atol=1e-6)
    return got


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{m}-mb{k}" for m, k in LAYOUTS])
def test_dropout_is_plain_jax_on_the_global_batch_on_every_layout(layout):
    # The mask (returned per example through aux, gathered in batch order) too.
    _check(_dropout_loss, layout, has_aux=True)


def test_masks_depend_on_the_key_and_differ_between_examples():
    loss = fs.value_and_grad(lambda s, b, k: _dropout_loss(fs.unshard(s), b, k), has_aux=True)
    state, batch = fs.shard(_params(), mesh_for("8")), _batch()
    (_, a), _ = jax.jit(loss)(state, batch, jax.random.key(0))
    (_, b), _ = jax.jit(loss)(state, batch, jax.random.key(1))
    assert not np.array_equal(np.asarray(a), np.asarray(b))
    assert len({row.tobytes() for row in np.asarray(a).reshape(8, -1)}) == 8


def test_raw_key_and_key_made_inside_the_loss_draw_as_plain_jax():
    def raw(p, b, data):
        return _dropout_loss(p, b, data)[0]

    def constant(p, b, _):
        return _dropout_loss(p, b, jax.random.key(3))[0]

    for loss, key in ((raw, jax.random.PRNGKey(2)), (constant, jax.random.key(0))):
        _check(loss, ("2x4", 2), key=key)


@pytest.mark.parametrize("layout", [("1", 1), ("8", 1), ("2x4", 2), ("4", 4)])
def test_scalar_and_parameter_shaped_draws_are_shared_as_in_plain_jax(layout):
    # 48 rows: 6 per device on 8 devices, as many as the noise's rows (the second trace
    # on twice the rows tells them apart), and a dropout of the same shape as the noise.
    def loss(p, b, key):
        k1, k2, k3 = jax.random.split(key, 3)
        w = p["w"] + 0.1 * jax.random.normal(k1, p["w"].shape)
        scale = jax.random.uniform(k2, (), minval=0.5, maxval=1.5)
        h, _ = _dropout(jnp.tanh(b["x"] @ w), k3)
        return jnp.mean((h @ p["v"] * scale - b["y"]) ** 2)

    _check(loss, layout, rows=48)


def _block(p, h, key):
    return _dropout(jnp.tanh(h @ p["w"]), key)[0]


def _layer_drop(p, b, key, *, written, block=_block):
    """LayerDrop: one decision for the whole batch, from a scalar draw. With lax.cond the
    skipped branch holds a unit's all-gather: the same predicate on every device."""
    h = jnp.tanh(b["x"] @ p["w"])
    for i in range(3):
        k = jax.random.fold_in(key, i)
        drop = jax.random.uniform(jax.random.fold_in(k, 99)) < 0.5
        if written == "where":
            h = jnp.where(drop, h, block(p["u"], h, k))
        else:
            h = jax.lax.cond(drop, lambda h: h, lambda h, k=k: block(p["u"], h, k), h)
    return jnp.mean((h @ p["v"] - b["y"]) ** 2)


@functools.cache
def _layer_drop_reference(written):
    # One compiled reference per way of writing it, shared by the layouts: the key is an
    # argument, not a constant (eagerly, the cond's fresh lambdas compiled anew per seed).
    return jax.jit(jax.value_and_grad(functools.partial(_layer_drop, written=written)))


@pytest.mark.slow  # the 8 cases: one compiled step each, one compiled reference per `written`
@pytest.mark.parametrize("layout", [("1", 1), ("8", 2), ("2x4", 1), ("2x4", 4)])
@pytest.mark.parametrize("written", ["where", "cond"])
def test_layer_drop_on_a_shared_scalar_draw_is_plain_jax(layout, written):
    unit = fs.fully_shard(_block)

    def gathered(s):
        full = fs.unshard(s)
        return {**full, "u": s["u"]}

    def sharded(s, b, k):
        return _layer_drop(gathered(s), b, k, written=written, block=unit)

    # One compiled step for the three seeds.
    step = jax.jit(fs.value_and_grad(sharded, microbatches=layout[1]))
    reference = _layer_drop_reference(written)
    for seed in range(3):
        params, batch, key = _params(), _batch(), jax.random.key(seed)
        ref, ref_grads = reference(params, batch, key)
        got, grads = step(fs.shard(params, mesh_for(layout[0])), batch, key)
        np.testing.assert_allclose(got, ref, atol=1e-6)
        assert_tree_close(fs.unshard(grads), ref_grads, atol=1e-6)


def _units_loss(p, b, key, block=_block):
    h = block(p["u"], b["x"], key)
    h = jax.checkpoint(lambda h: _dropout(jnp.tanh(h), jax.random.fold_in(key, 1))[0])(h)

    def body(h, i):
        return _dropout(jnp.tanh(h), jax.random.fold_in(key, i))[0], None

    h, _ = jax.lax.scan(body, h, jnp.arange(3))
    return jnp.mean((h @ p["v"] - b["y"]) ** 2)


@functools.cache
def _units_reference(seed):
    # Shared by the layouts: eagerly, the scan and checkpoint compile anew per call.
    return jax.value_and_grad(_units_loss)(_params(), _batch(), jax.random.key(seed))


@pytest.mark.parametrize("layout", [("8", 1), ("2x4", 2)])
def test_draws_inside_units_checkpoint_and_scan_are_plain_jax(layout):
    unit = fs.fully_shard(_block)
    params, batch, key = _params(), _batch(), jax.random.key(1)
    ref, ref_grads = _units_reference(1)
    step = fs.value_and_grad(
        lambda s, b, k: _units_loss({**fs.unshard(s), "u": s["u"]}, b, k, block=unit),
        microbatches=layout[1],
    )
    got, grads = jax.jit(step)(fs.shard(params, mesh_for(layout[0])), batch, key)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads, atol=1e-6)


def test_flattened_and_per_example_split_draws_are_plain_jax():
    # A draw of (rows * width,) reshaped, and one key per example from a split.
    def loss(p, b, key):
        k1, k2 = jax.random.split(key)
        h = jnp.tanh(b["x"] @ p["w"])
        noise = jax.random.normal(k1, (h.size,)).reshape(h.shape)
        keys = jax.random.split(k2, h.shape[0])
        h, _ = jax.vmap(_dropout)(h + 0.1 * noise, keys)
        return jnp.mean((h @ p["v"] - b["y"]) ** 2)

    _check(loss, ("2x4", 2))


def test_a_draw_that_changes_shape_otherwise_is_refused_with_its_line():
    def loss(p, b, key):
        noise = jax.random.normal(key, (b["x"].shape[0], b["x"].shape[0]))
        return jnp.mean(noise @ b["x"] @ p["w"])

    step = fs.value_and_grad(lambda s, b, k: loss(fs.unshard(s), b, k))
    with pytest.raises(errors.ShardingValueError) as info:
        step(fs.shard(_params(), mesh_for("8")), _batch(), jax.random.key(0))
    message = str(info.value)
    assert "test_randomness.py" in message and "per_device_keys=False" in message
    assert "(4, 4)" in message and "(8, 8)" in message


def test_opt_out_draws_as_written_on_each_device():
    # per_device_keys=False: every device draws (rows, width) from the key as written:
    # the same mask for every device's rows.
    def sharded(s, b, key):
        return _dropout_loss(fs.unshard(s), b, key)

    step = fs.value_and_grad(sharded, has_aux=True, per_device_keys=False)
    (_, keep), _ = jax.jit(step)(fs.shard(_params(), mesh_for("8")), _batch(), jax.random.key(4))
    first = np.asarray(jax.random.bernoulli(jax.random.key(4), 0.5, (ROWS // 8, WIDTH)))
    # Equal on every device, so typed as such: it comes back once, not gathered.
    np.testing.assert_array_equal(np.asarray(keep), first)


def test_per_device_keys_must_be_a_bool():
    with pytest.raises(errors.ShardingTypeError, match="per_device_keys must be a bool"):
        fs.value_and_grad(_dropout_loss, per_device_keys="yes")


@pytest.mark.parametrize("microbatches", [1, 2])
def test_keys_returned_come_back_as_given(microbatches):
    # Flax's recipe writes its RNG streams back from aux: the caller's key comes back.
    def loss(s, b, key):
        value, _ = _dropout_loss(fs.unshard(s), b, key)
        return value, {"key": key}

    key = jax.random.key(4)
    step = jax.jit(fs.value_and_grad(loss, has_aux=True, microbatches=microbatches))
    (_, aux), _ = step(fs.shard(_params(), mesh_for("8")), _batch(), key)
    np.testing.assert_array_equal(jax.random.key_data(aux["key"]), jax.random.key_data(key))


@pytest.mark.parametrize("bit_width", [8, 16, 32])
@pytest.mark.parametrize("axis", [0, 1])
def test_rows_from_counters_equal_the_global_draw_sliced(bit_width, axis):
    # The guard of _jax_compat.threefry_rows: JAX's partitionable threefry bits.
    key, shape = jax.random.key(11), (12, 5, 3)
    full = jax.random.bits(key, shape, jnp.dtype(f"uint{bit_width}"))
    for start, size in ((0, 3), (3, 2), (4, 1)):
        rows = _jax_compat.threefry_rows(key, bit_width, shape, axis, start, size)
        np.testing.assert_array_equal(
            np.asarray(rows), np.asarray(jax.lax.slice_in_dim(full, start, start + size, axis=axis))
        )


def _stack_params():
    keys = jax.random.split(jax.random.key(3), 3)
    stack = {"w": jnp.stack([jax.random.normal(k, (WIDTH, WIDTH)) / 3.0 for k in keys])}
    return {"stack": stack, "head": jax.random.normal(jax.random.key(4), (WIDTH, 1))}


def _stack_layer(key):
    def run(p, h):
        return _dropout(jnp.tanh(h @ p["w"]), jax.random.fold_in(key, 1))[0]

    return run


def _stack_plain(params, b, key):
    h, _ = jax.lax.scan(lambda h, p: (_stack_layer(key)(p, h), None), b["x"], params["stack"])
    return jnp.mean((h @ params["head"] - b["y"]) ** 2)


@functools.cache
def _stack_reference(seed):
    # Shared by the layouts: eagerly, the scan compiles anew per call.
    return jax.value_and_grad(_stack_plain)(_stack_params(), _batch(), jax.random.key(seed))


@pytest.mark.parametrize("layout", [("8", 1), ("2x4", 2)])
def test_draws_inside_a_scanned_stack_are_plain_jax(layout):
    """Dropout in every layer of `fs.scan` (whose backward loop recomputes the layer's
    elementwise values): the masks and gradients of plain JAX's `lax.scan`."""

    def sharded(s, b, key):
        h = fs.scan(_stack_layer(key), s["stack"], b["x"])
        return jnp.mean((h @ fs.unshard(s["head"]) - b["y"]) ** 2)

    params, batch, key = _stack_params(), _batch(), jax.random.key(9)
    ref, ref_grads = _stack_reference(9)
    mesh = mesh_for(layout[0])
    state = {
        "stack": fs.shard(params["stack"], mesh, stacked=True),
        "head": fs.shard(params["head"], mesh),
    }
    got, grads = jax.jit(fs.value_and_grad(sharded, microbatches=layout[1]))(state, batch, key)
    np.testing.assert_allclose(got, ref, atol=1e-6)
    assert_tree_close(fs.unshard(grads), ref_grads, atol=1e-6)
