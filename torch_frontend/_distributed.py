"""torchrun's environment -> JAX's runtime and torch's default process group, and meshes.

Two runtimes serve one job. JAX's multi-process runtime runs the hot path (every
all-gather and reduce-scatter of `fully_shard`), and torch.distributed's default
process group runs what torch's own tools need: DTensor reductions (the norm in
`clip_grad_norm_`, `full_tensor()`), `torch.distributed.checkpoint`, and the user's
own `dist.all_reduce` / `dist.barrier`. Both are started here from torchrun's
variables, and the same rank is the same process in both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist
from jax.sharding import Mesh
from torch.distributed.device_mesh import DeviceMesh

import funshard as fs
import funshard.distributed
from funshard import errors
from torch_frontend import _bridge, _cuda


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What `init_distributed` started, once per process.

    Attributes:
      mesh: the frontend's default mesh (one device per process).
      replicate: the HSDP replica count it was asked for (None: FSDP).
      comm: the process's collective launcher, handed to every group's layout.
    """

    mesh: Mesh
    replicate: int | None
    comm: _bridge.CommContext


_runtime: Runtime | None = None
# jax mesh <-> torch DeviceMesh over the same processes, made once per mesh: a
# DeviceMesh's sub-groups are made collectively, so every rank makes them in the same
# order, i.e. at the same fully_shard call.
_device_meshes: dict[Mesh, DeviceMesh] = {}
_jax_meshes: dict[DeviceMesh, Mesh] = {}


def init_distributed(replicate: int | None = None) -> Mesh:
    """Starts JAX's runtime and torch's default process group; returns the frontend's mesh.

    Every torch process is one rank that holds one shard, so the mesh has ONE device
    per process (each process's first local device, where DLPack imports land), in
    process order: rank r is position r of the "fsdp" axis. Torch's default process
    group is opened too (gloo; "cpu:gloo,cuda:nccl" where CUDA is present) unless the
    script already opened one, so `dist.get_rank()`, `dist.all_reduce`, DTensor and
    `torch.distributed.checkpoint` work as with FSDP2. Without a launcher's
    environment this is a single process (world size 1, still with a process group),
    e.g. in a notebook. Calling it again returns the same mesh; `device_mesh()` gives
    the matching torch `DeviceMesh`.

    Args:
      replicate: None for FSDP over all processes; k for HSDP, a ("replicate", "fsdp")
        mesh of shape (k, world // k).

    Returns:
      The mesh `fully_shard(mesh=None)` uses.

    Raises:
      ValueError: `replicate` differs from an earlier call, or does not divide the
        number of processes.
      RuntimeError: (`funshard.errors.DistributedError`) torch's process group
        disagrees with JAX's runtime on this process's rank or on the world size.
    """
    global _runtime
    if _runtime is not None:
        if replicate != _runtime.replicate:
            raise errors.ShardingValueError(_replicate_changed(_runtime.replicate, replicate))
        return _runtime.mesh
    _cuda.configure_allocator()  # first: JAX's GPU allocator reads it when it starts
    # fail_fast=True: torchrun's agent notices a failed worker only once it exits, then
    # tears the others down; a worker left in JAX's shutdown barrier would hang the job
    # instead (docs/distributed.md, "fail_fast"). To keep a process alive, call
    # fs.distributed.initialize() before this: a started runtime is not started again.
    sigterm = _sigterm_handler()
    fs.distributed.initialize(fail_fast=True)
    _restore_sigterm(sigterm)
    _cuda.set_torch_device(jax.local_devices()[0])  # torch's current GPU is JAX's
    _init_process_group()
    devices = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    _runtime = Runtime(fs.make_mesh(replicate, devices=devices), replicate, _bridge.CommContext())
    return _runtime.mesh


def _sigterm_handler() -> Any:
    """SIGTERM's handler now (in the main thread; None elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _restore_sigterm(handler: Any) -> None:
    """Gives SIGTERM back the handler it had before JAX's runtime started.

    JAX's runtime catches SIGTERM for its preemption notice (logging "SIGTERM caught"),
    so a torch worker stuck waiting for a peer outlived torchrun's SIGTERM and needed
    SIGKILL. A torch worker ends on SIGTERM (torch's default) or runs the script's own
    handler: its waits for collectives run in Python, in slices of half a second
    (`_worker.Pending`), so either happens within that.
    """
    if handler is None:
        return
    with contextlib.suppress(ValueError, OSError):  # not the main thread after all
        signal.signal(signal.SIGTERM, handler)


def _replicate_changed(before, now) -> str:
    return (
        f"init_distributed: already initialised with replicate={before!r}; "
        f"replicate={now!r} cannot change it in a running process."
    )


def _init_process_group() -> None:
    if not dist.is_initialized():
        backend = _cuda.torch_backend(_cuda.device_type(jax.local_devices()[0]))
        hook = sys.excepthook
        if jax.process_count() == 1:
            # No launcher: a private in-memory store, no port to find.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend)  # torchrun's MASTER_ADDR / MASTER_PORT
        _keep_excepthook(hook)
    if (dist.get_rank(), dist.get_world_size()) != (jax.process_index(), jax.process_count()):
        raise errors.DistributedError(
            _ranks_disagree(
                dist.get_rank(), dist.get_world_size(), jax.process_index(), jax.process_count()
            )
        )


def _keep_excepthook(hook) -> None:
    """Puts back the excepthook that was installed before torch's process group opened.

    `init_process_group` wraps `sys.excepthook` in one that sends sys.stderr to a
    buffer while the wrapped hook runs and prints the buffer with a `[rankN]:` prefix
    after it returns. funshard's fail-fast hook (installed by
    `fs.distributed.initialize`) prints the traceback and the reason, then ends the
    process with `os._exit(1)` inside that call: under the wrapper all of it went into
    the buffer and was lost, so a rank left by another ended with status 1 and no
    message at all. A hook the script or funshard installed is therefore kept as it
    was (tracebacks lose torch's rank prefix; funshard's text names the process).
    """
    if hook is not sys.__excepthook__ and sys.excepthook is not hook:
        sys.excepthook = hook


def _ranks_disagree(rank: int, world: int, jax_rank: int, jax_world: int) -> str:
    return (
        f"init_distributed: torch's process group has rank {rank} of {world}, but JAX's "
        f"runtime has process {jax_rank} of {jax_world}. Open both from the same "
        "launcher (torchrun), or let init_distributed() open torch's group."
    )


def default_mesh() -> Mesh:
    """The mesh of `init_distributed()`, starting it (without replication) if needed."""
    return _runtime.mesh if _runtime is not None else init_distributed()


def layout_of(mesh: Mesh) -> _bridge.RankLayout:
    """This process's layout on `mesh`, with the runtime's collective launcher."""
    default_mesh()
    assert _runtime is not None, "default_mesh() starts the runtime"
    return _bridge.layout_of(mesh, _runtime.comm)


def _process_grid(mesh: Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)


def device_mesh(mesh: Mesh | None = None) -> DeviceMesh:
    """The torch `DeviceMesh` over the same processes as a frontend mesh.

    Its dimensions are the mesh's axes: 1-D without dimension names (equal to FSDP2's
    default mesh, `init_device_mesh(type, (world,))`), or ("replicate", "fsdp") for
    HSDP; the sharded parameters are DTensors on it. Every process must
    call it for the same meshes in the same order the first time (torch makes the
    mesh's process groups collectively).

    Args:
      mesh: a mesh from `init_distributed()` or `funshard.make_mesh` with one device
        per process (None: `init_distributed()`'s).

    Returns:
      The DeviceMesh (made once per mesh).
    """
    mesh = default_mesh() if mesh is None else mesh
    if mesh not in _device_meshes:
        _init_process_group()
        device_type = _cuda.device_type(mesh.devices.flat[0])
        # On the CPU whatever the default device: fully_shard may first run under
        # `with torch.device("meta")` (FSDP2's init recipe).
        # A 1-D mesh without dim names, as FSDP2's default `init_device_mesh(type, (n,))`,
        # so that the two compare equal; HSDP's dims keep their names.
        names = tuple(mesh.axis_names) if len(mesh.axis_names) > 1 else None
        made = DeviceMesh(
            device_type, torch.as_tensor(_process_grid(mesh), device="cpu"), mesh_dim_names=names
        )
        _device_meshes[mesh], _jax_meshes[made] = made, mesh
    return _device_meshes[mesh]


def jax_mesh(mesh: DeviceMesh) -> Mesh:
    """The frontend mesh over the processes of a torch `DeviceMesh` (FSDP2's `mesh=`).

    A 1-D mesh becomes the "fsdp" axis; a 2-D one (FSDP2's HSDP mesh, replicas first)
    becomes ("replicate", "fsdp"). JAX's runtime is started first if needed.

    Raises:
      ValueError: the mesh has more than two dimensions.
    """
    if mesh in _jax_meshes:
        return _jax_meshes[mesh]
    if mesh.ndim not in (1, 2):
        raise errors.ShardingValueError(_device_mesh_rank(mesh))
    default_mesh()
    ranks = mesh.mesh.cpu().reshape(-1).tolist()
    devices = [jax.local_devices(process_index=r)[0] for r in ranks]
    made = fs.make_mesh(None if mesh.ndim == 1 else mesh.shape[0], devices=devices)
    # One way only: the user's DeviceMesh may lack our dimension names, and an equal
    # jax mesh (the default one) keeps the DeviceMesh `device_mesh()` made for it.
    _jax_meshes[mesh] = made
    return made


def _device_mesh_rank(mesh: DeviceMesh) -> str:
    # FSDP2's sentence first: code written for FSDP2 may match it.
    return (
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: pass a 1-D mesh "
        "(FSDP) or a 2-D (replicate, shard) mesh (HSDP), as init_device_mesh makes."
    )


def both_meshes(mesh) -> tuple[Mesh, DeviceMesh]:
    """(jax mesh, torch DeviceMesh) for `fully_shard(mesh=...)`: None, either kind.

    Raises:
      TypeError: `mesh` is neither.
    """
    if mesh is None or isinstance(mesh, Mesh):
        made = device_mesh(mesh)
        return _jax_meshes[made], made
    if isinstance(mesh, DeviceMesh):
        return jax_mesh(mesh), mesh
    raise errors.ShardingTypeError(_bad_mesh(mesh))


def _bad_mesh(mesh) -> str:
    return (
        f"fully_shard: mesh must be a torch DeviceMesh (init_device_mesh) or the mesh "
        f"torch_frontend.init_distributed() returns, got {type(mesh).__name__}."
    )
