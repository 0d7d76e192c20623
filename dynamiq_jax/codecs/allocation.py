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
"""

from __future__ import annotations

import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dynamiq_block as block

__all__ = [
    "level_error",
    "hull_widths",
    "allocate",
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


_TINY = np.finfo(np.float32).tiny
"""The least normal float32: statistics and multipliers are 0 or at least this (XLA:CPU
flushes subnormals and XLA:GPU does not, so a subnormal would differ between them)."""


def statistic(gnorm, valid):
  """Each super-group's F, the key of the allocation: the norm scaled by a power of two
  (exact), rounded to bf16 and squared (exact), 0 for padding and below the normal
  range. float32, ``>= 0``; its bit pattern orders as its value."""
  g = jnp.where(valid, _finite_norms(gnorm), 0.0)
  top = jnp.max(g)
  _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
  r = jnp.ldexp(g, -e).astype(jnp.bfloat16).astype(jnp.float32)
  f = r * r
  return jnp.where(f >= _TINY, f, 0.0)


def _multiplier(k):
  """The float32 multiplier of bit pattern ``k`` (uint32), zero below the normal range:
  non-decreasing in ``k``."""
  return jnp.where(k >= 0x00800000, jax.lax.bitcast_convert_type(k, jnp.float32), 0.0)


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
  w = sorted(errors)
  lo_w = w[0]
  if positions * cost_per_position[lo_w] > budget:
    raise ValueError(f"even all {positions} positions at {lo_w} bits cost "
                     f"{positions * cost_per_position[lo_w]} > {budget}")
  if blocks not in (1, n):
    raise ValueError(f"{blocks=} must be 1 or n={n}")
  total = positions * n
  per = total // blocks
  hull = hull_widths(errors, cost_per_position)
  t = [np.float32((cost_per_position[b] - cost_per_position[a]) / (errors[a] - errors[b]))
       for a, b in zip(hull[:-1], hull[1:])]
  step = [int(cost_per_position[b] - cost_per_position[a]) for a, b in zip(hull[:-1], hull[1:])]
  limit = int(math.floor(budget)) - int(positions * cost_per_position[hull[0]])
  if len(hull) == 1 or limit >= sum(step) * positions:  # one width for every position
    top = hull[0] if len(hull) == 1 else hull[-1]
    counts = jnp.asarray([positions if x == top else 0 for x in w], jnp.int32)
    # one class: slots in index order
    return _place(jnp.broadcast_to(jnp.arange(per, dtype=jnp.int32), (blocks, per)), n,
                  blocks), counts
  f = statistic(gnorm, valid)
  tb = jnp.asarray(t, jnp.float32)[:, None]

  def at_least(lam):  # positions beyond each boundary: [B]
    return _div(jnp.sum((f[None, :] >= lam * tb).astype(jnp.int32), axis=1) + (n - 1), n)

  weights = jnp.asarray(step, jnp.int32)

  def bisect(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = jnp.sum(weights * at_least(_multiplier(mid))) <= limit
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  # cost(0) is over the limit (checked above), cost(inf) = 0 is not
  zero = _zero_like(f)  # (varying over the same mesh axes as the statistics)
  lo, hi = jax.lax.fori_loop(0, 31, bisect, (zero, zero | jnp.uint32(0x7F800000)))
  c_hi, c_lo = at_least(_multiplier(hi)), at_least(_multiplier(lo))
  c = [c_hi[i] for i in range(len(t))]
  left = jnp.int32(limit) - sum(ci * st for ci, st in zip(c, step))
  for i in np.argsort(np.asarray(t, np.float64), kind="stable"):
    room = c[i - 1] - c[i] if i > 0 else positions - c[i]  # stay nested
    extra = jnp.maximum(jnp.minimum(jnp.minimum(c_lo[i] - c[i], room),
                                    _div(jnp.maximum(left, 0), step[i])), 0)
    c[i] = c[i] + extra
    left = left - extra * step[i]
  counts = {hull[0]: positions - c[0]}
  for i, x in enumerate(hull[1:]):
    counts[x] = c[i] - (c[i + 1] if i + 1 < len(c) else 0)
  counts = jnp.stack([jnp.asarray(counts.get(x, 0), jnp.int32) for x in w])
  # members per block beyond each boundary: all n N_b of them, or N_b of each block
  want = jnp.stack(c) * (n if blocks == 1 else 1)  # [B]
  keys = jax.lax.bitcast_convert_type(f, jnp.uint32).reshape(blocks, 1, per)
  return _slots_of(keys, jnp.broadcast_to(want[None, :], (blocks, len(t))), n, blocks), counts


def _zero_like(x):
  """A uint32 zero made from ``x``: a loop's carry must vary over the mesh axes ``x``
  varies over (inside ``shard_map``), as its body's results do."""
  return jax.lax.bitcast_convert_type(jnp.ravel(x)[0] * 0, jnp.uint32) & jnp.uint32(0)


def _div(a, b: int):
  """``a // b`` for ``a >= 0`` (int32) and a positive constant ``b``, as an unsigned
  division (jnp's ``//`` adds the sign corrections of a floor division, XLA's signed
  division by a constant those of truncation)."""
  return jax.lax.div(a.astype(jnp.uint32), jnp.uint32(b)).astype(jnp.int32)


def _largest_first(keys, want):
  """``(above, tie, need)`` of the ``want[k, b]`` largest ``keys[k, 0]`` (uint32; ties:
  lower index first) for each block k and boundary b: with ``v`` the ``want``-th
  largest key (32 bisection steps over its bit patterns), ``above`` / ``tie`` the keys
  above / at ``v``, ``need`` how many of the ties (the first by index) are among them."""

  def bit(i, v):
    cand = v | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
    enough = jnp.sum((keys >= cand[..., None]).astype(jnp.int32), axis=-1) >= want
    return jnp.where(enough, cand, v)

  v = jax.lax.fori_loop(0, 32, bit, jnp.broadcast_to(_zero_like(keys), want.shape))[..., None]
  above = keys > v
  tie = keys == v
  return above, tie, want - jnp.sum(above.astype(jnp.int32), axis=-1)


def _slots_of(keys, want, n: int, blocks: int):
  """Each super-group's slot: the ``want[k, b]`` largest keys of block k (ties: lower
  index first) are beyond boundary b; widest class first, index order within a class.

  One prefix sum, of the keys above each boundary's key and of its ties, gives
  ``P_b(i)``, how many super-groups before i are beyond boundary b (the ties taken
  first by index): a super-group's class is the boundaries it is beyond, its rank in
  its class k is ``P_{k-1}(i) - P_k(i)``, and the classes above k take ``want[k]``
  slots."""
  above, tie, need = _largest_first(keys, want)  # [blocks, B, per] x 2, [blocks, B]
  bounds, per = above.shape[1], keys.shape[-1]
  flags = jnp.concatenate([above, tie], axis=1).astype(jnp.int32)
  before = jnp.cumsum(flags, axis=-1) - flags  # exclusive prefix counts
  tie_before = before[:, bounds:]
  prefix = before[:, :bounds] + jnp.minimum(tie_before, need[..., None])  # P_b(i)
  beyond = above | (tie & (tie_before < need[..., None]))
  cls = jnp.sum(beyond.astype(jnp.int32), axis=1)  # [blocks, per]
  index = jnp.broadcast_to(jnp.arange(per, dtype=jnp.int32), (blocks, 1, per))
  zero = jnp.zeros((blocks, 1, per), jnp.int32)
  p = jnp.concatenate([index, prefix, zero], axis=1)  # P_{-1} .. P_B: [blocks, B + 2, per]
  slots_above = jnp.concatenate([want, jnp.zeros((blocks, 1), jnp.int32)], axis=1)[..., None]
  # class k: slots_above[k] + P_{k-1} - P_k, picked by a one-hot sum (no gather)
  onehot = cls[:, None, :] == jnp.arange(bounds + 1, dtype=jnp.int32)[None, :, None]
  local = jnp.sum(jnp.where(onehot, slots_above + p[:, :-1] - p[:, 1:], 0), axis=1)
  return _place(local, n, blocks)


def _place(local, n: int, blocks: int):
  """Slots from each block's local positions ``local`` [blocks, per]: block k's
  position j is slot ``j n + k`` (blocks = n), or the position itself (blocks = 1)."""
  if blocks == 1:
    return local.reshape(-1)
  return (local * n + jnp.arange(blocks, dtype=jnp.int32)[:, None]).reshape(-1)
