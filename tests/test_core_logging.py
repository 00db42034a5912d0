"""The core's debug records under the logger "funshard", silent unless configured.

As torch_frontend does under "torch_frontend" (tests/test_torch_logging.py) and FSDP2
under "torch.distributed.fsdp.fully_shard": `make_mesh` says what mesh it built, a step's
trace says what its root and each unit gather (by key path, with bytes) and which
collectives it issues (unit, dtype, elements, mesh axes). Records are written while a
step is traced, never when the compiled step runs.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

import funshard as fs
from funshard.comm import _gather, _mesh
from funshard.core import _step, _unit

LOGGER = "funshard"


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith(LOGGER)]


def _step_fn() -> tuple[fs.Sharded, jax.Array, object]:
    """An HSDP step (2 replicas of 4 shards), bf16 gathers and f32 reductions: a unit
    "block" of two leaves and a leaf the loss unshards itself."""
    mesh = fs.make_mesh(2)
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    params = {"block": {"w": jnp.ones((6, 4)), "b": jnp.ones((4,))}, "head": jnp.ones((4, 2))}
    state = fs.shard(params, mesh, mp_policy=policy)
    block = fs.fully_shard(lambda p, x: jnp.tanh(x @ p["w"] + p["b"]), name="block")

    def loss_fn(s, batch):
        return jnp.mean(block(s["block"], batch) @ fs.unshard(s["head"]))

    return state, jnp.ones((8, 6)), jax.jit(fs.value_and_grad(loss_fn))


def test_mesh_root_unit_and_collectives_are_recorded_at_trace_time(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    state, batch, step = _step_fn()
    built = _messages(caplog)
    assert built[0] == (
        "make_mesh: HSDP mesh (replicate=2, fsdp=4) over 8 cpu devices of 1 process(es)"
    )
    caplog.clear()
    step(state, batch)
    records = _messages(caplog)
    # In full 4 + 24 + 8 float32s; per device (rows of 1, 2 and 1) 1 + 8 + 2.
    assert records[0] == (
        "value_and_grad: root on mesh (replicate=2, fsdp=4), batch split over "
        "('replicate', 'fsdp'), microbatches=1: 3 sharded leaves, 144 bytes in full, 44 per "
        "device; 0 replicated array leaves: ['block']['b'] (4,) float32 16 B, "
        "['block']['w'] (6, 4) float32 96 B, ['head'] (4, 2) float32 32 B"
    )
    # The unit's plan: its own leaves, gathered in bf16 (6 * 4 * 2 + 4 * 2 bytes).
    plans = [m for m in records if m.startswith("fully_shard 'block'")]
    assert plans == [
        "fully_shard 'block' (in a step, reshard_after_forward=True): gathers 2 sharded "
        "leaves, 56 bytes, over mesh axes ('fsdp',): ['b'] (4,) bfloat16 8 B, "
        "['w'] (6, 4) bfloat16 48 B"
    ]
    # w: 6 rows over 4 shards is 2 rows of 4 per device, b: 1 of 4 rows; 9 elements.
    unit = [m for m in records if m.startswith("funshard/block: ")]
    gather = (
        "funshard/block: all-gather of 2 leaves (bfloat16) over mesh axes ('fsdp',): "
        "9 elements per device, 36 gathered"
    )
    assert unit == [
        gather,  # forward
        gather,  # backward: gathered again (reshard_after_forward=True)
        "funshard/block: reduce-scatter of 2 leaves (float32) over mesh axes ('fsdp',): "
        "36 elements per device in, 9 out",
        "funshard/block: all-reduce of 2 leaves (float32) over mesh axes ('replicate',): "
        "9 elements per device",
    ]
    unshard = [m for m in records if m.startswith("funshard/unshard: ")]
    assert [m.split(" of ")[0] for m in unshard] == [
        "funshard/unshard: all-gather",
        "funshard/unshard: reduce-scatter",
        "funshard/unshard: all-reduce",
    ]
    assert "1 leaf (float32) over mesh axes ('replicate',): 2 elements" in unshard[2]
    caplog.clear()
    step(state, batch)  # compiled: nothing is traced, nothing is written
    assert _messages(caplog) == []


def test_records_come_from_children_of_the_funshard_logger(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    state, batch, step = _step_fn()
    step(state, batch)
    names = {r.name for r in caplog.records if r.name.startswith(LOGGER)}
    assert names == {
        "funshard.comm._mesh",
        "funshard.core._step",
        "funshard.core._unit",
        "funshard.comm._gather",
    }
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_scanned_stack_records_its_plan_layer_by_layer(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    mesh = fs.make_mesh()
    state = fs.shard({"w": jnp.ones((3, 8, 8))}, mesh, stacked=True)

    def loss_fn(s, batch):
        return jnp.mean(fs.scan(lambda layer, h: jnp.tanh(h @ layer["w"]), s, batch))

    # Jitted: the same trace, one compiled program (eagerly, each operation compiles).
    jax.jit(fs.value_and_grad(loss_fn))(state, jnp.ones((8, 8)))
    plans = [m for m in _messages(caplog) if m.startswith("scan ")]
    assert plans == [
        "scan '<lambda>' (in a step, layer by layer, reshard_after_forward=True): gathers "
        "1 sharded leaf, 768 bytes, over mesh axes ('fsdp',): ['w'] (3, 8, 8) float32 768 B"
    ]


def test_nothing_is_logged_or_built_at_the_default_level(caplog, monkeypatch):
    logger = logging.getLogger(LOGGER)
    assert logger.level == logging.NOTSET and not logger.handlers  # the app decides
    assert not logger.isEnabledFor(logging.DEBUG)

    def built(*_args: object, **_kwargs: object) -> str:
        raise AssertionError("a debug message was built with debug records off")

    # The messages are guarded by isEnabledFor: their builders never run.
    monkeypatch.setattr(_mesh, "_describe_mesh", built)
    monkeypatch.setattr(_step, "_describe_root", built)
    monkeypatch.setattr(_unit, "_describe_plan", built)
    monkeypatch.setattr(_gather, "_log_collective", built)
    state, batch, step = _step_fn()
    step(state, batch)
    assert _messages(caplog) == []
