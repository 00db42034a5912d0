"""torchrun's environment -> JAX's multi-process runtime, and the mesh the frontend uses."""

from __future__ import annotations

import jax
from jax.sharding import Mesh

import funshard as fs
import funshard.distributed

_mesh: Mesh | None = None
_replicate: int | None = None


def init_distributed(replicate: int | None = None) -> Mesh:
    """Starts JAX's runtime from torchrun's environment and returns the frontend's mesh.

    Every torch process is one rank that holds one shard, so the mesh has ONE device
    per process (each process's first local device, where DLPack imports land), in
    process order: rank r is position r of the "fsdp" axis. Without a launcher's
    environment this is a single process (world size 1), e.g. in a notebook. Torch's
    own process group is never opened. Calling it again returns the same mesh.

    Args:
      replicate: None for FSDP over all processes; k for HSDP, a ("replicate", "fsdp")
        mesh of shape (k, world // k).

    Returns:
      The mesh `fully_shard(mesh=None)` uses.

    Raises:
      ValueError: `replicate` differs from an earlier call, or does not divide the
        number of processes.
    """
    global _mesh, _replicate
    if _mesh is not None:
        if replicate != _replicate:
            raise ValueError(
                f"init_distributed: already initialised with replicate={_replicate!r}; "
                f"replicate={replicate!r} cannot change it in a running process."
            )
        return _mesh
    fs.distributed.initialize()
    devices = [jax.local_devices(process_index=p)[0] for p in range(jax.process_count())]
    _mesh, _replicate = fs.make_mesh(replicate, devices=devices), replicate
    return _mesh


def default_mesh() -> Mesh:
    """The mesh of `init_distributed()`, starting it (without replication) if needed."""
    return _mesh if _mesh is not None else init_distributed()
