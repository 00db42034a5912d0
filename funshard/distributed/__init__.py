"""Multi-process training: start JAX's runtime from torchrun / SLURM, feed per-process rows.

    import funshard as fs
    import funshard.distributed

    mesh = fs.distributed.initialize()                 # before any other JAX call
    state = fs.shard(params, mesh)
    batch = fs.distributed.shard_batch(local_rows, mesh)

See docs/distributed.md for launch commands and the timeout knobs.
"""

from funshard.distributed._agreement import same_collective as same_collective
from funshard.distributed._departure import OrderedWorker as OrderedWorker
from funshard.distributed._departure import count_step as count_step
from funshard.distributed._runtime import Launch as Launch
from funshard.distributed._runtime import data_axes as data_axes
from funshard.distributed._runtime import global_devices as global_devices
from funshard.distributed._runtime import initialize as initialize
from funshard.distributed._runtime import resolve_launch as resolve_launch
from funshard.distributed._runtime import shard_batch as shard_batch
from funshard.distributed._state_agreement import same_state as same_state

__all__ = [
    "Launch",
    "OrderedWorker",
    "count_step",
    "data_axes",
    "global_devices",
    "initialize",
    "resolve_launch",
    "same_collective",
    "same_state",
    "shard_batch",
]
