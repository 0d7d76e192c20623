"""bfloat16 bit helpers, in one place for the codecs, the reference and the kernels.

Every function works on float32 arrays holding bf16-representable values (or
rounds to them) with integer operations only, so the result is exact and the
same on every backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["round_nearest", "ceil", "next_up", "stochastic", "to_bytes", "from_bytes"]


def round_nearest(v):
  """Round to bfloat16 (nearest-even), returned as float32."""
  return v.astype(jnp.bfloat16).astype(jnp.float32)


def ceil(v):
  """Smallest bfloat16-representable float32 >= ``v`` (for ``v >= 0``; a NaN gives a NaN).

  ``(bits + 0xFFFF)`` truncated to bf16: one carry into the bf16 part exactly
  when the low half is nonzero. NaNs are first brought to the quiet NaN
  0x7FC00000 (an unsigned minimum that leaves every other value as it is), so
  that no payload carries into the sign."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.uint32)
  bits = jnp.minimum(bits, jnp.uint32(0x7FC00000))
  return jax.lax.bitcast_convert_type((bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000),
                                      jnp.float32)


def next_up(v):
  """The next bfloat16 value above a bf16-exact ``v >= 0``."""
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32) + jnp.uint32(0x10000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def next_down(v):
  """The bfloat16 value below a bf16-exact ``v > 0``."""
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32) - jnp.uint32(0x10000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def stochastic(v, hash_bits):
  """Rounds float32 ``v`` to bfloat16 stochastically (unbiased).

  Adds the top 16 of ``hash_bits`` (uint32, one per element) below the bf16
  mantissa, then truncates. Non-finite values pass through.
  """
  bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
  noise = hash_bits >> 16
  out = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isfinite(v), out, v).astype(jnp.bfloat16)


def to_bytes(v):
  """bf16-exact float32 [...] -> uint8 [..., 2] (little-endian bf16 bits)."""
  u = jax.lax.bitcast_convert_type(v, jnp.uint32) >> 16
  return jnp.stack([u & 0xFF, u >> 8], axis=-1).astype(jnp.uint8)


def from_bytes(lo, hi):
  """Low and high bytes (uint8 arrays) of bf16 values -> float32."""
  u = (lo.astype(jnp.uint32) | (hi.astype(jnp.uint32) << 8)) << 16
  return jax.lax.bitcast_convert_type(u, jnp.float32)
