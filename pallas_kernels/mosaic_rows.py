"""DynamiQ's rows inside a Pallas Mosaic GPU kernel: decode and encode of a block's rows.

A program of :mod:`pallas_kernels.dynamiq_mosaic` holds :data:`ROWS` rows of
32 coordinates in shared memory. :func:`decode_rows` turns a block's plane
units, ``k`` bytes and scales into float32 rows; :func:`encode_rows` rounds
rows to codes and scales (the MEE or the lattice levels) with the block
arithmetic of :mod:`pallas_kernels.dynamiq_block` (:data:`MOSAIC_OPS`: its
instructions as Mosaic GPU lowers them) and stores them in shared memory.
:func:`select_tree` picks a per-super-group scalar for each row.
"""

from __future__ import annotations

import functools
import inspect

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import dynamiq_block as B
from pallas_kernels import rng

__all__ = ["BLOCK", "ROWS", "WORDS", "PTAB", "MOSAIC_OPS", "select_tree", "decode_rows",
           "encode_rows"]

BLOCK = 8
"""Super-groups per program: 64 rows of 32 coordinates, one warpgroup's WGMMA layout."""

ROWS = BLOCK * B.SUPERGROUP // 32  # 64
WORDS = B.SUPERGROUP // 32  # 32-bit words of one plane unit (plane_bits=1)
PTAB = 16  # int32 entries of the plane table: off_p for p < 8, then the units used


def _load(ref, layout):
  """``ref[...]`` into registers in ``layout``. jax 0.10.2's ``plgpu.load`` requires an
  index; jax 0.11 deprecates passing one (it defaults there) and 0.12 has no such
  parameter."""
  idx = inspect.signature(plgpu.load).parameters.get("idx")
  if idx is not None and idx.default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def select_tree(index, values, start: int = 0):
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


def decode_rows(u_s, k_s, sc_s, w_s, ptab_s, s0, *, tabs: B.LevelTables, planes: int):
  """The decoded block float32 [64, 32] from the operands in shared memory."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  shape = (ROWS, 32)
  col = plgpu.broadcasted_iota(jnp.uint32, shape, 1, layout=plgpu.Layout.WGMMA)
  row_sg = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=row_layout) // WORDS
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
    mag = select_tree(m if tabs.lattice else jnp.where(top == 1, m, jnp.uint32(r) - m), levels)
    val = jnp.where(top == 1, mag, -mag)
    lam = val if lam is None else jnp.where(wid == w, val, lam)
  return lam * scale


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
  shape = (ROWS, 32)
  halves = [lax.broadcast_in_dim(_load(vs_ref.at[pl.ds(32 * h, 32)], col_layout), shape, (1,))
            for h in range(2)]
  row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  both = jnp.where(row < 32, halves[0], halves[1])
  mine = (col.astype(jnp.int32) // WORDS) == (row // WORDS) % 4
  return jnp.max(jnp.where(mine, both, jnp.float32(0)), axis=1)


def encode_rows(x, w_s, key_s, out_s, vs_s, s0, *, tabs: B.LevelTables, planes: int,
                 strata: int, scale_rounding: str):
  """Encodes the block x float32 [64, 32] into ``out_s``: plane words uint32 [planes,
  64], k words uint16 [64] (groups 2 j, 2 j + 1 of each row), bf16 scale bits uint16
  [64] (each row its super-group's)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  shape = (ROWS, 32)
  col = plgpu.broadcasted_iota(jnp.uint32, shape, 1, layout=plgpu.Layout.WGMMA)
  row_i = plgpu.broadcasted_iota(jnp.int32, (ROWS,), 0, layout=row_layout)
  row_sg = row_i // WORDS
  bcast = lambda v: lax.broadcast_in_dim(v, shape, (0,))
  grow = (s0 * WORDS + row_i).astype(jnp.uint32)  # the chunk's row of each row
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
                       levels=lambda i: select_tree(i, lev))
  codes = (r + 1 + (lvl ^ neg)).astype(jnp.uint32)
  _store_rows(codes, ks, v, out_s, col=col, planes=planes)


def _store_rows(codes, ks, v, out_s, *, col, planes: int):
  """The block's codes [64, 32] as plane words, each row's two ``k`` as one uint16 word and
  its super-group scale's bf16 bits, into ``out_s`` (:func:`encode_rows`)."""
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
  """:func:`encode_rows` with the lattice levels (``gmax``: each row's two group maxima):
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
