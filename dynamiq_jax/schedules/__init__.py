"""Multi-hop all-reduce schedules: the collective vocabulary, static plans, the executor.

Nothing here knows a codec: the executor moves payloads and calls four
functions of arrays (:class:`HopOps`) that ``allreduce`` builds from a codec.
"""

from dynamiq_jax.schedules.context import AxisContext
from dynamiq_jax.schedules.context import UnboundAxisError
from dynamiq_jax.schedules.context import axis_context
from dynamiq_jax.schedules.executor import HopOps
from dynamiq_jax.schedules.executor import all_gather
from dynamiq_jax.schedules.executor import execute
from dynamiq_jax.schedules.executor import reduce_scatter
from dynamiq_jax.schedules.hierarchical import HIERARCHICAL
from dynamiq_jax.schedules.loss import PacketLoss
from dynamiq_jax.schedules.moshpit import GroupContext
from dynamiq_jax.schedules.moshpit import Moshpit
from dynamiq_jax.schedules.moshpit import MoshpitPlan
from dynamiq_jax.schedules.moshpit import default_grid
from dynamiq_jax.schedules.plan import TreePlan
from dynamiq_jax.schedules.plan import butterfly_plan
from dynamiq_jax.schedules.plan import get_plan
from dynamiq_jax.schedules.plan import ring_bytes_per_rank
from dynamiq_jax.schedules.plan import ring_plan

__all__ = [
    "AxisContext",
    "UnboundAxisError",
    "axis_context",
    "HopOps",
    "all_gather",
    "execute",
    "reduce_scatter",
    "HIERARCHICAL",
    "PacketLoss",
    "GroupContext",
    "Moshpit",
    "MoshpitPlan",
    "default_grid",
    "TreePlan",
    "butterfly_plan",
    "get_plan",
    "ring_bytes_per_rank",
    "ring_plan",
]
