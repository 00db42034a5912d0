"""funshard: fully sharded data parallelism (FSDP2 semantics) as pure-functional JAX."""

from funshard._fully_shard import fully_shard as fully_shard
from funshard._mesh import make_mesh as make_mesh
from funshard._placement import Replicate as Replicate
from funshard._placement import Shard as Shard
from funshard._policy import MixedPrecisionPolicy as MixedPrecisionPolicy
from funshard._scan import scan as scan
from funshard._shard import reshard as reshard
from funshard._shard import shard as shard
from funshard._shard import unshard as unshard
from funshard._sharded import Sharded as Sharded
from funshard._step import grad as grad
from funshard._step import value_and_grad as value_and_grad

__version__ = "0.1.0"

__all__ = [
    "MixedPrecisionPolicy",
    "Replicate",
    "Shard",
    "Sharded",
    "fully_shard",
    "grad",
    "make_mesh",
    "reshard",
    "scan",
    "shard",
    "unshard",
    "value_and_grad",
]
