"""Multi-process training: start JAX's runtime from torchrun / SLURM, feed per-process rows.

    import funshard as fs
    import funshard.distributed

    mesh = fs.distributed.initialize()                 # before any other JAX call
    state = fs.shard(params, mesh)
    batch = fs.distributed.shard_batch(local_rows, mesh)

See docs/distributed.md for launch commands and the timeout knobs.
"""

from funshard._distributed import Launch as Launch
from funshard._distributed import data_axes as data_axes
from funshard._distributed import global_devices as global_devices
from funshard._distributed import initialize as initialize
from funshard._distributed import resolve_launch as resolve_launch
from funshard._distributed import shard_batch as shard_batch

__all__ = [
    "Launch",
    "data_axes",
    "global_devices",
    "initialize",
    "resolve_launch",
    "shard_batch",
]
