"""`initialize`: the launcher's environment -> JAX's multi-process runtime -> the global mesh.

A thin composition: `_launch` reads where this process sits and the settings,
`_rendezvous` has every process meet process 0 first, `jax.distributed.initialize`
starts JAX's runtime (gloo collectives on CPU, NCCL on GPU), and `_lifecycle` starts the
departure notes, the watchdog and, with `fail_fast`, the process-wide behaviour. See
docs/distributed.md.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from funshard import _jax_compat, comm, errors
from funshard.distributed import _launch, _lifecycle, _rendezvous
from funshard.distributed._launch import Launch
from funshard.distributed._links import Links


def global_devices() -> list[jax.Device]:
    """All devices of the job, ordered by (process index, local device order).

    The position in this list, never `device.id` (0, 2048, ... across processes), is
    what the mesh uses: process p's devices form one contiguous block.
    """
    return [d for p in range(jax.process_count()) for d in jax.local_devices(process_index=p)]


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    replicate: int | None = None,
    initialization_timeout: float | None = None,
    heartbeat_timeout: float = _launch.HEARTBEAT_TIMEOUT,
    shutdown_timeout: float = _launch.SHUTDOWN_TIMEOUT,
    fail_fast: bool = False,
    departure_timeout: float | None = None,
) -> Mesh:
    """Starts JAX's multi-process runtime from the launcher's environment; returns the mesh.

    Call it first, before any other JAX call (JAX fixes its devices on first use).
    Explicit arguments win over the environment. torchrun's RANK / WORLD_SIZE /
    LOCAL_RANK / MASTER_ADDR / MASTER_PORT are read first, then SLURM's SLURM_PROCID /
    SLURM_NTASKS / SLURM_LOCALID (coordinator: MASTER_ADDR or SLURM_LAUNCH_NODE_IPADDR).
    A single process without such an environment starts nothing and just returns the
    mesh over its local devices. Calling it again returns the mesh again.

    Before JAX's runtime starts, the processes meet on the coordinator's port: a
    process still waiting after a second prints one line to stderr saying for whom
    and how long, and one that gives up raises in Python (JAX itself would abort the
    process in C++ when its own connection times out).

    Args:
      coordinator_address: "host:port" where process 0 runs JAX's coordination service.
      num_processes: number of processes in the job.
      process_id: this process's rank.
      local_device_ids: the accelerators this process drives (default: its LOCAL_RANK
        when the launcher runs several processes per node, else all it sees). CPU
        devices are set with `jax.config.update("jax_num_cpu_devices", k)` instead.
      replicate: as in `funshard.make_mesh`: None for a 1-D "fsdp" mesh over all
        devices of all processes, k for HSDP ("replicate", "fsdp") of shape (k, n/k).
      initialization_timeout: seconds every process waits for all others to connect
        (None: the environment variable FUNSHARD_INITIALIZATION_TIMEOUT, else 300).
      heartbeat_timeout: seconds without a heartbeat after which the coordination
        service declares a process dead and stops every process of the job.
      shutdown_timeout: seconds a finishing process waits for the others at exit.
      fail_fast: the one switch for process-wide behaviour; default False, since a
        library does not end its user's process unless asked. True: on an uncaught
        exception (its own, or a collective failing because another process died)
        print the traceback and a summary naming the dead process where it can, then
        exit at once with status 1, skipping JAX's shutdown barrier (which would wait
        for the dead process up to `heartbeat_timeout`, and keep the other processes
        blocked meanwhile); the departure watchdog exits with status 1; and at exit a
        process whose peers left without the barrier skips it. False: `sys.excepthook`
        is left alone and funshard never exits the process; the watchdog prints once
        who left and what JAX will do, and JAX's own timeouts end the job. With
        either, a process that dies (SIGKILL, a crash) is named on stderr at once.
      departure_timeout: seconds a process waits, without progress, for a process
        that has left the job (returned from its script early, or ended on an
        exception) before the watchdog acts (see `fail_fast`; a torch_frontend
        collective raises a RuntimeError instead). None: the environment variable
        FUNSHARD_DEPARTURE_TIMEOUT, else 30; `math.inf` never gives up. See
        docs/distributed.md.

    Returns:
      The global mesh, devices ordered by (process index, local device order).

    Raises:
      ValueError: inconsistent rank / world size, no coordinator for several
        processes, a coordinator host that does not resolve, a timeout that is not a
        positive number of seconds, or `replicate` does not divide the global device
        count.
      TimeoutError: within `initialization_timeout`, some processes never arrived
        (named by rank) or process 0's coordinator was not reached.
      RuntimeError: JAX's backend already started in this process before the call, or
        process 0 cannot listen on the coordinator's port, or a peer was rejected
        (another job size, a rank taken twice).
    """
    timeout = _launch.seconds(
        "initialization_timeout",
        initialization_timeout,
        _launch.INITIALIZATION_TIMEOUT,
        env=_launch.INITIALIZATION_TIMEOUT_ENV,
    )
    departure = _launch.seconds(
        "departure_timeout",
        departure_timeout,
        _launch.DEPARTURE_TIMEOUT,
        env=_launch.DEPARTURE_TIMEOUT_ENV,
        infinite=True,
    )
    heartbeat = _launch.seconds("heartbeat_timeout", heartbeat_timeout, _launch.HEARTBEAT_TIMEOUT)
    shutdown = _launch.seconds("shutdown_timeout", shutdown_timeout, _launch.SHUTDOWN_TIMEOUT)
    launch = _launch.resolve_launch(
        coordinator_address, num_processes, process_id, local_device_ids
    )
    if launch.multi_process and not jax.distributed.is_initialized():
        source = _launch.address_source(coordinator_address, launch, os.environ)
        links = _start(launch, source, timeout, heartbeat, shutdown)
        _lifecycle.start(
            _jax_compat.coordination_client(),
            launch,
            departure,
            shutdown,
            heartbeat,
            fail_fast,
            timeout,
            links,
        )
    return comm.make_mesh(replicate, devices=global_devices())


def _backend_already_started(launch: Launch) -> str:
    return (
        f"initialize: process {launch.process_id} of {launch.num_processes} already used "
        "JAX (jax.devices(), an array, a computation, ...) before this call, so its "
        "devices are fixed to this process alone. Call funshard.distributed.initialize() "
        "first, right after the imports."
    )


def _started_before_import(pool: int | None, launch: Launch | None) -> str:
    lost = []
    if pool is not None:
        devices = jax.local_device_count()
        lost.append(
            f"funshard could not size the CPU backend's thread pool for its {devices} "
            "devices: an asynchronous loop (steps never waited for) can make XLA abort "
            f'the process ("Expected {devices} threads to join the rendezvous")'
        )
    if launch is not None:
        lost.append(
            f"this process ({launch.launcher}: process {launch.process_id} of "
            f"{launch.num_processes}) can no longer start the multi-process runtime: "
            "funshard.distributed.initialize() will raise"
        )
    fix = "import funshard right after jax and jax.config.update, before anything uses JAX"
    if launch is not None:
        fix += ", then call funshard.distributed.initialize() before any other JAX call"
    if pool is not None:
        fix += f"; or set PJRT_NPROC={pool} in the environment before JAX starts"
    return (
        "import funshard: JAX's backend already started in this process (jax.devices(), "
        f"an array or a computation ran before funshard was imported), so {'; and '.join(lost)}. "
        f"To fix it, {fix} (docs/distributed.md, docs/concepts.md)."
    )


def warn_if_backend_started() -> None:
    """Warns, at `import funshard`, if JAX's backend started first and that loses something.

    Two things must happen before the backend starts: the CPU pool's sizing
    (`_jax_compat.widen_cpu_pool`) and, in a multi-process launch, `initialize`.
    Starts no backend.

    Warns:
      BackendStartedWarning: the CPU pool is too small for the asynchronous loops of
        its simulated devices, or the launcher's environment asks for several
        processes while `jax.distributed` was not started.
    """
    if not _jax_compat.backends_started():
        return
    try:
        launch: Launch | None = _launch.resolve_launch()
    except errors.FunshardError:  # initialize() names a bad environment itself
        launch = None
    if launch is not None and not (launch.multi_process and not jax.distributed.is_initialized()):
        launch = None
    pool = _jax_compat.cpu_pool_missed()
    if pool is not None or launch is not None:
        warnings.warn(
            _started_before_import(pool, launch), errors.BackendStartedWarning, stacklevel=2
        )


def _whole_seconds(seconds: float) -> int:
    """JAX takes its timeouts in whole seconds, at least 1."""
    return max(1, math.ceil(seconds))


def _start(
    launch: Launch, source: str, timeout: float, heartbeat_s: float, shutdown_s: float
) -> Links:
    """Meets the other processes, then starts `jax.distributed` with every setting resolved.

    Returns the rendezvous connections, kept open as liveness links.
    """
    host, port = _launch.endpoint(launch.coordinator_address or "", source)
    # Checked before the rendezvous: a process that cannot start anyway must not make
    # the others wait for it.
    if _jax_compat.backends_started():
        raise errors.DistributedError(_backend_already_started(launch))
    links = Links(_rendezvous.meet(launch.process_id, launch.num_processes, host, port, timeout))
    local = launch.local_device_ids
    try:
        jax.distributed.initialize(
            launch.coordinator_address,
            launch.num_processes,
            launch.process_id,
            local_device_ids=None if local is None else list(local),
            initialization_timeout=_whole_seconds(timeout),
            heartbeat_timeout_seconds=_whole_seconds(heartbeat_s),
            shutdown_timeout_seconds=_whole_seconds(shutdown_s),
            # Everything is resolved already; JAX's own probing would only add surprises.
            cluster_detection_method="deactivate",
        )
    except RuntimeError as exc:
        links.close()
        if "before any JAX calls" not in str(exc):
            raise
        raise errors.DistributedError(_backend_already_started(launch)) from exc
    return links
