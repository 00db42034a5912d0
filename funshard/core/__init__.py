"""funshard's core: the `Sharded` leaf, shard / unshard / reshard, units, the root, scan.

Layer 2 of the package (see docs/architecture.md): it builds on `funshard.comm` and is
used by `funshard.io`, `funshard.planning` and `funshard.flax`. The names below are
the core's interface to those layers; users import the public ones from `funshard`.
"""

from funshard.core._context import current as current_step  # noqa: F401 (re-export)
from funshard.core._context import in_unit as in_unit
from funshard.core._context import layout_of as layout_of
from funshard.core._fully_shard import fully_shard as fully_shard
from funshard.core._optim import init_optimizer as init_optimizer
from funshard.core._optim import sharding_on as sharding_on
from funshard.core._options import RootOptions as RootOptions
from funshard.core._options import check_flag as check_flag
from funshard.core._options import check_gradient_divide_factor as check_gradient_divide_factor
from funshard.core._options import check_microbatches as check_microbatches
from funshard.core._options import check_mp_policy as check_mp_policy
from funshard.core._options import check_reshard_after_forward as check_reshard_after_forward
from funshard.core._options import root_options as root_options
from funshard.core._options import trainable_flags as trainable_flags
from funshard.core._parallel import column_parallel as column_parallel
from funshard.core._parallel import expert_combine as expert_combine
from funshard.core._parallel import expert_dispatch as expert_dispatch
from funshard.core._parallel import gather_columns as gather_columns
from funshard.core._parallel import route_top_k as route_top_k
from funshard.core._parallel import row_parallel as row_parallel
from funshard.core._placement import Replicate as Replicate
from funshard.core._placement import Shard as Shard
from funshard.core._policy import MixedPrecisionPolicy as MixedPrecisionPolicy
from funshard.core._policy import param_dtype_for as param_dtype_for
from funshard.core._record import recording as recording
from funshard.core._routes import LeafRoute as LeafRoute
from funshard.core._routes import leaf_routes as leaf_routes
from funshard.core._routes import state_axes as state_axes
from funshard.core._scan import lax_scan as lax_scan
from funshard.core._scan import scan as scan
from funshard.core._shard import dtype_problem as dtype_problem
from funshard.core._shard import reshard as reshard
from funshard.core._shard import reshard_leaf as reshard_leaf
from funshard.core._shard import shard as shard
from funshard.core._shard import unshard as unshard
from funshard.core._shard import unshard_as as unshard_as
from funshard.core._shard_optimizer import LeafStatistics as LeafStatistics
from funshard.core._shard_optimizer import shard_optimizer as shard_optimizer
from funshard.core._sharded import Sharded as Sharded
from funshard.core._sharded import is_array as is_array
from funshard.core._sharded import is_key as is_key
from funshard.core._sharded import is_sharded as is_sharded
from funshard.core._step import grad as grad
from funshard.core._step import value_and_grad as value_and_grad
from funshard.core._tree import Partition as Partition
from funshard.core._tree import common_mesh as common_mesh
from funshard.core._tree import sharded_leaves as sharded_leaves
from funshard.core._unit import policy_of as policy_of
