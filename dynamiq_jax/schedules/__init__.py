"""Multi-hop all-reduce schedules: static plans and their executor."""

from dynamiq_jax.schedules.executor import execute
from dynamiq_jax.schedules.plan import TreePlan
from dynamiq_jax.schedules.plan import butterfly_plan
from dynamiq_jax.schedules.plan import get_plan
from dynamiq_jax.schedules.plan import ring_plan

__all__ = [
    "execute",
    "TreePlan",
    "butterfly_plan",
    "get_plan",
    "ring_plan",
]
