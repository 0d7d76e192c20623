"""Lossless-payload codecs: ``Bf16`` (the BF16 all-reduce baseline) and ``F32``.

Each hop decodes the received partial sum to float32, adds the local chunk
and re-encodes: exactly what a ring all-reduce in the payload dtype does
(NCCL's bf16 ring accumulates the same way). ``Bf16`` sends 16 bits per
coordinate, ``F32`` 32; no metadata.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs.base import Codec, Plan, pad_to, padded_length, partial_sum_energy

__all__ = ["Bf16", "F32", "Cast"]


class Cast(Codec):
  """Shared body: the payload is the partial sum cast to ``_dtype``.

  Decoding gives float32 (int32 for integer payloads); a hop adds in that
  dtype and casts back. Other codecs use it to carry integer or bf16 sums
  (``Cast.of(dtype)``).
  """

  reports_contribution = True
  supports_scatter = True  # chunk c is coordinates [c d/n, (c+1) d/n)
  self_scaled = True  # a float payload needs no agreed scale; non-finite values stay so

  _dtype = None

  @staticmethod
  def of(dtype) -> "Cast":
    """A cast codec for any payload dtype (e.g. uint8 counts, int16 sums)."""
    return _AnyCast(jnp.dtype(dtype).name)

  @property
  def dtype(self):
    return jnp.dtype(self._dtype)

  @property
  def result_dtype(self):
    """bfloat16 for bf16 payloads (the sums are bf16 already), float32 for every other
    payload dtype: a cast codec's result keeps its payload's precision."""
    return jnp.dtype(jnp.bfloat16) if self.dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)

  def wire_bits(self, d: int, n: int) -> int:
    return self.dtype.itemsize * 8 * padded_length(d, n)

  def plan(self, x, meta, bucket, state, keys):
    del meta, state, keys
    return Plan(pad_to(x, padded_length(bucket.d, bucket.n)).reshape(bucket.n, -1))

  def encode(self, chunk, aux, keys):
    del aux, keys
    return chunk.astype(self.dtype)

  def decode(self, payload, aux):
    del aux
    return payload.astype(jnp.int32 if jnp.issubdtype(self.dtype, jnp.integer)
                          else jnp.float32)

  def finish(self, decoded, aux, bucket, state):
    del aux, state
    return decoded.reshape(-1)[:bucket.d], None

  def contribution(self, x, aux, bucket):
    del aux, bucket
    return x.astype(self.dtype).astype(jnp.float32)

  def error_estimate(self, out, aux, bucket, partials):
    """Round-to-nearest error of every partial sum, ranks taken as independent.

    Float payloads only: ``c * sum_k ||P_k||^2`` with ``c`` the relative MSE
    of one cast (:func:`cast_error`) and partial norms from ``||out||^2``.
    """
    del aux
    if jnp.issubdtype(self.dtype, jnp.integer):
      return None
    energy = partial_sum_energy(jnp.sum(out * out), None, bucket.n, partials)
    return np.float32(cast_error(self.dtype.name)) * energy


@functools.lru_cache(maxsize=None)
def cast_error(dtype_name: str) -> float:
  """Relative MSE ``E (cast(v) - v)^2 / E v^2`` of rounding Gaussian float32 values
  to ``dtype_name`` (a fixed sample: deterministic)."""
  v = np.random.default_rng(12345).standard_normal(1 << 16).astype(np.float32)
  r = v.astype(jnp.dtype(dtype_name)).astype(np.float64)
  return float(np.sum((r - v) ** 2) / np.sum(v.astype(np.float64) ** 2))


@dataclasses.dataclass(frozen=True)
class _AnyCast(Cast):
  dtype_name: str = "float32"

  @property
  def dtype(self):
    return jnp.dtype(self.dtype_name)


@dataclasses.dataclass(frozen=True)
class Bf16(Cast):
  """Sends bfloat16 partial sums (16 bits/coordinate): the paper's baseline.

  Examples:
    >>> import dynamiq_jax as dq
    >>> dq.codecs.Bf16().wire_bits(1000, 8)
    16000
  """

  _dtype = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class F32(Cast):
  """Sends float32 partial sums (32 bits/coordinate): a full-precision ring."""

  _dtype = jnp.float32
