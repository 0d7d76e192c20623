"""The default DynamiQ's allocation: which code width each chunk position gets, every round.

XLA needs static buffer sizes, so each chunk's payload has a fixed number of
code units (the budget); which widths its positions take is decided every
round from the global statistics F (the paper's §3.2), identically on every
rank. A *position* is the j-th super-group of every chunk: the n
super-groups ranked ``jn .. jn + n - 1`` by F.

The rule is the paper's threshold rule (§3.2 / App. A): a super-group gets
the width b iff ``T_{a,b} <= F < T_{b,c}``, with thresholds set so that every
extra bit buys the same error reduction. If one quantisation at width ``w``
leaves a relative MSE ``c_w``, raising a position of statistic F from ``a``
to ``b`` bits saves ``F (c_a - c_b)`` for ``b - a`` bits per coordinate, so
equal gain per bit means ``T_{a,b} = lam (b - a) / (c_a - c_b)``, with
``lam`` the smallest multiplier whose widths fit the budget. The paper uses
the model ``c_w = 4^-w``; this module uses each width's own ``c_w``
(:func:`level_error`), far from that model for the ternary 2-bit quantiser
(docs/design.md, *How it works*, has the numbers).

Positions hold n super-groups of one width, so each width takes a multiple
of n super-groups: the ``n N_b`` largest by F (ties by index) take a width of
at least the b-th boundary, ``N_b`` the number of super-groups with ``F >= lam
t_b`` over n, rounded up (a position is worth the wider width when its largest
super-group is, as a position's sum of F is dominated by its largest on
heavy-tailed statistics). Which
super-group of a width sits in which position does not change its error, so
inside a width they keep their index order: the allocation needs the class
sizes and one boundary key per class, not a sort (:func:`allocate`).

A bucket calls :func:`plan`: in a GPU lowering one Pallas Triton kernel (slots,
the chunks' super-groups in chunk order and the positions' widths, in one
launch), elsewhere the jnp reference that :func:`allocate` runs, the same bits
(:mod:`pallas_kernels.dynamiq_allocation`).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import numpy as np

from pallas_kernels import dynamiq_allocation as K
from pallas_kernels import dynamiq_block as block

__all__ = [
    "level_error",
    "hull_widths",
    "statistic",
    "rule",
    "allocate",
    "plan",
]


def level_error(width: int, eps: float) -> float:
  """Relative MSE of one quantisation of Gaussian super-groups at ``width`` bits.

  ``E ||Q(x) - x||^2 / ||x||^2`` for x ~ N(0, I_256) with MEE levels of
  ``eps``, computed exactly from the rounding variance ``(t - lo)(hi - t)``
  of every coordinate of a fixed sample (group scales taken at the group
  max). Deterministic; cached. This is the ``c_w`` of the rule.
  """
  return _level_error(int(width), float(eps))


@functools.lru_cache(maxsize=None)
def _level_error(width: int, eps: float) -> float:
  lam = block.level_table(width, eps).astype(np.float64)
  return _gaussian_error(lam, 16)


@functools.lru_cache(maxsize=None)
def lattice_error(width: int) -> float:
  """:func:`level_error` of the lattice levels (``block.lattice_table``)."""
  return _gaussian_error(block.lattice_table(int(width))[0].astype(np.float64), 16)


@functools.lru_cache(maxsize=None)
def _gaussian_sample(groups: int, supergroups: int):
  """The fixed sample of :func:`_gaussian_error`, drawn once for every level table:
  ``|x|`` by group, each group's maximum, and ``||x||^2`` (read-only)."""
  x = np.random.default_rng(12345).standard_normal((supergroups, 256))  # one super-group each
  a = np.abs(x).reshape(supergroups, groups, -1)
  amax = a.max(-1, keepdims=True)
  for v in (a, amax):
    v.setflags(write=False)
  return a, amax, (x**2).sum()


def _gaussian_error(lam, groups: int, supergroups: int = 4096) -> float:
  a, amax, norm2 = _gaussian_sample(groups, supergroups)
  s = amax / lam[-1]
  t = a / s
  j = np.clip(np.searchsorted(lam, t, side="right") - 1, 0, lam.size - 2)
  var = (t - lam[j]) * (lam[j + 1] - t) * s**2
  return float(var.sum() / norm2)


def hull_widths(errors: Mapping[int, float], cost_per_position: Mapping[int, int]) -> list[int]:
  """Widths on the lower convex hull of (cost, error): the only ones the
  equal-marginal-gain rule ever picks (static)."""
  w = sorted(errors)
  hull = []
  for x in w:
    while len(hull) >= 2:
      a, b = hull[-2], hull[-1]
      # slope a->b must be steeper (more error saved per bit) than b->x
      s_ab = (errors[a] - errors[b]) / (cost_per_position[b] - cost_per_position[a])
      s_bx = (errors[b] - errors[x]) / (cost_per_position[x] - cost_per_position[b])
      if s_bx >= s_ab:
        hull.pop()
      else:
        break
    hull.append(x)
  return hull


def statistic(gnorm, valid):
  """Each super-group's F, the key of the allocation: the norm scaled by a power of two
  (exact), rounded to bf16 and squared (exact), 0 for padding and below the normal
  range. float32, ``>= 0``; its bit pattern orders as its value."""
  return K.statistic(gnorm, valid)


def rule(errors: Mapping[int, float], positions: int, cost_per_position: Mapping[int, int],
         budget: float, n: int, blocks: int = 1) -> K.Rule:
  """The static data of :func:`allocate` (its arguments after ``valid``), checked.

  Raises:
    ValueError: a budget that cannot pay for every position at the narrowest
      width, or ``blocks`` other than 1 and ``n``.
  """
  w = sorted(errors)
  lo_w = w[0]
  if positions * cost_per_position[lo_w] > budget:
    raise ValueError(f"even all {positions} positions at {lo_w} bits cost "
                     f"{positions * cost_per_position[lo_w]} > {budget}")
  if blocks not in (1, n):
    raise ValueError(f"{blocks=} must be 1 or n={n}")
  hull = hull_widths(errors, cost_per_position)
  t = [float(np.float32((cost_per_position[b] - cost_per_position[a]) / (errors[a] - errors[b])))
       for a, b in zip(hull[:-1], hull[1:])]
  step = [int(cost_per_position[b] - cost_per_position[a]) for a, b in zip(hull[:-1], hull[1:])]
  limit = int(math.floor(budget)) - int(positions * cost_per_position[hull[0]])
  return K.Rule(widths=tuple(int(x) for x in w), hull=tuple(int(x) for x in hull),
                t=tuple(t), step=tuple(step), limit=limit, positions=int(positions), n=int(n),
                blocks=int(blocks))


def allocate(gnorm, valid, errors: Mapping[int, float], positions: int,
             cost_per_position: Mapping[int, int], budget: float, n: int,
             blocks: int = 1):
  """Which chunk position each super-group takes, and positions per width (traced).

  The threshold rule with each width's measured error ``c_w``: for a multiplier
  ``lam``, a super-group of statistic F (:func:`statistic`) is worth the b-th
  hull boundary ``a | b`` iff ``F >= lam * t_ab``, ``t_ab = (cost_b - cost_a) /
  (c_a - c_b)``; a position holds n super-groups of one width, so ``N_b(lam) =
  ceil(#{F >= lam t_b} / n)`` positions take a width beyond boundary b. (Rounded
  down, a position would need its smallest super-group to be worth it: 6% more
  error than the whole-position optimum on embedding-like statistics. Rounded to
  the nearest, a bucket whose few non-zero super-groups do not fill their last
  position sent it at the narrowest width: 1.5x to 28x the vNMSE of the sorted
  rule on buckets ending in zeros, as scanned layers pad them. Rounded up: within
  2% of the optimum and of the sorted rule on both; tests/test_allocation_rounds.py,
  tests/test_stacked.py.)
  ``lam`` is the least float32 (zero or normal) whose widths fit the budget,
  found by 31 bisection steps over its bit patterns; what the budget has left
  then goes to the positions that switch just below it, boundary by boundary
  in order of gain per bit. The ``n N_b`` largest F (ties: lower index first)
  take a width beyond boundary b, found by 32 bisection steps over the keys'
  bit patterns and a prefix count of the ties. Within a width, super-groups keep
  their index order. Exact and deterministic: integer counts, float32
  comparisons of normal numbers, no sort.

  This is the jnp reference (:func:`pallas_kernels.dynamiq_allocation.allocate_reference`);
  a bucket calls :func:`plan`, which runs it as one Pallas Triton kernel in a GPU
  lowering.

  Args:
    gnorm: float32 ``[positions * n]`` global super-group norms (>= 0).
    valid: bool ``[positions * n]``: real super-groups (padding: F = 0, after the
      real ones of its block).
    errors: ``{width: c_w}``, decreasing in width.
    positions: positions per chunk (static).
    cost_per_position: ``{width: bits}`` of one position (static).
    budget: payload bits allowed (static).
    n: super-groups per position, one per chunk (static).
    blocks: 1 (an all-reduce: positions are filled from all super-groups) or
      ``n`` (a reduce-scatter: chunk c takes the ``positions`` super-groups
      ``[c positions, (c + 1) positions)``, each ranked within its block, and
      position j of every chunk has the same width).

  Returns:
    ``(dest, counts)``: int32 ``[positions * n]``, the slot of each super-group
    (slot ``j n + c``: chunk c, position j; positions widest first), and int32
    ``[len(errors)]``, positions per width, ascending widths (0 off the hull).
  """
  r = rule(errors, positions, cost_per_position, budget, n, blocks)
  return K.allocate_reference(gnorm, valid, r)


def plan(gnorm, supergroups: int, errors: Mapping[int, float], positions: int,
         cost_per_position: Mapping[int, int], budget: float, n: int, blocks: int = 1, *,
         planes: tuple[int, int] | None = None, column: int | None = None,
         implementation=None, interpret: bool | None = None):
  """:func:`allocate` of the first ``supergroups`` super-groups (the rest padding), with
  what a bucket needs of it: ``(dest, order_t, widths, counts)``, and with ``planes =
  (plane_bits, units)`` the hops' plane table fifth
  (:func:`pallas_kernels.dynamiq_allocation.plan`): one Pallas Triton kernel in a GPU
  lowering, the jnp reference elsewhere, the same bits. With ``column``, ``gnorm`` is
  ``[super-groups, k]`` statistics whose column ``column`` holds the norms.

  Returns:
    ``dest`` and ``counts`` as :func:`allocate`; ``order_t`` int32 ``[n, positions]``,
    the super-group at chunk c's position j; ``widths`` int32 ``[positions]``, the
    width of each position, widest first.
  """
  r = rule(errors, positions, cost_per_position, budget, n, blocks)
  return K.plan(gnorm, real=supergroups, rule=r, planes=planes, column=column,
                implementation=implementation, interpret=interpret)
