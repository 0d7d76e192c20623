"""The codes' bit planes as 32-bit words: the form the kernels move them in.

A plane byte holds one bit of 8 codes (``plane_bits=1``). The 8 codes of up
to 8 bits are an 8 x 8 bit matrix (code i, bit p), the plane bytes its
transpose (plane p, bit i). Held as words with byte i = code i (two words:
codes 0-3, 4-7), the transpose is three exchanges of index bits (Hacker's
Delight's transpose8): index bits 0 <-> 3 and 1 <-> 4 within each word (one
delta swap each), 2 <-> 5 between the two words (a nibble exchange). Codes of
at most 4 bits fit one word, code i at bit 8 (i % 4) + 4 (i // 4): its two
swaps alone give byte p = plane p. Both maps are involutions, so decode
applies the same steps to the plane bytes. These are the kernels' form of
:func:`pallas_kernels.dynamiq_reference.plane_bytes` and
:func:`~pallas_kernels.dynamiq_reference.codes_of_planes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dynamiq_block as B

__all__ = ["bit_select", "codes_to_plane_words", "byte_plane_words", "codes_to_planes",
           "code_lanes", "planes_to_codes", "plane_code_words", "codes_of_words"]


_SWAP_03, _SWAP_14 = (7, 0x00AA00AA), (14, 0x0000CCCC)


def _delta_swap(x, d: int, mask: int):
  """Exchanges the bits of ``x`` at ``mask`` with those ``d`` above them."""
  t = (x ^ (x >> np.uint32(d))) & np.uint32(mask)
  return x ^ t ^ (t << np.uint32(d))


def _swaps(x):
  return _delta_swap(_delta_swap(x, *_SWAP_03), *_SWAP_14)


def bit_select(mask: int, a, b):
  """``(a & mask) | (b & ~mask)`` (uint32; a kernel's one ``lop3``)."""
  return (a & np.uint32(mask)) | (b & np.uint32(~mask & 0xFFFFFFFF))


def _nibble_exchange(lo, hi, select=bit_select):
  """Index bit 2 <-> 5 of the 64-bit word ``(lo, hi)``: lo's high nibbles with hi's low ones
  (``select``: :func:`bit_select` or a kernel's instruction for it)."""
  m = 0x0F0F0F0F
  return select(m, lo, hi << np.uint32(4)), select(m, lo >> np.uint32(4), hi)


def codes_to_plane_words(codes, planes: int, select=bit_select, lane_axes: int = 1):
  """uint32 codes [..., 8] (below 2^planes), or [..., Q, 8 / Q] (``lane_axes=2``: a
  kernel's pieces, code ``q 8 / Q + i``) -> words (uint32 [...] each) whose byte ``p % 4``
  of word ``p // 4`` is plane byte ``p`` (its other bytes are arbitrary past ``planes``):
  what a kernel stores from, one ``prmt`` per two plane bytes. ``select``:
  :func:`bit_select` or a kernel's instruction for it."""
  lane = code_lanes(codes.shape, lane_axes)

  def packed(shift, keep=lambda lane: True):  # the codes at bits shift(lane), summed
    return B.reduce_trailing(jnp.where(keep(lane), codes << shift(lane), np.uint32(0)),
                             codes.ndim - lane_axes, B.sum_last)

  if planes <= 4:
    return [_swaps(packed(lambda lane: lane % 4 * 8 + lane // 4 * 4))]
  lo, hi = (packed(lambda lane: lane % 4 * 8, lambda lane, h=h: lane // 4 == h)
            for h in range(2))
  if planes == 5:  # planes 0-3 from the low nibbles, plane 4 by one multiply (_PLANE4)
    top = ((((lo >> np.uint32(4)) & np.uint32(0x01010101)) | (hi & np.uint32(0x10101010)))
           * np.uint32(_PLANE4)) >> np.uint32(21)
    return [_swaps(_nibble_exchange(lo, hi, select)[0]), top]
  return byte_plane_words(lo, hi, select)


def byte_plane_words(lo, hi, select=bit_select):
  """The 8 x 8 bit transposition of 8 bytes (byte i of ``lo``: byte i, of ``hi``: byte 4 +
  i) -> 2 words, byte ``t % 4`` of word ``t // 4`` holding bit ``t`` of the 8 bytes
  (:func:`codes_to_plane_words` of codes below 2^8)."""
  return list(_nibble_exchange(_swaps(lo), _swaps(hi), select))


def codes_to_planes(codes, planes: int):
  """uint32 codes [..., 8] (below 2^planes) -> ``planes`` plane bytes, uint32 [...] each."""
  words = codes_to_plane_words(codes, planes)
  return [(words[p // 4] >> np.uint32(8 * (p % 4))) & np.uint32(0xFF) for p in range(planes)]


# Bit 4 of the codes: at bits 8 k of (lo >> 4) for code k < 4, at 8 k + 4 of hi
# for code 4 + k. Times 2^0 + 2^7 + 2^14 + 2^21 every partial product lands on
# its own bit (8 k + 7 m, 8 k + 4 + 7 m; no carries), code i's at bit 21 + i.
# Its inverse spreads a nibble's bits i to bits 8 i (n * _PLANE4 & 0x01010101:
# partial products at i + 7 m, all distinct for i < 4, multiples of 8 only for
# m = i).
_PLANE4 = 0x00204081


def code_lanes(shape, lane_axes: int = 1):
  """uint32 iota of shape ``shape``: each code's index in its 8 (the last ``lane_axes``
  axes, row-major)."""
  lane, step = None, 1
  for ax in range(len(shape) - 1, len(shape) - 1 - lane_axes, -1):
    term = jax.lax.broadcasted_iota(jnp.uint32, shape, ax) * np.uint32(step)
    lane = term if lane is None else lane + term
    step *= shape[ax]
  return lane


def planes_to_codes(words, lane, planes: int, byte=None, select=bit_select):
  """Inverse of :func:`codes_to_planes`: ``words[h]`` (uint32 [...]) holds planes
  ``4 h + [0, 4)`` (byte p % 4 = plane p, zero past ``planes``) -> codes uint32
  [..., 8]; ``lane`` the codes' iota along the last axis. Code i is then
  ``byte(w, i % 4)`` of the codes' word lo (i < 4) or hi (:func:`plane_code_words`):
  byte ``i % 4`` zero-extended (None: by shifts; a kernel passes its one-instruction
  form)."""
  return codes_of_words(*plane_code_words(words, planes, select), lane, byte)


def plane_code_words(words, planes: int, select=bit_select):
  """The transposition of :func:`planes_to_codes` on whole words: ``words`` as there ->
  ``(lo, hi)`` (uint32 [...]), byte ``i`` of ``lo`` code ``i``, of ``hi`` code ``4 + i``."""
  if planes <= 5:
    w = _swaps(words[0])
    lo, hi = w & np.uint32(0x0F0F0F0F), (w >> np.uint32(4)) & np.uint32(0x0F0F0F0F)
    if planes == 5:  # plane 4's bits i to bit 4 of byte i % 4 of lo (i < 4) or hi
      b4 = words[1]
      lo = lo | (((b4 & np.uint32(0xF)) * np.uint32(_PLANE4 << 4)) & np.uint32(0x10101010))
      hi = hi | (((b4 >> np.uint32(4)) * np.uint32(_PLANE4 << 4)) & np.uint32(0x10101010))
    return lo, hi
  return _nibble_exchange(_swaps(words[0]), _swaps(words[1]), select)


def codes_of_words(lo, hi, lane, byte=None):
  """Codes uint32 [..., L] from :func:`plane_code_words`' ``(lo, hi)`` [...]: code
  ``lane`` (``lane``: uint32 iota [..., L], values in [0, 8))."""
  w = jnp.where(lane < 4, lo[..., None], hi[..., None])
  if byte is None:
    return (w >> ((lane % 4) * 8)) & np.uint32(0xFF)
  return byte(w, lane % 4)
