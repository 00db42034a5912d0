"""funshard's planner: what a step will gather, reduce and hold, before it compiles.

Layer 3 (see docs/architecture.md): it builds on `funshard.core` and `funshard.comm`.
Users call `funshard.plan` and read a `funshard.Plan`.
"""

from funshard.planning._plan import Plan as Plan
from funshard.planning._plan import plan as plan
