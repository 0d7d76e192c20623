"""Exact round-to-nearest-even conversion to the OCP MX element formats.

XLA on CPU cannot convert to the 6-bit float types (it fails to lower the
conversion), so the element formats are implemented here with float32
arithmetic that is exact: the quantum ``2^(e - m)`` is a power of two, so
``a / q`` is exact and ``round-half-even(a / q) * q`` is the correctly rounded
value. Conversion *saturates* (values beyond the largest normal clamp to it),
as OCP MX v1.0 §6.3 requires. Tests compare every format with ``ml_dtypes``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["Minifloat", "ELEMENTS", "pack_bits", "unpack_bits"]


@dataclasses.dataclass(frozen=True)
class Minifloat:
  """A sign + exponent + mantissa element format (no inf; saturating)."""

  name: str
  ebits: int
  mbits: int
  bias: int
  max: float
  ml_dtype: type

  @property
  def bits(self) -> int:
    return 1 + self.ebits + self.mbits

  @property
  def emin(self) -> int:
    return 1 - self.bias

  @property
  def emax(self) -> int:
    """Exponent of the largest normal power of two (OCP's emax_elem)."""
    return int(np.floor(np.log2(self.max)))

  def quantize(self, v):
    """float32 -> (nearest-even representable value, code uint32); saturating.

    NaN inputs give NaN values (codes are then meaningless: MX carries NaN in
    the block scale).
    """
    v = jnp.asarray(v, jnp.float32)
    a = jnp.minimum(jnp.abs(v), np.float32(self.max))
    _, e = jnp.frexp(a)  # a = f 2^e, f in [0.5, 1): floor(log2 a) = e - 1
    ee = jnp.maximum(e - 1, self.emin)
    q = jnp.ldexp(jnp.float32(1), ee - self.mbits)
    r = jnp.round(a / q) * q  # exact: q is a power of two; ties to even
    neg = jnp.signbit(v)
    # code fields, exact integer arithmetic on the grid value
    _, e2 = jnp.frexp(r)
    normal = (r > 0) & (e2 - 1 >= self.emin)
    expo = jnp.where(normal, e2 - 1 + self.bias, 0)
    mant_scale = jnp.where(normal, e2 - 1, self.emin)
    mant = jnp.ldexp(r, self.mbits - mant_scale)  # integer-valued
    mant = jnp.where(normal, mant - (1 << self.mbits), mant)
    code = ((neg.astype(jnp.uint32) << (self.ebits + self.mbits))
            | (expo.astype(jnp.uint32) << self.mbits)
            | jnp.nan_to_num(mant).astype(jnp.uint32))
    value = jnp.where(neg, -r, r)
    return jnp.where(jnp.isnan(v), v, value), code

  def decode(self, code):
    """uint codes -> float32 values."""
    code = code.astype(jnp.uint32)
    sign = (code >> (self.ebits + self.mbits)) & 1
    expo = ((code >> self.mbits) & ((1 << self.ebits) - 1)).astype(jnp.int32)
    mant = (code & ((1 << self.mbits) - 1)).astype(jnp.float32)
    sub = jnp.ldexp(mant, self.emin - self.mbits)
    nor = jnp.ldexp(mant + (1 << self.mbits), expo - self.bias - self.mbits)
    val = jnp.where(expo == 0, sub, nor)
    return jnp.where(sign == 1, -val, val)


ELEMENTS = {
    "e4m3": Minifloat("e4m3", 4, 3, 7, 448.0, ml_dtypes.float8_e4m3fn),
    "e5m2": Minifloat("e5m2", 5, 2, 15, 57344.0, ml_dtypes.float8_e5m2),
    "e3m2": Minifloat("e3m2", 3, 2, 3, 28.0, ml_dtypes.float6_e3m2fn),
    "e2m3": Minifloat("e2m3", 2, 3, 1, 7.5, ml_dtypes.float6_e2m3fn),
    "e2m1": Minifloat("e2m1", 2, 1, 1, 6.0, ml_dtypes.float4_e2m1fn),
}
"""MXFP8 = e4m3 (or e5m2), MXFP6 = e3m2 (or e2m3), MXFP4 = e2m1."""


def pack_bits(codes, bits: int):
  """uint codes [..., L] (< 2**bits, bits in {4, 6, 8}) -> uint8 [..., L*bits/8], LSB-first."""
  codes = codes.astype(jnp.uint32)
  if bits == 8:
    return codes.astype(jnp.uint8)
  if bits == 4:
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(jnp.uint8)
  if bits == 6:
    c = codes.reshape(*codes.shape[:-1], -1, 4)
    w = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    b = jnp.stack([w & 0xFF, (w >> 8) & 0xFF, w >> 16], axis=-1)
    return b.reshape(*codes.shape[:-1], -1).astype(jnp.uint8)
  raise ValueError(f"{bits=} must be 4, 6 or 8")


def unpack_bits(packed, bits: int):
  """Inverse of :func:`pack_bits` -> uint32 codes."""
  p = packed.astype(jnp.uint32)
  if bits == 8:
    return p
  if bits == 4:
    return jnp.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
  if bits == 6:
    t = p.reshape(*p.shape[:-1], -1, 3)
    w = t[..., 0] | (t[..., 1] << 8) | (t[..., 2] << 16)
    c = jnp.stack([(w >> s) & 0x3F for s in (0, 6, 12, 18)], axis=-1)
    return c.reshape(*p.shape[:-1], -1)
  raise ValueError(f"{bits=} must be 4, 6 or 8")


jax.tree_util.register_static(Minifloat)
