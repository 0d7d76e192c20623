"""Pallas kernels for the unit-packed DynamiQ chunk, and their dispatch.

The chunk layout is :mod:`pallas_kernels.dynamiq_units`'s (read its
docstring): ``S`` scale records of 18 bytes, then plane-major code units of
``32 * plane_bits`` bytes, each super-group at its own width (data, int32
``[S]``, widest first). Four operations, each one launch, as for the
per-class records (:mod:`pallas_kernels.dynamiq`):

=============================================  =======================================
``compress_units(x)``                          values -> chunk payload
``decompress_units(p)``                        chunk payload -> float32
``decompress_accumulate_units(p, x)``          ``decode(p) + x``
``decompress_accumulate_recompress_units``     ring hop ``encode(decode(p) + x)``;
                                               the sum stays in registers
=============================================  =======================================

Algorithm: the block arithmetic is the reference's own
(:func:`~pallas_kernels.dynamiq_units.encode_block_var`,
:func:`~pallas_kernels.dynamiq_units.decode_block_var`, on
:mod:`pallas_kernels.dynamiq_format`'s scales, draws and division-free
rounding; the per-width constants are a select chain over the static width
set), so kernel and reference agree bit for bit. Only the byte movement
differs.

Memory layout: one program handles :data:`BLOCK` super-groups. Dense
operands are viewed as ``[S, G, CB, P]`` with ``P = 8 / plane_bits`` codes
per plane byte and ``CB = 16 / P`` plane bytes per scale group, so byte ``g
CB + cb`` of a plane holds codes ``(g CB + cb) P + [0, P)``: a plane byte is
the plane's bits of the ``P`` codes along the last axis, packed and unpacked
without a reshape. With ``plane_bits=1`` the kernels load and store the two
halves ``[:, :, cb, :]`` apart (:func:`_load_dense`), so that one thread
holds a whole scale group.
The payload stays flat in global memory (``memory_space=ANY``): uint8 where
it is written, its uint16 view where it is read (:func:`_u16_payload`: one
16-bit load per plane and scale group, the group's two plane bytes); each
program loads / stores with computed offsets and masks: the 16 ``k_g`` bytes
and 2 unit bytes of each scale record, and for each plane ``p`` (up to the
widest of ``width_set``) its plane bytes at unit ``off_p + s`` where that
unit is below ``off_(p+1)`` (:func:`_plane_offsets`). A plane byte's 8 codes
and the plane bytes are bit transposes of each other (:func:`_codes_to_planes`).
The widths come in as a ``[BLOCK]`` block, the plane offsets as a small int32
input (``off_p``, then the units used, each at most ``units``). Compress
also zeroes the unused units ``[used, units)``: program ``i`` zeroes its own
static share of them, so every payload byte is written exactly once. The
concatenated level table (padded to a power of two) is a small input
gathered by level index.

``tests/test_gpu_compile_units.py`` compiles all eight kernels for sm_90a
from a CPU host and checks that ``ptxas`` spills nothing;
``tools/sass_count.py`` counts their SASS instructions
(``docs/results/kernels_sass.md``). Some operations have a GPU instruction
inlined (``_approx_log2``, ``_fma``, ``_floor_int``, ``_div_approx``,
``_mulhi``, ``_lt_mask``, ``_prmt``, ``_byte``, ``_pair16``); interpret mode
runs their jnp twins, which give the same codes (and the same sums: the
fused multiply-adds round products that are exact). Not yet run on a GPU.

Dispatch: :func:`pallas_kernels.dynamiq._dispatch`, the same as the
per-class kernels (``implementation=None``: the kernels in a lowering for
``cuda`` / ``rocm``, the reference elsewhere; ``"pallas"``: the kernels,
interpreted off GPU; ``"xla"``: the reference; a kernel raises
``NotImplementedError`` for input it does not support, and dispatch falls
back to the reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_format as F
from pallas_kernels import dynamiq_units as U

__all__ = [
    "compress_units",
    "decompress_units",
    "decompress_accumulate_units",
    "decompress_accumulate_recompress_units",
    "compress_units_pallas",
    "decompress_units_pallas",
    "decompress_accumulate_units_pallas",
    "decompress_accumulate_recompress_units_pallas",
]

BLOCK = 16
"""Super-groups per program: 32 coordinates per thread with 4 warps. Twice the
per-class kernels' :data:`pallas_kernels.dynamiq.BLOCK`: each thread's fixed
work (offsets, keys, table bases, the tail) is then shared by twice the
coordinates, for more registers per thread (fewer warps per SM); only a GPU
can weigh the two (``docs/results/kernels_sass.md``)."""

_G = F.HIER_GROUP  # scale groups per super-group
_PTAB = 16  # entries of the plane-offset input (off_p for p < 8, then the units used)
_TAIL_CHUNK = 64  # most unused units one store zeroes


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
  """Static description of a chunk's coding (hashable: a jit static argument)."""

  eps: tuple
  width_set: tuple
  plane_bits: int
  scale_rounding: str

  @functools.cached_property
  def tabs(self):
    return U._tables(dict(self.eps), self.width_set)

  def table(self) -> np.ndarray:
    """int32: the signed decode table's float32 bits (``_Tables.dec``), then
    (at :attr:`levels_at`) the encode's float32 levels (``_Tables.lev``),
    zero-padded to a power of two (Triton)."""
    t = np.concatenate([self.tabs.dec, self.tabs.lev]).view(np.int32)
    return np.pad(t, (0, pl.next_power_of_2(t.size) - t.size))

  @property
  def levels_at(self) -> int:
    return self.tabs.dec.size

  @property
  def per(self) -> int:  # codes per plane byte
    return 8 // self.plane_bits

  @property
  def cb(self) -> int:  # plane bytes per scale group
    return _G // self.per

  @property
  def unit_bytes(self) -> int:
    return U.unit_bytes(self.plane_bits)

  @property
  def planes(self) -> int:  # planes of the widest code of the width set
    return max(self.width_set) // self.plane_bits

  def block(self, supergroups: int) -> tuple[int, int, int, int]:
    return (supergroups, _G, self.cb, self.per)

  @property
  def split(self) -> bool:
    """Whether the kernels hold a block as its ``CB = 2`` halves ``[BLOCK, G, P]``
    (``plane_bits=1``; see :func:`_load_dense`)."""
    return self.plane_bits == 1


def _config(eps, width_set, plane_bits, scale_rounding) -> _Config:
  if plane_bits not in (1, 2):
    raise ValueError(f"{plane_bits=} must be 1 or 2")
  width_set = tuple(sorted(int(w) for w in width_set))
  if not width_set or min(width_set) < 2 or max(width_set) > 8:
    raise ValueError(f"{width_set=} must be a non-empty subset of 2..8")
  if scale_rounding not in ("up", "stochastic"):
    raise ValueError(f"{scale_rounding=} must be 'up' or 'stochastic'")
  eps = tuple(sorted((int(w), float(e)) for w, e in dict(eps).items()))
  return _Config(eps=eps, width_set=width_set, plane_bits=plane_bits,
                 scale_rounding=scale_rounding)


# ----------------------------------------------------------------------------
# Kernel bodies.


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _asm(text: str, constraints: str, dtype, *args):
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


def _scale_offsets(s_count: int, one=1):
  """Offsets of this program's scale records: k bytes [BLOCK, G], unit [BLOCK], masks."""
  block = BLOCK
  base = pl.program_id(0) * block
  sg2 = base + _iota((block, _G), 0)
  sg1 = base + _iota((block,), 0)
  return (sg2 * U.SCALE_BYTES + _iota((block, _G), 1) * one, sg2 < s_count,
          sg1 * U.SCALE_BYTES + _G, sg1 < s_count)


def _hidden_one(ptab_ref, cfg: _Config):
  """1, as a value the compiler cannot see (``off_0 = 0 >= 0``) when :attr:`_Config.split`.

  A group's ``k`` byte is one per thread there; with offsets it can see are
  contiguous, Triton would give each thread two neighbouring bytes and
  convert the layout through shared memory."""
  return (ptab_ref[0] >= 0).astype(jnp.int32) if cfg.split else 1


def _plane_offsets(cfg: _Config, ptab_ref, s_count: int, words: bool = False):
  """Per plane p: (byte offsets [BLOCK, G, CB] of this program's plane-p bytes, mask);
  ``words``: offsets [BLOCK, G] of each group's 16-bit word of plane bytes
  (``plane_bits=1``: one byte per half) in the payload's uint16 view.

  Plane p of super-group ``sg`` is unit ``off_p + sg`` where ``sg < count_p``,
  i.e. where that unit is below ``off_(p+1)`` (one comparison: with widths
  widest first these are the super-groups that have plane p, and the
  program's tail past ``s_count`` is excluded too, as ``count_p <= s_count``).
  :func:`_plane_table` clamps the offsets to the payload's units, so that no
  widths, valid or not, reach outside it."""
  block = BLOCK
  shape = (block, _G) if words else (block, _G, cfg.cb)
  sg = pl.program_id(0) * block + _iota(shape, 0)
  byte = _iota(shape, 1) * cfg.cb + (0 if words else _iota(shape, 2))
  div = 2 if words else 1  # (plane_bits=1: the bytes g CB, CB = 2, are even)
  out = []
  for p in range(cfg.planes):
    unit = ptab_ref[p] + sg
    out.append((s_count * (U.SCALE_BYTES // div) + unit * (cfg.unit_bytes // div) + byte // div,
                unit < ptab_ref[p + 1]))
  return out


def _keys(keys_ref):
  return (keys_ref[0], keys_ref[1], keys_ref[2], keys_ref[3]), keys_ref[4].astype(jnp.int32)


def _load_dense(ref, cfg: _Config):
  """A dense block ``[BLOCK, G, CB, P]`` as float32: whole, or as the tuple of
  its halves ``ref[:, :, c, :]`` when :attr:`_Config.split`.

  Loaded whole, Triton gives each thread 8 consecutive values (one 16-byte
  access), so a scale group spans two threads: both find its maximum (a
  shuffle) and its scale, and its two plane bytes (held by two threads) reach
  their 16-bit store through shared memory. As two halves of the same layout,
  one thread holds the whole group: its scale is found once per group, and
  its plane bytes are one 16-bit access without a layout conversion."""
  if not cfg.split:
    return ref[...].astype(jnp.float32)
  return tuple(ref[:, :, c, :].astype(jnp.float32) for c in range(cfg.cb))


def _store_dense(ref, v, cfg: _Config):
  """Stores float32 ``v`` (as :func:`_load_dense` gives) into a dense block."""
  if not cfg.split:
    ref[...] = v
    return
  for c, half in enumerate(v):
    ref[:, :, c, :] = half


# ----------------------------------------------------------------------------
# Plane bytes <-> codes of one plane byte (8 codes, plane_bits=1), by bit
# transposition: the 8 codes of up to 8 bits are an 8 x 8 bit matrix (code i,
# bit p), the plane bytes its transpose (plane p, bit i). Held as words with
# byte i = code i (two words: codes 0-3, 4-7), the transpose is three
# exchanges of index bits (Hacker's Delight's transpose8): index bits 0 <-> 3
# and 1 <-> 4 within each word (one delta swap each), 2 <-> 5 between the two
# words (a nibble exchange). Codes of at most 4 bits fit one word, code i at
# bit 8 (i % 4) + 4 (i // 4): its two swaps alone give byte p = plane p. Both
# maps are involutions, so decode applies the same steps to the plane bytes.
# About 2 instructions per code each way (a mask, multiply and shift per
# plane and 4 codes before).


_SWAP_03, _SWAP_14 = (7, 0x00AA00AA), (14, 0x0000CCCC)


def _delta_swap(x, d: int, mask: int):
  """Exchanges the bits of ``x`` at ``mask`` with those ``d`` above them."""
  t = (x ^ (x >> np.uint32(d))) & np.uint32(mask)
  return x ^ t ^ (t << np.uint32(d))


def _swaps(x):
  return _delta_swap(_delta_swap(x, *_SWAP_03), *_SWAP_14)


def _nibble_exchange(lo, hi):
  """Index bit 2 <-> 5 of the 64-bit word ``(lo, hi)``: lo's high nibbles with hi's low ones."""
  return ((lo & np.uint32(0x0F0F0F0F)) | ((hi << np.uint32(4)) & np.uint32(0xF0F0F0F0)),
          ((lo >> np.uint32(4)) & np.uint32(0x0F0F0F0F)) | (hi & np.uint32(0xF0F0F0F0)))


def _codes_to_planes(codes, planes: int):
  """uint32 codes [..., 8] (below 2^planes) -> ``planes`` plane bytes, uint32 [...] each."""
  lane = jax.lax.broadcasted_iota(jnp.uint32, codes.shape, codes.ndim - 1)
  if planes <= 4:
    w = _swaps(jnp.sum(codes << (lane % 4 * 8 + lane // 4 * 4), axis=-1))
    return [(w >> np.uint32(8 * p)) & np.uint32(0xFF) for p in range(planes)]
  lo, hi = (jnp.sum(jnp.where(lane // 4 == h, codes << (lane % 4 * 8), np.uint32(0)), axis=-1)
            for h in range(2))
  if planes == 5:  # planes 0-3 from the low nibbles, plane 4 by one multiply (_PLANE4)
    w = _swaps(_nibble_exchange(lo, hi)[0])
    top = ((((lo >> np.uint32(4)) & np.uint32(0x01010101)) | (hi & np.uint32(0x10101010)))
           * np.uint32(_PLANE4)) >> np.uint32(21)
    return [(w >> np.uint32(8 * p)) & np.uint32(0xFF) for p in range(4)] + [
        top & np.uint32(0xFF)]
  words = _nibble_exchange(_swaps(lo), _swaps(hi))
  return [(words[p // 4] >> np.uint32(8 * (p % 4))) & np.uint32(0xFF) for p in range(planes)]


# Bit 4 of the codes: at bits 8 k of (lo >> 4) for code k < 4, at 8 k + 4 of hi
# for code 4 + k. Times 2^0 + 2^7 + 2^14 + 2^21 every partial product lands on
# its own bit (8 k + 7 m, 8 k + 4 + 7 m; no carries), code i's at bit 21 + i.
# Its inverse spreads a nibble's bits i to bits 8 i (n * _PLANE4 & 0x01010101:
# partial products at i + 7 m, all distinct for i < 4, multiples of 8 only for
# m = i).
_PLANE4 = 0x00204081


def _planes_to_codes(words, lane, planes: int, interpret: bool):
  """Inverse of :func:`_codes_to_planes`: ``words[h]`` (uint32 [...]) holds planes
  ``4 h + [0, 4)`` (byte p % 4 = plane p, zero past ``planes``) -> codes uint32
  [..., 8]; ``lane`` the codes' iota along the last axis. Code i is then
  byte i % 4 of the codes' word lo (i < 4) or hi, one ``prmt`` each."""
  if planes <= 5:
    w = _swaps(words[0])
    lo, hi = w & np.uint32(0x0F0F0F0F), (w >> np.uint32(4)) & np.uint32(0x0F0F0F0F)
    if planes == 5:  # plane 4's bits i to bit 4 of byte i % 4 of lo (i < 4) or hi
      b4 = words[1]
      lo = lo | (((b4 & np.uint32(0xF)) * np.uint32(_PLANE4 << 4)) & np.uint32(0x10101010))
      hi = hi | (((b4 >> np.uint32(4)) * np.uint32(_PLANE4 << 4)) & np.uint32(0x10101010))
  else:
    lo, hi = _nibble_exchange(_swaps(words[0]), _swaps(words[1]))
  w = jnp.where(lane < 4, lo[..., None], hi[..., None])
  return _byte(w, lane % 4, interpret)


def _byte(w, i, interpret: bool):
  """Byte ``i`` (uint32 array of 0..3, constant per element) of ``w``, zero-extended:
  one ``prmt`` (selector ``0x444i``: byte i, then zero bytes)."""
  if interpret:
    return (w >> (i * 8)) & np.uint32(0xFF)
  return _asm("prmt.b32 $0, $1, 0, $2;", "=r,r,r", jnp.uint32, w, i | np.uint32(0x4440))


def _u16_payload(payload):
  """The payload (even length) as uint16 words, little-endian: the decoding
  kernels' view of it (one 16-bit load per plane and group, one per unit)."""
  return jax.lax.bitcast_convert_type(payload.reshape(-1, 2), jnp.uint16)


def _load_u16(ref16, byte_off, ok):
  """uint32 [..]: the 16-bit words at even byte offsets (0 where masked)."""
  return K._load_bytes(ref16, byte_off >> 1, ok).astype(jnp.uint32)


def _load_u8(ref16, byte_off, ok):
  """uint32 [..]: the bytes at any byte offsets, from their 16-bit words."""
  return (_load_u16(ref16, byte_off, ok) >> ((byte_off & 1) * 8).astype(jnp.uint32)) & 0xFF


def _read_chunk(pay16_ref, widths, ptab_ref, tab_ref, *, cfg: _Config, s_count: int,
                units: int, interpret: bool, addend=None):
  """Loads this program's scale records and planes (``pay16_ref``: the payload as
  uint16 words, :func:`_u16_payload`); decodes: float32 [BLOCK, G, CB, P],
  or its two halves [BLOCK, G, P] when :attr:`_Config.split`. ``addend`` (as
  :func:`_load_dense` gives): returns ``decode + addend``, each sum one
  ``fma.rn.f32`` on a GPU (:func:`~pallas_kernels.dynamiq_units.decode_block_var`)."""
  dec = functools.partial(U.decode_block_var, fma=U._fma if interpret else _fma)
  k_off, k_ok, u_off, u_ok = _scale_offsets(s_count, _hidden_one(ptab_ref, cfg))
  k = _load_u8(pay16_ref, k_off, k_ok)
  unit = jax.lax.bitcast_convert_type(_load_u16(pay16_ref, u_off, u_ok) << np.uint32(16),
                                      jnp.float32)
  shape = cfg.block(BLOCK)
  lookup = lambda j: jax.lax.bitcast_convert_type(tab_ref[j], jnp.float32)
  scale = F.hier_scale(k, unit)
  if cfg.split:
    # Per plane one 16-bit word per group: its byte c is half c's plane byte.
    # Four planes' words make two words per half (byte p = plane p), which
    # are transposed to the codes (:func:`_planes_to_codes`).
    half_shape = (shape[0], shape[1], shape[3])
    lane = jax.lax.broadcasted_iota(jnp.uint32, half_shape, 2)
    pw = [K._load_bytes(pay16_ref, off, ok) for off, ok in  # uint16
          _plane_offsets(cfg, ptab_ref, s_count, words=True)]
    pw += [None] * (-len(pw) % 4)
    halves = [[], []]
    for q in range(0, len(pw), 4):  # planes q..q+3
      a = _pair16(pw[q], pw[q + 1], interpret)
      b = _pair16(pw[q + 2], pw[q + 3], interpret)
      halves[0].append(_prmt(a, b, 0x6420, interpret))
      halves[1].append(_prmt(a, b, 0x7531, interpret))
    return tuple(dec(_planes_to_codes(halves[c], lane, cfg.planes, interpret), scale, widths,
                     cfg.tabs,
                     lookup=lookup, addend=None if addend is None else addend[c])
                 for c in range(cfg.cb))
  lane = jax.lax.broadcasted_iota(jnp.uint32, shape, 3)
  shifts = lane * np.uint32(cfg.plane_bits)
  mask = np.uint32((1 << cfg.plane_bits) - 1)
  codes = jnp.zeros(shape, jnp.uint32)
  for p, (off, ok) in enumerate(_plane_offsets(cfg, ptab_ref, s_count)):
    b = _load_u8(pay16_ref, off, ok)[..., None]
    codes = codes | (((b >> shifts) & mask) << np.uint32(cfg.plane_bits * p))
  return dec(codes, scale, widths, cfg.tabs, lookup=lookup, addend=addend)


def _pair16(lo, hi, interpret: bool):
  """``lo | hi << 16`` (uint32) of two uint16 words (None: zero): one ``mov.b32``
  of the two 16-bit registers (a ``prmt``; no zero extensions)."""
  if lo is None and hi is None:
    return None
  if lo is None or hi is None:
    return (lo.astype(jnp.uint32) if hi is None else hi.astype(jnp.uint32) << np.uint32(16))
  if interpret:
    return lo.astype(jnp.uint32) | (hi.astype(jnp.uint32) << np.uint32(16))
  lo, hi = (jax.lax.bitcast_convert_type(v, jnp.int16) for v in (lo, hi))
  return _asm("mov.b32 $0, {$1, $2};", "=r,h,h", jnp.uint32, lo, hi)


def _prmt(a, b, sel: int, interpret: bool):
  """The bytes of ``(a, b)`` (bytes 0-3 of a, 4-7 of b) chosen by the four
  nibbles of ``sel`` (low nibble: byte 0): the GPU's ``prmt.b32``, one
  instruction."""
  if b is None:
    b = jnp.zeros_like(a)
  if interpret:
    out = jnp.zeros_like(a)
    for i in range(4):
      src = (sel >> (4 * i)) & 7
      byte = ((a if src < 4 else b) >> np.uint32(8 * (src % 4))) & np.uint32(0xFF)
      out = out | (byte << np.uint32(8 * i))
    return out
  return _asm(f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r", jnp.uint32, a, b)


def _approx_log2(v):
  """float32 base-2 log by the GPU's ``lg2.approx.ftz.f32`` (one MUFU instruction;
  absolute error below 2^-22 for the arguments >= 1/2 it gets here). ``.ftz``:
  without it ptxas wraps the MUFU in a subnormal test, a scaling and a
  correction (4 instructions); the argument here is at least ``k`` (about
  0.97), never subnormal, so flushing changes nothing."""
  return _asm("lg2.approx.ftz.f32 $0, $1;", "=f,f", jnp.float32, v)


def _mulhi(v, n: int):
  """:func:`pallas_kernels.rng.mulhi` by the GPU's ``mul.hi.u32`` (one instruction)."""
  return _asm(f"mul.hi.u32 $0, $1, {int(n)};", "=r,r", jnp.uint32, v)


def _floor_int(v):
  """:func:`pallas_kernels.dynamiq_units._floor_int` by the GPU's ``cvt.rmi.s32.f32``."""
  return _asm("cvt.rmi.s32.f32 $0, $1;", "=r,f", jnp.int32, v)


def _div_approx(a, b):
  """``a / b`` by the GPU's ``div.approx.ftz.f32`` (a reciprocal and a multiply;
  2 ulp for ``|b|`` in [2^-126, 2^126]), for first guesses only: ``div.full.f32``
  (Triton's ``/``) adds range tests and scalings around them."""
  return _asm("div.approx.ftz.f32 $0, $1, $2;", "=f,f,f", jnp.float32, a, b)


def _lt_mask(a, b):
  """:func:`pallas_kernels.dynamiq_units._lt_mask` as the sign of ``a - b``
  (``sub.rn.f32``, ``shr.s32``): the same mask for every input (the difference
  of two distinct floats is never zero with subnormals kept, a NaN is not
  negative on a GPU), and no predicate for ``ptxas`` to keep alive."""
  return _asm("{ .reg .b32 t; sub.rn.f32 t, $1, $2; shr.s32 $0, t, 31; }", "=r,f,f",
              jnp.int32, a, b)


def _frac_mul(w, d):
  """:func:`pallas_kernels.dynamiq_units._frac_mul` as one ``fma.rn.f32``: ``w d + d``
  rounded once is ``(w + 1) d`` rounded once."""
  return _fma(w, d, d)


def _fma(a, b, c):
  """``a b + c`` by the GPU's ``fma.rn.f32``: the level's first guess, the decode's
  ``level scale + x`` and the rounding decision's ``(w + 1) d``."""
  return _asm("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", jnp.float32, a, b, c)


def _write_chunk(out_ref, x, widths, keys_ref, ptab_ref, tab_ref, *, cfg: _Config,
                 s_count: int, units: int, strata: int, interpret: bool, hop: bool = False):
  """Encodes float32 [BLOCK, G, CB, P] (or its halves, :func:`_load_dense`);
  stores its scale records, planes and its share of the unused units (zeros).
  ``hop``: the DAR kernel (the k bytes' offsets hidden, :func:`_hidden_one`)."""
  block = BLOCK
  shape = cfg.block(BLOCK)
  group_idx = ((pl.program_id(0) * block + _iota(shape[:2], 0)) * _G
               + _iota(shape[:2], 1)).astype(jnp.uint32)
  if cfg.split:  # halves [BLOCK, G, P]: half c holds the group's codes c P + [0, P)
    half_shape = (shape[0], shape[1], shape[3])
    p_iota = _iota(half_shape, 2)
    idx = tuple((group_idx[..., None] * _G + c * shape[3] + p_iota).astype(jnp.uint32)
                for c in range(cfg.cb))
    # the draws' group (idx >> 4) is the scale group, held by one thread: one
    # hash per key for both halves; lanes idx & 15 = c P + p, static
    draw_group = (group_idx[..., None],) * cfg.cb
    lane = tuple((p_iota + c * shape[3]).astype(jnp.uint32) for c in range(cfg.cb))
  else:
    idx = ((pl.program_id(0) * block + _iota(shape, 0)) * F.SUPERGROUP + _iota(shape, 1) * _G
           + _iota(shape, 2) * shape[3] + _iota(shape, 3)).astype(jnp.uint32)
    # the draws' group (idx >> 4) is the scale group; each code's lane (idx & 15)
    # is its static position in the group
    draw_group = group_idx[..., None, None]
    lane = (_iota(shape, 2) * shape[3] + _iota(shape, 3)).astype(jnp.uint32)
  keys, rank = _keys(keys_ref)
  codes, k, unit = U.encode_block_var(x, widths, cfg.tabs, pairs=None,
                                      idx=idx,
                                      keys=keys, rank=rank, strata=strata,
                                      scale_rounding=cfg.scale_rounding,
                                      log2=jnp.log2 if interpret else _approx_log2,
                                      group_idx=group_idx, draw_group=draw_group, lane=lane,
                                      mulhi=F.rng.mulhi if interpret else _mulhi,
                                      floor_int=U._floor_int if interpret else _floor_int,
                                      fma=U._fma if interpret else _fma,
                                      lt_mask=U._lt_mask if interpret else _lt_mask,
                                      frac_mul=U._frac_mul if interpret else _frac_mul,
                                      div=None if interpret else _div_approx,
                                      levels=lambda j: jax.lax.bitcast_convert_type(
                                          tab_ref[cfg.levels_at + j], jnp.float32))
  # hidden in the hop (DAR -1.1 / -5.7 at 4 / 5 bits), not in compress (+0.9 there)
  one = _hidden_one(ptab_ref, cfg) if hop else 1
  k_off, k_ok, _, _ = _scale_offsets(s_count, one)
  K._store_bytes(out_ref, k_off, k, k_ok)
  # The unit from the thread of each super-group's group 0, in the groups'
  # layout: stored from the per-super-group vector, Triton would first move it
  # to another layout through shared memory (three barriers). The other
  # groups' (masked) offsets are their own k bytes, already written: interpret
  # mode's masked store rewrites what is there, and must not race the unit's.
  bits = jnp.broadcast_to((jax.lax.bitcast_convert_type(unit, jnp.uint32) >> 16)[:, None],
                          k_off.shape)
  first = _iota(k_off.shape, 1) == 0
  u_ok = k_ok & first
  for i in range(2):  # sg 18 + 16 + i
    K._store_bytes(out_ref, k_off + first.astype(jnp.int32) * (_G + i),
                   ((bits >> (8 * i)) & 0xFF).astype(jnp.uint8), u_ok)
  if cfg.split:  # 1-bit planes: bit transposition of each half's 8 codes
    half_planes = [_codes_to_planes(c, cfg.planes) for c in codes]
  else:
    # 2-bit planes: the 4 codes of a plane byte in one uint32 word (a byte
    # each); a plane's fields at bits 0, 8, 16, 24 times 0x01041040 land at
    # bits 24..31 (partial products at distinct bits, so no carries).
    lane = jax.lax.broadcasted_iota(jnp.uint32, codes.shape, codes.ndim - 1)
    word = jnp.sum(codes << (lane * np.uint32(8)), axis=-1)
  for p, (off, ok) in enumerate(_plane_offsets(cfg, ptab_ref, s_count)):
    if cfg.split:  # one plane byte per half, stored together (16 bits)
      byte = jax.lax.stack([h[p] for h in half_planes], axis=2)
    else:
      byte = ((((word >> np.uint32(2 * p)) & np.uint32(0x03030303))
               * np.uint32(0x01041040)) >> np.uint32(24))
    K._store_bytes(out_ref, off, byte.astype(jnp.uint8), ok)
  # Unused units [used, units): program i zeroes [used + i T, used + (i + 1) T).
  share, chunk = _tail_share(units, pl.cdiv(s_count, block))
  if share:
    used = ptab_ref[_PTAB - 1]
    rows = _iota((chunk, cfg.unit_bytes), 0)
    cols = _iota((chunk, cfg.unit_bytes), 1)
    zeros = jnp.zeros((chunk, cfg.unit_bytes), jnp.uint8)
    for c in range(0, share, chunk):
      unit_i = used + pl.program_id(0) * share + c + rows
      K._store_bytes(out_ref, s_count * U.SCALE_BYTES + unit_i * cfg.unit_bytes + cols, zeros,
                     unit_i < units)


def _tail_share(units: int, programs: int) -> tuple[int, int]:
  """(unused units each program zeroes, units per store): static, covering ``units``."""
  if units == 0:
    return 0, 0
  chunk = min(pl.next_power_of_2(pl.cdiv(units, programs)), _TAIL_CHUNK)
  return pl.cdiv(pl.cdiv(units, programs), chunk) * chunk, chunk


def _compress_kernel(keys_ref, ptab_ref, tab_ref, w_ref, x_ref, out_ref, *, cfg, s_count, units,
                     strata, interpret):
  _write_chunk(out_ref, _load_dense(x_ref, cfg), w_ref[...], keys_ref, ptab_ref, tab_ref,
               cfg=cfg, s_count=s_count, units=units, strata=strata, interpret=interpret)


def _decompress_kernel(ptab_ref, tab_ref, w_ref, pay_ref, out_ref, *, cfg, s_count, units,
                       interpret):
  _store_dense(out_ref, _read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, units=units, interpret=interpret), cfg)


def _decompress_accumulate_kernel(ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg,
                                  s_count, units, interpret):
  _store_dense(out_ref, _read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, units=units,
                                    addend=_load_dense(x_ref, cfg), interpret=interpret), cfg)


def _dar_kernel(keys_ref, ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg, s_count,
                units, strata, interpret):
  widths = w_ref[...]
  acc = _read_chunk(pay_ref, widths, ptab_ref, tab_ref, cfg=cfg, s_count=s_count, units=units,
                    addend=_load_dense(x_ref, cfg), interpret=interpret)
  _write_chunk(out_ref, acc, widths, keys_ref, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
               units=units, strata=strata, interpret=interpret, hop=True)


# ----------------------------------------------------------------------------
# pallas_call wrappers (one launch each).


def _plane_table(widths, plane_bits: int, units: int):
  """int32 [16]: ``off_p`` (first unit of plane p) for p < 8, the units used after
  (``off_(p+1)`` ends plane p), each at most ``units``."""
  planes = 8 // plane_bits
  counts = jnp.sum((widths[None, :] // plane_bits
                    > jnp.arange(planes, dtype=jnp.int32)[:, None]).astype(jnp.int32), axis=1)
  ends = jnp.cumsum(counts)
  offs = ends - counts
  table = jnp.concatenate([offs, jnp.broadcast_to(ends[-1], (_PTAB - planes,))])
  return jnp.minimum(table, units).astype(jnp.int32)


def _payload_call(kernel, cfg, s_count, units, in_specs, interpret, name, fill, *args):
  """A launch writing a payload; ``fill`` (tests only) is the payload buffer's
  initial byte (None: uninitialized), to check that every byte is written."""
  out_shape = jax.ShapeDtypeStruct((U.payload_bytes(s_count, units, cfg.plane_bits),), jnp.uint8)
  if fill is None:
    return K._call(kernel, cfg, s_count, in_specs, out_shape, K._ANY, interpret, name, *args,
                   block=BLOCK)
  n = len(args)
  buf = jnp.full(out_shape.shape, fill, jnp.uint8)
  return pl.pallas_call(
      lambda *refs: kernel(*refs[:n], refs[-1]), out_shape=K._typed_like(out_shape, args),
      grid=(pl.cdiv(s_count, BLOCK),), in_specs=in_specs + [K._ANY], out_specs=K._ANY,
      input_output_aliases={n: 0}, compiler_params=K._compiler_params(interpret),
      interpret=interpret, name=name)(*args, buf)


def _dense_spec(cfg):
  return pl.BlockSpec(cfg.block(BLOCK), lambda i: (i, 0, 0, 0))


def _widths_spec():
  return pl.BlockSpec((BLOCK,), lambda i: (i,))


def _name(op, cfg):
  return f"dynamiq_units_{op}_p{cfg.plane_bits}"


@functools.partial(jax.jit, static_argnames=("cfg", "units", "strata", "interpret", "fill"))
def _compress_call(x, widths, karr, *, cfg, units, strata, interpret, fill=None):
  s_count = x.shape[0]
  tab = jnp.asarray(cfg.table())
  kernel = functools.partial(_compress_kernel, cfg=cfg, s_count=s_count, units=units,
                             strata=strata, interpret=bool(interpret))
  return _payload_call(kernel, cfg, s_count, units,
                       [K._whole(8), K._whole(_PTAB), K._whole(tab.shape[0]), _widths_spec(),
                        _dense_spec(cfg)],
                       interpret, _name("compress", cfg), fill,
                       karr, _plane_table(widths, cfg.plane_bits, units), tab, widths,
                       x.reshape(cfg.block(s_count)))


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret"))
def _decompress_call(payload, widths, *, cfg, units, interpret):
  s_count = widths.shape[0]
  tab = jnp.asarray(cfg.table())
  kernel = functools.partial(_decompress_kernel, cfg=cfg, s_count=s_count, units=units,
                             interpret=bool(interpret))
  out = K._call(kernel, cfg, s_count,
                [K._whole(_PTAB), K._whole(tab.shape[0]), _widths_spec(), K._ANY],
                jax.ShapeDtypeStruct(cfg.block(s_count), jnp.float32), _dense_spec(cfg),
                interpret, _name("decompress", cfg),
                _plane_table(widths, cfg.plane_bits, units), tab, widths, _u16_payload(payload),
                block=BLOCK)
  return out.reshape(s_count, F.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret"))
def _decompress_accumulate_call(payload, x, widths, *, cfg, units, interpret):
  s_count = widths.shape[0]
  tab = jnp.asarray(cfg.table())
  kernel = functools.partial(_decompress_accumulate_kernel, cfg=cfg, s_count=s_count,
                             units=units, interpret=bool(interpret))
  out = K._call(kernel, cfg, s_count,
                [K._whole(_PTAB), K._whole(tab.shape[0]), _widths_spec(), K._ANY,
                 _dense_spec(cfg)],
                jax.ShapeDtypeStruct(cfg.block(s_count), jnp.float32), _dense_spec(cfg),
                interpret, _name("decompress_accumulate", cfg),
                _plane_table(widths, cfg.plane_bits, units), tab, widths, _u16_payload(payload),
                x.reshape(cfg.block(s_count)), block=BLOCK)
  return out.reshape(s_count, F.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("cfg", "units", "strata", "interpret", "fill"))
def _dar_call(payload, x, widths, karr, *, cfg, units, strata, interpret, fill=None):
  s_count = widths.shape[0]
  tab = jnp.asarray(cfg.table())
  kernel = functools.partial(_dar_kernel, cfg=cfg, s_count=s_count, units=units, strata=strata,
                             interpret=bool(interpret))
  return _payload_call(kernel, cfg, s_count, units,
                       [K._whole(8), K._whole(_PTAB), K._whole(tab.shape[0]), _widths_spec(),
                        K._ANY, _dense_spec(cfg)],
                       interpret, _name("decompress_accumulate_recompress", cfg), fill,
                       karr, _plane_table(widths, cfg.plane_bits, units), tab, widths,
                       _u16_payload(payload),
                       x.reshape(cfg.block(s_count)))


def _check(cfg: _Config, units, widths, x=None, payload=None):
  """Validates operands (ValueError), or raises NotImplementedError for what the
  kernels do not support (dispatch then falls back to the reference)."""
  if not isinstance(units, (int, np.integer)) or units < 0:
    raise ValueError(f"{units=} must be a static non-negative int")
  if widths.ndim != 1 or not jnp.issubdtype(widths.dtype, jnp.integer):
    raise ValueError(f"widths {widths.dtype}{list(widths.shape)} must be int32 [supergroups]")
  s_count = widths.shape[0]
  if x is not None:
    if x.shape != (s_count, F.SUPERGROUP):
      raise ValueError(f"x.shape={x.shape} must be [{s_count}, {F.SUPERGROUP}] (widths: "
                       f"{s_count} super-groups)")
    if x.dtype not in K._SUPPORTED_DTYPES:
      raise NotImplementedError(f"x dtype {x.dtype} (kernels take float32, bfloat16, float16)")
  if payload is not None:
    size = U.payload_bytes(s_count, units, cfg.plane_bits)
    if payload.shape != (size,) or payload.dtype != jnp.uint8:
      raise ValueError(f"payload {payload.dtype}{list(payload.shape)} must be uint8 [{size}] "
                       f"(payload_bytes({s_count}, {units}, {cfg.plane_bits}))")
  if s_count == 0:
    raise NotImplementedError("an empty chunk (no super-groups)")
  if cfg.plane_bits == 2 and any(w % 2 for w in cfg.width_set):
    raise NotImplementedError(f"odd widths in width_set={cfg.width_set} with plane_bits=2")


def _widths(widths):
  return jnp.asarray(widths).astype(jnp.int32)


# vmap: every operation maps over the batch (dynamiq.py's _map_batch_rule):
# a chunk's units are plane-major over its own super-groups, so batches do
# not merge into one chunk.


@K._triton_entry
def compress_units_pallas(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                          scale_rounding="up", plane_bits: int = U.PLANE_BITS,
                          width_set=U.WIDTH_SET, interpret=False):
  """Kernel version of :func:`~pallas_kernels.dynamiq_units.compress_units_reference`."""
  cfg = _config(eps, width_set, plane_bits, scale_rounding)
  widths = _widths(widths)
  _check(cfg, units, widths, x=x)

  @jax.custom_batching.custom_vmap
  def op(x, widths, karr):
    return _compress_call(x, widths, karr, cfg=cfg, units=int(units), strata=strata,
                          interpret=interpret)

  op.def_vmap(K._map_batch_rule(op))
  return op(x, widths, K._keys_array(keys, rank))


@K._triton_entry
def decompress_units_pallas(payload, widths, units: int, *, eps, plane_bits: int = U.PLANE_BITS,
                            width_set=U.WIDTH_SET, interpret=False):
  """Kernel version of :func:`~pallas_kernels.dynamiq_units.decompress_units_reference`."""
  cfg = _config(eps, width_set, plane_bits, "up")
  widths = _widths(widths)
  _check(cfg, units, widths, payload=payload)

  @jax.custom_batching.custom_vmap
  def op(payload, widths):
    return _decompress_call(payload, widths, cfg=cfg, units=int(units), interpret=interpret)

  op.def_vmap(K._map_batch_rule(op))
  return op(payload, widths)


@K._triton_entry
def decompress_accumulate_units_pallas(payload, x, widths, units: int, *, eps,
                                       plane_bits: int = U.PLANE_BITS, width_set=U.WIDTH_SET,
                                       interpret=False):
  """Kernel version of ``decompress_units_reference(payload) + x``."""
  cfg = _config(eps, width_set, plane_bits, "up")
  widths = _widths(widths)
  _check(cfg, units, widths, x=x, payload=payload)

  @jax.custom_batching.custom_vmap
  def op(payload, x, widths):
    return _decompress_accumulate_call(payload, x, widths, cfg=cfg, units=int(units),
                                       interpret=interpret)

  op.def_vmap(K._map_batch_rule(op))
  return op(payload, x, widths)


@K._triton_entry
def decompress_accumulate_recompress_units_pallas(payload, x, widths, units: int, *, eps, keys,
                                                  rank=0, strata: int = 1, scale_rounding="up",
                                                  plane_bits: int = U.PLANE_BITS,
                                                  width_set=U.WIDTH_SET, interpret=False):
  """Kernel version of the fused ring hop
  (:func:`~pallas_kernels.dynamiq_units.decompress_accumulate_recompress_units_reference`)."""
  cfg = _config(eps, width_set, plane_bits, scale_rounding)
  widths = _widths(widths)
  _check(cfg, units, widths, x=x, payload=payload)

  @jax.custom_batching.custom_vmap
  def op(payload, x, widths, karr):
    return _dar_call(payload, x, widths, karr, cfg=cfg, units=int(units), strata=strata,
                     interpret=interpret)

  op.def_vmap(K._map_batch_rule(op))
  return op(payload, x, widths, K._keys_array(keys, rank))


# ----------------------------------------------------------------------------
# Dispatch (pallas_kernels.dynamiq's).


def _eps_key(eps):
  """eps as a hashable, sorted tuple of (width, eps) pairs (a dict is converted)."""
  return tuple(sorted((int(w), float(e)) for w, e in dict(eps).items()))


def compress_units(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                   scale_rounding="up", plane_bits: int = U.PLANE_BITS, width_set=U.WIDTH_SET,
                   implementation: K.Implementation = None, interpret: bool | None = None):
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
    implementation: None (kernels when lowering for a GPU, else the
      reference), ``"pallas"`` or ``"xla"``.
    interpret: overrides the kernels' interpret mode.

  Returns:
    uint8 ``[payload_bytes(S, units, plane_bits)]``.
  """
  return K._dispatch("compress_units", compress_units_pallas, U.compress_units_reference,
                     implementation, interpret, x, widths, units, eps=_eps_key(eps), keys=keys,
                     rank=rank, strata=strata, scale_rounding=scale_rounding,
                     plane_bits=plane_bits, width_set=tuple(width_set))


def decompress_units(payload, widths, units: int, *, eps, plane_bits: int = U.PLANE_BITS,
                     width_set=U.WIDTH_SET, implementation: K.Implementation = None,
                     interpret: bool | None = None):
  """Decodes a chunk payload (see :func:`compress_units`) to float32 [S, 256]."""
  return K._dispatch("decompress_units", decompress_units_pallas, U.decompress_units_reference,
                     implementation, interpret, payload, widths, units, eps=_eps_key(eps),
                     plane_bits=plane_bits, width_set=tuple(width_set))


def decompress_accumulate_units(payload, x, widths, units: int, *, eps,
                                plane_bits: int = U.PLANE_BITS, width_set=U.WIDTH_SET,
                                implementation: K.Implementation = None,
                                interpret: bool | None = None):
  """``decompress_units(payload) + x`` in float32 [S, 256]."""
  return K._dispatch("decompress_accumulate_units", decompress_accumulate_units_pallas,
                     U.decompress_accumulate_units_reference, implementation, interpret,
                     payload, x, widths, units, eps=_eps_key(eps), plane_bits=plane_bits,
                     width_set=tuple(width_set))


def decompress_accumulate_recompress_units(payload, x, widths, units: int, *, eps, keys, rank=0,
                                           strata: int = 1, scale_rounding="up",
                                           plane_bits: int = U.PLANE_BITS,
                                           width_set=U.WIDTH_SET,
                                           implementation: K.Implementation = None,
                                           interpret: bool | None = None):
  """``compress_units(decompress_units(payload) + x)`` in one pass (a ring hop);
  the sum is never stored."""
  return K._dispatch("decompress_accumulate_recompress_units",
                     decompress_accumulate_recompress_units_pallas,
                     U.decompress_accumulate_recompress_units_reference, implementation,
                     interpret, payload, x, widths, units, eps=_eps_key(eps), keys=keys,
                     rank=rank, strata=strata, scale_rounding=scale_rounding,
                     plane_bits=plane_bits, width_set=tuple(width_set))
