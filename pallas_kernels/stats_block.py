"""The guard's and the statistics' block arithmetic: backend-free, shared by kernel and reference.

Each function takes a block of rows (``sqrt`` passed in, so a kernel gives
its correctly rounded square root): the rows' means, norms and maxima
(:func:`row_stats_block`, :func:`row_norm_block`), the guard's exponent and
rescale (:func:`guard_exponent`, :func:`rescale`), and a pairwise
:func:`tree_sum` whose order every backend keeps.
:mod:`pallas_kernels.dynamiq_stats` runs them in its kernels and references.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import rng

__all__ = ["ROW", "tree_sum", "finite_mask", "stochastic_bf16", "row_norm_block",
           "row_stats_block", "guard_exponent", "rescale", "sum_block"]

ROW = 256
"""Coordinates per row (a DynamiQ super-group)."""

_TINY = np.float32(2.0**-126)  # smallest normal float32


def tree_sum(v, axis: int = -1):
  """Sum over ``axis`` (a power of two long) by a fixed pairwise tree: the first step adds
  element i and i + h (h half the length), as :func:`dynamiq_jax.codecs._exact.tree_sum`."""
  n = v.shape[axis]
  if n & (n - 1):
    raise ValueError(f"tree_sum of {n} values: the length must be a power of two")
  while v.shape[axis] > 1:
    a, b = jnp.split(v, 2, axis=axis)
    v = a + b
  return jnp.squeeze(v, axis)


def _pow2(k):
  """``2.0 ** k`` for int32 ``k`` in [-126, 127], built from its bits (exact)."""
  return jax.lax.bitcast_convert_type(((k + 127).astype(jnp.uint32) << 23), jnp.float32)


def _exponent(m):
  """``frexp(m)[1]`` for a normal float32 ``m > 0`` (``m < 2^e``); -126 for subnormals, whose
  scaled values below stay normal (see :func:`row_norm_block`)."""
  bits = jax.lax.bitcast_convert_type(m, jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32) - 126


def finite_mask(x):
  """``isfinite(x)`` of float32 ``x`` from its exponent bits."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  return (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)


def _bf16_round(v):
  return v.astype(jnp.bfloat16).astype(jnp.float32)


def stochastic_bf16(v, hash_bits):
  """:func:`pallas_kernels.bf16.stochastic` of finite float32 ``v``, as float32."""
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  return jax.lax.bitcast_convert_type((bits + (hash_bits >> 16)) & np.uint32(0xFFFF0000),
                                      jnp.float32)


def row_norm_block(r, sqrt=jnp.sqrt):
  """The L2 norm of each row of finite ``r`` [..., 256], rounded to bf16 (flushed to 0 below
  2^-126).

  :func:`dynamiq_jax.codecs._exact.row_norm`'s arithmetic: the row is scaled
  by the power of two below its largest magnitude (exact), rounded to bf16
  so that each square is exact, the squares summed by :func:`tree_sum`, one
  square root, scaled back. ``|r| < 2^66`` (rows the guard scaled).
  """
  m = jnp.max(jnp.abs(r), axis=-1)
  pos = m > 0
  e = jnp.where(pos, _exponent(m), 1)
  b = _bf16_round(r * _pow2(-e)[..., None])  # |b| <= 1
  h = sqrt(tree_sum(b * b)) * _pow2(e)
  return _bf16_round(jnp.where(pos & (h >= _TINY), h, 0.0))


def row_stats_block(x, j, k0, k1, *, safe_exponent: int, sqrt=jnp.sqrt):
  """One pass over rows ``x`` float [B, 256] -> per row ``(mean, norm, amax, bad, centre,
  unshift)``, float32.

  ``amax``: the largest finite magnitude; ``bad``: 1.0 if a value is not
  finite. ``mean`` and ``norm``: the statistics of the row's finite values
  (others as 0) scaled by the row's guard factor ``2^shift`` (module
  docstring; :func:`rescale` finishes them), the mean rounded to bf16
  stochastically by ``hash_index(k0, k1, j)``; ``centre``: the same mean before
  that rounding (the codec's centring mean, row-scaled); ``unshift``: ``2^-shift``,
  which :func:`rescale` multiplies by the bucket's factor.

  Args:
    x: float [B, 256].
    j: int32 [B], each row's index in its chunk.
    k0, k1: uint32 [B], each row's key (its chunk's).
    safe_exponent: the guard's :data:`~dynamiq_jax.engine.programs.SAFE_EXPONENT`.
  """
  x = x.astype(jnp.float32)
  finite = finite_mask(x)
  xz = jnp.where(finite, x, 0.0)
  amax = jnp.max(jnp.abs(xz), axis=-1)
  bad = jnp.max(jnp.where(finite, 0.0, 1.0), axis=-1)
  shift = _row_shift(amax, safe_exponent)
  xt = xz * _pow2(shift)[:, None]
  mean = tree_sum(xt) * np.float32(1.0 / ROW)
  norm = row_norm_block(xt - mean[:, None], sqrt)
  sent = stochastic_bf16(mean, rng.hash_index(k0, k1, j))
  return sent, norm, amax, bad, mean, _pow2(-shift)


def _row_shift(amax, safe_exponent: int):
  """The guard's exponent for a largest magnitude ``amax``: ``min(safe - e, 0)``."""
  e = jnp.where(amax > 0, _exponent(amax), 0)
  return jnp.minimum(safe_exponent - e, 0)


def guard_exponent(amax, safe_exponent: int):
  """The guard's scale exponent for the ranks' largest finite magnitude ``amax``:
  ``min(safe_exponent - frexp(amax)[1], 0)`` (``dynamiq_jax.engine.guard.guarded``)."""
  return _row_shift(amax, safe_exponent)


def rescale(found, scale_exponent=None, *, safe_exponent: int, scale=None):
  """:func:`guard_stats`' row statistics (a :class:`GuardStats`) -> those of the guarded
  bucket: ``(stats, centre)``, ``[S, 2]`` bfloat16 (mean, norm: the means already
  stochastically rounded) and float32 ``[S]`` the centring means (:func:`row_mean` of the
  guarded rows, bit for bit barring subnormals: module docstring), ``scale_exponent``
  (int32) the bucket's guard exponent (:func:`guard_exponent`), or ``scale`` its factor
  ``2^scale_exponent`` (float32; the guard's own, so that no program computes it twice).
  Each row times ``2^scale_exponent 2^-shift`` (``found.unshift``; exact: a power of two in
  [2^-64, 1]).
  """
  if safe_exponent >= 127:  # nothing is scaled
    return jnp.stack([found.mean, found.norm], axis=-1).astype(jnp.bfloat16), found.centre
  f = (_pow2(scale_exponent) if scale is None else scale) * found.unshift  # (exact)
  return (jnp.stack([found.mean * f, found.norm * f], axis=-1).astype(jnp.bfloat16),
          found.centre * f)


def sum_block(means, norms, sqrt=jnp.sqrt):
  """Decoded payloads ``means, norms`` float32 [n, B] (bf16-exact, norms >= 0, below
  2^100; n a power of two, zero rows padding) -> float32 ``(total, norm)`` [B]: the means'
  pairwise tree sum in rank order (:func:`dynamiq_jax.codecs._exact.tree_sum`), the norms'
  ``sqrt(sum of squares)`` rounded to bf16 (:func:`dynamiq_jax.codecs._exact.hypot_all`)."""
  total = tree_sum(means, axis=0)
  m = jnp.max(norms, axis=0)
  finite = finite_mask(m) & (m > 0)
  e = jnp.minimum(jnp.where(finite, _exponent(m), 1), 127)
  b = norms * _pow2(-e)[None, :]
  h = sqrt(tree_sum(b * b, axis=0)) * _pow2(e)
  norm = _bf16_round(jnp.where(finite, h, m + jnp.sum(norms, axis=0)))
  return total, norm
