"""The chunk payload's byte movement inside a Pallas Triton kernel.

The static description of a chunk's coding (:class:`Config`) and what a
program of :mod:`pallas_kernels.dynamiq_triton` does with bytes: the
offsets of each scale record and plane (:func:`plane_offsets`), the dense
operands loaded and stored by parts and held joined (:func:`part_keys`,
:func:`join_parts`, :func:`load_dense`, :func:`store_dense`), and a chunk read
into codes and scales (:func:`read_chunk`) or written from values
(:func:`write_chunk`, the plane words by :func:`plane_words`). The block
arithmetic between them is :mod:`pallas_kernels.dynamiq_block`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import plane_words
from pallas_kernels import rng
from pallas_kernels import triton_ops as tt

GROUPS = B.GROUP  # scale groups per super-group
PTAB = 16  # entries of the plane-offset input (off_p for p < 8, then the units used)
_TAIL_CHUNK = 64  # most unused units one store zeroes
_DEC_ROWS = 9 * 256  # entries of LevelTables.dec_rows

GPU_OPS = B.BlockOps(log2=tt.approx_log2, floor_int=tt.floor_int, fma=tt.fma,
                     lt_mask=tt.lt_mask, frac_mul=tt.frac_mul, div=tt.div_approx,
                     mulhi=tt.mulhi, mul_add_rounded=tt.mul_add_rounded,
                     or_unless=tt.or_unless, max_last=lambda a: jnp.max(a, axis=-1))
"""The block arithmetic's instructions on a GPU (a
:class:`~pallas_kernels.dynamiq_block.BlockOps`)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
  """Static description of a chunk's coding (hashable: a jit static argument).

  ``per`` codes per plane byte, ``cb`` plane bytes per scale group, ``planes``
  of the widest code; ``split``: the kernels access a block by parts ``[BLOCK, G / 2,
  piece]`` and hold it joined (``plane_bits=1``; :func:`part_keys`, :func:`load_dense`)."""

  eps: tuple
  width_set: tuple
  plane_bits: int
  scale_rounding: str
  sg: int  # super-groups per program (the launch's ``block``, :func:`launch_config`)
  num_warps: int
  pieces: int = 1  # pieces per half group (:func:`part_keys`): 2 for 32-bit dense values

  per = property(lambda self: 8 // self.plane_bits)
  cb = property(lambda self: GROUPS // self.per)
  unit_bytes = property(lambda self: R.unit_bytes(self.plane_bits))
  planes = property(lambda self: max(self.width_set) // self.plane_bits)
  split = property(lambda self: self.plane_bits == 1)
  piece = property(lambda self: self.per // self.pieces)  # values per part and thread
  levels_at = property(lambda self: _DEC_ROWS)  # where table() has the levels
  recip_at = property(lambda self: _DEC_ROWS + self.tabs.lev.size)  # reciprocals
  gf_at = property(lambda self: self.recip_at + B.reciprocal_tables().size)  # GF rows

  @functools.cached_property
  def tabs(self):
    return B.level_tables(self.eps, self.width_set)

  def table(self) -> np.ndarray:
    """int32: the signed decode table's float32 bits by rows (``LevelTables.dec_rows``:
    index ``code | width << 8``), then (at :attr:`levels_at`) the encode's float32
    levels (``LevelTables.lev``), the reciprocals and (at :attr:`gf_at`) the GF rows of the
    ranks below 8 (``rng.gf_rows_table``), zero-padded to a power of two (Triton)."""
    t = np.concatenate([self.tabs.dec_rows().view(np.int32), self.tabs.lev.view(np.int32),
                        B.reciprocal_tables().view(np.int32),
                        rng.gf_rows_table().reshape(-1).view(np.int32)])
    return np.pad(t, (0, pl.next_power_of_2(t.size) - t.size))

  def block(self, supergroups: int) -> tuple[int, int, int, int]:
    return (supergroups, GROUPS, self.cb, self.per)

  def dense(self, supergroups: int) -> tuple[int, ...]:
    """A dense operand's shape: :meth:`block`, or with its groups as pairs ``[S, G / 2,
    2, CB, P]`` when :attr:`split` (:func:`load_dense`)."""
    if self.split:
      return (supergroups, GROUPS // 2, 2, self.cb, self.per)
    return self.block(supergroups)

  def dense_spec(self):
    return pl.BlockSpec(self.dense(self.sg), lambda i: (i,) + (0,) * (len(self.dense(1)) - 1))


def iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


class Rows(NamedTuple):
  """Where the rows of a gathering program come from (:func:`_decode_rows_kernel`), per
  row [BLOCK]: ``j``, its position in its chunk; ``base``, the first byte of its
  chunk's payload; ``ok``, the row exists."""

  j: Any
  base: Any
  ok: Any


def _groups(cfg: Config) -> tuple[int, int]:
  """(groups per array, groups one offset covers): [BLOCK, G / 2] pairs when
  :attr:`Config.split` (:func:`load_dense`), else [BLOCK, G]."""
  return (GROUPS // 2, 2) if cfg.split else (GROUPS, 1)


def _scale_offsets(cfg: Config, s_count: int, rows: Rows | None = None):
  """Offsets of this program's scale records: k bytes [BLOCK, G] (the first of each pair
  of k bytes, [BLOCK, G / 2], when :attr:`Config.split`: even), super-group scale
  [BLOCK], masks (``rows``: each row's own position and payload)."""
  block = cfg.sg
  groups, step = _groups(cfg)
  shape = (block, groups)
  byte = iota(shape, 1) * step
  if rows is not None:
    j2 = jnp.broadcast_to(rows.j[:, None], shape)
    b2 = jnp.broadcast_to(rows.base[:, None], shape)
    return (b2 + j2 * R.SCALE_BYTES + byte, jnp.broadcast_to(rows.ok[:, None], shape),
            rows.base + rows.j * R.SCALE_BYTES + GROUPS, rows.ok)
  base = pl.program_id(0) * block
  sg2 = base + iota(shape, 0)
  sg1 = base + iota((block,), 0)
  return (sg2 * R.SCALE_BYTES + byte, sg2 < s_count, sg1 * R.SCALE_BYTES + GROUPS, sg1 < s_count)


def plane_offsets(cfg: Config, ptab_ref, s_count: int, words: bool = False,
                   rows: Rows | None = None):
  """Per plane p: (byte offsets [BLOCK, G, CB] of this program's plane-p bytes, mask);
  ``words``: offsets [BLOCK, G] of each group's 16-bit word of plane bytes
  (``plane_bits=1``: one byte per half) in the payload's uint16 view. When
  :attr:`Config.split`: of the first group of each pair, [BLOCK, G / 2, CB] and
  [BLOCK, G / 2] (the second's are 2 bytes, one word, further).

  Plane p of super-group ``sg`` is unit ``off_p + sg`` where ``sg < count_p``,
  i.e. where that unit is below ``off_(p+1)`` (one comparison: with widths
  widest first these are the super-groups that have plane p, and the
  program's tail past ``s_count`` is excluded too, as ``count_p <= s_count``).
  :func:`plane_table_of_widths` clamps the offsets to the payload's units, so that no
  widths, valid or not, reach outside it. ``rows``: each row's position, its
  payload's first byte (even) and whether it exists."""
  block = cfg.sg
  groups, step = _groups(cfg)
  shape = (block, groups) if words else (block, groups, cfg.cb)
  div = 2 if words else 1  # (plane_bits=1: the bytes g CB, CB = 2, are even)
  # in units of ``div`` bytes, without a division (whose floor rounding would hide from
  # Triton that the offsets are even)
  byte = iota(shape, 1) * (cfg.cb * step // div) + (0 if words else iota(shape, 2))
  if rows is None:
    sg, start, ok = pl.program_id(0) * block + iota(shape, 0), 0, True
  else:
    spread = lambda v: jnp.broadcast_to(v.reshape((block,) + (1,) * (len(shape) - 1)), shape)
    sg, start, ok = spread(rows.j), spread(rows.base >> (div - 1)), spread(rows.ok)
  out = []
  for p in range(cfg.planes):
    unit = ptab_ref[p] + sg
    out.append((start + s_count * (R.SCALE_BYTES // div) + unit * (cfg.unit_bytes // div)
                + byte, (unit < ptab_ref[p + 1]) & ok))
  return out


def _paired(s_count: int) -> bool:
  """Whether every group pair's two plane words (at ``off`` and ``off + 1``,
  :func:`plane_offsets`) start at an even word: the planes start at word ``9 s_count``
  of a payload, and (gathering rows) the payloads are ``payload_bytes`` apart, a multiple
  of 4 bytes, so where ``s_count`` is even."""
  return s_count % 2 == 0


def _pair_offsets(off, ok):
  h = jax.lax.broadcasted_iota(jnp.int32, off.shape + (2,), off.ndim)
  return off[..., None] + h, jnp.broadcast_to(ok[..., None], h.shape)


def _load_pairs(ref16, off, ok, s_count: int):
  """uint16 ``[BLOCK, G / 2, 2]``: each group pair's two plane words, the pair's axis last.
  One access where :func:`_paired` (Triton makes it one 32-bit load per pair, in the
  pairs' register layout), else one per word, stacked. Fewer accesses also make Triton's
  coalescing pass, which walks the whole kernel from each of them, cheaper."""
  if _paired(s_count):
    return tt.load(ref16, *_pair_offsets(off, ok))
  return _stack2([tt.load(ref16, off + h, ok) for h in range(2)])


def _store_pairs(ref16, off, words, ok, s_count: int):
  """Stores uint16 ``words`` ``[BLOCK, G / 2, 2]`` where :func:`_load_pairs` loads them."""
  if _paired(s_count):
    o, m = _pair_offsets(off, ok)
    tt.store(ref16, o, words, m)
    return
  for h, v in enumerate(_unstack2(words)):
    tt.store(ref16, off + h, v, ok)


def _keys(keys_ref, tab_ref, cfg: Config):
  """The keys and the rank (:func:`~pallas_kernels.rng.key_operand`), its rows of GF
  products read from the table (:attr:`Config.gf_at`), not computed, in each program."""
  rank = keys_ref[4].astype(jnp.int32)
  at = cfg.gf_at + (rank & 7) * 3
  rows = tuple(jax.lax.bitcast_convert_type(tab_ref[at + k], jnp.uint32) for k in range(3))
  return (keys_ref[0], keys_ref[1], keys_ref[2], keys_ref[3]), rng.Rank(rank, rows)


def load_dense(ref, cfg: Config, interpret: bool):
  """A dense block as float32: ``[BLOCK, G, CB, P]`` whole, or, when
  :attr:`Config.split` (``ref`` ``[BLOCK, G / 2, 2, CB, P]``, :meth:`Config.dense`),
  loaded as its parts (:func:`part_keys`) and held as :func:`join_parts` ``[BLOCK, G / 2, 2,
  CB, Q, piece]``.

  Loaded whole, Triton gives each thread 8 consecutive values, so a scale
  group spans two threads (a shuffle for its maximum, shared memory for its
  plane bytes); as parts of equal shape, one thread holds two whole neighbouring
  groups of one super-group: one super-group scale per thread, and the two groups'
  plane bytes and k bytes at one address. Joined, the parts are one array whose part
  axes are each thread's registers: the block arithmetic is written once for all of
  them (Triton's passes, some quadratic in the operations, see one copy, not 4 or 8)."""
  if not cfg.split:
    return ref[...].astype(jnp.float32)
  f32 = (tt.bf16_to_f32 if ref.dtype == jnp.bfloat16 and not interpret else
         lambda v: v.astype(jnp.float32))
  return join_parts([f32(ref[:, :, h, c, _piece(cfg, q)]) for h, c, q in part_keys(cfg)], cfg)


def part_keys(cfg: Config):
  """``(h, c, q)`` of each part: piece ``q`` (of :attr:`Config.pieces`) of half ``c`` of
  the groups ``2 j + h``. A thread holds one part of each, 16 bytes of values: a whole
  half (8 values) of 16-bit values, a half's half (4) of 32-bit ones."""
  return [(h, c, q) for h in range(2) for c in range(cfg.cb) for q in range(cfg.pieces)]


def joined_shape(cfg: Config) -> tuple[int, ...]:
  """``[BLOCK, G / 2, 2, CB(, Q), piece]``: group pair ``j``, group ``2 j + h``, half ``c``,
  (piece ``q``, when :attr:`Config.pieces` is 2,) value: value ``c P + q piece + i`` of
  group ``2 j + h``."""
  return (cfg.sg, GROUPS // 2, 2, cfg.cb) + ((cfg.pieces,) if cfg.pieces > 1 else ()) + (cfg.piece,)


def _lane_axes(cfg: Config) -> int:
  """The trailing axes of :func:`joined_shape` that index a value within its half."""
  return 2 if cfg.pieces > 1 else 1


def _stack2(vs):
  """Two arrays stacked on a new last axis (Triton's ``join``: the new axis in each
  thread's registers, the fastest of them)."""
  return jnp.stack(vs, axis=-1)


def _unstack2(v):
  """Inverse of :func:`_stack2` (Triton's ``split``)."""
  return tuple(jnp.unstack(v, axis=-1))


def _pair_major(v):
  """``[..., C, H]`` <-> ``[..., H, C]`` (a transposition of the last two axes): built or
  taken apart by :func:`_stack2` / :func:`_unstack2`, the group axis ``h`` is the last,
  held in :func:`join_parts`'s register order (``h`` the fastest), so that no layout
  conversion moves the values."""
  return jnp.swapaxes(v, -1, -2)


def _reversed_parts(ndim: int) -> tuple[int, ...]:
  """The permutation reversing the axes after the first two (an involution)."""
  return (0, 1) + tuple(range(ndim - 1, 1, -1))


def join_parts(parts, cfg: Config):
  """The parts ``[BLOCK, G / 2, piece]`` (in :func:`part_keys`' order) as one array
  :func:`joined_shape`: stacked on new last axes (q, then c, then h), then those axes
  moved before the values' (a relabelling of registers: no data moves)."""
  at = dict(zip(part_keys(cfg), parts))
  piece = lambda h, c: (_stack2([at[h, c, q] for q in range(cfg.pieces)]) if cfg.pieces > 1
                        else at[h, c, 0])
  v = _stack2([_stack2([piece(h, c) for c in range(cfg.cb)]) for h in range(2)])
  return jnp.transpose(v, _reversed_parts(v.ndim))


def split_parts(v, cfg: Config):
  """Inverse of :func:`join_parts`: the parts in :func:`part_keys`' order."""
  pieces = _unstack2 if cfg.pieces > 1 else (lambda cv: (cv,))
  return [q for hv in _unstack2(jnp.transpose(v, _reversed_parts(v.ndim)))
          for cv in _unstack2(hv) for q in pieces(cv)]


def _piece(cfg: Config, q: int):
  return slice(None) if cfg.pieces == 1 else pl.ds(q * cfg.piece, cfg.piece)


def pieces_for(cfg: Config, *dtypes) -> Config:
  """``cfg`` with 2 pieces per half where a dense operand has 32-bit values (a thread's
  accesses stay 16 bytes, so Triton keeps one thread per group pair)."""
  wide = cfg.split and any(jnp.dtype(d).itemsize == 4 for d in dtypes)
  return dataclasses.replace(cfg, pieces=2 if wide else 1)


def store_dense(ref, v, cfg: Config):
  """Stores float32 ``v`` (as :func:`load_dense` gives) into a dense block, rounded to the
  block's dtype."""
  if not cfg.split:
    ref[...] = v.astype(ref.dtype)
    return
  for (h, c, q), part in zip(part_keys(cfg), split_parts(v, cfg)):
    ref[:, :, h, c, _piece(cfg, q)] = part.astype(ref.dtype)


def _table_f32(tab_ref, cfg: Config, at: int, j):
  """float32 entries ``at + j`` of the table input. A :func:`join_parts` index is gathered by
  parts and a group pair's ``[BLOCK, G / 2, 2]`` by group: each gather then has the shape
  of the block's dense accesses (``[BLOCK, G / 2, piece]``) or of its scale records (``[BLOCK,
  G / 2]``), whose register layout Triton gives it; gathered whole, it would get one of its
  own, and the values would be moved between threads to and from it."""
  get = lambda i: jax.lax.bitcast_convert_type(tab_ref[i + at], jnp.float32)
  if not cfg.split or j.ndim < 3:
    return get(j)
  if j.shape == joined_shape(cfg):
    return join_parts([get(i) for i in split_parts(j, cfg)], cfg)
  return _stack2([get(i) for i in _unstack2(j)])


def u16_payload(payload):
  """The payload (even length) as uint16 words, little-endian: the decoding
  kernels' view of it (one 16-bit load per plane and group, one per scale)."""
  return jax.lax.bitcast_convert_type(payload.reshape(-1, 2), jnp.uint16)


def _load_u16(ref16, byte_off, ok):
  """uint32 [..]: the 16-bit words at even byte offsets (0 where masked)."""
  return tt.load(ref16, byte_off >> 1, ok).astype(jnp.uint32)


def _load_u8(ref16, byte_off, ok):
  """uint32 [..]: the bytes at any byte offsets, from their 16-bit words."""
  return (_load_u16(ref16, byte_off, ok) >> ((byte_off & 1) * 8).astype(jnp.uint32)) & 0xFF


def read_chunk(pay16_ref, widths, ptab_ref, tab_ref, *, cfg: Config, s_count: int,
                interpret: bool, addend=None, rows: Rows | None = None):
  """Loads this program's scale records and planes (``pay16_ref``: the payload as
  uint16 words, :func:`u16_payload`); decodes: float32 [BLOCK, G, CB, P],
  or :func:`joined_shape` when :attr:`Config.split` (:func:`load_dense`).
  ``addend`` (as :func:`load_dense` gives): returns ``decode + addend``, each sum one
  ``fma.rn.f32`` on a GPU. ``rows``: each row from its own position and payload
  (:class:`Rows`) instead of this program's block of one chunk."""
  # the codes become indices of the table's rows (code | width << 8): on a GPU the byte
  # extraction inserts the row (tt.byte_over), so each lookup needs no addition
  dec = functools.partial(B.decode_block, fma=B.REFERENCE_OPS.fma if interpret else tt.fma,
                          rows=True)
  row = cfg.tabs.row(widths).astype(jnp.uint32) << np.uint32(8)
  k_off, k_ok, v_off, v_ok = _scale_offsets(cfg, s_count, rows)
  sg_scale = jax.lax.bitcast_convert_type(_load_u16(pay16_ref, v_off, v_ok) << np.uint32(16),
                                          jnp.float32)
  shape = cfg.block(cfg.sg)
  lookup = functools.partial(_table_f32, tab_ref, cfg, 0)
  if cfg.split:
    # The k bytes of a pair of groups are one 16-bit word. Per plane one 16-bit word
    # per group (the pair's two at one address): its byte c is half c's plane byte.
    # Four planes' words make two words per half (byte p = plane p), which are
    # transposed to the codes (planes_to_codes). Held [BLOCK, G / 2, 2(, CB)]: the
    # group h of each pair, then the half c, in each thread's registers (join_parts).
    kw = _load_u16(pay16_ref, k_off, k_ok)
    scale = B.decoded_scale(_stack2([kw & 0xFF, kw >> np.uint32(8)]), sg_scale)
    # the pair's plane words [BLOCK, G / 2, 2] (group h), transposed whole, then taken
    # apart by group h and half c (each part's codes then in the layout of the block's
    # dense accesses: built from whole words in the joined shape, Triton would give them
    # a layout of their own and move them between threads)
    pw = [_load_pairs(pay16_ref, off, ok, s_count)  # uint16
          for off, ok in plane_offsets(cfg, ptab_ref, s_count, words=True, rows=rows)]
    pw += [None] * (-len(pw) % 4)
    words = []
    for q in range(0, len(pw), 4):  # planes q..q+3: [BLOCK, G / 2, 2, CB]
      a = tt.pair16(pw[q], pw[q + 1], interpret)
      b = tt.pair16(pw[q + 2], pw[q + 3], interpret)
      words.append(_stack2([tt.prmt(a, b, sel, interpret) for sel in (0x6420, 0x7531)]))
    lo, hi = ([_unstack2(vc) for vc in _unstack2(v)]  # [c][h]
              for v in plane_words.plane_code_words(words, cfg.planes,
                                          plane_words.bit_select if interpret else tt.bit_select))
    lane = jax.lax.broadcasted_iota(jnp.uint32, (cfg.sg, GROUPS // 2, cfg.piece), 2)
    row = row[:, None, None]
    if interpret:
      index = lambda h, c, ln: plane_words.codes_of_words(lo[c][h], hi[c][h], ln) | row
    else:
      index = lambda h, c, ln: plane_words.codes_of_words(lo[c][h], hi[c][h], ln,
                                                lambda w, i: tt.byte_over(w, i, row))
    codes = join_parts([index(h, c, lane + np.uint32(q * cfg.piece)) for h, c, q in part_keys(cfg)],
                    cfg)
    return dec(codes, scale, widths, cfg.tabs, lookup=lookup, addend=addend)
  k = _load_u8(pay16_ref, k_off, k_ok)
  scale = B.decoded_scale(k, sg_scale)
  lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 3)
  shifts = lane * np.uint32(cfg.plane_bits)
  mask = np.uint32((1 << cfg.plane_bits) - 1)
  codes = jnp.zeros(shape, jnp.uint32)
  for p, (off, ok) in enumerate(plane_offsets(cfg, ptab_ref, s_count, rows=rows)):
    b = _load_u8(pay16_ref, off, ok)[..., None]
    codes = codes | (((b >> shifts) & mask) << np.uint32(cfg.plane_bits * p))
  return dec(codes | row[:, None, None, None], scale, widths, cfg.tabs, lookup=lookup,
             addend=addend)


def write_chunk(out_ref, x, widths, keys_ref, ptab_ref, tab_ref, *, cfg: Config,
                 s_count: int, units: int, strata: int, interpret: bool):
  """Encodes float32 [BLOCK, G, CB, P] (or :func:`joined_shape`, :func:`load_dense`);
  stores its scale records, planes and its share of the unused units (zeros)."""
  block = cfg.sg
  shape = cfg.block(block)
  if cfg.split:  # joined [BLOCK, G / 2, 2, CB, Q, piece] (joined_shape): group 2 j + h
    jshape = joined_shape(cfg)
    g3 = jshape[:3]
    group_idx = ((pl.program_id(0) * block + iota(g3, 0)) * GROUPS + iota(g3, 1) * 2
                 + iota(g3, 2)).astype(jnp.uint32)
    # the draws' group (idx >> 4) is the scale group, held by one thread: one hash per
    # key for every value; lanes idx & 15 = c P + q piece + i, static
    lane = plane_words.code_lanes(jshape, 1 + _lane_axes(cfg))
    draw_group = B.trailing(group_idx, len(jshape))
    idx = draw_group * np.uint32(GROUPS) + lane
  else:
    group_idx = ((pl.program_id(0) * block + iota(shape[:2], 0)) * GROUPS
                 + iota(shape[:2], 1)).astype(jnp.uint32)
    idx = ((pl.program_id(0) * block + iota(shape, 0)) * B.SUPERGROUP + iota(shape, 1) * GROUPS
           + iota(shape, 2) * shape[3] + iota(shape, 3)).astype(jnp.uint32)
    # the draws' group (idx >> 4) is the scale group; each code's lane (idx & 15)
    # is its static position in the group
    draw_group = group_idx[..., None, None]
    lane = (iota(shape, 2) * shape[3] + iota(shape, 3)).astype(jnp.uint32)
  keys, rank = _keys(keys_ref, tab_ref, cfg)
  # before any store: a hop's decode loaded the same plane table, and no store between
  # lets the compiler reuse those loads
  offsets = plane_offsets(cfg, ptab_ref, s_count, words=cfg.split)
  # lattice codes of up to 8 planes stay where the rounding leaves them (bits [F, F + w));
  # their third bytes are transposed, and the planes shifted into place (_plane_words)
  raw = cfg.split and cfg.tabs.lattice and cfg.planes > 5
  codes, k, sg_scale = B.encode_block(
      x, widths, cfg.tabs, keys=keys, rank=rank, strata=strata, idx=idx, draw_group=draw_group,
      lane=lane, scale_rounding=cfg.scale_rounding, raw_codes=raw,
      ops=B.REFERENCE_OPS if interpret else GPU_OPS, group_idx=group_idx,
      levels=functools.partial(_table_f32, tab_ref, cfg, cfg.levels_at),
      recip=functools.partial(_table_f32, tab_ref, cfg, cfg.recip_at))
  k_off, k_ok, _, _ = _scale_offsets(cfg, s_count)
  # The super-group scale from the thread of each super-group's group 0, in
  # the groups' layout (from the [BLOCK] vector, Triton would convert the
  # layout through shared memory). The other groups' (masked) offsets are
  # their own k bytes, already written: interpret mode's masked store
  # rewrites what is there, and must not race the scale's.
  bits = jnp.broadcast_to((jax.lax.bitcast_convert_type(sg_scale, jnp.uint32) >> 16)[:, None],
                          k_off.shape)
  first = iota(k_off.shape, 1) == 0
  v_ok = k_ok & first
  if cfg.split:  # the payload as uint16 words (every store pairs two bytes: even offsets)
    # a pair's k bytes, then the scale's two, each one 16-bit store
    k_word = k_off >> 1
    k0, k1 = (v.astype(jnp.uint32) for v in _unstack2(k))
    tt.store(out_ref, k_word, (k0 | (k1 << 8)).astype(jnp.uint16), k_ok)
    tt.store(out_ref, k_word + first.astype(jnp.int32) * (GROUPS // 2), bits.astype(jnp.uint16),
             v_ok)
    # 1-bit planes: bit transposition of each half's 8 codes, to words whose byte p % 4
    # is plane p (codes_to_plane_words); a group's two plane-p bytes (its halves) by one
    # prmt, stored per group h of the pair (the second a word further)
    halves = [[_unstack2(wh) for wh in _unstack2(_pair_major(w))]  # [h][c]
              for w in _plane_words(codes, widths, cfg, raw, interpret)]
    for p, (off, ok) in enumerate(offsets):
      q = p % 4
      pair = _stack2([tt.prmt(*halves[p // 4][h], q | (4 + q) << 4, interpret)
                      for h in range(2)]).astype(jnp.uint16)
      _store_pairs(out_ref, off, pair, ok, s_count)
  else:
    tt.store(out_ref, k_off, k, k_ok)
    for i in range(2):  # sg 18 + 16 + i
      tt.store(out_ref, k_off + first.astype(jnp.int32) * (GROUPS + i),
               ((bits >> (8 * i)) & 0xFF).astype(jnp.uint8), v_ok)
    # 2-bit planes: the 4 codes of a plane byte in one uint32 word (a byte
    # each); a plane's fields at bits 0, 8, 16, 24 times 0x01041040 land at
    # bits 24..31 (partial products at distinct bits, so no carries).
    lane = jax.lax.broadcasted_iota(jnp.uint32, codes.shape, codes.ndim - 1)
    word = jnp.sum(codes << (lane * np.uint32(8)), axis=-1)
    for p, (off, ok) in enumerate(offsets):
      byte = ((((word >> np.uint32(2 * p)) & np.uint32(0x03030303))
               * np.uint32(0x01041040)) >> np.uint32(24))
      tt.store(out_ref, off, byte.astype(jnp.uint8), ok)
  # Unused units [used, units): program i zeroes [used + i T, used + (i + 1) T).
  share, chunk = _tail_share(units, pl.cdiv(s_count, block))
  if share:
    used = ptab_ref[PTAB - 1]
    per = 2 if cfg.split else 1  # bytes per element of out_ref
    unit = cfg.unit_bytes // per
    rows = iota((chunk, unit), 0)
    cols = iota((chunk, unit), 1)
    zeros = jnp.zeros((chunk, unit), out_ref.dtype)
    for c in range(0, share, chunk):
      unit_i = used + pl.program_id(0) * share + c + rows
      tt.store(out_ref, s_count * (R.SCALE_BYTES // per) + unit_i * unit + cols, zeros,
               unit_i < units)


def _plane_words(codes, widths, cfg: Config, raw: bool, interpret: bool):
  """Each half group's words ``[BLOCK, G / 2, 2, CB]`` whose byte ``p % 4`` of word ``p //
  4`` is its plane-``p`` byte
  (:func:`~pallas_kernels.plane_words.codes_to_plane_words`), from its codes
  (:func:`joined_shape`).

  ``raw`` codes (``encode_block(raw_codes=True)``) have the code at bits ``[F, F + w)``,
  inside their third byte (``F >= 16``, ``F + w <= 24``): the third bytes are packed
  (``prmt``) and transposed whole, and transposed plane ``F - 16 + p`` is the code's
  plane ``p``, so one 64-bit shift of the two words by ``8 (F - 16)`` replaces a shift
  per code."""
  select = plane_words.bit_select if interpret else tt.bit_select
  if not raw:
    return plane_words.codes_to_plane_words(codes, cfg.planes, select, lane_axes=_lane_axes(cfg))
  field, _, _ = B.lattice_consts(widths)
  by = B.trailing((field - np.uint32(16)) * np.uint32(8), 4)
  lane = plane_words.code_lanes(codes.shape, _lane_axes(cfg))

  # one element per lane: code i of each half
  zs = [B.reduce_trailing(jnp.where(lane == i, codes, np.uint32(0)),
                          codes.ndim - _lane_axes(cfg), B.sum_last) for i in range(8)]
  lo, hi = (tt.third_bytes(*zs[4 * j:4 * j + 4], interpret) for j in range(2))
  w0, w1 = plane_words.byte_plane_words(lo, hi, select)
  return list(tt.shift_right64(w0, w1, by, interpret))


def _tail_share(units: int, programs: int) -> tuple[int, int]:
  """(unused units each program zeroes, units per store): static, covering ``units``."""
  if units == 0:
    return 0, 0
  chunk = min(pl.next_power_of_2(pl.cdiv(units, programs)), _TAIL_CHUNK)
  return pl.cdiv(pl.cdiv(units, programs), chunk) * chunk, chunk


def plane_table_of_widths(widths, plane_bits: int, units: int):
  """int32 [16]: ``off_p`` (first unit of plane p) for p < 8, the units used after
  (``off_(p+1)`` ends plane p), each at most ``units``."""
  # plane p starts after every position's units of the planes before it,
  # sum_j min(w_j / plane_bits, p) (entries past the last plane: the units used). The
  # sum is halving additions of slices, not a reduction: integers, so the same sum, and
  # XLA fuses it with the clamp into one launch (a reduction and the clamp after it were
  # two per call)
  planes = 8 // plane_bits
  p = jnp.minimum(jnp.arange(PTAB, dtype=jnp.int32), planes)[:, None]
  terms = jnp.minimum(widths.astype(jnp.int32)[None, :] // plane_bits, p)
  while terms.shape[1] > 1:
    if terms.shape[1] % 2:
      terms = jnp.pad(terms, ((0, 0), (0, 1)))
    half = terms.shape[1] // 2
    terms = terms[:, :half] + terms[:, half:]
  return jnp.minimum(terms[:, 0], units).astype(jnp.int32)


def plane_table(counts, width_set, plane_bits: int, units: int):
  """:func:`plane_table_of_widths` of widths that take ``counts[i]`` positions of width
  ``sorted(width_set)[i]`` (an allocation's counts): int32 [16], the same integers from
  a few products instead of a sum over every position
  (:func:`~pallas_kernels.dynamiq_reference.plane_table_of_counts`: what a hop reads of
  its widths beside them; the kernels take it as their ``ptab`` operand, and the
  allocation kernel makes it from its counts)."""
  ws = sorted(int(w) for w in width_set)
  counts = jnp.asarray(counts).astype(jnp.int32)
  if counts.shape[-1:] != (len(ws),):
    raise ValueError(f"counts has shape {counts.shape}; give one count per width of "
                     f"width_set={tuple(ws)}")
  return R.plane_table_of_counts([counts[..., i, None] for i in range(len(ws))], ws,
                                 plane_bits, units, np.arange(PTAB, dtype=np.int32))


def plane_operand(ptab, widths, plane_bits: int, units: int):
  """The kernels' plane-offset operand: ``ptab`` as given (checked), or None:
  :func:`plane_table_of_widths` of ``widths``."""
  if ptab is None:
    return plane_table_of_widths(widths, plane_bits, units)
  if np.shape(ptab) != (PTAB,) or jnp.result_type(ptab) != jnp.int32:
    raise ValueError(f"ptab has shape {np.shape(ptab)} and dtype {jnp.result_type(ptab)}; "
                     f"give int32 [{PTAB}] (plane_table of the widths' counts)")
  return ptab
