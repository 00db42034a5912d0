"""Root options: gradient accumulation, postponed HSDP all-reduce, frozen leaves, divide factor."""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import collectives, compiled, computations, count_by_kind
from _models import jitted_mlp_params, mlp_reference, mlp_sharded_loss
from _util import assert_tree_close, mlp_batch
from conftest import mesh_for

import funshard as fs

pytestmark = pytest.mark.slow

UNITS = 3  # mlp_params has three layers, one fully_shard unit each

_mlp_batch = jax.jit(mlp_batch, static_argnums=0)  # one program, not a compile per eager op


ACCUMULATION = [
    dict(microbatches=2),
    dict(microbatches=4, sync_every_microbatch=False),
    dict(microbatches=2, all_reduce_every_microbatch=False),
    dict(microbatches=2, sync_every_microbatch=False, all_reduce_every_microbatch=False),
]


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("options", ACCUMULATION)
@pytest.mark.parametrize("reshard", [True, False])
def test_accumulated_gradients_equal_full_batch(mesh_name, options, reshard):
    params = jitted_mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for(mesh_name))
    step = fs.value_and_grad(mlp_sharded_loss(True, reshard), **options)
    loss, grads = jax.jit(step)(state, _mlp_batch(32))
    ref_loss, ref_grads = mlp_reference(params, _mlp_batch(32))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_tree_close(fs.unshard(grads), ref_grads, atol=2e-5)


def _scatter_count(mesh_name="8", rows=32, **options):
    state = fs.shard(jitted_mlp_params(jax.random.key(0)), mesh_for(mesh_name))
    step = fs.value_and_grad(mlp_sharded_loss(True), **options)
    return compiled(step, state, _mlp_batch(rows))[1]


_CALLED = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\n]*)")


def _reachable(comps: dict, root: str) -> set[str]:
    """Names of the computations `root` runs, itself included (calls, loops, branches)."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for group in _CALLED.findall(comps[name]):
            todo += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return seen


def _microbatch_loop(text: str) -> tuple[int, Counter, Counter]:
    """(trip count, collectives inside the loop, collectives outside) of a step's HLO."""
    comps = computations(text)
    whiles = re.findall(r"while\(.*body=%?([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"", text)
    assert len(whiles) == 1, whiles
    body, trips = whiles[0]
    inside = _reachable(comps, body)
    count = lambda names: Counter(  # noqa: E731
        c["kind"] for name in names for c in collectives(comps[name])
    )
    return int(trips), count(inside), count(set(comps) - inside)


@pytest.mark.parametrize("k", [2, 8])
def test_reduce_scatter_every_microbatch_inside_one_loop(k):
    one = count_by_kind(_scatter_count(microbatches=1, rows=8 * k))
    trips, inside, outside = _microbatch_loop(_scatter_count(microbatches=k, rows=8 * k))
    # The program holds ONE microbatch's step (not k copies), run k times.
    assert trips == k
    assert inside["reduce-scatter"] == one["reduce-scatter"] == UNITS
    assert inside["all-gather"] == one["all-gather"] and outside["reduce-scatter"] == 0


@pytest.mark.parametrize("k", [2, 8])
def test_deferred_sums_reduced_once_after_the_loop(k):
    trips, inside, outside = _microbatch_loop(
        _scatter_count(microbatches=k, rows=8 * k, sync_every_microbatch=False)
    )
    # Unreduced sums accumulate in the loop; one reduce-scatter per dtype after it.
    assert trips == k and inside["reduce-scatter"] == 0 and outside["reduce-scatter"] == 1


def test_hsdp_all_reduce_once_after_the_last_microbatch():
    def replicate_reduce_elements(text):
        return sum(
            c["elements"]
            for c in collectives(text)
            if c["kind"] == "all-reduce" and c["groups"] == "{{0,4},{1,5},{2,6},{3,7}}"
        )

    # Per microbatch: the loop's body holds the all-reduce once and runs it 4 times.
    per_microbatch = _scatter_count("2x4", microbatches=4)  # one compile, read twice
    trips, _, _ = _microbatch_loop(per_microbatch)
    every = replicate_reduce_elements(per_microbatch)
    once = replicate_reduce_elements(
        _scatter_count("2x4", microbatches=4, all_reduce_every_microbatch=False)
    )
    assert trips == 4 and once > 0 and every == once


@pytest.mark.parametrize("units", [False, True])
def test_frozen_leaves_get_zero_gradients_and_no_communication(units):
    params = jitted_mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"))
    trainable = {"layers": [False, True, {"w": True, "b": False}], "scale": True}
    step = fs.value_and_grad(mlp_sharded_loss(units), trainable=trainable)
    _, grads = jax.jit(step)(state, _mlp_batch(32))
    _, ref = mlp_reference(params, _mlp_batch(32))
    got = fs.unshard(grads)
    for name in ("w", "b"):
        np.testing.assert_array_equal(got["layers"][0][name], 0)
    np.testing.assert_array_equal(got["layers"][2]["b"], 0)
    assert_tree_close(got["layers"][1], ref["layers"][1], atol=2e-5)
    assert_tree_close(got["layers"][2]["w"], ref["layers"][2]["w"], atol=2e-5)
    assert_tree_close(got["scale"], ref["scale"], atol=2e-5)
    text = compiled(step, state, _mlp_batch(32))[1]
    scattered = sum(c["elements"] for c in collectives(text) if c["kind"] == "reduce-scatter")
    # Only the trainable leaves' local blocks are reduce-scattered: layer 1's w (4 rows
    # of 24 per device) and b (3 rows), layer 2's w (3 rows of 5).
    assert scattered == 4 * 24 + 3 + 3 * 5


def test_frozen_everything_in_a_unit_means_no_reduce_scatter():
    params = jitted_mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("8"))
    trainable = {"layers": [False, False, False], "scale": True}
    text = compiled(
        fs.value_and_grad(mlp_sharded_loss(True), trainable=trainable), state, _mlp_batch(32)
    )[1]
    assert count_by_kind(text)["reduce-scatter"] == 0


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_gradient_divide_factor_scales_the_sum(factor):
    params = jitted_mlp_params(jax.random.key(0))
    state = fs.shard(params, mesh_for("2x4"))
    step = fs.value_and_grad(mlp_sharded_loss(True), gradient_divide_factor=factor)
    loss, grads = jax.jit(step)(state, _mlp_batch(32))
    ref_loss, ref_grads = mlp_reference(params, _mlp_batch(32))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # the loss is still the mean
    assert_tree_close(
        fs.unshard(grads), jax.tree.map(lambda g: np.asarray(g) * 8 / factor, ref_grads), atol=1e-4
    )


def test_one_all_gather_for_a_unit_of_mixed_dtypes():
    params = {"w": jnp.ones((16, 8)), "h": jnp.ones((8, 8), jnp.bfloat16), "i": jnp.arange(8)}
    state = fs.shard(params, mesh_for("8"))

    def unit_fn(p, x):
        return (x @ p["w"]) @ p["h"].astype(jnp.float32) + p["i"]

    unit = fs.fully_shard(unit_fn, reshard_after_forward=False)

    def loss(state, x):
        return jnp.mean(unit(state, x) ** 2)

    step = fs.value_and_grad(loss, trainable={"w": True, "h": True, "i": False})
    value, grads = jax.jit(step)(state, jnp.ones((8, 16)))
    ref_value, ref = jax.jit(
        jax.value_and_grad(lambda p, i, x: jnp.mean(unit_fn({**p, "i": i}, x) ** 2))
    )({"w": params["w"], "h": params["h"]}, params["i"], jnp.ones((8, 16)))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    got = fs.unshard(grads)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-5)
    assert got["h"].dtype == jnp.bfloat16
    np.testing.assert_allclose(got["h"].astype(np.float32), ref["h"].astype(np.float32), rtol=2e-2)
    gathers = [
        c
        for c in collectives(compiled(step, state, jnp.ones((8, 16)))[1])
        if c["kind"] == "all-gather"
    ]
    # Three leaves of three dtypes: ONE collective of raw 16-bit words.
    assert len(gathers) == 1 and gathers[0]["dtype"] == "u16"
    assert gathers[0]["elements"] == 8 * (2 * 8 * 2 + 1 * 8 + 1 * 2)  # u16 words per device
