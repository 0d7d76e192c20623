"""The guard of every bucket: the ranks agree on non-finite values and on a power-of-two
scale before a codec sees the bucket (:func:`guard`), and the codec's result is put back
in input units (:func:`unguard`). :mod:`dynamiq_jax.engine.programs` runs them around each bucket
program; Moshpit and tensor parallelism call them directly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.schedules.context import AxisContext

__all__ = ["SAFE_EXPONENT", "guard", "guard_votes", "guarded", "guard_metadata", "unguard"]

SAFE_EXPONENT = 64
"""Buckets whose largest magnitude reaches 2^64 are scaled down by a power of two
(exactly) before the codec sees them, so that no codec's partial sums, centred
residuals or rounding products can overflow float32 on finite inputs."""


def guard(x, ctx: AxisContext, after=None):
  """Every rank's agreement on one bucket -> (any rank non-finite, guarded x, scale).

  One small all-reduce (max) of finite numbers per bucket, so it behaves the
  same on every backend (no reliance on how a backend's max treats NaN): a
  value that is NaN or infinite on any rank makes the whole bucket NaN on
  every rank (:func:`unguard`; the codec itself sees zeros there, so its
  state stays finite), and finite inputs reach the codec scaled below
  :data:`SAFE_EXPONENT` exactly (the scale is a power of two, 1 for usual
  gradients). ``after``, a value of the previous bucket's result, rides
  along as a finite flag: see :func:`one_after_another`.
  """
  finite, votes = guard_votes(x, after)
  agreed = ctx.pmax(jnp.stack(votes))
  return guarded(x, finite, agreed[0], agreed[1])


def guard_votes(x, after=None):
  """One rank's part of :func:`guard` -> (``isfinite(x)``, its votes: the largest finite
  magnitude, 1.0 if any value is not finite, and ``after``'s finite flag if given), to be
  combined by a maximum over the ranks."""
  finite = jnp.isfinite(x)
  votes = [jnp.max(jnp.where(finite, jnp.abs(x), 0.0)), jnp.any(~finite).astype(jnp.float32)]
  if after is not None:
    votes.append(jnp.isfinite(after).astype(jnp.float32))
  return finite, votes


def guarded(x, finite, amax, bad):
  """:func:`guard`'s result from the ranks' largest finite magnitude ``amax`` and their
  non-finite vote ``bad``: (any rank non-finite, guarded x, scale)."""
  # 2^k, k = min(SAFE_EXPONENT - e, 0) with amax < 2^e (1 unless huge; k >= -64), built
  # from amax's biased exponent E = e + 126 (amax is finite and >= 0: zeros and subnormals
  # have E = 0 and k = 0, as with frexp): k + 127 = min(SAFE_EXPONENT + 253 - E, 127),
  # unsigned since E <= 254. A few instructions where jnp.frexp's special cases cost ~30,
  # in every fusion that reads the scale.
  biased = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.uint32) >> 23
  field = jnp.minimum(np.uint32(SAFE_EXPONENT + 253) - biased, np.uint32(127))
  scale = jax.lax.bitcast_convert_type(field << 23, jnp.float32)
  return bad > 0, jnp.where(finite, x, 0.0) * scale, scale


def guard_metadata(x, codec: Codec, bucket: Bucket, keys: Keys, ctx: AxisContext, after=None):
  """:func:`guard` and the codec's local metadata of the guarded bucket in one pass over
  ``x``, where the codec has the hook ``guard_statistics(x, bucket, keys, *,
  safe_exponent)`` (DynamiQ: its votes ``[2, P]``, maximised over P and pmax-ed as
  :func:`guard`'s, and ``finish(scale)``, its metadata of the bucket as guarded) -> (any
  rank non-finite, guarded x, scale, local metadata, or None without the hook:
  ``codec.metadata`` of the guarded x, as before)."""
  hook = getattr(codec, "guard_statistics", None)
  found = None if hook is None else hook(x, bucket, keys, safe_exponent=SAFE_EXPONENT)
  with jax.named_scope("guard"):  # (the hook's pass is the codec's own scope's)
    if found is None:
      return (*guard(x, ctx, after), None)
    votes = found[0]  # [2, P]: P parts' votes, with the chain's flag maximised at once
    if after is not None:
      flag = jnp.isfinite(after).astype(jnp.float32)
      votes = jnp.concatenate([votes, jnp.broadcast_to(flag, (1, votes.shape[-1]))])
    agreed = ctx.pmax(jnp.max(votes, axis=-1))
    nonfinite, guarded_x, scale = guarded(x, jnp.isfinite(x), agreed[0], agreed[1])
  return nonfinite, guarded_x, scale, found[1](scale)


def unguard(out, nonfinite, scale, dtype=None):
  """The codec's result in input units (float32), NaN where :func:`guard` found a
  non-finite value.

  With ``dtype`` (a codec's :attr:`~dynamiq_jax.codecs.Codec.result_dtype`), ``out``
  is first rounded to ``dtype`` and held there by an optimization barrier: the
  rounded result is what waits for its reader (the optimizer, at the end of the
  step), and the float32 one dies as soon as it is made, however early XLA
  schedules the decoding. The division by the guard's power-of-two scale (exact)
  and the NaNs are elementwise, so XLA fuses them into the reader.
  """
  if dtype is not None and jnp.dtype(dtype) != out.dtype:
    out = jax.lax.optimization_barrier(out.astype(dtype))
  return jnp.where(nonfinite, jnp.float32(jnp.nan), out / scale)
