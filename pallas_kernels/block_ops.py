"""The instructions of DynamiQ's block arithmetic that a kernel may replace.

:class:`BlockOps` names each operation of :mod:`pallas_kernels.dynamiq_block`
that a GPU kernel implements by one instruction
(:data:`pallas_kernels.triton_chunk.GPU_OPS`); :data:`REFERENCE_OPS` holds
the jnp ones, which the reference and the kernels in interpret mode run
(the ``ref_`` functions). Each GPU instruction must give the reference's bits
where :class:`BlockOps` says so.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import rng

__all__ = ["BlockOps", "REFERENCE_OPS", "ref_floor_int", "ref_fma", "ref_frac_mul", "ref_lt_mask",
           "ref_mul_add_rounded", "ref_or_unless", "ref_max_last"]


def ref_floor_int(v):
  """``floor(v)`` as int32 (NaN -> 0, saturating)."""
  return jnp.floor(v).astype(jnp.int32)


def ref_fma(a, b, c):
  return a * b + c


def ref_frac_mul(w, d):
  """``(w + 1) d``, rounded once (``w + 1`` is exact for ``w`` in (-2, -1])."""
  return (w + np.float32(1.0)) * d


def ref_lt_mask(a, b):
  """int32 -1 where ``a < b`` (ordered: false for NaN), else 0."""
  return -(a < b).astype(jnp.int32)


def ref_mul_add_rounded(a, b, c):
  """``sat(a b) + c`` with the product rounded first (two roundings), ``sat`` the
  clamp to [0, 1] where a NaN product gives 0 (the GPU's ``mul.rn.sat.f32``; maxNum
  with 0, then the minimum with 1). The clamp also keeps a compiler from fusing the
  product and the sum into one ``fma`` (XLA:CPU does at its default optimisation
  level), and a non-finite element (whose super-group has ``rs = 0``: infinity times
  0) gets the same code everywhere instead of one made from a NaN's bits, which
  backends set differently."""
  return jnp.minimum(jnp.fmax(a * b, np.float32(0.0)), np.float32(1.0)) + c


def ref_or_unless(z, bits, neg):
  """``z | (bits & ~neg)`` (uint32)."""
  return z | (bits & ~neg.astype(jnp.uint32))


def ref_max_last(a):
  """The maximum of float32 ``a >= 0`` (or NaN) over its last axis, NaN if any is NaN: taken
  on the float bits as integers (their order for non-negative floats, NaN's above
  infinity's). XLA:CPU reduces a float maximum over an axis that is not the minor one
  with a library kernel that drops NaN (a kernel's ``interpret=True`` view of its
  registers), so a float reduction would not give every backend the same result."""
  m = jnp.max(jax.lax.bitcast_convert_type(a, jnp.int32), axis=-1)
  return jax.lax.bitcast_convert_type(m, jnp.float32)


class BlockOps(NamedTuple):
  """The operations of the block arithmetic that a kernel may implement by one GPU
  instruction each (:data:`REFERENCE_OPS`: the jnp ones).

  ``floor_int``, ``lt_mask``, ``frac_mul``, ``mulhi`` and ``mul_add_rounded`` must
  equal the reference's on every input; ``fma`` may be fused or not (every sum it
  feeds has an exact product, except the first guess); ``log2`` and ``div``
  feed only first guesses, so any approximation within 2^-20 (``log2``) or a
  few ulp for divisors in [2^-126, 2^126] (``div``; None: exact ``/``, whose
  operands are then not rescaled) gives the same codes. ``max_last``: the maximum of
  non-negative floats (or NaN) over the last axis, NaN if any is (a GPU's float
  maximum propagates NaN).
  """

  log2: Callable = jnp.log2
  floor_int: Callable = ref_floor_int
  fma: Callable = ref_fma
  lt_mask: Callable = ref_lt_mask
  frac_mul: Callable = ref_frac_mul
  div: Callable | None = None
  mulhi: Callable = rng.mulhi
  mul_add_rounded: Callable = ref_mul_add_rounded
  or_unless: Callable = ref_or_unless
  max_last: Callable = ref_max_last


REFERENCE_OPS = BlockOps()
"""The jnp operations (the reference's, and the kernels' in interpret mode)."""
