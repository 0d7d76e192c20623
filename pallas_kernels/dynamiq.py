"""DynamiQ's hop operations on a chunk payload: the kernels where they lower, or the reference.

=============================================  =======================================
:func:`compress`                               values -> chunk payload (leaf, sender)
:func:`decompress`                             chunk payload -> float32 (all-gather)
:func:`decompress_accumulate`                  ``decode(p) + x`` (butterfly node)
:func:`decompress_accumulate_recompress`       ring hop ``encode(decode(p) + x)`` in
                                               one pass; the sum is never stored
:func:`decompress_many`                        ``n`` payloads of the same widths ->
                                               float32 [n, S, 256], one launch
:func:`decompress_rows`                      the same, each output row from its slot
                                               plus a mean (a codec's finish), one launch
:func:`decompress_sum`                         their decodes summed in rank order
                                               (a two-step reduction), one launch
=============================================  =======================================

The modules behind them, kernel -> wrapper -> reference as in JAX's own
Pallas ops:

* :mod:`pallas_kernels.dynamiq_block`: the block arithmetic (levels, scales,
  draws, rounding) that kernel and reference share, so that they give the
  same bits;
* :mod:`pallas_kernels.dynamiq_triton`: the Pallas Triton kernels and their
  wrappers (``*_pallas``);
* :mod:`pallas_kernels.dynamiq_reference`: the payload's byte layout and the
  pure-jnp reference (``*_reference``), the product path on CPU;
* :mod:`pallas_kernels.dispatch`: the choice between them by the platform
  being lowered for (``implementation=``), the compile probe and the
  fallback.

* :mod:`pallas_kernels.dynamiq_mosaic`: the Mosaic GPU kernels (on the
  planar payload of :mod:`pallas_kernels.dynamiq_planar`; ``*_mosaic`` take
  record payloads and convert around the launch). ``"mosaic"`` forces them.
  With Mosaic-first dispatch on (:data:`pallas_kernels.dispatch.MOSAIC_FIRST`,
  off: docs/mosaic_gpu.md says why) ``implementation=None`` picks them for
  ``cuda`` where they lower for the target GPU (Hopper or newer; each probed
  on a small instance of the call's configuration, :func:`_probe`), Triton
  where they do not (older GPUs, jax 0.10.2), the reference last.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_mosaic as M
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import dynamiq_triton as T

__all__ = [
    "compress",
    "decompress",
    "decompress_accumulate",
    "decompress_accumulate_recompress",
    "decompress_many",
    "decompress_rows",
    "decompress_sum",
    "plane_table",
]


_PROBE_SUPERGROUPS = M.BLOCK + 1
"""Super-groups of the Mosaic GPU probe's instance: two programs, the last one partial."""


def _probe(x_dtype, payload: bool, encode: bool, *, width_set, plane_bits, **static):
  """A small instance of a call's configuration, as ``(args, kwargs)`` of ShapeDtypeStructs
  (:attr:`pallas_kernels.dispatch.Kernels.mosaic_probe`): the same static arguments and
  dtypes, :data:`_PROBE_SUPERGROUPS` super-groups, every one at the widest width."""
  s = _PROBE_SUPERGROUPS
  units = s * max(width_set)
  args = []
  if payload:
    args.append(jax.ShapeDtypeStruct((R.payload_bytes(s, units, plane_bits),), jnp.uint8))
  if x_dtype is not None:
    args.append(jax.ShapeDtypeStruct((s, 256), x_dtype))
  args += [jax.ShapeDtypeStruct((s,), jnp.int32), units]
  kwargs = dict(static, width_set=width_set, plane_bits=plane_bits)
  if encode:
    kwargs.update(keys=tuple(jax.ShapeDtypeStruct((), jnp.uint32) for _ in range(4)),
                  rank=jax.ShapeDtypeStruct((), jnp.int32))
  return tuple(args), kwargs


def _kernels(triton, mosaic, x, payload: bool, encode: bool, **static) -> D.Kernels:
  """The Triton and Mosaic GPU kernels of one call, with the probe of its configuration."""
  x_dtype = None if x is None else np.dtype(jnp.result_type(x))
  return D.Kernels(triton, mosaic, functools.partial(_probe, x_dtype, payload, encode, **static))


@functools.lru_cache(maxsize=None)
def _without_ptab(fn):
  """``fn`` taking and ignoring ``ptab=`` (the plane table a Triton kernel takes as an
  operand): the references and the Mosaic GPU kernels find their plane offsets from the
  widths themselves. One wrapper per function, so that its traces stay cached."""

  @functools.wraps(fn)
  def call(*args, ptab=None, **kwargs):
    del ptab
    return fn(*args, **kwargs)

  return call


plane_table = T.plane_table
"""int32 [16]: the plane offsets the kernels read (``ptab=``), from the positions per width
(an allocation's counts, ascending widths): :func:`pallas_kernels.dynamiq_triton.plane_table`."""


def compress(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1, scale_rounding="up",
             plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
             ptab=None, implementation: D.Implementation = None, interpret: bool | None = None):
  """Compresses a chunk ``x`` float [S, 256] at per-super-group ``widths``.

  Args:
    x: float32, bfloat16 or float16 [S, 256].
    widths: int32 [S], widest first, each in ``width_set``.
    units: code units of the payload (static).
    eps: MEE eps per width: a tuple of ``(width, eps)`` pairs or a dict.
    keys: ``(k0, k1, s0, s1)`` uint32 scalars.
    rank: this rank (stratified draws).
    strata: 1 (independent draws) or the number of ranks sharing strata.
    scale_rounding: ``"up"`` or ``"stochastic"``.
    plane_bits: 1 (32-byte units, any widths) or 2 (64-byte units, even widths).
    width_set: the widths the chunk may use (a subset of 2..8).
    ptab: the widths' :func:`plane_table` from their counts, or None: the Triton kernel
      computes it from ``widths`` (a sum over every position, one launch more per
      bucket); the reference and Mosaic GPU ignore it. Every call below takes it too.
    implementation: None (the Triton kernel in a GPU lowering, or for ``cuda`` the
      Mosaic GPU kernel where it lowers if ``dispatch.MOSAIC_FIRST``; else the
      reference), ``"pallas"`` (Triton), ``"mosaic"`` (Mosaic GPU) or ``"xla"``
      (:func:`pallas_kernels.dispatch.dispatch`).
    interpret: overrides the kernel's interpret mode.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]``.
  """
  return D.dispatch("compress",
                    _kernels(T.compress_pallas, _without_ptab(M.compress_mosaic), x, False, True,
                             eps=B.level_key(eps), strata=strata, scale_rounding=scale_rounding,
                             plane_bits=plane_bits, width_set=tuple(width_set)),
                    _without_ptab(R.compress_reference), implementation,
                    interpret, x, widths, units, eps=B.level_key(eps), keys=keys, rank=rank,
                    strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
                    width_set=tuple(width_set), ptab=ptab)


def decompress(payload, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
               width_set=R.WIDTH_SET, ptab=None, implementation: D.Implementation = None,
               interpret: bool | None = None):
  """Decodes a chunk payload (see :func:`compress`) to float32 [S, 256]."""
  return D.dispatch("decompress",
                    _kernels(T.decompress_pallas, _without_ptab(M.decompress_mosaic), None, True,
                             False, eps=B.level_key(eps), plane_bits=plane_bits,
                             width_set=tuple(width_set)),
                    _without_ptab(R.decompress_reference), implementation,
                    interpret, payload, widths, units, eps=B.level_key(eps),
                    plane_bits=plane_bits, width_set=tuple(width_set), ptab=ptab)


def decompress_accumulate(payload, x, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                          width_set=R.WIDTH_SET, ptab=None, implementation: D.Implementation = None,
                          interpret: bool | None = None):
  """``decompress(payload) + x`` in float32 [S, 256]."""
  return D.dispatch("decompress_accumulate",
                    _kernels(T.decompress_accumulate_pallas,
                             _without_ptab(M.decompress_accumulate_mosaic),
                             x, True, False, eps=B.level_key(eps), plane_bits=plane_bits,
                             width_set=tuple(width_set)),
                    _without_ptab(R.decompress_accumulate_reference), implementation, interpret,
                    payload, x, widths, units, eps=B.level_key(eps), plane_bits=plane_bits,
                    width_set=tuple(width_set), ptab=ptab)


def decompress_accumulate_recompress(payload, x, widths, units: int, *, eps, keys, rank=0,
                                     strata: int = 1, scale_rounding="up",
                                     plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                                     ptab=None, implementation: D.Implementation = None,
                                     interpret: bool | None = None):
  """``compress(decompress(payload) + x)`` in one pass (a ring hop); the sum is never
  stored."""
  return D.dispatch("decompress_accumulate_recompress",
                    _kernels(T.decompress_accumulate_recompress_pallas,
                             _without_ptab(M.decompress_accumulate_recompress_mosaic), x, True,
                             True, eps=B.level_key(eps), strata=strata,
                             scale_rounding=scale_rounding, plane_bits=plane_bits,
                             width_set=tuple(width_set)),
                    _without_ptab(R.decompress_accumulate_recompress_reference), implementation,
                    interpret, payload, x, widths, units, eps=B.level_key(eps), keys=keys,
                    rank=rank, strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
                    width_set=tuple(width_set), ptab=ptab)


def _many_mosaic(payloads, widths, units: int, *, interpret=False, **geo):
  """Mosaic GPU's form of :func:`decompress_many`: one Mosaic GPU decode per payload,
  stacked (it has no batched decode)."""
  return jnp.stack([M.decompress_mosaic(payloads[c], widths, units, **geo, interpret=interpret)
                    for c in range(payloads.shape[0])])


def _rows_mosaic(payloads, widths, units: int, slots, mean=None, *, rotate=0, dtype=jnp.float32,
                 row_sum=None, interpret=False, **geo):
  """Mosaic GPU's form of :func:`decompress_rows`: :func:`_many_mosaic`, then the
  reference's gather, mean and row sum."""
  R.check_payloads(payloads, widths, units, plane_bits=geo["plane_bits"],
                   width_set=geo["width_set"], slots=slots, mean=mean, rotate=rotate)
  rows = R.rows_of_decoded(_many_mosaic(payloads, widths, units, interpret=interpret, **geo),
                           slots, mean, rotate)
  return R.rows_and_terms(rows, mean, widths, slots, payloads.shape[0], dtype, row_sum)


def _probe_many(gather: bool, **static):
  """:func:`_probe` of a decode, for two payloads (and with ``gather``, a slot and a mean
  per row)."""
  (payload, widths, units), kwargs = _probe(None, True, False, **static)
  args = (jax.ShapeDtypeStruct((2,) + payload.shape, payload.dtype), widths, units)
  if gather:
    rows = 2 * widths.shape[0]
    args += (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.float32))
  return args, kwargs


def decompress_many(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                    width_set=R.WIDTH_SET, ptab=None, implementation: D.Implementation = None,
                    interpret: bool | None = None):
  """Decodes ``n`` chunk payloads of the same ``widths`` (uint8 [n, bytes], see
  :func:`compress`) to float32 [n, S, 256]: one Triton launch whose grid covers every
  payload's super-groups (Mosaic GPU: one launch per payload; the reference: as
  :func:`decompress` of each). The same bits as :func:`decompress` of each payload."""
  geo = dict(eps=B.level_key(eps), plane_bits=plane_bits, width_set=tuple(width_set))
  return D.dispatch("decompress_many",
                    D.Kernels(T.decompress_many_pallas, _without_ptab(_many_mosaic),
                              functools.partial(_probe_many, False, **geo)),
                    _without_ptab(R.decompress_many_reference), implementation, interpret,
                    payloads, widths, units, **geo, ptab=ptab)


def decompress_rows(payloads, widths, units: int, slots, mean=None, *, eps,
                      plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET, rotate: int = 0,
                      dtype=jnp.float32, ptab=None, row_sum=None,
                      implementation: D.Implementation = None, interpret: bool | None = None):
  """Rows of ``n`` decoded chunk payloads, each from its slot, plus a mean: [R, 256] of
  ``dtype`` (float32 by default; another float dtype: the float32 rows rounded to it as
  they are stored, so that no float32 copy is written). ``row_sum`` (a static callable):
  ``(rows, terms)``, ``terms`` float32 [R] each row's ``row_sum(sq, norm, width)``
  (:func:`~pallas_kernels.dynamiq_reference.row_terms`: the float32 row's squares less
  its mean, summed in the kernel's order, so the last bits may differ from the
  reference's; the statistics' next column; its position's width): the terms of an error
  estimate made without reading the rows again, left for the caller to sum (with other
  buckets' in one operation).

  Row r is slot ``slots[r]`` (int32 [R]) of the decoded chunks interleaved by position
  (slot ``j n + c``: position j of chunk c, which is payload ``(c + rotate) % n``: the
  payloads as gathered in rank order, read in chunk order without a copy), plus
  ``mean[r]`` (float [R], or column 0 of ``[R, k]`` statistics read in place, or None):
  a codec's finish in one Triton launch, the same bits as :func:`decompress` of each
  payload, then the gather and the sum
  (:func:`~pallas_kernels.dynamiq_reference.decompress_rows_reference`)."""
  geo = dict(eps=B.level_key(eps), plane_bits=plane_bits, width_set=tuple(width_set))
  return D.dispatch("decompress_rows",
                    D.Kernels(T.decompress_rows_pallas, _without_ptab(_rows_mosaic),
                              functools.partial(_probe_many, True, **geo)),
                    _without_ptab(R.decompress_rows_reference), implementation, interpret,
                    payloads, widths, units, slots, mean, rotate=rotate, dtype=jnp.dtype(dtype),
                    row_sum=row_sum, **geo, ptab=ptab)


def _sum_mosaic(payloads, widths, units: int, *, interpret=False, **geo):
  """Mosaic GPU's form of :func:`decompress_sum`: one Mosaic GPU decode, then one
  decode-add per payload, in rank order."""
  acc = M.decompress_mosaic(payloads[0], widths, units, **geo, interpret=interpret)
  for c in range(1, payloads.shape[0]):
    acc = M.decompress_accumulate_mosaic(payloads[c], acc, widths, units, **geo,
                                         interpret=interpret)
  return acc


def decompress_sum(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                   width_set=R.WIDTH_SET, ptab=None, implementation: D.Implementation = None,
                   interpret: bool | None = None):
  """The decodes of ``n`` chunk payloads of the same ``widths`` (uint8 [n, bytes]) summed
  in rank order: float32 [S, 256], one Triton launch that keeps the sum in registers
  (Mosaic GPU: a decode and ``n - 1`` decode-adds). The bits of :func:`decompress` of
  payload 0 followed by :func:`decompress_accumulate` of each next one."""
  geo = dict(eps=B.level_key(eps), plane_bits=plane_bits, width_set=tuple(width_set))
  return D.dispatch("decompress_sum",
                    D.Kernels(T.decompress_sum_pallas, _without_ptab(_sum_mosaic),
                              functools.partial(_probe_many, False, **geo)),
                    _without_ptab(R.decompress_sum_reference), implementation, interpret,
                    payloads, widths, units, **geo, ptab=ptab)
