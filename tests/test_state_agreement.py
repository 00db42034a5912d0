"""Processes that built different models: a clear error on every process, not SIGABRT.

Each case starts two real processes (`tests/_state_agreement_worker.py`) on 127.0.0.1 with
torchrun's environment set by hand. Before this check, process 1 with 18 rows in `w1`
where process 0 has 16 made gloo abort both in the step's first all-gather.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _launch import free_port, launch, rank_env

import funshard as fs
from funshard.comm import _state_agreement

WORKER = Path(__file__).with_name("_state_agreement_worker.py")
HARD_CAP_S = 90


def _run(tmp_path: Path, *args: str) -> tuple[list, dict]:
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    argv = [sys.executable, str(WORKER), *args]
    with launch(tmp_path, {r: (argv, rank_env(r, 2, port)) for r in range(2)}, HARD_CAP_S) as job:
        codes = job.wait()
    assert None not in codes.values(), f"still running after {HARD_CAP_S} s: {job.logs()}"
    return list(codes.values()), job.logs()


@pytest.mark.multiprocess
def test_processes_with_different_models_raise_the_same_clear_error(tmp_path):
    codes, logs = _run(tmp_path, "--bigger-rank", "1")
    assert codes == [1, 1], logs  # fail_fast's exit, not -6 (SIGABRT from gloo)
    for log in logs.values():
        assert (
            "DistributedError: value_and_grad: the processes traced the step with "
            "different states" in log
        ), log
        assert (
            "state['w1'] is float32 (16, 4) sharded on dim 0 over ('fsdp',) on process 0; "
            "float32 (18, 4) sharded on dim 0 over ('fsdp',) on process 1 "
            "(1 more leaves differ)" in log
        ), log
        assert "EnforceNotMet" not in log and "step 0 loss" not in log, log


@pytest.mark.multiprocess
def test_processes_with_the_same_model_train(tmp_path):
    codes, logs = _run(tmp_path)
    assert codes == [0, 0], logs
    # Two steps, one trace: one comparison per process; both print the same losses.
    losses = {r: [line for line in log.splitlines() if " loss " in line] for r, log in logs.items()}
    assert [line.split(": ", 1)[1] for line in losses[0]] == [
        line.split(": ", 1)[1] for line in losses[1]
    ], logs
    assert len(losses[0]) == 2
    for log in logs.values():
        assert log.count("compared across 2 processes") == 1, log


# ---- in-process: the signature and the message ------------------------------------


def test_signature_names_layout_policy_and_plain_leaves():
    mesh = fs.make_mesh(devices=jax.devices()[:2])
    policy = fs.MixedPrecisionPolicy(param_dtype=jnp.bfloat16)
    state = {
        "w": fs.shard(jnp.ones((3, 2)), mesh, mp_policy=policy),
        "s": jnp.zeros(()),
        "n": None,
        "name": "mlp",
    }
    sig = dict(_state_agreement.signature(state))
    assert sig["['w']"]["shape"] == [3, 2] and sig["['w']"]["dim"] == 0
    assert "bfloat16" in sig["['w']"]["mp_policy"]
    assert sig["['s']"] == {"kind": "array", "shape": [], "dtype": "float32"}
    assert sig["['name']"] == {"kind": "str"} and "['n']" not in sig  # None: no leaf


def test_message_names_the_first_differing_leaf_and_each_process():
    mesh = fs.make_mesh(devices=jax.devices()[:2])
    a = _state_agreement.signature(
        fs.shard({"a": np.ones((4, 2), np.float32), "b": np.ones(3, np.float32)}, mesh)
    )
    b = _state_agreement.signature(
        fs.shard({"a": np.ones((4, 2), np.float32), "b": np.ones(3, np.float16)}, mesh)
    )
    text = _state_agreement._states_differ("value_and_grad", {0: a, 1: a, 2: b})
    assert (
        "leaf state['b'] is float32 (3,) sharded on dim 0 over ('fsdp',) on processes "
        "0-1; float16 (3,) sharded on dim 0 over ('fsdp',) on process 2." in text
    )
    c = _state_agreement.signature({"a": fs.shard(np.ones((4, 2), np.float32), mesh)})
    text = _state_agreement._states_differ("value_and_grad", {0: a, 1: c})
    assert (
        "state['b'] is float32 (3,) sharded on dim 0 over ('fsdp',) on process 0; "
        "absent on process 1" in text
    )


def test_single_process_does_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _state_agreement._jax_compat, "coordination_client", lambda: calls.append(1)
    )
    _state_agreement.same_state("value_and_grad", {"w": np.ones(2)})
    assert calls == [1]  # looked for a client, found none, compared nothing
