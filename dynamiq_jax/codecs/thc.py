"""THC (Li et al., NSDI 2024) adapted to multi-hop all-reduce, and Global-QSGD.

Both quantise each rank's vector *once*, onto a lattice shared by all ranks,
so that partial sums are exact integer sums that only widen along the ring
(no re-quantisation at the hops):

* :class:`THC`: shared-seed randomized Hadamard transform (block-diagonal,
  ``rht_block`` coordinates per block), one global scale from the max of the
  ranks' L2 norms (an all-reduce MAX), clamping to ``[-T, T]`` standard
  deviations (``P(|Z| > T) = 1 / overflow_frequency``), unbiased stochastic
  rounding to ``levels`` uniform levels, integer sums carried in
  ``ceil(log2((levels - 1) n + 1))`` bits rounded up to a byte multiple. The
  DynamiQ paper describes 4-bit THC (16 levels); the authors' launcher used
  120 levels. Rounding draws are independent per rank (the authors' port
  used one identical stream on every rank, which correlates the ranks'
  errors).
* :class:`GlobalQSGD` (Xin et al., 2025): global L-infinity scale (an
  all-reduce MAX), unbiased rounding of ``x K / max`` to integers with ``K =
  floor((2^(bits-1) - 1) / n)`` so that the sum of n ranks never overflows
  the ``bits``-bit signed container.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs._exact import vector_norm
from dynamiq_jax.codecs.base import Metadata, Plan, pad_to, padded_length, round_up
from dynamiq_jax.codecs.bf16 import Cast
from pallas_kernels import rng

__all__ = ["THC", "GlobalQSGD", "fwht"]


def fwht(x):
  """Unnormalised fast Walsh-Hadamard transform over the last axis (a power of two).

  Every stage is the same constant-shape step (halves a, b -> interleaved
  a + b, a - b); log2(B) of them give the Sylvester-ordered transform. One
  ``fori_loop`` body keeps compile time flat (unrolled stages of different
  reshapes fuse into one huge computation that XLA takes minutes to compile)
  and the result is bit-identical wherever it runs (adds only).
  """
  b = x.shape[-1]
  lead = x.shape[:-1]
  stages = b.bit_length() - 1

  def stage(_, v):
    h = v.reshape(lead + (2, b // 2))
    a, c = h[..., 0, :], h[..., 1, :]
    return jnp.stack([a + c, a - c], axis=-1).reshape(lead + (b,))

  return jax.lax.fori_loop(0, stages, stage, x)


def _container(max_value: int, signed: bool):
  for dtype in ((jnp.int8, jnp.int16, jnp.int32) if signed else
                (jnp.uint8, jnp.uint16, jnp.uint32)):
    if max_value <= jnp.iinfo(dtype).max:
      return dtype
  raise ValueError(f"no integer container holds {max_value}")


def _normal_two_sided_quantile(p: float) -> float:
  """T with P(|Z| > T) = p for a standard normal Z."""
  lo, hi = 0.0, 40.0
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    if math.erfc(mid / math.sqrt(2.0)) > p:
      lo = mid
    else:
      hi = mid
  return 0.5 * (lo + hi)


def _private_uniforms(keys, size):
  """This rank's own uniforms on [0, 1) for ``size`` elements."""
  k0, k1 = keys.derive(rng.Stream.PRIVATE_ROUND, keys.rank)
  return rng.uniform24(rng.hash_index(k0, k1, jnp.arange(size, dtype=jnp.uint32)))


class IntegerSum(Cast):
  """Shared hop functions of the integer-lattice codecs: the payload is the
  integer partial sum in the codec's container; nothing is re-quantised."""

  def encode(self, chunk, aux, keys):
    del keys
    return chunk.astype(aux.container)

  def decode(self, payload, aux):
    del aux
    return payload.astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class THC(IntegerSum):
  """Tensor Homomorphic Compression, uniform variant, as a ring codec.

  Args:
    levels: quantisation levels (16 = 4 bits, the paper's; the authors'
      launcher used 120).
    overflow_frequency: clamp at ``T`` with ``P(|Z| > T) = 1/overflow_frequency``
      (1024, the authors' port: T = 3.30).
    rht_block: coordinates per Hadamard block (a power of two); smaller
      buckets use one block of the next power of two.

  Examples:
    >>> from dynamiq_jax.codecs import THC
    >>> THC(levels=16).wire_bits(1 << 20, 8) / (1 << 20)  # 8-bit integer sums
    8.000030517578125
  """

  reports_contribution = True
  supports_scatter = False  # the rotation mixes coordinates of different chunks

  levels: int = 16
  overflow_frequency: float = 1024.0
  rht_block: int = 1 << 20

  def __post_init__(self):
    if not 2 <= self.levels <= 1 << 16:
      raise ValueError(f"levels={self.levels} must be in [2, 65536]")
    if self.rht_block < 2 or self.rht_block & (self.rht_block - 1):
      raise ValueError(f"rht_block={self.rht_block} must be a power of two")
    if not self.overflow_frequency > 1:
      raise ValueError(f"overflow_frequency={self.overflow_frequency} must exceed 1")

  @property
  def clamp(self) -> float:
    return _normal_two_sided_quantile(1.0 / self.overflow_frequency)

  def _layout(self, d: int, n: int):
    block = min(self.rht_block, 1 << max(d - 1, 1).bit_length())
    rotated = round_up(d, block)
    return block, rotated, padded_length(rotated, n)

  def container(self, n: int):
    return _container((self.levels - 1) * n, signed=False)

  def wire_bits(self, d: int, n: int) -> int:
    _, _, padded = self._layout(d, n)
    return padded * jnp.iinfo(self.container(n)).bits + 32  # + the max-norm all-reduce

  def metadata(self, x, bucket, state, keys=None):
    del bucket, state
    with jax.named_scope("thc/scale"):
      return Metadata(vector_norm(x), combine="max")

  def _signs(self, keys, bucket):
    block, rotated, _ = self._layout(bucket.d, bucket.n)
    k0, k1 = keys.derive(rng.Stream.THC_SIGNS)
    bits = rng.hash_index(k0, k1, jnp.arange(rotated, dtype=jnp.uint32)) >> 31
    return jnp.where(bits == 1, np.float32(-1), np.float32(1)).reshape(-1, block)

  def plan(self, x, meta, bucket, state, keys):
    del state
    n, d = bucket.n, bucket.d
    block, rotated, padded = self._layout(d, n)
    signs = self._signs(keys, bucket)
    inv_sqrt = np.float32(1.0 / np.sqrt(block))
    with jax.named_scope("thc/rotate"):
      y = (fwht(pad_to(x, rotated).reshape(-1, block) * signs) * inv_sqrt).reshape(-1)
    max_norm = meta
    sigma = max_norm / np.float32(np.sqrt(rotated))
    t = np.float32(self.clamp)
    lo = -t * sigma
    delta = 2 * t * sigma / np.float32(self.levels - 1)
    live = delta > 0
    z = jnp.clip((y - lo) / jnp.where(live, delta, 1.0), 0, self.levels - 1)
    u = _private_uniforms(keys, rotated)
    fl = jnp.floor(z)
    lvl = (fl + (u < z - fl)).astype(jnp.int32)
    lvl = jnp.where(live, lvl, 0)
    aux = THCAux(signs, lo, delta, live, max_norm, lvl, self.container(n))
    return Plan(pad_to(lvl, padded).reshape(n, padded // n), aux)

  def _unrotate(self, v, aux, d):
    block = aux.signs.shape[1]
    inv_sqrt = np.float32(1.0 / np.sqrt(block))
    return (fwht(v.reshape(-1, block)) * inv_sqrt * aux.signs).reshape(-1)[:d]

  def finish(self, decoded, aux, bucket, state):
    del state
    rotated = aux.signs.size
    total = decoded.reshape(-1)[:rotated]
    summed = jnp.where(aux.live, total * aux.delta + np.float32(bucket.n) * aux.lo, 0.0)
    out = self._unrotate(summed, aux, bucket.d)
    return jnp.where(jnp.isfinite(aux.max_norm), out, jnp.nan), None

  def contribution(self, x, aux, bucket):
    del x
    own = jnp.where(aux.live, aux.levels.astype(jnp.float32) * aux.delta + aux.lo, 0.0)
    return self._unrotate(own, aux, bucket.d)


class THCAux(NamedTuple):
  """THC's per-bucket arrays: rotation signs, lattice origin and step, this rank's levels."""

  signs: jax.Array
  lo: jax.Array
  delta: jax.Array
  live: jax.Array
  max_norm: jax.Array
  levels: jax.Array
  container: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class GlobalQSGD(IntegerSum):
  """Global-QSGD with a global L-infinity scale and integer all-reduce.

  Args:
    bits: width of the signed integer on the wire (8 or 16).

  Examples:
    >>> from dynamiq_jax.codecs import GlobalQSGD
    >>> GlobalQSGD(bits=8).wire_bits(1 << 20, 8) / (1 << 20)
    8.000030517578125
  """

  reports_contribution = True

  bits: int = 8

  def __post_init__(self):
    if self.bits not in (8, 16):
      raise ValueError(f"bits={self.bits} must be 8 or 16")

  def levels(self, n: int) -> int:
    k = (2 ** (self.bits - 1) - 1) // n
    if k < 1:
      raise ValueError(
          f"GlobalQSGD(bits={self.bits}) cannot sum over n={n} ranks without overflow "
          f"(needs n <= {2 ** (self.bits - 1) - 1}); use bits=16")
    return k

  def wire_bits(self, d: int, n: int) -> int:
    self.levels(n)
    return padded_length(d, n) * self.bits + 32  # + the max all-reduce

  def metadata_bits(self, d: int, n: int) -> int:
    del d, n
    return 32

  def metadata(self, x, bucket, state, keys=None):
    del bucket, state
    return Metadata(jnp.max(jnp.abs(x)), combine="max")

  def plan(self, x, meta, bucket, state, keys):
    del state
    n, d = bucket.n, bucket.d
    k = np.float32(self.levels(n))
    gmax = meta
    live = gmax > 0
    step = jnp.where(live, gmax, 1.0) / k
    y = x / step  # in [-K, K]
    u = _private_uniforms(keys, d)
    fl = jnp.floor(y)
    q = jnp.where(live, fl + (u < y - fl), 0.0).astype(jnp.int32)
    container = jnp.int8 if self.bits == 8 else jnp.int16
    return Plan(pad_to(q, padded_length(d, n)).reshape(n, -1),
                GlobalQSGDAux(step, gmax, q, container))

  def finish(self, decoded, aux, bucket, state):
    del state
    out = decoded.reshape(-1)[:bucket.d] * aux.step
    return jnp.where(jnp.isfinite(aux.gmax), out, jnp.nan), None

  def contribution(self, x, aux, bucket):
    del x, bucket
    return aux.q.astype(jnp.float32) * aux.step


class GlobalQSGDAux(NamedTuple):
  step: jax.Array
  gmax: jax.Array
  q: jax.Array
  container: Any
