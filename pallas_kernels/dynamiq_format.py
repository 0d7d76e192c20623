"""DynamiQ's wire format and its pure-jnp reference codec.

This module is the single definition of the bytes DynamiQ puts on the wire
(the paper's §3.3, with the authors' record layout) and of the arithmetic that produces them. The
Pallas kernels reproduce it bit for bit; the reference is also the product
path on CPU.

Format (one *super-group* = 256 consecutive coordinates, one code width
``b`` in {2, 4, 8}):

* Symmetric levels ``±lam[l]``, ``l = 0..R``, ``R = 2**(b-1) - 1``, i.e.
  ``2**b - 1`` used codes (code ``R + sign*l``; one code is unused).
  ``levels="mee"``: the paper's non-uniform value set
  ``lam[l] = ((1 + 2 eps^2)^l - 1) / ((1 + 2 eps^2)^R - 1)`` (top = 1);
  ``levels="uniform"``: ``lam[l] = l`` (top = R).
  Every table value is rounded to bfloat16 precision once, so that a decoded
  value ``lam * k * U`` (8 x 8 x 8 significant bits) is exact in float32.
  That makes every result independent of whether a compiler contracts the
  following accumulation into a fused multiply-add — the property behind the
  bit-exact kernel/reference and vmap/shard_map parity.
* Hierarchical scales (default): 16 groups of 16 coordinates. ``U`` =
  bfloat16 unit per super-group, rounded *up* from ``max|x| / (255 top)``;
  per group a uint8 ``k``; the decoded group scale is ``k U``.
  ``scale_rounding="up"`` (the authors' kernel) takes ``k = ceil(gmax / (U
  top))`` and normalises by the decoded scale, so no element is clamped;
  ``"stochastic"`` (the paper's text) normalises by the group max (rounded
  up to bf16, so that products stay exact) and rounds ``k`` stochastically
  so that ``E[k U]`` equals it. Both are unbiased.
* Flat scales (``hierarchical=False``, the ablation baseline): one bfloat16
  scale per ``group_size`` coordinates, rounded up.
* Element rounding is unbiased in the *value* domain: ``t = |x| / scale`` is
  rounded to one of its two bracketing levels with probability proportional
  to the distance (the paper and the authors' simulator; their CUDA kernel's
  log-domain rounding is biased and not used), in the *signed* lattice:
  the value goes to the level above (towards +inf) iff ``u < p``, so a
  negative value is rounded by ``1 - u`` in magnitude. The uniform draw comes from
  :mod:`pallas_kernels.rng`; with ``strata = n > 1`` it is the correlated
  (stratified) draw ``u = (pi(rank) + gamma) / q`` with the permutation
  ``pi`` shared by all ranks for the coordinate and ``gamma`` private
  (:func:`pallas_kernels.rng.stratum`). ``gamma`` has 16 bits, and one
  hash per key and group of 16 coordinates feeds its 16 draws
  (:func:`_uniforms`): each draw is exactly uniform on its grid, so a
  quantisation's bias is below 2^-16 / q of its level gap (the probability
  of rounding up is ``ceil(p q 2^16) / (q 2^16)``).

Byte layout of one hierarchical super-group record (``32 b + 18`` bytes)::

  for g in 0..15: [2b bytes: 16 codes, LSB-first] [1 byte: k_g]
  then:           [2 bytes: U as bfloat16, little-endian]

Flat record: per group ``[group_size*b/8 code bytes][2 bytes bf16 scale]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from ml_dtypes import bfloat16

from pallas_kernels import bf16
from pallas_kernels import rng

__all__ = [
    "SUPERGROUP",
    "HIER_GROUP",
    "Format",
    "compress_reference",
    "decompress_reference",
    "decompress_accumulate_reference",
    "decompress_accumulate_recompress_reference",
    "materialize",
    "take_in_range",
    "pack_codes",
    "unpack_codes",
    "ceil_to_bf16",
    "block_shape",
    "encode_block",
    "decode_block",
    "hier_scale",
]

SUPERGROUP = 256
HIER_GROUP = 16
_UNIT_MAX = 255


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
  """Static description of one width class of the DynamiQ format.

  Attributes:
    bits: code width, 2, 4 or 8.
    levels: ``"mee"`` (non-uniform, the paper's) or ``"uniform"``.
    eps: MEE error parameter for this width (ignored for uniform levels and
      for 2 bits, where the levels are {-1, 0, 1}).
    hierarchical: uint8 group scales under a bf16 unit per 256 coordinates;
      otherwise one bf16 scale per ``group_size`` coordinates.
    group_size: group length of the flat (non-hierarchical) layout.
    scale_rounding: ``"up"`` or ``"stochastic"`` (hierarchical only).
  """

  bits: int
  levels: Literal["mee", "uniform"] = "mee"
  eps: float = 0.18
  hierarchical: bool = True
  group_size: int = 32
  scale_rounding: Literal["up", "stochastic"] = "up"

  def __post_init__(self):
    if self.bits not in (2, 4, 8):
      raise ValueError(f"bits={self.bits!r} must be 2, 4 or 8")
    if self.levels not in ("mee", "uniform"):
      raise ValueError(f"levels={self.levels!r} must be 'mee' or 'uniform'")
    if self.levels == "mee" and not 0.0 < self.eps < 1.0:
      raise ValueError(f"eps={self.eps!r} must be in (0, 1) for MEE levels")
    if self.scale_rounding not in ("up", "stochastic"):
      raise ValueError(
          f"scale_rounding={self.scale_rounding!r} must be 'up' or 'stochastic'")
    if not self.hierarchical:
      gs = self.group_size
      if gs <= 0 or SUPERGROUP % gs or (gs * self.bits) % 8:
        raise ValueError(
            f"group_size={gs!r} must divide {SUPERGROUP} and hold whole bytes "
            f"of {self.bits}-bit codes")
      if self.scale_rounding != "up":
        raise ValueError("scale_rounding='stochastic' needs hierarchical=True")

  @property
  def top(self) -> int:
    """Largest level index R."""
    return 2 ** (self.bits - 1) - 1

  @property
  def groups(self) -> int:
    return SUPERGROUP // (HIER_GROUP if self.hierarchical else self.group_size)

  @property
  def record_bytes(self) -> int:
    """Bytes of one 256-coordinate record: ``32 b + 18`` when hierarchical."""
    codes = SUPERGROUP * self.bits // 8
    if self.hierarchical:
      return codes + self.groups + 2
    return codes + 2 * self.groups

  def table(self) -> np.ndarray:
    """Nonnegative level magnitudes ``lam[0..R]`` as bf16-exact float32."""
    return _level_table(self.bits, self.levels, float(self.eps))


@functools.lru_cache(maxsize=None)
def _level_table(bits: int, levels: str, eps: float) -> np.ndarray:
  r = 2 ** (bits - 1) - 1
  idx = np.arange(r + 1, dtype=np.float64)
  if levels == "uniform" or r == 1:
    lam = idx if levels == "uniform" else idx / r
  else:
    q = 1.0 + 2.0 * eps * eps
    lam = (q**idx - 1.0) / (q**r - 1.0)
  lam = lam.astype(np.float32).astype(bfloat16).astype(np.float32)
  if not np.all(np.diff(lam) > 0):
    raise ValueError(
        f"eps={eps} gives {bits}-bit MEE levels that coincide at bfloat16 "
        "precision; use a larger eps")
  lam.setflags(write=False)
  return lam


# ----------------------------------------------------------------------------
# Bit-level helpers.


ceil_to_bf16 = bf16.ceil
"""Smallest bfloat16-representable float32 >= ``v`` (re-exported from :mod:`pallas_kernels.bf16`)."""


def pack_codes(codes, bits: int):
  """uint8 codes [..., L] (values < 2**bits) -> packed bytes [..., L*bits/8], LSB-first."""
  per = 8 // bits
  c = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], -1, per)
  out = c[..., 0]
  for i in range(1, per):
    out = out | (c[..., i] << (bits * i))
  return out


def unpack_codes(packed, bits: int):
  """Inverse of :func:`pack_codes`."""
  per = 8 // bits
  mask = (1 << bits) - 1
  parts = [(packed >> (bits * i)) & mask for i in range(per)]
  return jnp.stack(parts, axis=-1).reshape(*packed.shape[:-1], -1)


# ----------------------------------------------------------------------------
# Block arithmetic, shared by the reference and the Pallas kernels.
#
# A block of S super-groups is viewed as values[S, G, CB, P]: G scale groups,
# CB code bytes per group, P = 8 / bits codes per byte (row-major, so the
# element index is the flat coordinate index). The two implementations differ
# only in how they move bytes (concatenate vs. scatter) and how they index
# the level table (``lookup``: jnp.take vs. a gather from a kernel ref).


def block_shape(fmt: Format, supergroups: int) -> tuple[int, int, int, int]:
  """Shape [S, G, CB, P] of a block of ``supergroups`` super-groups."""
  per = 8 // fmt.bits
  return (supergroups, fmt.groups, SUPERGROUP // fmt.groups // per, per)


def _round_levels(a, s, fmt: Format, lookup, u_scaled, q: int):
  """Stochastically rounds ``a / s`` (in [0, top]) to a level index in [0, R].

  Division-free: the level is bracketed with exact products ``lam[j] * s``
  (8 x 16 significant bits), and "round up iff ``u < p``" with
  ``p = (a - lo s) / (hi s - lo s)`` is decided as ``u q (hi s - lo s) <
  (a - lo s) q``. Every step is then one IEEE operation with the same result
  on every backend, whatever the precision of its division or log (only the
  first guess of ``j`` uses them) and whether it contracts into FMA.
  ``u_scaled`` is uniform on [0, q) (on its grid of integers: strata x 2^16).
  """
  r = fmt.top
  safe = jnp.where(s > 0, s, 1.0)
  t = a / safe  # a guess only
  if fmt.levels == "uniform" or r == 1:
    approx = t
  else:
    qq = 1.0 + 2.0 * float(fmt.eps) ** 2
    approx = jnp.log1p(t * np.float32(qq**r - 1.0)) * np.float32(1.0 / np.log(qq))
  j = jnp.clip(jnp.floor(approx), 0, r - 1).astype(jnp.int32)
  j = jnp.maximum(j - (a < lookup(j) * s).astype(jnp.int32), 0)
  j = jnp.minimum(j + (a >= lookup(j + 1) * s).astype(jnp.int32), r - 1)
  lo = lookup(j) * s  # exact
  hi = lookup(j + 1) * s  # exact
  up = u_scaled * (hi - lo) < (a - lo) * np.float32(q)
  return j + up.astype(jnp.int32)


UNIFORM_BITS = 16
"""Resolution of each element's private uniform gamma (:func:`_uniforms`)."""


def _uniforms(idx, keys, rank, ranks: int, *, group_idx=None, lane=None, mulhi=rng.mulhi,
              hash_store=None, fraction_of=None):
  """Per-element draws in units of ``2^-16``: ``pi(rank) 2^16 + gamma``, uniform
  on [0, q 2^16) (q = 1: ``gamma``), as uint32.

  Element ``idx`` belongs to the group ``idx >> 4`` of 16 consecutive
  elements (:data:`~pallas_kernels.rng.GROUP`), at ``lane = idx & 15``; one
  :func:`~pallas_kernels.rng.group_hash`
  per group and key gives every lane its bits (:func:`~pallas_kernels.rng.lane_bits`):
  the private gamma is the top 16 bits under the rounding key ``(k0, k1)``,
  the shared stratum pi comes from the bits under ``(s0, s1)``
  (:func:`~pallas_kernels.rng.stratum`). Converted to float32
  (:func:`signed_draws`) exactly for q <= 256 (below 2^24); beyond, rounded
  to 24 bits.

  Args:
    idx: uint32 element indices.
    group_idx, lane: ``idx >> 4`` and ``idx & 15`` when given (broadcastable
      against each other; a kernel passes the group's index per group and
      static lanes).
    mulhi: :func:`pallas_kernels.rng.mulhi` or an equal implementation.
    hash_store: identity on values, applied to the groups' hashes (the XLA
      reference passes :func:`materialize` with per-group ``group_idx``, so
      that the fused rounding loop reads one hash per group instead of
      recomputing it for each of the group's 16 elements).
    fraction_of: the elements' :func:`sign_mask`, for a power-of-two q: returns
      :func:`signed_draws`' draw ``v`` as the float32 ``w = -(1 + v / q)``
      instead, built from its bits (``v`` is the mantissa's top ``log2 q``
      bits; the shifts merge with the join of pi and gamma), so that ``w + 1
      = -v / q`` exactly.
  """
  k0, k1, s0, s1 = keys
  if group_idx is None:
    group_idx = idx >> np.uint32(rng.GROUP_SHIFT)
  if lane is None:
    lane = idx & np.uint32(rng.GROUP - 1)
  hstore = hash_store or (lambda v: v)
  word = rng.lane_bits(hstore(rng.group_hash(k0, k1, group_idx)), lane)  # gamma: its top bits
  pi = None
  if ranks > 1:
    pi = rng.stratum(rng.lane_bits(hstore(rng.group_hash(s0, s1, group_idx)), lane), rank,
                     ranks, mulhi=mulhi).astype(jnp.uint32)
  if fraction_of is None:
    gamma = word >> np.uint32(32 - UNIFORM_BITS)
    return gamma if pi is None else (pi << np.uint32(UNIFORM_BITS)) | gamma
  q = rng.strata_count(ranks) * 2**UNIFORM_BITS
  if q & (q - 1) or q > 1 << 23:
    raise ValueError(f"fraction_of needs a power-of-two q <= 2^23, not {q=}")
  shift = 23 - (q.bit_length() - 1)  # v at mantissa bits [shift, 23)
  bits = word >> np.uint32(32 - UNIFORM_BITS - shift)  # gamma << shift, and lower bits
  if pi is not None:
    bits = bits | (pi << np.uint32(UNIFORM_BITS + shift))
  field = np.uint32((q - 1) << shift)
  bits = ((bits ^ fraction_of.astype(jnp.uint32)) & field) | np.uint32(0xBF800000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def sign_mask(x):
  """int32 -1 where ``x`` has its sign bit set (negative values, -0.0), else 0."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) >> 31


def signed_draws(u, neg, q: int):
  """The draws of the signed-domain rounding, float32: ``u`` (uint32 on [0, q),
  :func:`_uniforms`) where ``neg`` (:func:`sign_mask`) is 0 and ``q - 1 - u``
  where it is -1 (still uniform on the grid [0, q)); one xor when q is a
  power of two."""
  m = neg.astype(jnp.uint32)
  if q & (q - 1) == 0:
    v = u ^ (m & np.uint32(q - 1))
  else:
    v = (u ^ m) + (m & np.uint32(q))
  return v.astype(jnp.float32)


def _top(fmt: Format):
  return np.float32(fmt.top if fmt.levels == "uniform" else 1.0)


def _recip_up(c: float) -> np.float32:
  """float32 reciprocal of c, rounded up."""
  r = np.float32(1.0 / c)
  return r if float(r) * c >= 1.0 else np.nextafter(r, np.float32(np.inf))


def _ceil_div_bf16(v, c: float):
  """Smallest bf16-exact w >= v / c (c a small integer constant), without division."""
  w = ceil_to_bf16(v * _recip_up(c))
  return jnp.where(w * np.float32(c) < v, bf16.next_up(w), w)  # exact product


def _guess_operands(v, d, div):
  """``(v, d, div)`` for a quotient guess: with an approximate ``div`` (a GPU's
  ``div.approx.ftz.f32``, accurate for ``d`` in [2^-126, 2^126]) a ``d`` below
  2^-64 and its ``v`` are scaled by 2^64 first (exact; the quotients here are
  at most about ``kmax``, so ``v`` stays finite)."""
  if div is None:
    return v, d, jnp.divide
  f = jnp.where(d < np.float32(2.0**-64), np.float32(2.0**64), np.float32(1.0))
  return v * f, d * f, div


def _ceil_quotient(v, d, kmax, div=None):
  """ceil(v / d) clipped to [0, kmax], for d with <= 16 significant bits; exact
  (``div``: any division within a few ulp, for the first guess only)."""
  gv, gd, div = _guess_operands(v, d, div)
  k = jnp.clip(jnp.ceil(div(gv, jnp.where(gd > 0, gd, 1.0))), 0, kmax)  # guess
  k = jnp.where((k > 0) & ((k - 1) * d >= v), k - 1, k)  # exact products
  return jnp.where((k < kmax) & (k * d < v), k + 1, k)


def _floor_quotient(v, d, kmax, div=None):
  """floor(v / d) clipped to [0, kmax], for d with <= 16 significant bits; exact
  (``div`` as for :func:`_ceil_quotient`)."""
  gv, gd, div = _guess_operands(v, d, div)
  k = jnp.clip(jnp.floor(div(gv, jnp.where(gd > 0, gd, 1.0))), 0, kmax)  # guess
  k = jnp.where((k > 0) & (k * d > v), k - 1, k)
  return jnp.where((k < kmax) & ((k + 1) * d <= v), k + 1, k)


def _scales_hier(a, fmt: Format, keys, group_idx, div=None, gmax=None):
  """a = |x| [S, G, CB, P] -> (k f32 [S, G], unit f32 [S], element scale s [S, G]).

  ``"up"``: ``k = ceil(gmax / (U top))``; elements are normalised by the
  decoded scale ``s = k U`` (so ``a <= top s``). ``"stochastic"``: the group
  max rounded up to bf16, ``g``, normalises the elements and ``k`` is rounded
  stochastically with ``E[k U] = g``. Both unbiased.
  ``div``: an approximate division for the quotients' first guesses
  (:func:`_ceil_quotient`; the same results). ``gmax``: the group maxima
  [S, G] when the caller has them (``a`` is then not read).
  """
  top = _top(fmt)
  if gmax is None:
    gmax = jnp.max(jnp.max(a, axis=-1), axis=-1)
  if fmt.scale_rounding == "up":
    unit = _ceil_div_bf16(jnp.max(gmax, axis=-1), float(top) * _UNIT_MAX)
    live = unit > 0
    ut = unit[:, None] * top  # exact: 8 x 7 significant bits
    k = _ceil_quotient(gmax, ut, _UNIT_MAX, div)
    s = k * unit[:, None]  # exact: 8 x 8 significant bits
  else:
    g = _ceil_div_bf16(gmax, float(top))  # bf16-exact, g top >= gmax
    unit = _ceil_div_bf16(jnp.max(g, axis=-1), _UNIT_MAX)
    live = unit > 0
    u1 = unit[:, None]
    kf = _floor_quotient(g, u1, _UNIT_MAX, div)
    k0, k1, _, _ = keys
    u = rng.uniform24(rng.hash_index(k0 ^ jnp.uint32(rng.Stream.DYNAMIQ_SCALE), k1, group_idx))
    # P(k = kf + 1) = (g - kf U) / U, decided as u U < g - kf U (exact products)
    k = kf + ((u * u1 < g - kf * u1) & (kf < _UNIT_MAX)).astype(jnp.float32)
    s = g
  k = jnp.where(live[:, None], k, 0.0)
  return k, unit, s


def _scales_flat(a, fmt: Format):
  """a = |x| [S, G, CB, P] -> bf16-exact group scales s [S, G] with ``a <= top s``."""
  return _ceil_div_bf16(jnp.max(jnp.max(a, axis=-1), axis=-1), float(_top(fmt)))


def encode_block(x, fmt: Format, *, lookup, idx, keys, rank, strata: int, store=None):
  """Quantises one block.

  Args:
    x: float32 [S, G, CB, P] values.
    fmt: the width class.
    lookup: ``lookup(j) -> lam[j]`` for int32 arrays j.
    idx: uint32 [S, G, CB, P] element indices (the RNG counters).
    keys: ``(k0, k1, s0, s1)`` uint32 scalars.
    rank: int32 scalar.
    strata: 1 (independent) or n (correlated over n ranks).
    store: identity on values; the XLA reference passes :func:`materialize`
      to store the random draws before the rounding reads them when several
      codes share a byte (2 and 4 bits): fused, the per-byte loop over those
      codes holds the whole hash, is not unrolled and so not vectorised on
      XLA:CPU (8-bit, one code per byte, is faster fused). Kernels keep them in
      registers (None).

  Returns:
    ``(packed uint8 [S, G, CB], k uint8 [S, G] | None, scale)``: with
    hierarchical scales ``scale`` is the bf16-exact unit [S]; otherwise the
    bf16-exact group scales [S, G].
  """
  a = jnp.abs(x)
  if fmt.hierarchical:
    group_idx = jnp.min(jnp.min(idx, axis=-1), axis=-1) // np.uint32(SUPERGROUP // fmt.groups)
    k, scale, s = _scales_hier(a, fmt, keys, group_idx)
    k = k.astype(jnp.uint8)
  else:
    scale = s = _scales_flat(a, fmt)
    k = None
  q = rng.strata_count(strata) * 2**UNIFORM_BITS  # u is uniform on [0, q)
  # Signed-domain rounding: "up" means towards +inf whatever the sign, so a
  # negative value rounds away from zero iff q - 1 - u < p q. Each quantisation
  # is unbiased either way; with stratified draws, only the signed rule keeps
  # the hops' errors negatively correlated when a coordinate's partial sums
  # change sign along the path (the authors' simulator rounds signed values too).
  neg = sign_mask(x)
  u = signed_draws(_uniforms(idx, keys, rank, strata), neg, q)
  if store is not None and fmt.bits < 8:
    u = store(u)
  lvl = _round_levels(a, s[..., None, None], fmt, lookup, u, q)
  r = fmt.top
  codes = (r + ((lvl ^ neg) - neg)).astype(jnp.uint32)  # r - lvl where x has its sign bit
  shifts = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 3) * np.uint32(fmt.bits)
  packed = jnp.sum(codes << shifts, axis=-1).astype(jnp.uint8)  # disjoint bit fields
  return packed, k, scale


def decode_block(packed, scale, fmt: Format, *, lookup):
  """packed uint8 [S, G, CB], decoded group scale f32 [S, G] -> float32 [S, G, CB, P]."""
  per = 8 // fmt.bits
  shape = packed.shape + (per,)
  shifts = jax.lax.broadcasted_iota(jnp.uint32, shape, 3) * np.uint32(fmt.bits)
  codes = (packed.astype(jnp.uint32)[..., None] >> shifts) & np.uint32((1 << fmt.bits) - 1)
  lvl = codes.astype(jnp.int32) - fmt.top
  val = lookup(jnp.abs(lvl)) * scale[..., None, None]  # exact product
  return jnp.where(lvl < 0, -val, val)


def hier_scale(k, unit):
  """Decoded group scale ``k * U`` [S, G] (exact)."""
  return k.astype(jnp.float32) * unit[:, None]


# ----------------------------------------------------------------------------
# Record assembly (reference): concatenation in the documented byte order.


def _assemble(packed, k, scale, fmt: Format):
  s_count = packed.shape[0]
  if fmt.hierarchical:
    body = jnp.concatenate([packed, k[..., None]], axis=-1).reshape(s_count, -1)
    return jnp.concatenate([body, bf16.to_bytes(scale)], axis=-1)
  body = jnp.concatenate([packed, bf16.to_bytes(scale)], axis=-1)
  return body.reshape(s_count, -1)


def _disassemble(payload, fmt: Format):
  """payload [S, rec] -> (packed uint8 [S, G, CB], decoded group scale f32 [S, G])."""
  s_count = payload.shape[0]
  g = fmt.groups
  cb = SUPERGROUP * fmt.bits // 8 // g
  if fmt.hierarchical:
    body = payload[:, : g * (cb + 1)].reshape(s_count, g, cb + 1)
    unit = bf16.from_bytes(payload[:, g * (cb + 1)], payload[:, g * (cb + 1) + 1])
    return body[..., :cb], hier_scale(body[..., cb], unit)
  body = payload.reshape(s_count, g, cb + 2)
  return body[..., :cb], bf16.from_bytes(body[..., cb], body[..., cb + 1])


def _check_chunk(x, name):
  if x.ndim != 2 or x.shape[1] != SUPERGROUP:
    raise ValueError(f"{name}.shape={x.shape} must be [supergroups, {SUPERGROUP}]")


def _check_payload(payload, fmt: Format):
  if payload.ndim != 2 or payload.shape[1] != fmt.record_bytes or payload.dtype != jnp.uint8:
    raise ValueError(
        f"payload {payload.dtype}{list(payload.shape)} must be uint8 "
        f"[supergroups, {fmt.record_bytes}] for {fmt}")


def _table_lookup(fmt: Format):
  lam = jnp.asarray(fmt.table())
  return lambda j: jnp.take(lam, j)


# ----------------------------------------------------------------------------
# The four operations (reference implementations).


def compress_reference(x, fmt: Format, *, keys, rank=0, strata: int = 1):
  """Quantises super-groups into DynamiQ records.

  Args:
    x: float [S, 256] (bf16, f16 or f32; computed in f32).
    fmt: the width class.
    keys: four uint32 scalars ``(k0, k1, s0, s1)``: the private rounding key
      and the shared stratum key (:func:`pallas_kernels.rng.derive_key`).
    rank: int32 scalar, this worker's index (used when ``strata > 1``).
    strata: 1 for independent rounding, n for correlated rounding over n
      ranks (:func:`pallas_kernels.rng.stratum`).

  Returns:
    uint8 [S, fmt.record_bytes].
  """
  _check_chunk(x, "x")
  shape = block_shape(fmt, x.shape[0])
  # Stored first: fused into the encode loop, x's producer would be
  # re-evaluated per use in an unvectorised loop (5x slower on XLA:CPU).
  xb = materialize(x.astype(jnp.float32).reshape(shape))
  idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(shape)
  keys = tuple(jnp.asarray(k, jnp.uint32) for k in keys)
  packed, k, scale = encode_block(xb, fmt, lookup=_table_lookup(fmt), idx=idx, keys=keys,
                                  rank=jnp.asarray(rank, jnp.int32), strata=strata,
                                  store=materialize)
  return _assemble(packed, k, scale, fmt)


def decompress_reference(payload, fmt: Format):
  """Decodes records to float32 [S, 256]."""
  _check_payload(payload, fmt)
  packed, scale = _disassemble(payload, fmt)
  val = decode_block(packed, scale, fmt, lookup=_table_lookup(fmt))
  return val.reshape(payload.shape[0], SUPERGROUP)


def decompress_accumulate_reference(payload, x, fmt: Format):
  """``decompress(payload) + x`` in float32."""
  _check_chunk(x, "x")
  return decompress_reference(payload, fmt) + x.astype(jnp.float32)


def take_in_range(a, idx):
  """``a[idx]`` for indices known to be in range (an encoder's codes, a
  permutation): an unsigned gather without jnp's negative-index and
  out-of-range fill code, which XLA:CPU would otherwise evaluate per element.
  (An out-of-range index would read a clamped entry, never outside ``a``:
  XLA's gather clamps.)"""
  return jnp.asarray(a).at[jnp.asarray(idx).astype(jnp.uint32)].get(mode="promise_in_bounds")


def materialize(value):
  """``value``, stored to memory before any consumer reads it (XLA:CPU).

  XLA fuses a producer into every consumer that it judges cheap to
  recompute. For the encode that means its whole input computation (a ring
  hop's decode: byte unpacking, level lookup, scale; or the gather that
  sorts super-groups into width classes) lands inside the encode loop,
  where it is evaluated once per use and the merged loop no longer
  vectorises. ``jax.lax.optimization_barrier`` does not prevent this on
  XLA:CPU (it is expanded away before fusion); a while loop's body is its
  own computation, so a loop that runs exactly once, from a start that XLA
  cannot fold to a constant (derived from the data), stores its result.
  Identity on values, so bit-exactness is unaffected whatever a compiler
  does with it. The XLA reference uses it, and so does the DynamiQ codec for
  each bucket's output (else XLA:CPU fuses every bucket's final decode into
  the loop that concatenates the buckets); on GPU the Pallas kernels run by
  default and keep such values in registers.

  The loop is XLA:CPU's workaround only: it is chosen by the platform being
  lowered for (``jax.lax.platform_dependent``), and a lowering for any
  other platform (the reference forced on GPU with ``implementation="xla"``,
  or a kernel's fallback) gets ``value`` itself.
  """
  if value.size == 0:
    return value

  def stored(value):
    first = jnp.ravel(value)[0].astype(jnp.float32)
    start = jnp.minimum(jax.lax.bitcast_convert_type(first, jnp.uint32), jnp.uint32(0))
    # the carry starts as the first element broadcast (no zero-filled buffer of its own)
    _, out = jax.lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, value),
                                (start, jnp.broadcast_to(jnp.ravel(value)[0], value.shape)))
    return out

  return jax.lax.platform_dependent(value, cpu=stored, default=lambda value: value)


def decompress_accumulate_recompress_reference(payload, x, fmt: Format, *, keys,
                                               rank=0, strata: int = 1):
  """``compress(decompress(payload) + x)``: one ring hop.

  The reference stores the sum once between the two halves
  (:func:`materialize`, in :func:`compress_reference`); the Pallas kernel
  keeps it in registers.
  """
  acc = decompress_accumulate_reference(payload, x, fmt)
  return compress_reference(acc, fmt, keys=keys, rank=rank, strata=strata)
