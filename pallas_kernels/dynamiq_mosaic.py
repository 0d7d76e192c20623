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
balanced tree spilled, :func:`_select_tree`), one chain per width of the set,
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
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_planar as P
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng

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

BLOCK = 8
"""Super-groups per program: 64 rows of 32 coordinates, one warpgroup's WGMMA layout."""

KERNEL_PREFIX = "dynamiq_mosaic_"
"""Each kernel's name (``plgpu.kernel(kernel_name=...)``) is this and its operation's: it
names the kernel in the HLO's op names and its PTX entry."""

_ROWS = BLOCK * B.SUPERGROUP // 32  # 64
_WORDS = B.SUPERGROUP // 32  # 32-bit words of one plane unit (plane_bits=1)
_PTAB = 16  # int32 entries of the plane table: off_p for p < 8, then the units used


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
  table = jnp.concatenate([ends - counts, jnp.full((_PTAB - 8,), ends[-1], jnp.int32)])
  return jnp.minimum(table, units).astype(jnp.int32)


def _load(ref, layout):
  """``ref[...]`` into registers in ``layout``. jax 0.10.2's ``plgpu.load`` requires an
  index; jax 0.11 deprecates passing one (it defaults there) and 0.12 has no such
  parameter."""
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _select_tree(index, values, start: int = 0):
  """``values[index - start]`` (static float values; ``index`` an int32 or uint32 array,
  in range) by a chain of selects: ``len(values) - 1`` compares and selects, no gather.

  A chain (``out = where(index >= start + i, values[i], out)`` for ascending ``i``)
  keeps one partial result live; a balanced tree of as many selects keeps up to half
  its leaves live, which for a width's 128 levels held all 255 registers of a thread
  and spilled (``python tools/mosaic_regs.py``)."""
  out = jnp.float32(values[0])
  for i, v in enumerate(values[1:], start=1):
    out = jnp.where(index >= jnp.asarray(start + i, index.dtype), jnp.float32(v), out)
  return out


def _row_vector(scalars, row_sg, dtype):
  """Row vector [64] whose row ``r`` is ``scalars[r // 8]`` (8 scalars): a select chain."""
  out = jnp.zeros_like(row_sg, dtype) + scalars[0]
  for i, v in enumerate(scalars[1:], start=1):
    out = jnp.where(row_sg == i, v, out)
  return out


def _decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, *, tabs: B.LevelTables, planes: int):
  """The decoded block float32 [64, 32] from the operands in shared memory."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  shape = (_ROWS, 32)
  col = plgpu.broadcasted_iota(jnp.uint32, shape, 1, layout=plgpu.Layout.WGMMA)
  row_sg = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=row_layout) // _WORDS
  sg = s0 + row_sg  # chunk index of each row's super-group
  bcast = lambda v: lax.broadcast_in_dim(v, shape, (0,))

  codes = jnp.zeros(shape, jnp.uint32)
  for p in range(planes):
    live = sg < ptab_s[p + 1] - ptab_s[p]  # count_p: super-groups with plane p
    word = jnp.where(live, _load(u_s.at[p], row_layout), jnp.uint32(0))
    codes = codes | (((bcast(word) >> col) & jnp.uint32(1)) << jnp.uint32(p))

  w_row = _row_vector([w_s[i] for i in range(BLOCK)], row_sg, jnp.int32)
  v_bits = [(sc_s[i].astype(jnp.uint32) << jnp.uint32(16)) for i in range(BLOCK)]
  v_row = lax.bitcast_convert_type(_row_vector(v_bits, row_sg, jnp.uint32), jnp.float32)
  k16 = bcast(_load(k_s, row_layout).astype(jnp.uint32))
  k = jnp.where(col < jnp.uint32(16), k16 & jnp.uint32(0xFF), k16 >> jnp.uint32(8))
  scale = k.astype(jnp.float32) * bcast(v_row)

  wid = bcast(w_row)
  if tabs.lattice:  # the levels by arithmetic (B.lattice_level), one path for every width
    return B.lattice_level(codes, wid) * scale
  lam = None
  for i, w in enumerate(tabs.widths):  # the smallest width's levels for widths outside the set
    r = 2 ** (w - 1) - 1
    levels = [float(v) for v in tabs.table[tabs.base[i]:tabs.base[i] + r + 1]]
    top = (codes >> jnp.uint32(w - 1)) & jnp.uint32(1)
    m = codes & jnp.uint32(r)  # the lattice's codes are sign and magnitude
    mag = _select_tree(m if tabs.lattice else jnp.where(top == 1, m, jnp.uint32(r) - m), levels)
    val = jnp.where(top == 1, mag, -mag)
    lam = val if lam is None else jnp.where(wid == w, val, lam)
  return lam * scale


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
  copies = [(ptab_g, ptab_s), (k_g.at[pl.ds(s0 * BLOCK, _ROWS)], k_s),
            (sc_g.at[pl.ds(s0, BLOCK)], sc_s), (w_g.at[pl.ds(s0, BLOCK)], w_s), *more]
  _copy_all(copies, bars)
  _copy_all([(units_g.at[pl.ds((ptab_s[p] + s0) * _WORDS, _ROWS)], u_s.at[p])
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
  s0 = lax.axis_index("b") * BLOCK
  _fetch((units_g, k_g, sc_g, w_g, ptab_g), (u_s, k_s, sc_s, w_s, ptab_s), bar, s0, planes,
         [(x_g.at[pl.ds(s0 * BLOCK, _ROWS)], x_s)] if accumulate else [])
  out = _decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, tabs=tabs, planes=planes)
  if accumulate:
    out = out + x_s[...].astype(jnp.float32)
  o_s[...] = out
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(o_s, out_g.at[pl.ds(s0 * BLOCK, _ROWS)])
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
  scratch = [plgpu.SMEM((planes, _ROWS), jnp.uint32), plgpu.SMEM((_ROWS,), jnp.uint16),
             plgpu.SMEM((BLOCK,), jnp.uint16), plgpu.SMEM((BLOCK,), jnp.int32),
             plgpu.SMEM((_PTAB,), jnp.int32)]
  if accumulate:
    operands.append(x.reshape(s_count * _WORDS, 32))
    scratch.append(plgpu.SMEM((_ROWS, 32), x.dtype))
  scratch += [plgpu.SMEM((_ROWS, 32), jnp.float32),
              plgpu.Barrier(num_barriers=_fetch_barriers(planes, int(accumulate)))]
  kernel = plgpu.kernel(
      functools.partial(_decode_kernel, tabs=tabs, planes=planes, s_count=s_count,
                        accumulate=accumulate),
      out_type=jax.ShapeDtypeStruct((s_count * _WORDS, 32), jnp.float32),
      grid=(-(-s_count // BLOCK),), grid_names=("b",), scratch_types=scratch,
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


def _to_int(v):
  """float32 -> int32, truncated towards zero (NaN -> 0, saturating): the conversion."""
  return v.astype(jnp.int32)


def _floor(v):
  """``jnp.floor`` without the floor primitive (Mosaic GPU has no Warpgroup rule for it):
  exact for |v| < 2^31, NaN kept, beyond that a value that the callers clip alike."""
  t = _to_int(v).astype(jnp.float32)
  return jnp.where(v != v, v, t - (v < t).astype(jnp.float32))


def _ceil(v):
  """``jnp.ceil`` without the ceil primitive (as :func:`_floor`)."""
  t = _to_int(v).astype(jnp.float32)
  return jnp.where(v != v, v, t + (v > t).astype(jnp.float32))


def _floor_int(v):
  """``floor(v)`` as int32 (NaN -> 0, saturating), :class:`~pallas_kernels.dynamiq_block.BlockOps`'
  ``floor_int`` without the floor primitive."""
  t = _to_int(v)
  return t - ((v < t.astype(jnp.float32)) & (t > jnp.int32(-2**31))).astype(jnp.int32)


MOSAIC_OPS = B.BlockOps(floor_int=_floor_int)
"""The block arithmetic's instructions in the Mosaic GPU kernels (the reference's, with
``floor`` by conversion)."""


def _segment_max(v, vs_ref, col):
  """Row vector [64] -> row vector: each row gets the max over its super-group's 8 rows.

  The 64 values go through shared memory and come back as two column vectors
  (32 values each, broadcast along rows: the layout ``WGMMA.reduce(0)``); a row
  keeps the 8 columns of its super-group and reduces them along the row. NaN
  propagates as ``jnp.max``'s does."""
  vs_ref[...] = v
  plgpu.commit_smem()  # a warpgroup barrier: each thread reads rows that others wrote
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  shape = (_ROWS, 32)
  halves = [lax.broadcast_in_dim(_load(vs_ref.at[pl.ds(32 * h, 32)], col_layout), shape, (1,))
            for h in range(2)]
  row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  both = jnp.where(row < 32, halves[0], halves[1])
  mine = (col.astype(jnp.int32) // _WORDS) == (row // _WORDS) % 4
  return jnp.max(jnp.where(mine, both, jnp.float32(0)), axis=1)


def _encode_kernel(x_g, w_g, key_g, codes_g, k_g, v_g, x_s, w_s, key_s, codes_s, k_s, v_s,
                   vs_s, bar, **static):
  """One program: 8 super-groups -> their plane words, k bytes and scale bits (per row)."""
  s0 = lax.axis_index("b") * BLOCK
  _copy_all([(x_g.at[pl.ds(s0 * BLOCK, _ROWS)], x_s), (w_g.at[pl.ds(s0, BLOCK)], w_s),
             (key_g, key_s)], bar)
  _encode_rows(x_s[...].astype(jnp.float32), w_s, key_s, (codes_s, k_s, v_s), vs_s, s0,
               **static)
  _store_encoded((codes_s, k_s, v_s), (codes_g, k_g, v_g), s0)


def _store_encoded(smem, gmem, s0):
  """Plane words, k words and scale bits of the block from shared to global memory."""
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(smem[0], gmem[0].at[:, pl.ds(s0 * BLOCK, _ROWS)])
  for src, dst in zip(smem[1:], gmem[1:]):
    plgpu.copy_smem_to_gmem(src, dst.at[pl.ds(s0 * BLOCK, _ROWS)])
  plgpu.wait_smem_to_gmem(0)


def _encode_rows(x, w_s, key_s, out_s, vs_s, s0, *, tabs: B.LevelTables, planes: int,
                 strata: int, scale_rounding: str):
  """Encodes the block x float32 [64, 32] into ``out_s``: plane words uint32 [planes,
  64], k words uint16 [64] (groups 2 j, 2 j + 1 of each row), bf16 scale bits uint16
  [64] (each row its super-group's)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  shape = (_ROWS, 32)
  col = plgpu.broadcasted_iota(jnp.uint32, shape, 1, layout=plgpu.Layout.WGMMA)
  row_i = plgpu.broadcasted_iota(jnp.int32, (_ROWS,), 0, layout=row_layout)
  row_sg = row_i // _WORDS
  bcast = lambda v: lax.broadcast_in_dim(v, shape, (0,))
  grow = (s0 * _WORDS + row_i).astype(jnp.uint32)  # the chunk's row of each row
  left = col < jnp.uint32(16)

  a = jnp.abs(x)
  gl = jnp.max(jnp.where(left, a, jnp.float32(0)), axis=1)
  gr = jnp.max(jnp.where(left, jnp.float32(0), a), axis=1)
  keys = tuple(key_s[i] for i in range(4))
  rank = key_s[4].astype(jnp.int32)
  kmax = B.K_MAX
  div_up = B.ceil_div_bf16
  if tabs.lattice:
    _encode_rows_lattice(x, w_s, out_s, vs_s, (gl, gr), keys, rank, col=col, row_sg=row_sg,
                         grow=grow, left=left, planes=planes, strata=strata,
                         scale_rounding=scale_rounding)
    return
  if scale_rounding == "up":
    v = div_up(_segment_max(jnp.maximum(gl, gr), vs_s, col), float(kmax))
    ks = [B.ceil_quotient(g, v, kmax, ceil=_ceil) for g in (gl, gr)]
    ss = [k * v for k in ks]
  else:
    gs = [div_up(g, 1.0) for g in (gl, gr)]
    v = div_up(_segment_max(jnp.maximum(*gs), vs_s, col), float(kmax))
    ks, ss = _stochastic_ks(gs, v, grow, keys), gs
  live = v > 0
  ks = [jnp.where(live, k, jnp.float32(0)) for k in ks]
  s = jnp.where(left, bcast(ss[0]), bcast(ss[1]))

  q = rng.strata_count(strata) * 2**rng.UNIFORM_BITS
  neg = B.sign_mask(x)
  idx = bcast(grow) * jnp.uint32(32) + col
  draws = functools.partial(rng.uniforms, keys, rank, strata, group=idx >> jnp.uint32(4),
                            lane=col & jnp.uint32(15))
  if q & (q - 1) == 0:
    u, frac = None, draws(fraction_of=neg)
  else:
    u, frac = rng.signed_draws(draws(), neg, q), None
  w_row = _row_vector([w_s[i] for i in range(BLOCK)], row_sg, jnp.int32)
  per = lambda values: bcast(_row_vector_of_width(w_row, tabs, values))
  r = per(tabs.r)
  consts = B.WidthConsts(per(tabs.lbase), r, per(tabs.c1k), per(tabs.k), per(tabs.c2))
  lev = [float(t) for t in tabs.lev]
  lvl = B.round_levels(a, s, consts, u, frac, q, ops=MOSAIC_OPS,
                       levels=lambda i: _select_tree(i, lev))
  codes = (r + 1 + (lvl ^ neg)).astype(jnp.uint32)
  _store_rows(codes, ks, v, out_s, col=col, planes=planes)


def _store_rows(codes, ks, v, out_s, *, col, planes: int):
  """The block's codes [64, 32] as plane words, each row's two ``k`` as one uint16 word and
  its super-group scale's bf16 bits, into ``out_s`` (:func:`_encode_rows`)."""
  codes_s, k_s, v_s = out_s
  for p in range(planes):
    codes_s[p] = jnp.sum(((codes >> jnp.uint32(p)) & jnp.uint32(1)) << col, axis=1)
  k_s[...] = (ks[0].astype(jnp.uint32) | (ks[1].astype(jnp.uint32) << jnp.uint32(8))).astype(
      jnp.uint16)
  v_s[...] = (lax.bitcast_convert_type(v, jnp.uint32) >> jnp.uint32(16)).astype(jnp.uint16)


def _stochastic_ks(gs, unit, grow, keys):
  """Each row's two ``k`` (groups ``2 row + h``) rounded stochastically so that ``E[k unit]
  = g`` (:func:`~pallas_kernels.dynamiq_block.scales`' ``"stochastic"`` rounding, exact
  products), from the rows' bf16 group maxima ``gs``."""
  return [B.stochastic_k(g, unit, keys, grow * jnp.uint32(2) + jnp.uint32(h), floor=_floor)
          for h, g in enumerate(gs)]


def _encode_rows_lattice(x, w_s, out_s, vs_s, gmax, keys, rank, *, col, row_sg, grow, left,
                         planes: int, strata: int, scale_rounding: str):
  """:func:`_encode_rows` with the lattice levels (``gmax``: each row's two group maxima):
  the reference's :func:`~pallas_kernels.dynamiq_block.lattice_scales` arithmetic per row,
  the reciprocals computed (:func:`~pallas_kernels.dynamiq_block.reciprocal_of_index`: no
  gather), the draws and the rounding of the block arithmetic."""
  shape = x.shape
  bcast = lambda v: lax.broadcast_in_dim(v, shape, (0,))
  kmax = B.K_MAX
  w_row = _row_vector([w_s[i] for i in range(BLOCK)], row_sg, jnp.int32)
  _, _, top = B.lattice_consts(w_row)
  top_kmax = top * jnp.float32(kmax)
  div_by = B.ceil_div_bf16_by
  recip = B.reciprocal_of_index
  gl, gr = gmax
  amax = _segment_max(jnp.maximum(gl, gr), vs_s, col)
  if scale_rounding == "up":
    v = div_by(amax, top_kmax)
  else:
    gs = [B.ceil_div_bf16(g, 1.0) for g in (gl, gr)]
    v = div_by(_segment_max(jnp.maximum(*gs), vs_s, col), top_kmax)
  live = (v > 0) & (amax < jnp.float32(jnp.inf))  # no NaN or infinity in the super-group
  vt = v * top  # exact
  if scale_rounding == "up":  # k = 0 where not live before it indexes the reciprocals
    ks = [jnp.where(live, B.ceil_quotient(g, vt, kmax, ceil=_ceil), jnp.float32(0))
          for g in (gl, gr)]
    rss = [B.lattice_reciprocal(k.astype(jnp.int32), v, recip) for k in ks]
  else:
    ks = [jnp.where(live, k, jnp.float32(0)) for k in _stochastic_ks(gs, vt, grow, keys)]
    rss = [B.lattice_reciprocal(top, g, recip) for g in gs]
  rss = [jnp.where(live & (g > 0), rs, jnp.float32(0)) for rs, g in zip(rss, (gl, gr))]
  rs = jnp.where(left, bcast(rss[0]), bcast(rss[1]))
  field, sign_at, _ = (bcast(c) for c in B.lattice_consts(w_row))
  neg = B.sign_mask(x)
  idx = bcast(grow) * jnp.uint32(32) + col
  draws = rng.lattice_draws(keys, rank, strata, group=idx >> jnp.uint32(4),
                            lane=col & jnp.uint32(15), neg=neg, field=field)
  codes = B.round_lattice(jnp.abs(x), rs, field, draws, MOSAIC_OPS, sign_at=sign_at,
                          neg=neg)
  _store_rows(codes, ks, v, out_s, col=col, planes=planes)


def _row_vector_of_width(w_row, tabs: B.LevelTables, values):
  """Row vector of the per-width constant ``values[index of the row's width]`` (the
  smallest width's for a width outside the set): :meth:`LevelTables.select`."""
  out = jnp.zeros_like(w_row, jnp.asarray(values).dtype) + values[0]
  for i, w in enumerate(tabs.widths[1:], start=1):
    out = jnp.where(w_row == w, values[i], out)
  return out


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
  rows = s_count * _WORDS
  scratch = [plgpu.SMEM((_ROWS, 32), x.dtype), plgpu.SMEM((BLOCK,), jnp.int32),
             *_encode_scratch(planes), plgpu.Barrier(num_barriers=3)]
  kernel = plgpu.kernel(
      functools.partial(_encode_kernel, tabs=tabs, planes=planes, strata=strata,
                        scale_rounding=scale_rounding),
      out_type=_encode_outputs(rows, planes),
      grid=(-(-s_count // BLOCK),), grid_names=("b",), scratch_types=scratch,
      kernel_name=f"{KERNEL_PREFIX}compress",
      interpret=interpret_params() if interpret else None)
  operands = (x.reshape(rows, 32), widths.astype(jnp.int32), rng.key_operand(keys, rank))
  words, k16, v16 = _launch(kernel, operands)
  return _assemble(words, k16, v16, widths, units, planes)


def _assemble(words, k16, v16, widths, units: int, planes: int):
  """The planar payload from an encode's outputs: the plane words placed at their units
  (the reference's placement, by XLA after the kernel), the k and scale planes."""
  s_count = widths.shape[0]
  plane_bytes = jax.lax.bitcast_convert_type(words.reshape(planes, s_count, _WORDS),
                                             jnp.uint8).reshape(planes, s_count, -1)
  body = R.place_planes(jnp.moveaxis(plane_bytes, 0, 1), widths, units, 1)
  u8 = lambda v: jax.lax.bitcast_convert_type(v, jnp.uint8).reshape(-1)
  return jnp.concatenate([u8(k16), body.reshape(-1), u8(v16.reshape(s_count, _WORDS)[:, 0])])


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
  return [plgpu.SMEM((8,), jnp.uint32), plgpu.SMEM((planes, _ROWS), jnp.uint32),
          plgpu.SMEM((_ROWS,), jnp.uint16), plgpu.SMEM((_ROWS,), jnp.uint16),
          plgpu.SMEM((_ROWS,), jnp.float32)]


def _dar_kernel(units_g, k_g, sc_g, w_g, ptab_g, x_g, key_g, codes_g, ko_g, vo_g,
                u_s, k_s, sc_s, w_s, ptab_s, x_s, key_s, codes_s, ko_s, vo_s, vs_s, bar, *,
                tabs: B.LevelTables, planes: int, **static):
  """One program of the ring hop: decode 8 super-groups, add x, encode the sum (kept in
  registers) into plane words, k words and scale bits."""
  s0 = lax.axis_index("b") * BLOCK
  _fetch((units_g, k_g, sc_g, w_g, ptab_g), (u_s, k_s, sc_s, w_s, ptab_s), bar, s0, planes,
         [(x_g.at[pl.ds(s0 * BLOCK, _ROWS)], x_s), (key_g, key_s)])
  acc = _decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, tabs=tabs, planes=planes)
  acc = acc + x_s[...].astype(jnp.float32)
  _encode_rows(acc, w_s, key_s, (codes_s, ko_s, vo_s), vs_s, s0, tabs=tabs, planes=planes,
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
  rows = s_count * _WORDS
  k16, units_w, sc16 = P.planes(planar, s_count, units, plane_bits)
  scratch = [plgpu.SMEM((planes, _ROWS), jnp.uint32), plgpu.SMEM((_ROWS,), jnp.uint16),
             plgpu.SMEM((BLOCK,), jnp.uint16), plgpu.SMEM((BLOCK,), jnp.int32),
             plgpu.SMEM((_PTAB,), jnp.int32), plgpu.SMEM((_ROWS, 32), x.dtype),
             *_encode_scratch(planes), plgpu.Barrier(num_barriers=_fetch_barriers(planes, 2))]
  kernel = plgpu.kernel(
      functools.partial(_dar_kernel, tabs=tabs, planes=planes, strata=strata,
                        scale_rounding=scale_rounding),
      out_type=_encode_outputs(rows, planes), grid=(-(-s_count // BLOCK),), grid_names=("b",),
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
