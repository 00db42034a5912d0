"""funshard's communication layer: meshes, the collectives, and the eager collective API.

Layer 1 of the package (see docs/architecture.md): it knows meshes, layouts and arrays,
never a training step. Everything the core, the planner and the frontends communicate
goes through these names:

- in a step (inside `jax.shard_map`): `gather` / `gather_deferred` (an all-gather whose
  transpose is a reduce-scatter, described by a `GroupLayout`), `gather_values`,
  `regather_values`, `reduce_values`, `all_gather_blocks`, `reduce_scatter_blocks`,
  and a unit's own collectives in their place (`AllGather`, `ReduceScatter`, public as
  `fs.AllGather` / `fs.ReduceScatter`, attached by `with_collectives`);
- eagerly, outside a step (semi-public: documented in docs/architecture.md, used by
  `fs.unshard` and `torch_frontend`): `eager_all_gather`, `eager_reduce_scatter` and
  `eager_reduce_scatter_rows` over global arrays, and `global_array`, which makes one
  from process-local buffers without a copy;
- across processes, outside any step (semi-public, re-exported by `funshard.distributed`
  and used by the core): `same_collective` and `same_state`, the agreement checks, and
  the departure notes they read (`Note`, `departed`, `count_step`, `stuck_error`, ...),
  which `funshard.distributed` writes.
"""

from funshard.comm._agreement import same_collective as same_collective
from funshard.comm._custom import AllGather as AllGather
from funshard.comm._custom import ReduceScatter as ReduceScatter
from funshard.comm._custom import check_unit_collectives as check_unit_collectives
from funshard.comm._custom import wire_label as wire_label
from funshard.comm._departures import DEPARTURE_TIMEOUT as DEPARTURE_TIMEOUT
from funshard.comm._departures import POLL_S as POLL_S
from funshard.comm._departures import SERVICE_GRACE_S as SERVICE_GRACE_S
from funshard.comm._departures import Board as Board
from funshard.comm._departures import Note as Note
from funshard.comm._departures import announce_failure as announce_failure
from funshard.comm._departures import await_failures as await_failures
from funshard.comm._departures import board as board
from funshard.comm._departures import collective_running as collective_running
from funshard.comm._departures import count_step as count_step
from funshard.comm._departures import departed as departed
from funshard.comm._departures import departure_text as departure_text
from funshard.comm._departures import left_before_this_step as left_before_this_step
from funshard.comm._departures import open_board as open_board
from funshard.comm._departures import python_wait as python_wait
from funshard.comm._departures import running_collectives as running_collectives
from funshard.comm._departures import same_steps_hint as same_steps_hint
from funshard.comm._departures import stuck_error as stuck_error
from funshard.comm._departures import wait_limit as wait_limit
from funshard.comm._eager import backends_started as backends_started
from funshard.comm._eager import dlpack_import as dlpack_import
from funshard.comm._eager import eager_all_gather as eager_all_gather
from funshard.comm._eager import eager_reduce_scatter as eager_reduce_scatter
from funshard.comm._eager import eager_reduce_scatter_rows as eager_reduce_scatter_rows
from funshard.comm._eager import global_array as global_array
from funshard.comm._gather import GroupLayout as GroupLayout
from funshard.comm._gather import LeafLayout as LeafLayout
from funshard.comm._gather import backward_values as backward_values
from funshard.comm._gather import gather as gather
from funshard.comm._gather import gather_deferred as gather_deferred
from funshard.comm._gather import gather_values as gather_values
from funshard.comm._gather import reduce_values as reduce_values
from funshard.comm._gather import regather_values as regather_values
from funshard.comm._gather import scope as scope
from funshard.comm._gather import with_collectives as with_collectives
from funshard.comm._key_value import agree_on_digest as agree_on_digest
from funshard.comm._key_value import exchange_texts as exchange_texts
from funshard.comm._layout import Layout as Layout
from funshard.comm._layout import LayoutFacts as LayoutFacts
from funshard.comm._layout import check_group_size as check_group_size
from funshard.comm._layout import chunk as chunk
from funshard.comm._layout import from_padded as from_padded
from funshard.comm._layout import pad_blocks as pad_blocks
from funshard.comm._layout import pad_end as pad_end
from funshard.comm._layout import padded_size as padded_size
from funshard.comm._layout import rows_per_shard as rows_per_shard
from funshard.comm._layout import to_padded as to_padded
from funshard.comm._layout import unpad_blocks as unpad_blocks
from funshard.comm._lowering import PRESENT_SCOPE as PRESENT_SCOPE
from funshard.comm._lowering import UINT as UINT
from funshard.comm._lowering import all_gather_blocks as all_gather_blocks
from funshard.comm._lowering import is_inexact_array as is_inexact_array
from funshard.comm._lowering import materialize as materialize
from funshard.comm._lowering import packing_of as packing_of
from funshard.comm._lowering import reduce_scatter_blocks as reduce_scatter_blocks
from funshard.comm._lowering import reduce_scatter_by_permutes as reduce_scatter_by_permutes
from funshard.comm._lowering import tie_to as tie_to
from funshard.comm._lowering import vary as vary
from funshard.comm._mesh import REPLICATE_AXIS as REPLICATE_AXIS
from funshard.comm._mesh import SHARD_AXIS as SHARD_AXIS
from funshard.comm._mesh import as_axes as as_axes
from funshard.comm._mesh import axes_size as axes_size
from funshard.comm._mesh import constrain as constrain
from funshard.comm._mesh import has_explicit_axes as has_explicit_axes
from funshard.comm._mesh import make_mesh as make_mesh
from funshard.comm._mesh import place_for_map as place_for_map
from funshard.comm._mesh import resolve_axes as resolve_axes
from funshard.comm._mesh import spec as spec
from funshard.comm._state_agreement import same_state as same_state
