"""Obscure failures made clear: donated state, callbacks outside the loss, empty stacks,
and the in-process parts of a departed peer (the multi-process cases are in
tests/test_departed_peer.py)."""

import math
import os
import sys
import textwrap
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _launch import run
from conftest import mesh_for

import funshard as fs
import funshard.distributed
from funshard.distributed import _departure, _runtime

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


class _FakeService:
    """The coordination service's key-value store, as `_departure` uses it."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def blocking_key_value_get(self, key, timeout_ms):
        time.sleep(timeout_ms / 1000)
        raise RuntimeError("DEADLINE_EXCEEDED")

    def leave(self, rank, step, kind="shard_batch call", how="returned normally"):
        note = _departure.Note(rank, step, kind, how, barrier=True)
        self.kv[f"funshard/left/{rank}"] = note.text()


@pytest.fixture
def monitor(monkeypatch):
    service = _FakeService()
    mon = _departure._Monitor(service, rank=0, count=2, timeout=0.6, shutdown_s=1.0)
    monkeypatch.setattr(_departure, "_monitor", mon)
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
        _departure.departure_timeout(value, {})


def test_departure_timeout_from_the_environment():
    env = {"FUNSHARD_DEPARTURE_TIMEOUT": "7.5"}
    assert _departure.departure_timeout(None, env) == 7.5
    assert _departure.departure_timeout(2, env) == 2.0  # the argument wins
    assert _departure.departure_timeout(None, {}) == _departure.DEPARTURE_TIMEOUT <= 60
    assert _departure.departure_timeout(None, {"FUNSHARD_DEPARTURE_TIMEOUT": "inf"}) == math.inf
    with pytest.raises(ValueError, match="FUNSHARD_DEPARTURE_TIMEOUT='-3'"):
        _departure.departure_timeout(None, {"FUNSHARD_DEPARTURE_TIMEOUT": "-3"})
    with pytest.raises(ValueError, match="departure_timeout=-1"):
        fs.distributed.initialize(departure_timeout=-1)  # checked before anything starts


def test_a_collective_future_gives_up_on_a_process_that_left(monitor):
    mon, service = monitor
    worker, release = _departure.OrderedWorker("test"), threading.Event()
    assert worker.submit(lambda: 41 + 1).result() == 42  # no one left: a plain future
    stuck = worker.submit(release.wait)  # a collective the other process never joins
    mon.step, mon.kind = 3, "backward pass"
    service.leave(1, 2, kind="backward pass")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        stuck.result()
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert (
        "process 0 of 2 gives up: process 1 returned normally and left the job after "
        "2 steps (backward passes)" in text
    ), text
    assert "The last step both reached is step 2." in text
    assert "departure_timeout=0.6 s" in text
    release.set()
    assert stuck.result() is True  # the job itself finished meanwhile
    assert worker.submit(lambda: 1).result() == 1  # the worker goes on, in order


def test_a_collective_future_keeps_its_own_exceptions(monitor):
    worker = _departure.OrderedWorker("test")

    def late():
        time.sleep(0.7)
        raise TimeoutError("the job's own timeout")

    with pytest.raises(TimeoutError, match="the job's own timeout"):
        worker.submit(late).result()


def test_shard_batch_wait_raises_when_a_process_left_before_this_step(monitor):
    mon, service = monitor
    mon.step, mon.kind = 3, "shard_batch call"
    service.leave(1, 3)  # it reached this step: wait as usual, then go on unchecked
    assert _runtime._wait_for(service, "verdict", 0.6) is None
    service.leave(1, 2)  # it left before this step: it will never post its batch
    with pytest.raises(
        RuntimeError,
        match=r"shard_batch: process 0 of 2, at step 3: process 1 "
        r"returned normally and left the job after 2 steps \(shard_batch "
        r"calls\), so this step's batch .* The last step both reached is step 2",
    ):
        _runtime._wait_for(service, "verdict", 30)


def test_failure_summary_names_the_process_that_left():
    launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 2, 0, None)
    error = RuntimeError(
        "Gloo AllGather failed: Read error [127.0.0.1]:4411: Connection reset by peer"
    )
    note = _departure.Note(1, 4, "shard_batch call", "raised KeyError", barrier=False)
    text = _runtime.failure_summary(error, launch, {0: "127.0.0.1", 1: "127.0.0.1"}, {1: note})
    assert (
        "a collective failed because process 1 raised KeyError and left the job after "
        "4 steps (shard_batch calls)"
    ) in text


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
