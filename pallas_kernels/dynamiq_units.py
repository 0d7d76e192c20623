"""PROTOTYPE: a unit-packed DynamiQ chunk whose per-super-group widths are data.

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
and its division-free rounding (:func:`_round_levels_var` repeats
``_round_levels`` line for line with the width's constants as per-super-group
arrays: a concatenated level table ``[lam_2 | lam_3 | ...]`` indexed at a
per-super-group base). So with the same draws a super-group gets exactly
the code the per-class format gives it (tested), and one code path serves
every width (no per-class launches, no static capacities).

Only hierarchical MEE scales with ``scale_rounding="up"`` or
``"stochastic"`` are supported (the codec's defaults).
"""

from __future__ import annotations

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
    self.base = np.array(base, np.int32)
    self.r = np.array(r, np.int32)
    self.c1 = np.array(c1, np.float32)
    self.c2 = np.array(c2, np.float32)


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


def _round_levels_var(a, s, lookup, base, r, c1, c2, u_scaled, q: int, log2=jnp.log2):
  """:func:`pallas_kernels.dynamiq_format._round_levels` with the width's
  constants as arrays broadcast against ``a`` (``base`` indexes the
  concatenated table).

  The first guess is the MEE log formula for every width, ``floor(log2(1 +
  t c1) / log2(1 + 2 eps^2))`` with ``t = a / s``; for the ternary 2-bit
  width it is clipped to ``r - 1 = 0``, the only bracket, so no select is
  needed. It is computed cheaply: ``1 / s`` once per group (``s`` is the
  group's scale, broadcast), then per coordinate two multiplies, a multiply-
  add and a base-2 log (one MUFU instruction on a GPU) instead of a division
  and ``log1p``. Groups with ``s < 2^-100`` are scaled by ``2^24`` first
  (exact) so that the reciprocal stays finite. Only the guess changes: it is
  within one level of the exact bracket for every width 2..8 and ``a`` in
  ``[0, s]`` (``a`` next to every level boundary, checked in
  ``tests/test_dynamiq_units.py``), and the two correction steps below then
  find that bracket whatever the guess, so the codes are the ones the
  division and ``log1p`` gave, bit for bit, on every backend, and ``log2``
  may be any approximation with an error well below a level (the kernels
  pass the GPU's ``lg2.approx.f32``, absolute error below 2^-22)."""
  f = jnp.where(s < np.float32(2.0**-100), np.float32(2.0**24), np.float32(1.0))
  rcp = 1.0 / (jnp.where(s > 0, s, 1.0) * f)  # per group
  t = (a * f) * rcp  # a guess only
  approx = log2(1.0 + t * c1) * c2
  j = jnp.clip(jnp.floor(approx), 0, r - 1).astype(jnp.int32)
  lk = lambda i: lookup(base + i)
  j = jnp.maximum(j - (a < lk(j) * s).astype(jnp.int32), 0)
  j = jnp.minimum(j + (a >= lk(j + 1) * s).astype(jnp.int32), r - 1)
  lo = lk(j) * s  # exact
  hi = lk(j + 1) * s  # exact
  up = u_scaled * (hi - lo) < (a - lo) * np.float32(q)
  return j + up.astype(jnp.int32)


def encode_block_var(x, widths, tabs: _Tables, *, lookup, idx, keys, rank, strata: int,
                     scale_rounding="up", store=None, log2=jnp.log2):
  """Quantises a block of super-groups, each at its own width.

  Args:
    x: float32 [S, G, 16] values (G = 16 hierarchical groups), or the same
      as [S, G, CB, P] (the kernels' view, P codes per plane byte).
    widths: int32 [S].
    idx: uint32 RNG counters, shaped as ``x``.
    log2: the base-2 log of the first guess of each level (any approximation
      within 2^-20 of it gives the same codes; :func:`_round_levels_var`).

  Returns:
    ``(codes uint32 shaped as x in [0, 2^w - 2], k uint8 [S, G], unit f32 [S])``.
  """
  a = jnp.abs(x)
  fmt8 = F.Format(bits=8, scale_rounding=scale_rounding)  # top = 1: same scales for all widths
  a4 = _trailing(a, 4)  # the format's [S, G, CB, P] view (P = 1 for [S, G, 16])
  group_idx = jnp.min(jnp.min(_trailing(idx, 4), axis=-1), axis=-1) // np.uint32(F.HIER_GROUP)
  k, unit, s = F._scales_hier(a4, fmt8, keys, group_idx)
  q = F.rng.strata_count(strata)
  u = F._uniforms(idx, keys, rank, strata)
  u = jnp.where(x < 0, np.float32(q) - u, u)
  if store is not None:
    u = store(u)
  per = lambda v: _trailing(_wsel(widths, v, tabs), x.ndim)
  r = per(tabs.r)
  lvl = _round_levels_var(a, _trailing(s, x.ndim), lookup, per(tabs.base), r, per(tabs.c1),
                          per(tabs.c2), u, q, log2)
  codes = jnp.where(x < 0, r - lvl, r + lvl).astype(jnp.uint32)
  return codes, k.astype(jnp.uint8), unit


def decode_block_var(codes, scale, widths, tabs: _Tables, *, lookup):
  """codes uint32 [S, G, 16] (or [S, G, CB, P]), decoded group scale f32 [S, G]
  -> float32 shaped as codes."""
  per = lambda v: _trailing(_wsel(widths, v, tabs), codes.ndim)
  lvl = codes.astype(jnp.int32) - per(tabs.r)
  val = lookup(per(tabs.base) + jnp.abs(lvl)) * _trailing(scale, codes.ndim)  # exact product
  return jnp.where(lvl < 0, -val, val)


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


def _lookup(tabs):
  t = jnp.asarray(tabs.table)
  return lambda j: jnp.take(t, j)


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
  xb = F.materialize(x.astype(jnp.float32).reshape(s_count, F.HIER_GROUP, -1))
  idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
  keys = tuple(jnp.asarray(k, jnp.uint32) for k in keys)
  codes, k, unit = encode_block_var(xb, widths, tabs, lookup=_lookup(tabs), idx=idx, keys=keys,
                                    rank=jnp.asarray(rank, jnp.int32), strata=strata,
                                    scale_rounding=scale_rounding, store=None)
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
