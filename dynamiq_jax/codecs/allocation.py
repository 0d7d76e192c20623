"""The default DynamiQ's allocation: which code width each chunk position gets, every round.

XLA needs static buffer sizes, so each chunk's payload has a fixed number of
code units (the budget); which widths its positions take is decided every
round from the global statistics F (the paper's §3.2), identically on every
rank. A *position* is the j-th super-group of every chunk: the n
super-groups ranked ``jn .. jn + n - 1`` by F.

The rule is the paper's threshold rule (§3.2 / App. A): a position gets the
width b iff ``T_{a,b} <= F < T_{b,c}``, with thresholds set so that every
extra bit buys the same error reduction. If one quantisation at width ``w``
leaves a relative MSE ``c_w``, raising a position of statistic F from ``a``
to ``b`` bits saves ``F (c_a - c_b)`` for ``b - a`` bits per coordinate, so
equal gain per bit means ``T_{a,b} = lam (b - a) / (c_a - c_b)``, with
``lam`` the smallest multiplier whose widths fit the budget. The paper uses
the model ``c_w = 4^-w``; this module uses each width's own ``c_w``
(:func:`level_error`), far from that model for the ternary 2-bit quantiser
(docs/design.md, *How it works*, has the numbers).
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dynamiq_block as block
from pallas_kernels import dynamiq_reference as payload_lib

__all__ = [
    "level_error",
    "hull_widths",
    "descending_order",
    "capacities_threshold",
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


def _gaussian_error(lam, groups: int, supergroups: int = 4096) -> float:
  x = np.random.default_rng(12345).standard_normal((supergroups, 256))  # one super-group each
  a = np.abs(x).reshape(supergroups, groups, -1)
  s = a.max(-1, keepdims=True) / lam[-1]
  t = a / s
  j = np.clip(np.searchsorted(lam, t, side="right") - 1, 0, lam.size - 2)
  var = (t - lam[j]) * (lam[j + 1] - t) * s**2
  return float(var.sum() / (x**2).sum())


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


def _finite_norms(gnorm):
  """float32 norms with non-finite ones (never produced by the guarded all-reduce)
  as the largest float."""
  g = jnp.asarray(gnorm, jnp.float32)
  return jnp.where(jnp.isfinite(g), g, jnp.finfo(jnp.float32).max)


def descending_order(gnorm, valid, chunks: int | None = None):
  """The permutation that sorts super-groups by norm, largest first, ties by
  index, the ones not ``valid`` (padding) last: the order in which the
  allocation hands out widths.

  With ``chunks=n`` (a reduce-scatter, whose chunk c must hold super-groups
  ``[c s, (c+1) s)``), each of the n contiguous blocks of ``s`` super-groups
  is sorted on its own and the blocks are interleaved: position ``j n + c``
  holds the j-th largest super-group of block c, so ``order.reshape(s, n).T``
  gives chunk c its own super-groups, largest first, and position j of every
  chunk the j-th largest of each.
  """
  key = jnp.where(valid, -_finite_norms(gnorm), jnp.inf)
  if chunks is None:
    return jnp.argsort(key, stable=True)
  s = key.shape[0] // chunks
  local = jnp.argsort(key.reshape(chunks, s), axis=1, stable=True)
  return (local + (jnp.arange(chunks) * s)[:, None]).T.reshape(-1)


def capacities_threshold(gnorm, valid, errors: Mapping[int, float], positions: int,
                         cost_per_position: Mapping[int, int], budget: float, n: int,
                         order=None):
  """Positions per width by the paper's threshold rule, for any number of widths (traced).

  The rule (equal marginal gain per bit, with each width's measured error
  ``c_w``): for a multiplier ``lam``, a position of statistic F (the sum of its
  n super-groups' F) gets the widest width b with ``F >= lam * t_ab`` for
  every hull boundary ``a | b`` below it, ``t_ab = (cost_b - cost_a) / (c_a
  - c_b)``; ``lam`` is the smallest that fits the budget. Exact and
  deterministic: F is scaled by a power of two (exact) and squared from
  bf16-exact norms (exact), a position's F summed in a fixed order; ``lam``
  is the least float32 whose widths fit (:func:`_switching_multiplier`: each
  position's largest multiplier that keeps it above a boundary, ``F >= lam *
  t`` as one rounded product, then one sort of those); positions that tie at
  the switching multiplier then take the next width while the budget allows.

  Args:
    gnorm: float32 ``[positions * n]`` global super-group norms (>= 0).
    valid: bool ``[positions * n]``: real super-groups (padding is ranked last, F = 0).
    errors: ``{width: c_w}``, decreasing in width.
    positions: positions per chunk (static).
    cost_per_position: ``{width: bits}`` of one position (static).
    budget: payload bits allowed (static).
    n: super-groups per position, one per chunk (static).
    order: optional, :func:`descending_order` of ``(gnorm, valid)``, when the
      caller has it: the statistics are then put in order by one gather
      instead of a sort (the same values: the map from a norm to its F is
      non-decreasing).

  Returns:
    int32 ``[len(errors)]``: positions per width, ascending widths (0 off the hull).
  """
  w = sorted(errors)
  lo_w = w[0]
  if positions * cost_per_position[lo_w] > budget:
    raise ValueError(f"even all {positions} positions at {lo_w} bits cost "
                     f"{positions * cost_per_position[lo_w]} > {budget}")
  hull = hull_widths(errors, cost_per_position)
  if len(hull) == 1:
    return jnp.asarray([positions if x == hull[0] else 0 for x in w], jnp.int32)
  g = jnp.where(valid, _finite_norms(gnorm), 0.0)
  top = jnp.max(g)
  _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
  r = jnp.ldexp(g, -e).astype(jnp.bfloat16).astype(jnp.float32)
  if order is None:
    f = jnp.sort(r * r)[::-1]
  else:  # r * r is non-decreasing in g (>= 0), and 0 where not valid (last in order)
    f = payload_lib.take_in_range(r * r, order)
  f = f.reshape(positions, n)
  position_f = f[:, 0]
  for i in range(1, n):
    position_f = position_f + f[:, i]
  t = [np.float32((cost_per_position[b] - cost_per_position[a]) / (errors[a] - errors[b]))
       for a, b in zip(hull[:-1], hull[1:])]
  step = [int(cost_per_position[b] - cost_per_position[a])
          for a, b in zip(hull[:-1], hull[1:])]
  base = int(positions * cost_per_position[hull[0]])
  limit = int(math.floor(budget)) - base
  if limit >= sum(step) * positions:  # everything at the widest hull width fits
    return jnp.asarray([positions if x == hull[-1] else 0 for x in w], jnp.int32)

  def at_least(lam):  # positions at or above each hull boundary (nested: t increases)
    return [jnp.sum((position_f >= lam * tb).astype(jnp.int32)) for tb in t]

  lo, hi = _switching_multiplier(position_f, t, step, limit)
  c = at_least(hi)
  # Spend what is left on the positions that tie at the switching multiplier:
  # those that take the next width at ``lo`` but not at ``hi`` (a prefix
  # extension of each boundary's count), boundary by boundary in order of
  # gain per bit (lowest t first), as many as fit. Integer arithmetic.
  c_lo = at_least(lo)
  left = jnp.int32(limit) - sum(ci * st for ci, st in zip(c, step))
  for i in np.argsort(np.asarray(t, np.float64), kind="stable"):
    room = c[i - 1] - c[i] if i > 0 else positions - c[i]  # stay nested
    extra = jnp.minimum(jnp.minimum(c_lo[i] - c[i], room), left // step[i])
    extra = jnp.maximum(extra, 0)
    c[i] = c[i] + extra
    left = left - extra * step[i]
  counts = {hull[0]: positions - c[0]}
  for i, x in enumerate(hull[1:]):
    counts[x] = c[i] - (c[i + 1] if i + 1 < len(c) else 0)
  return jnp.stack([jnp.asarray(counts.get(x, 0), jnp.int32) for x in w])


def _largest_below(f, t):
  """Elementwise, the largest float32 ``lam``, zero or normal, with ``fl(lam * t) <= f``
  (``f >= 0`` finite, ``t >= 1`` a float32 constant): ``f / t`` moved one float at a
  time (:func:`_next_up`, :func:`_next_down`) until it is.

  ``fl(lam * t)`` is non-decreasing in ``lam``, so those ``lam`` are ``[0, result]``.
  A correctly rounded quotient is within one step of the result; two steps each
  way leave room for a quotient off by one more (unrolled and elementwise: one
  fusion). Subnormal multipliers are left out: XLA:CPU flushes them to zero and
  XLA:GPU does not, so a product with one would differ between them.
  """
  t = np.float32(t)
  q = f / t
  q = jnp.where(q >= _TINY, q, 0.0)  # +0.0 below the normal range
  for _ in range(2):  # too large: step down
    q = jnp.where(q * t > f, _next_down(q), q)
  for _ in range(2):  # room above: step up
    up = _next_up(q)
    q = jnp.where(up * t <= f, up, q)
  return q


_TINY = np.finfo(np.float32).tiny
"""The least normal float32: the multipliers are 0 or at least this."""


def _next_up(q):
  """The next float32 above ``q >= 0`` among zero and the normal ones."""
  bits = jax.lax.bitcast_convert_type(q, jnp.uint32)
  return jnp.where(q == 0, _TINY, jax.lax.bitcast_convert_type(bits + 1, jnp.float32))


def _next_down(q):
  """The next float32 below ``q > 0`` among zero and the normal ones (0 stays 0)."""
  bits = jax.lax.bitcast_convert_type(q, jnp.uint32)
  down = jax.lax.bitcast_convert_type(jnp.maximum(bits, 1) - 1, jnp.float32)
  return jnp.where(q <= _TINY, 0.0, down)


def _switching_multiplier(position_f, t, step, limit: int):
  """``(lo, hi)`` float32 multipliers: ``hi`` the least (zero or normal) with
  ``cost(hi) <= limit``, ``lo`` the one just below it, over budget.

  ``cost(lam) = sum_b step[b] * #{j: position_f[j] >= fl(lam * t[b])}``. Position j
  stays at or above boundary b exactly while ``lam <= c[j, b]``
  (:func:`_largest_below`), so ``cost(lam)`` is the total weight of the
  candidates ``c >= lam``, and ``lo`` is the largest candidate whose cost is
  over ``limit``; ``hi`` is the next float up. The candidates (floats >= 0, so
  ordered as their bit patterns) are found by weight in two rounds of 16 bits
  (:func:`_largest_over`): integer histograms and suffix sums, no sort and no
  loop. The caller has checked that all candidates together weigh more than
  ``limit``. Exact: what a bisection over the float32 bit patterns finds,
  without its 31 steps.
  """
  cands = jnp.concatenate([_largest_below(position_f, tb) for tb in t])
  weights = jnp.concatenate([jnp.full(position_f.shape, w, jnp.int32) for w in step])
  bits = jax.lax.bitcast_convert_type(cands, jnp.uint32)
  top = (bits >> 16).astype(jnp.int32)  # < 0x7F80: finite, >= 0
  high, above = _largest_over(top, weights, 1 << 15, 0, limit)
  low, _ = _largest_over((bits & 0xFFFF).astype(jnp.int32), jnp.where(top == high, weights, 0),
                         1 << 16, above, limit)
  lo = jax.lax.bitcast_convert_type((high.astype(jnp.uint32) << 16) | low.astype(jnp.uint32),
                                    jnp.float32)
  return lo, _next_up(lo)


def _largest_over(keys, weights, bins: int, base, limit: int):
  """``(k, above)``: the largest key ``k`` with ``base + weight(keys >= k) > limit``, and
  ``base + weight(keys > k)`` (int32 keys in ``[0, bins)``; integer sums: exact)."""
  hist = jnp.zeros((bins,), jnp.int32).at[keys].add(weights, mode="promise_in_bounds")
  at_least = base + jnp.cumsum(hist[::-1])[::-1]  # weight of keys >= each bin
  k = jnp.max(jnp.where(at_least > limit, jnp.arange(bins, dtype=jnp.int32), 0))
  return k, at_least[k] - hist[k]
