"""Megatron sequence parallelism: `fs.column_parallel` / `fs.row_parallel` with
`sequence_axis=`, on fsdp=4 x tensor=2 against the plain model on one device.

Numbers are compared with `jax.value_and_grad` of the global-batch mean loss on the full
parameters; collectives are read from the compiled HLO and memory from
`compiled.memory_analysis()`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funshard as fs
from funshard import errors
from tests.test_model_axes import (
    GPT_SPEC,
    HEAD_DIM,
    _assert_close,
    _collectives,
    _groups,
    _mesh,
    _norm,
    gpt_block,
    gpt_loss,
    gpt_params,
)


def _local_sequence(x, axis="tensor"):
    """This tensor rank's block of the sequence (dim 1) of `x`, replicated over `axis`."""
    n = x.shape[1] // jax.lax.axis_size(axis)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * n, n, axis=1)


def sp_block(p, x):
    """tests/test_model_axes.py's `gpt_block`, sequence-parallel: `x` and the output are
    this tensor rank's block of the sequence, the norms and residuals run on it."""
    h = _norm(x, p["ln1"])
    # The whole sequence, this rank's heads: (batch, seq, heads / t, head_dim).
    q, k, v = (
        fs.column_parallel(h, p[n], sequence_axis=1).reshape(x.shape[0], -1, 2, HEAD_DIM)
        for n in ("wq", "wk", "wv")
    )
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(*q.shape[:2], -1)
    x = x + fs.row_parallel(o, p["wo"], sequence_axis=1)
    h = jax.nn.gelu(fs.column_parallel(_norm(x, p["ln2"]), p["w_in"], p["b_in"], sequence_axis=1))
    return x + fs.row_parallel(h, p["w_out"], p["b_out"], sequence_axis=1)


def sp_loss(p, x):
    # Every rank's block of the sequence is the same size: the mean of their means.
    return jax.lax.pmean(jnp.mean(sp_block(p, _local_sequence(x)) ** 2), "tensor")


def plain_tp_loss(p, x):
    return jnp.mean(gpt_block(p, x, "tensor") ** 2)


def _batch(seq, n=16, seed=7):
    return _batch_of(seq, n, seed)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _batch_of(seq, n, seed):
    return jax.random.normal(jax.random.key(seed), (n, seq, 16))


@functools.cache  # the one-device reference, jitted: one program, not one per eager op
def _reference(loss):
    return jax.jit(jax.value_and_grad(loss))


def _step(loss, unit=False):
    return _jitted_step(loss, unit)


@functools.cache  # one jitted step per loss: tests of the same program share its compile
def _jitted_step(loss, unit):
    if unit:
        block = fs.fully_shard(loss, reshard_after_forward=True)
        return jax.jit(fs.value_and_grad(block))
    return jax.jit(fs.value_and_grad(lambda s, b: loss(fs.unshard(s), b)))


def _assert_one_device(loss, unit, reference=gpt_loss, x=None):
    """`loss` per device on fsdp=4 x tensor=2 gives `reference`'s loss and gradients on
    one device (the GPT block's parameters, batch `x`)."""
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(), _batch(8) if x is None else x
    want_loss, want = _reference(reference)(params, x)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    got_loss, grads = _step(loss, unit)(state, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


@pytest.mark.parametrize("unit", [False, True], ids=["unshard", "fully_shard"])
def test_sequence_parallel_block_matches_one_device(unit):
    _assert_one_device(sp_loss, unit)


def test_tensor_collectives_are_gathers_and_scatters_of_the_sequence():
    """Over `tensor`: all-gathers of the sequence-split activations (forward, and again
    in the backward pass) and reduce-scatters of the partial products and of the
    gathered inputs' gradients; no activation-sized all-reduce. The only sums over
    `tensor` are the gradients of the leaves replicated over it (norm scales, `b_out`)
    and the loss."""
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(), _batch(8)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    found = _collectives(_step(sp_loss), state, x)
    tensor, data = _groups(mesh, ("tensor",)), _groups(mesh, ("fsdp",))
    over_tensor = [c for c in found if c["groups"] == tensor]
    assert {c["groups"] for c in found} == {tensor, data}
    kinds = {c["kind"] for c in over_tensor}
    assert kinds == {"all-gather", "reduce-scatter", "all-reduce"}
    # Per device: 4 rows of 8 tokens, 4 of them on each tensor rank, width 16.
    local_act, full_act = 4 * 4 * 16, 4 * 8 * 16
    gathers = [c for c in over_tensor if c["kind"] == "all-gather"]
    scatters = [c for c in over_tensor if c["kind"] == "reduce-scatter"]
    assert {c["elements"] for c in gathers} == {full_act}  # an all-gather's result
    assert {c["elements"] for c in scatters} == {local_act}  # a reduce-scatter's result
    # Forward, the 2 gathered inputs (XLA merges q's, k's and v's identical gathers);
    # backward, the 4 column-parallel inputs gathered again (each tied to its own
    # cotangent) and the cotangents of the 2 row-parallel outputs.
    assert len(gathers) == 8
    # The 2 row-parallel sums forward; backward, the gradients of the 4 column-parallel
    # inputs (q, k and v each its own: separate kernels).
    assert len(scatters) == 6
    replicated = sum(params[n].size for n in ("ln1", "ln2", "b_out"))
    sums = [c for c in over_tensor if c["kind"] == "all-reduce"]
    assert sum(c["elements"] for c in sums) == replicated + 1  # and the loss's pmean


def test_sequence_parallel_lowers_temp_memory():
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(), _batch(64)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    temp = {}
    for name, loss in (("sp", sp_loss), ("tp", plain_tp_loss)):
        compiled = _step(loss).lower(state, x).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["sp"] < temp["tp"], temp


def _sp_fn(fn, **kwargs):
    mesh = _mesh(tensor=2)
    spec = jax.sharding.PartitionSpec(None, "tensor")
    return jax.shard_map(
        lambda x, w: fn(x, w, **kwargs), mesh=mesh, in_specs=(spec, None), out_specs=spec
    )


BAD = errors.ShardingValueError
BAD_CASES = {
    "row_uneven": (fs.row_parallel, 6, {"sequence_axis": 1}, BAD, "length 3.*2 divides"),
    "row_features": (fs.row_parallel, 8, {"sequence_axis": 2}, BAD, "sequence_axis=2"),
    "column_features": (fs.column_parallel, 8, {"sequence_axis": -1}, BAD, "last is"),
    "column_float": (
        fs.column_parallel,
        8,
        {"sequence_axis": 1.0},
        errors.ShardingTypeError,
        "index of the sequence",
    ),
}


@pytest.mark.parametrize(
    ("fn", "seq", "kwargs", "error", "match"), BAD_CASES.values(), ids=BAD_CASES.keys()
)
def test_bad_sequence_axis_says_how_to_fix(fn, seq, kwargs, error, match):
    x, w = jnp.asarray(np.ones((2, seq, 4), np.float32)), jnp.asarray(np.ones((4, 4), np.float32))
    with pytest.raises(error, match=match):
        _sp_fn(fn, **kwargs)(x, w)


def test_column_parallel_refuses_an_unsplit_sequence():
    mesh = _mesh(tensor=2)
    x, w = jnp.asarray(np.ones((2, 8, 4), np.float32)), jnp.asarray(np.ones((4, 4), np.float32))
    fn = jax.shard_map(
        lambda x, w: fs.column_parallel(x, w, sequence_axis=1),
        mesh=mesh,
        in_specs=(jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec(None, "tensor")),
        out_specs=jax.sharding.PartitionSpec(None, None, "tensor"),
    )
    with pytest.raises(errors.ShardingValueError, match="same on every device of 'tensor'"):
        fn(x, w)


def test_a_unit_takes_a_sequence_split_input():
    """A `fs.fully_shard` unit whose input is this rank's block of the sequence, holding
    leaves replicated over `tensor` (the LayerNorm gains): its gathers wait for that
    input, and its gradients are typed as its leaves are (plain JAX's numbers)."""
    mesh = _mesh(fsdp=4, tensor=2)
    params, x = gpt_params(), _batch(8)
    want_loss, want = _reference(gpt_loss)(params, x)
    state = fs.shard(params, mesh, model_spec=GPT_SPEC)
    unit = fs.fully_shard(sp_block, reshard_after_forward=True)

    def loss(s, b):
        return jax.lax.pmean(jnp.mean(unit(s, _local_sequence(b)) ** 2), "tensor")

    got_loss, grads = jax.jit(fs.value_and_grad(loss))(state, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    _assert_close(fs.unshard(grads), want)


def _in_cond(block):
    # A data-dependent predicate made equal on every device (a varying one is an error,
    # tests/test_control_flow.py); the false branch runs the block too.
    def run(p, x):
        finite = jnp.all(jnp.isfinite(x)).astype(jnp.int32)
        same = jax.lax.pmin(finite, ("fsdp", "tensor")) > 0
        return jax.lax.cond(same, block, lambda p, x: 0.0 * block(p, x), p, x)

    return run


def _vmapped(block):
    # Each row on its own: the sequence collectives run under vmap over the batch.
    return lambda p, x: jax.vmap(lambda row: block(p, row[None])[0])(x)


SP_WRAPPERS = {
    "checkpoint": jax.checkpoint,
    "checkpoint_dots": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
    "cond": _in_cond,
    "vmap": _vmapped,
}


@pytest.mark.parametrize("unit", [False, True], ids=["unshard", "fully_shard"])
@pytest.mark.parametrize("wrapper", sorted(SP_WRAPPERS))
def test_sequence_parallel_under_transforms_is_plain_jax(wrapper, unit):
    """The sequence-parallel block under jax.checkpoint (with and without a policy), in a
    `lax.cond`, and vmapped over rows: the one-device model's loss and gradients."""
    block = SP_WRAPPERS[wrapper](sp_block)

    def loss(p, x):
        return jax.lax.pmean(jnp.mean(block(p, _local_sequence(x)) ** 2), "tensor")

    _assert_one_device(loss, unit)


def _robust(h):
    return jnp.where(jnp.isnan(h), 0.0, h)


def _robust_reference(p, x):  # module level: both cases share its jitted reference
    return jnp.mean(_robust(gpt_block(p, x)) ** 2)


@pytest.mark.parametrize("unit", [False, True], ids=["unshard", "fully_shard"])
def test_a_nan_in_the_input_is_plain_jaxs(unit):
    """A NaN in one token of the input, zeroed after the block: loss and gradients (NaN
    where plain JAX's are) equal the one-device model's. The sequence's gathers and
    reduce-scatters spread it to no other row or token than plain JAX does."""

    def loss(p, x):
        return jax.lax.pmean(jnp.mean(_robust(sp_block(p, _local_sequence(x))) ** 2), "tensor")

    x = jax.jit(lambda x: x.at[5, 3, 0].set(jnp.nan))(_batch(8))
    _assert_one_device(loss, unit, _robust_reference, x)
