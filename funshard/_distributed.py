"""Multi-process start-up and per-process data: the launcher's environment -> global mesh.

`initialize` reads what torchrun or SLURM put in the environment, starts JAX's
multi-process runtime (`jax.distributed`: gloo collectives on CPU, NCCL on GPU) and
returns the global mesh. `shard_batch` assembles each process's own rows into one
global batch without any host-to-host copy. See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import selectors
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.tree_util import keystr, tree_flatten_with_path, tree_unflatten

from funshard import _errors, _mesh

# JAX's own defaults (jax.distributed.initialize in jax 0.10.2), in seconds.
INITIALIZATION_TIMEOUT = 300
HEARTBEAT_TIMEOUT = 100
SHUTDOWN_TIMEOUT = 300
# Read when `initialize(initialization_timeout=None)`: launchers (torchrun) call scripts
# whose initialize() the user may not want to edit.
INITIALIZATION_TIMEOUT_ENV = "FUNSHARD_INITIALIZATION_TIMEOUT"
# A start-up this quick stays silent; a longer one says once what it waits for.
WAIT_NOTICE_S = 1.0
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
        return self.num_processes > 1


def _int_env(environ: Mapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(
            f"initialize: environment variable {name}={value!r} is not an integer; it is "
            "set by the launcher (torchrun / srun), or pass the value as an argument."
        ) from None


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
        return ("torchrun", coordinator, _int_env(environ, "WORLD_SIZE"),
                _int_env(environ, "RANK"), local)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        host = environ.get("MASTER_ADDR") or environ.get("SLURM_LAUNCH_NODE_IPADDR")
        coordinator = None
        if host and ("MASTER_PORT" in environ or "SLURM_JOB_ID" in environ):
            coordinator = f"{host}:{_slurm_port(environ)}"
        local = _int_env(environ, "SLURM_LOCALID") if "SLURM_LOCALID" in environ else None
        return ("slurm", coordinator, _int_env(environ, "SLURM_NTASKS"),
                _int_env(environ, "SLURM_PROCID"), local)
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
      ValueError: the values are inconsistent or a multi-process job has no
        coordinator address.
    """
    environ = os.environ if environ is None else environ
    launcher, env_coordinator, env_n, env_id, local_rank = _from_environment(environ)
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit):
        launcher = "arguments" if launcher == "none" else launcher
    coordinator = (
        coordinator_address or environ.get("JAX_COORDINATOR_ADDRESS") or env_coordinator
    )
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


def _check_launch(launcher: str, coordinator, n, rank) -> None:
    for name, value in (("num_processes", n), ("process_id", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"initialize: {name} must be an int, got {value!r}.")
    if n < 1 or not 0 <= rank < n:
        raise ValueError(
            f"initialize: process_id={rank} and num_processes={n} must satisfy "
            "0 <= process_id < num_processes (check RANK / WORLD_SIZE or the arguments)."
        )
    if n > 1 and not coordinator:
        raise ValueError(
            f"initialize: {n} processes ({launcher}) but no coordinator address: pass "
            "coordinator_address='host:port' (process 0's host), or set MASTER_ADDR and "
            "MASTER_PORT (or JAX_COORDINATOR_ADDRESS) in every process's environment."
        )


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

    Returns:
      The global mesh, devices ordered by (process index, local device order).

    Raises:
      ValueError: inconsistent rank / world size, no coordinator for several
        processes, a coordinator host that does not resolve, a bad timeout, or
        `replicate` does not divide the global device count.
      TimeoutError: within `initialization_timeout`, some processes never arrived
        (named by rank) or process 0's coordinator was not reached.
      RuntimeError: JAX's backend already started in this process before the call, or
        process 0 cannot listen on the coordinator's port, or a peer was rejected
        (another job size, a rank taken twice).
    """
    timeout = _initialization_timeout(initialization_timeout, os.environ)
    launch = resolve_launch(coordinator_address, num_processes, process_id, local_device_ids)
    if launch.multi_process and not jax.distributed.is_initialized():
        source = _address_source(coordinator_address, launch, os.environ)
        _start(launch, source, timeout, heartbeat_timeout, shutdown_timeout)
        if fail_fast:
            hosts = _exchange_hosts(launch, timeout)
            sys.excepthook = _fail_fast_hook(sys.excepthook, launch, hosts)
    return _mesh.make_mesh(replicate, devices=global_devices())


def _initialization_timeout(value, environ: Mapping[str, str]) -> float:
    source = "initialization_timeout"
    if value is None and INITIALIZATION_TIMEOUT_ENV in environ:
        source, value = INITIALIZATION_TIMEOUT_ENV, environ[INITIALIZATION_TIMEOUT_ENV]
    if value is None:
        return float(INITIALIZATION_TIMEOUT)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not 0 < seconds < math.inf:
        raise ValueError(
            f"initialize: {source}={value!r} is not a positive number of seconds; pass e.g. "
            "initialization_timeout=60 (or FUNSHARD_INITIALIZATION_TIMEOUT=60)."
        )
    return seconds


def _address_source(argument: str | None, launch: Launch, environ) -> str:
    """Where the coordinator address came from, in the words a user set it with."""
    if argument:
        return "the coordinator_address argument"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if launch.launcher == "slurm" and not environ.get("MASTER_ADDR"):
        return "SLURM_LAUNCH_NODE_IPADDR"
    return "MASTER_ADDR / MASTER_PORT"


def _endpoint(address: str, source: str) -> tuple[str, int]:
    """(host, port) of "host:port" / "[v6]:port"; the host must resolve (fail fast)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(_errors.coordinator_bad_address(address, source))
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(_errors.coordinator_unresolvable(host, source, str(exc))) from None
    return host, int(port)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge  # no public way to ask without starting it
    except ImportError:
        return False
    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: False)())


def _too_late(launch: Launch) -> str:
    return (
        f"initialize: process {launch.process_id} of {launch.num_processes} already "
        "used JAX (jax.devices(), an array, a computation, ...) before this call, so "
        "its devices are fixed to this process alone. Call "
        "funshard.distributed.initialize() first, right after the imports."
    )


def _start(launch: Launch, source: str, timeout: float, heartbeat_timeout, shutdown_timeout):
    host, port = _endpoint(launch.coordinator_address, source)
    # Checked before the rendezvous: a process that cannot start anyway must not make
    # the others wait for it.
    if _backend_started():
        raise RuntimeError(_too_late(launch))
    _rendezvous(launch, host, port, timeout)
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
        raise RuntimeError(_too_late(launch)) from exc


# ---- Rendezvous: every process meets process 0 on the coordinator's port first. ----
#
# JAX's client aborts the whole process (LOG(FATAL) in C++, SIGABRT) when its
# connection times out, and says only that "another task died". So the processes first
# meet over a plain TCP socket on the same port, where a timeout is a Python exception
# naming who is missing; process 0 then closes it and JAX's service binds the port.
# Each process sends one line "funshard-start <rank> <num_processes>"; process 0
# answers "go" once all have arrived, or "missing <ranks>" / "error <text>".

_HELLO = "funshard-start"
_ANSWER_SLACK_S = 1.0  # network and scheduling delay allowed for process 0's answer


def _me(launch: Launch) -> str:
    return f"process {launch.process_id} of {launch.num_processes}"


def _rendezvous(launch: Launch, host: str, port: int, timeout: float) -> None:
    start = time.monotonic()
    if launch.process_id == 0:
        _serve_rendezvous(launch, host, port, start, timeout)
    else:
        _join_rendezvous(launch, host, port, start, timeout)


def _notice(text: str) -> None:
    print(f"funshard: {text}", file=sys.stderr, flush=True)


def _listen(port: int) -> socket.socket:
    # Bind where JAX's service will: JAX_COORDINATOR_BIND_ADDRESS, else the same port
    # on every interface ("[::]:port"), so whoever reaches one reaches the other.
    host, _, bind_port = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").rpartition(":")
    host, port = host.strip("[]"), int(bind_port) if bind_port.isdigit() else port
    if host in ("", "::") and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _serve_rendezvous(launch: Launch, host: str, port: int, start: float, timeout: float):
    """Process 0: waits for every other rank's hello, then answers all of them at once."""
    address, n = f"{host}:{port}", launch.num_processes
    try:
        server = _listen(port)
    except OSError as exc:
        raise RuntimeError(
            f"initialize: process 0 cannot listen on port {port} for the coordinator "
            f"({exc.strerror or exc}); another program uses it. Choose a free port "
            "(MASTER_PORT, or the port in coordinator_address)."
        ) from None
    arrived: dict[int, socket.socket] = {}
    notes: list[str] = []
    with server, selectors.DefaultSelector() as selector:
        selector.register(server, selectors.EVENT_READ, None)
        try:
            noticed = False
            while len(arrived) < n - 1 and time.monotonic() - start < timeout:
                if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
                    missing = sorted(set(range(1, n)) - set(arrived))
                    _notice(f"{_me(launch)} waiting for {_errors.process_list(missing)} "
                            f"at {address}, timeout {timeout:g} s")
                    noticed = True
                for key, _ in selector.select(0.2):
                    _on_readable(key, server, selector, arrived, notes, n)
            missing = sorted(set(range(1, n)) - set(arrived))
            reply = f"missing {','.join(map(str, missing))}" if missing else "go"
            for peer in arrived.values():
                _send_line(peer, reply)
        finally:
            for key in list(selector.get_map().values()):
                if key.fileobj is not server:
                    key.fileobj.close()
    if missing:
        raise TimeoutError(
            _errors.start_missing_processes(_me(launch), missing, address, timeout, notes))


def _on_readable(key, server, selector, arrived: dict, notes: list, n: int) -> None:
    if key.fileobj is server:
        peer, _ = server.accept()
        peer.setblocking(False)
        selector.register(peer, selectors.EVENT_READ, b"")
        return
    peer = key.fileobj
    try:
        data = key.data + peer.recv(256)
    except OSError:
        data = b""
    selector.unregister(peer)
    if b"\n" not in data:
        if data and len(data) < 256:  # the rest of the line is still on its way
            selector.register(peer, selectors.EVENT_READ, data)
            return
        # Gone before (or without) a hello: a peer that died, or not funshard at all.
        for rank in [r for r, s in arrived.items() if s is peer]:
            del arrived[rank]
            notes.append(f"Process {rank} arrived but disconnected again (it exited)")
        peer.close()
        return
    problem, rank = _check_hello(data.split(b"\n", 1)[0], arrived, n)
    if problem:
        notes.append(f"Refused a connection: {problem}")
        _send_line(peer, f"error initialize: process 0 of {n} rejected this process: {problem}")
        peer.close()
        return
    arrived[rank] = peer
    selector.register(peer, selectors.EVENT_READ, b"")  # to notice if it dies meanwhile


def _check_hello(line: bytes, arrived: dict, n: int) -> tuple[str | None, int]:
    parts = line.decode(errors="replace").split()
    if len(parts) != 3 or parts[0] != _HELLO or not all(p.isdigit() for p in parts[1:]):
        return "a program other than funshard connected to the coordinator's port", -1
    rank, size = int(parts[1]), int(parts[2])
    if size != n:
        return (f"a process started as rank {rank} of {size} processes, but process 0 "
                f"expects {n} (WORLD_SIZE differs between processes)"), rank
    if rank in arrived:
        return f"two processes started as rank {rank} (RANK must be unique)", rank
    return None, rank


def _send_line(peer: socket.socket, text: str) -> None:
    try:
        peer.setblocking(True)
        peer.sendall(text.encode() + b"\n")
    except OSError:
        pass  # it is gone; nothing to tell


def _join_rendezvous(launch: Launch, host: str, port: int, start: float, timeout: float):
    """Any other process: says hello to process 0 and waits for its answer."""
    address, reason, noticed = f"{host}:{port}", "nothing listens there", False
    while True:
        left = timeout - (time.monotonic() - start)
        if left <= 0:
            raise TimeoutError(_errors.start_no_coordinator(_me(launch), address, timeout,
                                                            reason))
        if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
            _notice(f"{_me(launch)} waiting for process 0 (the coordinator) and the "
                    f"others at {address}, timeout {timeout:g} s")
            noticed = True
        try:
            peer = socket.create_connection((host, port), timeout=min(left, 1.0))
        except OSError as exc:
            reason = exc.strerror or str(exc) or type(exc).__name__
            time.sleep(min(0.2, max(left, 0)))
            continue
        with peer:
            reply = _await_reply(peer, launch, start, timeout, noticed, address)
        if reply is not None:
            return _on_reply(reply, launch)
        reason = "process 0 closed the connection without an answer"


def _await_reply(peer, launch: Launch, start: float, timeout: float, noticed, address):
    """Process 0's one-line answer, or None if the connection closed before it.

    Process 0 started before this connection and answers by its own deadline, so its
    clock decides (its answer names the missing processes); the bound here only guards
    against a process 0 that hangs.
    """
    deadline = time.monotonic() + timeout + _ANSWER_SLACK_S
    try:
        peer.sendall(f"{_HELLO} {launch.process_id} {launch.num_processes}\n".encode())
    except OSError:
        return None
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"initialize: {_me(launch)} reached the coordinator at {address}, but "
                f"process 0 did not answer within {timeout:g} s (is it stopped?)."
            )
        if not noticed and time.monotonic() - start >= WAIT_NOTICE_S:
            _notice(f"{_me(launch)} waiting for the other processes at {address}, "
                    f"timeout {timeout:g} s")
            noticed = True
        peer.settimeout(min(left, 0.2))
        try:
            chunk = peer.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


def _on_reply(reply: str, launch: Launch) -> None:
    word, _, rest = reply.partition(" ")
    if word == "go":
        return
    if word == "missing":
        missing = [int(r) for r in rest.split(",")]
        raise TimeoutError(
            f"initialize: {_me(launch)}: process 0 gave up waiting: "
            f"{_errors.process_list(missing)} never reached the coordinator (see process "
            "0's error). Start the missing processes, or raise the timeout "
            "(initialization_timeout= or FUNSHARD_INITIALIZATION_TIMEOUT)."
        )
    raise RuntimeError(rest if word == "error" else f"initialize: unexpected answer {reply!r}")


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
        from jax._src import distributed  # the key-value store has no public API

        client = distributed.global_state.client
        me = _my_address(launch.coordinator_address)
        client.key_value_set(f"funshard/host/{launch.process_id}", me)
        client.wait_at_barrier("funshard/hosts", int(min(timeout_s, 60) * 1000))
        pairs = client.key_value_dir_get("funshard/host/")
        return {int(key.rsplit("/", 1)[1]): ip for key, ip in pairs}
    except Exception:  # noqa: BLE001 -- naming peers is a nicety, never a failure
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


def failure_summary(exc: BaseException, launch: Launch, hosts: dict[int, str]) -> str:
    """The one-paragraph explanation `fail_fast` prints after the traceback."""
    me = f"funshard.distributed: process {launch.process_id} of {launch.num_processes}"
    text = str(exc)
    if _LOST.search(text):
        who = _dead_peer(text, launch, hosts) or "another process"
        return (
            f"{me} stops: a collective failed because {who} is gone (it exited or "
            "crashed; its own log says why). Exiting now with status 1 instead of "
            "waiting for it in JAX's shutdown barrier."
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
            print(failure_summary(exc, launch, hosts), file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # The client's destructor would block in the shutdown barrier until the
            # dead process's heartbeat times out; nothing else is left to do here.
            os._exit(1)

    return hook


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh's data-parallel axes: ("replicate", "fsdp") or ("fsdp",)."""
    return tuple(a for a in (_mesh.REPLICATE_AXIS, _mesh.SHARD_AXIS) if a in mesh.axis_names)


def _local_positions(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many distinct batch blocks (positions along `axes`) this process's devices hold."""
    me, where = jax.process_index(), [mesh.axis_names.index(a) for a in axes]
    return len({
        tuple(idx[i] for i in where)
        for idx in np.ndindex(mesh.devices.shape)
        if mesh.devices[idx].process_index == me
    })


def _as_rows(path, leaf):
    if not isinstance(leaf, jax.Array):
        if not hasattr(leaf, "shape") and not isinstance(leaf, (int, float, bool, complex)):
            raise TypeError(
                f"shard_batch: leaf local_batch{keystr(path)} is {type(leaf).__name__}; "
                "expected a numpy or jax array of this process's rows."
            )
        leaf = np.asarray(leaf)
    if leaf.ndim == 0:
        raise ValueError(
            f"shard_batch: leaf local_batch{keystr(path)} is a scalar; every batch leaf "
            "needs a leading row dimension (pass replicated values as extra arguments)."
        )
    return leaf


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
      TypeError: a leaf is not an array.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"shard_batch: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; "
            "use the mesh funshard.distributed.initialize() returned."
        )
    axes = data_axes(mesh) if axes is None else _mesh._as_axes(axes)
    if not axes or any(a not in mesh.axis_names for a in axes):
        raise ValueError(
            f"shard_batch: mesh axes {mesh.axis_names} lack the data-parallel axes "
            f"{axes or ('fsdp',)}; pass axes=... naming the axes the batch is split over."
        )
    with_path, treedef = tree_flatten_with_path(local_batch)
    if check and jax.process_count() > 1:
        # Before any check of this process alone: a mismatch must raise on every
        # process, not leave the others waiting for one that already raised.
        _check_same_batch(_signature(with_path), BATCH_CHECK_WAIT_S)
    local = _local_positions(mesh, axes)
    if not local:
        raise ValueError(
            f"shard_batch: process {jax.process_index()} has no device in the mesh; build "
            "the mesh over every process's devices (funshard.distributed.initialize())."
        )
    world = _mesh.axes_size(mesh, axes)
    sharding = NamedSharding(mesh, _mesh.spec(axes))
    out = []
    for path, leaf in with_path:
        leaf = _as_rows(path, leaf)
        if leaf.shape[0] % local:
            raise ValueError(
                f"shard_batch: leaf local_batch{keystr(path)} has {leaf.shape[0]} rows, which "
                f"do not split over this process's {local} data-parallel devices; give each "
                f"process a multiple of {local} rows."
            )
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
    from jax._src import distributed  # the key-value store has no public API

    client = distributed.global_state.client
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
    if not agreed:
        raise ValueError(_errors.batch_differs_across_processes(
            _all_signatures(client, root, text, wait_s)))


def _wait_for(client, key: str, wait_s: float) -> str | None:
    try:
        return client.blocking_key_value_get(key, int(wait_s * 1000))
    except Exception:  # noqa: BLE001 -- a late or dead process: see _check_same_batch
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
        int(key.rsplit("/", 1)[1]): [(p, (tuple(d[0]), d[1]) if isinstance(d, list) else d)
                                     for p, d in json.loads(value)]
        for key, value in client.key_value_dir_get(f"{root}full/")
    }
    return dict(sorted(signatures.items()))
