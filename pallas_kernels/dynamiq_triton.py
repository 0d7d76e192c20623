"""DynamiQ's hop kernels on the Pallas Triton backend, and their wrappers.

Four operations on one chunk payload (its bytes:
:mod:`pallas_kernels.dynamiq_reference`), each one launch that reads every
input byte once and writes every output byte once: :func:`compress_pallas`
(values -> payload), :func:`decompress_pallas` (payload -> float32),
:func:`decompress_accumulate_pallas` (``decode(p) + x``) and the ring hop
:func:`decompress_accumulate_recompress_pallas` (``encode(decode(p) + x)``,
the sum kept in registers). Three more decode all ``n`` gathered payloads of
one bucket (the same per-position widths) in one launch whose grid covers every
payload's super-groups: :func:`decompress_many_pallas` (``[n, S, 256]``),
:func:`decompress_rows_pallas` (each output row from its slot ``j n + c``, plus
a mean: DynamiQ's finish, every super-group written straight to its place) and
:func:`decompress_sum_pallas` (the decodes summed in rank order, in registers:
a two-step reduction). Their programs read each row's bytes at its own
payload's offsets (:class:`_Rows`).

Algorithm: the block arithmetic is the reference's own
(:func:`~pallas_kernels.dynamiq_block.encode_block`,
:func:`~pallas_kernels.dynamiq_block.decode_block`), so kernel and reference
agree bit for bit; only the byte movement and the instructions differ: off
GPU (``interpret=True``) the reference's
(:data:`~pallas_kernels.dynamiq_block.REFERENCE_OPS`), on a GPU
:data:`GPU_OPS`, one inlined PTX instruction each
(:mod:`pallas_kernels.triton_ops`) with the same codes
(:class:`~pallas_kernels.dynamiq_block.BlockOps` says why).

Memory layout: one program handles :data:`BLOCK` super-groups. Dense
operands are viewed as ``[S, G, CB, P]`` with ``P = 8 / plane_bits`` codes
per plane byte and ``CB = 16 / P`` plane bytes per scale group, so byte ``g
CB + cb`` of a plane holds codes ``(g CB + cb) P + [0, P)``: a plane byte is
the plane's bits of the ``P`` codes along the last axis, packed and unpacked
without a reshape. With ``plane_bits=1`` the dense operands are viewed as
``[S, G / 2, 2, CB, P]`` and the kernels load and store parts ``[:, :, h, cb,
piece]`` apart (:func:`_parts`: two pieces of a half for 32-bit values), so that one
thread holds two whole neighbouring scale groups of one super-group, and hold them
joined as one array (:func:`_joined`: the part axes in each thread's registers), so that
the block arithmetic is one copy in the IR, not one per part: Triton's coalescing pass
walks the whole IR from every memory access, so a kernel's compile time grows with the
square of its size (``docs/results/kernels_sass.md``). The payload stays flat in global
memory (``memory_space=ANY``), as uint16 words there (every ``plane_bits=1``
store pairs two bytes at an even offset; uint8 for ``plane_bits=2``): each
program loads / stores with computed offsets and masks the ``k`` bytes and 2
scale bytes of each scale record, and for each plane ``p`` (up to the widest
of ``width_set``) its plane bytes at unit ``off_p + s`` where that unit is
below ``off_(p+1)`` (:func:`_plane_offsets`). A plane byte's 8 codes and the
plane bytes are bit transposes of each other
(:func:`~pallas_kernels.dynamiq_reference.codes_to_plane_words`). The widths come
in as a ``[BLOCK]`` block, the plane offsets as a small int32 input
(``off_p``, then the units used, each at most ``units``). Compress also
zeroes the unused units ``[used, units)``: program ``i`` zeroes its own
static share of them, so every payload byte is written exactly once. The
level tables (the decode table by rows, ``code | width << 8``, then the
encode's levels and the reciprocals, padded to a power of two) are a small
input gathered by index.

jax >= 0.11 deprecates the Triton backend and warns at every Triton
lowering; the four entry points filter that DeprecationWarning, and only it,
whenever they build a Triton kernel (:func:`_triton_entry`). jax >= 0.11
also compiles a Triton kernel for the GPU of the abstract mesh in context,
else of the default device: lowering for a GPU from a CPU host takes an
abstract GPU device (docs/guide.md).

``tests/test_gpu_compile_units.py`` compiles all eight kernels for sm_90a
from a CPU host and checks that ``ptxas`` spills nothing;
``tools/sass_count.py`` counts their SASS instructions.
:mod:`pallas_kernels.dynamiq` dispatches to these kernels or the reference.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dispatch
from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng
from pallas_kernels import triton_ops as tt

__all__ = [
    "BLOCK",
    "GPU_OPS",
    "NUM_WARPS",
    "TUNED",
    "launch_config",
    "plane_table",
    "TRITON_DEPRECATION",
    "compress_pallas",
    "decompress_pallas",
    "decompress_accumulate_pallas",
    "decompress_accumulate_recompress_pallas",
    "decompress_many_pallas",
    "decompress_rows_pallas",
    "decompress_sum_pallas",
]

BLOCK = 16
"""Super-groups per program by default: 32 coordinates per thread with
:data:`NUM_WARPS` warps (``docs/results/kernels_sass.md`` weighs it against 8 and 32)."""

NUM_WARPS = 4
"""Warps per program by default."""

TUNED: dict[str, dict[str, tuple[int, int]]] = {
    # bench.kernels --sweep, docs/results/kernels_gpu_h200_sweep.json: at 2^28
    # coordinates 0.656 / 0.808 ms against 0.756 / 0.859 at (16, 4); one group per
    # thread, 64-thread programs (more programs resident per SM).
    "NVIDIA H200": {"compress": (4, 2), "decompress_accumulate_recompress": (4, 2)},
}
"""Per GPU (its ``device_kind``), per operation: ``(block, num_warps)`` chosen by
measurement (``python -m dynamiq_jax.bench.kernels --gpu --sweep``); a GPU or an
operation not listed gets ``(BLOCK, NUM_WARPS)``."""

_G = B.GROUP  # scale groups per super-group
_PTAB = 16  # entries of the plane-offset input (off_p for p < 8, then the units used)
_TAIL_CHUNK = 64  # most unused units one store zeroes
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_UNROLL_SUM = 8  # payloads the decode-sum kernel adds unrolled; more in a loop
_DEC_ROWS = 9 * 256  # entries of LevelTables.dec_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
  """Static description of a chunk's coding (hashable: a jit static argument).

  ``per`` codes per plane byte, ``cb`` plane bytes per scale group, ``planes``
  of the widest code; ``split``: the kernels access a block by parts ``[BLOCK, G / 2,
  piece]`` and hold it joined (``plane_bits=1``; :func:`_parts`, :func:`_load_dense`)."""

  eps: tuple
  width_set: tuple
  plane_bits: int
  scale_rounding: str
  sg: int  # super-groups per program (the launch's ``block``, :func:`launch_config`)
  num_warps: int
  pieces: int = 1  # pieces per half group (:func:`_parts`): 2 for 32-bit dense values

  per = property(lambda self: 8 // self.plane_bits)
  cb = property(lambda self: _G // self.per)
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
    return (supergroups, _G, self.cb, self.per)

  def dense(self, supergroups: int) -> tuple[int, ...]:
    """A dense operand's shape: :meth:`block`, or with its groups as pairs ``[S, G / 2,
    2, CB, P]`` when :attr:`split` (:func:`_load_dense`)."""
    if self.split:
      return (supergroups, _G // 2, 2, self.cb, self.per)
    return self.block(supergroups)

  def dense_spec(self):
    return pl.BlockSpec(self.dense(self.sg), lambda i: (i,) + (0,) * (len(self.dense(1)) - 1))


GPU_OPS = B.BlockOps(log2=tt.approx_log2, floor_int=tt.floor_int, fma=tt.fma,
                     lt_mask=tt.lt_mask, frac_mul=tt.frac_mul, div=tt.div_approx,
                     mulhi=tt.mulhi, mul_add_rounded=tt.mul_add_rounded,
                     or_unless=tt.or_unless, max_last=lambda a: jnp.max(a, axis=-1))
"""The block arithmetic's instructions on a GPU (a
:class:`~pallas_kernels.dynamiq_block.BlockOps`)."""


# ----------------------------------------------------------------------------
# Byte movement.


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


class _Rows(NamedTuple):
  """Where the rows of a gathering program come from (:func:`_decode_rows_kernel`), per
  row [BLOCK]: ``j``, its position in its chunk; ``base``, the first byte of its
  chunk's payload; ``ok``, the row exists."""

  j: Any
  base: Any
  ok: Any


def _groups(cfg: _Config) -> tuple[int, int]:
  """(groups per array, groups one offset covers): [BLOCK, G / 2] pairs when
  :attr:`_Config.split` (:func:`_load_dense`), else [BLOCK, G]."""
  return (_G // 2, 2) if cfg.split else (_G, 1)


def _scale_offsets(cfg: _Config, s_count: int, rows: _Rows | None = None):
  """Offsets of this program's scale records: k bytes [BLOCK, G] (the first of each pair
  of k bytes, [BLOCK, G / 2], when :attr:`_Config.split`: even), super-group scale
  [BLOCK], masks (``rows``: each row's own position and payload)."""
  block = cfg.sg
  groups, step = _groups(cfg)
  shape = (block, groups)
  byte = _iota(shape, 1) * step
  if rows is not None:
    j2 = jnp.broadcast_to(rows.j[:, None], shape)
    b2 = jnp.broadcast_to(rows.base[:, None], shape)
    return (b2 + j2 * R.SCALE_BYTES + byte, jnp.broadcast_to(rows.ok[:, None], shape),
            rows.base + rows.j * R.SCALE_BYTES + _G, rows.ok)
  base = pl.program_id(0) * block
  sg2 = base + _iota(shape, 0)
  sg1 = base + _iota((block,), 0)
  return (sg2 * R.SCALE_BYTES + byte, sg2 < s_count, sg1 * R.SCALE_BYTES + _G, sg1 < s_count)


def _plane_offsets(cfg: _Config, ptab_ref, s_count: int, words: bool = False,
                   rows: _Rows | None = None):
  """Per plane p: (byte offsets [BLOCK, G, CB] of this program's plane-p bytes, mask);
  ``words``: offsets [BLOCK, G] of each group's 16-bit word of plane bytes
  (``plane_bits=1``: one byte per half) in the payload's uint16 view. When
  :attr:`_Config.split`: of the first group of each pair, [BLOCK, G / 2, CB] and
  [BLOCK, G / 2] (the second's are 2 bytes, one word, further).

  Plane p of super-group ``sg`` is unit ``off_p + sg`` where ``sg < count_p``,
  i.e. where that unit is below ``off_(p+1)`` (one comparison: with widths
  widest first these are the super-groups that have plane p, and the
  program's tail past ``s_count`` is excluded too, as ``count_p <= s_count``).
  :func:`_plane_table` clamps the offsets to the payload's units, so that no
  widths, valid or not, reach outside it. ``rows``: each row's position, its
  payload's first byte (even) and whether it exists."""
  block = cfg.sg
  groups, step = _groups(cfg)
  shape = (block, groups) if words else (block, groups, cfg.cb)
  div = 2 if words else 1  # (plane_bits=1: the bytes g CB, CB = 2, are even)
  # in units of ``div`` bytes, without a division (whose floor rounding would hide from
  # Triton that the offsets are even)
  byte = _iota(shape, 1) * (cfg.cb * step // div) + (0 if words else _iota(shape, 2))
  if rows is None:
    sg, start, ok = pl.program_id(0) * block + _iota(shape, 0), 0, True
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
  :func:`_plane_offsets`) start at an even word: the planes start at word ``9 s_count``
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


def _keys(keys_ref, tab_ref, cfg: _Config):
  """The keys and the rank (:func:`~pallas_kernels.rng.key_operand`), its rows of GF
  products read from the table (:attr:`_Config.gf_at`), not computed, in each program."""
  rank = keys_ref[4].astype(jnp.int32)
  at = cfg.gf_at + (rank & 7) * 3
  rows = tuple(jax.lax.bitcast_convert_type(tab_ref[at + k], jnp.uint32) for k in range(3))
  return (keys_ref[0], keys_ref[1], keys_ref[2], keys_ref[3]), rng.Rank(rank, rows)


def _load_dense(ref, cfg: _Config, interpret: bool):
  """A dense block as float32: ``[BLOCK, G, CB, P]`` whole, or, when
  :attr:`_Config.split` (``ref`` ``[BLOCK, G / 2, 2, CB, P]``, :meth:`_Config.dense`),
  loaded as its parts (:func:`_parts`) and held as :func:`_joined` ``[BLOCK, G / 2, 2,
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
  return _joined([f32(ref[:, :, h, c, _piece(cfg, q)]) for h, c, q in _parts(cfg)], cfg)


def _parts(cfg: _Config):
  """``(h, c, q)`` of each part: piece ``q`` (of :attr:`_Config.pieces`) of half ``c`` of
  the groups ``2 j + h``. A thread holds one part of each, 16 bytes of values: a whole
  half (8 values) of 16-bit values, a half's half (4) of 32-bit ones."""
  return [(h, c, q) for h in range(2) for c in range(cfg.cb) for q in range(cfg.pieces)]


def _joined_shape(cfg: _Config) -> tuple[int, ...]:
  """``[BLOCK, G / 2, 2, CB(, Q), piece]``: group pair ``j``, group ``2 j + h``, half ``c``,
  (piece ``q``, when :attr:`_Config.pieces` is 2,) value: value ``c P + q piece + i`` of
  group ``2 j + h``."""
  return (cfg.sg, _G // 2, 2, cfg.cb) + ((cfg.pieces,) if cfg.pieces > 1 else ()) + (cfg.piece,)


def _lane_axes(cfg: _Config) -> int:
  """The trailing axes of :func:`_joined_shape` that index a value within its half."""
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
  held in :func:`_joined`'s register order (``h`` the fastest), so that no layout
  conversion moves the values."""
  return jnp.swapaxes(v, -1, -2)


def _reversed_parts(ndim: int) -> tuple[int, ...]:
  """The permutation reversing the axes after the first two (an involution)."""
  return (0, 1) + tuple(range(ndim - 1, 1, -1))


def _joined(parts, cfg: _Config):
  """The parts ``[BLOCK, G / 2, piece]`` (in :func:`_parts`' order) as one array
  :func:`_joined_shape`: stacked on new last axes (q, then c, then h), then those axes
  moved before the values' (a relabelling of registers: no data moves)."""
  at = dict(zip(_parts(cfg), parts))
  piece = lambda h, c: (_stack2([at[h, c, q] for q in range(cfg.pieces)]) if cfg.pieces > 1
                        else at[h, c, 0])
  v = _stack2([_stack2([piece(h, c) for c in range(cfg.cb)]) for h in range(2)])
  return jnp.transpose(v, _reversed_parts(v.ndim))


def _split(v, cfg: _Config):
  """Inverse of :func:`_joined`: the parts in :func:`_parts`' order."""
  pieces = _unstack2 if cfg.pieces > 1 else (lambda cv: (cv,))
  return [q for hv in _unstack2(jnp.transpose(v, _reversed_parts(v.ndim)))
          for cv in _unstack2(hv) for q in pieces(cv)]


def _piece(cfg: _Config, q: int):
  return slice(None) if cfg.pieces == 1 else pl.ds(q * cfg.piece, cfg.piece)


def _pieces_for(cfg: _Config, *dtypes) -> _Config:
  """``cfg`` with 2 pieces per half where a dense operand has 32-bit values (a thread's
  accesses stay 16 bytes, so Triton keeps one thread per group pair)."""
  wide = cfg.split and any(jnp.dtype(d).itemsize == 4 for d in dtypes)
  return dataclasses.replace(cfg, pieces=2 if wide else 1)


def _store_dense(ref, v, cfg: _Config):
  """Stores float32 ``v`` (as :func:`_load_dense` gives) into a dense block, rounded to the
  block's dtype."""
  if not cfg.split:
    ref[...] = v.astype(ref.dtype)
    return
  for (h, c, q), part in zip(_parts(cfg), _split(v, cfg)):
    ref[:, :, h, c, _piece(cfg, q)] = part.astype(ref.dtype)


def _table_f32(tab_ref, cfg: _Config, at: int, j):
  """float32 entries ``at + j`` of the table input. A :func:`_joined` index is gathered by
  parts and a group pair's ``[BLOCK, G / 2, 2]`` by group: each gather then has the shape
  of the block's dense accesses (``[BLOCK, G / 2, piece]``) or of its scale records (``[BLOCK,
  G / 2]``), whose register layout Triton gives it; gathered whole, it would get one of its
  own, and the values would be moved between threads to and from it."""
  get = lambda i: jax.lax.bitcast_convert_type(tab_ref[i + at], jnp.float32)
  if not cfg.split or j.ndim < 3:
    return get(j)
  if j.shape == _joined_shape(cfg):
    return _joined([get(i) for i in _split(j, cfg)], cfg)
  return _stack2([get(i) for i in _unstack2(j)])


def _u16_payload(payload):
  """The payload (even length) as uint16 words, little-endian: the decoding
  kernels' view of it (one 16-bit load per plane and group, one per scale)."""
  return jax.lax.bitcast_convert_type(payload.reshape(-1, 2), jnp.uint16)


def _load_u16(ref16, byte_off, ok):
  """uint32 [..]: the 16-bit words at even byte offsets (0 where masked)."""
  return tt.load(ref16, byte_off >> 1, ok).astype(jnp.uint32)


def _load_u8(ref16, byte_off, ok):
  """uint32 [..]: the bytes at any byte offsets, from their 16-bit words."""
  return (_load_u16(ref16, byte_off, ok) >> ((byte_off & 1) * 8).astype(jnp.uint32)) & 0xFF


def _read_chunk(pay16_ref, widths, ptab_ref, tab_ref, *, cfg: _Config, s_count: int,
                interpret: bool, addend=None, rows: _Rows | None = None):
  """Loads this program's scale records and planes (``pay16_ref``: the payload as
  uint16 words, :func:`_u16_payload`); decodes: float32 [BLOCK, G, CB, P],
  or :func:`_joined_shape` when :attr:`_Config.split` (:func:`_load_dense`).
  ``addend`` (as :func:`_load_dense` gives): returns ``decode + addend``, each sum one
  ``fma.rn.f32`` on a GPU. ``rows``: each row from its own position and payload
  (:class:`_Rows`) instead of this program's block of one chunk."""
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
    # group h of each pair, then the half c, in each thread's registers (_joined).
    kw = _load_u16(pay16_ref, k_off, k_ok)
    scale = B.decoded_scale(_stack2([kw & 0xFF, kw >> np.uint32(8)]), sg_scale)
    # the pair's plane words [BLOCK, G / 2, 2] (group h), transposed whole, then taken
    # apart by group h and half c (each part's codes then in the layout of the block's
    # dense accesses: built from whole words in the joined shape, Triton would give them
    # a layout of their own and move them between threads)
    pw = [_load_pairs(pay16_ref, off, ok, s_count)  # uint16
          for off, ok in _plane_offsets(cfg, ptab_ref, s_count, words=True, rows=rows)]
    pw += [None] * (-len(pw) % 4)
    words = []
    for q in range(0, len(pw), 4):  # planes q..q+3: [BLOCK, G / 2, 2, CB]
      a = tt.pair16(pw[q], pw[q + 1], interpret)
      b = tt.pair16(pw[q + 2], pw[q + 3], interpret)
      words.append(_stack2([tt.prmt(a, b, sel, interpret) for sel in (0x6420, 0x7531)]))
    lo, hi = ([_unstack2(vc) for vc in _unstack2(v)]  # [c][h]
              for v in R.plane_code_words(words, cfg.planes,
                                          R.bit_select if interpret else tt.bit_select))
    lane = jax.lax.broadcasted_iota(jnp.uint32, (cfg.sg, _G // 2, cfg.piece), 2)
    row = row[:, None, None]
    if interpret:
      index = lambda h, c, ln: R.codes_of_words(lo[c][h], hi[c][h], ln) | row
    else:
      index = lambda h, c, ln: R.codes_of_words(lo[c][h], hi[c][h], ln,
                                                lambda w, i: tt.byte_over(w, i, row))
    codes = _joined([index(h, c, lane + np.uint32(q * cfg.piece)) for h, c, q in _parts(cfg)],
                    cfg)
    return dec(codes, scale, widths, cfg.tabs, lookup=lookup, addend=addend)
  k = _load_u8(pay16_ref, k_off, k_ok)
  scale = B.decoded_scale(k, sg_scale)
  lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 3)
  shifts = lane * np.uint32(cfg.plane_bits)
  mask = np.uint32((1 << cfg.plane_bits) - 1)
  codes = jnp.zeros(shape, jnp.uint32)
  for p, (off, ok) in enumerate(_plane_offsets(cfg, ptab_ref, s_count, rows=rows)):
    b = _load_u8(pay16_ref, off, ok)[..., None]
    codes = codes | (((b >> shifts) & mask) << np.uint32(cfg.plane_bits * p))
  return dec(codes | row[:, None, None, None], scale, widths, cfg.tabs, lookup=lookup,
             addend=addend)


def _write_chunk(out_ref, x, widths, keys_ref, ptab_ref, tab_ref, *, cfg: _Config,
                 s_count: int, units: int, strata: int, interpret: bool):
  """Encodes float32 [BLOCK, G, CB, P] (or :func:`_joined_shape`, :func:`_load_dense`);
  stores its scale records, planes and its share of the unused units (zeros)."""
  block = cfg.sg
  shape = cfg.block(block)
  if cfg.split:  # joined [BLOCK, G / 2, 2, CB, Q, piece] (_joined_shape): group 2 j + h
    jshape = _joined_shape(cfg)
    g3 = jshape[:3]
    group_idx = ((pl.program_id(0) * block + _iota(g3, 0)) * _G + _iota(g3, 1) * 2
                 + _iota(g3, 2)).astype(jnp.uint32)
    # the draws' group (idx >> 4) is the scale group, held by one thread: one hash per
    # key for every value; lanes idx & 15 = c P + q piece + i, static
    lane = R.code_lanes(jshape, 1 + _lane_axes(cfg))
    draw_group = B.trailing(group_idx, len(jshape))
    idx = draw_group * np.uint32(_G) + lane
  else:
    group_idx = ((pl.program_id(0) * block + _iota(shape[:2], 0)) * _G
                 + _iota(shape[:2], 1)).astype(jnp.uint32)
    idx = ((pl.program_id(0) * block + _iota(shape, 0)) * B.SUPERGROUP + _iota(shape, 1) * _G
           + _iota(shape, 2) * shape[3] + _iota(shape, 3)).astype(jnp.uint32)
    # the draws' group (idx >> 4) is the scale group; each code's lane (idx & 15)
    # is its static position in the group
    draw_group = group_idx[..., None, None]
    lane = (_iota(shape, 2) * shape[3] + _iota(shape, 3)).astype(jnp.uint32)
  keys, rank = _keys(keys_ref, tab_ref, cfg)
  # before any store: a hop's decode loaded the same plane table, and no store between
  # lets the compiler reuse those loads
  offsets = _plane_offsets(cfg, ptab_ref, s_count, words=cfg.split)
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
  first = _iota(k_off.shape, 1) == 0
  v_ok = k_ok & first
  if cfg.split:  # the payload as uint16 words (every store pairs two bytes: even offsets)
    # a pair's k bytes, then the scale's two, each one 16-bit store
    k_word = k_off >> 1
    k0, k1 = (v.astype(jnp.uint32) for v in _unstack2(k))
    tt.store(out_ref, k_word, (k0 | (k1 << 8)).astype(jnp.uint16), k_ok)
    tt.store(out_ref, k_word + first.astype(jnp.int32) * (_G // 2), bits.astype(jnp.uint16),
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
      tt.store(out_ref, k_off + first.astype(jnp.int32) * (_G + i),
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
    used = ptab_ref[_PTAB - 1]
    per = 2 if cfg.split else 1  # bytes per element of out_ref
    unit = cfg.unit_bytes // per
    rows = _iota((chunk, unit), 0)
    cols = _iota((chunk, unit), 1)
    zeros = jnp.zeros((chunk, unit), out_ref.dtype)
    for c in range(0, share, chunk):
      unit_i = used + pl.program_id(0) * share + c + rows
      tt.store(out_ref, s_count * (R.SCALE_BYTES // per) + unit_i * unit + cols, zeros,
               unit_i < units)


def _plane_words(codes, widths, cfg: _Config, raw: bool, interpret: bool):
  """Each half group's words ``[BLOCK, G / 2, 2, CB]`` whose byte ``p % 4`` of word ``p //
  4`` is its plane-``p`` byte
  (:func:`~pallas_kernels.dynamiq_reference.codes_to_plane_words`), from its codes
  (:func:`_joined_shape`).

  ``raw`` codes (``encode_block(raw_codes=True)``) have the code at bits ``[F, F + w)``,
  inside their third byte (``F >= 16``, ``F + w <= 24``): the third bytes are packed
  (``prmt``) and transposed whole, and transposed plane ``F - 16 + p`` is the code's
  plane ``p``, so one 64-bit shift of the two words by ``8 (F - 16)`` replaces a shift
  per code."""
  select = R.bit_select if interpret else tt.bit_select
  if not raw:
    return R.codes_to_plane_words(codes, cfg.planes, select, lane_axes=_lane_axes(cfg))
  field, _, _ = B.lattice_consts(widths)
  by = B.trailing((field - np.uint32(16)) * np.uint32(8), 4)
  lane = R.code_lanes(codes.shape, _lane_axes(cfg))

  # one element per lane: code i of each half
  zs = [B.reduce_trailing(jnp.where(lane == i, codes, np.uint32(0)),
                          codes.ndim - _lane_axes(cfg), B.sum_last) for i in range(8)]
  lo, hi = (tt.third_bytes(*zs[4 * j:4 * j + 4], interpret) for j in range(2))
  w0, w1 = R.byte_plane_words(lo, hi, select)
  return list(tt.shift_right64(w0, w1, by, interpret))


def _tail_share(units: int, programs: int) -> tuple[int, int]:
  """(unused units each program zeroes, units per store): static, covering ``units``."""
  if units == 0:
    return 0, 0
  chunk = min(pl.next_power_of_2(pl.cdiv(units, programs)), _TAIL_CHUNK)
  return pl.cdiv(pl.cdiv(units, programs), chunk) * chunk, chunk


# ----------------------------------------------------------------------------
# Kernel bodies.


def _compress_kernel(keys_ref, ptab_ref, tab_ref, w_ref, x_ref, out_ref, *, cfg, s_count, units,
                     strata, interpret):
  _write_chunk(out_ref, _load_dense(x_ref, cfg, interpret), w_ref[...], keys_ref, ptab_ref,
               tab_ref, cfg=cfg, s_count=s_count, units=units, strata=strata,
               interpret=interpret)


def _decompress_kernel(ptab_ref, tab_ref, w_ref, pay_ref, out_ref, *, cfg, s_count, interpret):
  _store_dense(out_ref, _read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, interpret=interpret), cfg)


def _decompress_accumulate_kernel(ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg,
                                  s_count, interpret):
  _store_dense(out_ref, _read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, addend=_load_dense(x_ref, cfg, interpret),
                                    interpret=interpret), cfg)


def _dar_kernel(keys_ref, ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg, s_count,
                units, strata, interpret):
  widths = w_ref[...]
  acc = _read_chunk(pay_ref, widths, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                    addend=_load_dense(x_ref, cfg, interpret), interpret=interpret)
  _write_chunk(out_ref, acc, widths, keys_ref, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
               units=units, strata=strata, interpret=interpret)


def _decode_rows_kernel(ptab_ref, tab_ref, w_ref, *refs, cfg, s_count, n, count, slots, mean,
                        payload_bytes, interpret, rotate=0, row_sum=None):
  """Decodes ``count`` rows, each one super-group of one of the ``n`` payloads (all with
  the same per-position widths, ``w_ref`` read per row): row r is position ``r % S``
  of payload ``r // S``, or (``slots``) slot ``slot_ref[r]``, clamped to ``[0, n S)``:
  position ``slot // n`` of chunk ``slot % n``, which is payload ``(slot % n + rotate)
  % n``; plus ``mean_ref[r mean]`` (``mean``: the stride of the flat means, 0 without),
  by the same ``fma`` as :func:`_decompress_accumulate_kernel`. ``row_sum``: also each
  row's ``row_sum(sq, norm, width)`` (``sq`` the float32 row's squares less its mean,
  :func:`_row_sq`; ``norm`` the entry after its mean, or None; ``width`` its
  position's)."""
  refs = list(refs)
  slot_ref = refs.pop(0) if slots else None
  mean_ref = refs.pop(0) if mean else None
  pay_ref, out_ref = refs[:2]
  block = cfg.sg
  row = pl.program_id(0) * block + _iota((block,), 0)
  ok = row < count
  if slots:
    slot = jnp.clip(jnp.where(ok, slot_ref[...], 0), 0, n * s_count - 1)
    c, j = jax.lax.rem(slot, np.int32(n)), jax.lax.div(slot, np.int32(n))
    if rotate:
      c = jax.lax.rem(c + np.int32(rotate), np.int32(n))
  else:
    r = jnp.where(ok, row, 0)
    c, j = jax.lax.div(r, np.int32(s_count)), jax.lax.rem(r, np.int32(s_count))
  rows = _Rows(j, c * np.int32(payload_bytes), ok)
  addend = None
  at = jnp.where(ok, row, 0) * np.int32(mean)  # row r's entry in the flat means
  if mean:  # row r's mean: entry r * mean of the flat means (a column of statistics)
    m = tt.load(mean_ref, at, ok).astype(jnp.float32)
    shape = cfg.block(block)
    if cfg.split:
      shape = _joined_shape(cfg)
    addend = jnp.broadcast_to(B.trailing(m, len(shape)), shape)
  width = tt.load(w_ref, j, ok)
  val = _read_chunk(pay_ref, width, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                    interpret=interpret, addend=addend, rows=rows)
  _store_dense(out_ref, val, cfg)
  if row_sum is not None:
    norm = None
    if mean >= 2:  # the statistics' next column: the row's norm
      norm = tt.load(mean_ref, at + 1, ok).astype(jnp.float32)
    refs[2][...] = row_sum(_row_sq(val, addend), norm, width)


def _row_sq(val, addend):
  """float32 [BLOCK]: each row's sum of ``(val - addend)^2`` over its 256 values (``val``,
  ``addend`` as :func:`_read_chunk` takes and gives them; None: no addend), one axis at a
  time (a Triton reduction takes one): the compiler's order, so the last bits may differ
  from the reference's sum."""
  r = val if addend is None else val - addend
  return B.reduce_trailing(r * r, 1, B.sum_last)


def _decode_sum_kernel(ptab_ref, tab_ref, w_ref, pay_ref, out_ref, *, cfg, s_count, n,
                       payload_bytes, interpret):
  """The sum of the ``n`` payloads' decodes of this program's block of positions, in rank
  order: payload 0 decoded, then each next one decoded and added (``fma``, as
  :func:`_decompress_accumulate_kernel`), the sum kept in registers."""
  j = pl.program_id(0) * cfg.sg + _iota((cfg.sg,), 0)
  ok = j < s_count
  widths = w_ref[...]

  def add(c, acc):
    rows = _Rows(j, j * 0 + c * np.int32(payload_bytes), ok)
    return _read_chunk(pay_ref, widths, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                       interpret=interpret, addend=acc, rows=rows)

  acc = add(np.int32(0), None)
  if n <= _UNROLL_SUM:
    for c in range(1, n):
      acc = add(np.int32(c), acc)
  else:
    acc = jax.lax.fori_loop(np.int32(1), np.int32(n), add, acc)
  _store_dense(out_ref, acc, cfg)


# ----------------------------------------------------------------------------
# The launch: one pallas_call per operation.


def _plane_table(widths, plane_bits: int, units: int):
  """int32 [16]: ``off_p`` (first unit of plane p) for p < 8, the units used after
  (``off_(p+1)`` ends plane p), each at most ``units``."""
  # plane p starts after every position's units of the planes before it,
  # sum_j min(w_j / plane_bits, p) (entries past the last plane: the units used). The
  # sum is halving additions of slices, not a reduction: integers, so the same sum, and
  # XLA fuses it with the clamp into one launch (a reduction and the clamp after it were
  # two per call)
  planes = 8 // plane_bits
  p = jnp.minimum(jnp.arange(_PTAB, dtype=jnp.int32), planes)[:, None]
  terms = jnp.minimum(widths.astype(jnp.int32)[None, :] // plane_bits, p)
  while terms.shape[1] > 1:
    if terms.shape[1] % 2:
      terms = jnp.pad(terms, ((0, 0), (0, 1)))
    half = terms.shape[1] // 2
    terms = terms[:, :half] + terms[:, half:]
  return jnp.minimum(terms[:, 0], units).astype(jnp.int32)


def plane_table(counts, width_set, plane_bits: int, units: int):
  """:func:`_plane_table` of widths that take ``counts[i]`` positions of width
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
                                 plane_bits, units, np.arange(_PTAB, dtype=np.int32))


def _plane_operand(ptab, widths, plane_bits: int, units: int):
  """The kernels' plane-offset operand: ``ptab`` as given (checked), or None:
  :func:`_plane_table` of ``widths``."""
  if ptab is None:
    return _plane_table(widths, plane_bits, units)
  if np.shape(ptab) != (_PTAB,) or jnp.result_type(ptab) != jnp.int32:
    raise ValueError(f"ptab has shape {np.shape(ptab)} and dtype {jnp.result_type(ptab)}; "
                     f"give int32 [{_PTAB}] (plane_table of the widths' counts)")
  return ptab


def _compiler_params(cfg: _Config, interpret):
  """Triton's (what makes a ``pallas_call`` lower with the Triton backend on GPU)."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltr
  return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=1)


_KERNELS = {  # op: (kernel body, reads a payload, reads x, writes a payload)
    "compress": (_compress_kernel, False, True, True),
    "decompress": (_decompress_kernel, True, False, False),
    "decompress_accumulate": (_decompress_accumulate_kernel, True, True, False),
    "decompress_accumulate_recompress": (_dar_kernel, True, True, True),
}


@functools.partial(jax.jit, static_argnames=("op", "cfg", "units", "strata", "interpret",
                                             "fill"))
def _launch(payload, x, widths, karr, ptab, *, op, cfg, units, strata, interpret, fill=None):
  """One launch of ``op`` over ``cdiv(S, BLOCK)`` programs. ``ptab``: the widths' plane
  table (:func:`_plane_operand`). ``fill`` (tests only): the output payload buffer's
  initial byte (None: uninitialized), to check that every byte is written."""
  body, reads, dense, writes = _KERNELS[op]
  s_count = widths.shape[0]
  # (the dense output, when there is one, is float32)
  cfg = _pieces_for(cfg, *([x.dtype] if dense else []), *([] if writes else [jnp.float32]))
  tab = jnp.asarray(cfg.table())
  static = dict(cfg=cfg, s_count=s_count, interpret=bool(interpret))
  if writes:
    static.update(units=units, strata=strata)
  args = ([karr] if writes else []) + [ptab, tab, widths]
  dense_spec = cfg.dense_spec()
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))
  in_specs = ([whole(8)] if writes else []) + [
      whole(_PTAB), whole(tab.shape[0]), pl.BlockSpec((cfg.sg,), lambda i: (i,))]
  if reads:
    args.append(_u16_payload(payload))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
  if dense:
    args.append(x.reshape(cfg.dense(s_count)))
    in_specs.append(dense_spec)
  kernel = functools.partial(body, **static)
  if writes:  # (split: written as uint16 words, _write_chunk)
    size = R.payload_bytes(s_count, units, cfg.plane_bits)
    out_shape = (jax.ShapeDtypeStruct((size // 2,), jnp.uint16) if cfg.split else
                 jax.ShapeDtypeStruct((size,), jnp.uint8))
    out_spec = pl.BlockSpec(memory_space=pl.ANY)
  else:
    out_shape = jax.ShapeDtypeStruct(cfg.dense(s_count), jnp.float32)
    out_spec = dense_spec
  aliases = {}
  if writes and fill is not None:
    n = len(args)
    kernel = lambda *refs, k=kernel: k(*refs[:n], refs[-1])
    args.append(jnp.full(out_shape.shape, fill * (0x101 if cfg.split else 1), out_shape.dtype))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    aliases = {n: 0}
  out = pl.pallas_call(
      kernel, out_shape=dispatch.typed_like(out_shape, args), grid=(pl.cdiv(s_count, cfg.sg),),
      in_specs=in_specs, out_specs=out_spec, input_output_aliases=aliases,
      compiler_params=_compiler_params(cfg, interpret), interpret=interpret,
      name=f"dynamiq_units_{op}_p{cfg.plane_bits}")(*args)
  if writes:
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(-1) if cfg.split else out
  return out.reshape(s_count, B.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret", "rotate", "dtype",
                                             "row_sum"))
def _launch_rows(payloads, widths, slots, mean, ptab, *, cfg, units, interpret, rotate=0,
                 dtype=jnp.float32, row_sum=None):
  """One launch decoding rows of all ``n`` payloads [n, bytes] (:func:`_decode_rows_kernel`)
  over ``cdiv(rows, BLOCK)`` programs: ``n S`` rows in chunk order, or one per slot
  (chunk c: payload ``(c + rotate) % n``). ``row_sum``: -> (rows, float32 [rows] each
  row's term)."""
  n, size = payloads.shape
  cfg = _pieces_for(cfg, dtype)
  s_count = widths.shape[0]
  count = n * s_count if slots is None else slots.shape[0]
  tab = jnp.asarray(cfg.table())
  whole = lambda k: pl.BlockSpec((k,), lambda i: (0,))
  per_row = pl.BlockSpec((cfg.sg,), lambda i: (i,))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  args = [ptab, tab, widths]
  in_specs = [whole(_PTAB), whole(tab.shape[0]), anywhere]
  if slots is not None:
    args.append(slots.astype(jnp.int32))
    in_specs.append(per_row)
  if mean is not None:  # read where it lies: [rows] or column 0 of [rows, k] statistics
    if mean.dtype not in (jnp.float32, jnp.bfloat16):
      mean = mean.astype(jnp.float32)
    args.append(mean.reshape(-1))
    in_specs.append(anywhere)
  args.append(_u16_payload(payloads.reshape(-1)))
  in_specs.append(anywhere)
  kernel = functools.partial(_decode_rows_kernel, cfg=cfg, s_count=s_count, n=n, count=count,
                             slots=slots is not None,
                             mean=0 if mean is None else math.prod(mean.shape[1:]),
                             payload_bytes=size, interpret=bool(interpret), rotate=rotate,
                             row_sum=row_sum)
  out_shape = [jax.ShapeDtypeStruct(cfg.dense(count), dtype)]
  out_specs = [cfg.dense_spec()]
  programs = pl.cdiv(count, cfg.sg)
  if row_sum is not None:  # one term per row
    out_shape.append(jax.ShapeDtypeStruct((count,), jnp.float32))
    out_specs.append(pl.BlockSpec((cfg.sg,), lambda i: (i,)))
  name = "decompress_rows" if slots is not None else "decompress_many"
  out = pl.pallas_call(
      kernel, out_shape=[dispatch.typed_like(o, args) for o in out_shape],
      grid=(programs,), in_specs=in_specs, out_specs=out_specs,
      compiler_params=_compiler_params(cfg, interpret), interpret=interpret,
      name=f"dynamiq_units_{name}_p{cfg.plane_bits}")(*args)
  rows = out[0].reshape(count, B.SUPERGROUP)
  return (rows, out[1]) if row_sum is not None else rows


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret"))
def _launch_sum(payloads, widths, ptab, *, cfg, units, interpret):
  """One launch summing the decodes of all ``n`` payloads [n, bytes] in rank order
  (:func:`_decode_sum_kernel`) over ``cdiv(S, BLOCK)`` programs."""
  n, size = payloads.shape
  cfg = _pieces_for(cfg, jnp.float32)
  s_count = widths.shape[0]
  tab = jnp.asarray(cfg.table())
  whole = lambda k: pl.BlockSpec((k,), lambda i: (0,))
  dense_spec = cfg.dense_spec()
  args = [ptab, tab, widths, _u16_payload(payloads.reshape(-1))]
  in_specs = [whole(_PTAB), whole(tab.shape[0]), pl.BlockSpec((cfg.sg,), lambda i: (i,)),
              pl.BlockSpec(memory_space=pl.ANY)]
  kernel = functools.partial(_decode_sum_kernel, cfg=cfg, s_count=s_count, n=n,
                             payload_bytes=size, interpret=bool(interpret))
  out_shape = jax.ShapeDtypeStruct(cfg.dense(s_count), jnp.float32)
  out = pl.pallas_call(
      kernel, out_shape=dispatch.typed_like(out_shape, args), grid=(pl.cdiv(s_count, cfg.sg),),
      in_specs=in_specs, out_specs=dense_spec, compiler_params=_compiler_params(cfg, interpret),
      interpret=interpret, name=f"dynamiq_units_decompress_sum_p{cfg.plane_bits}")(*args)
  return out.reshape(s_count, B.SUPERGROUP)


def launch_config(op: str, launch=None, *, interpret: bool = False) -> tuple[int, int]:
  """``(block, num_warps)`` of a launch of ``op``: ``launch`` if given (checked), else
  :data:`TUNED`'s entry for the GPU the program is lowered for (the abstract
  mesh's device in context, else the first GPU), else ``(BLOCK, NUM_WARPS)``.

  Raises:
    ValueError: a ``launch`` that is not two positive ints, a block that is not a
      power of two, or fewer scale groups (``16 block``) than threads (``32
      num_warps``): each thread holds at least one whole group.
  """
  if launch is None:
    kind = None if interpret else dispatch.target_gpu()[0]
    return TUNED.get(kind, {}).get(op, (BLOCK, NUM_WARPS))
  try:
    block, warps = (int(v) for v in launch)
  except (TypeError, ValueError):
    raise ValueError(f"launch={launch!r}: give (block, num_warps), two ints") from None
  if block < 1 or block & (block - 1) or warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"launch={launch!r}: block must be a power of two and num_warps one of "
                     "1, 2, 4, 8, 16")
  if _G * block < 32 * warps:
    raise ValueError(f"launch={launch!r}: {_G * block} scale groups for {32 * warps} threads; "
                     f"use block >= {2 * warps} with {warps} warps")
  return block, warps


def _run(op, payload, x, widths, units, keys, rank, *, eps, strata, scale_rounding, plane_bits,
         width_set, interpret, fill=None, launch=None, ptab=None):
  """Validates (ValueError; NotImplementedError for what the kernels do not support,
  so that dispatch falls back to the reference), then launches ``op``
  (:func:`launch_config`), mapped over a ``vmap`` batch: a chunk's units are
  plane-major over its own super-groups, so batches do not merge into one chunk."""
  widths = jnp.asarray(widths).astype(jnp.int32)
  R.check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
                scale_rounding=scale_rounding, x=x, payload=payload)
  block, warps = launch_config(op, launch, interpret=bool(interpret))
  cfg = _Config(eps=B.level_key(eps),
                width_set=tuple(sorted(int(w) for w in width_set)), plane_bits=plane_bits,
                scale_rounding=scale_rounding, sg=block, num_warps=warps)
  if x is not None and x.dtype not in _SUPPORTED_DTYPES:
    raise NotImplementedError(f"x dtype {x.dtype} (kernels take float32, bfloat16, float16)")
  if widths.shape[0] == 0:
    raise NotImplementedError("an empty chunk (no super-groups)")
  if cfg.plane_bits == 2 and any(w % 2 for w in cfg.width_set):
    raise NotImplementedError(f"odd widths in width_set={cfg.width_set} with plane_bits=2")
  karr = rng.key_operand(keys, rank) if _KERNELS[op][3] else None
  launch = functools.partial(_launch, op=op, cfg=cfg, units=int(units), strata=strata,
                             interpret=interpret, fill=fill)
  return dispatch.map_over_batch(launch, payload, x, widths, karr,
                                 _plane_operand(ptab, widths, cfg.plane_bits, int(units)))


def _run_rows(op, payloads, widths, units, slots, mean, *, eps, plane_bits, width_set,
              interpret, launch=None, rotate=0, dtype=jnp.float32, ptab=None, row_sum=None):
  """:func:`_run` for the decodes of all ``n`` payloads at once (:func:`_launch_rows`,
  or their sum: :func:`_launch_sum`)."""
  widths = jnp.asarray(widths).astype(jnp.int32)
  R.check_payloads(payloads, widths, units, plane_bits=plane_bits, width_set=width_set,
                   slots=slots, mean=mean, rotate=rotate)
  block, warps = launch_config(op, launch, interpret=bool(interpret))
  cfg = _Config(eps=B.level_key(eps),
                width_set=tuple(sorted(int(w) for w in width_set)), plane_bits=plane_bits,
                scale_rounding="up", sg=block, num_warps=warps)
  if widths.shape[0] == 0 or payloads.shape[0] == 0 or (slots is not None
                                                        and slots.shape[0] == 0):
    raise NotImplementedError("an empty chunk (no super-groups, payloads or slots)")
  if payloads.size >= 2**31:
    raise NotImplementedError(f"{payloads.shape[0]} payloads of {payloads.shape[1]} bytes "
                              "(int32 byte offsets)")
  if cfg.plane_bits == 2 and any(w % 2 for w in cfg.width_set):
    raise NotImplementedError(f"odd widths in width_set={cfg.width_set} with plane_bits=2")
  ptab = _plane_operand(ptab, widths, cfg.plane_bits, int(units))
  if op == "decompress_sum":
    call = functools.partial(_launch_sum, cfg=cfg, units=int(units), interpret=interpret)
    return dispatch.map_over_batch(call, payloads, widths, ptab)
  call = functools.partial(_launch_rows, cfg=cfg, units=int(units), interpret=interpret,
                           rotate=int(rotate), dtype=jnp.dtype(dtype), row_sum=row_sum)
  return dispatch.map_over_batch(call, payloads, widths, slots, mean, ptab)


TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
"""Start of the DeprecationWarning that jax >= 0.11 raises at each Triton lowering."""


def quiet_triton_deprecation():
  """Ignores jax's Triton-deprecation DeprecationWarning, and only it.

  jax >= 0.11 warns at every lowering of a Triton ``pallas_call`` that the
  backend "will be removed". The kernels are Triton on purpose (Mosaic GPU
  cannot lower them yet, ``docs/mosaic_gpu.md``). The warning is raised
  when the caller's program is lowered, outside any frame of this package,
  so the filter goes in at the last frame of ours before that: by the
  warning's exact start and category, never other warnings. Installed again
  on each use because ``warnings.catch_warnings`` (pytest, user code)
  restores filters on exit; a program traced inside one such block and
  lowered after it can still show the warning.
  """
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def _triton_entry(kernel):
  """Decorates a kernel's entry point: a call that builds the Triton kernel
  (``interpret=False``) quiets jax's Triton deprecation
  (:func:`quiet_triton_deprecation`). The entry point runs on every trace of
  the caller's program, unlike the jitted launch below it, whose trace jax
  caches."""

  @functools.wraps(kernel)
  def entry(*args, interpret=False, **kwargs):
    if not interpret:
      quiet_triton_deprecation()
    return kernel(*args, interpret=interpret, **kwargs)

  return entry


@_triton_entry
def compress_pallas(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                    scale_rounding="up", plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                    interpret=False, fill=None, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.compress_reference`
  (the same arguments; ``fill``: see :func:`_launch`; ``launch``: ``(block,
  num_warps)``, :func:`launch_config`; ``ptab``: the widths' :func:`plane_table`, or
  None: computed from them)."""
  return _run("compress", None, x, widths, units, keys, rank, eps=eps, strata=strata,
              scale_rounding=scale_rounding, plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, fill=fill, launch=launch, ptab=ptab)


@_triton_entry
def decompress_pallas(payload, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                      width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_reference`."""
  return _run("decompress", payload, None, widths, units, None, None, eps=eps, strata=1,
              scale_rounding="up", plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, launch=launch, ptab=ptab)


@_triton_entry
def decompress_accumulate_pallas(payload, x, widths, units: int, *, eps,
                                 plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                                 interpret=False, launch=None, ptab=None):
  """Kernel version of ``decompress_reference(payload) + x``."""
  return _run("decompress_accumulate", payload, x, widths, units, None, None, eps=eps, strata=1,
              scale_rounding="up", plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, launch=launch, ptab=ptab)


@_triton_entry
def decompress_accumulate_recompress_pallas(payload, x, widths, units: int, *, eps, keys,
                                            rank=0, strata: int = 1, scale_rounding="up",
                                            plane_bits: int = R.PLANE_BITS,
                                            width_set=R.WIDTH_SET, interpret=False, fill=None,
                                            launch=None, ptab=None):
  """Kernel version of the fused ring hop
  (:func:`~pallas_kernels.dynamiq_reference.decompress_accumulate_recompress_reference`)."""
  return _run("decompress_accumulate_recompress", payload, x, widths, units, keys, rank,
              eps=eps, strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
              width_set=width_set, interpret=interpret, fill=fill, launch=launch, ptab=ptab)


@_triton_entry
def decompress_many_pallas(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                           width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_many_reference`:
  the ``n`` payloads [n, bytes] decoded by one launch, float32 [n, S, 256]."""
  out = _run_rows("decompress_many", payloads, widths, units, None, None, eps=eps,
                  plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                  launch=launch, ptab=ptab)
  return out.reshape(payloads.shape[0], -1, B.SUPERGROUP)


@_triton_entry
def decompress_rows_pallas(payloads, widths, units: int, slots, mean=None, *, eps,
                             plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                             rotate: int = 0, dtype=jnp.float32, interpret=False, launch=None,
                             ptab=None, row_sum=None):
  """Kernel version of
  :func:`~pallas_kernels.dynamiq_reference.decompress_rows_reference`: each output
  row decoded from its slot of the ``n`` payloads (plus its mean) by one launch, stored
  as ``dtype``; with ``row_sum``, also a term per row (each row's squares summed in the
  compiler's order: the last bits may differ from the reference's)."""
  return _run_rows("decompress_rows", payloads, widths, units, slots, mean, eps=eps,
                   plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                   launch=launch, rotate=rotate, dtype=dtype, ptab=ptab, row_sum=row_sum)


@_triton_entry
def decompress_sum_pallas(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                          width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_sum_reference`:
  the ``n`` payloads' decodes summed in rank order by one launch, float32 [S, 256]."""
  return _run_rows("decompress_sum", payloads, widths, units, None, None, eps=eps,
                   plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                   launch=launch, ptab=ptab)
