"""The unit-packed DynamiQ chunk of the default codec: per-super-group widths are data.

One ring chunk of ``S`` super-groups travels as one static payload::

  [S scale records: 16 uint8 k_g + 2-byte bf16 unit U]   (18 S bytes)
  [U_units code units of 32 * plane_bits bytes]

A w-bit code (w in ``width_set``, default :data:`WIDTH_SET` = (2, 3, 4, 5,
6, 8); the paper's set is :data:`WIDTHS` = (2, 4, 8)) is stored as ``w``
one-bit *planes* (``plane_bits=1``, the default; units of 32 bytes) or
``w / 2`` two-bit planes (``plane_bits=2``, units of 64 bytes; even widths
only): plane ``p`` of a super-group holds bits ``[p b, (p + 1) b)`` of its
256 codes, ``8 / b`` codes per byte, LSB-first (one unit). Super-groups are
ordered widest first, and units are *plane-major*: plane p of every
super-group that has it (a prefix of the chunk) occupies units ``[off_p,
off_p + count_p)``, ``off`` the exclusive prefix sum of ``count_p`` (the
number of super-groups with more than ``p`` planes); unused units at the end
are zero. Placement is one contiguous copy per plane at a data-dependent
offset (no gather). Bytes per super-group are those of the per-class record
(``32 w + 18``), so a split that fits the per-class budget fits here; the
number of units is static (the budget), the widths are per round.

The ``*_reference`` functions here are the pure-jnp twins of the Pallas
kernels in :mod:`pallas_kernels.dynamiq_units_kernels` (which also holds
the dispatching public names, ``compress_units`` and friends); both use
:func:`encode_block_var` / :func:`decode_block_var`.

Arithmetic: the same as :mod:`pallas_kernels.dynamiq_format` — its
hierarchical scales (:func:`~pallas_kernels.dynamiq_format._scales_hier`;
with MEE levels the top level is 1 for every width, so scales do not depend
on the width), its RNG draws (:func:`~pallas_kernels.dynamiq_format._uniforms`)
and its division-free rounding (:func:`_round_levels_var` finds the same
exact bracket as ``_round_levels`` and makes the same comparison, with the
width's constants as per-super-group arrays and concatenated tables
indexed at a per-super-group base: bracket pairs for the encode, signed
levels per code for the decode). So with the same draws a super-group gets
exactly the level and value the per-class format gives it (tested), and one
code path serves every width (no per-class launches, no static capacities).
Codes differ from the per-class format's only in numbering: a negative level
-l is code R - l, a positive one R + 1 + l (every code of w bits is used;
:func:`encode_block_var`).

Only hierarchical MEE scales with ``scale_rounding="up"`` or
``"stochastic"`` are supported (the codec's defaults).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bf16
from pallas_kernels import dynamiq_format as F

__all__ = ["WIDTHS", "WIDTH_SET", "PLANE_BITS", "UNIT_BYTES", "SCALE_BYTES", "payload_bytes",
           "position_widths", "position_widths_general", "unit_bytes", "eps_for",
           "compress_units_reference", "decompress_units_reference",
           "decompress_accumulate_units_reference",
           "decompress_accumulate_recompress_units_reference", "units_for_budget"]

WIDTHS = (2, 4, 8)
"""The paper's width set."""
WIDTH_SET = (2, 3, 4, 5, 6, 8)
"""Default width set of the ``*_units`` functions (with ``plane_bits=1``)."""
PLANE_BITS = 1
"""Default bits per plane (units of ``32 * PLANE_BITS`` bytes)."""
UNIT_BYTES = 64  # one 2-bit plane of 256 codes
SCALE_BYTES = F.HIER_GROUP + 2  # 16 k_g + bf16 unit


def payload_bytes(supergroups: int, units: int, plane_bits: int = PLANE_BITS) -> int:
  return supergroups * SCALE_BYTES + units * 32 * plane_bits


def units_for_budget(supergroups: int, budget_bytes: int, plane_bits: int = PLANE_BITS) -> int:
  """Code units of a chunk of ``supergroups`` within ``budget_bytes`` (static)."""
  return (budget_bytes - supergroups * SCALE_BYTES) // (32 * plane_bits)


def eps_for(width: int, eps: dict[int, float]) -> float:
  """MEE eps of a width: given, or interpolated linearly between given widths
  (0.23 below the smallest given width)."""
  if width in eps:
    return float(eps[width])
  ws = sorted(eps)
  lo = max([w for w in ws if w < width], default=None)
  hi = min([w for w in ws if w > width], default=None)
  if lo is None or hi is None:
    return float(eps[lo if hi is None else hi]) if (lo or hi) else 0.23
  return float(eps[lo] + (eps[hi] - eps[lo]) * (width - lo) / (hi - lo))


class _Tables:
  """Concatenated level tables and per-width rounding constants (static).

  ``widths`` may be any subset of 2..8 (odd widths: MEE levels with eps
  interpolated, :func:`eps_for`; only {2, 4, 8} have a byte layout here, the
  others serve accuracy studies through :func:`encode_block_var` /
  :func:`decode_block_var`)."""

  def __init__(self, eps: dict[int, float], widths=WIDTHS):
    tabs, base, r, c1, c2 = [], [], [], [], []
    off = 0
    self.widths = tuple(sorted(widths))
    self.index = np.zeros(9, np.int32)
    for i, w in enumerate(self.widths):
      self.index[w] = i
      e = eps_for(w, eps)
      rr = 2 ** (w - 1) - 1
      t = F._level_table(w, "mee", e)
      tabs.append(t)
      base.append(off)
      off += t.size
      r.append(rr)
      if rr == 1:  # ternary: j = 0 whatever the guess (clipped to r - 1 = 0)
        c1.append(1.0)
        c2.append(1.0)
      else:
        qq = 1.0 + 2.0 * e**2
        c1.append(np.float32(qq**rr - 1.0))
        c2.append(np.float32(1.0 / np.log2(qq)))
    self.table = np.concatenate(tabs).astype(np.float32)
    # pairs[pbase + l]: lam_l (bf16 bits, low half) and lam_(l+1) (high half),
    # lam_(R+1) = lam_R: one load gives a bracket's two ends; pairs[pbase - 1]
    # = (0, lam_0 = 0), so that a guess of -1 needs no clamp
    bits = [(t.view(np.uint32) >> 16) for t in tabs]
    self.pairs = np.concatenate([np.concatenate([[0], b | (np.append(b[1:], b[-1]) << 16)])
                                 for b in bits]).astype(np.uint32).view(np.int32)
    self.pbase = np.array(base, np.int32) + 1 + np.arange(len(tabs), dtype=np.int32)
    # lev[lbase + l]: lam_l as float32, for l in [-1, R + 1]: lam_(-1) = 0 (read
    # by a guess of -1, never used), lam_(R+1) = lam_R (the kernels' bracket,
    # :func:`_round_levels_var` with ``levels``)
    self.lev = np.concatenate([np.concatenate([[0.0], t, t[-1:]]) for t in tabs]).astype(np.float32)
    self.lbase = np.array(base, np.int32) + 1 + 2 * np.arange(len(tabs), dtype=np.int32)
    # dec[dbase + c]: the signed level of code c: -lam_(R-c) for c <= R (-lam_0
    # = -0 at R), lam_(c-R-1) above (every code of w bits used; encode_block_var)
    dec = [np.concatenate([-t[::-1], t]).astype(np.float32) for t in tabs]
    self.dec = np.concatenate(dec)
    self.dbase = np.cumsum([0] + [d.size for d in dec[:-1]]).astype(np.int32)
    self.base = np.array(base, np.int32)
    self.r = np.array(r, np.int32)
    self.c1 = np.array(c1, np.float32)
    self.c2 = np.array(c2, np.float32)
    # 2^(-GUESS_OFFSET / c2): the guess's offset folded into the log's argument
    self.k = np.exp2(-GUESS_OFFSET / self.c2.astype(np.float64)).astype(np.float32)
    self.c1k = (self.c1.astype(np.float64) * self.k).astype(np.float32)


def _tables(eps, widths=WIDTHS):
  return _Tables(dict(eps), widths)


def position_widths(counts_per_chunk, supergroups: int):
  """Widths of the ``supergroups`` positions of a chunk, widest first.

  Args:
    counts_per_chunk: int32 ``[3]``: super-groups per chunk at 2, 4, 8 bits
      (e.g. :func:`dynamiq_jax.codecs.allocation.capacities_from_stats`,
      whose units are one super-group per chunk); sums to ``supergroups``.
  """
  return position_widths_general(counts_per_chunk, WIDTHS, supergroups)


def position_widths_general(counts, width_set, supergroups: int):
  """As :func:`position_widths` for any ``width_set`` (counts in ascending width order)."""
  j = jnp.arange(supergroups, dtype=jnp.int32)
  ws = sorted(width_set, reverse=True)
  out = jnp.full((supergroups,), ws[-1], jnp.int32)
  end = jnp.int32(0)
  for i, w in zip(range(len(ws) - 1, -1, -1), ws):  # widest first
    start, end = end, end + counts[i]
    out = jnp.where((j >= start) & (j < end), w, out)
  return out


def _wsel(widths, values, tabs):
  """Per-super-group constant: ``values[index of width]`` (the smallest width's
  for a width outside the set).

  A select chain over the static width set, not a gather, so that the same
  code runs in the Pallas kernels (:mod:`pallas_kernels.dynamiq_units_kernels`)."""
  out = jnp.full(widths.shape, values[0], values.dtype)
  for i, w in enumerate(tabs.widths[1:], start=1):
    out = jnp.where(widths == w, values[i], out)
  return out


def _trailing(v, ndim: int):
  """``v`` with unit axes appended up to ``ndim`` (broadcasts against a block)."""
  return v[(...,) + (None,) * (ndim - v.ndim)]


GUESS_OFFSET = 0.5
"""Levels subtracted from the first guess of :func:`_round_levels_var`."""


def _floor_int(v):
  """``floor(v)`` as int32 (NaN -> 0, saturating): one ``cvt.rmi.s32.f32`` on a GPU."""
  return jnp.floor(v).astype(jnp.int32)


def _pair_lo(w):
  return jax.lax.bitcast_convert_type(w << 16, jnp.float32)


def _pair_hi(w):
  return jax.lax.bitcast_convert_type(w & np.int32(-65536), jnp.float32)


def _fma(a, b, c):
  return a * b + c


def _frac_mul(w, d):
  """``(w + 1) d``, rounded once (``w + 1`` is exact for ``w`` in (-2, -1])."""
  return (w + np.float32(1.0)) * d


def _lt_mask(a, b):
  """int32 -1 where ``a < b`` (ordered: false for NaN), else 0 (the kernels: the sign of
  ``a - b``, no predicate)."""
  return -(a < b).astype(jnp.int32)


def _round_levels_var(a, s, pairs, base, r, c1k, k, c2, u_scaled, q, log2=jnp.log2,
                      floor_int=_floor_int, fma=_fma, group_store=None, levels=None,
                      lbase=None, lt_mask=_lt_mask, frac=None, frac_mul=_frac_mul,
                      div=None):
  """Stochastically rounds ``a / s`` (in [0, 1]) to a level index in [0, R] with
  the width's constants as arrays broadcast against ``a`` (``base`` indexes
  the concatenated tables; ``pairs(i)`` is :attr:`_Tables.pairs`, the bf16
  bits of ``lam_l`` and ``lam_(l+1)`` in one int32).

  The rounding is :func:`pallas_kernels.dynamiq_format._round_levels`'s: the
  bracket ``j`` is exact (``lam_j s <= a < lam_(j+1) s`` by exact products,
  8 x 16 significant bits) and the value goes to ``j + 1`` iff ``u (hi - lo)
  < (a - lo) q``. It is found from a first guess ``g = floor(log2(1 + t c1)
  / log2(1 + 2 eps^2) - 1/2)``, ``t = a / s`` (the MEE index formula less
  :data:`GUESS_OFFSET`), at most R - 1: the formula is within 1/2 of
  a level of the exact position (bf16 levels move a boundary by at most a
  quarter of a level at 8 bits, checked next to every boundary of every
  width in ``tests/test_dynamiq_units.py``, also with a log2 off by 2^-20),
  so ``g`` is ``j`` or ``j - 1``, and one exact comparison with ``lam_(g+1)
  s`` decides; the two pairs ``g``, ``g + 1`` hold the three levels it
  needs (two loads; a guess of -1 reads the pair ``(0, lam_0)`` before the
  width's, and the comparison with ``lam_0 s = 0`` moves it to 0). At ``g = R - 1`` and ``a = s`` the bracket becomes
  ``[lam_R, lam_R]`` and the value stays at ``R``, as ``[lam_(R-1), lam_R]``
  with certain rounding up gives. The guess is cheap: ``c1 / s`` once per
  group (an ``s`` below 2^-64 or above 2^64 scaled by 2^64 or 2^-64 first,
  exact, so that it stays finite and ``div``, a kernel's approximate
  division, accurate), then per coordinate a multiply, a multiply-add, a base-2 log (one
  MUFU instruction on a GPU) and a multiply (the offset is folded into the
  log's argument: ``c1k = c1 k``, ``k = 2^(-1/2 / c2)``); ``log2`` and the division may
  be approximations (the kernels pass ``lg2.approx.f32``), ``fma`` fused or
  not, and ``floor_int`` any equal floor (the kernels' ``cvt.rmi``): only
  the guess depends on them, never the codes. ``group_store`` (identity on values, the XLA reference's
  :func:`~pallas_kernels.dynamiq_format.materialize`) is applied to the
  per-group factors, so that a fused loop reads them instead of recomputing
  them per coordinate.

  ``levels`` (with ``lbase``; ``levels(i)`` is :attr:`_Tables.lev`, float32
  levels) makes the same bracket from single levels instead of pairs, as the
  kernels do: ``m = lam_(g+1) s`` decides the step and is one end of the
  bracket whichever way it goes; the other end is ``lam_(g+2) s`` after a
  step, else ``lam_g s`` (one load, predicated on a GPU). The same three
  exact products as with pairs, the same comparisons: the same codes, and
  one instruction less per coordinate on a GPU (no bf16 halves to unpack, and
  the step's product is reused instead of recomputed)."""
  group_store = group_store or (lambda v: v)
  # f: 2^64 below 2^-64, 2^-64 above 2^64 (exact scalings): s f is then in
  # [2^-85, 2^64], where c1k / (s f) is finite and an approximate ``div`` accurate
  f = jnp.where(s < np.float32(2.0**-64), np.float32(2.0**64),
                jnp.where(s > np.float32(2.0**64), np.float32(2.0**-64), np.float32(1.0)))
  d = jnp.where(s > 0, s, 1.0) * f
  rc1 = group_store(c1k / d if div is None else div(c1k, d))  # per group
  f = group_store(f)
  approx = log2(fma(a * f, rc1, k)) * c2  # log2(k (1 + t c1)) c2 = c2 log2(1 + t c1) - 1/2
  g = jnp.minimum(floor_int(approx), r - 1)  # >= -1: pairs(base - 1) = (0, lam_0)
  if levels is not None:
    m = levels(lbase + g + 1) * s  # exact
    step = a >= m
    o = jnp.where(step, levels(lbase + g + 2), levels(lbase + g)) * s  # exact
    lo = jnp.where(step, m, o)
    # hi - lo = |o - m| (round-to-nearest is symmetric): no select for hi
    up = lt_mask(*_decision(u_scaled, frac, frac_mul, o - m, a - lo, q))
    return g + step.astype(jnp.int32) - up
  w0 = pairs(base + g)  # lam_g, lam_(g+1)
  step = a >= _pair_hi(w0) * s  # exact
  w = jnp.where(step, pairs(base + g + 1), w0)
  lo = _pair_lo(w) * s  # exact
  hi = _pair_hi(w) * s  # exact
  up = lt_mask(*_decision(u_scaled, frac, frac_mul, hi - lo, a - lo, q))
  return g + step.astype(jnp.int32) - up


def _decision(u_scaled, frac, frac_mul, d, e, q):
  """The two sides of the rounding decision ``u |d| < e q`` (round up iff the
  first is less; ``d`` is the bracket's width up to its sign). With ``frac =
  -(1 + u / q)`` (a power-of-two q): ``(u / q) |d| < e``, the same comparison
  scaled by the exact 1 / q, and ``(frac + 1) d`` is one fused multiply-add
  on a GPU (``frac_mul``: ``frac d + d``; its magnitude is ``(u / q) |d|``,
  rounding being symmetric), with no integer-to-float conversion and no
  multiply by q."""
  if frac is not None:
    return jnp.abs(frac_mul(frac, d)), e
  return u_scaled * jnp.abs(d), e * np.float32(q)


def encode_block_var(x, widths, tabs: _Tables, *, pairs, idx, keys, rank, strata: int,
                     scale_rounding="up", store=None, log2=jnp.log2, group_idx=None,
                     draw_group=None, lane=None, mulhi=F.rng.mulhi, floor_int=_floor_int,
                     fma=_fma, group_store=None, levels=None, div=None, scales=None,
                     lt_mask=_lt_mask, frac_mul=_frac_mul):
  """Quantises a block of super-groups, each at its own width.

  Args:
    x: float32 [S, G, 16] values (G = 16 hierarchical groups), or the same
      as [S, G, CB, P] (the kernels' view, P codes per plane byte), or a
      tuple of parts [S, G, P] (part c: ``x[:, :, c]``; ``idx``,
      ``draw_group`` and ``lane`` are then tuples too, and so are the codes).
    widths: int32 [S].
    pairs: ``pairs(i) -> tabs.pairs[i]`` for int32 arrays ``i`` (None with ``levels``).
    idx: uint32 RNG counters, shaped as ``x``.
    log2: the base-2 log of the first guess of each level (any approximation
      within 2^-20 of it gives the same codes; :func:`_round_levels_var`).
    group_idx: ``idx >> 4`` per scale group (uint32 [S, G]), when given.
    draw_group, lane: ``idx >> 4`` (broadcastable against ``x``) and ``idx &
      15`` (each element's place in its group of 16 draws), when given: a
      kernel computes the group's hash once per group and the lanes are
      static positions.
    mulhi: :func:`pallas_kernels.rng.mulhi` or an equal implementation.
    floor_int: :func:`_floor_int` or an equal implementation.
    fma: ``a b + c``, fused or not (the first guess only).
    levels: ``levels(i) -> tabs.lev[i]``: the bracket from single levels
      (:func:`_round_levels_var`; the same codes), instead of ``pairs``.
    div: an approximate float32 division (within a few ulp for divisors in
      [2^-126, 2^126]) for the first guesses of the scales' quotients (the
      same scales); None: ``/``.
    group_store: identity on values, applied to the per-group and
      per-super-group values (scales, width constants, the first guess's
      factors); the XLA reference passes
      :func:`~pallas_kernels.dynamiq_format.materialize`, so that the fused
      rounding loop reads them instead of recomputing them per coordinate.
      Kernels: None.
    scales: ``(k, unit, s)`` already found (for the parts of a tuple ``x``).

  Returns:
    ``(codes uint32 shaped as x in [0, 2^w - 1] (R - lvl, or R + 1 + lvl), k uint8 [S, G],
    unit f32 [S])``.
  """
  if isinstance(x, (tuple, list)):  # parts of each group: encoded one by one
    parts = [jnp.abs(v) for v in x]
    gmax = functools.reduce(jnp.maximum, [jnp.max(v, axis=-1) for v in parts])
    k, unit, s = F._scales_hier(None, F.Format(bits=8, scale_rounding=scale_rounding), keys,
                                group_idx, div, gmax=gmax)
    one = dict(tabs=tabs, pairs=pairs, keys=keys, rank=rank, strata=strata,
               scale_rounding=scale_rounding, store=store, log2=log2, mulhi=mulhi,
               floor_int=floor_int, fma=fma, group_store=group_store, levels=levels,
               scales=(k, unit, s), lt_mask=lt_mask, frac_mul=frac_mul, div=div)
    codes = tuple(encode_block_var(v, widths, idx=i, group_idx=group_idx, draw_group=d, lane=l,
                                   **one)[0]
                  for v, i, d, l in zip(x, idx, draw_group, lane))
    return codes, k.astype(jnp.uint8), unit
  a = jnp.abs(x)
  fmt8 = F.Format(bits=8, scale_rounding=scale_rounding)  # top = 1: same scales for all widths
  a4 = _trailing(a, 4)  # the format's [S, G, CB, P] view (P = 1 for [S, G, 16])
  if group_idx is None:
    group_idx = jnp.min(jnp.min(_trailing(idx, 4), axis=-1), axis=-1) // np.uint32(F.HIER_GROUP)
  if scales is None:
    k, unit, s = F._scales_hier(a4, fmt8, keys, group_idx, div)
  else:
    k, unit, s = scales
  q = F.rng.strata_count(strata) * 2**F.UNIFORM_BITS  # u is uniform on [0, q)
  neg = F.sign_mask(x)
  draws = functools.partial(F._uniforms, idx, keys, rank, strata, group_idx=draw_group,
                            lane=lane, mulhi=mulhi,
                            hash_store=group_store if draw_group is not None else None)
  if q & (q - 1) == 0:  # the draw as 1 + u / q (_decision)
    u, frac = None, draws(fraction_of=neg)
    if store is not None:
      frac = store(frac)
  else:
    u, frac = F.signed_draws(draws(), neg, q), None
    if store is not None:
      u = store(u)
  gstore = group_store or (lambda v: v)
  per = lambda v: _trailing(gstore(_wsel(widths, v, tabs)), x.ndim)
  r = per(tabs.r)
  lvl = _round_levels_var(a, _trailing(gstore(s), x.ndim), pairs, per(tabs.pbase), r,
                          per(tabs.c1k), per(tabs.k), per(tabs.c2), u, q, log2, floor_int, fma,
                          group_store, levels,
                          None if levels is None else per(tabs.lbase), lt_mask, frac,
                          frac_mul, div)
  # code R + 1 + lvl, or R - lvl where x has its sign bit (lvl ^ -1 = -lvl - 1):
  # one xor, no negation (the per-class format's R - lvl needs one more add)
  codes = (r + 1 + (lvl ^ neg)).astype(jnp.uint32)
  return codes, k.astype(jnp.uint8), unit


def decode_block_var(codes, scale, widths, tabs: _Tables, *, lookup, addend=None, fma=_fma):
  """codes uint32 [S, G, 16] (or [S, G, CB, P]), decoded group scale f32 [S, G]
  -> float32 shaped as codes; ``lookup(i) -> tabs.dec[i]``.

  ``addend`` (float32 shaped as codes): returns ``decode + addend`` as
  ``fma(level, scale, addend)``; the product is exact (8 x 16 significant
  bits), so a fused ``fma`` (a kernel's ``fma.rn.f32``) gives the same sum as a
  multiply and an add, unless the product is subnormal."""
  per = lambda v: _trailing(_wsel(widths, v, tabs), codes.ndim)
  # the signed level of each code from one table (tabs.dec): -lam s = -(lam s)
  lam = lookup(per(tabs.dbase) + codes.astype(jnp.int32))
  if addend is None:
    return lam * _trailing(scale, codes.ndim)
  return fma(lam, _trailing(scale, codes.ndim), addend)


# ----------------------------------------------------------------------------
# Planes and unit placement (reference byte movement).


def _geom(plane_bits: int):
  """(planes of an 8-bit code, codes per byte, bytes per plane = one unit)."""
  if plane_bits not in (1, 2):
    raise ValueError(f"plane_bits={plane_bits!r} must be 1 or 2")
  per = 8 // plane_bits
  return 8 // plane_bits, per, 256 // per


def unit_bytes(plane_bits: int = PLANE_BITS) -> int:
  return _geom(plane_bits)[2]


def _planes(codes, plane_bits: int = 2):
  """codes uint32 [S, 256] -> plane bytes uint8 [S, P, 256 / per]: plane p
  holds bits ``[p b, (p + 1) b)`` of every code, ``per = 8 / b`` codes per
  byte, LSB-first.

  Each code is read once: four codes are first packed into one uint32 word
  (a reduction, as the per-class format packs its bytes), and every plane
  byte is a bit permutation of that word. Cutting planes straight from the
  codes let XLA:CPU fuse the whole encode into each plane and recompute it
  per plane (measured 2x slower encode)."""
  planes, per, nb = _geom(plane_bits)
  s = codes.shape[0]
  c = codes.reshape(s, 256 // 4, 4)
  word = jnp.sum(c << (8 * jax.lax.broadcasted_iota(jnp.uint32, c.shape, 2)), axis=-1)
  out = []
  for p in range(planes):
    if plane_bits == 2:  # byte i of word -> bits (2p, 2p+1) at position 2i
      x = (word >> np.uint32(2 * p)) & np.uint32(0x03030303)
      byte = (x | (x >> 6) | (x >> 12) | (x >> 18)) & np.uint32(0xFF)
    else:  # two words per byte: bit p of 8 codes
      x = (word >> np.uint32(p)) & np.uint32(0x01010101)
      nib = (x | (x >> 7) | (x >> 14) | (x >> 21)) & np.uint32(0xF)
      nib = nib.reshape(s, nb, 2)
      byte = nib[..., 0] | (nib[..., 1] << 4)
    out.append(byte)
  return jnp.stack(out, axis=1).astype(jnp.uint8)


def _unplanes(planes_, plane_bits: int = 2):
  """Inverse of :func:`_planes`: uint8 [S, P, nb] -> codes uint32 [S, 256].

  Broadcast shifts over (plane, code-in-byte) and one sum over the planes,
  whose bit fields are disjoint: a handful of array ops whatever the plane
  count (a loop of P x per ops made the 1-bit layout slow to compile)."""
  planes, per, nb = _geom(plane_bits)
  s = planes_.shape[0]
  b = planes_.astype(jnp.uint32)[:, :, :, None]  # [S, P, nb, 1]
  lane = jax.lax.broadcasted_iota(jnp.uint32, (1, 1, 1, per), 3) * np.uint32(plane_bits)
  plane = jax.lax.broadcasted_iota(jnp.uint32, (1, planes, 1, 1), 1) * np.uint32(plane_bits)
  fields = ((b >> lane) & np.uint32((1 << plane_bits) - 1)) << plane  # [S, P, nb, per]
  return jnp.sum(fields, axis=1).reshape(s, 256)


def _plane_offsets(widths, plane_bits: int = 2):
  """Per plane p: (first unit, number of super-groups having plane p)."""
  planes = _geom(plane_bits)[0]
  counts = [jnp.sum((widths // plane_bits > p).astype(jnp.int32)) for p in range(planes)]
  offs, o = [], jnp.int32(0)
  for c in counts:
    offs.append(o)
    o = o + c
  return offs, counts


def _place(planes_, widths, units: int, plane_bits: int = 2):
  """[S, P, nb] planes -> [units, nb], plane-major.

  Plane p of the super-groups that have it (a prefix, widths being sorted
  widest first) occupies units ``[off_p, off_p + count_p)``. Each whole
  plane is written at its offset in turn, so the rows past ``count_p``
  (zero: a narrower code's high planes are zero) are overwritten by the
  next plane or left as the zero tail. No gather."""
  planes, _, nb = _geom(plane_bits)
  s = planes_.shape[0]
  offs, _ = _plane_offsets(widths, plane_bits)
  buf = jnp.zeros((planes * s + max(units - s, 0), nb), jnp.uint8)
  for p in range(planes):
    buf = jax.lax.dynamic_update_slice(buf, planes_[:, p], (offs[p], jnp.int32(0)))
  return buf[:units]


def _fetch(unit_bytes_, widths, plane_bits: int = 2):
  """[units, nb] -> planes [S, P, nb] (planes a super-group lacks are zero)."""
  planes, _, nb = _geom(plane_bits)
  s = widths.shape[0]
  offs, counts = _plane_offsets(widths, plane_bits)
  units = unit_bytes_.shape[0]
  pad = jnp.concatenate([unit_bytes_, jnp.zeros((max(planes * s - units, 0) + s, nb), jnp.uint8)])
  row = jnp.arange(s, dtype=jnp.int32)[:, None]
  out = [jnp.where(row < counts[p], jax.lax.dynamic_slice(pad, (offs[p], jnp.int32(0)), (s, nb)),
                   jnp.uint8(0)) for p in range(planes)]
  return jnp.stack(out, axis=1)


def _table(t):
  """``j -> t[j]`` for the encoder's in-range indices
  (:func:`~pallas_kernels.dynamiq_format.take_in_range`)."""
  t = jnp.asarray(t)
  return lambda j: F.take_in_range(t, j)


def _lookup(tabs):
  return _table(tabs.dec)


def _pairs(tabs):
  return _table(tabs.pairs)


def compress_units_reference(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                             scale_rounding="up", plane_bits: int = PLANE_BITS,
                             width_set=WIDTH_SET):
  """Compresses a chunk ``x`` float [S, 256] with per-super-group ``widths``.

  ``plane_bits=1`` (default) stores 1-bit planes (units of 32 bytes), which
  allows any width in ``width_set`` (a subset of 2..8); with 2 widths must
  be even.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]``.
  """
  tabs = _tables(eps, width_set)
  s_count = x.shape[0]
  # [S, G, 1, 16]: each last axis is one group of 16 draws (idx >> 4), its lanes static
  xb = F.materialize(x.astype(jnp.float32).reshape(s_count, F.HIER_GROUP, -1, F.rng.GROUP))
  idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
  keys = tuple(jnp.asarray(k, jnp.uint32) for k in keys)
  codes, k, unit = encode_block_var(xb, widths, tabs, pairs=_pairs(tabs), idx=idx, keys=keys,
                                    rank=jnp.asarray(rank, jnp.int32), strata=strata,
                                    scale_rounding=scale_rounding, store=None,
                                    draw_group=idx[..., :1] >> np.uint32(F.rng.GROUP_SHIFT),
                                    lane=np.arange(F.rng.GROUP, dtype=np.uint32),
                                    group_store=F.materialize)  # 8-12% less CPU time
  # Not stored (F.materialize) before the planes are cut: measured slower
  # stored (31 ms vs 8.4 ms for codes + planes of 2^20 coordinates, XLA:CPU).
  scales = jnp.concatenate([k, bf16.to_bytes(unit)], axis=-1)  # [S, 18]
  body = _place(_planes(codes.reshape(s_count, 256), plane_bits), widths, units, plane_bits)
  return jnp.concatenate([scales.reshape(-1), body.reshape(-1)])


def decompress_units_reference(payload, widths, units: int, *, eps, plane_bits: int = PLANE_BITS,
                               width_set=WIDTH_SET):
  """Inverse of :func:`compress_units_reference` (values): float32 [S, 256]."""
  tabs = _tables(eps, width_set)
  s_count = widths.shape[0]
  scales = payload[:s_count * SCALE_BYTES].reshape(s_count, SCALE_BYTES)
  body = payload[s_count * SCALE_BYTES:].reshape(units, unit_bytes(plane_bits))
  unit = bf16.from_bytes(scales[:, F.HIER_GROUP], scales[:, F.HIER_GROUP + 1])
  scale = F.hier_scale(scales[:, :F.HIER_GROUP], unit)
  codes = _unplanes(_fetch(body, widths, plane_bits), plane_bits).reshape(
      s_count, F.HIER_GROUP, -1)
  val = decode_block_var(codes, scale, widths, tabs, lookup=_lookup(tabs))
  return val.reshape(s_count, 256)


def decompress_accumulate_units_reference(payload, x, widths, units: int, *, eps,
                                          plane_bits: int = PLANE_BITS, width_set=WIDTH_SET):
  """``decompress_units_reference(payload) + x`` in float32: float32 [S, 256]."""
  return (decompress_units_reference(payload, widths, units, eps=eps, plane_bits=plane_bits,
                                     width_set=width_set) + x.astype(jnp.float32))


def decompress_accumulate_recompress_units_reference(payload, x, widths, units: int, *, eps, keys,
                                                     rank=0, strata: int = 1,
                                                     scale_rounding="up",
                                                     plane_bits: int = PLANE_BITS,
                                                     width_set=WIDTH_SET):
  """One ring hop: ``compress_units_reference(decompress_units_reference(payload) + x)``."""
  geo = dict(plane_bits=plane_bits, width_set=width_set)
  acc = decompress_accumulate_units_reference(payload, x, widths, units, eps=eps, **geo)
  return compress_units_reference(acc, widths, units, eps=eps, keys=keys, rank=rank,
                                  strata=strata, scale_rounding=scale_rounding, **geo)
