"""DynamiQ's guard and statistics in one pass over a bucket, and the statistics' sum.

:func:`guard_stats` reads a bucket ``x`` float32 ``[S, 256]`` once (one
super-group of 256 coordinates per row) and gives, per row:

* the guard's votes (:func:`dynamiq_jax.engine.guard`): the largest finite
  magnitude and 1.0 if any value is NaN or infinite;
* the local mean of the row's finite values (non-finite ones count as 0, as
  the guard makes them), already rounded to bf16 *stochastically* as the
  statistics all-reduce's first encode does (the key of the row's chunk c at
  step ``hop``: :func:`pallas_kernels.rng.hash_index` of the element index
  ``row % s`` in the chunk of ``s`` rows);
* the L2 norm of the centred residual, exact to bf16 (:func:`row_norm_block`,
  the arithmetic of :func:`dynamiq_jax.codecs._exact.row_norm`);
* the centring mean itself, float32 (the codec subtracts it before it
  encodes: :func:`rescale` finishes it), so that no second pass over the bucket
  (:func:`row_mean`) computes it again.

**Scale.** The guard scales a bucket whose largest magnitude reaches
``2^safe_exponent`` by a power of two, which is known only once every rank
has voted; this pass runs before that. So each row is first scaled by its
*own* guard factor ``2^shift`` (``shift = min(safe_exponent - e, 0)``,
``e`` the exponent of the row's largest magnitude: 0 for every usual row),
which keeps sums and residuals finite, and :func:`rescale` multiplies mean and
norm (and the centring mean) by ``2^(bucket shift - row shift)`` after the
vote. A product by a power of two is exact, and stochastic rounding to bf16 commutes with it, so
these are the statistics of the guarded bucket, bit for bit, except where
the guarded values are subnormal (below 2^-126: only in a bucket with a
value of 2^64 or more, for values 2^190 times smaller than its largest):
there the statistics of the guarded bucket would have lost bits that these
keep (and a GPU may flush them), and the centring mean can differ from
:func:`row_mean` of the guarded values (and from the mean sent) in those bits.
Norms below 2^-126 are flushed to 0 (they only rank super-groups).

:func:`stats_sum` is the owner's step of the statistics' all-reduce
(:meth:`dynamiq_jax.codecs.supergroup_stats.SupergroupStats.decode_sum`): the n ranks'
payloads of one chunk ``[n, s, 2]`` bf16 decoded, the means summed by a fixed
pairwise tree in rank order, the norms combined as ``sqrt(sum of squares)``
(:func:`dynamiq_jax.codecs._exact.hypot_all`'s arithmetic), in one launch.
:func:`row_mean` is the centring mean of a guarded bucket that :func:`guard_stats` did
not read (the same tree).

Memory layout: one program handles :data:`BLOCK` rows, each row whole in
registers (both reductions of a row stay in the program) and writes one
column of a ``[6, S]`` output (mean, norm, largest magnitude, non-finite flag,
centring mean, inverse row factor);
the key tables come in whole and are gathered by chunk. Pairwise trees are
``split``-and-add steps (``v[..., :h] + v[..., h:]``), which the Triton
backend lowers as register shuffles. The block arithmetic below is shared by
the kernels and their jnp references (``*_reference``, the product path off
GPU), so the two agree bit for bit; on a GPU the square root is
``sqrt.rn.f32`` (correctly rounded, like XLA's).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dispatch as D
from pallas_kernels import rng
from pallas_kernels import stats_block as SB
from pallas_kernels.stats_block import ROW, guard_exponent, rescale, row_norm_block
from pallas_kernels.stats_block import row_stats_block, tree_sum
from pallas_kernels import triton_ops as tt

__all__ = ["ROW", "BLOCK", "NUM_WARPS", "tree_sum", "row_stats_block", "row_norm_block",
           "guard_exponent", "rescale", "GuardStats", "row_mean", "row_mean_reference",
           "row_mean_pallas",
           "guard_stats", "guard_stats_reference", "guard_stats_pallas",
           "stats_sum", "stats_sum_reference", "stats_sum_pallas", "stats_sum_encode",
           "stats_sum_encode_reference"]

BLOCK = 16
"""Rows per program of :func:`guard_stats_pallas`: 32 values per thread with
:data:`NUM_WARPS` warps."""
NUM_WARPS = 4
"""Warps per program."""
_SUM_BLOCK = 256  # super-groups per program of stats_sum_pallas
_OUTPUTS = 6  # rows of guard_stats' output: mean, norm, amax, bad, centre, unshift


# ----------------------------------------------------------------------------
# Block arithmetic (backend-free; ``sqrt`` is passed in).


# ----------------------------------------------------------------------------
# The statistics pass.


def _check_rows(x):
  if x.ndim != 2 or x.shape[1] != ROW:
    raise ValueError(f"x has shape {x.shape}; give rows [S, {ROW}] (one super-group each)")


def _chunk_keys(k0, k1, hop, c, stride: int):
  """Each row's key: entry ``c * stride + hop`` of the flat key tables ``k0, k1``."""
  i = c * stride + hop
  return k0[i], k1[i]


class GuardStats(NamedTuple):
  """What :func:`guard_stats` returns: float32 [S] per row, float32 [2, P] the votes.

  Attributes:
    mean: the row-scaled local mean, rounded to bf16 stochastically (the statistics'
      first encode).
    norm: the row-scaled norm of the centred residual, rounded to bf16.
    rows_amax: each row's largest finite magnitude.
    votes: ``[2, P]``, the guard's votes of the rows' P parts of :data:`BLOCK` rows (the
      kernel's programs): the largest finite magnitude, and 1.0 if a value is not
      finite. The bucket's votes are their maxima over P (:attr:`amax`, :attr:`bad`);
      left apart, the caller's maximum can take in votes of its own in one operation.
    centre: the row-scaled local mean in float32 (:func:`rescale` finishes it).
    unshift: ``2^-shift``, the inverse of each row's own guard factor (:func:`rescale`).
  """

  mean: jax.Array
  norm: jax.Array
  rows_amax: jax.Array
  votes: jax.Array
  centre: jax.Array
  unshift: jax.Array

  @property
  def amax(self):
    """The bucket's vote: its largest finite magnitude."""
    return jnp.max(self.votes[..., 0, :], axis=-1)

  @property
  def bad(self):
    """The bucket's vote: 1.0 if a value is not finite."""
    return jnp.max(self.votes[..., 1, :], axis=-1)


def guard_stats_reference(x, k0, k1, hop=0, *, s: int, safe_exponent: int, stride: int = 1):
  """:func:`guard_stats` in jnp: the same block arithmetic over every row at once."""
  _check_rows(x)
  row = jnp.arange(x.shape[0], dtype=jnp.int32)
  k0, k1 = (jnp.asarray(k, jnp.uint32).reshape(-1) for k in (k0, k1))
  hop = jnp.asarray(hop, jnp.int32).reshape(())
  mean, norm, amax, bad, mid, unshift = row_stats_block(
      x, row % s, *_chunk_keys(k0, k1, hop, row // s, stride), safe_exponent=safe_exponent)
  parts = pl.cdiv(x.shape[0], BLOCK)  # the kernel's programs: votes of BLOCK rows each
  votes = jnp.pad(jnp.stack([amax, bad]), ((0, 0), (0, parts * BLOCK - x.shape[0])))
  return GuardStats(mean, norm, amax, jnp.max(votes.reshape(2, parts, BLOCK), axis=-1), mid,
                    unshift)


def _guard_stats_kernel(keys_ref, hop_ref, x_ref, out_ref, votes_ref, *, block: int, s: int,
                        stride: int, safe_exponent: int, interpret: bool, rows: int):
  # keys_ref: k0's table, then k1's (one operand: a bucket's two tables are adjacent in
  # its key row, so XLA passes one slice of it)
  half = keys_ref.shape[0] // 2
  row = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
  c = jnp.minimum(row // s, half // stride - 1)  # rows past the end: any key
  i = c * stride + hop_ref[0]
  sqrt = jnp.sqrt if interpret else _sqrt_rn
  found = row_stats_block(x_ref[...], row % s, keys_ref[i], keys_ref[half + i],
                          safe_exponent=safe_exponent, sqrt=sqrt)
  for r, v in enumerate(found):  # (mean, norm, amax, bad, centre, unshift): one output
    out_ref[r, :] = v
  # this program's votes (the largest of its rows'; 0, the maximum's identity here, for
  # rows past the end), so that the bucket's vote is a maximum over programs, not rows
  ok = row < rows
  for r in (2, 3):
    votes_ref[r - 2, 0] = jnp.max(jnp.where(ok, found[r], 0.0))


def _sqrt_rn(v):
  """Correctly rounded square root on the GPU (``sqrt.rn.f32``), as XLA's."""
  return tt.asm("sqrt.rn.f32 $0, $1;", "=f,f", jnp.float32, v)


def _compiler_params(interpret, num_warps=NUM_WARPS):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltr  # pylint: disable=import-outside-toplevel
  return pltr.CompilerParams(num_warps=num_warps, num_stages=1)


@functools.partial(jax.jit, static_argnames=("s", "stride", "safe_exponent", "interpret",
                                             "block"))
def _guard_stats_launch(x, keys, hop, *, s, stride, safe_exponent, interpret, block):
  rows = x.shape[0]
  programs = pl.cdiv(rows, block)
  kernel = functools.partial(_guard_stats_kernel, block=block, s=s, stride=stride,
                             safe_exponent=safe_exponent, interpret=bool(interpret), rows=rows)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))
  out = [jax.ShapeDtypeStruct((_OUTPUTS, rows), jnp.float32),
         jax.ShapeDtypeStruct((2, programs), jnp.float32)]
  return pl.pallas_call(
      kernel, out_shape=[D.typed_like(o, (x, keys, hop)) for o in out], grid=(programs,),
      in_specs=[whole(keys), whole(hop), pl.BlockSpec((block, ROW), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((_OUTPUTS, block), lambda i: (0, i)),
                 pl.BlockSpec((2, 1), lambda i: (0, i))],
      compiler_params=_compiler_params(interpret), interpret=interpret,
      name="dynamiq_guard_stats")(keys, hop, x)


def guard_stats_pallas(x, k0, k1, hop=0, *, s: int, safe_exponent: int, stride: int = 1,
                       interpret=False, block: int = BLOCK):
  """Kernel version of :func:`guard_stats_reference` (the same arguments)."""
  _check_rows(x)
  if x.dtype != jnp.float32:
    raise NotImplementedError(f"x dtype {x.dtype} (the kernel takes float32)")
  if not interpret:
    _quiet()
  hop = jnp.asarray(hop, jnp.int32).reshape(1)
  launch = functools.partial(_guard_stats_launch, s=s, stride=stride,
                             safe_exponent=safe_exponent, interpret=interpret, block=block)
  out, votes = D.map_over_batch(launch, x, _flat_keys(k0, k1), hop)  # [..., 6, S], [..., 2, P]
  return GuardStats(out[..., 0, :], out[..., 1, :], out[..., 2, :], votes, out[..., 4, :],
                    out[..., 5, :])


def guard_stats(x, k0, k1, hop=0, *, s: int, safe_exponent: int, stride: int = 1,
                implementation: D.Implementation = None, interpret: bool | None = None):
  """The guard's votes and a bucket's statistics in one pass (module docstring).

  Args:
    x: float32 [S, 256], one super-group per row.
    k0, k1: uint32, flat tables of the keys of the statistics' first encode:
      chunk c's is entry ``c * stride + hop`` (DynamiQ's ``[n, n + 1]`` tables of
      (chunk, step) with ``stride = n + 1`` and ``hop`` this rank; ``[n]`` keys with
      the defaults).
    hop: int32 scalar (see ``k0``).
    s: rows per chunk (``S = n s``).
    safe_exponent: magnitudes from ``2^safe_exponent`` are scaled down by the guard.
    stride: see ``k0``.
    implementation, interpret: as :func:`pallas_kernels.dynamiq.compress`'s.

  Returns:
    a :class:`GuardStats`: float32 [S] the row-scaled statistics (the mean rounded
    to bf16 stochastically, the norm to bf16), each row's largest finite magnitude,
    the row-scaled centring mean and the inverse row factor (:func:`rescale` takes
    it all); float32 [2, P] the guard's votes of P parts of the rows (the largest
    finite magnitude and the non-finite flag; their maxima over P are the bucket's).
  """
  n = np.size(k0) // stride
  if s < 1 or x.ndim != 2 or x.shape[0] != s * n:
    raise ValueError(f"x has shape {np.shape(x)} but s={s} rows per chunk and "
                     f"{n} chunk keys; give rows [S = n s, {ROW}]")
  return D.dispatch("guard_stats", D.Kernels(guard_stats_pallas), guard_stats_reference,
                    _implementation(implementation), interpret, x, k0, k1, hop, s=s, safe_exponent=safe_exponent,
                    stride=stride)


def row_mean_reference(x):
  """:func:`row_mean` in jnp."""
  _check_rows(x)
  return tree_sum(x.astype(jnp.float32)) * np.float32(1.0 / ROW)


def _row_mean_kernel(x_ref, out_ref):
  out_ref[...] = tree_sum(x_ref[...].astype(jnp.float32)) * np.float32(1.0 / ROW)


@functools.partial(jax.jit, static_argnames=("interpret", "block"))
def _row_mean_launch(x, *, interpret, block):
  out = jax.ShapeDtypeStruct((x.shape[0],), jnp.float32)
  return pl.pallas_call(
      _row_mean_kernel, out_shape=D.typed_like(out, (x,)), grid=(pl.cdiv(x.shape[0], block),),
      in_specs=[pl.BlockSpec((block, ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      compiler_params=_compiler_params(interpret), interpret=interpret,
      name="dynamiq_row_mean")(x)


def row_mean_pallas(x, *, interpret=False, block: int = BLOCK):
  """Kernel version of :func:`row_mean_reference`."""
  _check_rows(x)
  if x.dtype != jnp.float32:
    raise NotImplementedError(f"x dtype {x.dtype} (the kernel takes float32)")
  if not interpret:
    _quiet()
  return D.map_over_batch(functools.partial(_row_mean_launch, interpret=interpret, block=block),
                          x)


def row_mean(x, *, implementation: D.Implementation = None, interpret: bool | None = None):
  """Each row's mean, its pairwise :func:`tree_sum` times 2^-8: the centring mean of a
  guarded bucket ``x`` float32 [S, 256] (what :func:`guard_stats` gives in its pass,
  barring subnormals: module docstring), for a bucket that pass did not read."""
  return D.dispatch("row_mean", D.Kernels(row_mean_pallas), row_mean_reference,
                    _implementation(implementation), interpret, x)


# ----------------------------------------------------------------------------
# The statistics' sum (the owner's step of the two-step all-reduce).


def _check_payloads(payloads):
  if payloads.ndim != 3 or payloads.shape[-1] != 2:
    raise ValueError(f"payloads have shape {payloads.shape}; give [n, s, 2] (mean, norm)")


def _pad_ranks(payloads):
  n = payloads.shape[0]
  q = 1 << max(n - 1, 0).bit_length()
  return jnp.pad(payloads, ((0, q - n), (0, 0), (0, 0))) if q != n else payloads


def _encode_block(total, norm, k0, k1, j):
  """The sum's encode for the next step (:meth:`SupergroupStats.encode
  <dynamiq_jax.codecs.supergroup_stats.SupergroupStats.encode>`): bfloat16 ``[B, 2]``, the
  means ``total`` rounded stochastically by ``hash_index(k0, k1, j)`` (non-finite
  ones as they are, as :func:`pallas_kernels.bf16.stochastic`), the norms as they are
  (bf16-exact)."""
  mean = jnp.where(SB.finite_mask(total), SB.stochastic_bf16(total, rng.hash_index(k0, k1, j)), total)
  return jnp.stack([mean, norm], axis=-1).astype(jnp.bfloat16)


def _sum_keys(keys, chunk, *, stride: int, step: int):
  """``(k0, k1)`` of chunk ``chunk`` at ``step``: entry ``chunk stride + step`` of the flat
  tables ``keys`` (k0's, then k1's; an array, or the kernel's ref)."""
  half = keys.shape[0] // 2
  i = chunk * stride + step
  return keys[i], keys[half + i]


def _summed(payloads):
  """``(total, norm)`` float32 [s] of payloads [n, s, 2] (:func:`~pallas_kernels.stats_block.sum_block`), in jnp."""
  _check_payloads(payloads)
  p = _pad_ranks(payloads).astype(jnp.float32)
  return SB.sum_block(p[..., 0], p[..., 1])


def stats_sum_reference(payloads):
  """:func:`stats_sum` in jnp."""
  return jnp.stack(_summed(payloads), axis=-1)


def stats_sum_encode_reference(payloads, k0, k1, chunk, *, stride: int, step: int):
  """:func:`stats_sum_encode` in jnp."""
  total, norm = _summed(payloads)
  keys = _flat_keys(k0, k1)
  c = jnp.asarray(chunk, jnp.int32).reshape(())
  j = jnp.arange(total.shape[0], dtype=jnp.int32)
  return _encode_block(total, norm, *_sum_keys(keys, c, stride=stride, step=step), j)


def _stats_sum_kernel(p_ref, *refs, interpret: bool, encode: bool, block: int, stride: int,
                      step: int):
  means = p_ref[:, :, 0].astype(jnp.float32)
  norms = p_ref[:, :, 1].astype(jnp.float32)
  total, norm = SB.sum_block(means, norms, sqrt=jnp.sqrt if interpret else _sqrt_rn)
  if not encode:
    [out_ref] = refs
    out_ref[...] = jnp.stack([total, norm], axis=-1)
    return
  keys_ref, chunk_ref, out_ref = refs
  j = pl.program_id(0) * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
  out_ref[...] = _encode_block(total, norm,
                               *_sum_keys(keys_ref, chunk_ref[0], stride=stride, step=step), j)


@functools.partial(jax.jit, static_argnames=("interpret", "block", "stride", "step"))
def _stats_sum_launch(payloads, keys=None, chunk=None, *, interpret, block, stride=1, step=0):
  n, s, _ = payloads.shape
  encode = keys is not None
  out = jax.ShapeDtypeStruct((s, 2), jnp.bfloat16 if encode else jnp.float32)
  operands = (payloads, keys, chunk) if encode else (payloads,)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))
  return pl.pallas_call(
      functools.partial(_stats_sum_kernel, interpret=bool(interpret), encode=encode,
                        block=block, stride=stride, step=step),
      out_shape=D.typed_like(out, operands), grid=(pl.cdiv(s, block),),
      in_specs=[pl.BlockSpec((n, block, 2), lambda i: (0, i, 0))]
      + ([whole(keys), whole(chunk)] if encode else []),
      out_specs=pl.BlockSpec((block, 2), lambda i: (i, 0)),
      compiler_params=_compiler_params(interpret), interpret=interpret,
      name="dynamiq_stats_sum_encode" if encode else "dynamiq_stats_sum")(*operands)


def _check_sum_kernel(payloads, interpret):
  _check_payloads(payloads)
  n = payloads.shape[0]
  if payloads.dtype != jnp.bfloat16:
    raise NotImplementedError(f"payload dtype {payloads.dtype} (the kernel takes bfloat16)")
  if n & (n - 1):
    raise NotImplementedError(f"n={n} ranks, not a power of two")
  if not interpret:
    _quiet()


def _sum_block_rows(payloads, block: int) -> int:
  return min(block, 1 << max(payloads.shape[1] - 1, 0).bit_length())


def stats_sum_pallas(payloads, *, interpret=False, block: int = _SUM_BLOCK):
  """Kernel version of :func:`stats_sum_reference`."""
  _check_sum_kernel(payloads, interpret)
  launch = functools.partial(_stats_sum_launch, interpret=interpret,
                             block=_sum_block_rows(payloads, block))
  return D.map_over_batch(launch, payloads)


def _flat_keys(k0, k1):
  """k0's and k1's tables, flat, in one operand (a bucket's two tables are adjacent in its
  key row, so XLA passes one slice of it, the one :func:`guard_stats` reads)."""
  k0, k1 = (jnp.asarray(k, jnp.uint32).reshape(-1) for k in (k0, k1))
  if k0.shape != k1.shape:
    raise ValueError(f"k0 has {k0.size} keys and k1 {k1.size}; give tables of one size")
  return jnp.concatenate([k0, k1])


def stats_sum_encode_pallas(payloads, k0, k1, chunk, *, stride: int, step: int, interpret=False,
                            block: int = _SUM_BLOCK):
  """Kernel version of :func:`stats_sum_encode_reference` (the same arguments)."""
  _check_sum_kernel(payloads, interpret)
  launch = functools.partial(_stats_sum_launch, interpret=interpret, stride=stride, step=step,
                             block=_sum_block_rows(payloads, block))
  return D.map_over_batch(launch, payloads, _flat_keys(k0, k1),
                          jnp.asarray(chunk, jnp.int32).reshape(1))


def stats_sum(payloads, *, implementation: D.Implementation = None,
              interpret: bool | None = None):
  """The n ranks' statistics payloads of one chunk, decoded and summed in one pass.

  Args:
    payloads: bfloat16 [n, s, 2], row r rank r's (mean, norm) of the chunk.

  Returns:
    float32 [s, 2]: the means added in rank order by a pairwise tree, the
    norms combined as ``sqrt(sum of squares)`` rounded to bf16 (what
    :meth:`~dynamiq_jax.codecs.supergroup_stats.SupergroupStats.decode_sum` returns).
  """
  return D.dispatch("stats_sum", D.Kernels(stats_sum_pallas), stats_sum_reference,
                    _implementation(implementation), interpret, payloads)


def stats_sum_encode(payloads, k0, k1, chunk, *, stride: int, step: int,
                     implementation: D.Implementation = None, interpret: bool | None = None):
  """:func:`stats_sum` and the sum's encode for the next step, in one pass: the owner's
  step of the statistics' two-step all-reduce, ending in what it all-gathers.

  Args:
    payloads: bfloat16 [n, s, 2], as for :func:`stats_sum`.
    k0, k1: uint32, flat key tables (as :func:`guard_stats`'): the encode's key is
      entry ``chunk * stride + step``.
    chunk: int32 scalar, the chunk this rank owns (traced).
    stride, step: static ints (DynamiQ's ``[n, n + 1]`` tables: ``n + 1`` and ``n``).

  Returns:
    bfloat16 [s, 2]: the means of :func:`stats_sum` rounded to bf16 stochastically by
    ``hash_index(k0, k1, j)`` for row j, the norms as they are: the bits of
    :meth:`SupergroupStats.encode <dynamiq_jax.codecs.supergroup_stats.SupergroupStats.encode>`
    of :func:`stats_sum`.
  """
  if not (isinstance(stride, (int, np.integer)) and isinstance(step, (int, np.integer))):
    raise TypeError(f"stride={stride!r} and step={step!r} must be Python ints (static)")
  return D.dispatch("stats_sum_encode", D.Kernels(stats_sum_encode_pallas),
                    stats_sum_encode_reference, _implementation(implementation), interpret,
                    payloads, k0, k1, chunk, stride=int(stride), step=int(step))


def _implementation(implementation: D.Implementation) -> D.Implementation:
  """These kernels have no Mosaic GPU form: under ``"mosaic"`` (the hops' backend) they take
  the default path (Triton where it compiles, else the reference)."""
  return None if implementation == "mosaic" else implementation


def _quiet():
  from pallas_kernels import dynamiq_triton  # pylint: disable=import-outside-toplevel
  dynamiq_triton.quiet_triton_deprecation()
