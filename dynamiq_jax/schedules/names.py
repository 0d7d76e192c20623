"""The schedules' names, in one place: every list of valid schedules and its error.

A schedule is a string or, for Moshpit averaging, a ``dq.Moshpit(...)``. The
front doors (``allreduce``, ``reduce_scatter``, ``compressed_psum``,
``compressed_psum_scatter``, ``simulate``, ``tp_psum``, ``wire_stats``) check
the name with :func:`check_schedule` against the subset they run, so an
unknown name fails where it is passed, with every valid name in the message.
"""

from __future__ import annotations

__all__ = ["FLAT_SCHEDULES", "HIERARCHICAL", "MOSHPIT", "SCHEDULES", "SCATTER_SCHEDULES",
           "ScheduleObject", "check_schedule", "schedule_choices"]

FLAT_SCHEDULES = ("ring", "butterfly", "two_step")
"""The schedules over one axis, each a static plan (``schedules.plan.get_plan``)."""

HIERARCHICAL = {"hierarchical": "ring", "hierarchical-butterfly": "butterfly"}
"""Two-level schedules for ``axis_name=(slow, fast)``, and their slow-axis schedule."""

MOSHPIT = "moshpit"
"""Moshpit averaging with the defaults (``dq.Moshpit()``)."""

SCHEDULES = FLAT_SCHEDULES + tuple(HIERARCHICAL) + (MOSHPIT,)
"""Every schedule name ``dq.allreduce`` and ``dq.compressed_psum`` accept."""

SCATTER_SCHEDULES = FLAT_SCHEDULES + tuple(HIERARCHICAL)
"""The schedules of ``dq.reduce_scatter`` and ``dq.compressed_psum_scatter``."""



class ScheduleObject:
  """A schedule given as an object instead of a name; ``name`` is the name it stands for
  (``dq.Moshpit`` is the one: ``name = "moshpit"``)."""

  name: str = ""


_NOTES = {
    "butterfly": "'butterfly' needs a power-of-two axis",
    "hierarchical": "'hierarchical' and 'hierarchical-butterfly' need axis_name=(slow, fast)",
    MOSHPIT: "'moshpit' is dq.Moshpit(), which takes grid=, rounds=, dropout=, shuffle=, inner=",
}


def schedule_choices(allowed=SCHEDULES) -> str:
  """``allowed`` as a message lists it: the names, then what some of them need."""
  notes = [note for name, note in _NOTES.items() if name in allowed]
  return f"{tuple(allowed)}" + (f" ({'; '.join(notes)})" if notes else "")


def check_schedule(schedule, allowed=SCHEDULES, *, what: str = "allreduce",
                   keyword: str = "schedule"):
  """Returns ``schedule`` if ``what`` runs it, else raises a ValueError naming every choice.

  Args:
    schedule: a name, or a ``dq.Moshpit`` (where ``"moshpit"`` is allowed).
    allowed: the names ``what`` runs (a subset of :data:`SCHEDULES`).
    what: the function, for the message (``"tp_psum"``, ``"dq.Moshpit"``).
    keyword: the argument's name, for the message (``"inner"`` for ``dq.Moshpit``).

  Raises:
    ValueError: an unknown name, or one ``what`` does not run.
  """
  if isinstance(schedule, ScheduleObject) and schedule.name == MOSHPIT:
    if MOSHPIT in allowed:
      return schedule
    raise ValueError(f"{what} does not run Moshpit averaging ({keyword}={schedule!r}). Fix: "
                     f"{keyword}= one of {schedule_choices(allowed)}")
  if isinstance(schedule, str) and schedule in allowed:
    return schedule
  if isinstance(schedule, str) and schedule in SCHEDULES:
    raise ValueError(f"{what} does not run {keyword}={schedule!r}. Fix: {keyword}= one of "
                     f"{schedule_choices(allowed)}")
  raise ValueError(f"{what}: {keyword}={schedule!r} is not one of "
                   f"{schedule_choices(allowed)}. Fix: one of those names")
