"""Lossless-payload codecs: ``Bf16`` (the BF16 all-reduce baseline) and ``F32``.

Each hop decodes the received partial sum to float32, adds the local chunk
and re-encodes: exactly what a ring all-reduce in the payload dtype does
(NCCL's bf16 ring accumulates the same way). ``Bf16`` sends 16 bits per
coordinate, ``F32`` 32; no metadata.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dynamiq_jax.codecs.base import Prepared, cast_ops

__all__ = ["Bf16", "F32"]


def _padded(d: int, n: int) -> int:
  return -(-d // n) * n


class _CastCodec:
  """Shared body: the payload is the partial sum cast to ``_dtype``."""

  reports_contribution = True  # prepare() gives `own`, for error feedback

  _dtype = None
  _bits = 0

  def wire_bits(self, d: int, n: int) -> int:
    return self._bits * _padded(d, n)

  def prepare(self, x, *, ctx, run, key_words, bucket, implementation=None, state=None):
    del run, key_words, bucket, implementation, state
    d = x.shape[0]
    chunks = jnp.pad(x, (0, _padded(d, ctx.n) - d)).reshape(ctx.n, -1)
    dtype = self._dtype

    def finish(decoded):
      return decoded.reshape(-1)[:d], None

    def own():
      return x.astype(dtype).astype(jnp.float32)

    return Prepared(chunks, cast_ops(dtype), finish, own)


@dataclasses.dataclass(frozen=True)
class Bf16(_CastCodec):
  """Sends bfloat16 partial sums (16 bits/coordinate): the paper's baseline.

  Examples:
    >>> import dynamiq_jax as dq
    >>> dq.codecs.Bf16().wire_bits(1000, 8)
    16000
  """

  _dtype = jnp.bfloat16
  _bits = 16


@dataclasses.dataclass(frozen=True)
class F32(_CastCodec):
  """Sends float32 partial sums (32 bits/coordinate): a full-precision ring."""

  _dtype = jnp.float32
  _bits = 32
