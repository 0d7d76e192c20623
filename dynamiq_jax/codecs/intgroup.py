"""Fine-grained integer quantisation: Flash Communication's INT8 / INT4 codec.

Each group of ``group`` (128) consecutive coordinates is quantised on its own,
at every encode, with the group's own range (Li, Zhang, Ye et al., "Flash
Communication: Reducing Tensor Parallelization Bottleneck for Fast Large
Language Model Inference"):

* ``symmetric=False`` (the paper's): codes ``q = round((x - zero) / scale)`` in
  ``[0, 2^bits - 1]``, ``zero`` the group's minimum rounded down and ``scale``
  its range over ``2^bits - 1`` rounded up, both stored in ``scale_dtype``
  (float16); decoded ``q scale + zero``.
* ``symmetric=True``: ``q = round(x / scale)`` in ``[-(2^(bits-1) - 1),
  2^(bits-1) - 1]``, ``scale`` the group's largest magnitude over ``2^(bits-1)
  - 1`` rounded up; no zero point.

Because the stored zero point is at most the group's minimum and the stored
scale covers the group's range, no code saturates: every encode's error is at
most half its group's stored scale per coordinate (round to nearest), and an
all-reduce's error is at most the sum of those halves over the encodes a
value went through (two with ``schedule="two_step"``, n with a ring).
Rounding is to nearest, ties to even (``rounding="stochastic"``: unbiased,
keyed by the bucket's random stream, for gradients).

Codes are packed ``8 / bits`` to a byte (INT4: two to a byte), followed by
the group's scale and zero point: ``bits + 32 / group`` bits per coordinate
with float16 scales (INT8: 8.25, INT4: 4.25), ``bits + 16 / group``
symmetric. No metadata pass: every payload carries its own scales, so a
group holding a NaN or an infinity decodes as NaN (or infinite) in that
group only, and a group whose zero point or scale would exceed
``scale_dtype``'s largest value (65504 for float16: a minimum below -65504,
or a range beyond 65504 (2^bits - 1)) decodes as NaN (use
``scale_dtype="bfloat16"`` or ``"float32"`` for such data).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from dynamiq_jax.codecs.base import Codec, Plan, ceil_div, pad_to, round_up
from dynamiq_jax.codecs.minifloat import pack_bits, unpack_bits
from pallas_kernels.rng import Stream

__all__ = ["IntGroup", "round_toward"]

_SCALE_DTYPES = ("float16", "bfloat16", "float32")


def round_toward(v, dtype, direction: Literal["down", "up"]):
  """float32 ``v`` rounded to ``dtype`` toward -inf (``"down"``) or +inf (``"up"``), as
  ``dtype``: the nearest value on that side, NaN kept, overflow to the infinities."""
  y = v.astype(dtype)
  yf = y.astype(jnp.float32)
  if direction == "down":
    return jnp.where(yf > v, jnp.nextafter(y, jnp.asarray(-jnp.inf, dtype)), y)
  return jnp.where(yf < v, jnp.nextafter(y, jnp.asarray(jnp.inf, dtype)), y)


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntGroup(Codec):
  """Per-group integer codec (Flash Communication's quantiser).

  Args:
    bits: code width: 8, 6 or 4 (4-bit codes packed two to a byte).
    group: coordinates per group (one scale and zero point each); a multiple
      of 4.
    symmetric: no zero point: codes centred on zero, one scale per group.
    scale_dtype: ``"float16"`` (the paper's), ``"bfloat16"`` or ``"float32"``:
      how each group's scale (and zero point) travel.
    rounding: ``"nearest"`` (ties to even; the paper's) or ``"stochastic"``
      (unbiased; draws keyed by bucket, chunk, hop and rank).

  Examples:
    >>> from dynamiq_jax.codecs import IntGroup
    >>> IntGroup(bits=4).wire_bits(128 * 8, 8) / (128 * 8)
    4.25
  """

  supports_scatter = True  # chunk c is whole groups of coordinates [c d/n, (c+1) d/n)
  self_scaled = True  # each encode computes its groups' scales

  bits: int = 8
  group: int = 128
  symmetric: bool = False
  scale_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
  rounding: Literal["nearest", "stochastic"] = "nearest"

  def __post_init__(self):
    if self.bits not in (4, 6, 8):
      raise ValueError(f"bits={self.bits!r} must be 8, 6 or 4 (codes packed whole in bytes)")
    if not isinstance(self.group, int) or self.group < 4 or self.group % 4:
      raise ValueError(f"group={self.group!r} must be a positive multiple of 4 (e.g. 128, the "
                       f"paper's), so that a group's codes fill whole bytes")
    if self.scale_dtype not in _SCALE_DTYPES:
      raise ValueError(f"scale_dtype={self.scale_dtype!r} must be one of {_SCALE_DTYPES}")
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(f"rounding={self.rounding!r} must be 'nearest' or 'stochastic'")

  @property
  def granularity(self) -> int:
    return self.group

  @property
  def reports_contribution(self) -> bool:
    """A rank's own representation is its first encode's, known without keys only when
    rounding is to nearest."""
    return self.rounding == "nearest"

  # -- sizes --------------------------------------------------------------------------

  @property
  def _levels(self) -> int:
    """The largest code: ``2^bits - 1``, or ``2^(bits-1) - 1`` each side if symmetric."""
    return (1 << (self.bits - 1)) - 1 if self.symmetric else (1 << self.bits) - 1

  @property
  def _meta_bytes(self) -> int:
    return jnp.dtype(self.scale_dtype).itemsize * (1 if self.symmetric else 2)

  @property
  def _code_bytes(self) -> int:
    return self.group * self.bits // 8

  def _groups(self, d: int, n: int) -> int:
    return round_up(ceil_div(d, self.group), n)

  def wire_bits(self, d: int, n: int) -> int:
    return self._groups(d, n) * 8 * (self._code_bytes + self._meta_bytes)

  # -- the all-reduce ---------------------------------------------------------------

  def _padded(self, x, bucket):
    g = self._groups(bucket.d, bucket.n)
    return pad_to(x, g * self.group).reshape(g, self.group)

  def plan(self, x, meta, bucket, state, keys):
    del meta, state, keys
    xg = self._padded(x, bucket)
    return Plan(xg.reshape(bucket.n, -1, self.group))

  def quantize(self, chunk, uniforms=None):
    """Groups ``chunk`` [..., group] (float32) -> (codes as float32, scale, zero point),
    scale and zero point float32 values of ``scale_dtype`` ([..., 1]; zero point 0 if
    symmetric)."""
    sdt = jnp.dtype(self.scale_dtype)
    top = jnp.float32(self._levels)
    if self.symmetric:
      zero = jnp.zeros(chunk.shape[:-1] + (1,), jnp.float32)
      span = jnp.max(jnp.abs(chunk), axis=-1, keepdims=True)
      low = -top
    else:
      zero = round_toward(jnp.min(chunk, axis=-1, keepdims=True), sdt, "down").astype(
          jnp.float32)
      span = jnp.max(chunk, axis=-1, keepdims=True) - zero
      low = jnp.float32(0)
    # the least scale_dtype value with scale * top >= span (a product exact in float32),
    # whether or not the division below rounds correctly
    scale = (span / top).astype(sdt)
    scale = jnp.where(scale.astype(jnp.float32) * top < span,
                      jnp.nextafter(scale, jnp.asarray(jnp.inf, sdt)), scale).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    t = (chunk - zero) / safe
    q = jnp.round(t) if uniforms is None else jnp.floor(t + uniforms)
    return jnp.clip(q, low, top), scale, zero

  def encode(self, chunk, aux, keys):
    del aux
    u = None
    if self.rounding == "stochastic":
      u = keys.uniform(chunk.shape, Stream.INTGROUP_ROUND, keys.chunk, keys.hop, keys.rank)
    q, scale, zero = self.quantize(chunk, u)
    sdt = jnp.dtype(self.scale_dtype)
    offset = self._levels if self.symmetric else 0
    codes = pack_bits((q + offset).astype(jnp.uint32), self.bits)
    meta = scale if self.symmetric else jnp.concatenate([scale, zero], axis=-1)
    meta = jax.lax.bitcast_convert_type(meta.astype(sdt), jnp.uint8)
    return jnp.concatenate([codes, meta.reshape(*meta.shape[:-2], -1)], axis=-1)

  def decode(self, payload, aux):
    del aux
    sdt = jnp.dtype(self.scale_dtype)
    nb = self._code_bytes
    q = unpack_bits(payload[..., :nb], self.bits).astype(jnp.float32)
    meta = payload[..., nb:].reshape(*payload.shape[:-1], -1, sdt.itemsize)
    meta = jax.lax.bitcast_convert_type(meta, sdt).astype(jnp.float32)
    if self.symmetric:
      return (q - jnp.float32(self._levels)) * meta[..., :1]
    return q * meta[..., :1] + meta[..., 1:]

  def finish(self, decoded, aux, bucket, state):
    del aux, state
    return decoded.reshape(-1)[:bucket.d], None

  def contribution(self, x, aux, bucket):
    if self.rounding != "nearest":
      raise NotImplementedError(
          "IntGroup(rounding='stochastic') draws its rounding per hop, so a rank's own "
          "representation is not known without the hop's keys; use rounding='nearest' "
          "with error feedback")
    q, scale, zero = self.quantize(self._padded(x, bucket))
    return (q * scale + zero).reshape(-1)[:bucket.d]
