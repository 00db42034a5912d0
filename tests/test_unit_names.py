"""Each unit's collectives carry its name in the compiled program (FSDP2's `FSDP::all_gather`).

A `jax.profiler` trace and an HLO dump attribute time and memory by these names; here they
are read back from the op metadata of the compiled step.
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from _hlo import compiled, count_by_kind
from _models import mlp_layer, mlp_params, mse
from _util import mlp_batch
from conftest import mesh_for

import funshard as fs

_NAMED = re.compile(
    r"= [^ ]+ (all-gather|reduce-scatter)(?:-start)?\(.*op_name=\"[^\"]*funshard/(.+?)/"
    r"(all_gather|reduce_scatter)[)/]"
)


def _named_collectives(text: str) -> Counter:
    """(HLO collective, unit name, funshard scope) -> count."""
    return Counter(m.groups() for m in map(_NAMED.search, text.splitlines()) if m)


@pytest.mark.parametrize("reshard", [True, False])
def test_unit_collectives_are_named_after_the_unit(reshard):
    state = fs.shard(mlp_params(jax.random.key(0)), mesh_for("8"))
    unit = fs.fully_shard(mlp_layer, reshard_after_forward=reshard, name="mlp_block")

    def loss(state, batch):
        h = batch[0]
        for p in state["layers"]:
            h = unit(p, h)
        return mse(h * state["scale"], batch[1])

    text = compiled(fs.value_and_grad(loss), state, mlp_batch())[1]
    named = _named_collectives(text)
    # Every all-gather and reduce-scatter of the step is the unit's, and named so.
    assert named == Counter(
        {
            ("all-gather", "mlp_block", "all_gather"): count_by_kind(text)["all-gather"],
            ("reduce-scatter", "mlp_block", "reduce_scatter"): 3,
        }
    )
    assert count_by_kind(text)["all-gather"] >= 3


def test_default_names_unshard_scan_and_root():
    params = {"w": jnp.ones((3, 8, 8)), "head": jnp.ones((8, 5))}
    state = {
        "w": fs.shard({"w": params["w"]}, mesh_for("8"), stacked=True)["w"],
        "head": fs.shard(params["head"], mesh_for("8")),
    }

    def block(p, h):
        return jnp.tanh(h @ p)

    def loss(state, batch):
        h = fs.scan(block, state["w"], jnp.pad(batch[0], ((0, 0), (0, 0)))[:, :8])
        return mse(h @ fs.unshard(state["head"]), batch[1])

    step = fs.value_and_grad(loss, microbatches=2, sync_every_microbatch=True)
    named = _named_collectives(compiled(step, state, mlp_batch())[1])
    units = {unit for _, unit, _ in named}
    assert units == {"scan/block", "unshard"}, named
    deferred = fs.value_and_grad(
        lambda s, b: mse(fs.fully_shard(lambda p, h: h @ p)(s["head"], b[0][:, :8]), b[1]),
        microbatches=2,
        sync_every_microbatch=False,
    )
    named = _named_collectives(compiled(deferred, state, mlp_batch())[1])
    assert ("reduce-scatter", "root", "reduce_scatter") in named
    assert ("all-gather", "<lambda>", "all_gather") in named


def test_unit_name_must_be_a_string():
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        fs.fully_shard(mlp_layer, name="")
