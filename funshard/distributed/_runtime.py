"""Multi-process start-up and per-process data: the launcher's environment -> global mesh.

`initialize` reads what torchrun or SLURM put in the environment, starts JAX's
multi-process runtime (`jax.distributed`: gloo collectives on CPU, NCCL on GPU) and
returns the global mesh. `shard_batch` assembles each process's own rows into one
global batch without any host-to-host copy. The processes' first meeting, before
JAX's runtime starts, lives in `_rendezvous`. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import keystr, tree_flatten_with_path, tree_unflatten

from funshard import _jax_compat, _text, comm, errors
from funshard.distributed import _departure, _rendezvous
from funshard.distributed._departure import DEPARTURE_TIMEOUT as DEPARTURE_TIMEOUT
from funshard.distributed._departure import DEPARTURE_TIMEOUT_ENV as DEPARTURE_TIMEOUT_ENV
from funshard.distributed._rendezvous import INITIALIZATION_TIMEOUT as INITIALIZATION_TIMEOUT
from funshard.distributed._rendezvous import (
    INITIALIZATION_TIMEOUT_ENV as INITIALIZATION_TIMEOUT_ENV,
)

# JAX's own defaults (jax.distributed.initialize in jax 0.10.2), in seconds.
HEARTBEAT_TIMEOUT = 100
SHUTDOWN_TIMEOUT = 300
# How long shard_batch waits for the other processes' batches before it goes on unchecked.
BATCH_CHECK_WAIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process sits in the job, as read from arguments and environment.

    Attributes:
      launcher: "arguments", "torchrun", "slurm" or "none" (a single process).
      coordinator_address: "host:port" of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process's rank, in [0, num_processes).
      local_device_ids: the accelerators this process uses (None: all it sees).
    """

    launcher: str
    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None

    @property
    def multi_process(self) -> bool:
        """Whether the job has more than one process."""
        return self.num_processes > 1


def _env_not_int(name: str, value: str) -> str:
    return (
        f"initialize: environment variable {name}={value!r} is not an integer; it is "
        "set by the launcher (torchrun / srun), or pass the value as an argument."
    )


def _int_env(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise errors.ShardingValueError(_env_not_int(name, value)) from None


def _torchrun_port(environ: Mapping[str, str]) -> int:
    # torchrun's agent on node 0 already listens on MASTER_PORT (its TCPStore) when
    # TORCHELASTIC_USE_AGENT_STORE is True; JAX's coordinator takes the next port.
    port = _int_env(environ, "MASTER_PORT")
    return port + 1 if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else port


def _slurm_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return _int_env(environ, "MASTER_PORT")
    # The port JAX's own SLURM detection derives from the job id (same on every task).
    return _int_env(environ, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)


def _from_environment(environ: Mapping[str, str]) -> tuple:
    """(launcher, coordinator, num_processes, process_id, local_rank) from the launcher."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        coordinator = None
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            coordinator = f"{environ['MASTER_ADDR']}:{_torchrun_port(environ)}"
        local = _int_env(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else None
        return (
            "torchrun",
            coordinator,
            _int_env(environ, "WORLD_SIZE"),
            _int_env(environ, "RANK"),
            local,
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        host = environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR")
        coordinator = None
        if host and ("MASTER_PORT" in environ or "SLURM_JOB_ID" in environ):
            coordinator = f"{host}:{_slurm_port(environ)}"
        local = _int_env(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else None
        return (
            "slurm",
            coordinator,
            _int_env(environ, "SLURM_NTASKS"),
            _int_env(environ, "SLURM_PROCID"),
            local,
        )
    return ("none", None, 1, 0, None)


def _several_per_node(launcher: str, environ: Mapping[str, str]) -> bool:
    if launcher == "torchrun":
        return environ.get("LOCAL_WORLD_SIZE", "1") != "1"
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3": tasks per node, grouped.
    counts = environ.get("SLURM_NTASKS_PER_NODE") or environ.get("SLURM_STEP_TASKS_PER_NODE")
    return max(int(c) for c in re.findall(r"(\d+)(?:\(x\d+\))?", counts or "1") or [1]) > 1


def _local_devices_default(launcher, local_rank, environ) -> tuple[int, ...] | None:
    # One accelerator per process when a launcher starts several per node (torchrun's
    # and srun's convention); a lone process per node keeps all of its devices.
    if local_rank is None or not _several_per_node(launcher, environ):
        return None
    return (local_rank,)


def resolve_launch(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Launch:
    """Combines explicit arguments (which win) with the launcher's environment.

    Args:
      coordinator_address: "host:port" of process 0, or None to read it from the
        environment (JAX_COORDINATOR_ADDRESS, then MASTER_ADDR/MASTER_PORT, then
        SLURM_LAUNCH_NODE_IPADDR).
      num_processes: job size, or None for WORLD_SIZE / SLURM_NTASKS.
      process_id: this process's rank, or None for RANK / SLURM_PROCID.
      local_device_ids: accelerators of this process, or None for LOCAL_RANK /
        SLURM_LOCALID when several processes share a node.
      environ: the environment to read (default `os.environ`).

    Returns:
      The resolved `Launch`.

    Raises:
      ValueError: the values are inconsistent (a job size below 1, a rank outside the
        job) or a multi-process job has no coordinator address.
      TypeError: `num_processes` or `process_id` is not an int.
    """
    environ = os.environ if environ is None else environ
    launcher, env_coordinator, env_n, env_id, local_rank = _from_environment(environ)
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit):
        launcher = "arguments" if launcher == "none" else launcher
    coordinator = coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS") or env_coordinator
    n = env_n if num_processes is None else num_processes
    rank = env_id if process_id is None else process_id
    if local_device_ids is None:
        local = _local_devices_default(launcher, local_rank, environ)
    elif isinstance(local_device_ids, int):
        local = (local_device_ids,)
    else:
        local = tuple(local_device_ids)
    _check_launch(launcher, coordinator, n, rank)
    return Launch(launcher, coordinator, n, rank, local)


def _launch_not_int(name: str, value) -> str:
    return (
        f"initialize: {name} must be an int, got {value!r}; pass an int, or leave it "
        "None to read it from the launcher's environment."
    )


def _launch_bad_rank(rank: int, n: int) -> str:
    return (
        f"initialize: process_id={rank} and num_processes={n} must satisfy "
        "0 <= process_id < num_processes (check RANK / WORLD_SIZE or the arguments)."
    )


def _launch_no_coordinator(n: int, launcher: str) -> str:
    return (
        f"initialize: {n} processes ({launcher}) but no coordinator address: pass "
        "coordinator_address='host:port' (process 0's host), or set MASTER_ADDR and "
        "MASTER_PORT (or JAX_COORDINATOR_ADDRESS) in every process's environment."
    )


def _check_launch(launcher: str, coordinator, n, rank) -> None:
    for name, value in (("num_processes", n), ("process_id", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise errors.ShardingTypeError(_launch_not_int(name, value))
    if n < 1 or not 0 <= rank < n:
        raise errors.ShardingValueError(_launch_bad_rank(rank, n))
    if n > 1 and not coordinator:
        raise errors.ShardingValueError(_launch_no_coordinator(n, launcher))


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
    heartbeat_timeout: int = HEARTBEAT_TIMEOUT,
    shutdown_timeout: int = SHUTDOWN_TIMEOUT,
    fail_fast: bool = True,
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
      fail_fast: on an uncaught exception (its own, or a collective failing because
        another process died), print the traceback and a summary naming the dead
        process where it can, then exit at once with status 1, skipping JAX's
        shutdown barrier (which would wait for the dead process up to
        `heartbeat_timeout`, and keep the other processes blocked meanwhile).
      departure_timeout: seconds a process waits, without progress, for a process
        that has left the job (returned from its script early, or ended on an
        exception) before it gives up: it prints who left after how many steps and
        exits with status 1 (a torch_frontend collective raises a RuntimeError
        instead). None: the environment variable FUNSHARD_DEPARTURE_TIMEOUT, else 30;
        `math.inf` never gives up. See docs/distributed.md.

    Returns:
      The global mesh, devices ordered by (process index, local device order).

    Raises:
      ValueError: inconsistent rank / world size, no coordinator for several
        processes, a coordinator host that does not resolve, a bad timeout (or
        departure timeout), or
        `replicate` does not divide the global device count.
      TimeoutError: within `initialization_timeout`, some processes never arrived
        (named by rank) or process 0's coordinator was not reached.
      RuntimeError: JAX's backend already started in this process before the call, or
        process 0 cannot listen on the coordinator's port, or a peer was rejected
        (another job size, a rank taken twice).
    """
    timeout = _rendezvous.initialization_timeout(initialization_timeout, os.environ)
    departure = _departure.departure_timeout(departure_timeout, os.environ)
    launch = resolve_launch(coordinator_address, num_processes, process_id, local_device_ids)
    if launch.multi_process and not jax.distributed.is_initialized():
        source = _address_source(coordinator_address, launch, os.environ)
        _start(launch, source, timeout, heartbeat_timeout, shutdown_timeout)
        _departure.start(
            _jax_compat.coordination_client(),
            launch.process_id,
            launch.num_processes,
            departure,
            shutdown_timeout,
        )
        if fail_fast:
            hosts = _exchange_hosts(launch, timeout)
            sys.excepthook = _fail_fast_hook(sys.excepthook, launch, hosts)
    return comm.make_mesh(replicate, devices=global_devices())


def _address_source(argument: str | None, launch: Launch, environ) -> str:
    """Where the coordinator address came from, in the words a user set it with."""
    if argument:
        return "the coordinator_address argument"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if launch.launcher == "slurm" and not environ.get("MASTER_ADDR"):
        return "SLURM_LAUNCH_NODE_IPADDR"
    return "MASTER_ADDR / MASTER_PORT"


def _backend_already_started(launch) -> str:
    return (
        f"initialize: process {launch.process_id} of {launch.num_processes} already used "
        "JAX (jax.devices(), an array, a computation, ...) before this call, so its "
        "devices are fixed to this process alone. Call funshard.distributed.initialize() "
        "first, right after the imports."
    )


def _start(launch: Launch, source: str, timeout: float, heartbeat_timeout, shutdown_timeout):
    host, port = _rendezvous.endpoint(launch.coordinator_address, source)
    # Checked before the rendezvous: a process that cannot start anyway must not make
    # the others wait for it.
    if _jax_compat.backends_started():
        raise errors.DistributedError(_backend_already_started(launch))
    _rendezvous.meet(launch.process_id, launch.num_processes, host, port, timeout)
    local = launch.local_device_ids
    try:
        jax.distributed.initialize(
            launch.coordinator_address,
            launch.num_processes,
            launch.process_id,
            local_device_ids=None if local is None else list(local),
            initialization_timeout=max(1, math.ceil(timeout)),
            heartbeat_timeout_seconds=heartbeat_timeout,
            shutdown_timeout_seconds=shutdown_timeout,
            # Everything is resolved already; JAX's own probing would only add surprises.
            cluster_detection_method="deactivate",
        )
    except RuntimeError as exc:
        if "before any JAX calls" not in str(exc):
            raise
        raise errors.DistributedError(_backend_already_started(launch)) from exc


def _my_address(coordinator_address: str) -> str:
    """The IP this host uses to reach the coordinator (what peers see as its address)."""
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    try:
        family, _, _, _, target = socket.getaddrinfo(host, 1, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)  # UDP: picks the route, sends nothing
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _exchange_hosts(launch: Launch, timeout_s: float) -> dict[int, str]:
    """Every process's IP, by rank, through JAX's coordination service ({} if unavailable).

    Only used to name the process behind a failed connection in error messages. Every
    process has connected by now, so the barrier is short.
    """
    try:
        client = _jax_compat.coordination_client()
        me = _my_address(launch.coordinator_address)
        client.key_value_set(f"funshard/host/{launch.process_id}", me)
        client.wait_at_barrier("funshard/hosts", int(min(timeout_s, 60) * 1000))
        pairs = client.key_value_dir_get("funshard/host/")
        return {int(key.rsplit("/", 1)[1]): ip for key, ip in pairs}
    except Exception:
        return {}


# A peer's address in gloo's errors: "... Connection closed by peer [10.0.0.2]:7042".
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:(\d+)")
_LOST = re.compile(r"(?i)connection (closed|reset|refused)|broken pipe|by peer")


def _dead_peer(message: str, launch: Launch, hosts: dict[int, str]) -> str | None:
    """Who the failed connection in `message` led to, e.g. "process 1 (127.0.0.1:7042)"."""
    match = _PEER.search(message)
    if match is None:
        return None
    ip, port = match.groups()
    ranks = [r for r, h in sorted(hosts.items()) if h == ip and r != launch.process_id]
    where = f"{ip}:{port}"
    if len(ranks) == 1:
        return f"process {ranks[0]} ({where})"
    if ranks:
        return f"one of processes {', '.join(map(str, ranks))} ({where})"
    return f"the process at {where}"


def failure_summary(
    exc: BaseException,
    launch: Launch,
    hosts: dict[int, str],
    departed: Mapping[int, Any] | None = None,
) -> str:
    """The one-paragraph explanation `fail_fast` prints after the traceback.

    `departed` holds the notes of the processes that said they left the job
    (`_departure.departed()`): they name the process behind a lost connection.
    """
    me = f"funshard.distributed: process {launch.process_id} of {launch.num_processes}"
    text = str(exc)
    if _LOST.search(text):
        if departed:
            why = "; ".join(_departure.departure_text(n) for _, n in sorted(departed.items()))
        else:
            who = _dead_peer(text, launch, hosts) or "another process"
            why = f"{who} is gone (it exited or crashed; its own log says why)"
        return (
            f"{me} stops: a collective failed because {why}. Exiting now with status 1 "
            "instead of waiting for it in JAX's shutdown barrier."
        )
    return (
        f"{me} stops on an uncaught {type(exc).__name__}. Exiting now with status 1, "
        "without JAX's shutdown barrier, so that the other processes fail at their next "
        "collective instead of waiting for this one."
    )


def _fail_fast_hook(previous, launch: Launch, hosts: dict[int, str]):
    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        try:
            _departure.post_leaving(f"raised {exc_type.__name__}")
            print(failure_summary(exc, launch, hosts, _departure.departed()), file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # The client's destructor would block in the shutdown barrier until the
            # dead process's heartbeat times out; nothing else is left to do here.
            os._exit(1)

    return hook


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data-parallel axes: ("replicate", "fsdp") or ("fsdp",)."""
    return tuple(a for a in (comm.REPLICATE_AXIS, comm.SHARD_AXIS) if a in mesh.axis_names)


def _local_positions(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many distinct batch blocks (positions along `axes`) this process's devices hold."""
    me, where = jax.process_index(), [mesh.axis_names.index(a) for a in axes]
    return len(
        {
            tuple(idx[i] for i in where)
            for idx in np.ndindex(mesh.devices.shape)
            if mesh.devices[idx].process_index == me
        }
    )


def _local_batch_not_array(path, leaf) -> str:
    return (
        f"{_text.where('shard_batch', path)} is a {type(leaf).__name__}, not an array; pass a "
        "numpy or jax array of this process's rows."
    )


def _local_batch_scalar(path) -> str:
    return (
        f"{_text.where('shard_batch', path)} is a scalar; every batch leaf needs a leading row "
        "dimension (pass replicated values as extra arguments)."
    )


def _as_rows(path, leaf):
    if not isinstance(leaf, jax.Array):
        if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, bool, complex)):
            raise errors.ShardingTypeError(_local_batch_not_array(path, leaf))
        leaf = np.asarray(leaf)
    if leaf.ndim == 0:
        raise errors.ShardingValueError(_local_batch_scalar(path))
    return leaf


def _shard_batch_not_mesh(mesh) -> str:
    return (
        f"shard_batch: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
        "use the mesh funshard.distributed.initialize() returned."
    )


def _shard_batch_no_data_axes(mesh_axes, axes) -> str:
    return (
        f"shard_batch: mesh axes {tuple(mesh_axes)} lack the data-parallel axes "
        f"{axes or ('fsdp',)}; pass axes=... naming the axes the batch is split over."
    )


def _shard_batch_no_local_device(rank: int) -> str:
    return (
        f"shard_batch: process {rank} has no device in the mesh; build the mesh over "
        "every process's devices (funshard.distributed.initialize())."
    )


def _local_batch_uneven(path, rows: int, local: int) -> str:
    return (
        f"{_text.where('shard_batch', path)} has {rows} rows, which do not split over this "
        f"process's {local} data-parallel devices; give each process a multiple of "
        f"{local} rows."
    )


def shard_batch(
    local_batch: Any,
    mesh: Mesh,
    *,
    axes: str | Sequence[str] | None = None,
    check: bool = True,
) -> Any:
    """Assembles every process's own rows into one global batch, sharded on dim 0.

    No process sees another's rows: each leaf becomes a global `jax.Array` built with
    `jax.make_array_from_process_local_data`, its leading dimension split over the
    mesh's data-parallel axes. Rows are ordered by process (process 0's rows first),
    which is the mesh's device order when it comes from `initialize`.

    Args:
      local_batch: a pytree of numpy / jax arrays; each leading dimension is this
        process's share of the global batch (the same size on every process).
      mesh: the global mesh (from `initialize` or `funshard.make_mesh`).
      axes: mesh axes dim 0 is split over (default: ("replicate", "fsdp") on an HSDP
        mesh, else ("fsdp",)).
      check: in a multi-process job, first compare every process's tree, row counts,
        trailing shapes and dtypes through JAX's coordination service (three small
        messages per call, no device work, no barrier: a process waits at most 10 s for
        the others' batches). Every process must call `shard_batch` equally often.
        False skips it, for a data pipeline known to be consistent.

    Returns:
      The same pytree of global arrays, each with `num_processes` times the rows.

    Raises:
      ValueError: a leaf is a scalar, or its rows do not split evenly over this
        process's devices, or the mesh has no data-parallel axis, or (on every
        process) the processes' batches differ in structure, rows, shapes or dtypes.
      TypeError: `mesh` is not a `jax.sharding.Mesh`, or a leaf is not an array.
      RuntimeError: (with `check`) another process left the job after fewer
        `shard_batch` calls than this one has made: it will never join this step.
    """
    if not isinstance(mesh, Mesh):
        raise errors.ShardingTypeError(_shard_batch_not_mesh(mesh))
    _departure.count_step("shard_batch call")
    axes = data_axes(mesh) if axes is None else comm.as_axes(axes)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise errors.ShardingValueError(_shard_batch_no_data_axes(mesh.axis_names, axes))
    with_path, treedef = tree_flatten_with_path(local_batch)
    if check and jax.process_count() > 1:
        # Before any check of this process alone: a mismatch must raise on every
        # process, not leave the others waiting for one that already raised.
        _check_same_batch(_signature(with_path), BATCH_CHECK_WAIT_S)
    local = _local_positions(mesh, axes)
    if not local:
        raise errors.ShardingValueError(_shard_batch_no_local_device(jax.process_index()))
    world = comm.axes_size(mesh, axes)
    sharding = NamedSharding(mesh, comm.spec(axes))
    out = []
    for path, leaf in with_path:
        leaf = _as_rows(path, leaf)
        if leaf.shape[0] % local:
            raise errors.ShardingValueError(_local_batch_uneven(path, leaf.shape[0], local))
        global_shape = (leaf.shape[0] // local * world, *leaf.shape[1:])
        out.append(jax.make_array_from_process_local_data(sharding, leaf, global_shape))
    return tree_unflatten(treedef, out)


def _signature(with_path) -> list:
    """[(keystr path, [shape, dtype] or a type name)]: what must agree across processes."""
    described = []
    for path, leaf in with_path:
        if isinstance(leaf, (int, float, bool, complex)):
            leaf = np.asarray(leaf)
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            described.append((keystr(path), [list(leaf.shape), str(leaf.dtype)]))
        else:
            described.append((keystr(path), type(leaf).__name__))
    return described


# Numbers this process's shard_batch calls; each call's keys carry it, so that every
# process compares with the others' batch of the same step.
_batch_calls = itertools.count()


def _leaf_text(described, groups) -> str:
    """ "8 rows" where only the row counts differ, else "float32 (8, 3)"."""
    if described == "absent":
        return described
    if not isinstance(described, tuple):
        return f"a {described}, not an array,"
    arrays = [d for d in groups if isinstance(d, tuple)]
    if (
        len(arrays) == len(groups)
        and all(
            len(d[0]) >= 1 and d[0][1:] == described[0][1:] and d[1] == described[1] for d in arrays
        )
        and described[0]
    ):
        return f"{described[0][0]} rows"
    return f"{described[1]} {tuple(described[0])}"


def _batch_differs_across_processes(signatures) -> str:
    """`signatures`: rank -> [(keystr path, (shape, dtype) or a type name)] of its leaves."""
    by_path: dict = {}
    for rank, leaves in signatures.items():
        for path, described in leaves:
            by_path.setdefault(path, {})[rank] = described
    lines = []
    for path, per_rank in by_path.items():
        groups: dict = {}
        for rank in signatures:
            groups.setdefault(per_rank.get(rank, "absent"), []).append(rank)
        if len(groups) > 1:
            listing = "; ".join(
                f"{_leaf_text(d, groups)} on {_text.process_list(r)}" for d, r in groups.items()
            )
            lines.append(f"  local_batch{path}: {listing}")
    return (
        "shard_batch: the processes passed batches that do not fit together:\n"
        + "\n".join(lines)
        + "\nEvery process must pass the same tree with the same number of rows, trailing "
        "shape and dtype per leaf (drop or pad a last partial batch on every process alike)."
    )


def _check_same_batch(signature: list, wait_s: float) -> None:
    """Raises the same ValueError on every process when their batches do not fit together.

    Each process adds 1 to a counter keyed by its signature's digest and to an arrival
    counter. The last to arrive knows every process has counted: the digest's count
    equals the process count exactly when all agree, and it posts that verdict, which
    the others wait for. Only on a mismatch do the full signatures travel.

    The others wait at most `wait_s`, never at a collective barrier: a process that
    died would hold that barrier until its heartbeat times out (100 s by default),
    where the next collective fails at once. A process more than `wait_s` behind the
    others still gets the verdict (it arrives last) and raises; the others then fail
    in their next collective with it, as they would without the check.
    """
    client = _jax_compat.coordination_client()
    if client is None:  # not started by jax.distributed: nothing to compare through
        return
    call, count = next(_batch_calls), jax.process_count()
    root = f"funshard/batch/{call}/"
    text = json.dumps(signature)
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    client.key_value_increment(f"{root}digest/{digest}", 1)
    if client.key_value_increment(f"{root}arrived", 1) == count:
        agreed = client.key_value_try_get(f"{root}digest/{digest}") == str(count)
        client.key_value_set(f"{root}verdict", "same" if agreed else "different")
        if call:  # every process is past the previous call: drop its keys
            client.key_value_delete(f"funshard/batch/{call - 1}/")
    else:
        agreed = _wait_for(client, f"{root}verdict", wait_s) != "different"
    if not agreed:  # every process got the same verdict, and raises
        message = _batch_differs_across_processes(_all_signatures(client, root, text, wait_s))
        _departure.announce_failure()
        _departure.await_failures(range(count))
        raise errors.ShardingValueError(message)


def _wait_for(client, key: str, wait_s: float) -> str | None:
    """`key`'s value within `wait_s` (else None), in short slices: a process that left
    before this step will never post it, and that is an error at once."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            return client.blocking_key_value_get(key, max(1, int(min(left, 0.5) * 1000)))
        except Exception:
            pass
        error = _departure.left_before_this_step()
        if error is not None:
            raise errors.DistributedError(error)
        if time.monotonic() >= deadline:
            return None


def _all_signatures(client, root: str, text: str, wait_s: float) -> dict:
    """Every process's signature (rank -> leaves), exchanged only after a mismatch."""
    rank, count = jax.process_index(), jax.process_count()
    client.key_value_set(f"{root}full/{rank}", text)
    if client.key_value_increment(f"{root}described", 1) == count:
        client.key_value_set(f"{root}all_described", "1")
    else:
        _wait_for(client, f"{root}all_described", wait_s)  # else: name who did answer
    signatures = {
        int(key.rsplit("/", 1)[1]): [
            (p, (tuple(d[0]), d[1]) if isinstance(d, list) else d) for p, d in json.loads(value)
        ]
        for key, value in client.key_value_dir_get(f"{root}full/")
    }
    return dict(sorted(signatures.items()))
