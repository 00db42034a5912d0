"""Host callbacks that raise inside a training step: a Python exception, never an abort.

A raising `jax.debug.callback` ends that device's execution of the program. If every
device raises, XLA reports a `JaxRuntimeError` carrying the callback's message. If only
some devices raise (a NaN check on one device's batch slice), the others wait for them at
the next collective's rendezvous, and XLA CPU kills the process (`LOG(FATAL)` in
`rendezvous.cc` after `xla_cpu_collective_call_terminate_timeout_seconds`, 40 s by
default). A plain `jax.shard_map` step with a `psum` after the callback aborts the same
way. funshard's root therefore records a callback's exception on the device that raised
it and raises it at the end of the step, after the last collective (funshard/core/_callbacks.py).

Each case runs in a child process bounded by a timeout, so that an abort or a hang fails
the test instead of killing or stalling the suite.
"""

import os
import subprocess
import sys
import textwrap

import pytest
from _launch import run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

# The child: one funshard step whose loss runs a raising callback on the devices listed
# in argv[1] ("all" or a device index), then a step with the callback quiet, compared
# with jax.value_and_grad of the unsharded loss. It prints OK only if everything held.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import funshard as fs

    which, nested = sys.argv[1], sys.argv[2] == "nested"
    armed = [True]

    def check(h, device):
        if armed[0] and (which == "all" or int(device) == int(which)):
            raise FloatingPointError("nan-check: callback raised on device %d" % device)

    def block(w, h):
        return jnp.tanh(h @ w["w"] + w["b"])

    def loss(params, batch, unit=block, probe=False):
        h, y = batch
        for w in params:
            h = unit(w, h)
            if probe:
                jax.debug.callback(check, h, jax.lax.axis_index("fsdp"))
        return jnp.mean((h - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 3)
    params = [{"w": jax.random.normal(k, (16, 16)) / 4, "b": jnp.full((16,), 0.1)} for k in keys]
    x = jax.random.normal(jax.random.key(1), (32, 16))
    batch = (x, jnp.sin(x))
    state = fs.shard(params, fs.make_mesh())
    before = [np.asarray(leaf) for leaf in jax.tree.leaves(state)]
    if nested:
        # The callback inside a checkpointed unit, under cond, with microbatches (a scan).
        def probed(w, h):
            h = block(w, h)
            jax.lax.cond(jnp.all(jnp.isfinite(h)),
                         lambda: jax.debug.callback(check, h, jax.lax.axis_index("fsdp")),
                         lambda: None)
            return h

        unit = jax.checkpoint(fs.fully_shard(probed))
        step = jax.jit(fs.value_and_grad(lambda s, b: loss(s, b, unit), microbatches=2))
    else:
        unit = fs.fully_shard(block)
        step = jax.jit(fs.value_and_grad(lambda s, b: loss(s, b, unit, probe=True)))

    start = time.monotonic()
    try:
        jax.block_until_ready(step(state, batch))
    except Exception as e:  # XLA wraps the callback's exception in a JaxRuntimeError
        elapsed = time.monotonic() - start
        assert "nan-check: callback raised" in str(e), str(e)[:2000]
        assert elapsed < 20, elapsed
    else:
        raise AssertionError("the raising callback did not raise")

    for old, leaf in zip(before, jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(leaf), old)

    armed[0] = False
    value, grads = step(state, batch)
    want_value, want_grads = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(fs.unshard(grads)), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    print("OK")
    """
)


def _run_child(
    which: str, nested: bool = False, timeout: float = 120.0
) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # Only the rendezvous timeouts are shortened, so that an abort (the failure this file
    # guards against) shows up in seconds rather than after XLA's default 40 s.
    env["XLA_FLAGS"] = " ".join(
        [
            *(f for f in env.get("XLA_FLAGS", "").split() if "collective_call" not in f),
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5",
            "--xla_cpu_collective_call_terminate_timeout_seconds=10",
        ]
    )
    try:
        return run(
            [sys.executable, "-c", CHILD, which, "nested" if nested else "plain"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the step with a raising callback hung for {timeout} s:\n{e.stderr}")


def _assert_clean(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0 and "OK" in result.stdout, (
        f"child exited with {result.returncode} (-6 or 134: XLA aborted the process)\n"
        f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
    )


def test_callback_raising_on_every_device_raises_and_keeps_the_state():
    _assert_clean(_run_child("all"))


def test_callback_raising_on_one_device_raises_and_keeps_the_state():
    _assert_clean(_run_child("3"))


@pytest.mark.parametrize("which", ["3", "all"])
def test_nested_callback_under_checkpoint_cond_and_microbatches(which):
    _assert_clean(_run_child(which, nested=True))
