"""DynamiQ's hop kernels on the Pallas Mosaic GPU backend (``plgpu.kernel``).

Four operations on one chunk payload in the planar layout
(:mod:`pallas_kernels.dynamiq_planar`): :func:`decompress_planar` (payload
-> float32), :func:`decompress_accumulate_planar` (``decode(p) + x``),
:func:`compress_planar` and :func:`decompress_accumulate_recompress_planar`
(the ring hop), each one launch of ``ceil(S / BLOCK)`` programs of one
warpgroup, named ``dynamiq_mosaic_<operation>`` (:data:`KERNEL_PREFIX`).
:mod:`pallas_kernels.dynamiq` calls them (through the ``*_mosaic`` entry
points on record payloads) under ``"mosaic"``, and under ``implementation=None``
for a ``cuda`` lowering where they lower for the target GPU once Mosaic-first
dispatch is on (:data:`pallas_kernels.dispatch.MOSAIC_FIRST`, off today).

Memory layout: a program handles :data:`BLOCK` = 8 super-groups, i.e. 8 x
256 coordinates, held as a ``[64, 32]`` array in the WGMMA register layout:
row ``r = 8 s + j`` is 32-coordinate word ``j`` of super-group ``s`` of the
block, column ``c`` is bit ``c`` of that word, so the output, viewed as
float32 ``[S * 8, 32]``, is the chunk ``[S, 256]`` itself. Every operand
moves with one TMA block copy per program (no byte gather): the block's
64 ``k`` words (uint16: ``k`` of scale groups ``2 j`` and ``2 j + 1``),
its 8 super-group scales (bf16 bits), widths, and per plane ``p`` the 64
words of units ``[off_p + s0, off_p + s0 + 8)``, a contiguous run of the
unit plane at a data-dependent offset. A per-row word is broadcast along
the columns (a row vector in the layout ``WGMMA.reduce(1)``), so that bit
``c`` of plane ``p`` is ``(word >> c) & 1``. Rows of a super-group past
``count_p`` (narrower codes, the tail past ``S``) are masked, so a plane copy
that runs past the unit plane's end reads only masked rows: on a GPU the
TMA unit fills such reads with zeros and drops writes past the output's
end.

Copies: a program issues its independent copies together, each on its own
barrier (:func:`_copy_all`): plane table, ``k`` words, scales, widths, local
values and keys, then, once the plane table is in shared memory, every
plane's words; it waits twice rather than once per copy. (On an H200 this
did not change the kernels' time: they are bound by their arithmetic,
docs/results.md, "Kernels on a GPU".)

Level lookups have no gather: the magnitude index ``l`` of a code and its
sign come from its top bit. The lattice's ``lam[l]`` is arithmetic on the
float bits (:func:`~pallas_kernels.dynamiq_block.lattice_level`: a shift, an
add, a subtraction, one path for every width); MEE's is a chain of selects over
the width's constant levels (``R`` selects, one partial result live: a
balanced tree spilled, :func:`~pallas_kernels.mosaic_rows.select_tree`), one chain per width of the set,
chosen per row by the super-group's width. The arithmetic is the
reference's: ``lam * (k * V)`` in float32 (exact: 8 x 16 significant bits),
then ``+ x``; so the output equals
:func:`~pallas_kernels.dynamiq_reference.decompress_reference` bit for bit
(``tests/test_mosaic_gpu.py``, in GPU interpret mode).

Only ``plane_bits=1`` is written (a ``NotImplementedError`` otherwise).
GPU interpret mode (:data:`INTERPRET`, ``jax.experimental.pallas.mosaic_gpu.
InterpretGPUParams``) is in jax 0.11.2 and 0.12 (the versions tested); jax
0.10.2 has ``plgpu.kernel`` but no interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_planar as P
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import mosaic_rows as MR
from pallas_kernels import rng
from pallas_kernels.mosaic_rows import BLOCK, MOSAIC_OPS

__all__ = [
    "BLOCK",
    "KERNEL_PREFIX",
    "has_interpret",
    "interpret_params",
    "decompress_planar",
    "decompress_accumulate_planar",
    "compress_planar",
    "decompress_accumulate_recompress_planar",
    "MOSAIC_OPS",
    "compress_mosaic",
    "decompress_mosaic",
    "decompress_accumulate_mosaic",
    "decompress_accumulate_recompress_mosaic",
]

KERNEL_PREFIX = "dynamiq_mosaic_"
"""Each kernel's name (``plgpu.kernel(kernel_name=...)``) is this and its operation's: it
names the kernel in the HLO's op names and its PTX entry."""


def has_interpret() -> bool:
  """Whether this jax has Mosaic GPU's interpret mode (``InterpretGPUParams``: jax 0.11.2 and 0.12 have it, 0.10.2 not)."""
  return hasattr(plgpu, "InterpretGPUParams")


def interpret_params(detect_races: bool = True):
  """GPU interpret mode for these kernels (CPU simulation of threads, shared memory,
  barriers; races detected). Reads past an operand's end return uninitialised
  values, as they are masked (the module docstring says why they happen).

  Raises:
    NotImplementedError: this jax has no GPU interpret mode (:func:`has_interpret`).
  """
  if not has_interpret():
    raise NotImplementedError(
        f"jax {jax.__version__} has no Mosaic GPU interpret mode "
        "(jax.experimental.pallas.mosaic_gpu.InterpretGPUParams: jax 0.11.2 and 0.12 have it)")
  return plgpu.InterpretGPUParams(detect_races=detect_races, out_of_bounds_reads="uninitialized")


def _plane_table(widths, units: int):
  """int32 [16]: ``off_p`` for p < 8, then the units used; each at most ``units``."""
  have = (widths[:, None] > jnp.arange(8, dtype=jnp.int32)[None, :]).astype(jnp.int32)
  counts = jnp.sum(have, axis=0)
  ends = jnp.cumsum(counts)
  table = jnp.concatenate([ends - counts, jnp.full((MR.PTAB - 8,), ends[-1], jnp.int32)])
  return jnp.minimum(table, units).astype(jnp.int32)


def _copy_all(copies, bars, first: int = 0):
  """Issues every (src, dst) copy, each on its own barrier ``bars.at[first + i]``, then
  waits for all: the copies are in flight together, not one after another."""
  for i, (src, dst) in enumerate(copies):
    plgpu.copy_gmem_to_smem(src, dst, bars.at[first + i])
  for i in range(len(copies)):
    plgpu.barrier_wait(bars.at[first + i])


def _fetch_barriers(planes: int, more: int) -> int:
  """Barriers :func:`_fetch` uses: one per copy."""
  return 4 + more + planes


def _fetch(gmem, smem, bars, s0, planes: int, more=()):
  """The block's payload operands (and ``more`` (src, dst) copies) into shared memory:
  plane table, ``k`` words, scales, widths (and ``more``) together, then, once the
  plane table has arrived, each plane's 64 unit words together
  (:func:`_copy_all`; ``bars``: :func:`_fetch_barriers` of them)."""
  units_g, k_g, sc_g, w_g, ptab_g = gmem
  u_s, k_s, sc_s, w_s, ptab_s = smem
  copies = [(ptab_g, ptab_s), (k_g.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)], k_s),
            (sc_g.at[pl.ds(s0, MR.BLOCK)], sc_s), (w_g.at[pl.ds(s0, MR.BLOCK)], w_s), *more]
  _copy_all(copies, bars)
  _copy_all([(units_g.at[pl.ds((ptab_s[p] + s0) * MR.WORDS, MR.ROWS)], u_s.at[p])
             for p in range(planes)], bars, first=len(copies))


def _decode_kernel(*refs, tabs: B.LevelTables, planes: int, s_count: int, accumulate: bool):
  """One program: 8 super-groups -> float32 [64, 32] (``+ x`` when ``accumulate``)."""
  if accumulate:
    (units_g, k_g, sc_g, w_g, ptab_g, x_g, out_g,
     u_s, k_s, sc_s, w_s, ptab_s, x_s, o_s, bar) = refs
  else:
    (units_g, k_g, sc_g, w_g, ptab_g, out_g,
     u_s, k_s, sc_s, w_s, ptab_s, o_s, bar) = refs
    x_g = x_s = None
  s0 = lax.axis_index("b") * MR.BLOCK
  _fetch((units_g, k_g, sc_g, w_g, ptab_g), (u_s, k_s, sc_s, w_s, ptab_s), bar, s0, planes,
         [(x_g.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)], x_s)] if accumulate else [])
  out = MR.decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, tabs=tabs, planes=planes)
  if accumulate:
    out = out + x_s[...].astype(jnp.float32)
  o_s[...] = out
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s, out_g.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("units", "eps", "plane_bits", "width_set",
                                             "interpret"))
def _decode(planar, x, widths, *, units, eps, plane_bits, width_set, interpret):
  s_count = widths.shape[0]
  R.check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set, x=x,
                payload=planar)
  _planes_supported(plane_bits)
  tabs = B.level_tables(eps, width_set)
  planes = max(width_set)
  k16, units_w, sc16 = P.planes(planar, s_count, units, plane_bits)
  ptab = _plane_table(widths.astype(jnp.int32), units)
  accumulate = x is not None
  operands = [units_w, k16, sc16, widths.astype(jnp.int32), ptab]
  scratch = [plgpu.SMEM((planes, MR.ROWS), jnp.uint32), plgpu.SMEM((MR.ROWS,), jnp.uint16),
             plgpu.SMEM((MR.BLOCK,), jnp.uint16), plgpu.SMEM((MR.BLOCK,), jnp.int32),
             plgpu.SMEM((MR.PTAB,), jnp.int32)]
  if accumulate:
    operands.append(x.reshape(s_count * MR.WORDS, 32))
    scratch.append(plgpu.SMEM((MR.ROWS, 32), x.dtype))
  scratch += [plgpu.SMEM((MR.ROWS, 32), jnp.float32),
              plgpu.Barrier(num_barriers=_fetch_barriers(planes, int(accumulate)))]
  kernel = plgpu.kernel(
      functools.partial(_decode_kernel, tabs=tabs, planes=planes, s_count=s_count,
                        accumulate=accumulate),
      out_type=jax.ShapeDtypeStruct((s_count * MR.WORDS, 32), jnp.float32),
      grid=(-(-s_count // MR.BLOCK),), grid_names=("b",), scratch_types=scratch,
      kernel_name=f"{KERNEL_PREFIX}decompress{'_accumulate' if accumulate else ''}",
      interpret=interpret_params() if interpret else None)
  return _launch(kernel, operands).reshape(s_count, B.SUPERGROUP)


def decompress_planar(planar, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                      width_set=R.WIDTH_SET, interpret: bool = False):
  """Decodes a planar chunk payload to float32 [S, 256] (one Mosaic GPU launch).

  Args:
    planar: uint8 ``[payload_bytes(S, units, plane_bits)]`` in the planar
      layout (:func:`pallas_kernels.dynamiq_planar.to_planar`).
    widths: int32 [S], widest first, each in ``width_set``.
    units: code units of the payload (static).
    eps: MEE eps per width: a dict or ``(width, eps)`` pairs.
    plane_bits: 1 (2 raises ``NotImplementedError``).
    width_set: the widths the chunk may use.
    interpret: run in Mosaic GPU's interpret mode (:func:`interpret_params`).

  Returns:
    float32 [S, 256], equal to
    :func:`~pallas_kernels.dynamiq_reference.decompress_reference` of the
    record payload.
  """
  return _decode(planar, None, widths, units=units, eps=B.level_key(eps), plane_bits=plane_bits,
                 width_set=tuple(width_set), interpret=interpret)


def decompress_accumulate_planar(planar, x, widths, units: int, *, eps,
                                 plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                                 interpret: bool = False):
  """``decompress_planar(planar) + x`` in float32 [S, 256]; ``x`` float32, bfloat16
  or float16 [S, 256] (see :func:`decompress_planar`)."""
  return _decode(planar, x, widths, units=units, eps=B.level_key(eps), plane_bits=plane_bits,
                 width_set=tuple(width_set), interpret=interpret)



# ----------------------------------------------------------------------------
# Encode (work in progress: interpret-mode parity first; see compress_planar).


def _encode_kernel(x_g, w_g, key_g, codes_g, k_g, v_g, x_s, w_s, key_s, codes_s, k_s, v_s,
                   vs_s, bar, **static):
  """One program: 8 super-groups -> their plane words, k bytes and scale bits (per row)."""
  s0 = lax.axis_index("b") * MR.BLOCK
  _copy_all([(x_g.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)], x_s), (w_g.at[pl.ds(s0, MR.BLOCK)], w_s),
             (key_g, key_s)], bar)
  MR.encode_rows(x_s[...].astype(jnp.float32), w_s, key_s, (codes_s, k_s, v_s), vs_s, s0,
               **static)
  _store_encoded((codes_s, k_s, v_s), (codes_g, k_g, v_g), s0)


def _store_encoded(smem, gmem, s0):
  """Plane words, k words and scale bits of the block from shared to global memory."""
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem[0], gmem[0].at[:, pl.ds(s0 * MR.BLOCK, MR.ROWS)])
  for src, dst in zip(smem[1:], gmem[1:]):
    plgpu.copy_smem_to_gmem(src, dst.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)])
  plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("units", "eps", "strata", "scale_rounding",
                                             "plane_bits", "width_set", "interpret"))
def _compress(x, widths, keys, rank, *, units, eps, strata, scale_rounding, plane_bits,
              width_set, interpret):
  s_count = widths.shape[0]
  R.check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
                scale_rounding=scale_rounding, x=x)
  _planes_supported(plane_bits)
  tabs = B.level_tables(eps, width_set)
  planes = max(width_set)
  rows = s_count * MR.WORDS
  scratch = [plgpu.SMEM((MR.ROWS, 32), x.dtype), plgpu.SMEM((MR.BLOCK,), jnp.int32),
             *_encode_scratch(planes), plgpu.Barrier(num_barriers=3)]
  kernel = plgpu.kernel(
      functools.partial(_encode_kernel, tabs=tabs, planes=planes, strata=strata,
                        scale_rounding=scale_rounding),
      out_type=_encode_outputs(rows, planes),
      grid=(-(-s_count // MR.BLOCK),), grid_names=("b",), scratch_types=scratch,
      kernel_name=f"{KERNEL_PREFIX}compress",
      interpret=interpret_params() if interpret else None)
  operands = (x.reshape(rows, 32), widths.astype(jnp.int32), rng.key_operand(keys, rank))
  words, k16, v16 = _launch(kernel, operands)
  return _assemble(words, k16, v16, widths, units, planes)


def _assemble(words, k16, v16, widths, units: int, planes: int):
  """The planar payload from an encode's outputs: the plane words placed at their units
  (the reference's placement, by XLA after the kernel), the k and scale planes."""
  s_count = widths.shape[0]
  plane_bytes = jax.lax.bitcast_convert_type(words.reshape(planes, s_count, MR.WORDS),
                                             jnp.uint8).reshape(planes, s_count, -1)
  body = R.place_planes(jnp.moveaxis(plane_bytes, 0, 1), widths, units, 1)
  u8 = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)
  return jnp.concatenate([u8(k16), body.reshape(-1), u8(v16.reshape(s_count, MR.WORDS)[:, 0])])


def _encode_outputs(rows: int, planes: int):
  """An encode's output types: plane words, k words, scale bits."""
  return (jax.ShapeDtypeStruct((planes, rows), jnp.uint32),
          jax.ShapeDtypeStruct((rows,), jnp.uint16), jax.ShapeDtypeStruct((rows,), jnp.uint16))


def _launch(kernel, operands):
  """``kernel(*operands)`` with every operand and result its own buffer.

  The Mosaic GPU custom call requires 256-byte aligned input and output
  buffers (it checks at run time: "Input buffer 0 is not 256-byte aligned").
  The planes are slices of one payload at 16-byte offsets, and for small
  chunks XLA:GPU's dynamic-slice fusion passes such a slice to the custom
  call in place (seen on an H100, jax 0.11.2: a 13-super-group decompress
  failed). ``optimization_barrier`` on both sides keeps every operand and
  result a whole buffer of XLA's, which it allocates aligned
  (``tests/test_mosaic_gpu.py::test_no_plane_reaches_a_mosaic_kernel_as_a_slice``)."""
  operands = jax.lax.optimization_barrier(list(operands))
  return jax.lax.optimization_barrier(_vary_like(kernel(*operands), operands))


def _vary_like(outs, args):
  """``outs`` varying over every mesh axis one of ``args`` varies over (inside
  ``shard_map(check_vma=True)``): ``plgpu.kernel`` returns its outputs unvarying."""
  avals = [jax.typeof(a) for a in args]
  if getattr(avals[0], "manual_axis_type", None) is None:
    return outs
  varying = tuple(sorted(frozenset().union(*(a.manual_axis_type.varying for a in avals))))
  if not varying:
    return outs
  return jax.tree.map(lambda o: jax.lax.pcast(o, varying, to="varying"), outs)


def _encode_scratch(planes: int):
  return [plgpu.SMEM((8,), jnp.uint32), plgpu.SMEM((planes, MR.ROWS), jnp.uint32),
          plgpu.SMEM((MR.ROWS,), jnp.uint16), plgpu.SMEM((MR.ROWS,), jnp.uint16),
          plgpu.SMEM((MR.ROWS,), jnp.float32)]


def _dar_kernel(units_g, k_g, sc_g, w_g, ptab_g, x_g, key_g, codes_g, ko_g, vo_g,
                u_s, k_s, sc_s, w_s, ptab_s, x_s, key_s, codes_s, ko_s, vo_s, vs_s, bar, *,
                tabs: B.LevelTables, planes: int, **static):
  """One program of the ring hop: decode 8 super-groups, add x, encode the sum (kept in
  registers) into plane words, k words and scale bits."""
  s0 = lax.axis_index("b") * MR.BLOCK
  _fetch((units_g, k_g, sc_g, w_g, ptab_g), (u_s, k_s, sc_s, w_s, ptab_s), bar, s0, planes,
         [(x_g.at[pl.ds(s0 * MR.BLOCK, MR.ROWS)], x_s), (key_g, key_s)])
  acc = MR.decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, tabs=tabs, planes=planes)
  acc = acc + x_s[...].astype(jnp.float32)
  MR.encode_rows(acc, w_s, key_s, (codes_s, ko_s, vo_s), vs_s, s0, tabs=tabs, planes=planes,
               **static)
  _store_encoded((codes_s, ko_s, vo_s), (codes_g, ko_g, vo_g), s0)


@functools.partial(jax.jit, static_argnames=("units", "eps", "strata", "scale_rounding",
                                             "plane_bits", "width_set", "interpret"))
def _dar(planar, x, widths, keys, rank, *, units, eps, strata, scale_rounding, plane_bits,
         width_set, interpret):
  s_count = widths.shape[0]
  R.check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
                scale_rounding=scale_rounding, x=x, payload=planar)
  _planes_supported(plane_bits)
  tabs = B.level_tables(eps, width_set)
  planes = max(width_set)
  rows = s_count * MR.WORDS
  k16, units_w, sc16 = P.planes(planar, s_count, units, plane_bits)
  scratch = [plgpu.SMEM((planes, MR.ROWS), jnp.uint32), plgpu.SMEM((MR.ROWS,), jnp.uint16),
             plgpu.SMEM((MR.BLOCK,), jnp.uint16), plgpu.SMEM((MR.BLOCK,), jnp.int32),
             plgpu.SMEM((MR.PTAB,), jnp.int32), plgpu.SMEM((MR.ROWS, 32), x.dtype),
             *_encode_scratch(planes), plgpu.Barrier(num_barriers=_fetch_barriers(planes, 2))]
  kernel = plgpu.kernel(
      functools.partial(_dar_kernel, tabs=tabs, planes=planes, strata=strata,
                        scale_rounding=scale_rounding),
      out_type=_encode_outputs(rows, planes), grid=(-(-s_count // MR.BLOCK),), grid_names=("b",),
      scratch_types=scratch, kernel_name=f"{KERNEL_PREFIX}decompress_accumulate_recompress",
      interpret=interpret_params() if interpret else None)
  operands = (units_w, k16, sc16, widths.astype(jnp.int32),
              _plane_table(widths.astype(jnp.int32), units), x.reshape(rows, 32),
              rng.key_operand(keys, rank))
  words, ko, vo = _launch(kernel, operands)
  return _assemble(words, ko, vo, widths, units, planes)


def compress_planar(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                    scale_rounding="up", plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                    interpret: bool = False):
  """Compresses a chunk ``x`` float [S, 256] into a planar payload (work in progress).

  One Mosaic GPU launch computes each super-group's scales and codes (the
  reference's arithmetic, :func:`~pallas_kernels.dynamiq_block.round_levels`,
  with levels from a select chain) and writes its plane words; XLA then places
  the planes at their units (:func:`~pallas_kernels.dynamiq_reference.place_planes`)
  and concatenates the planes, extra passes a finished kernel would not make.

  Args: as :func:`~pallas_kernels.dynamiq_reference.compress_reference`.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]`` in the planar layout.
  """
  return _compress(x, widths, tuple(jnp.asarray(k, jnp.uint32) for k in keys),
                   jnp.asarray(rank, jnp.int32), units=units, eps=B.level_key(eps), strata=strata,
                   scale_rounding=scale_rounding, plane_bits=plane_bits,
                   width_set=tuple(width_set), interpret=interpret)


def decompress_accumulate_recompress_planar(planar, x, widths, units: int, *, eps, keys, rank=0,
                                            strata: int = 1, scale_rounding="up",
                                            plane_bits: int = R.PLANE_BITS,
                                            width_set=R.WIDTH_SET, interpret: bool = False):
  """One ring hop on planar payloads: ``compress(decompress(planar) + x)`` in one Mosaic GPU
  launch, the sum kept in registers (then XLA's placement, as :func:`compress_planar`).

  Args: as :func:`~pallas_kernels.dynamiq_reference.decompress_accumulate_recompress_reference`,
    with ``planar`` in the planar layout.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]`` in the planar layout.
  """
  return _dar(planar, x, widths, tuple(jnp.asarray(k, jnp.uint32) for k in keys),
              jnp.asarray(rank, jnp.int32), units=units, eps=B.level_key(eps), strata=strata,
              scale_rounding=scale_rounding, plane_bits=plane_bits, width_set=tuple(width_set),
              interpret=interpret)


# ----------------------------------------------------------------------------
# Entry points on record payloads (implementation="mosaic"): the planar kernels between
# dynamiq_planar's conversions, which are XLA copies around each launch until the codecs
# send planar payloads.


def compress_mosaic(x, widths, units: int, *, plane_bits: int = R.PLANE_BITS, **kw):
  """:func:`compress_planar`, returning the record payload of
  :func:`~pallas_kernels.dynamiq_reference.compress_reference`."""
  return P.from_planar(compress_planar(x, widths, units, plane_bits=plane_bits, **kw),
                       widths.shape[0], units, plane_bits)


def decompress_mosaic(payload, widths, units: int, *, plane_bits: int = R.PLANE_BITS, **kw):
  """:func:`decompress_planar` of a record payload."""
  _planes_supported(plane_bits)
  return decompress_planar(P.to_planar(payload, widths.shape[0], units, plane_bits), widths,
                           units, plane_bits=plane_bits, **kw)


def decompress_accumulate_mosaic(payload, x, widths, units: int, *,
                                 plane_bits: int = R.PLANE_BITS, **kw):
  """:func:`decompress_accumulate_planar` of a record payload."""
  _planes_supported(plane_bits)
  return decompress_accumulate_planar(P.to_planar(payload, widths.shape[0], units, plane_bits),
                                      x, widths, units, plane_bits=plane_bits, **kw)


def decompress_accumulate_recompress_mosaic(payload, x, widths, units: int, *,
                                            plane_bits: int = R.PLANE_BITS, **kw):
  """:func:`decompress_accumulate_recompress_planar` on record payloads."""
  _planes_supported(plane_bits)
  s_count = widths.shape[0]
  out = decompress_accumulate_recompress_planar(
      P.to_planar(payload, s_count, units, plane_bits), x, widths, units,
      plane_bits=plane_bits, **kw)
  return P.from_planar(out, s_count, units, plane_bits)


def _planes_supported(plane_bits: int):
  """Raises NotImplementedError (dispatch falls back) unless ``plane_bits`` is 1."""
  if plane_bits != 1:
    raise NotImplementedError(f"{plane_bits=}: the Mosaic GPU kernels are written for "
                              "plane_bits=1 only; use implementation='pallas' (Triton) or 'xla'")
