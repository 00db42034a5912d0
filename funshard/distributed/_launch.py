"""Where this process sits in the job: the launcher's environment and the settings, read.

Pure functions of the arguments and the environment, with no JAX call: `resolve_launch`
(torchrun's or SLURM's variables, or explicit arguments, into a `Launch`), `endpoint`
(the coordinator's "host:port", checked and resolved), and `seconds`, the one parser of
every timeout setting of `funshard.distributed.initialize` (an argument, else its
environment variable, else the default). See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
from collections.abc import Mapping, Sequence

from funshard import comm, errors

# JAX's own defaults (jax.distributed.initialize in jax 0.10.2), in seconds.
INITIALIZATION_TIMEOUT = 300
HEARTBEAT_TIMEOUT = 100
SHUTDOWN_TIMEOUT = 300
# Read when `initialize(initialization_timeout=None)`: launchers (torchrun) call scripts
# whose initialize() the user may not want to edit.
INITIALIZATION_TIMEOUT_ENV = "FUNSHARD_INITIALIZATION_TIMEOUT"
DEPARTURE_TIMEOUT = comm.DEPARTURE_TIMEOUT
DEPARTURE_TIMEOUT_ENV = "FUNSHARD_DEPARTURE_TIMEOUT"


def _not_seconds(source: str, value: float | str, example: str) -> str:
    return (
        f"initialize: {source}={value!r} is not a positive number of seconds; pass e.g. {example}."
    )


def seconds(
    name: str,
    value: float | str | None,
    default: float,
    *,
    environ: Mapping[str, str] | None = None,
    env: str | None = None,
    infinite: bool = False,
) -> float:
    """A timeout setting in seconds: `value`, else the environment variable `env`, else `default`.

    Args:
      name: the argument's name, for the message ("initialization_timeout").
      value: the argument (None: not given).
      default: the value when neither the argument nor the environment gives one.
      environ: the environment to read `env` from (default `os.environ`).
      env: the environment variable that stands in for the argument, if any.
      infinite: whether `math.inf` ("never give up") is allowed.

    Returns:
      The timeout in seconds.

    Raises:
      ValueError: the value (from the argument or the environment, named in the
        message) is not a positive number of seconds, or is infinite where `infinite`
        is False.
    """
    environ = os.environ if environ is None else environ
    source = name
    if value is None and env is not None and env in environ:
        source, value = env, environ[env]
    if value is None:
        return float(default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not (number > 0 and (infinite or math.isfinite(number))):
        example = f"{name}={default:g}" + (f" (or {env}={default:g})" if env else "")
        raise errors.ShardingValueError(
            _not_seconds(source, value, example + (", or inf to wait forever" if infinite else ""))
        )
    return number


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


def _master_port_bad(port: int) -> str:
    return (
        f"initialize: MASTER_PORT={port} leaves no port for JAX's coordinator, which "
        "listens on MASTER_PORT + 1 (torch's store keeps MASTER_PORT); choose a port "
        "below 65535, or pass coordinator_address='host:port'."
    )


def _coordinator_port(environ: Mapping[str, str]) -> int:
    """JAX's coordinator port when the launcher names MASTER_PORT: always the next one.

    MASTER_PORT belongs to torch's TCPStore: torchrun's agent listens there
    (TORCHELASTIC_USE_AGENT_STORE=True), and without torchrun `init_process_group` on
    rank 0 binds it itself, before or after this call. One rule for every launch keeps
    the two apart whoever starts first.
    """
    port = _int_env(environ, "MASTER_PORT")
    if not 0 < port < 65535:
        raise errors.ShardingValueError(_master_port_bad(port))
    return port + 1


def _slurm_port(environ: Mapping[str, str]) -> int:
    if "MASTER_PORT" in environ:
        return _coordinator_port(environ)
    # The port JAX's own SLURM detection derives from the job id (same on every task).
    return _int_env(environ, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1)


def _from_environment(environ: Mapping[str, str]) -> tuple:
    """(launcher, coordinator, num_processes, process_id, local_rank) from the launcher."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        coordinator = None
        if "MASTER_ADDR" in environ and "MASTER_PORT" in environ:
            coordinator = f"{environ['MASTER_ADDR']}:{_coordinator_port(environ)}"
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


def _local_devices_default(
    launcher: str, local_rank: int | None, environ: Mapping[str, str]
) -> tuple[int, ...] | None:
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
        environment (JAX_COORDINATOR_ADDRESS, then MASTER_ADDR and MASTER_PORT + 1,
        whose MASTER_PORT is torch's store, then SLURM_LAUNCH_NODE_IPADDR).
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


def _launch_not_int(name: str, value: object) -> str:
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


def _check_launch(launcher: str, coordinator: str | None, n: int, rank: int) -> None:
    for name, value in (("num_processes", n), ("process_id", rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise errors.ShardingTypeError(_launch_not_int(name, value))
    if n < 1 or not 0 <= rank < n:
        raise errors.ShardingValueError(_launch_bad_rank(rank, n))
    if n > 1 and not coordinator:
        raise errors.ShardingValueError(_launch_no_coordinator(n, launcher))


def _coordinator_bad_address(address: str, source: str) -> str:
    return (
        f"initialize: coordinator address {address!r} (from {source}) is not 'host:port' "
        "with a port in 1-65535; pass e.g. '10.0.0.1:29500' (MASTER_ADDR and MASTER_PORT "
        "under torchrun)."
    )


def _coordinator_unresolvable(host: str, source: str, reason: str) -> str:
    return (
        f"initialize: the coordinator host {host!r} (from {source}) does not resolve "
        f"({reason}); set it to the host name or IP address of the machine that runs "
        "process 0, as every process can resolve it."
    )


def endpoint(address: str, source: str) -> tuple[str, int]:
    """(host, port) of "host:port" / "[v6]:port"; the host must resolve (fail fast).

    Args:
      address: the coordinator address.
      source: where it came from, in the user's words (named in the error).

    Returns:
      The host (brackets of an IPv6 literal removed) and the port.

    Raises:
      ValueError: the address is malformed or its host does not resolve.
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ShardingValueError(_coordinator_bad_address(address, source))
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise errors.ShardingValueError(_coordinator_unresolvable(host, source, str(exc))) from None
    return host, int(port)


def address_source(argument: str | None, launch: Launch, environ: Mapping[str, str]) -> str:
    """Where the coordinator address came from, in the words a user set it with."""
    if argument:
        return "the coordinator_address argument"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if launch.launcher == "slurm" and not environ.get("MASTER_ADDR"):
        return "SLURM_LAUNCH_NODE_IPADDR"
    return "MASTER_ADDR / MASTER_PORT"
