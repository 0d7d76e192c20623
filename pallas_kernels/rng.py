"""Counter-based integer hash RNG shared by the Pallas kernels and their references.

Stochastic rounding needs one uniform number per coordinate per quantisation.
Pallas on GPU has no PRNG, and the kernels must agree bit for bit with the
pure-jnp references, so both draw from the same stateless hash of integer
counters: a 32-bit value ``h = hash(k0, k1, index)`` built only from 32-bit
multiply, xor, shift and add, which every backend implements identically.

The mixer is the "lowbias32" integer finaliser (C. Wellons, 2018; a
variant of the MurmurHash3 finaliser), applied twice with the two key words
folded in between. Keys are derived on the host side of a kernel (in jnp,
from scalars such as seed, step, bucket, chunk and hop) with
:func:`derive_key`; the per-element part, :func:`hash_index`, is what kernels
evaluate in registers.

All functions take and return ``uint32`` arrays and wrap modulo 2**32.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Stream",
    "mix32",
    "derive_key",
    "KEY_INIT",
    "absorb",
    "finish_key",
    "key_operand",
    "Rank",
    "hash_index",
    "group_hash",
    "uniform24",
    "uniform_int",
    "GROUP",
    "lane_bits",
    "mulhi",
    "strata_count",
    "stratum",
    "UNIFORM_BITS",
    "uniforms",
    "signed_draws",
]



class Stream(enum.IntEnum):
  """Every random stream of the library, in one list: which key feeds which draw.

  A key is :func:`derive_key` of the words ``(seed0, seed1, bucket, ...,
  stream)``; ``seed0, seed1`` are the words of the user's ``jax.random`` key
  (identical on every rank), ``bucket`` the bucket index, and the words
  between are listed here. The draw is then :func:`hash_index` of that key at
  each element's index.

  ==========================  =====================  ==============================================
  stream                      words before it         draws
  ==========================  =====================  ==============================================
  ``DYNAMIQ_ROUND``           width, chunk, hop       private part gamma of each element's rounding
  ``DYNAMIQ_PERMUTATION``     width, chunk            shared stratum permutation of correlated
                                                      rounding (no hop: a coordinate's hops share
                                                      it, which makes them stratified)
  ``DYNAMIQ_STATS``           chunk, hop              stochastic bf16 rounding of the super-group
                                                      means in the statistics all-reduce
  ``DYNAMIQ_SCALE``           (xor-ed into word 0     stochastic rounding of the uint8 group
                              of the rounding key)    scales (``scale_rounding="stochastic"``)
  ``THC_SIGNS``               (none)                  the shared random signs of THC's Hadamard
                                                      rotation (identical on every rank)
  ``PRIVATE_ROUND``           (after it: rank)        THC's and Global-QSGD's per-rank rounding
  ``ARCTOPK_SKETCH``          (none)                  ARC-Top-K's shared Gaussian sketch matrix
                                                      (identical on every rank)
  ``RANDK_ROWS``              (none)                  Rand-K's shared choice of rows (benchmarks)
  ``INTGROUP_ROUND``          chunk, hop, rank        IntGroup's stochastic rounding
                                                      (``rounding="stochastic"``)
  ``USER``                    (any)                   free for codecs written outside the library
  ==========================  =====================  ==============================================
  """

  DYNAMIQ_ROUND = 1
  DYNAMIQ_PERMUTATION = 2
  DYNAMIQ_STATS = 3
  THC_SIGNS = 11
  PRIVATE_ROUND = 12
  ARCTOPK_SKETCH = 13
  RANDK_ROWS = 14
  INTGROUP_ROUND = 15
  DYNAMIQ_SCALE = 0x5CA1E5
  USER = 0x55E5


_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _u32(x):
  return jnp.asarray(x).astype(jnp.uint32)


def mix32(x):
  """Bijective 32-bit avalanche mixer (lowbias32)."""
  x = _u32(x)
  x = x ^ (x >> 16)
  x = x * jnp.uint32(_M1)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(_M2)
  x = x ^ (x >> 16)
  return x


def derive_key(*words):
  """Folds any number of integer words into a two-word key ``(k0, k1)``.

  Args:
    *words: scalars or arrays (broadcastable), any integer dtype; negative
      values are reinterpreted modulo 2**32.

  Returns:
    A pair of ``uint32`` arrays. Distinct word sequences give unrelated keys.
  """
  return finish_key(absorb(KEY_INIT, *words))


KEY_INIT = (np.uint32(0x243F6A88), np.uint32(0x85A308D3))
"""The fold state of :func:`derive_key` before any word."""


def absorb(state, *words):
  """The fold state ``(k0, k1)`` of :func:`derive_key` after ``words`` more words:
  ``derive_key(*a, *b) == finish_key(absorb(absorb(KEY_INIT, *a), *b))``, so the
  state of a common prefix is computed once for many keys."""
  k0, k1 = (_u32(v) for v in state)
  for w in words:
    w = _u32(w)
    k0 = mix32(k0 ^ w)
    k1 = mix32(k1 + w * jnp.uint32(_GOLDEN) + k0)
  return k0, k1


def finish_key(state):
  """The key ``(k0, k1)`` of a fold state (:func:`absorb`)."""
  k0, k1 = state
  return k0, mix32(k1 ^ (k0 >> 7))


class Rank(NamedTuple):
  """A scalar rank with its rows of GF(2^k) products (:func:`_gf_row`, ``k`` = 1, 2, 3),
  read from a table (:func:`gf_rows_table`) instead of computed in every program."""

  index: Any
  rows: tuple


@functools.lru_cache(maxsize=None)
def gf_rows_table() -> np.ndarray:
  """uint32 [8, 3]: :func:`_gf_row` of ``i`` for k = 1, 2, 3, for every ``i < 8``, computed
  once in numpy (no jax operation to dispatch, also when first asked for inside a trace).
  A row is read only for ``q = 2^k <= 8`` strata, whose ranks are below 8
  (:class:`Rank`)."""
  i = np.arange(8, dtype=np.uint32)
  out = np.stack([_gf_row(i, k, xp=np) for k in (1, 2, 3)], axis=1)  # uint32, as _gf_row's
  out.setflags(write=False)
  return out


def key_operand(keys, rank):
  """uint32 [8]: ``keys`` (four uint32 scalars, or their uint32 [4] array), ``rank``,
  zeros: one small kernel operand holding a hop's random keys."""
  r = jnp.asarray(rank).astype(jnp.uint32)
  rest = jnp.stack([r, jnp.uint32(0), jnp.uint32(0), jnp.uint32(0)])
  if isinstance(keys, (jax.Array, np.ndarray)) and np.shape(keys) == (4,):
    return jnp.concatenate([jnp.asarray(keys).astype(jnp.uint32), rest])
  return jnp.concatenate([jnp.stack([jnp.asarray(v).astype(jnp.uint32) for v in keys]), rest])


def hash_index(k0, k1, index):
  """The per-element hash: 32 random bits for counter ``index`` under key (k0, k1)."""
  h = mix32(_u32(index) ^ _u32(k0))
  return mix32(h + _u32(k1))


def group_hash(k0, k1, group):
  """32 random bits for a group of :data:`GROUP` coordinates under key (k0, k1):
  one lowbias32 round of the keyed counter, ``mix32((group ^ k0) + k1)``.

  DynamiQ's draws (:func:`lane_bits` spreads it to the group's coordinates).
  Half of :func:`hash_index`'s two rounds, for the kernels' instruction count:
  every draw is still exactly uniform (a bijection of a uniformly keyed
  counter), and the error statistics of the codec are those of the two-round
  hash within their noise (``docs/results/kernels_sass.md``: vNMSE, the bias
  of the all-reduce, correlated against independent rounding)."""
  return mix32((_u32(group) ^ _u32(k0)) + _u32(k1))


def uniform24(h):
  """Maps 32 hash bits to a float32 uniform on [0, 1) with 24-bit resolution (exact)."""
  return (_u32(h) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def uniform_int(h, n: int):
  """Maps 32 hash bits to an integer uniform on {0, ..., n - 1}.

  Computes ``floor(m * n / 2**24)`` for the top 24 bits ``m`` of ``h`` with
  32-bit integer arithmetic only (split multiply), so it is exact for any
  ``n < 2**16``; each value has probability within ``2**-24`` of ``1/n``
  (exactly ``1/n`` when ``n`` is a power of two).
  """
  if not 1 <= n < 2**16:
    raise ValueError(f"{n=} must be in [1, 65536)")
  m = _u32(h) >> 8
  if n < 1 << 8:  # m n < 2^32: one multiply, the same value
    return ((m * jnp.uint32(n)) >> 24).astype(jnp.int32)
  hi = (m >> 12) * jnp.uint32(n)
  lo = (m & jnp.uint32(0xFFF)) * jnp.uint32(n)
  return ((hi + (lo >> 12)) >> 12).astype(jnp.int32)


GROUP = 16
"""Coordinates per hash of the grouped draws (:func:`lane_bits`): DynamiQ's
scale group."""

GROUP_SHIFT = GROUP.bit_length() - 1
"""``idx >> GROUP_SHIFT`` is the group of element ``idx``."""

# The seed of the lanes' multipliers: of 3000 random seeds, the one whose 16
# multipliers have the longest shortest lattice vector over all their pairs
# (2^14.05; the seed 0x632BE5AB of the earlier 8 lanes gives 2^11.9 for 16).
_LANE_SEED = 0xEE6AF9B6


def lane_bits(h, lane):
  """32 bits for coordinate ``lane`` (in [0, :data:`GROUP`)) of a group whose
  hash is ``h``: ``h * K(lane)`` modulo 2**32 with odd constants ``K(lane) =
  mix32(lane + c) | 1``.

  One :func:`group_hash` per group of 16 coordinates instead of a hash per
  coordinate (a kernel computes ``K`` at compile time: ``lane`` is a static
  position in the thread's registers). Multiplication by an odd constant is
  a bijection of the 32-bit words, so with ``h`` uniform each coordinate's
  word is *exactly* uniform, and any bit field of it too: every marginal
  draw (what unbiasedness needs) is exact. Two coordinates of one group see
  ``h K_i`` and ``h K_j``: as ``h`` varies the pair lies on a 2-D lattice
  whose shortest vector is at least 2^14.0 for every pair of these
  constants (ideal: 2^16.1; checked in ``tests/test_format.py``), i.e. on
  lines at most 2^-14.0 apart in the unit square, so any pair statistic
  (the correlation of two rounding errors, hence the error of a sum) is
  that of independent draws to within about that spacing."""
  k = mix32(_u32(lane) + jnp.uint32(_LANE_SEED)) | jnp.uint32(1)
  return _u32(h) * k


def mulhi(v, n: int):
  """``floor(v n / 2**32)`` for uint32 ``v`` and a static ``0 < n <= 2**16``,
  exact in 32-bit arithmetic (split multiply); the kernels use the GPU's
  ``mul.hi.u32`` (one instruction, the same value)."""
  if not 0 < n <= 1 << 16:
    raise ValueError(f"{n=} must be in [1, 65536]")
  v = _u32(v)
  n = jnp.uint32(n)
  return ((v >> 16) * n + (((v & jnp.uint32(0xFFFF)) * n) >> 16)) >> 16


# Irreducible polynomials over GF(2) of degree k (bit k set), k = 1..16.
_GF_POLY = {
    1: 0b11, 2: 0b111, 3: 0b1011, 4: 0b10011, 5: 0b100101, 6: 0b1000011,
    7: 0b10000011, 8: 0x11B, 9: 0x211, 10: 0x409, 11: 0x805, 12: 0x1053,
    13: 0x201B, 14: 0x4443, 15: 0x8003, 16: 0x1100B,
}


def _gf_row(i, k: int, xp=jnp):
  """The products ``alpha i`` in GF(2^k) for every ``alpha < 2^k``, ``k``-bit
  fields of one uint32 (field ``alpha`` at bit ``k alpha``); ``k <= 3``.

  ``alpha i`` is linear in ``alpha``'s bits: the XOR of ``x^j i`` over the set
  bits ``j``. So the whole row costs a few operations on the scalar ``i``,
  and a product with a per-coordinate ``alpha`` is then one shift and mask
  (:func:`stratum`) instead of ``k`` rounds of :func:`_gf_mul`. ``xp``: ``jnp`` (traced),
  or ``np`` (:func:`gf_rows_table`'s eager table, the same operations)."""
  poly = xp.uint32(_GF_POLY[k])
  top = xp.uint32(1 << k)
  m = [xp.asarray(i).astype(xp.uint32)]
  for _ in range(k - 1):
    a = m[-1] << xp.uint32(1)
    m.append(xp.where((a & top) != 0, a ^ poly, a))
  row = xp.zeros_like(m[0])
  prod = [xp.zeros_like(m[0])]
  for alpha in range(1, 1 << k):
    low = (alpha & -alpha).bit_length() - 1
    prod.append(prod[alpha & (alpha - 1)] ^ m[low])
    row = row | (prod[alpha] << xp.uint32(k * alpha))
  return row


def _is_prime(p: int) -> bool:
  return p >= 2 and all(p % d for d in range(2, int(p**0.5) + 1))


def strata_count(n: int) -> int:
  """Number of strata q used for correlated rounding over n ranks.

  ``n`` itself when it is a power of two or a prime (exact stratification:
  the n ranks take n distinct strata); otherwise the smallest prime above
  ``n`` (the ranks take n distinct strata out of q).
  """
  if n < 1 or n > 1 << 16:
    raise ValueError(f"{n=} must be in [1, 65536] for correlated rounding")
  if n & (n - 1) == 0 or _is_prime(n):
    return n
  q = n + 1
  while not _is_prime(q):
    q += 1
  return q


def _gf_mul(a, b, k: int):
  """Product in GF(2^k) of uint32 arrays a, b < 2**k."""
  poly = jnp.uint32(_GF_POLY[k])
  top = jnp.uint32(1 << k)
  r = jnp.zeros_like(a)
  for i in range(k):
    r = r ^ jnp.where(((b >> i) & 1) == 1, a, jnp.uint32(0))
    a = a << 1
    a = jnp.where((a & top) != 0, a ^ poly, a)
  return r


def stratum(h, rank, n: int, *, mulhi=mulhi):
  """Stratum of ``rank`` under a shared random permutation drawn from ``h``.

  For each coordinate the shared bits ``h`` (identical on every rank) pick a
  bijection pi of the strata {0..q-1} (q = :func:`strata_count`) from a
  *pairwise-uniform* family: for any two ranks the pair (pi(i), pi(j)) is
  uniform over distinct pairs, exactly as for a uniformly random
  permutation. That is what makes every pair of roundings negatively
  correlated (Suresh et al., ICML 2022). A cyclic shift, the cheapest
  "one rank per stratum" map, is *not* enough on a ring: consecutive hops
  land in adjacent strata and their errors correlate positively.

  * q = 2^k: pi(i) = alpha * i + beta in GF(2^k), alpha != 0; alpha - 1 =
    ``mulhi(h, q - 1)`` (the top bits), beta the low k bits of ``h`` (k <= 8)
    or of ``mix32(h)``. beta is exactly uniform whatever alpha, so every
    rank's stratum is exactly uniform (unbiased rounding); given the low k
    bits, alpha's probabilities are within 2^(2k-32) <= 2^-16 of 1 / (q - 1).
  * q prime: pi(i) = (alpha i + beta) mod q, alpha != 0; (alpha - 1, beta)
    is ``mulhi(h, q (q - 1))`` split by q when q (q - 1) < 2^16 (each pair
    within 2^-16 relative of 1 / (q (q - 1))), else alpha from ``h`` and beta
    from ``mix32(h)`` by ``mulhi``.

  Args:
    h: uint32 shared bits per coordinate (:func:`lane_bits`).
    rank: int32 rank (scalar or broadcastable), in [0, n).
    n: number of ranks (static).
    mulhi: :func:`mulhi` or an equal implementation (the kernels' one
      instruction).

  Returns:
    int32 strata in [0, q).
  """
  q = strata_count(n)
  if q == 1:
    return jnp.zeros(jnp.shape(h), jnp.int32)
  h = _u32(h)
  i = jnp.asarray(rank.index if isinstance(rank, Rank) else rank).astype(jnp.uint32)
  if q & (q - 1) == 0:
    low = h if q <= 1 << 8 else mix32(h)  # beta = low & (q - 1)
    prod = alpha_product(h, rank, q, mulhi=mulhi)
    return (prod ^ (low & jnp.uint32(q - 1))).astype(jnp.int32)
  if q * (q - 1) < 1 << 16:
    w = mulhi(h, q * (q - 1))
    alpha, beta = w // jnp.uint32(q) + jnp.uint32(1), w % jnp.uint32(q)
  else:  # q - 1 <= 2^16; q = 65537 (n in 65522..65535): beta by a modulo (2^-16 bias)
    alpha = mulhi(h, q - 1) + jnp.uint32(1)
    beta = mulhi(mix32(h), q) if q <= 1 << 16 else mix32(h) % jnp.uint32(q)
  return ((alpha * i + beta) % jnp.uint32(q)).astype(jnp.int32)


UNIFORM_BITS = 16
"""Resolution of each element's private uniform gamma (:func:`uniforms`)."""


# ----------------------------------------------------------------------------
# DynamiQ's rounding draws (pallas_kernels.dynamiq_block).


def uniforms(keys, rank, ranks: int, *, group, lane, mulhi=mulhi, hash_store=None,
             fraction_of=None):
  """Per-element draws in units of ``2^-16``: ``pi(rank) 2^16 + gamma``, uniform
  on [0, q 2^16) (q = 1: ``gamma``), as uint32.

  Element ``idx`` belongs to the draw group ``idx >> 4`` of 16 consecutive
  elements (:data:`GROUP`), at ``lane = idx & 15``; one :func:`group_hash`
  per group and key gives every lane its bits (:func:`lane_bits`): the
  private gamma is the top 16 bits under the rounding key ``(k0, k1)``, the
  shared stratum pi comes from the bits under ``(s0, s1)`` (:func:`stratum`).

  Args:
    keys: ``(k0, k1, s0, s1)`` uint32 scalars.
    rank: int32 scalar (used when ``ranks > 1``).
    ranks: 1 (independent draws) or the number of ranks sharing strata.
    group, lane: uint32 ``idx >> 4`` and ``idx & 15``, broadcastable against
      each other (a kernel passes the group's index per group and static lanes).
    mulhi: :func:`mulhi` or an equal implementation.
    hash_store: identity on values, applied to the groups' hashes (the XLA
      reference's :func:`~pallas_kernels.dynamiq_reference.materialize`, so
      that the fused rounding loop reads one hash per group instead of
      recomputing it for each of the group's 16 elements).
    fraction_of: the elements' sign mask (int32 -1 where the sign bit is set),
      for a power-of-two q: returns :func:`signed_draws`' draw ``v`` as the
      float32 ``w = -(1 + v / q)`` instead, built from its bits, so that ``w +
      1 = -v / q`` exactly.
  """
  k0, k1, s0, s1 = keys
  hstore = hash_store or (lambda v: v)
  word = lane_bits(hstore(group_hash(k0, k1, group)), lane)  # gamma: its top bits
  pi = None
  if ranks > 1:
    pi = stratum(lane_bits(hstore(group_hash(s0, s1, group)), lane), rank, ranks,
                 mulhi=mulhi).astype(jnp.uint32)
  if fraction_of is None:
    gamma = word >> np.uint32(32 - UNIFORM_BITS)
    return gamma if pi is None else (pi << np.uint32(UNIFORM_BITS)) | gamma
  q = strata_count(ranks) * 2**UNIFORM_BITS
  if q & (q - 1) or q > 1 << 23:
    raise ValueError(f"fraction_of needs a power-of-two q <= 2^23, not {q=}")
  shift = 23 - (q.bit_length() - 1)  # v at mantissa bits [shift, 23)
  bits = word >> np.uint32(32 - UNIFORM_BITS - shift)  # gamma << shift, and lower bits
  if pi is not None:
    bits = bits | (pi << np.uint32(UNIFORM_BITS + shift))
  field = np.uint32((q - 1) << shift)
  bits = ((bits ^ fraction_of.astype(jnp.uint32)) & field) | np.uint32(0xBF800000)
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def alpha_product(h, rank, q: int, *, mulhi=mulhi):
  """``alpha rank`` with ``alpha - 1 = mulhi(h, q - 1)``: in GF(q) for a power-of-two
  ``q``, modulo ``q`` for a prime one (uint32; ``rank`` an int32 scalar or array)."""
  h = _u32(h)
  rows = rank.rows if isinstance(rank, Rank) else None
  i = jnp.asarray(rank.index if isinstance(rank, Rank) else rank).astype(jnp.uint32)
  alpha0 = mulhi(h, q - 1)  # alpha - 1
  if q & (q - 1):
    return ((alpha0 + jnp.uint32(1)) * i) % jnp.uint32(q)
  k = q.bit_length() - 1
  if k <= 3 and jnp.ndim(i) == 0:  # the row of products with the scalar rank
    row = (_gf_row(i, k) if rows is None else _u32(rows[k - 1])) >> jnp.uint32(k)
    # (field alpha - 1 holds alpha i)
    return (row >> (alpha0 * jnp.uint32(k))) & jnp.uint32(q - 1)
  return _gf_mul(alpha0 + jnp.uint32(1), jnp.broadcast_to(i, jnp.shape(h)), k)


_ALPHA_MUL = 0x5851F42D  # the per-group multiplier's bits: (group ^ s0) times this (odd)


def lattice_draws(keys, rank, ranks: int, *, group, lane, neg, field, mulhi=mulhi,
                  hash_store=None):
  """Per-element ``F``-bit draws (uint32 on [0, 2^F), ``F = field`` per element, at most
  23), stratified over ``ranks`` and signed: ``2^F - 1 - r`` where ``neg`` (the sign
  mask) is -1.

  Each element's stratum is ``pi(rank) = alpha rank + beta`` (GF(q) for a
  power-of-two ``q`` strata, else modulo the prime ``q``): the multiplier ``alpha``
  (nonzero) is shared by the :data:`GROUP` elements of a draw group, from ``(group ^
  s0) c`` (an odd ``c``: uniform over ``s0``), and ``beta`` is the element's own, from its lane's
  shared bits (:func:`lane_bits` of ``group_hash(s0, s1, group)``). For a fixed
  ``s0`` the multiplier is fixed and ``beta`` exactly uniform over ``s1``, so every
  rank's stratum is exactly uniform; ``alpha`` is uniform over the nonzero values
  (within 2^-29), so each element's permutation is uniform over the affine maps,
  pairwise uniform over the ranks, as with an independent ``alpha`` per element
  (:func:`stratum`), and two elements' strata stay independent (their betas are).

  With ``q = 2^j`` the draw is the top ``F`` bits of ``(alpha rank) 2^(32 - j) ^
  shared ^ (private & (2^(32 - j) - 1))``, all complemented for a negative element
  (the private bits: the lane's :func:`lane_bits` under ``(k0, k1)``). Otherwise it
  is ``floor(u 2^F / (q 2^16))`` of :func:`uniforms`' ``u = pi 2^16 + gamma``
  (exact integer arithmetic), so each rank's draws stay in its stratum's ``1 / q``
  of the range.
  """
  k0, k1, s0, s1 = keys
  hstore = hash_store or (lambda v: v)
  word = lane_bits(hstore(group_hash(k0, k1, group)), lane)
  m = neg.astype(jnp.uint32)
  field = _u32(field)
  q = strata_count(ranks)
  if q == 1:
    return (word ^ m) >> (np.uint32(32) - field)
  shared = lane_bits(hstore(group_hash(s0, s1, group)), lane)
  ai = hstore(alpha_product((_u32(group) ^ _u32(s0)) * jnp.uint32(_ALPHA_MUL), rank, q,
                            mulhi=mulhi))
  if q & (q - 1) == 0:
    j = q.bit_length() - 1
    low = np.uint32((1 << (32 - j)) - 1)
    u = (ai << np.uint32(32 - j)) ^ shared ^ m ^ (word & low)
    return u >> (np.uint32(32) - field)
  beta = mulhi(shared, q)
  pi = ai + beta
  pi = jnp.where(pi >= np.uint32(q), pi - np.uint32(q), pi)
  u = (pi << np.uint32(UNIFORM_BITS)) | (word >> np.uint32(32 - UNIFORM_BITS))
  c = field - np.uint32(UNIFORM_BITS)  # F >= 16
  qq = np.uint32(q)
  r = ((u // qq) << c) + (((u % qq) << c) // qq)
  return r ^ (m & ((np.uint32(1) << field) - np.uint32(1)))


def signed_draws(u, neg, q: int):
  """The draws of the signed-domain rounding, float32: ``u`` (uint32 on [0, q),
  :func:`uniforms`) where ``neg`` (the sign mask) is 0 and ``q - 1 - u``
  where it is -1 (still uniform on the grid [0, q))."""
  m = neg.astype(jnp.uint32)
  if q & (q - 1) == 0:
    v = u ^ (m & np.uint32(q - 1))
  else:
    v = (u ^ m) + (m & np.uint32(q))
  return v.astype(jnp.float32)
