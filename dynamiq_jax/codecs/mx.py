"""OCP Microscaling (MX) formats as a multi-hop all-reduce codec: MXFP8/6/4.

Blocks of ``block`` (32) consecutive coordinates share one scale; elements
are FP8 (E4M3, E5M2), FP6 (E3M2, E2M3) or FP4 (E2M1), converted with
round-to-nearest-even and saturation (:mod:`dynamiq_jax.codecs.minifloat`).
Two scale modes:

* ``scale="e8m0"`` — OCP MX v1.0 exact: per block and *per hop*, the scale is
  ``2^(floor(log2 amax) - emax_elem)`` of the current partial sum, sent as
  one E8M0 byte (NaN/Inf in a block -> scale 0xFF, decoded NaN). Every hop
  re-casts the partial sum with its own scales. ``elem + 8/block`` bits.
* ``scale="bf16"`` — the DynamiQ authors' multi-hop adaptation (after
  FP8-LM): the block max is agreed with an all-reduce MAX before the ring, a
  bf16 block scale maps it to ``mu``, and every hop re-casts the partial sum
  on that fixed grid; ``mu`` starts at the authors' value (FP8: 335/n, FP6:
  max/(1.4 n), FP4: max/sqrt(2n)) and, where ``adaptive`` (by default FP4,
  as the authors), grows by 2^0.02 per step and shrinks by 0.95 when more
  than ``overflow`` of the result saturates — codec state carried by the
  optax transform. ``elem + 16/block`` bits (the scale all-reduce), i.e.
  the paper's 8.5 / 6.5 / 4.5 bits for MXFP8 / 6 / 4.

The authors' own FP6/FP4 casts truncate subnormals and round normals with
+0.43 / +0.4 offsets (biased low); ours are exact RNE casts, so ours can be
more accurate than their simulator (docs/results.md compares them).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs.base import Codec, Metadata, Plan, ceil_div, pad_to, round_up
from dynamiq_jax.codecs.minifloat import ELEMENTS, pack_bits, unpack_bits
from pallas_kernels import bf16

__all__ = ["MX", "mxfp8", "mxfp6", "mxfp4"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MX(Codec):
  """MX block-scaled minifloat codec.

  Args:
    element: ``"e4m3"``, ``"e5m2"`` (MXFP8), ``"e3m2"``, ``"e2m3"`` (MXFP6) or
      ``"e2m1"`` (MXFP4).
    scale: ``"bf16"`` (the paper's multi-hop adaptation; default) or
      ``"e8m0"`` (OCP-exact, local scale at every hop).
    block: coordinates per scale (32 in OCP MX).
    mu: ``scale="bf16"``: the value the global block max maps to, times n
      (None: the authors' default for the element type).
    adaptive: ``scale="bf16"``: auto-scale ``mu`` from the overflow rate
      (None: only for e2m1, as the authors).
    overflow: target saturated fraction for the auto-scaling (None: 2% for
      e2m1, 1% otherwise).

  Examples:
    >>> from dynamiq_jax.codecs import MX
    >>> MX(element="e4m3").wire_bits(32 * 8 * 100, 8) / (32 * 8 * 100)
    8.5
  """

  reports_contribution = True
  supports_scatter = True  # chunk c is whole blocks [c d/n, (c+1) d/n)

  element: Literal["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"] = "e4m3"
  scale: Literal["bf16", "e8m0"] = "bf16"
  block: int = 32
  mu: float | None = None
  adaptive: bool | None = None
  overflow: float | None = None

  def __post_init__(self):
    if self.element not in ELEMENTS:
      raise ValueError(f"element={self.element!r} must be one of {sorted(ELEMENTS)}")
    if self.scale not in ("bf16", "e8m0"):
      raise ValueError(f"scale={self.scale!r} must be 'bf16' or 'e8m0'")
    if self.block < 1 or (self.block * self.fmt.bits) % 8:
      raise ValueError(f"block={self.block} must hold whole bytes of {self.fmt.bits}-bit codes")
    if self.mu is not None and not self.mu > 0:
      raise ValueError(f"mu={self.mu!r} must be positive")

  @property
  def self_scaled(self) -> bool:
    """``scale="e8m0"``: every hop's payload carries its blocks' own scales."""
    return self.scale == "e8m0"

  @property
  def fmt(self):
    return ELEMENTS[self.element]

  @property
  def granularity(self) -> int:
    return self.block

  # -- sizes ------------------------------------------------------------------

  def _blocks(self, d: int, n: int) -> tuple[int, int]:
    m = ceil_div(d, self.block)
    return m, round_up(m, n)

  def wire_bits(self, d: int, n: int) -> int:
    m, padded = self._blocks(d, n)
    codes = padded * self.block * self.fmt.bits
    if self.scale == "e8m0":
      return codes + 8 * padded
    return codes + 16 * m  # the bf16 block-max all-reduce

  def metadata_bits(self, d: int, n: int) -> int:
    return 0 if self.scale == "e8m0" else 16 * self._blocks(d, n)[0]

  # -- state (scale="bf16") -------------------------------------------------------

  def _is_adaptive(self) -> bool:
    return self.adaptive if self.adaptive is not None else self.element == "e2m1"

  def _overflow(self) -> float:
    return self.overflow if self.overflow is not None else (
        2e-2 if self.element == "e2m1" else 1e-2)

  def _mu0(self, n: int) -> float:
    if self.mu is not None:
      return self.mu / n
    f = self.fmt
    if f.bits == 8:
      return f.max * (335.0 / 448.0) / n  # the authors' "335" for E4M3
    if f.bits == 6:
      return f.max / (1.4 * n)
    return f.max / np.sqrt(2.0 * n)

  def init_state(self, d: int, n: int):
    del d
    if self.scale != "bf16":
      return None
    return jnp.asarray(self._mu0(n), jnp.float32)

  # -- the all-reduce ---------------------------------------------------------------

  @property
  def stateful(self) -> bool:
    return self.scale == "bf16"

  def metadata(self, x, bucket, state, keys=None):
    del state
    if self.scale == "e8m0":
      return None
    m, _ = self._blocks(bucket.d, bucket.n)
    xb = self._padded(x, bucket)
    with jax.named_scope("mx/block_max"):
      return Metadata(bf16.ceil(jnp.max(jnp.abs(xb[:m]), axis=-1)), combine="max")

  def _padded(self, x, bucket):
    _, padded = self._blocks(bucket.d, bucket.n)
    return pad_to(x, padded * self.block).reshape(padded, self.block)

  def plan(self, x, meta, bucket, state, keys):
    del keys
    n = bucket.n
    xb = self._padded(x, bucket)
    padded = xb.shape[0]
    if self.scale == "e8m0":
      return Plan(xb.reshape(n, padded // n, self.block))
    mu = self.init_state(bucket.d, n) if state is None else state
    amax = jnp.pad(meta, (0, padded - meta.shape[0]))
    scale = bf16.ceil(amax / mu)  # bf16: block max -> at most mu
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    scaled = jnp.where(scale[:, None] > 0, xb / safe, 0.0)
    return Plan(scaled.reshape(n, padded // n, self.block), MXAux(scale, mu))

  def encode(self, chunk, aux, keys):
    del keys
    f = self.fmt
    if self.scale == "e8m0":
      codes, sbyte = self._quantize_e8m0(chunk)
      return jnp.concatenate([pack_bits(codes, f.bits), sbyte[:, None]], axis=-1)
    return pack_bits(f.quantize(chunk)[1], f.bits)

  def decode(self, payload, aux):
    f = self.fmt
    if self.scale == "e8m0":
      nb = self.block * f.bits // 8
      return self._dequantize_e8m0(unpack_bits(payload[:, :nb], f.bits), payload[:, nb])
    return f.decode(unpack_bits(payload, f.bits))

  def finish(self, decoded, aux, bucket, state):
    d, n = bucket.d, bucket.n
    if self.scale == "e8m0":
      return decoded.reshape(-1)[:d], None
    f = self.fmt
    scale, mu = aux
    grid = decoded.reshape(-1, self.block)
    out = (grid * scale[:, None]).reshape(-1)[:d]  # exact: <=4 x 8 significant bits
    new_mu = mu
    if self._is_adaptive():
      sat = jnp.sum((jnp.abs(grid) >= f.max).reshape(-1)[:d]) / d
      new_mu = jnp.where(sat > self._overflow(),
                         jnp.maximum(mu * 0.95, f.max / (2.0 * n)),
                         jnp.minimum(mu * 2.0**0.02, f.max))
    return out, new_mu

  def contribution(self, x, aux, bucket):
    xb = self._padded(x, bucket)
    if self.scale == "e8m0":
      return self._dequantize_e8m0(*self._quantize_e8m0(xb)).reshape(-1)[:bucket.d]
    scale, _ = aux
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    scaled = jnp.where(scale[:, None] > 0, xb / safe, 0.0)
    return (self.fmt.quantize(scaled)[0] * scale[:, None]).reshape(-1)[:bucket.d]

  def _quantize_e8m0(self, v):
    """OCP MX conversion of blocks v [B, block] -> (codes [B, block], scale byte [B])."""
    f = self.fmt
    amax = jnp.max(jnp.abs(v), axis=-1)
    bad = ~jnp.isfinite(amax)
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))
    shared = jnp.clip(e - 1 - f.emax, -127, 127)
    shared = jnp.where(amax > 0, shared, -127)
    p = f.quantize(jnp.ldexp(v, -shared[:, None]))[1]  # exact power-of-two scaling
    sbyte = jnp.where(bad, 255, shared + 127).astype(jnp.uint8)
    return p, sbyte

  def _dequantize_e8m0(self, codes, sbyte):
    x = jnp.ldexp(self.fmt.decode(codes), sbyte.astype(jnp.int32)[..., None] - 127)
    return jnp.where((sbyte == 255)[..., None], jnp.nan, x)


class MXAux(NamedTuple):
  """Per-bucket arrays of the bf16-scale mode: block scales [blocks] and this round's mu."""

  scale: jax.Array
  mu: jax.Array


def mxfp8(**kw) -> MX:
  """MXFP8 (E4M3) with the paper's multi-hop adaptation: 8.5 bits/coordinate."""
  return MX(element="e4m3", **kw)


def mxfp6(**kw) -> MX:
  """MXFP6 (E3M2): 6.5 bits/coordinate."""
  return MX(element="e3m2", **kw)


def mxfp4(**kw) -> MX:
  """MXFP4 (E2M1), adaptive scale: 4.5 bits/coordinate."""
  return MX(element="e2m1", **kw)
