"""funshard: fully sharded data parallelism (FSDP2 semantics) as pure-functional JAX.

The public face: everything below is re-exported from the subpackages whose names are
the architecture (docs/architecture.md): `funshard.comm` (collectives), `funshard.core`
(the sharded state, units and the root), `funshard.io` (checkpoints, state dicts),
`funshard.planning` (`plan`), `funshard.distributed` (multi-process start-up) and the
optional `funshard.flax`.
"""

from funshard import _jax_compat

# Before anything can start JAX's CPU backend: give its thread pool room for asynchronous
# steps on simulated devices (docs/concepts.md, "Asynchronous steps on CPU devices").
_jax_compat.widen_cpu_pool()

from funshard import distributed as distributed
from funshard import errors as errors
from funshard.comm import AllGather as AllGather
from funshard.comm import ReduceScatter as ReduceScatter
from funshard.comm import make_mesh as make_mesh
from funshard.core import MixedPrecisionPolicy as MixedPrecisionPolicy
from funshard.core import Replicate as Replicate
from funshard.core import Shard as Shard
from funshard.core import Sharded as Sharded
from funshard.core import column_parallel as column_parallel
from funshard.core import expert_combine as expert_combine
from funshard.core import expert_dispatch as expert_dispatch
from funshard.core import fully_shard as fully_shard
from funshard.core import gather_columns as gather_columns
from funshard.core import grad as grad
from funshard.core import init_optimizer as init_optimizer
from funshard.core import lax_scan as lax_scan
from funshard.core import reshard as reshard
from funshard.core import route_top_k as route_top_k
from funshard.core import row_parallel as row_parallel
from funshard.core import scan as scan
from funshard.core import shard as shard
from funshard.core import shard_optimizer as shard_optimizer
from funshard.core import unshard as unshard
from funshard.core import value_and_grad as value_and_grad
from funshard.io import PendingSave as PendingSave
from funshard.io import load_state_dict as load_state_dict
from funshard.io import restore as restore
from funshard.io import save as save
from funshard.io import state_dict as state_dict
from funshard.planning import Plan as Plan
from funshard.planning import StepReport as StepReport
from funshard.planning import check as check
from funshard.planning import plan as plan

__version__ = "0.1.0"


def __getattr__(name):
    # `fs.flax` without importing flax at `import funshard` (flax is an optional extra).
    if name == "flax":
        import importlib

        return importlib.import_module("funshard.flax")
    raise AttributeError(f"module 'funshard' has no attribute {name!r}")


__all__ = [
    "AllGather",
    "MixedPrecisionPolicy",
    "PendingSave",
    "Plan",
    "ReduceScatter",
    "Replicate",
    "Shard",
    "Sharded",
    "StepReport",
    "check",
    "column_parallel",
    "distributed",
    "errors",
    "expert_combine",
    "expert_dispatch",
    "fully_shard",
    "gather_columns",
    "grad",
    "init_optimizer",
    "lax_scan",
    "load_state_dict",
    "make_mesh",
    "plan",
    "reshard",
    "restore",
    "route_top_k",
    "row_parallel",
    "save",
    "scan",
    "shard",
    "shard_optimizer",
    "state_dict",
    "unshard",
    "value_and_grad",
]
