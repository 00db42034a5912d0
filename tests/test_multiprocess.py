"""Multi-process training over gloo on 127.0.0.1 against the single-process run.

Each case starts real processes (`tests/_mp_worker.py`) with torchrun's environment
variables set by hand (torchrun itself is not needed), trains the transformer block of
tests/_models.py for 5 AdamW steps, and compares losses and final parameters with the
same training run in this process on as many of its 8 CPU devices.
"""

import functools
import signal
import sys
import time
from pathlib import Path

import _mp_worker as worker
import jax
import numpy as np
import pytest
from _launch import LAUNCH_VARS, free_port, launch, rank_env
from _models import block_params
from jax.sharding import PartitionSpec

import funshard as fs
import funshard.distributed
from funshard.distributed._lifecycle import failure_summary

WORKER = Path(__file__).with_name("_mp_worker.py")
HARD_CAP_S = 120  # per test: a hung job fails the test instead of the CI run
FAULT_LIMIT_S = 60
STEPS = 5


def _job(tmp_path: Path, processes: int, *args: str):
    """Starts `processes` workers (stdout and stderr apart); `launch` kills what is left."""
    port = free_port(pair=True)  # MASTER_PORT; JAX's coordinator takes port + 1
    argv = [sys.executable, str(WORKER), "--out", str(tmp_path), *args]
    return launch(
        tmp_path,
        {r: (argv, rank_env(r, processes, port)) for r in range(processes)},
        HARD_CAP_S,
        separate_stderr=True,
    )


def _wait(job) -> list[int]:
    codes = job.wait()
    if None in codes.values():
        pytest.fail(f"multi-process job still running after {HARD_CAP_S} s (killed)")
    return list(codes.values())


@pytest.fixture(scope="module")
def params_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("params") / "params.npz"
    # One quickly compiled program instead of a compile per jax.random call (seconds).
    key = jax.random.key(1)
    init = jax.jit(block_params).lower(key).compile(worker.COMPILER_OPTIONS)
    worker.save_tree(str(path), init(key))
    return path


@functools.cache
def _reference(devices: int, replicate, params_path: str):
    """The same training in this process on its first `devices` devices."""
    mesh = fs.make_mesh(replicate, devices=jax.devices()[:devices])
    rows = worker.ROWS_PER_DEVICE * devices
    params = worker.load_params(params_path)
    return worker.train(mesh, params, STEPS, lambda i: worker.global_batch(i, rows))


def _run_and_compare(tmp_path, params_file, processes, devices, replicate, ref_devices, save=None):
    args = ["--params", str(params_file), "--devices", str(devices), "--steps", str(STEPS)]
    if replicate:
        args += ["--replicate", str(replicate)]
    if save:
        args += ["--save", str(save)]
    with _job(tmp_path, processes, *args) as job:
        codes = _wait(job)
    assert codes == [0] * processes, "\n\n".join(job.logs().values())
    for rank in range(processes):
        assert "watchdog alive at exit: False" in job.log(rank, "out"), job.log(rank)
    got = np.load(tmp_path / "result.npz")
    want_losses, want_params = _reference(ref_devices, replicate, str(params_file))
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5, atol=1e-5)
    for path, want in jax.tree_util.tree_leaves_with_path(want_params):
        np.testing.assert_allclose(got[jax.tree_util.keystr(path)], want, rtol=1e-5, atol=1e-5)


@pytest.mark.multiprocess
def test_two_processes_one_device_each_match_two_devices(tmp_path, params_file):
    # 2 global devices in all, so the reference is the single-process 2-device run.
    _run_and_compare(tmp_path, params_file, processes=2, devices=1, replicate=None, ref_devices=2)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_two_devices_each_match_four_devices(tmp_path, params_file):
    # The processes also checkpoint their shards; restore it here on 8 and 3 devices.
    ckpt = tmp_path / "ckpt"
    _run_and_compare(
        tmp_path, params_file, processes=2, devices=2, replicate=None, ref_devices=4, save=ckpt
    )
    _, want = _reference(4, None, str(params_file))
    for n in (8, 3):
        mesh = fs.make_mesh(devices=jax.devices()[:n])
        like = fs.shard(worker.load_params(str(params_file)), mesh)
        restored = fs.unshard(fs.restore(ckpt, like))
        for (path, got), w in zip(
            jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(want), strict=True
        ):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5, err_msg=str(path))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_four_process_hsdp_matches_single_process_hsdp(tmp_path, params_file):
    # make_mesh(replicate=2) over 4 processes x 1 device: each replica spans 2 processes.
    _run_and_compare(tmp_path, params_file, processes=4, devices=1, replicate=2, ref_devices=4)


# Measured with jax 0.10.2: when process 1 dies, process 0's next collective fails at
# once ("Gloo AllGather failed: ... Connection reset by peer"), but without fail_fast the
# process then waits in JAX's shutdown barrier until the dead one's heartbeat times out
# (~100 s) and aborts. When process 0 (the coordination service) dies, JAX terminates
# process 1 by itself within a second ("Terminating process because the JAX distributed
# service detected fatal errors"), unless its failed collective reaches fail_fast first.
# Process 0 names a dead process 1 at once from its start-up connection, then fails
# naming it (its next shard_batch refuses, or a collective fails).
SURVIVOR_MESSAGES = {
    1: (
        "funshard.distributed: process 0 of 2 stops: a collective failed because process 1 ",
        "funshard.distributed: process 0 of 2 stops on an uncaught DistributedError, after "
        "process 1 died (",
    ),
    0: (
        "funshard.distributed: process 1 of 2 stops",
        "Terminating process because the JAX distributed service detected fatal errors",
    ),
}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("dead", [1, 0])
def test_survivor_exits_promptly_when_a_peer_dies(tmp_path, params_file, dead):
    survivor = 1 - dead
    start = time.monotonic()
    args = [
        "--params",
        str(params_file),
        "--devices",
        "1",
        "--steps",
        str(STEPS),
        "--die-rank",
        str(dead),
        "--die-after-step",
        "2",
    ]
    with _job(tmp_path, 2, *args) as job:
        codes = _wait(job)
    elapsed = time.monotonic() - start
    stderr = job.log(survivor, "err")
    assert codes[dead] == -signal.SIGKILL, job.log(dead)
    assert codes[survivor] != 0 and elapsed < FAULT_LIMIT_S, (codes, elapsed, stderr)
    assert "step 2 " in job.log(survivor, "out")
    assert any(m in stderr for m in SURVIVOR_MESSAGES[dead]), stderr


# ---- In-process checks: environment resolution, single-process start, shard_batch ----


def test_resolve_launch_torchrun_environment():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    # MASTER_PORT is torch's store (torchrun's agent, or init_process_group without
    # torchrun): JAX's coordinator takes the next port, under torchrun or not.
    launch = fs.distributed.resolve_launch(environ=env)
    assert launch == fs.distributed.Launch("torchrun", "10.0.0.1:29501", 8, 3, (1,))
    agent = fs.distributed.resolve_launch(environ={**env, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert agent.coordinator_address == "10.0.0.1:29501"
    with pytest.raises(ValueError, match="MASTER_PORT=65535 leaves no port for JAX's"):
        fs.distributed.resolve_launch(environ={**env, "MASTER_PORT": "65535"})
    # One process per node keeps all of its devices.
    single = fs.distributed.resolve_launch(environ={**env, "LOCAL_WORLD_SIZE": "1"})
    assert single.local_device_ids is None


def test_resolve_launch_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
        "SLURM_LAUNCH_NODE_IPADDR": "10.1.2.3",
        "SLURM_JOB_ID": "4097",
    }
    launch = fs.distributed.resolve_launch(environ=env)
    assert launch == fs.distributed.Launch("slurm", "10.1.2.3:61441", 8, 5, (1,))
    with_master = fs.distributed.resolve_launch(
        environ={**env, "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    )
    assert with_master.coordinator_address == "node0:1235"  # MASTER_PORT + 1, as torchrun


def test_resolve_launch_explicit_arguments_win():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    launch = fs.distributed.resolve_launch("b:2", 4, 3, local_device_ids=[0, 1], environ=env)
    assert launch == fs.distributed.Launch("torchrun", "b:2", 4, 3, (0, 1))
    bare = fs.distributed.resolve_launch("h:9", 2, 0, environ={})
    assert bare.launcher == "arguments" and bare.multi_process
    assert (
        fs.distributed.resolve_launch(
            environ={"JAX_COORDINATOR_ADDRESS": "c:3", **env}
        ).coordinator_address
        == "c:3"
    )


@pytest.mark.parametrize(
    "env,match",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "no coordinator address"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "process_id=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ],
)
def test_resolve_launch_errors(env, match):
    with pytest.raises(ValueError, match=match):
        fs.distributed.resolve_launch(environ=env)


def test_initialize_single_process_is_a_no_op(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    mesh = fs.distributed.initialize()
    assert not jax.distributed.is_initialized()
    assert mesh.axis_names == ("fsdp",) and list(mesh.devices.flat) == jax.devices()
    assert fs.distributed.initialize() == mesh  # a second call is fine
    hsdp = fs.distributed.initialize(replicate=2)
    assert dict(hsdp.shape) == {"replicate": 2, "fsdp": jax.device_count() // 2}


def test_initialize_after_jax_started_says_what_to_do(monkeypatch):
    # This test process has used JAX already: a multi-process start must refuse clearly.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    jax.devices()
    with pytest.raises(RuntimeError, match="process 0 of 2 already used JAX"):
        fs.distributed.initialize()
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("replicate", [None, 2])
def test_shard_batch_single_process(replicate):
    mesh = fs.make_mesh(replicate, devices=jax.devices()[:4])
    rows = {"x": np.arange(24.0).reshape(8, 3), "y": [np.arange(8, dtype=np.int32)]}
    batch = fs.distributed.shard_batch(rows, mesh)
    axes = ("fsdp",) if replicate is None else ("replicate", "fsdp")
    for got, want in zip(jax.tree.leaves(batch), jax.tree.leaves(rows), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.sharding.spec == PartitionSpec(axes[0] if len(axes) == 1 else axes)
        assert got.addressable_shards[0].data.shape[0] == 2


def test_shard_batch_errors():
    mesh = fs.make_mesh(devices=jax.devices()[:4])
    with pytest.raises(
        ValueError, match=r"shard_batch: leaf \['y'\]\[0\] has 6 rows.*multiple of 4"
    ):
        fs.distributed.shard_batch({"x": np.zeros((8, 2)), "y": [np.zeros(6)]}, mesh)
    with pytest.raises(ValueError, match=r"shard_batch: leaf \['s'\] is a scalar"):
        fs.distributed.shard_batch({"s": np.float32(1.0)}, mesh)
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        fs.distributed.shard_batch(np.zeros(4), "mesh")


def test_failure_summary_names_the_dead_peer():
    launch = fs.distributed.Launch("torchrun", "127.0.0.1:1", 3, 0, None)
    hosts = {0: "127.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
    error = RuntimeError(
        "Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] "
        "Read error [10.0.0.3]:43441: Connection reset by peer"
    )
    text = failure_summary(error, launch, hosts)
    assert "process 0 of 3 stops" in text and "process 2 (10.0.0.3:43441) is gone" in text
    own = failure_summary(KeyError("k"), launch, hosts)
    assert "uncaught KeyError" in own
