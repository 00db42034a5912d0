"""funshard: fully sharded data parallelism (FSDP2 semantics) as pure-functional JAX."""

from funshard._checkpoint import PendingSave as PendingSave
from funshard._checkpoint import restore as restore
from funshard._checkpoint import save as save
from funshard._fully_shard import fully_shard as fully_shard
from funshard._mesh import make_mesh as make_mesh
from funshard._optim import init_optimizer as init_optimizer
from funshard._plan import Plan as Plan
from funshard._plan import plan as plan
from funshard._placement import Replicate as Replicate
from funshard._placement import Shard as Shard
from funshard._policy import MixedPrecisionPolicy as MixedPrecisionPolicy
from funshard._scan import scan as scan
from funshard._shard import reshard as reshard
from funshard._shard import shard as shard
from funshard._shard import unshard as unshard
from funshard._sharded import Sharded as Sharded
from funshard._state_dict import load_state_dict as load_state_dict
from funshard._state_dict import state_dict as state_dict
from funshard._step import grad as grad
from funshard._step import value_and_grad as value_and_grad

from funshard import distributed as distributed

__version__ = "0.1.0"


def __getattr__(name):
    # `fs.flax` without importing flax at `import funshard` (flax is an optional extra).
    if name == "flax":
        import importlib

        return importlib.import_module("funshard.flax")
    raise AttributeError(f"module 'funshard' has no attribute {name!r}")

__all__ = [
    "PendingSave",
    "Plan",
    "MixedPrecisionPolicy",
    "Replicate",
    "Shard",
    "Sharded",
    "distributed",
    "fully_shard",
    "grad",
    "init_optimizer",
    "load_state_dict",
    "make_mesh",
    "plan",
    "reshard",
    "restore",
    "save",
    "scan",
    "shard",
    "state_dict",
    "unshard",
    "value_and_grad",
]
