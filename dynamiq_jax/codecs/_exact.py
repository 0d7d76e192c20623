"""Arithmetic whose result does not depend on how a backend schedules it.

XLA contracts ``a * b + c`` into a fused multiply-add wherever it fuses, and
reduces in an order of its choosing; results that every rank must agree on
(and that ``simulate`` must reproduce under ``vmap``) are therefore computed
with explicit pairwise trees and with products that are exact (bf16-exact
operands), so that each step is a single, uniquely rounded IEEE operation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bf16 import round_nearest as bf16_round
from pallas_kernels.bf16 import stochastic as stochastic_bf16

__all__ = ["bf16_round", "stochastic_bf16", "tree_sum", "row_norm", "hypot", "hypot_all",
           "vector_norm"]


def tree_sum(v):
  """Sum over the last axis (zero-padded to a power of two) by a fixed pairwise tree."""
  n = v.shape[-1]
  p = 1 << max(n - 1, 0).bit_length()
  if p != n:
    v = jnp.concatenate([v, jnp.zeros(v.shape[:-1] + (p - n,), v.dtype)], axis=-1)
  while v.shape[-1] > 1:
    h = v.shape[-1] // 2
    v = v[..., :h] + v[..., h:]
  return v[..., 0]


def _pow2_flushed(k):
  """``2.0 ** k`` for int32 ``k`` as XLA:CPU computes it: exact from 2^-126 to
  2^127, 0 below (subnormals flushed), inf above (checked for every k that
  :func:`_ldexp_cpu` can meet in ``tests/test_exact.py``)."""
  bits = (jnp.clip(k, -127, 128) + 127).astype(jnp.uint32) << 23  # -127: 0.0, 128: inf
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _ldexp_cpu(x, k):
  """``jnp.ldexp(x, k)`` (float32 x, int32 k) step for step, with the power of two
  built from its bits instead of ``2.0 ** k`` (a float ``pow`` per element,
  the larger part of :func:`row_norm`'s time on XLA:CPU)."""
  m, e = jnp.frexp(x)
  e = e + k
  m = jnp.where(e > 0, m * 2, m)
  e = jnp.where(e > 0, e - 1, e)
  out = m * _pow2_flushed(e)
  return jnp.where(jnp.isinf(x) | (x == 0), x, out)


def _ldexp(x, k):
  """``jnp.ldexp(x, k)``: :func:`_ldexp_cpu` in a lowering for the CPU, whose
  ``pow`` it reproduces; ``jnp.ldexp`` itself elsewhere."""
  return jax.lax.platform_dependent(x, k, cpu=_ldexp_cpu, default=jnp.ldexp)


def row_norm(r):
  """L2 norm over the last axis: bf16-exact, deterministic, overflow-free."""
  m = jnp.max(jnp.abs(r), axis=-1)
  finite = jnp.isfinite(m) & (m > 0)
  _, e = jnp.frexp(jnp.where(finite, m, 1.0))
  b = bf16_round(_ldexp(r, -e[..., None]))  # |b| <= 1; b*b is exact
  nrm = jnp.ldexp(jnp.sqrt(tree_sum(b * b)), e)
  return bf16_round(jnp.where(finite, nrm, m))


def hypot(a, b):
  """sqrt(a^2 + b^2) for bf16-exact a, b >= 0; result rounded to bf16."""
  m = jnp.maximum(a, b)
  finite = jnp.isfinite(m) & (m > 0)
  _, e = jnp.frexp(jnp.where(finite, m, 1.0))
  a2 = jnp.ldexp(a, -e)
  b2 = jnp.ldexp(b, -e)
  h = jnp.ldexp(jnp.sqrt(a2 * a2 + b2 * b2), e)  # exact squares: one rounding
  return bf16_round(jnp.where(finite, h, m + a + b))


def hypot_all(v):
  """``sqrt(sum of squares)`` over the last axis of bf16-exact ``v >= 0``, rounded to bf16.

  Scaled by a power of two below the largest (exact), squared (exact: 16
  significant bits), summed by :func:`tree_sum` (a fixed order), one square
  root: the same bits on every backend. Non-finite where any value is.
  """
  m = jnp.max(v, axis=-1)
  finite = jnp.isfinite(m) & (m > 0)
  _, e = jnp.frexp(jnp.where(finite, m, 1.0))
  b = jnp.ldexp(v, -e[..., None])
  h = jnp.ldexp(jnp.sqrt(tree_sum(b * b)), e)
  return bf16_round(jnp.where(finite, h, m + jnp.sum(v, axis=-1)))


def vector_norm(x, row: int = 256):
  """L2 norm of a flat vector, bf16-exact and deterministic."""
  pad = (-x.shape[0]) % row
  rows = row_norm(jnp.pad(x, (0, pad)).reshape(-1, row))
  m = jnp.max(rows)
  finite = jnp.isfinite(m) & (m > 0)
  _, e = jnp.frexp(jnp.where(finite, m, 1.0))
  b = bf16_round(jnp.ldexp(rows, -e))
  nrm = jnp.ldexp(jnp.sqrt(tree_sum(b * b)), e)
  return bf16_round(jnp.where(finite, nrm, m))
