"""DynamiQ's hop operations on a chunk payload: the kernels where they lower, or the reference.

=============================================  =======================================
:func:`compress`                               values -> chunk payload (leaf, sender)
:func:`decompress`                             chunk payload -> float32 (all-gather)
:func:`decompress_accumulate`                  ``decode(p) + x`` (butterfly node)
:func:`decompress_accumulate_recompress`       ring hop ``encode(decode(p) + x)`` in
                                               one pass; the sum is never stored
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
  record payloads and convert around the launch). ``implementation="mosaic"``
  forces them; ``implementation=None`` keeps Triton for every GPU until they
  have run on one.
"""

from __future__ import annotations

from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq_mosaic as M
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import dynamiq_triton as T

__all__ = [
    "compress",
    "decompress",
    "decompress_accumulate",
    "decompress_accumulate_recompress",
]


def _kernel(implementation, triton, mosaic):
  """The GPU kernel of ``implementation``: Mosaic GPU's for ``"mosaic"``, else Triton's."""
  return mosaic if implementation == "mosaic" else triton


def _eps_key(eps):
  """eps as a hashable, sorted tuple of (width, eps) pairs (a dict is converted)."""
  return tuple(sorted((int(w), float(e)) for w, e in dict(eps).items()))


def compress(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1, scale_rounding="up",
             plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
             implementation: D.Implementation = None, interpret: bool | None = None):
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
    implementation: None (the Triton kernel when lowering for a GPU, else the
      reference), ``"pallas"`` (Triton), ``"mosaic"`` (Mosaic GPU) or ``"xla"``
      (:func:`pallas_kernels.dispatch.dispatch`).
    interpret: overrides the kernel's interpret mode.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]``.
  """
  return D.dispatch("compress", _kernel(implementation, T.compress_pallas, M.compress_mosaic),
                    R.compress_reference, implementation,
                    interpret, x, widths, units, eps=_eps_key(eps), keys=keys, rank=rank,
                    strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
                    width_set=tuple(width_set))


def decompress(payload, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
               width_set=R.WIDTH_SET, implementation: D.Implementation = None,
               interpret: bool | None = None):
  """Decodes a chunk payload (see :func:`compress`) to float32 [S, 256]."""
  return D.dispatch("decompress",
                    _kernel(implementation, T.decompress_pallas, M.decompress_mosaic),
                    R.decompress_reference, implementation,
                    interpret, payload, widths, units, eps=_eps_key(eps),
                    plane_bits=plane_bits, width_set=tuple(width_set))


def decompress_accumulate(payload, x, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                          width_set=R.WIDTH_SET, implementation: D.Implementation = None,
                          interpret: bool | None = None):
  """``decompress(payload) + x`` in float32 [S, 256]."""
  return D.dispatch("decompress_accumulate",
                    _kernel(implementation, T.decompress_accumulate_pallas,
                            M.decompress_accumulate_mosaic),
                    R.decompress_accumulate_reference, implementation, interpret, payload, x,
                    widths, units, eps=_eps_key(eps), plane_bits=plane_bits,
                    width_set=tuple(width_set))


def decompress_accumulate_recompress(payload, x, widths, units: int, *, eps, keys, rank=0,
                                     strata: int = 1, scale_rounding="up",
                                     plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                                     implementation: D.Implementation = None,
                                     interpret: bool | None = None):
  """``compress(decompress(payload) + x)`` in one pass (a ring hop); the sum is never
  stored."""
  return D.dispatch("decompress_accumulate_recompress",
                    _kernel(implementation, T.decompress_accumulate_recompress_pallas,
                            M.decompress_accumulate_recompress_mosaic),
                    R.decompress_accumulate_recompress_reference, implementation, interpret,
                    payload, x, widths, units, eps=_eps_key(eps), keys=keys, rank=rank,
                    strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
                    width_set=tuple(width_set))
