"""DynamiQ's chunk payload and its pure-jnp reference: the product path on CPU.

One ring chunk of ``S`` super-groups, each at its own width (data: int32
``[S]``, widest first, each in ``width_set``), travels as one static
payload (:func:`payload_bytes`)::

  [S scale records: 16 uint8 k_g + 2-byte bf16 super-group scale]   (SCALE_BYTES each)
  [units code units of 32 * plane_bits bytes, plane-major]

A w-bit code is stored as ``w`` one-bit *planes* (``plane_bits=1``, the
default; units of 32 bytes) or ``w / 2`` two-bit planes (``plane_bits=2``,
units of 64 bytes; even widths only): plane ``p`` of a super-group holds bits
``[p b, (p + 1) b)`` of its 256 codes, ``8 / b`` codes per byte, LSB-first
(one code unit). Units are plane-major: plane p of every super-group that
has it (a prefix of the chunk, widths being sorted) occupies units ``[off_p,
off_p + count_p)``, ``off`` the exclusive prefix sum of ``count_p`` (the
number of super-groups with more than ``p`` planes); unused units at the end
are zero. Placement is one contiguous copy per plane at a data-dependent
offset (no gather). A super-group of width w takes ``32 w + 18`` bytes; the
number of units is static (the budget), the widths are per round.

The arithmetic is :mod:`pallas_kernels.dynamiq_block`'s, shared with the
Pallas kernels (:mod:`pallas_kernels.dynamiq_triton`), so kernel and
reference give the same bits; :mod:`pallas_kernels.dynamiq` chooses between
them. The reference stores a few intermediates (:func:`materialize`) so
that XLA:CPU keeps its loops vectorised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import bf16
from pallas_kernels import dynamiq_block as B
from pallas_kernels import rng

__all__ = [
    "SCALE_BYTES", "WIDTH_SET", "PLANE_BITS", "unit_bytes", "payload_bytes", "check_chunk",
    "position_widths", "plane_table_of_counts", "row_means", "row_squares", "row_terms",
    "plane_bytes", "codes_of_planes", "take_in_range",
    "materialize", "compress_reference", "decompress_reference",
    "decompress_accumulate_reference", "decompress_accumulate_recompress_reference",
    "check_payloads", "decompress_many_reference", "rows_of_decoded",
    "decompress_rows_reference",
    "decompress_sum_reference",
]

SCALE_BYTES = B.GROUP + 2
"""Bytes of a super-group's scale record: 16 ``k`` bytes and the bf16 super-group scale."""
WIDTH_SET = (2, 3, 4, 5, 6, 8)
"""Default code widths of a chunk."""
PLANE_BITS = 1
"""Default bits per plane (code units of ``32 * PLANE_BITS`` bytes)."""


def _geom(plane_bits: int):
  """(planes of an 8-bit code, codes per byte, bytes per plane = one unit)."""
  if plane_bits not in (1, 2):
    raise ValueError(f"plane_bits={plane_bits!r} must be 1 or 2")
  per = 8 // plane_bits
  return 8 // plane_bits, per, 256 // per


def unit_bytes(plane_bits: int = PLANE_BITS) -> int:
  """Bytes of one code unit: one plane of a super-group's 256 codes."""
  return _geom(plane_bits)[2]


def payload_bytes(supergroups: int, units: int, plane_bits: int = PLANE_BITS) -> int:
  """Bytes of a chunk payload: ``supergroups`` scale records and ``units`` code units."""
  return supergroups * SCALE_BYTES + units * unit_bytes(plane_bits)


def check_chunk(widths, units, *, plane_bits, width_set, scale_rounding="up", x=None,
                payload=None):
  """Raises ValueError, naming the value, unless the operands describe one chunk:
  ``widths`` int [S], ``units`` a static int, ``x`` [S, 256], ``payload``
  uint8 ``[payload_bytes(S, units, plane_bits)]``, ``width_set`` within 2..8."""
  unit_bytes(plane_bits)  # checks plane_bits
  ws = tuple(int(w) for w in width_set)
  if not ws or min(ws) < 2 or max(ws) > 8:
    raise ValueError(f"width_set={width_set} must be a non-empty subset of 2..8")
  if scale_rounding not in ("up", "stochastic"):
    raise ValueError(f"{scale_rounding=} must be 'up' or 'stochastic'")
  if not isinstance(units, (int, np.integer)) or units < 0:
    raise ValueError(f"{units=} must be a static non-negative int")
  if widths.ndim != 1 or not jnp.issubdtype(widths.dtype, jnp.integer):
    raise ValueError(f"widths {widths.dtype}{list(widths.shape)} must be int32 [supergroups]")
  s_count = widths.shape[0]
  if x is not None and x.shape != (s_count, B.SUPERGROUP):
    raise ValueError(f"x.shape={x.shape} must be [{s_count}, {B.SUPERGROUP}] (widths: "
                     f"{s_count} super-groups)")
  size = payload_bytes(s_count, units, plane_bits)
  if payload is not None and (payload.shape != (size,) or payload.dtype != jnp.uint8):
    raise ValueError(f"payload {payload.dtype}{list(payload.shape)} must be uint8 [{size}] "
                     f"(payload_bytes({s_count}, {units}, {plane_bits}))")


def check_payloads(payloads, widths, units, *, plane_bits, width_set, slots=None, mean=None,
                   rotate=0):
  """Raises ValueError, naming the value, unless ``payloads`` are ``n`` chunk payloads of
  the same ``widths`` (uint8 ``[n, payload_bytes(S, units, plane_bits)]``, see
  :func:`check_chunk`), ``slots`` int [R] and ``mean`` float [R] (the same R), and
  ``rotate`` a Python int in ``[0, n)``."""
  if getattr(payloads, "ndim", None) != 2:
    raise ValueError(f"payloads {getattr(payloads, 'dtype', type(payloads))}"
                     f"{list(getattr(payloads, 'shape', []))} must be uint8 [n, bytes]: n chunk "
                     "payloads, stacked")
  check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
              payload=jax.ShapeDtypeStruct(payloads.shape[1:], payloads.dtype))
  if slots is not None and (slots.ndim != 1 or not jnp.issubdtype(slots.dtype, jnp.integer)):
    raise ValueError(f"slots {slots.dtype}{list(slots.shape)} must be int32 [rows]")
  if mean is not None and (slots is None or mean.ndim not in (1, 2)
                           or mean.shape[0] != slots.shape[0]):
    raise ValueError(f"mean {mean.dtype}{list(mean.shape)} must be float [rows] (or [rows, k] "
                     f"statistics, the mean in column 0), one per slot (slots: "
                     f"{None if slots is None else list(slots.shape)})")
  if not isinstance(rotate, (int, np.integer)) or not 0 <= rotate < payloads.shape[0]:
    raise ValueError(f"rotate={rotate!r} must be a Python int in [0, {payloads.shape[0]}) "
                     "(chunk c is payload (c + rotate) % n)")


def position_widths(counts, width_set, supergroups: int):
  """int32 [supergroups]: the width of each position of a chunk, widest first.

  Args:
    counts: int32 ``[len(width_set)]``, positions per width in ascending width
      order, summing to ``supergroups``.
    width_set: the widths.
    supergroups: positions in the chunk (static).
  """
  j = jnp.arange(supergroups, dtype=jnp.int32)
  ws = sorted(width_set, reverse=True)
  out = jnp.full((supergroups,), ws[-1], jnp.int32)
  end = jnp.int32(0)
  for i, w in zip(range(len(ws) - 1, -1, -1), ws):  # widest first
    start, end = end, end + counts[i]
    out = jnp.where((j >= start) & (j < end), w, out)
  return out


def plane_table_of_counts(counts, width_set, plane_bits: int, units: int, p):
  """Entry ``p`` of the plane-offset table of a chunk whose positions take ``counts[i]``
  of width ``sorted(width_set)[i]``: ``min(sum_i counts[i] min(w_i / plane_bits,
  min(p, 8 / plane_bits)), units)``, the first unit of plane p (past the last plane:
  the units used). ``counts``: a sequence of int32 values (scalars, or arrays that
  broadcast with ``p``); ``p``: int32. Integers: the same in any order, so the
  allocation kernel makes it from its counts as the hops' wrappers do."""
  q = jnp.minimum(p, 8 // plane_bits)
  ws = sorted(int(w) for w in width_set)
  if len(counts) != len(ws):
    raise ValueError(f"{len(counts)} counts for width_set={tuple(ws)}; give one per width")
  total = sum(c * jnp.minimum(q, w // plane_bits) for c, w in zip(counts, ws))
  return jnp.minimum(total, units).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Planes and unit placement.


def plane_bytes(codes, plane_bits: int = 2):
  """codes uint32 [S, 256] -> plane bytes uint8 [S, P, 256 / per]: plane p
  holds bits ``[p b, (p + 1) b)`` of every code, ``per = 8 / b`` codes per
  byte, LSB-first.

  Each code is read once: four codes are first packed into one uint32 word
  (a reduction), and every plane byte is a bit permutation of that word.
  Cutting planes straight from the codes lets XLA:CPU fuse the whole encode
  into each plane and recompute it per plane."""
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


def codes_of_planes(planes_, plane_bits: int = 2):
  """Inverse of :func:`plane_bytes`: uint8 [S, P, nb] -> codes uint32 [S, 256].

  Broadcast shifts over (plane, code-in-byte) and one sum over the planes,
  whose bit fields are disjoint: a handful of array ops whatever the plane
  count."""
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


def place_planes(planes_, widths, units: int, plane_bits: int = 2):
  """[S, P, nb] planes -> [units, nb], plane-major.

  Each whole plane is written at its offset in turn, so the rows past
  ``count_p`` (zero: a narrower code's high planes are zero) are overwritten
  by the next plane or left as the zero tail. No gather."""
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


# ----------------------------------------------------------------------------
# XLA:CPU helpers.


def take_in_range(a, idx):
  """``a[idx]`` for indices known to be in range (an encoder's codes, a
  permutation): an unsigned gather without jnp's negative-index and
  out-of-range fill code, which XLA:CPU would otherwise evaluate per element.
  (An out-of-range index would read a clamped entry, never outside ``a``:
  XLA's gather clamps.)"""
  return jnp.asarray(a).at[jnp.asarray(idx).astype(jnp.uint32)].get(mode="promise_in_bounds")


def materialize(value):
  """``value``, stored to memory before any consumer reads it (XLA:CPU).

  XLA fuses a producer into every consumer that it judges cheap to
  recompute. For the encode that means its whole input computation (a ring
  hop's decode: plane unpacking, level lookup, scale) lands inside the
  encode loop, where it is evaluated once per use and the merged loop no
  longer vectorises. ``jax.lax.optimization_barrier`` does not prevent this
  on XLA:CPU (it is expanded away before fusion); a while loop's body is its
  own computation, so a loop that runs exactly once, from a start that XLA
  cannot fold to a constant (derived from the data), stores its result.
  Identity on values, so bit-exactness is unaffected whatever a compiler
  does with it. The reference uses it, and so does the DynamiQ codec for
  each bucket's output (else XLA:CPU fuses every bucket's final decode into
  the loop that concatenates the buckets).

  The loop is XLA:CPU's workaround only: it is chosen by the platform being
  lowered for (``jax.lax.platform_dependent``), and a lowering for any
  other platform (the reference forced on GPU with ``implementation="xla"``,
  or a kernel's fallback) gets ``value`` itself.
  """
  if value.size == 0:
    return value

  def stored(value):
    first = jnp.ravel(value)[0].astype(jnp.float32)
    start = jnp.minimum(jax.lax.bitcast_convert_type(first, jnp.uint32), jnp.uint32(0))
    # the carry starts as the first element broadcast (no zero-filled buffer of its own)
    _, out = jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, value),
                                (start, jnp.broadcast_to(jnp.ravel(value)[0], value.shape)))
    return out

  return jax.lax.platform_dependent(value, cpu=stored, default=lambda value: value)


def _table(t):
  """``j -> t[j]`` for in-range indices (:func:`take_in_range`)."""
  t = jnp.asarray(t)
  return lambda j: take_in_range(t, j)


# ----------------------------------------------------------------------------
# The four operations.


def compress_reference(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                       scale_rounding="up", plane_bits: int = PLANE_BITS, width_set=WIDTH_SET):
  """Compresses a chunk ``x`` float [S, 256] with per-super-group ``widths``.

  Args:
    x: float32, bfloat16 or float16 [S, 256] (computed in float32).
    widths: int32 [S], widest first, each in ``width_set``.
    units: code units of the payload (static).
    eps: MEE eps per width: a dict or ``(width, eps)`` pairs (others interpolated).
    keys: ``(k0, k1, s0, s1)`` uint32 scalars: the private rounding key and the
      shared stratum key (:func:`pallas_kernels.rng.derive_key`).
    rank: int32 scalar, this rank (used when ``strata > 1``).
    strata: 1 (independent rounding) or n (correlated over n ranks).
    scale_rounding: ``"up"`` or ``"stochastic"``.
    plane_bits: 1 (32-byte units, any widths) or 2 (64-byte units, even widths).
    width_set: the widths the chunk may use (a subset of 2..8).

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]``.
  """
  check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
              scale_rounding=scale_rounding, x=x)
  tabs = B.level_tables(eps, width_set)
  s_count = x.shape[0]
  # [S, G, 1, 16]: each last axis is one group of 16 draws (idx >> 4), its lanes static
  xb = materialize(x.astype(jnp.float32).reshape(s_count, B.GROUP, -1, rng.GROUP))
  idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
  keys = tuple(jnp.asarray(k, jnp.uint32) for k in keys)
  codes, k, sg_scale = B.encode_block(
      xb, widths, tabs, keys=keys, rank=jnp.asarray(rank, jnp.int32), strata=strata, idx=idx,
      draw_group=idx[..., :1] >> np.uint32(rng.GROUP_SHIFT),
      lane=np.arange(rng.GROUP, dtype=np.uint32), scale_rounding=scale_rounding,
      pairs=_table(tabs.pairs), group_store=materialize, recip=_table(B.reciprocal_tables()))
  # the codes are not stored (materialize) before the planes are cut: XLA:CPU is faster fused
  scales = jnp.concatenate([k, bf16.to_bytes(sg_scale)], axis=-1)  # [S, 18]
  body = place_planes(plane_bytes(codes.reshape(s_count, 256), plane_bits), widths, units,
                      plane_bits)
  return jnp.concatenate([scales.reshape(-1), body.reshape(-1)])


def decompress_reference(payload, widths, units: int, *, eps, plane_bits: int = PLANE_BITS,
                         width_set=WIDTH_SET):
  """Inverse of :func:`compress_reference` (values): float32 [S, 256]."""
  check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set, payload=payload)
  tabs = B.level_tables(eps, width_set)
  s_count = widths.shape[0]
  scales = payload[:s_count * SCALE_BYTES].reshape(s_count, SCALE_BYTES)
  body = payload[s_count * SCALE_BYTES:].reshape(units, unit_bytes(plane_bits))
  sg_scale = bf16.from_bytes(scales[:, B.GROUP], scales[:, B.GROUP + 1])
  scale = B.decoded_scale(scales[:, :B.GROUP], sg_scale)
  codes = codes_of_planes(_fetch(body, widths, plane_bits), plane_bits).reshape(
      s_count, B.GROUP, -1)
  val = B.decode_block(codes, scale, widths, tabs, lookup=_table(tabs.dec))
  return val.reshape(s_count, 256)


def decompress_accumulate_reference(payload, x, widths, units: int, *, eps,
                                    plane_bits: int = PLANE_BITS, width_set=WIDTH_SET):
  """``decompress_reference(payload) + x`` in float32: float32 [S, 256]."""
  return (decompress_reference(payload, widths, units, eps=eps, plane_bits=plane_bits,
                               width_set=width_set) + x.astype(jnp.float32))


def decompress_accumulate_recompress_reference(payload, x, widths, units: int, *, eps, keys,
                                               rank=0, strata: int = 1, scale_rounding="up",
                                               plane_bits: int = PLANE_BITS,
                                               width_set=WIDTH_SET):
  """One ring hop: ``compress_reference(decompress_reference(payload) + x)``; the sum
  is stored once between the two halves (:func:`materialize`)."""
  geo = dict(plane_bits=plane_bits, width_set=width_set)
  acc = decompress_accumulate_reference(payload, x, widths, units, eps=eps, **geo)
  return compress_reference(acc, widths, units, eps=eps, keys=keys, rank=rank, strata=strata,
                            scale_rounding=scale_rounding, **geo)


def decompress_many_reference(payloads, widths, units: int, *, eps,
                              plane_bits: int = PLANE_BITS, width_set=WIDTH_SET):
  """``n`` chunk payloads uint8 [n, bytes], all of the same ``widths``, decoded: float32
  [n, S, 256], payload by payload as :func:`decompress_reference` (the same bits)."""
  check_payloads(payloads, widths, units, plane_bits=plane_bits, width_set=width_set)
  return jax.vmap(lambda p: decompress_reference(p, widths, units, eps=eps,
                                                 plane_bits=plane_bits,
                                                 width_set=width_set))(payloads)


def decompress_rows_reference(payloads, widths, units: int, slots, mean=None, *, eps,
                                plane_bits: int = PLANE_BITS, width_set=WIDTH_SET,
                                rotate: int = 0, dtype=jnp.float32, row_sum=None):
  """Rows of the ``n`` decoded payloads, gathered, plus a mean: [R, 256] of ``dtype``
  (computed in float32, then rounded to ``dtype``); with ``row_sum``, ``(rows,``
  :func:`row_terms` ``of the float32 rows)``.

  Row r is slot ``slots[r]`` of the decoded chunks interleaved by position (slot ``j n
  + c``: position j of chunk c; an out-of-range slot reads the nearest one), plus
  ``mean[r]`` when given: a codec's finish (the chunks' super-groups put back in
  their order, the means added) in one pass.

  Args:
    payloads: uint8 [n, bytes]: the chunk payloads, all of the same ``widths``.
    widths: int32 [S].
    units: code units of each payload (static).
    slots: int32 [R], each in ``[0, n S)``.
    mean: float [R], or [R, k] statistics with the mean in column 0 (:func:`row_means`), or
      None.
    eps, plane_bits, width_set: as :func:`decompress_reference`.
    rotate: chunk c is payload ``(c + rotate) % n`` (static): payloads gathered in rank
      order where rank ``(c + rotate) % n`` holds chunk c, read without a copy in chunk
      order.
    dtype: the rows' dtype (static).
  """
  check_payloads(payloads, widths, units, plane_bits=plane_bits, width_set=width_set,
                 slots=slots, mean=mean, rotate=rotate)
  dec = decompress_many_reference(payloads, widths, units, eps=eps, plane_bits=plane_bits,
                                  width_set=width_set)
  rows = rows_of_decoded(dec, slots, mean, rotate)
  return rows_and_terms(rows, mean, widths, slots, dec.shape[0], dtype, row_sum)


def row_squares(rows, mean=None):
  """float32 [R]: each float32 row's sum of squares less its mean (``mean`` as
  :func:`row_means` takes it, or None), what a codec's error estimate reads of its
  finished rows."""
  r = rows if mean is None else rows - row_means(mean)[:, None]
  return jnp.sum(r * r, axis=-1)


def row_means(mean):
  """float32 [R]: ``mean`` float [R], or column 0 of float [R, k] statistics (a codec's,
  which the kernels read in place)."""
  return (mean if mean.ndim == 1 else mean[:, 0]).astype(jnp.float32)


def row_terms(rows, mean, widths, slots, n: int, row_sum):
  """float32 [R]: each of the float32 ``rows``' (of ``slots``, n payloads of ``widths``)
  ``row_sum(sq, norm, width)``: ``sq`` their :func:`row_squares`, ``norm`` column 1 of
  ``mean`` statistics ``[R, k >= 2]`` (None otherwise), ``width`` the width of the row's
  position (slot // n): a codec's error estimate from what its finish has in hand."""
  norm = None if mean is None or mean.ndim < 2 else mean[:, 1].astype(jnp.float32)
  # the slots clamped as rows_of_decoded reads them; >= 0, so an unsigned division (jnp's
  # floor division of int32 adds ~17 instructions of sign handling)
  slot = jnp.clip(slots, 0, n * widths.shape[0] - 1).astype(jnp.uint32)
  width = take_in_range(widths, jax.lax.div(slot, np.uint32(n)))
  return row_sum(row_squares(rows, mean), norm, width)


def rows_and_terms(rows, mean, widths, slots, n: int, dtype, row_sum):
  """The float32 ``rows`` rounded to ``dtype``, and with ``row_sum`` their
  :func:`row_terms` beside them."""
  out = rows.astype(dtype)
  return out if row_sum is None else (out, row_terms(rows, mean, widths, slots, n, row_sum))


def rows_of_decoded(dec, slots, mean=None, rotate: int = 0):
  """:func:`decompress_rows_reference`'s rows from the decoded payloads ``dec`` float32
  [n, S, 256] (payload ``(c + rotate) % n`` is chunk c): slot ``slots[r]`` of the chunks
  interleaved by position, plus ``mean[r]``."""
  dec = jnp.roll(dec, -rotate, axis=0) if rotate else dec  # chunk order
  out = take_in_range(dec.transpose(1, 0, 2).reshape(-1, dec.shape[-1]), slots)
  return out if mean is None else out + row_means(mean)[:, None]


_UNROLL_SUM = 17  # payloads decompress_sum_reference adds unrolled; more in a loop


def decompress_sum_reference(payloads, widths, units: int, *, eps,
                             plane_bits: int = PLANE_BITS, width_set=WIDTH_SET):
  """The sum of ``n`` decoded chunk payloads (uint8 [n, bytes], the same ``widths``) in
  rank order, ``dec[n-1] + (... + (dec[1] + dec[0]))``: float32 [S, 256], the bits of
  :func:`decompress_reference` of payload 0 followed by
  :func:`decompress_accumulate_reference` of each next one."""
  check_payloads(payloads, widths, units, plane_bits=plane_bits, width_set=width_set)
  dec = decompress_many_reference(payloads, widths, units, eps=eps, plane_bits=plane_bits,
                                  width_set=width_set)
  n = dec.shape[0]
  if n <= _UNROLL_SUM:
    acc = dec[0]
    for c in range(1, n):
      acc = dec[c] + acc
    return acc
  return jax.lax.fori_loop(1, n, lambda c, acc: dec[c] + acc, dec[0])
