"""Triton-specific operations inside Pallas Triton kernels.

:func:`load` / :func:`store`: masked gathers and scatters of global memory
at computed offsets. The rest are PTX instructions, one per element (Triton
inline assembly), each the GPU form of a jnp operation that Triton would
otherwise compile to several instructions: the kernels pass them where the
block arithmetic takes its instructions
(:class:`pallas_kernels.dynamiq_block.BlockOps`), and the jnp forms in
interpret mode. :func:`pair16` and :func:`prmt` carry their jnp twins
(``interpret=True``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["load", "store", "asm", "approx_log2", "mulhi", "floor_int", "div_approx", "lt_mask",
           "fma", "mul_add_rounded", "or_unless", "bit_select", "frac_mul", "byte", "byte_over",
           "third_bytes", "shift_right64", "pair16",
           "prmt"]


def load(ref, offsets, mask):
  """``ref`` at the int32 ``offsets`` (a flat ref in global memory), 0 where not ``mask``."""
  from jax.experimental.pallas import triton as pltr
  return pltr.load(ref.at[offsets], mask=mask, other=0)


def store(ref, offsets, values, mask):
  """Stores ``values`` at the int32 ``offsets`` of ``ref`` where ``mask``."""
  from jax.experimental.pallas import triton as pltr
  pltr.store(ref.at[offsets], values, mask=mask)


def asm(text: str, constraints: str, dtype, *args):
  """One PTX instruction (or block) per element of the broadcast ``args``:
  Triton's inline assembly, the result of ``dtype``. Unsigned ints go in and
  out as their signless int32 bits (``"r"``)."""
  from jax.experimental.pallas import triton as pltr
  args = [jax.lax.bitcast_convert_type(a, jnp.int32) if a.dtype == jnp.uint32 else a
          for a in jnp.broadcast_arrays(*args)]
  out_dtype = jnp.int32 if dtype == jnp.uint32 else dtype
  [out] = pltr.elementwise_inline_asm(text, args=args, constraints=constraints, pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape,
                                                                                out_dtype)])
  return jax.lax.bitcast_convert_type(out, jnp.uint32) if dtype == jnp.uint32 else out


def approx_log2(v):
  """float32 base-2 log by ``lg2.approx.ftz.f32`` (one MUFU instruction; absolute
  error below 2^-22 for arguments >= 1/2). ``.ftz`` flushes subnormal
  arguments (DynamiQ's first guess never has one); without it ptxas wraps
  the MUFU in a subnormal test and a scaling."""
  return asm("lg2.approx.ftz.f32 $0, $1;", "=f,f", jnp.float32, v)


def mulhi(v, n: int):
  """:func:`pallas_kernels.rng.mulhi` by ``mul.hi.u32``."""
  return asm(f"mul.hi.u32 $0, $1, {int(n)};", "=r,r", jnp.uint32, v)


def floor_int(v):
  """``floor`` to int32 by ``cvt.rmi.s32.f32`` (NaN -> 0, saturating, as the reference)."""
  return asm("cvt.rmi.s32.f32 $0, $1;", "=r,f", jnp.int32, v)


def div_approx(a, b):
  """``a / b`` by ``div.approx.ftz.f32`` (2 ulp for ``|b|`` in [2^-126, 2^126]), for
  first guesses only (Triton's ``/`` is ``div.full.f32``, with range tests)."""
  return asm("div.approx.ftz.f32 $0, $1, $2;", "=f,f,f", jnp.float32, a, b)


def lt_mask(a, b):
  """int32 -1 where ``a < b``, as the sign of ``a - b`` (``sub.rn.f32``, ``shr.s32``):
  the reference's mask for every input (the difference of two distinct floats
  is never zero with subnormals kept, a NaN is not negative on a GPU), and no
  predicate for ``ptxas`` to keep alive."""
  return asm("{ .reg .b32 t; sub.rn.f32 t, $1, $2; shr.s32 $0, t, 31; }", "=r,f,f",
             jnp.int32, a, b)


def fma(a, b, c):
  """``a b + c`` by ``fma.rn.f32``."""
  return asm("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", jnp.float32, a, b, c)


def mul_add_rounded(a, b, c):
  """``sat(a b) + c``, the product rounded first: ``mul.rn.sat.f32`` (clamped to [0, 1],
  a NaN product gives 0) and ``add.rn.f32`` (the ``.rn`` forms, which ``ptxas`` never
  fuses into an ``fma``): the reference's ``_mul_add_rounded``."""
  return asm("{ .reg .f32 t; mul.rn.sat.f32 t, $1, $2; add.rn.f32 $0, t, $3; }",
             "=f,f,f,f", jnp.float32, a, b, c)


def bit_select(mask: int, a, b):
  """``(a & mask) | (b & ~mask)`` by one ``lop3.b32`` (uint32; ``mask`` static)."""
  return asm("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r", jnp.uint32, a, b,
             jnp.full(jnp.shape(a), mask, jnp.uint32))


def or_unless(z, bits, neg):
  """``z | (bits & ~neg)`` by one ``lop3.b32`` (uint32 ``z``, ``bits``; int32 ``neg``)."""
  return asm("lop3.b32 $0, $1, $2, $3, 0xF2;", "=r,r,r,r", jnp.uint32, z,
             jax.lax.bitcast_convert_type(neg, jnp.uint32), bits)


def frac_mul(w, d):
  """``(w + 1) d`` as one ``fma.rn.f32``: ``w d + d`` rounded once."""
  return fma(w, d, d)


def byte(w, i):
  """Byte ``i`` (uint32 array of 0..3) of ``w``, zero-extended: one ``prmt``."""
  return asm("prmt.b32 $0, $1, 0, $2;", "=r,r,r", jnp.uint32, w, i | np.uint32(0x4440))


def byte_over(w, i, hi):
  """Byte ``i`` (uint32 array of 0..3) of ``w`` in the low byte of ``hi`` (uint32 whose
  low byte is 0): ``hi | byte(w, i)``, one ``prmt``."""
  return asm("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", jnp.uint32, w, hi, i | np.uint32(0x7650))


def third_bytes(z0, z1, z2, z3, interpret: bool):
  """uint32 whose byte i is byte 2 of ``z_i``: three ``prmt``."""
  if interpret:
    return functools.reduce(jnp.bitwise_or, [((z >> np.uint32(16)) & np.uint32(0xFF))
                                             << np.uint32(8 * i)
                                             for i, z in enumerate((z0, z1, z2, z3))])
  return asm("{ .reg .b32 t, u; prmt.b32 t, $1, $2, 0x62; prmt.b32 u, $3, $4, 0x62; "
             "prmt.b32 $0, t, u, 0x5410; }", "=r,r,r,r,r", jnp.uint32, z0, z1, z2, z3)


def shift_right64(lo, hi, k, interpret: bool):
  """``(hi:lo) >> k`` as (low word, high word), ``k`` (uint32) in [0, 64): a ``shr.b64``
  and a ``shr.b32``."""
  if interpret:
    k = k.astype(jnp.uint32)
    big = k >= np.uint32(32)
    small = jnp.where(big, np.uint32(0), k)
    up = jnp.where(small == 0, np.uint32(0), hi << ((np.uint32(32) - small) & np.uint32(31)))
    return (jnp.where(big, hi >> (k - np.uint32(32)), (lo >> small) | up),
            jnp.where(big, np.uint32(0), hi >> small))
  low = asm("{ .reg .b64 t; mov.b64 t, {$1, $2}; shr.b64 t, t, $3; mov.b64 {$0, _}, t; }",
            "=r,r,r,r", jnp.uint32, lo, hi, k)
  return low, asm("shr.b32 $0, $1, $2;", "=r,r,r", jnp.uint32, hi, k)  # (0 for k >= 32)


def bf16_to_f32(x):
  """bfloat16 -> float32, two values per instruction pair: each 32-bit register of two
  values gives the low one by a ``prmt`` (its bits to the high half) and the high one
  by another (the low half zeroed), where the conversion would extract, then shift."""
  from jax.experimental.pallas import triton as pltr
  [out] = pltr.elementwise_inline_asm(
      "prmt.b32 $0, $2, 0, 0x1044; prmt.b32 $1, $2, 0, 0x3244;", args=[x],
      constraints="=r,=r,r", pack=2,
      result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
  return jax.lax.bitcast_convert_type(out, jnp.float32)


def pair16(lo, hi, interpret: bool):
  """``lo | hi << 16`` (uint32) of two uint16 words (None: zero): one ``mov.b32``
  of the two 16-bit registers (no zero extensions)."""
  if lo is None and hi is None:
    return None
  if lo is None or hi is None:
    return (lo.astype(jnp.uint32) if hi is None else hi.astype(jnp.uint32) << np.uint32(16))
  if interpret:
    return lo.astype(jnp.uint32) | (hi.astype(jnp.uint32) << np.uint32(16))
  lo, hi = (jax.lax.bitcast_convert_type(v, jnp.int16) for v in (lo, hi))
  return asm("mov.b32 $0, {$1, $2};", "=r,h,h", jnp.uint32, lo, hi)


def prmt(a, b, sel: int, interpret: bool):
  """The bytes of ``(a, b)`` (bytes 0-3 of a, 4-7 of b) chosen by the four
  nibbles of ``sel`` (low nibble: byte 0): one ``prmt.b32``."""
  if b is None:
    b = jnp.zeros_like(a)
  if interpret:
    out = jnp.zeros_like(a)
    for i in range(4):
      src = (sel >> (4 * i)) & 7
      v = ((a if src < 4 else b) >> np.uint32(8 * (src % 4))) & np.uint32(0xFF)
      out = out | (v << np.uint32(8 * i))
    return out
  return asm(f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r", jnp.uint32, a, b)
