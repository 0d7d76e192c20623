"""DynamiQ's allocation: its rule, the arithmetic kernel and reference share, and the reference.

:class:`Rule` (the static description of a bucket's allocation), the shared
steps (:func:`statistic`, :func:`multiplier`, :func:`fix_up`,
:func:`class_counts`) and :func:`plan_reference`, the jnp reference that is
the product path off GPU. :mod:`pallas_kernels.dynamiq_allocation` holds the
Pallas Triton kernel that computes the same bits and the dispatch between the
two; its module docstring gives the algorithm.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dynamiq_reference as R

__all__ = ["COUNTS", "Rule", "finite_norms", "masked_norms", "scaled_statistic",
           "statistic", "multiplier", "udiv", "fix_up", "class_counts", "allocate_reference",
           "inverse", "check", "plan_reference", "plane_table"]


COUNTS = 16  # entries of the kernel's counts output (a power of two >= the widths)

_TINY = np.finfo(np.float32).tiny
"""The least normal float32: statistics and multipliers are 0 or at least this (XLA:CPU
flushes subnormals and XLA:GPU does not, so a subnormal would differ between them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """The allocation's static data (hashable: a jit static argument).

  Attributes:
    widths: every width of the codec, ascending.
    hull: the widths on the lower convex hull of (cost, error), ascending.
    t: per hull boundary ``hull[b] | hull[b + 1]``, the threshold ``t_b`` (a
      float32 value, as a Python float): F is worth the wider width iff
      ``F >= lam t_b``.
    step: per boundary, the bits one position more beyond it costs.
    limit: the budget's bits beyond every position at ``hull[0]``.
    positions: positions per chunk.
    n: chunks (super-groups per position).
    blocks: 1 (one ranking of all super-groups) or ``n`` (chunk c ranks its own).
  """

  widths: tuple[int, ...]
  hull: tuple[int, ...]
  t: tuple[float, ...]
  step: tuple[int, ...]
  limit: int
  positions: int
  n: int
  blocks: int

  @property
  def total(self) -> int:
    return self.positions * self.n

  @property
  def per(self) -> int:
    """Super-groups per block."""
    return self.total // self.blocks

  @property
  def one_class(self) -> bool:
    """Whether every position takes one width (the widest the budget pays for all)."""
    return len(self.hull) == 1 or self.limit >= sum(self.step) * self.positions

  @property
  def top_width(self) -> int:
    """The width of every position when :attr:`one_class`."""
    return self.hull[-1]


# ----------------------------------------------------------------------------
# The arithmetic that kernel and reference share.


def finite_norms(gnorm):
  """float32 norms with non-finite ones (never produced by the guarded all-reduce)
  as the largest float."""
  g = jnp.asarray(gnorm, jnp.float32)
  return jnp.where(jnp.isfinite(g), g, jnp.finfo(jnp.float32).max)


def masked_norms(gnorm, valid):
  """The norms that enter the statistic: finite, 0 where not ``valid`` (padding)."""
  return jnp.where(valid, finite_norms(gnorm), 0.0)


def scaled_statistic(g, top):
  """F of masked norms ``g`` given their largest, ``top``: ``g`` scaled by ``top``'s power
  of two (exact), rounded to bf16 and squared (exact), 0 below the normal range."""
  _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
  r = jnp.ldexp(g, -e).astype(jnp.bfloat16).astype(jnp.float32)
  f = r * r
  return jnp.where(f >= _TINY, f, 0.0)


def statistic(gnorm, valid):
  """Each super-group's F, the key of the allocation (:func:`scaled_statistic`).
  float32, ``>= 0``; its bit pattern orders as its value."""
  g = masked_norms(gnorm, valid)
  return scaled_statistic(g, jnp.max(g))


def multiplier(k):
  """The float32 multiplier of bit pattern ``k`` (uint32), zero below the normal range:
  non-decreasing in ``k``."""
  return jnp.where(k >= 0x00800000, jax.lax.bitcast_convert_type(k, jnp.float32), 0.0)


def udiv(a, b: int):
  """``a // b`` for ``a >= 0`` (int32) and a positive constant ``b``, as an unsigned
  division (jnp's ``//`` adds the sign corrections of a floor division, XLA's signed
  division by a constant those of truncation)."""
  return jax.lax.div(a.astype(jnp.uint32), jnp.uint32(b)).astype(jnp.int32)


def fix_up(c_hi, c_lo, rule: Rule):
  """Positions beyond each boundary (a list of int32 scalars) from those at the least
  multiplier that fits, ``c_hi``, and at the greatest that does not, ``c_lo``: what the
  budget has left goes to the positions that switch between them, boundary by boundary
  in order of gain per bit, staying nested."""
  c = list(c_hi)
  left = jnp.int32(rule.limit) - sum(ci * st for ci, st in zip(c, rule.step))
  for i in np.argsort(np.asarray(rule.t, np.float64), kind="stable"):
    room = c[i - 1] - c[i] if i > 0 else rule.positions - c[i]  # stay nested
    extra = jnp.maximum(jnp.minimum(jnp.minimum(c_lo[i] - c[i], room),
                                    udiv(jnp.maximum(left, 0), rule.step[i])), 0)
    c[i] = c[i] + extra
    left = left - extra * rule.step[i]
  return c


def class_counts(c, rule: Rule):
  """Positions per width (a list of int32 scalars, ascending widths; 0 off the hull)
  from the positions beyond each boundary ``c``."""
  counts = {rule.hull[0]: rule.positions - c[0]}
  for i, x in enumerate(rule.hull[1:]):
    counts[x] = c[i] - (c[i + 1] if i + 1 < len(c) else 0)
  return [jnp.asarray(counts.get(x, 0), jnp.int32) for x in rule.widths]


# ----------------------------------------------------------------------------
# The reference (jnp): the product path off GPU.


def _zero_like(x):
  """A uint32 zero made from ``x``: a loop's carry must vary over the mesh axes ``x``
  varies over (inside ``shard_map``), as its body's results do."""
  return jax.lax.bitcast_convert_type(jnp.ravel(x)[0] * 0, jnp.uint32) & jnp.uint32(0)


def allocate_reference(gnorm, valid, rule: Rule):
  """``(dest, counts)``: each super-group's slot (int32 ``[total]``; slot ``j n + c``:
  chunk c, position j, positions widest first) and positions per width (int32
  ``[len(rule.widths)]``, ascending widths), by the rule of
  :func:`dynamiq_jax.codecs.allocation.allocate`.

  Args:
    gnorm: float32 ``[total]`` global super-group norms (>= 0).
    valid: bool ``[total]``: real super-groups (padding: F = 0).
    rule: the static :class:`Rule`.
  """
  n, blocks, per, positions = rule.n, rule.blocks, rule.per, rule.positions
  if rule.one_class:
    counts = jnp.asarray([positions if x == rule.top_width else 0 for x in rule.widths],
                         jnp.int32)
    # one class: slots in index order
    return _place(jnp.broadcast_to(jnp.arange(per, dtype=jnp.int32), (blocks, per)), n,
                  blocks), counts
  f = statistic(gnorm, valid)
  tb = jnp.asarray(rule.t, jnp.float32)[:, None]

  def at_least(lam):  # positions beyond each boundary: [B]
    return udiv(jnp.sum((f[None, :] >= lam * tb).astype(jnp.int32), axis=1) + (n - 1), n)

  weights = jnp.asarray(rule.step, jnp.int32)

  def bisect(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = jnp.sum(weights * at_least(multiplier(mid))) <= rule.limit
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  # cost(0) is over the limit (checked when the rule is made), cost(inf) = 0 is not
  zero = _zero_like(f)  # (varying over the same mesh axes as the statistics)
  lo, hi = jax.lax.fori_loop(0, 31, bisect, (zero, zero | jnp.uint32(0x7F800000)))
  c_hi, c_lo = at_least(multiplier(hi)), at_least(multiplier(lo))
  bounds = len(rule.t)
  c = fix_up([c_hi[i] for i in range(bounds)], [c_lo[i] for i in range(bounds)], rule)
  counts = jnp.stack(class_counts(c, rule))
  # members per block beyond each boundary: all n N_b of them, or N_b of each block
  want = jnp.stack(c) * (n if blocks == 1 else 1)  # [B]
  keys = jax.lax.bitcast_convert_type(f, jnp.uint32).reshape(blocks, 1, per)
  return _slots_of(keys, jnp.broadcast_to(want[None, :], (blocks, bounds)), n, blocks), counts


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


def inverse(dest):
  """The inverse of the permutation ``dest`` (``argsort(dest)``), by one scatter
  instead of a sort."""
  pos = jnp.arange(dest.shape[0], dtype=dest.dtype)
  return jnp.zeros_like(dest).at[dest.astype(jnp.uint32)].set(
      pos, mode="promise_in_bounds", unique_indices=True)


def check(gnorm, real: int, rule: Rule, column: int | None = None):
  if not isinstance(rule, Rule):
    raise TypeError(f"rule={rule!r} must be a pallas_kernels.dynamiq_allocation.Rule "
                    "(dynamiq_jax.codecs.allocation.rule makes one)")
  shape = jnp.shape(gnorm)
  if column is None and shape != (rule.total,):
    raise ValueError(f"gnorm.shape={shape} must be ({rule.total},): "
                     f"positions={rule.positions} x n={rule.n} super-groups")
  if column is not None and (len(shape) != 2 or shape[0] != rule.total
                             or not 0 <= column < shape[1]):
    raise ValueError(f"gnorm.shape={shape} with column={column}: give ({rule.total}, k) "
                     f"statistics, the norms in column 0 <= column < k")
  if not 0 <= real <= rule.total:
    raise ValueError(f"real={real} must be in [0, {rule.total}] (the super-groups that "
                     "are not padding come first)")


def plan_reference(gnorm, *, real: int, rule: Rule, planes: tuple[int, int] | None = None,
                   column: int | None = None):
  """``(dest, order_t, widths, counts[, ptab])`` of :func:`plan`, in jnp."""
  check(gnorm, real, rule, column)
  if column is not None:
    gnorm = gnorm[:, column]
  valid = jnp.arange(rule.total) < real
  dest, counts = allocate_reference(gnorm, valid, rule)
  order_t = inverse(dest).reshape(rule.positions, rule.n).T  # slot j n + c: chunk c's j
  widths = R.position_widths(counts, rule.widths, rule.positions)
  if planes is None:
    return dest, order_t, widths, counts
  return dest, order_t, widths, counts, plane_table(list(counts), rule, planes)


def plane_table(counts, rule: Rule, planes: tuple[int, int]):
  """The hops' plane table (int32 [16]) of the counts per width (``counts``, in
  ``rule.widths`` order): :func:`~pallas_kernels.dynamiq_reference.plane_table_of_counts`
  with ``planes = (plane_bits, units)``."""
  plane_bits, units = planes
  return R.plane_table_of_counts(counts, rule.widths, plane_bits, units,
                                 jnp.arange(COUNTS, dtype=jnp.int32))
