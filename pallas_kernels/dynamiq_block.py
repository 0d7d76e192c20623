"""DynamiQ's block arithmetic: levels, scales, draws and rounding of a block of super-groups.

The level tables are :mod:`pallas_kernels.dynamiq_levels`' (re-exported here).
One function of arrays, shared by the Pallas kernels and the pure-jnp
reference, so that on the same inputs they give the same bits: the kernels
(:mod:`pallas_kernels.dynamiq_triton`) and the reference
(:mod:`pallas_kernels.dynamiq_reference`) differ only in how they move bytes
and in the instructions of :class:`BlockOps` (each an exact twin of the
reference's, or an approximation used only for a first guess). Nothing here
knows a backend.

The format (the paper's §3.3), per *super-group* of 256 consecutive
coordinates at its own code width ``w`` in ``width_set`` (a subset of 2..8):

* Symmetric MEE levels ``±lam[l]``, ``l = 0..R``, ``R = 2**(w-1) - 1``:
  ``lam[l] = ((1 + 2 eps^2)^l - 1) / ((1 + 2 eps^2)^R - 1)`` (top level 1),
  each rounded to bfloat16 once, so that a decoded value ``lam * k * V`` (8
  x 8 x 8 significant bits) is exact in float32 and no compiler contraction
  into a fused multiply-add can change it. Level -l is code ``R - l``,
  level l is code ``R + 1 + l``: all ``2**w`` codes are used.
* Hierarchical scales: 16 scale groups of 16 coordinates. ``V`` is the
  bfloat16 *super-group scale*, rounded up from ``max|x| / 255``; each group
  has a uint8 ``k``, and its decoded scale is ``k V``. ``scale_rounding="up"``
  (the authors' kernel) takes ``k = ceil(gmax / V)`` and normalises by the
  decoded scale, so no element is clamped; ``"stochastic"`` (the paper's
  text) normalises by the group max rounded up to bf16 and rounds ``k``
  stochastically so that ``E[k V]`` equals it. Both are unbiased.
* Element rounding is unbiased in the value domain, in the *signed* lattice:
  the value goes to the level above (towards +inf) iff ``u < p``, ``p`` its
  distance from the level below over the gap, so a negative value is rounded
  by ``1 - u`` in magnitude. ``u`` comes from :mod:`pallas_kernels.rng`: with
  ``strata = n > 1`` it is the correlated (stratified) draw ``(pi(rank) +
  gamma) / q`` with the permutation ``pi`` shared by all ranks and ``gamma``
  private (:func:`pallas_kernels.rng.stratum`). ``gamma`` has 16 bits; one
  hash per key and group of 16 coordinates feeds its 16 draws
  (:func:`pallas_kernels.rng.uniforms`), each exactly uniform on its grid.
* The rounding is division-free and exact (:func:`round_levels`): the level
  bracket is found with exact products ``lam_j s``, the decision compares
  exact products too, and only a first guess uses a log or a division.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bf16
from pallas_kernels import rng
from pallas_kernels.block_ops import REFERENCE_OPS, BlockOps, ref_fma, ref_max_last
from pallas_kernels.dynamiq_levels import GUESS_OFFSET, LATTICE, LevelTables, eps_for
from pallas_kernels.dynamiq_levels import LATTICE_Y0, ROUND_Y0, lattice_table, level_key
from pallas_kernels.dynamiq_levels import level_table, level_tables

__all__ = [
    "SUPERGROUP", "GROUP", "GUESS_OFFSET", "level_table", "eps_for", "LevelTables",
    "level_tables", "level_key", "LATTICE", "lattice_table", "BlockOps", "REFERENCE_OPS",
    "sign_mask", "ceil_quotient", "stochastic_k",
    "floor_quotient", "scales", "decoded_scale", "WidthConsts", "round_levels", "encode_block",
    "decode_block", "trailing", "reduce_trailing", "sum_last", "group_max",
]

SUPERGROUP = 256
"""Coordinates per super-group: one code width, one super-group scale."""
GROUP = 16
"""Coordinates per scale group (one uint8 ``k``)."""
K_MAX = 255  # largest group multiplier k


def trailing(v, ndim: int):
  """``v`` with unit axes appended up to ``ndim`` (broadcasts against a block)."""
  return v[(...,) + (None,) * (ndim - v.ndim)]


def reduce_trailing(v, ndim: int, last):
  """``v`` reduced by ``last`` (a reduction of the last axis) until it has ``ndim`` axes,
  one axis at a time (a Triton reduction takes one)."""
  while v.ndim > ndim:
    v = last(v)
  return v


def sum_last(v):
  """The sum over the last axis (:func:`reduce_trailing`'s ``last`` for sums)."""
  return jnp.sum(v, axis=-1)


# ----------------------------------------------------------------------------
# Signs.


def sign_mask(x):
  """int32 -1 where ``x`` has its sign bit set (negative values, -0.0), else 0."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 31


# ----------------------------------------------------------------------------
# Scales.


def _recip_up(c: float) -> np.float32:
  """float32 reciprocal of c, rounded up."""
  r = np.float32(1.0 / c)
  return r if float(r) * c >= 1.0 else np.nextafter(r, np.float32(np.inf))


def ceil_div_bf16(v, c: float):
  """Smallest bf16-exact w >= v / c (c a small integer constant), without division."""
  w = bf16.ceil(v * _recip_up(c))
  return jnp.where(w * np.float32(c) < v, bf16.next_up(w), w)  # exact product


def _guess_operands(v, d, div):
  """``(v, d, div)`` for a quotient guess: with an approximate ``div`` a ``d``
  below 2^-64 and its ``v`` are scaled by 2^64 first (exact; the quotients
  here are at most about 255, so ``v`` stays finite)."""
  if div is None:
    return v, d, jnp.divide
  f = jnp.where(d < np.float32(2.0**-64), np.float32(2.0**64), np.float32(1.0))
  return v * f, d * f, div


def ceil_quotient(v, d, kmax, div=None, ceil=jnp.ceil):
  """ceil(v / d) clipped to [0, kmax], for d with <= 16 significant bits; exact
  (``div``: any division within a few ulp, for the first guess only; ``ceil``:
  an exact ``jnp.ceil`` for a backend without one)."""
  gv, gd, div = _guess_operands(v, d, div)
  k = jnp.clip(ceil(div(gv, jnp.where(gd > 0, gd, 1.0))), 0, kmax)  # guess
  k = jnp.where((k > 0) & ((k - 1) * d >= v), k - 1, k)  # exact products
  return jnp.where((k < kmax) & (k * d < v), k + 1, k)


def floor_quotient(v, d, kmax, div=None, floor=jnp.floor):
  """floor(v / d) clipped to [0, kmax], for d with <= 16 significant bits; exact
  (``div`` and ``floor`` as for :func:`ceil_quotient`)."""
  gv, gd, div = _guess_operands(v, d, div)
  k = jnp.clip(floor(div(gv, jnp.where(gd > 0, gd, 1.0))), 0, kmax)  # guess
  k = jnp.where((k > 0) & (k * d > v), k - 1, k)
  return jnp.where((k < kmax) & ((k + 1) * d <= v), k + 1, k)


def scales(gmax, scale_rounding: str, keys, group_idx, div=None):
  """The group maxima ``gmax`` [S, G] (of ``|x|``; or [S, G', ...]: groups along several
  axes) -> (k f32 [S, G], super-group scale f32 [S], element scale s [S, G]).

  ``"up"``: ``k = ceil(gmax / V)``; elements are normalised by the decoded
  scale ``s = k V`` (so ``a <= s``). ``"stochastic"``: the group max rounded
  up to bf16, ``g``, normalises the elements and ``k`` is rounded
  stochastically with ``E[k V] = g`` (its draw: :data:`~pallas_kernels.rng.Stream.DYNAMIQ_SCALE`
  at ``group_idx``). Both unbiased. ``div``: an approximate division for the
  quotients' first guesses (the same results).
  """
  top = np.float32(1.0)
  sg = lambda v: trailing(v, gmax.ndim)
  if scale_rounding == "up":
    sg_scale = ceil_div_bf16(_supergroup_max(gmax), float(top) * K_MAX)
    k = ceil_quotient(gmax, sg(sg_scale) * top, K_MAX, div)  # (the product exact)
    s = k * sg(sg_scale)  # exact: 8 x 8 significant bits
  else:
    s = ceil_div_bf16(gmax, float(top))  # bf16-exact, g top >= gmax
    sg_scale = ceil_div_bf16(_supergroup_max(s), K_MAX)
    k = stochastic_k(s, sg(sg_scale), keys, group_idx, div)
  return jnp.where(sg(sg_scale > 0), k, 0.0), sg_scale, s


def stochastic_k(g, unit, keys, group_idx, div=None, floor=jnp.floor):
  """``k`` in [0, 255] rounded stochastically so that ``E[k unit] = g`` (``g`` and ``unit``
  bf16-exact, ``unit`` with at most 16 significant bits): ``floor(g / unit)``, plus 1
  with probability ``(g - kf unit) / unit``, decided as ``u unit < g - kf unit`` (exact
  products; the draw: :data:`~pallas_kernels.rng.Stream.DYNAMIQ_SCALE` at ``group_idx``;
  ``div``, ``floor`` as :func:`floor_quotient`'s)."""
  kf = floor_quotient(g, unit, K_MAX, div, floor=floor)
  k0, k1 = keys[0], keys[1]
  u = rng.uniform24(rng.hash_index(k0 ^ jnp.uint32(rng.Stream.DYNAMIQ_SCALE), k1, group_idx))
  return kf + ((u * unit < g - kf * unit) & (kf < K_MAX)).astype(jnp.float32)


def decoded_scale(k, sg_scale):
  """Decoded group scale ``k V`` [S, G] (exact)."""
  return k.astype(jnp.float32) * trailing(sg_scale, k.ndim)


# ----------------------------------------------------------------------------
# Rounding.


def _pair_lo(w):
  return jax.lax.bitcast_convert_type(w << 16, jnp.float32)


def _pair_hi(w):
  return jax.lax.bitcast_convert_type(w & np.int32(-65536), jnp.float32)


def _decision(u_scaled, frac, frac_mul, d, e, q):
  """The two sides of the rounding decision ``u |d| < e q`` (round up iff the
  first is less; ``d`` is the bracket's width up to its sign). With ``frac =
  -(1 + u / q)`` (a power-of-two q): ``(u / q) |d| < e``, the same comparison
  scaled by the exact 1 / q; ``(frac + 1) d`` is ``frac_mul``."""
  if frac is not None:
    return jnp.abs(frac_mul(frac, d)), e
  return u_scaled * jnp.abs(d), e * np.float32(q)


class WidthConsts(NamedTuple):
  """A width's rounding constants (:class:`LevelTables`), broadcast against the block;
  ``base`` indexes ``pairs`` (``pbase``) or ``levels`` (``lbase``)."""

  base: jax.Array
  r: jax.Array
  c1k: jax.Array
  k: jax.Array
  c2: jax.Array


def round_levels(a, s, c: WidthConsts, u_scaled, frac, q: int, *, ops: BlockOps = REFERENCE_OPS,
                 pairs=None, levels=None, group_store=None):
  """Stochastically rounds ``a / s`` (in [0, 1]) to a level index in [0, R].

  The bracket ``j`` is exact (``lam_j s <= a < lam_(j+1) s`` by exact
  products, 8 x 16 significant bits) and the value goes to ``j + 1`` iff
  ``u (hi - lo) < (a - lo) q`` (:func:`_decision`; ``u_scaled`` uniform on
  [0, q), or ``frac``). The bracket is found from a first guess ``g =
  floor(log2(1 + t c1) / log2(1 + 2 eps^2) - 1/2)``, ``t = a / s`` (the MEE
  index formula less :data:`GUESS_OFFSET`), at most R - 1: the formula is
  within 1/2 of a level of the exact position (bf16 levels move a boundary
  by at most a quarter of a level at 8 bits, checked next to every boundary
  of every width in ``tests/test_format.py``, also with a log2 off by
  2^-20), so ``g`` is ``j`` or ``j - 1``, and one exact comparison with
  ``lam_(g+1) s`` decides. At ``g = R - 1`` and ``a = s`` the bracket becomes
  ``[lam_R, lam_R]`` and the value stays at ``R``, as ``[lam_(R-1), lam_R]``
  with certain rounding up gives. The guess costs ``c1 / s`` once per group
  (an ``s`` below 2^-64 or above 2^64 scaled by 2^64 or 2^-64 first, exact,
  so that it stays finite and an approximate ``ops.div`` accurate), then per
  coordinate a multiply, a multiply-add, a base-2 log and a multiply (the
  offset folded into the log's argument: ``c1k = c1 k``, ``k = 2^(-1/2 /
  c2)``); only the guess depends on ``ops.log2``, ``ops.div``, ``ops.fma`` and
  ``ops.floor_int``, never the codes.

  The levels come from one of two tables: ``pairs(i)`` (:attr:`LevelTables.pairs`,
  two bf16 levels per load: the reference's) or ``levels(i)``
  (:attr:`LevelTables.lev`, float32: the kernels'). With ``levels``, ``m =
  lam_(g+1) s`` decides the step and is one end of the bracket whichever way
  it goes; the other end is ``lam_(g+2) s`` after a step, else ``lam_g s``.
  The same three exact products and comparisons: the same codes.
  ``group_store`` (identity on values; the XLA reference's
  :func:`~pallas_kernels.dynamiq_reference.materialize`) is applied to the
  per-group factors, so that a fused loop reads them instead of recomputing
  them per coordinate.
  """
  group_store = group_store or (lambda v: v)
  # f: 2^64 below 2^-64, 2^-64 above 2^64 (exact scalings): s f is then in
  # [2^-85, 2^64], where c1k / (s f) is finite and an approximate ``div`` accurate
  f = jnp.where(s < np.float32(2.0**-64), np.float32(2.0**64),
                jnp.where(s > np.float32(2.0**64), np.float32(2.0**-64), np.float32(1.0)))
  d = jnp.where(s > 0, s, 1.0) * f
  rc1 = group_store(c.c1k / d if ops.div is None else ops.div(c.c1k, d))  # per group
  f = group_store(f)
  approx = ops.log2(ops.fma(a * f, rc1, c.k)) * c.c2  # c2 log2(1 + t c1) - 1/2
  g = jnp.minimum(ops.floor_int(approx), c.r - 1)  # >= -1: pairs(base - 1) = (0, lam_0)
  if levels is not None:
    m = levels(c.base + g + 1) * s  # exact
    step = a >= m
    o = jnp.where(step, levels(c.base + g + 2), levels(c.base + g)) * s  # exact
    lo = jnp.where(step, m, o)
    # hi - lo = |o - m| (round-to-nearest is symmetric): no select for hi
    up = ops.lt_mask(*_decision(u_scaled, frac, ops.frac_mul, o - m, a - lo, q))
    return g + step.astype(jnp.int32) - up
  w0 = pairs(c.base + g)  # lam_g, lam_(g+1)
  step = a >= _pair_hi(w0) * s  # exact
  w = jnp.where(step, pairs(c.base + g + 1), w0)
  lo = _pair_lo(w) * s  # exact
  hi = _pair_hi(w) * s  # exact
  up = ops.lt_mask(*_decision(u_scaled, frac, ops.frac_mul, hi - lo, a - lo, q))
  return g + step.astype(jnp.int32) - up


def reciprocal_tables() -> np.ndarray:
  """float32 [384]: ``RD(1 / k)`` for ``k`` in [0, 256) (0 at ``k = 0``), then ``RD(1 /
  (1 + f / 128))`` for ``f`` in [0, 128): the factors of :func:`lattice_reciprocal`."""
  return _RECIPROCALS


def _round_down_recip(d: np.ndarray) -> np.ndarray:
  r = (1.0 / d).astype(np.float32)
  over = r.astype(np.float64) * d > 1.0
  return np.where(over, np.nextafter(r, np.float32(0)), r).astype(np.float32)


_RECIPROCALS = np.concatenate([
    [np.float32(0)], _round_down_recip(np.arange(1, 256, dtype=np.float64)),
    _round_down_recip(1.0 + np.arange(128, dtype=np.float64) / 128)]).astype(np.float32)
_RECIPROCALS.setflags(write=False)
_MANTISSA_AT = 256  # where reciprocal_tables() has RD(1 / (1 + f / 128))


def reciprocal_of_index(i):
  """``reciprocal_tables()[i]`` computed without a gather (a backend without one): ``RD(1
  / k)`` for ``i = k < 256``, ``RD(128 / (128 + f))`` for ``i = 256 + f``, from the
  quotient corrected by exact residuals (the divisor has at most 8 significant bits,
  the quotient is split into two 12-bit halves: every product and difference exact)."""
  i = jnp.asarray(i).astype(jnp.int32)
  is_k = i < _MANTISSA_AT
  n = jnp.where(is_k, np.float32(1.0), np.float32(128.0))
  d = jnp.where(is_k, i, i - _MANTISSA_AT + 128).astype(jnp.float32)
  d = jnp.where(d > 0, d, np.float32(1.0))
  step = lambda q, by: jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(q, jnp.int32) + by, jnp.float32)

  def residual(q):  # n - q d, exactly
    hi = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(q, jnp.uint32) & np.uint32(0xFFFFF000), jnp.float32)
    return (n - hi * d) - (q - hi) * d

  q = n / d
  for _ in range(2):
    q = jnp.where(residual(q) < 0, step(q, -1), q)
  for _ in range(2):
    up = step(q, 1)
    q = jnp.where(residual(up) >= 0, up, q)
  return jnp.where(i > 0, q, np.float32(0.0))


def small_int(v):
  """int32 of float32 integers in [0, 2^23) (a scale's ``k``): the bits of ``v + 2^23``
  less those of ``2^23``, exact, two instructions where a saturating conversion takes
  three or four."""
  two23 = np.float32(1 << 23)
  return jax.lax.bitcast_convert_type(v + two23, jnp.int32) - two23.view(np.int32)


def _prev_float(v):
  """The float32 below ``v`` for ``v > 0`` (``v`` where it is 0)."""
  bits = jax.lax.bitcast_convert_type(v, jnp.int32)
  return jax.lax.bitcast_convert_type(bits - (bits > 0).astype(jnp.int32), jnp.float32)


def lattice_consts(widths):
  """Per-width constants of the lattice, computed from the int32 ``widths`` (any
  shape; clipped to [2, 8]) -> (``F`` uint32, the code's sign bit ``2^(F + w - 1)``
  uint32, the top level ``lam_R = 5/4 - 2^(2-w)`` float32, exact)."""
  w = jnp.clip(widths, 2, 8).astype(jnp.uint32)
  field = jnp.minimum(np.uint32(24) - w, np.uint32(21))  # 23 - M
  sign_at = np.uint32(1) << (field + w - np.uint32(1))
  top = np.float32(LATTICE_Y0) - jax.lax.bitcast_convert_type(
      (np.uint32(129) - w) << np.uint32(23), jnp.float32)
  return field, sign_at, top


def lattice_reciprocal(num, den, recip):
  """A float32 ``rs <= num / (2 den)`` (half scale, :data:`ROUND_Y0`), within 2^-21 of
  it, for a bf16-exact ``den`` in
  [2^-126, 2^117] and ``num`` either a float32 or, as an int32 in [0, 256),
  an index of ``recip`` (``recip(i) -> reciprocal_tables()[i]``).

  ``1 / (2 den)`` rounded down is ``RD(1 / (1 + f / 128))`` from the table times
  ``2^(126 - e)`` (``den``'s biased exponent ``e`` and fraction ``f``: exact);
  its product with ``num`` is rounded to nearest, then stepped down one float,
  which puts it at or below the exact quotient. Only float products and
  integer operations: the same bits in every implementation."""
  bits = jax.lax.bitcast_convert_type(den, jnp.uint32)
  frac = ((bits >> np.uint32(16)) & np.uint32(0x7F)).astype(jnp.int32)
  scale = jax.lax.bitcast_convert_type(
      (np.uint32(253 << 23) - (bits & np.uint32(0x7F800000))), jnp.float32)  # 2^(126 - e)
  inv = recip(frac + _MANTISSA_AT) * scale  # RD(1 / (2 den)), exact
  if jnp.issubdtype(num.dtype, jnp.integer):
    num = recip(num)
  return _prev_float(num * inv)


def lattice_scales(gmax, widths, scale_rounding: str, keys, group_idx, recip, div=None):
  """The hierarchical scales of lattice levels -> (``k`` f32 [S, G], super-group scale
  ``V`` f32 [S], ``rs`` f32 [S, G]), from the group maxima ``gmax`` [S, G] (or [S, G',
  ...]: groups along several axes).

  A group decodes as ``lam_l k V`` (``lam_R`` = ``c``, :func:`lattice_consts`' top level,
  not 1: ``k V c`` covers the group). ``"up"``: ``V = ceil_bf16(max / (255 c))``, ``k =
  ceil(gmax / (V c))`` (exact products: ``c`` has few bits), and the elements are
  mapped to ``a rs`` with ``rs <= 1 / (2 k V)`` (:func:`lattice_reciprocal`: half
  scale), so ``a rs <= c / 2``. ``"stochastic"``: ``g = ceil_bf16(gmax)``, ``V =
  ceil_bf16(max g / (255 c))``, ``k`` rounded stochastically with ``E[k V c] = g``,
  and ``rs <= c / (2 g)``. Both unbiased up to ``rs``'s rounding (relative 2^-21).
  """
  _, _, top = lattice_consts(widths)
  top_kmax = top * np.float32(K_MAX)  # exact: 15 significant bits at most
  sg = lambda v: trailing(v, gmax.ndim)
  # a super-group with a NaN or an infinity (its maximum is not below infinity) gets k =
  # 0 and rs = 0 (k is made 0 before it becomes a table index: a NaN's integer is each
  # backend's own); so does an all-zero one
  amax = _supergroup_max(gmax)
  if scale_rounding == "up":
    sg_scale = ceil_div_bf16_by(amax, top_kmax, div)
  else:
    gs = ceil_div_bf16(gmax, 1.0)
    sg_scale = ceil_div_bf16_by(_supergroup_max(gs), top_kmax, div)
  live = sg((sg_scale > 0) & (amax < np.float32(np.inf)))
  vt = sg(sg_scale * top)  # exact
  if scale_rounding == "up":
    k = jnp.where(live, ceil_quotient(gmax, vt, K_MAX, div), 0.0)
    rs = lattice_reciprocal(small_int(k), jnp.broadcast_to(sg(sg_scale), k.shape), recip)
  else:
    k = jnp.where(live, stochastic_k(gs, vt, keys, group_idx, div), 0.0)
    rs = lattice_reciprocal(jnp.broadcast_to(sg(top), gs.shape), gs, recip)
  return k, sg_scale, jnp.where(live & (gmax > 0), rs, 0.0)


def group_max(a, gdims: int, max_last=ref_max_last):
  """The maximum of float32 ``a >= 0`` (or NaN) over the axes past the first ``gdims`` (a
  block's groups), NaN if any is NaN (``max_last``: :attr:`BlockOps.max_last`)."""
  return reduce_trailing(a, gdims, max_last)


def _supergroup_max(gmax):
  """float32 [S]: the maximum over each super-group's groups (every axis past the first)."""
  return group_max(gmax, 1)


def lattice_level(codes, widths):
  """The signed lattice level of sign-magnitude ``codes`` (uint32, any shape) of
  ``widths`` (int32, broadcastable; clipped to [2, 8]) by arithmetic, no table:
  magnitude ``m`` (the low ``w - 1`` bits) gives ``lam_m = fl(Y0 + m 2^F) - Y0`` (the
  float ``m`` steps of ``2^F`` in its bits above ``Y0``: exact, as ``Y0 <= y < 2 Y0``),
  negated where bit ``w - 1`` is clear. Equal to ``LevelTables.dec`` at ``2^w - 4 +
  code`` for every code below ``2^w``: for a backend without a gather."""
  field, _, _ = lattice_consts(widths)
  w = jnp.clip(widths, 2, 8).astype(jnp.uint32)
  m = codes & ((np.uint32(1) << (w - np.uint32(1))) - np.uint32(1))
  y0 = np.float32(LATTICE_Y0)
  lam = jax.lax.bitcast_convert_type(y0.view(np.uint32) + (m << field), jnp.float32) - y0
  return jnp.where(((codes >> (w - np.uint32(1))) & np.uint32(1)) == 1, lam, -lam)


def ceil_div_bf16_by(v, c, div=None):
  """:func:`ceil_div_bf16` by a per-element ``c`` (at most 16 significant bits): a guess
  from ``div`` (None: exact ``/``) within one bf16 step, then corrected both ways by
  exact products, so any guess that close gives the same result."""
  w = bf16.ceil(v / c if div is None else div(v, c))
  down = bf16.next_down(w)
  w = jnp.where((w > 0) & (down * c >= v), down, w)  # exact products
  return jnp.where(w * c < v, bf16.next_up(w), w)


def round_lattice(a, rs, field, draws, ops: BlockOps = REFERENCE_OPS, *, sign_at=None,
                  neg=None, shift=True):
  """Level index in [0, R] of ``t = 2 a rs`` (``a rs`` in [0, lam_R / 2]: half scale)
  on the lattice of :func:`lattice_table`: ``y = Y0 / 2 + a rs`` (:data:`ROUND_Y0`;
  product and sum each rounded once, ``ops.mul_add_rounded``), plus the ``F``-bit
  ``draws`` in its low bits, less ``bits(Y0 / 2)``, shifted right by ``F``: level ``j
  + 1`` with probability ``(y - y_j) / (y_(j+1) - y_j)``, exactly (a draw of ``F``
  bits), else ``j``. (Halving ``Y0 + t`` keeps its fraction bits, so the levels are
  those of ``Y0 + t``.)

  With ``sign_at`` (``2^(F + w - 1)``) and the sign mask ``neg``: the code instead
  (uint32), the level with bit ``w - 1`` set where the element is not negative; not
  ``shift``: the code at bits ``[F, F + w)`` (below 2^24), draw bits below it."""
  y = ops.mul_add_rounded(a, rs, ROUND_Y0)
  z = jax.lax.bitcast_convert_type(y, jnp.uint32) + draws - ROUND_Y0.view(np.uint32)
  if sign_at is None:
    return (z >> field).astype(jnp.int32)
  z = ops.or_unless(z, sign_at, neg)
  return z >> field if shift else z


def _encode_lattice(x, widths, tabs: LevelTables, *, keys, rank, strata, draw_group, lane,
                    scale_rounding, ops, recip, group_idx, group_store, raw):
  """:func:`encode_block` on lattice levels (one array ``x``)."""
  gstore = group_store or (lambda v: v)
  a = jnp.abs(x)
  k, sg_scale, rs = lattice_scales(group_max(a, group_idx.ndim, ops.max_last), widths,
                                   scale_rounding, keys, group_idx, recip, ops.div)
  field, sign_at, _ = (trailing(gstore(v), x.ndim) for v in lattice_consts(widths))
  neg = sign_mask(x)
  draws = rng.lattice_draws(keys, rank, strata, group=draw_group, lane=lane, neg=neg,
                            field=field, mulhi=ops.mulhi, hash_store=group_store)
  codes = round_lattice(a, trailing(gstore(rs), x.ndim), field, draws, ops, sign_at=sign_at,
                        neg=neg, shift=not raw)
  return codes, small_int(k).astype(jnp.uint8), sg_scale


def encode_block(x, widths, tabs: LevelTables, *, keys, rank, strata: int, idx, draw_group,
                 lane, scale_rounding="up", ops: BlockOps = REFERENCE_OPS, pairs=None,
                 levels=None, group_idx=None, group_store=None, recip=None, raw_codes=False):
  """Quantises a block of super-groups, each at its own width.

  Args:
    x: float32 [S, G, 16] values (G = 16 scale groups), or the same as [S, G,
      CB, P] (a kernel's view, P codes per plane byte), or any [S, G', ..., E...]
      whose leading axes (``group_idx``'s) are the scale groups and the rest a
      group's 16 elements (a kernel's group pairs held in registers).
    widths: int32 [S].
    tabs: the width set's tables.
    keys: ``(k0, k1, s0, s1)`` uint32 scalars.
    rank: int32 scalar, this rank (stratified draws).
    strata: 1 (independent draws) or the number of ranks sharing strata.
    idx: uint32 element indices (the RNG counters), shaped as ``x``.
    draw_group, lane: ``idx >> 4`` (broadcastable against ``x``) and ``idx &
      15`` (each element's place in its group of 16 draws): a kernel computes
      the group's hash once per group and the lanes are static positions.
    scale_rounding: ``"up"`` or ``"stochastic"``.
    ops: the instructions (:class:`BlockOps`).
    pairs, levels: ``pairs(i) -> tabs.pairs[i]`` or ``levels(i) -> tabs.lev[i]``
      for int32 arrays ``i``: the table :func:`round_levels` brackets with.
    group_idx: ``idx >> 4`` per scale group (uint32 [S, G], or the group axes of
      ``x``), when given; required when the groups span more than one axis.
    group_store: identity on values, applied to the per-group and
      per-super-group values (scales, width constants, the first guess's
      factors, the draws' hashes); the XLA reference passes
      :func:`~pallas_kernels.dynamiq_reference.materialize`, so that the fused
      rounding loop reads them instead of recomputing them per coordinate.
    raw_codes: lattice levels only: each code left at bits ``[F, F + w)`` of its uint32
      (``F``: :func:`lattice_consts`), the bits below it arbitrary (a kernel packs
      the codes' third bytes and shifts the transposed planes instead).

  Returns:
    ``(codes uint32 shaped as x in [0, 2^w - 1], k uint8 shaped as ``group_idx``,
    super-group scale f32 [S])``.
  """
  if group_idx is None:
    group_idx = jnp.min(jnp.min(trailing(idx, 4), axis=-1), axis=-1) // np.uint32(GROUP)
  if tabs.lattice:
    return _encode_lattice(x, widths, tabs, keys=keys, rank=rank, strata=strata,
                           draw_group=draw_group, lane=lane, scale_rounding=scale_rounding,
                           ops=ops, recip=recip, group_idx=group_idx, group_store=group_store,
                           raw=raw_codes)
  if raw_codes:
    raise ValueError("raw_codes: lattice levels only")
  a = jnp.abs(x)
  k, sg_scale, s = scales(group_max(a, group_idx.ndim, ops.max_last), scale_rounding, keys,
                          group_idx, ops.div)
  q = rng.strata_count(strata) * 2**rng.UNIFORM_BITS  # u is uniform on [0, q)
  neg = sign_mask(x)
  draws = functools.partial(rng.uniforms, keys, rank, strata, group=draw_group, lane=lane,
                            mulhi=ops.mulhi, hash_store=group_store)
  if q & (q - 1) == 0:  # the draw as 1 + u / q (_decision)
    u, frac = None, draws(fraction_of=neg)
  else:
    u, frac = rng.signed_draws(draws(), neg, q), None
  gstore = group_store or (lambda v: v)
  per = lambda v: trailing(gstore(tabs.select(widths, v)), x.ndim)
  r = per(tabs.r)
  s = trailing(gstore(s), x.ndim)
  pbase = per(tabs.pbase) if levels is None else None
  c1k, k_guess, c2 = per(tabs.c1k), per(tabs.k), per(tabs.c2)
  base = pbase if levels is None else per(tabs.lbase)
  lvl = round_levels(a, s, WidthConsts(base, r, c1k, k_guess, c2), u, frac, q, ops=ops,
                     pairs=pairs, levels=levels, group_store=group_store)
  # code R + 1 + lvl, or R - lvl where x has its sign bit (lvl ^ -1 = -lvl - 1): one xor
  codes = (r + 1 + (lvl ^ neg)).astype(jnp.uint32)
  return codes, small_int(k).astype(jnp.uint8), sg_scale


def decode_block(codes, scale, widths, tabs: LevelTables, *, lookup, addend=None, fma=ref_fma,
                 rows=False):
  """codes uint32 [S, G, 16] (or [S, G, CB, P]), decoded group scale f32 [S, G]
  -> float32 shaped as codes; ``lookup(i) -> tabs.dec[i]``. ``rows``: the codes are
  already indices ``code | row << 8`` of :meth:`LevelTables.dec_rows`, which
  ``lookup`` reads (``widths`` unused).

  ``addend`` (float32 shaped as codes): returns ``decode + addend`` as
  ``fma(level, scale, addend)``; the product is exact (8 x 16 significant
  bits), so a fused ``fma`` gives the same sum as a multiply and an add,
  unless the product is subnormal."""
  index = codes.astype(jnp.int32)
  if not rows:  # the width's table: the lattice's every width at 2^w - 4, else at dbase
    if tabs.lattice and len(tabs.widths) > 1:
      dbase = (1 << jnp.clip(widths, 2, 8)) - 4
    else:
      dbase = tabs.select(widths, tabs.dbase)
    index = trailing(dbase, codes.ndim) + index
  lam = lookup(index)  # -lam s = -(lam s)
  if addend is None:
    return lam * trailing(scale, codes.ndim)
  return fma(lam, trailing(scale, codes.ndim), addend)
