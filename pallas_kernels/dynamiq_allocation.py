"""DynamiQ's allocation (which slot each super-group takes) as one Pallas Triton kernel.

:func:`plan` is what a bucket calls: from the global super-group norms
``gnorm`` float32 ``[total]`` and the static :class:`Rule`, each
super-group's slot ``dest``, the inverse permutation in chunk order
(``order_t`` ``[n, positions]``: chunk c's position j holds super-group
``order_t[c, j]``), the width of each position, and the positions per
width. One launch of :func:`plan_pallas` in a GPU lowering, the jnp
reference :func:`plan_reference` elsewhere (the product path on CPU), by
:func:`pallas_kernels.dispatch.dispatch`.

Algorithm (the rule itself: :mod:`dynamiq_jax.codecs.allocation`), the same
steps in kernel and reference, sharing their arithmetic
(:func:`statistic`, :func:`multiplier`, :func:`fix_up`,
:func:`class_counts`), so that the two agree bit for bit:

1. F, each super-group's statistic: the norm scaled by the largest one's
   power of two, rounded to bf16 and squared;
2. the least multiplier ``lam`` whose widths fit the budget: 31 bisection
   steps over its float32 bit patterns, each counting ``#{F >= lam t_b}``
   for every hull boundary b; then the fix-up of what the budget has left;
3. each boundary's key, the ``want_b``-th largest F of the block (32
   bisection steps over its bit patterns), and how many of its ties are in;
4. one exclusive prefix count of the keys above each boundary's key and of
   its ties: a super-group's class and its rank in its class, hence its slot.

Memory layout of the kernel: ``blocks`` programs (1 for an all-reduce, n for
a reduce-scatter, whose chunk c ranks its own ``positions`` super-groups);
every operand stays in global memory (``memory_space=ANY``) and each program
loops (``lax.fori_loop``) over tiles of :data:`TILE` super-groups, loading
the norms at computed offsets and recomputing F from them on every pass
(nothing but the norms is read: ~70 passes over 4 bytes a super-group).
Steps 1 and 2 read all ``total`` norms in every program (they are global),
steps 3 and 4 the program's own block. The prefix count of step 4 is
``cumsum`` within a tile plus a running count carried across tiles (one
``cumsum`` per boundary: its two counts, above and tied, packed 16 bits each). Program
k writes ``dest`` and ``order_t`` of its block (``order_t`` by a scatter
store: a slot's position), and program 0 the position widths and counts.

Compiled for sm_90a from a CPU host (tests/test_allocation_kernel.py): 161 and 139
registers (all-reduce and reduce-scatter) on jax 0.10.2, 135 and 141 on jax 0.12, no
spills. Its run time on a GPU
is not measured yet (no GPU here): a single program per block that makes
~70 dependent passes over the norms is latency-bound: an estimate (not a
measurement) puts it at milliseconds at 2^25 coordinates, not microseconds;
``test_kernel_on_gpu_equals_reference`` records it where a GPU runs the tests.
A radix select (a few histogram passes instead of the 63 bisection passes)
is the next step if it matters.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import triton_ops as tt

__all__ = [
    "TILE",
    "NUM_WARPS",
    "Rule",
    "statistic",
    "multiplier",
    "allocate_reference",
    "plan_reference",
    "plan_pallas",
    "plan",
]

TILE = 1024
"""Super-groups per tile of the kernel's loops: 8 per thread with :data:`NUM_WARPS` warps."""

NUM_WARPS = 4
"""Warps per program."""

_COUNTS = 16  # entries of the kernel's counts output (a power of two >= the widths)

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


def _check(gnorm, real: int, rule: Rule, column: int | None = None):
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
  _check(gnorm, real, rule, column)
  if column is not None:
    gnorm = gnorm[:, column]
  valid = jnp.arange(rule.total) < real
  dest, counts = allocate_reference(gnorm, valid, rule)
  order_t = inverse(dest).reshape(rule.positions, rule.n).T  # slot j n + c: chunk c's j
  widths = R.position_widths(counts, rule.widths, rule.positions)
  if planes is None:
    return dest, order_t, widths, counts
  return dest, order_t, widths, counts, _plane_table(list(counts), rule, planes)


def _plane_table(counts, rule: Rule, planes: tuple[int, int]):
  """The hops' plane table (int32 [16]) of the counts per width (``counts``, in
  ``rule.widths`` order): :func:`~pallas_kernels.dynamiq_reference.plane_table_of_counts`
  with ``planes = (plane_bits, units)``."""
  plane_bits, units = planes
  return R.plane_table_of_counts(counts, rule.widths, plane_bits, units,
                                 jnp.arange(_COUNTS, dtype=jnp.int32))


# ----------------------------------------------------------------------------
# The kernel.


def _store(ref, size: int, offsets, values, ok):
  """Stores ``values`` at ``offsets`` of the flat ``ref`` of ``size`` entries where ``ok``.
  Lanes not ``ok`` point past the end: a GPU skips them, and interpret mode's masked
  store (a read-modify-write scatter) drops them instead of racing a lane that stores."""
  tt.store(ref, jnp.where(ok, offsets, size), values, ok)


def _plan_kernel(g_ref, dest_ref, order_ref, widths_ref, counts_ref, *ptab_ref, rule: Rule,
                 real: int, tile: int, planes: tuple[int, int] | None = None,
                 stride: int = 1, column: int = 0):
  """Program k: the allocation of block k (module docstring); with ``planes``, program 0
  also stores the hops' plane table (:func:`_plane_table`). The norm of super-group i is
  entry ``i stride + column`` of ``g_ref`` (a column of the statistics, read in place)."""
  k = pl.program_id(0)
  total, per, n, positions = rule.total, rule.per, rule.n, rule.positions
  bounds = len(rule.t)
  lanes = jnp.arange(tile, dtype=jnp.int32)

  def norms(idx, ok):  # masked norms at global indices idx (ok: in range)
    g = tt.load(g_ref, jnp.where(ok, idx, 0) * stride + column, ok)
    return masked_norms(g, idx < real)

  def over(count: int, body, init):
    return jax.lax.fori_loop(0, pl.cdiv(count, tile), body, init)

  def top_of(i, m):
    idx = i * tile + lanes
    ok = idx < total
    return jnp.maximum(m, jnp.max(jnp.where(ok, norms(idx, ok), -jnp.inf)))

  base = k * per
  if rule.one_class:
    want, above_v, need = (), (), ()
    top = jnp.float32(0)
  else:
    top = over(total, top_of, jnp.float32(-jnp.inf))

    def f_at(idx, ok):
      return scaled_statistic(norms(idx, ok), top)

    def at_least(lam):  # positions beyond each boundary, over all super-groups
      def body(i, acc):
        idx = i * tile + lanes
        ok = idx < total
        f = f_at(idx, ok)
        return tuple(a + jnp.sum(((f >= lam * np.float32(t)) & ok).astype(jnp.int32))
                     for a, t in zip(acc, rule.t))

      counts = over(total, body, (jnp.int32(0),) * bounds)
      return [udiv(c + (n - 1), n) for c in counts]

    def bisect(_, lohi):
      lo, hi = lohi
      mid = lo + (hi - lo) // 2
      cost = sum(c * st for c, st in zip(at_least(multiplier(mid)), rule.step))
      ok = cost <= rule.limit
      return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 31, bisect, (jnp.uint32(0), jnp.uint32(0x7F800000)))
    c = fix_up(at_least(multiplier(hi)), at_least(multiplier(lo)), rule)
    counts_list = class_counts(c, rule)
    want = [ci * (n if rule.blocks == 1 else 1) for ci in c]

    def keys_at(j):  # this block's j-th tile: keys, in the block, global indices
      local = j * tile + lanes
      ok = local < per
      idx = base + local
      return jax.lax.bitcast_convert_type(f_at(idx, ok), jnp.uint32), ok, local, idx

    def bit(i, v):
      shift = jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32))
      cand = tuple(vb | shift for vb in v)

      def body(j, acc):
        key, ok, _, _ = keys_at(j)
        return tuple(a + jnp.sum(((key >= cb) & ok).astype(jnp.int32))
                     for a, cb in zip(acc, cand))

      cnt = over(per, body, (jnp.int32(0),) * bounds)
      return tuple(jnp.where(cn >= w, cb, vb) for cn, w, cb, vb in zip(cnt, want, cand, v))

    above_v = jax.lax.fori_loop(0, 32, bit, (jnp.uint32(0),) * bounds)

    def above_count(j, acc):
      key, ok, _, _ = keys_at(j)
      return tuple(a + jnp.sum(((key > v) & ok).astype(jnp.int32)) for a, v in zip(acc, above_v))

    n_above = over(per, above_count, (jnp.int32(0),) * bounds)
    need = [w - a for w, a in zip(want, n_above)]

  if rule.one_class:
    counts_list = [jnp.int32(positions if x == rule.top_width else 0) for x in rule.widths]

  def slots(j, carry):
    if rule.one_class:
      local = j * tile + lanes
      ok = local < per
      idx = base + local
      slot = local
    else:
      key, ok, local, idx = keys_at(j)
      above_before, tie_before = carry
      cls = jnp.zeros((tile,), jnp.int32)
      prefix = []
      new_a, new_t = [], []
      for b in range(bounds):
        a = ((key > above_v[b]) & ok).astype(jnp.int32)
        t = ((key == above_v[b]) & ok).astype(jnp.int32)
        # both counts in one scan: a in the low 16 bits, t in the high ones (a count
        # within a tile is at most tile <= 2^14: no field carries into the next): the
        # scans are most of the kernel's compile time (tools/kernel_compile_cpu.py)
        both = a | (t << 16)
        before = jnp.cumsum(both) - both
        a_before = above_before[b] + (before & 0xFFFF)
        t_before = tie_before[b] + (before >> 16)
        prefix.append(a_before + jnp.minimum(t_before, need[b]))
        cls = cls + (a | (t & (t_before < need[b]).astype(jnp.int32)))
        new_a.append(above_before[b] + jnp.sum(a))
        new_t.append(tie_before[b] + jnp.sum(t))
      carry = (tuple(new_a), tuple(new_t))
      p = [local] + prefix + [jnp.zeros_like(local)]
      slots_above = list(want) + [0]
      slot = jnp.zeros_like(local)
      for cl in range(bounds + 1):
        slot = jnp.where(cls == cl, slots_above[cl] + p[cl] - p[cl + 1], slot)
    if rule.blocks == 1:
      dest = slot
      where = udiv(slot, n) + (slot - udiv(slot, n) * n) * positions  # chunk c, position j
    else:
      dest = slot * n + k
      where = k * positions + slot
    _store(dest_ref, total, idx, dest, ok)
    _store(order_ref, total, where, idx, ok)
    return carry

  zeros = (jnp.int32(0),) * bounds
  over(per, slots, (zeros, zeros))

  first = k == 0
  ws = sorted(rule.widths, reverse=True)

  def widths_tile(j, _):
    pos = j * tile + lanes
    out = jnp.full((tile,), ws[-1], jnp.int32)
    end = jnp.int32(0)
    for i, w in zip(range(len(ws) - 1, -1, -1), ws):  # widest first
      start, end = end, end + counts_list[i]
      out = jnp.where((pos >= start) & (pos < end), w, out)
    ok = (pos < positions) & first
    _store(widths_ref, positions, pos, out, ok)
    return _

  over(positions, widths_tile, jnp.int32(0))
  slot_i = jnp.arange(_COUNTS, dtype=jnp.int32)
  vec = jnp.zeros((_COUNTS,), jnp.int32)
  for i, cnt in enumerate(counts_list):
    vec = jnp.where(slot_i == i, cnt, vec)
  ok = (slot_i < len(rule.widths)) & first
  _store(counts_ref, _COUNTS, slot_i, vec, ok)
  if planes is not None:
    _store(ptab_ref[0], _COUNTS, slot_i, _plane_table(counts_list, rule, planes),
           (slot_i < _COUNTS) & first)  # every entry, by program 0


@functools.partial(jax.jit, static_argnames=("real", "rule", "tile", "interpret", "planes",
                                             "column"))
def _launch(gnorm, *, real: int, rule: Rule, tile: int, interpret: bool, planes=None,
            column=None):
  total, positions = rule.total, rule.positions
  out_shape = [jax.ShapeDtypeStruct((total,), jnp.int32),
               jax.ShapeDtypeStruct((total,), jnp.int32),
               jax.ShapeDtypeStruct((positions,), jnp.int32),
               jax.ShapeDtypeStruct((_COUNTS,), jnp.int32)]
  if planes is not None:
    out_shape.append(jax.ShapeDtypeStruct((_COUNTS,), jnp.int32))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltr
    params = pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
  dest, order, widths, counts, *ptab = pl.pallas_call(
      functools.partial(_plan_kernel, rule=rule, real=real, tile=tile, planes=planes,
                        stride=1 if column is None else gnorm.shape[1], column=column or 0),
      out_shape=[D.typed_like(s, [gnorm]) for s in out_shape], grid=(rule.blocks,),
      in_specs=[anywhere], out_specs=[anywhere] * len(out_shape), compiler_params=params,
      interpret=interpret, name=f"dynamiq_allocate_b{rule.blocks}")(gnorm.reshape(-1))
  return (dest, order.reshape(rule.n, positions), widths, counts[:len(rule.widths)], *ptab)


def plan_pallas(gnorm, *, real: int, rule: Rule, tile: int | None = None,
                interpret: bool = False, planes: tuple[int, int] | None = None,
                column: int | None = None):
  """``(dest, order_t, widths, counts[, ptab])`` of :func:`plan` in one Pallas Triton launch
  of ``rule.blocks`` programs, mapped over a ``vmap`` batch."""
  _check(gnorm, real, rule, column)
  tile = TILE if tile is None else int(tile)
  if tile < 32 or tile > 2**14 or tile & (tile - 1):
    raise ValueError(f"tile={tile} must be a power of two in [32, 2^14] (the slots' counts "
                     "of a tile share one 32-bit scan, 16 bits each)")
  if len(rule.widths) > _COUNTS:
    raise NotImplementedError(f"{len(rule.widths)} widths (the kernel counts {_COUNTS})")
  if not interpret:
    from pallas_kernels import dynamiq_triton  # pylint: disable=import-outside-toplevel
    warnings.filterwarnings("ignore", message=dynamiq_triton.TRITON_DEPRECATION,
                            category=DeprecationWarning)
  launch = functools.partial(_launch, real=int(real), rule=rule, tile=tile,
                             interpret=bool(interpret), planes=_planes(planes), column=column)
  g = jnp.asarray(gnorm)
  if g.dtype not in (jnp.float32, jnp.bfloat16):  # (read as they are: no copy converts them)
    g = g.astype(jnp.float32)
  return D.map_over_batch(launch, g)


def _planes(planes):
  """``planes`` checked: None, or ``(plane_bits, units)`` as two ints."""
  if planes is None:
    return None
  plane_bits, units = (int(v) for v in planes)
  if plane_bits not in (1, 2) or units < 0:
    raise ValueError(f"planes={planes}: give (plane_bits in (1, 2), units >= 0)")
  return plane_bits, units


def plan(gnorm, *, real: int, rule: Rule, planes: tuple[int, int] | None = None,
         column: int | None = None, implementation: D.Implementation = None,
         interpret: bool | None = None):
  """Each super-group's slot, the chunks' super-groups, and the widths of the positions.

  Args:
    gnorm: float32 or bfloat16 ``[rule.total]``: the global super-group norms (>= 0);
      with ``column``, ``[rule.total, k]`` statistics whose column ``column`` holds them
      (read in place: no slice of them is made).
    real: super-groups that are not padding (the first ``real``; static).
    rule: the static :class:`Rule`.
    planes: ``(plane_bits, units)`` of the chunks' payloads, or None: with them, the
      hops' plane table (int32 [16],
      :func:`~pallas_kernels.dynamiq_reference.plane_table_of_counts` of the counts)
      comes fifth, made by the same launch.
    implementation: None (the Triton kernel in a GPU lowering, else the reference),
      ``"pallas"`` or ``"xla"`` (:func:`pallas_kernels.dispatch.dispatch`); ``"mosaic"``
      (the hops' Mosaic GPU kernels) is None here.
    interpret: overrides the kernel's interpret mode.

  Returns:
    ``(dest, order_t, widths, counts)``: int32 ``[total]``, the slot of each
    super-group (slot ``j n + c``: chunk c, position j); int32 ``[n, positions]``,
    the super-group at chunk c's position j; int32 ``[positions]``, the width of each
    position (widest first); int32 ``[len(rule.widths)]``, positions per width
    (ascending widths); with ``planes``, the plane table.
  """
  if implementation == "mosaic":  # no Mosaic GPU kernel of its own: Triton's where it is
    implementation = None
  return D.dispatch("allocate", D.Kernels(plan_pallas), plan_reference, implementation,
                    interpret, gnorm, real=int(real), rule=rule, planes=_planes(planes),
                    column=None if column is None else int(column))
