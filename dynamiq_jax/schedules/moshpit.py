"""Moshpit averaging: rounds of small group all-reduces on a virtual grid.

The ``n`` ranks sit on a virtual grid of sides ``(M_1, ..., M_d)`` (their
product is ``n``); round ``t`` averages within the groups of ranks that share
every grid coordinate but the one along axis ``t mod d`` (Ryabinin et al.,
"Moshpit SGD", NeurIPS 2021). With every rank present, every rank holds the
exact mean after ``d`` rounds, and no collective spans more than ``max(M)``
ranks. A rank absent in a round (simulated: XLA's collectives cannot lose a
peer) contributes nothing and keeps its own value; its group divides by the
count of members present, each member weighed (``weighted=True``) by the
contributions its value already holds, so that a rank that missed round t,
whose value holds its own contribution only, counts once and not as much as a
member holding the mean of ``M`` ranks.

This module is the static part: the grid, where each rank sits in each round
(optionally re-shuffled within the groups of the round before, as hivemind's
matchmaking re-draws a peer's coordinate along the axis it just averaged),
and :class:`GroupContext`, the collective vocabulary of
:class:`~dynamiq_jax.schedules.context.AxisContext` restricted to one round's
groups (built from ``ppermute``: ``shard_map`` has no collectives over
groups of an axis). Nothing here knows a codec.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.schedules.context import AxisContext
from dynamiq_jax.schedules.names import FLAT_SCHEDULES, MOSHPIT, ScheduleObject, check_schedule
from dynamiq_jax.schedules.plan import get_plan

__all__ = ["Moshpit", "MoshpitPlan", "GroupContext", "default_grid", "is_moshpit"]


def default_grid(n: int) -> tuple[int, ...]:
  """The default grid for ``n`` ranks: two sides as equal as ``n``'s divisors allow
  (``4 x 4`` for 16, ``2 x 4`` for 8, ``8 x 16`` for 128): two rounds, groups of about
  ``sqrt(n)``.

  Raises:
    ValueError: where ``n`` has no such factorisation (a prime, or fewer than 4
      ranks); the message says which grid to pass instead.
  """
  side = max((k for k in range(2, math.isqrt(n) + 1) if n % k == 0), default=None)
  if side is None:
    raise ValueError(
        f"{n} ranks cannot sit on a grid of two or more sides of at least 2 ({n} is "
        f"{'prime' if n > 3 else 'below 4'}), so Moshpit averaging has no small groups to "
        f"offer. Fix: pass grid=({n},) to average in one group of {n} (a ring), or use "
        f"schedule='ring'")
  return side, n // side


@dataclasses.dataclass(frozen=True)
class Moshpit(ScheduleObject):
  """``schedule=Moshpit(...)``: Moshpit averaging on a virtual grid
  (``schedule="moshpit"`` is ``Moshpit()``).

  Attributes:
    grid: the sides ``(M_1, ..., M_d)``, their product the axis size; None:
      :func:`default_grid`.
    rounds: group reductions to run (None: ``d``, one per grid axis, which with
      every rank present gives the exact mean); round t averages along axis
      ``t mod d``.
    dropout: the probability that a rank is absent from a round, drawn per
      round and rank from the call's key (a seeded simulation of peers that
      drop out: the collectives still run, an absent rank contributes nothing
      and keeps its own value).
    shuffle: None (every round on the same placement), or a seed: after each
      round, the members of each group are given new coordinates along the
      axis they just averaged, in an order drawn from this seed (fixed when the
      program is traced, as ``ppermute``'s pairs must be).
    inner: the schedule inside a group: ``"ring"``, ``"butterfly"`` (power-of-two
      sides) or ``"two_step"`` (:data:`~dynamiq_jax.schedules.names.FLAT_SCHEDULES`).
    weighted: the group's mean weighs each present member by the count of ranks'
      contributions its value holds (True), or each member alike (False: the
      Moshpit authors' averager). With every rank present the two are the same
      (bit for bit); where a rank missed a round, the weighted mean of a later
      group is the exact mean of the contributions it holds, where the plain one
      gives a lone value the weight of a group's mean.
  """

  grid: tuple[int, ...] | None = None
  rounds: int | None = None
  dropout: float = 0.0
  shuffle: int | None = None
  inner: str = "ring"
  weighted: bool = True
  name = MOSHPIT  # (not a field) what check_schedule reads

  def __post_init__(self):
    if self.grid is not None:
      if isinstance(self.grid, (int, np.integer)):
        object.__setattr__(self, "grid", (int(self.grid),))
      grid = tuple(self.grid)
      if not grid or any(not isinstance(m, (int, np.integer)) or m < 2 for m in grid):
        raise ValueError(f"grid={self.grid!r} must be a tuple of sides, each an int >= 2, "
                         f"e.g. grid=(4, 4) for 16 ranks")
      object.__setattr__(self, "grid", tuple(int(m) for m in grid))
    if self.rounds is not None and (not isinstance(self.rounds, (int, np.integer))
                                    or self.rounds < 1):
      raise ValueError(f"rounds={self.rounds!r} must be an int >= 1 (None: one per grid axis)")
    if not 0.0 <= float(self.dropout) < 1.0:
      raise ValueError(f"dropout={self.dropout!r} must be a probability in [0, 1)")
    if self.shuffle is not None and not isinstance(self.shuffle, (int, np.integer)):
      raise ValueError(f"shuffle={self.shuffle!r} must be None or an int seed")
    check_schedule(self.inner, FLAT_SCHEDULES, what="dq.Moshpit (the schedule inside a group)",
                   keyword="inner")
    if not isinstance(self.weighted, (bool, np.bool_)):
      raise ValueError(f"weighted={self.weighted!r} must be True (each member weighed by the "
                       f"contributions its value holds) or False (members alike)")

  def plan(self, n: int) -> "MoshpitPlan":
    """The static plan over ``n`` ranks (validates the grid against ``n``)."""
    grid = default_grid(n) if self.grid is None else self.grid
    if math.prod(grid) != n:
      fits = default_grid(n) if _factors(n) else (n,)
      raise ValueError(
          f"grid={grid} holds {math.prod(grid)} ranks but the axis has {n}: the sides' "
          f"product must be the axis size. Fix: e.g. grid={fits}, or grid=None (the default)")
    for m in grid:
      get_plan(self.inner, m)  # a butterfly needs power-of-two sides
    return _plan(grid, self.rounds or len(grid), self.shuffle, self.inner, bool(self.weighted))


def _factors(n: int) -> bool:
  return any(n % k == 0 for k in range(2, math.isqrt(n) + 1))


def is_moshpit(schedule) -> bool:
  """Whether ``schedule`` names Moshpit averaging (``"moshpit"`` or a :class:`Moshpit`)."""
  return isinstance(schedule, Moshpit) or (isinstance(schedule, str) and schedule == "moshpit")


def as_moshpit(schedule) -> Moshpit:
  """``schedule`` as a :class:`Moshpit` (``"moshpit"``: the defaults)."""
  return schedule if isinstance(schedule, Moshpit) else Moshpit()


@dataclasses.dataclass(frozen=True)
class MoshpitPlan:
  """Where every rank sits in every round; static, hashable.

  Attributes:
    grid: the sides.
    rounds: the number of rounds.
    coords: ``coords[t][r]``: rank r's grid coordinates in round t.
    inner: the schedule inside a group.
    weighted: members weighed by the contributions their values hold
      (:attr:`Moshpit.weighted`).
  """

  grid: tuple[int, ...]
  rounds: int
  coords: tuple[tuple[tuple[int, ...], ...], ...]
  inner: str
  weighted: bool = True

  def held(self, t: int) -> int:
    """The contributions every rank's value holds before round ``t`` with every rank
    present: the product of the sides rounds ``0 .. t - 1`` averaged along."""
    return math.prod(self.grid[self.axis(s)] for s in range(t))

  @property
  def n(self) -> int:
    return math.prod(self.grid)

  def axis(self, t: int) -> int:
    """The grid axis round ``t`` averages along."""
    return t % len(self.grid)

  def groups(self, t: int) -> tuple[tuple[int, ...], ...]:
    """Round t's groups: each the ranks in the order of their coordinate along the
    round's axis, groups in the row-major order of their other coordinates."""
    a = self.axis(t)
    found: dict[tuple, list] = {}
    for r, c in enumerate(self.coords[t]):
      found.setdefault(c[:a] + c[a + 1:], [None] * self.grid[a])[c[a]] = r
    return tuple(tuple(found[k]) for k in sorted(found))

  def remaining(self, t: int) -> tuple[int, ...]:
    """The grid axes rounds ``t + 1, ..., rounds - 1`` average along, besides round t's."""
    d = len(self.grid)
    later = {self.axis(s) for s in range(t + 1, self.rounds)}
    return tuple(a for a in range(d) if a in later and a != self.axis(t))

  def stream(self, t: int) -> tuple[int, ...]:
    """Per rank, the random stream of its group in round t: the group's coordinates
    along the axes later rounds still average (:meth:`remaining`). Groups that differ
    only along axes already averaged hold the same values (with every rank present)
    and draw the same rounding, so they end bit-identical, while groups whose results
    later rounds average draw independent rounding."""
    axes = self.remaining(t)
    out = []
    for c in self.coords[t]:
      idx = 0
      for a in axes:
        idx = idx * self.grid[a] + c[a]
      out.append(idx)
    return tuple(out)

  def context(self, t: int, axis_name, n: int) -> "GroupContext":
    """Round t's groups as a collective context over ``axis_name``."""
    if n != self.n:
      raise ValueError(f"the Moshpit plan is for {self.n} ranks but the axis has {n}")
    groups = self.groups(t)
    local = [0] * self.n
    for g in groups:
      for i, r in enumerate(g):
        local[r] = i
    return GroupContext(axis_name=axis_name, n=len(groups[0]), groups=groups,
                        local=tuple(local))

  def placement(self) -> np.ndarray:
    """``[rounds, n]``: each rank's cell (row-major index of its coordinates) per round."""
    return np.array([[int(np.ravel_multi_index(c, self.grid)) for c in row]
                     for row in self.coords])


@functools.lru_cache(maxsize=None)
def _plan(grid: tuple[int, ...], rounds: int, shuffle: int | None, inner: str,
          weighted: bool = True) -> MoshpitPlan:
  n = math.prod(grid)
  coords = [tuple(int(v) for v in np.unravel_index(r, grid)) for r in range(n)]
  rows = [tuple(coords)]
  rng = np.random.default_rng(shuffle) if shuffle is not None else None
  for t in range(rounds - 1):
    if rng is not None:  # new coordinates along the axis just averaged, group by group
      a = t % len(grid)
      groups: dict[tuple, list] = {}
      for r, c in enumerate(coords):
        groups.setdefault(c[:a] + c[a + 1:], []).append(r)
      coords = list(coords)
      for k in sorted(groups):
        members = sorted(groups[k], key=lambda r: coords[r][a])
        for r, v in zip(members, rng.permutation(grid[a])):
          c = coords[r]
          coords[r] = c[:a] + (int(v),) + c[a + 1:]
    rows.append(tuple(coords))
  return MoshpitPlan(grid, rounds, tuple(rows), inner, weighted)


@dataclasses.dataclass(frozen=True)
class GroupContext(AxisContext):
  """An axis seen as disjoint groups of equal size: collectives within each group.

  ``n`` is the group size and ``rank()`` the rank's index in its group; every
  collective runs in every group at once, each built from ``ppermute`` over the
  whole axis (whose pairs stay within groups). Results vary over the axis.

  Attributes:
    groups: the groups, each a tuple of axis indices in group order.
    local: per axis index, its index in its group.
  """

  groups: tuple[tuple[int, ...], ...] = ()
  local: tuple[int, ...] = ()

  def rank(self):
    return jnp.asarray(self.local, jnp.int32)[jax.lax.axis_index(self.axis_name)]

  def ppermute(self, tree, perm):
    pairs = [(g[i], g[j]) for g in self.groups for i, j in perm]
    return jax.lax.ppermute(tree, self.axis_name, pairs)

  def _shifted(self, tree, k: int):
    """Every member's ``tree`` from the member ``k`` places before it in its group."""
    return self.ppermute(tree, [(i, (i + k) % self.n) for i in range(self.n)])

  def all_gather(self, tree):
    """Leading axis n: row s is group member s's value (the same on every member)."""
    r = self.rank()
    order = (r - jnp.arange(self.n)) % self.n  # row s came k = (r - s) % n places before

    def one(a):
      parts = [a] + [self._shifted(a, k) for k in range(1, self.n)]
      return jnp.take(jnp.stack(parts), order, axis=0)

    return jax.tree.map(one, tree)

  def all_to_all(self, tree):
    """Leading axis n: member r's row s goes to member s, which holds it as its row r."""
    r = self.rank()
    ks = jnp.arange(self.n)

    def one(a):
      parts = [jax.lax.dynamic_index_in_dim(a, r, 0, keepdims=False)]
      for k in range(1, self.n):
        parts.append(self._shifted(jax.lax.dynamic_index_in_dim(a, (r + k) % self.n, 0,
                                                                keepdims=False), k))
      return jnp.take(jnp.stack(parts), (r - ks) % self.n, axis=0)

    return jax.tree.map(one, tree)

  def pmax(self, tree):
    return jax.tree.map(lambda a: jnp.max(a, axis=0), self.all_gather(tree))

  def psum(self, tree):
    """The members' sum, added in group order (the same bits on every member)."""

    def total(a):
      acc = a[0]
      for s in range(1, self.n):
        acc = acc + a[s]
      return acc

    return jax.tree.map(total, self.all_gather(tree))
