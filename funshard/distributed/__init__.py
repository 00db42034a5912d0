"""Multi-process training: start JAX's runtime from torchrun / SLURM, feed per-process rows.

    import funshard as fs
    import funshard.distributed

    mesh = fs.distributed.initialize()                 # before any other JAX call
    state = fs.shard(params, mesh)
    batch = fs.distributed.shard_batch(local_rows, mesh)

One job per module: `_launch` (the launcher's environment, the settings), `_rendezvous`
(the processes' first meeting), `_links` (its connections, kept open to notice a death),
`_batch` (`shard_batch`), `_lifecycle` (departure notes, watchdog, exit, `fail_fast`) and
`_initialize`, which composes them. The agreement
checks and the departure notes' reader live in `funshard.comm`, below the core that
calls them. See docs/distributed.md for launch commands, the timeout knobs and
`fail_fast`.
"""

from funshard.comm import count_step as count_step
from funshard.comm import same_collective as same_collective
from funshard.comm import same_state as same_state
from funshard.distributed import _initialize
from funshard.distributed._batch import data_axes as data_axes
from funshard.distributed._batch import shard_batch as shard_batch
from funshard.distributed._initialize import global_devices as global_devices
from funshard.distributed._initialize import initialize as initialize
from funshard.distributed._launch import Launch as Launch
from funshard.distributed._launch import resolve_launch as resolve_launch

# Said at `import funshard` (which imports this package), the first moment funshard can.
_initialize.warn_if_backend_started()

__all__ = [
    "Launch",
    "count_step",
    "data_axes",
    "global_devices",
    "initialize",
    "resolve_launch",
    "same_collective",
    "same_state",
    "shard_batch",
]
