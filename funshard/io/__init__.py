"""funshard's I/O: sharded checkpoints on disk and full state dicts.

Layer 3 (see docs/architecture.md): it builds on `funshard.core`. Users import
`save`, `restore`, `PendingSave`, `state_dict` and `load_state_dict` from `funshard`;
`leaf_records` is for frontends that read a checkpoint's layout (torch_frontend).
"""

from funshard.io._checkpoint import PendingSave as PendingSave
from funshard.io._checkpoint import leaf_records as leaf_records
from funshard.io._checkpoint import restore as restore
from funshard.io._checkpoint import save as save
from funshard.io._state_dict import load_state_dict as load_state_dict
from funshard.io._state_dict import state_dict as state_dict
