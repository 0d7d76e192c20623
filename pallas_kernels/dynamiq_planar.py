"""The chunk payload as aligned planes: the layout Mosaic GPU moves with block copies.

Today's payload (:mod:`pallas_kernels.dynamiq_reference`) interleaves each
super-group's 16 ``k`` bytes and its 2 bf16 scale bytes in records of
:data:`~pallas_kernels.dynamiq_reference.SCALE_BYTES` = 18 bytes, so a
block of super-groups starts at an offset that is a multiple of 18: no
aligned block copy (TMA needs 16-byte aligned starts and 16-byte multiples)
can fetch it, which is why the Triton kernels gather bytes at computed
offsets. The *planar* layout holds the same bytes as three planes::

  [k plane:     S x 16 uint8, super-group s at bytes [16 s, 16 s + 16)]
  [unit plane:  units x unit_bytes(plane_bits), exactly today's code units]
  [scale plane: S x 2 bytes, the bf16 super-group scales, little-endian]

Every plane starts at a multiple of 16 bytes (``16 S``, then ``16 S + 32
units`` or ``+ 64 units``), a block of ``b`` super-groups' ``k`` bytes is
``16 b`` contiguous bytes, and its plane units are the contiguous run
``[off_p + s0, off_p + s0 + b)`` of the unit plane, as today. The planar
payload is a byte permutation of today's: same size
(:func:`planar_bytes` equals ``payload_bytes``), so the wire bits per
coordinate of every codec configuration are unchanged, with no padding.

:func:`to_planar` and :func:`from_planar` convert between the two with
slices, reshapes and one concatenation (no gather): pure jnp, bit-exact
both ways. :func:`planes` cuts a planar payload into the word views a
Mosaic GPU kernel takes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_reference as R

__all__ = [
    "GRANULE",
    "plane_offsets",
    "planar_bytes",
    "to_planar",
    "from_planar",
    "planes",
]

GRANULE = 16
"""Bytes: alignment and size multiple of a TMA block copy; every plane starts at one."""


def plane_offsets(supergroups: int, units: int, plane_bits: int = R.PLANE_BITS):
  """Byte offsets ``(k, units, scale, end)`` of the planes of a planar payload.

  Args:
    supergroups: super-groups ``S`` of the chunk.
    units: code units of the payload.
    plane_bits: 1 or 2 (unit bytes 32 or 64).

  Returns:
    Four ints; ``end`` equals ``payload_bytes(supergroups, units, plane_bits)``.
  """
  ub = R.unit_bytes(plane_bits)
  k0 = 0
  u0 = k0 + supergroups * B.GROUP
  s0 = u0 + units * ub
  end = s0 + 2 * supergroups
  return k0, u0, s0, end


def planar_bytes(supergroups: int, units: int, plane_bits: int = R.PLANE_BITS) -> int:
  """Bytes of a planar payload: the same as today's :func:`~pallas_kernels.dynamiq_reference.payload_bytes`."""
  return plane_offsets(supergroups, units, plane_bits)[3]


def _check(payload, supergroups, units, plane_bits):
  size = R.payload_bytes(supergroups, units, plane_bits)
  if payload.shape != (size,) or payload.dtype != jnp.uint8:
    raise ValueError(f"payload {payload.dtype}{list(payload.shape)} must be uint8 [{size}] "
                     f"(payload_bytes({supergroups}, {units}, {plane_bits}))")


def to_planar(payload, supergroups: int, units: int, plane_bits: int = R.PLANE_BITS):
  """Today's record payload -> the planar payload (same bytes, same size).

  Args:
    payload: uint8 ``[payload_bytes(S, units, plane_bits)]`` in the record
      layout of :func:`~pallas_kernels.dynamiq_reference.compress_reference`.
    supergroups: ``S``.
    units: code units.
    plane_bits: 1 or 2.

  Returns:
    uint8 of the same shape, in the planar layout.

  Raises:
    ValueError: ``payload`` is not uint8 of that size.
  """
  _check(payload, supergroups, units, plane_bits)
  rec = payload[:supergroups * R.SCALE_BYTES].reshape(supergroups, R.SCALE_BYTES)
  body = payload[supergroups * R.SCALE_BYTES:]
  return jnp.concatenate([rec[:, :B.GROUP].reshape(-1), body, rec[:, B.GROUP:].reshape(-1)])


def from_planar(planar, supergroups: int, units: int, plane_bits: int = R.PLANE_BITS):
  """Inverse of :func:`to_planar`: the planar payload -> today's record payload."""
  _check(planar, supergroups, units, plane_bits)
  k0, u0, s0, end = plane_offsets(supergroups, units, plane_bits)
  k = planar[k0:u0].reshape(supergroups, B.GROUP)
  sc = planar[s0:end].reshape(supergroups, 2)
  return jnp.concatenate([jnp.concatenate([k, sc], axis=1).reshape(-1), planar[u0:s0]])


def _words(bytes_, dtype):
  """uint8 [n] -> [n / itemsize] of ``dtype`` (little-endian)."""
  size = jnp.dtype(dtype).itemsize
  return jax.lax.bitcast_convert_type(bytes_.reshape(-1, size), dtype)


def planes(planar, supergroups: int, units: int, plane_bits: int = R.PLANE_BITS):
  """The planes of a planar payload as the word arrays a kernel reads.

  Returns:
    ``(k, units_, scale)``: uint16 ``[S * 8]`` (element ``8 s + j`` holds
    ``k`` of scale groups ``2 j`` (low byte) and ``2 j + 1`` of super-group
    ``s``), uint32 ``[units * unit_bytes / 4]`` (the code units, word ``i``
    of unit ``u`` at ``u * unit_bytes / 4 + i``, bit ``b`` of a word = code bit
    of element ``32 i + b`` for ``plane_bits=1``) and uint16 ``[S]`` (bf16
    bits of the super-group scales).
  """
  _check(planar, supergroups, units, plane_bits)
  k0, u0, s0, end = plane_offsets(supergroups, units, plane_bits)
  return (_words(planar[k0:u0], jnp.uint16), _words(planar[u0:s0], jnp.uint32),
          _words(planar[s0:end], jnp.uint16))
