"""Obscure failures made clear: donated state, callbacks outside the loss, empty stacks,
and the in-process parts of a departed peer (the multi-process cases are in
tests/test_departed_peer.py)."""

import atexit
import inspect
import math
import os
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _departure_fakes import FakeService, fake_lifecycle_service
from _launch import run
from conftest import mesh_for

import funshard as fs
import funshard.distributed
from funshard import comm
from funshard.comm import _departures, _key_value
from funshard.distributed import _launch, _lifecycle

# ---- a donated state is an error, never a segfault ----

# Reusing a state a jitted step donated: on a multi-device mesh XLA (jax 0.10) crashes
# the process (one device's "Buffer has been deleted or donated", a segfault on the
# others), so the child runs it and the test reads what it printed.
DONATED_CHILD = textwrap.dedent(
    """
    import os
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import funshard as fs

    state = fs.shard({"w": jnp.ones((16, 4)), "b": jnp.zeros(4)}, fs.make_mesh())
    def loss(s, x):
        p = fs.unshard(s)
        return jnp.mean(x @ p["w"].T + p["b"].sum())
    step = jax.jit(fs.value_and_grad(loss), donate_argnums=0)
    x = jnp.ones((8, 4))
    step(state, x)                                   # donates state's buffers
    for name, again in [("step", lambda: step(state, x)), ("unshard", lambda: fs.unshard(state))]:
        try:
            again()
        except RuntimeError as e:
            print(name, "RuntimeError:", e)
        else:
            print(name, "did not raise")
    """
)


@pytest.mark.multiprocess
def test_reusing_a_donated_state_raises_instead_of_crashing():
    result = run(
        [sys.executable, "-c", DONATED_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0, (
        f"child exited {result.returncode} (139: segfault)\n{result.stderr[-3000:]}"
    )
    for name in ("step", "unshard"):
        assert (
            f"{name} RuntimeError: Array has been deleted: fs.Sharded leaf of shape"
            in result.stdout
        ), result.stdout + result.stderr[-2000:]
    assert "Use the state that call returned" in result.stdout


def test_donation_still_works_and_live_leaves_are_untouched():
    state = fs.shard({"w": jnp.arange(12.0).reshape(6, 2)}, mesh_for("4"))
    step = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    new = step(state)
    np.testing.assert_array_equal(fs.unshard(new)["w"], np.arange(12.0).reshape(6, 2) + 1)
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        _ = state["w"].data


# ---- host callbacks outside the loss: said before the step runs ----


def _root_and_batch():
    state = fs.shard({"w": jnp.ones((16, 16)) / 4}, mesh_for("8"))

    def loss(p, b):
        h = jnp.tanh(b @ fs.unshard(p)["w"])
        jax.debug.callback(lambda v: None, h)  # inside the loss: funshard defers it
        jax.debug.print("inside {}", h.sum())
        return jnp.mean(h**2)

    return fs.value_and_grad(loss), state, jnp.ones((32, 16))


def test_callback_before_the_root_is_detected_at_trace_time():
    root, state, x = _root_and_batch()

    def check(batch):
        pass

    def step(state, x):
        jax.debug.callback(check, x)  # outside the loss: an abort if it raised on a device
        return root(state, x)

    with pytest.warns(
        RuntimeWarning,
        match=r"runs jax\.debug\.callback before "
        r"fs\.value_and_grad, outside the loss function \(at .*test_hardening",
    ):
        jax.jit(step).lower(state, x)  # traced only: nothing runs


def test_callbacks_inside_the_loss_and_prints_do_not_warn():
    root, state, x = _root_and_batch()

    def step(state, x):
        jax.debug.print("x {}", x.sum())
        loss, _grads = root(state, x)
        again, _ = root(state, x)  # a second root sees the first one's callbacks: its own
        return loss + again

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(step).lower(state, x)


# ---- fs.scan over a stack with no layers ----


def test_scan_over_zero_layers_names_the_stack():
    stack = fs.shard(
        {"w": jnp.zeros((0, 8, 8)), "b": jnp.zeros((0, 8))}, mesh_for("4"), stacked=True
    )

    def layer(p, h):
        return jnp.tanh(h @ p["w"] + p["b"])

    def loss(s, h):
        return jnp.mean(fs.scan(layer, s, h) ** 2)

    match = r"fs\.scan\(layer, \.\.\.\) holds no layers.*\['b'\] \(0, 8\), \['w'\] \(0, 8, 8\)"
    with pytest.raises(ValueError, match=match):
        jax.jit(fs.value_and_grad(loss))(stack, jnp.ones((8, 8)))
    with pytest.raises(ValueError, match=match):  # outside a step too
        fs.scan(layer, stack, jnp.ones((8, 8)))


def test_scan_layer_counts_must_agree():
    stack = fs.shard({"w": jnp.zeros((3, 8, 8))}, mesh_for("4"), stacked=True)
    with pytest.raises(ValueError, match=r"disagree on the number of layers.*\['gain'\] \(2,\)"):
        fs.scan(lambda p, h: h * p["gain"], {**stack, "gain": jnp.ones(2)}, jnp.ones((8, 8)))


# ---- `.data` inside a step: the local block, read by mistake ----


def test_data_in_the_loss_is_an_error_naming_the_local_block():
    state = fs.shard({"w": jnp.ones((16, 4))}, mesh_for("8"))

    def loss(s, x):
        return jnp.mean(x @ s["w"].data.T)  # looks like the parameter; is 2 of its 16 rows

    with pytest.raises(
        TypeError,
        match=r"`\.data` of a sharded parameter of shape \(16, 4\) "
        r"read inside a funshard step: .* local block, of shape \(2, 4\)",
    ):
        jax.jit(fs.value_and_grad(loss))(state, jnp.ones((8, 4)))


def test_local_blocks_on_purpose_and_transforms_still_work():
    params = {"w": jnp.arange(64.0).reshape(16, 4) / 64}
    state = fs.shard(params, mesh_for("8"))

    def loss(s, x):
        local = jax.tree.leaves(s["w"])[0]  # the pytree child: the local block, on purpose
        decay = jax.lax.psum(jnp.sum(local**2), "fsdp")
        inner = jax.checkpoint(jax.jit(lambda t: jnp.mean(x @ fs.unshard(t)["w"].T)))
        return inner(s) + decay

    value, _ = jax.jit(fs.value_and_grad(loss))(state, jnp.ones((8, 4)))
    want = jnp.mean(jnp.ones((8, 4)) @ params["w"].T) + jnp.sum(params["w"] ** 2)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    assert state["w"].data.shape == (16, 4)  # outside a step: the padded global array
    assert jax.jit(lambda s: s["w"].data * 2)(state).shape == (16, 4)


# ---- a departed peer, in process: timeouts, the futures, shard_batch's wait, messages ----


@pytest.fixture
def monitor(monkeypatch):
    service = FakeService()
    mon = comm.Board(service, rank=0, count=2, timeout=0.6)
    monkeypatch.setattr(_departures, "_board", mon)
    return mon, service


@pytest.mark.parametrize(
    "value,source",
    [
        (-1, "departure_timeout"),
        (0, "departure_timeout"),
        ("soon", "departure_timeout"),
        (True, "departure_timeout"),
    ],
)
def test_departure_timeout_must_be_positive(value, source):
    with pytest.raises(ValueError, match=f"{source}={value!r} is not a positive number"):
        _departure_timeout(value, {})


def _departure_timeout(value, environ):
    """`departure_timeout` as `initialize` reads it: the one timeout parser."""
    return _launch.seconds(
        "departure_timeout",
        value,
        _launch.DEPARTURE_TIMEOUT,
        environ=environ,
        env="FUNSHARD_DEPARTURE_TIMEOUT",
        infinite=True,
    )


def test_departure_timeout_from_the_environment():
    env = {"FUNSHARD_DEPARTURE_TIMEOUT": "7.5"}
    assert _departure_timeout(None, env) == 7.5
    assert _departure_timeout(2, env) == 2.0  # the argument wins
    assert _departure_timeout(None, {}) == _launch.DEPARTURE_TIMEOUT <= 60
    assert _departure_timeout(None, {"FUNSHARD_DEPARTURE_TIMEOUT": "inf"}) == math.inf
    with pytest.raises(ValueError, match="FUNSHARD_DEPARTURE_TIMEOUT='-3'"):
        _departure_timeout(None, {"FUNSHARD_DEPARTURE_TIMEOUT": "-3"})
    with pytest.raises(ValueError, match="departure_timeout=-1"):
        fs.distributed.initialize(departure_timeout=-1)  # checked before anything starts


def _await_batch_verdict(service, wait_s: float):
    # shard_batch's wait for the verdict: the shared key wait with its departure check.
    deadline = time.monotonic() + wait_s
    return _key_value.await_key(service, "verdict", deadline, comm.left_before_this_step)


def test_shard_batch_wait_raises_when_a_process_left_before_this_step(monitor):
    mon, service = monitor
    mon.step, mon.kind = 3, "shard_batch call"
    service.leave(1, 3)  # it reached this step: wait as usual, then go on unchecked
    assert _await_batch_verdict(service, 0.6) is None
    service.leave(1, 2)  # it left before this step: it will never post its batch
    with pytest.raises(
        RuntimeError,
        match=r"shard_batch: process 0 of 2, at step 3: process 1 "
        r"returned normally and left the job after 2 steps \(shard_batch "
        r"calls\), so this step's batch .* The last step both reached is step 2",
    ):
        _await_batch_verdict(service, 30)


def test_failure_summary_names_the_process_that_left():
    launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 2, 0, None)
    error = RuntimeError(
        "Gloo AllGather failed: Read error [127.0.0.1]:4411: Connection reset by peer"
    )
    note = comm.Note(1, 4, "shard_batch call", "raised KeyError", barrier=False)
    text = _lifecycle.failure_summary(error, launch, {0: "127.0.0.1", 1: "127.0.0.1"}, {1: note})
    assert (
        "a collective failed because process 1 raised KeyError and left the job after "
        "4 steps (shard_batch calls)"
    ) in text


# ---- fail_fast: the one switch for process-wide behaviour, off by default ----


@pytest.fixture
def lifecycle(monkeypatch):
    """A process's lifecycle on a fake service (no processes): its exits are recorded."""
    service, exits = fake_lifecycle_service(monkeypatch)

    def make(fail_fast: bool) -> _lifecycle.Lifecycle:
        launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 2, 1, None)
        _lifecycle.start(service, launch, math.inf, 0.3, 100, fail_fast, 1.0)
        made = _lifecycle._current
        assert made is not None
        monkeypatch.setattr(made.board, "timeout", 0.6)
        return made

    yield make, service, exits
    if _lifecycle._current is not None:
        atexit.unregister(_lifecycle._current.at_exit)


def test_initialize_is_quiet_by_default():
    assert inspect.signature(fs.distributed.initialize).parameters["fail_fast"].default is False


@pytest.mark.parametrize(
    "waited,fail_fast,warned,action",
    [
        (0.5, False, False, "wait"),
        (0.5, True, False, "wait"),
        (1.0, True, False, "exit"),
        (1.0, False, False, "warn"),
        (1.0, False, True, "done"),
    ],
)
def test_watchdog_action(waited, fail_fast, warned, action):
    assert _lifecycle.watchdog_action(waited, 1.0, fail_fast, warned) == action


def test_without_fail_fast_excepthook_and_process_are_left_alone(lifecycle, monkeypatch, capsys):
    make, service, exits = lifecycle
    hook = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", hook)  # restored whatever happens
    life = make(fail_fast=False)
    assert sys.excepthook is hook
    life.board.step, life.board.kind = 3, "shard_batch call"
    service.leave(0, 2)
    life.board.refresh()
    assert life.on_stuck(0.1) == "wait"
    assert life.on_stuck(0.7) == "warn"
    assert life.on_stuck(5.0) == "done"  # said once: the watchdog thread then returns
    err = capsys.readouterr().err
    assert err.count("funshard.distributed: process 1 of 2 is stuck: process 0 returned ") == 1
    assert "left the job after 2 steps (shard_batch calls)" in err, err
    assert "The last step both reached is step 2." in err, err
    assert "does not exit by itself" in err and "heartbeat_timeout=100 s" in err, err
    assert "fail_fast=True" in err, err
    assert exits == []
    assert "funshard/left/1" not in service.kv  # it did not leave
    # At exit, a process whose peer left without JAX's barrier says so and goes into it.
    service.leave(0, 2, barrier=False)
    life.at_exit()
    assert exits == []
    err = capsys.readouterr().err
    assert "process 0 left without JAX's shutdown barrier" in err, err
    assert '"barrier": true' in service.kv["funshard/left/1"]  # it waits in the barrier


def test_with_fail_fast_the_process_ends_at_once(lifecycle, monkeypatch, capsys):
    make, service, exits = lifecycle
    hook = sys.excepthook
    monkeypatch.setattr(sys, "excepthook", hook)
    life = make(fail_fast=True)
    assert sys.excepthook is not hook
    service.leave(0, 2)
    life.board.refresh()
    assert life.on_stuck(0.7) == "exit"
    assert exits == [1]
    assert "process 1 of 2 gives up: process 0 returned normally" in capsys.readouterr().err
    assert '"barrier": false' in service.kv["funshard/left/1"]
    sys.excepthook(KeyError, KeyError("k"), None)  # the hook: summary, then exit 1
    assert exits == [1, 1]
    assert "stops on an uncaught KeyError" in capsys.readouterr().err


def test_a_leftover_set_mesh_is_named_by_the_root():
    # Flax's tutorials leave `jax.set_mesh(...)` set; the root's shard_map then failed
    # with JAX's raw mesh-mismatch error, for a linen model sharded with plain fs.shard too.
    mesh = fs.make_mesh()
    state = fs.shard({"w": jnp.ones((8, 4))}, mesh)
    batch = jnp.ones((8, 4))
    step = fs.value_and_grad(lambda s, b: jnp.mean((b @ fs.unshard(s)["w"].T) ** 2))
    other = jax.make_mesh((2, 4), ("data", "model"))
    with jax.set_mesh(other), pytest.raises(ValueError, match=r"jax\.set_mesh \(data=2, model=4"):
        step(state, batch)
    with jax.set_mesh(mesh):  # the state's own mesh is fine
        loss, _ = step(state, batch)
    assert float(loss) == float(step(state, batch)[0])
