"""funshard's planner: what a step will gather, reduce and hold, before it compiles.

Layer 3 (see docs/architecture.md): it builds on `funshard.core` and `funshard.comm`.
Users call `funshard.plan` and read a `funshard.Plan`, and `funshard.check` to hold a
compiled step against its policy. `torch_frontend.check` builds the same `StepReport`
from the records below (`CheckedCollective`, `Mismatch`, `MISMATCH_KINDS`, `human`).
"""

from funshard.planning._check import MISMATCH_KINDS as MISMATCH_KINDS
from funshard.planning._check import CheckedCollective as CheckedCollective
from funshard.planning._check import Mismatch as Mismatch
from funshard.planning._check import StepReport as StepReport
from funshard.planning._check import check as check
from funshard.planning._check import check_allow as check_allow
from funshard.planning._plan import Plan as Plan
from funshard.planning._plan import plan as plan
from funshard.planning._render import human as human
