"""The lattice levels of DynamiQ (``level_set="lattice"``, the default): the level table,
the reciprocal of the scales, the rounding by one integer addition, and the draws."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_dtypes import bfloat16

from dynamiq_jax.codecs import DynamiQ
from pallas_kernels import dynamiq_block as B
from pallas_kernels import rng

WIDTHS = range(2, 9)


def _bits(v):
  return np.asarray(v, np.float32).view(np.uint32)


def _significant_bits(v: float) -> int:
  n = Fraction(float(v)).numerator
  while n and n % 2 == 0:
    n //= 2
  return n.bit_length()


@pytest.mark.parametrize("w", WIDTHS)
def test_levels_are_the_lattice_and_its_constants(w):
  """Each width's levels are consecutive floats with M fraction bits from 5/4, less 5/4,
  exact in float32 with at most w significant bits (so a level times k V, 8 + 8 bits,
  is exact); lattice_consts (computed from the width in the kernels) agrees: F = 23 - M,
  the top level, and the code's sign bit just above the level's bits."""
  lam, y0, field = B.lattice_table(w)
  r = 2 ** (w - 1) - 1
  assert lam.size == r + 1 and lam[0] == 0 and y0 == np.float32(B.LATTICE_Y0)
  ys = _bits(lam + y0)
  np.testing.assert_array_equal(np.diff(ys.astype(np.int64)), 1 << field)  # consecutive
  assert (ys[0] & ((1 << field) - 1)) == 0  # Y0 on the lattice
  assert max(_significant_bits(v) for v in lam) <= w
  f, sign_at, top = (np.asarray(v) for v in B.lattice_consts(jnp.asarray([w], jnp.int32)))
  assert int(f[0]) == field and top[0] == lam[-1] and _significant_bits(top[0]) <= 7
  assert int(sign_at[0]) == 1 << (field + w - 1) and (r << field) < int(sign_at[0])


def test_reciprocal_tables_are_rounded_down():
  t = B.reciprocal_tables()
  for i, d in [(k, Fraction(k)) for k in range(1, 256)] + [
      (256 + f, 1 + Fraction(f, 128)) for f in range(128)]:
    v = Fraction(float(t[i]))
    up = Fraction(float(np.nextafter(t[i], np.float32(np.inf))))
    assert v * d <= 1 < up * d, (i, float(t[i]))
  assert t[0] == 0


def test_the_reciprocals_without_a_gather_equal_the_tables():
  got = np.asarray(jax.jit(B.reciprocal_of_index)(jnp.arange(384)))
  np.testing.assert_array_equal(got.view(np.uint32), B.reciprocal_tables().view(np.uint32))


def test_the_scale_reciprocal_is_below_and_close():
  """rs <= 1 / (2 k den) for every k (the "up" rounding) or rs <= num / (2 den) for a float
  numerator (the "stochastic" one), within 2^-21, for bf16 scales in [2^-126, 2^117]
  (half scale: ROUND_Y0)."""
  r = np.random.default_rng(0)
  den = (2.0 ** r.uniform(-126, 117, 4000)).astype(bfloat16).astype(np.float32)
  k = r.integers(1, 256, den.size).astype(np.int32)
  num = r.uniform(0.25, 2, den.size).astype(np.float32)
  recip = lambda i: jnp.asarray(B.reciprocal_tables())[i]
  for n in (jnp.asarray(k), jnp.asarray(num)):
    rs = np.asarray(jax.jit(lambda a, b: B.lattice_reciprocal(a, b, recip))(n, den))
    for a, b, q in zip(np.asarray(n), den, rs):
      exact = 1 / Fraction(int(a)) if n.dtype == jnp.int32 else Fraction(float(a))
      exact /= 2 * Fraction(float(b))
      assert Fraction(float(q)) <= exact < Fraction(float(q)) * (1 + Fraction(1, 1 << 21))


@pytest.mark.parametrize("w", [2, 3, 5, 8])
def test_the_rounding_is_linear_between_neighbours(w):
  """For any y in the lattice's range the level is j + 1 with probability low / 2^F (low:
  the bits below the level's) and y - Y0 is exactly lam_j + (low / 2^F)(lam_(j+1) -
  lam_j): the expectation of the decoded level is y - Y0, so the rounding is unbiased;
  and round_lattice gives j + 1 exactly for the draws r >= 2^F - low."""
  lam, y0, field = B.lattice_table(w)
  r = np.random.default_rng(w)
  a = r.uniform(0, 1, 3000).astype(np.float32)
  rs = np.float32(lam[-1]) * np.float32(0.999)
  y = (a * rs).astype(np.float32) + y0
  z = _bits(y).astype(np.int64) - int(_bits(y0))
  j, low = z >> field, z & ((1 << field) - 1)
  lamf = [Fraction(float(v)) for v in lam]
  for yy, jj, ll in zip(y, j, low):
    p = Fraction(int(ll), 1 << field)
    nxt = lamf[jj + 1] if jj + 1 < len(lamf) else lamf[jj]
    assert lamf[jj] + p * (nxt - lamf[jj]) == Fraction(float(yy)) - Fraction(float(y0))
  draws = r.integers(0, 1 << field, a.size).astype(np.uint32)
  assert B.ROUND_Y0 == y0 / 2
  lvl = np.asarray(B.round_lattice(jnp.asarray(a), rs / np.float32(2), np.uint32(field),
                                   jnp.asarray(draws)))
  np.testing.assert_array_equal(lvl, j + (draws >= (1 << field) - low))


def _draws(strata, rank, keys, neg, field=16, groups=64):
  group = jnp.arange(groups, dtype=jnp.uint32)[:, None]
  lane = jnp.arange(16, dtype=jnp.uint32)[None, :]
  return np.asarray(rng.lattice_draws(keys, jnp.int32(rank), strata, group=group, lane=lane,
                                      neg=jnp.full((groups, 16), neg, jnp.int32),
                                      field=jnp.uint32(field)))


@pytest.mark.parametrize("strata", [2, 8, 16, 6])
def test_every_coordinate_gives_each_rank_its_own_stratum(strata):
  """For every coordinate the ranks' draws fall in distinct strata (q of the range, q =
  rng.strata_count(n)), under any key; a negative element's draw is 2^F - 1 - r."""
  q, field = rng.strata_count(strata), 16
  for seed in range(3):
    keys = tuple(jnp.uint32(v) for v in np.random.default_rng(seed).integers(0, 2**32, 4))
    d = np.stack([_draws(strata, k, keys, 0, field) for k in range(strata)]).astype(np.int64)
    # a draw r of stratum pi has pi in [floor(r q / 2^F), floor((r q + q - 1) / 2^F)] (one
    # value when q is a power of two); the ranks must fit distinct strata (greedy matching)
    lo, hi = (d * q) >> field, (d * q + q - 1) >> field
    for g in range(d.shape[1]):
      for l in range(16):
        taken = set()
        for rank in np.argsort(hi[:, g, l], kind="stable"):
          pi = next((p for p in range(lo[rank, g, l], hi[rank, g, l] + 1) if p not in taken),
                    None)
          assert pi is not None, (g, l, d[:, g, l])
          taken.add(pi)
    np.testing.assert_array_equal(_draws(strata, 1, keys, -1, field),
                                  (1 << field) - 1 - d[1])


def test_each_ranks_draws_are_uniform_over_keys():
  """A rank's draw of one coordinate over random keys: each of the 8 strata and each
  quarter inside them equally often (chi-square, 32 cells)."""
  r = np.random.default_rng(5)
  keys = r.integers(0, 2**32, (4000, 4)).astype(np.uint32)
  f = jax.jit(jax.vmap(lambda k: jnp.stack([
      rng.lattice_draws(tuple(k[i] for i in range(4)), jnp.int32(3), 8,
                        group=jnp.uint32(g), lane=jnp.uint32(l), neg=jnp.int32(0),
                        field=jnp.uint32(20)) for g, l in ((0, 0), (5, 9), (77, 15))])))
  d = np.asarray(f(jnp.asarray(keys)))
  for col in d.T:
    counts = np.bincount(col >> 15, minlength=32)
    chi2 = np.sum((counts - col.size / 32) ** 2 / (col.size / 32))
    assert chi2 < 70, chi2  # 31 degrees of freedom: p ~ 1e-4


def test_the_codec_takes_a_level_set():
  assert DynamiQ().level_set == "lattice"
  assert DynamiQ(level_set="mee").level_spec == DynamiQ().eps
  with pytest.raises(ValueError, match="level_set='uniform' must be 'lattice' or 'mee'"):
    DynamiQ(level_set="uniform")
  with pytest.raises(ValueError, match="pass level_set='mee' with it"):
    DynamiQ(eps={4: 0.2})  # silently unused otherwise
  assert DynamiQ(eps={4: 0.2}, level_set="mee").level_spec == ((4, 0.2),)
  errs = DynamiQ().width_errors()
  assert all(errs[a] > errs[b] for a, b in zip(sorted(errs), sorted(errs)[1:]))


_CONTRACTION_CHECK = """
import jax, numpy as np
from pallas_kernels import block_ops
r = np.random.default_rng(0)
a, b, c = (r.uniform(0, 1, 1 << 18).astype(np.float32) for _ in range(3))  # a b in [0, 1]
unfused = a * b + c  # numpy: the product rounded, then the sum
kept = np.asarray(jax.jit(block_ops.ref_mul_add_rounded)(a, b, c))
plain = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c))
print(int((kept != unfused).sum()), int((plain != unfused).sum()))
"""


def test_the_product_stays_rounded_as_a_users_job_compiles():
  """The lattice's ``y = fl(fl(a rs) + Y0)`` (``_mul_add_rounded``) keeps its two roundings
  where XLA:CPU fuses ``a b + c`` into an ``fma``: at the default optimisation level, in a
  child without the tests' flags. The plain expression there is the negative control."""
  import os
  import subprocess
  import sys

  from test_digests import ROOT, user_xla_flags

  env = dict(os.environ, XLA_FLAGS=user_xla_flags(), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _CONTRACTION_CHECK], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300, check=True)
  kept, plain = (int(v) for v in res.stdout.split())
  assert plain > 0, "the child did not fuse a b + c: the check would prove nothing"
  assert kept == 0, f"{kept} of 2^18 products were fused into the sum"


@pytest.mark.parametrize("w", [2, 3, 4, 5, 6, 7, 8])
def test_the_arithmetic_decode_equals_the_table(w):
  """lattice_level (a backend without a gather) gives LevelTables.dec's level of every
  code of every width, bit for bit, and a width outside [2, 8] that of its clipped one."""
  tabs = B.level_tables(B.LATTICE, (2, 3, 4, 5, 6, 8))
  codes = jnp.arange(1 << w, dtype=jnp.uint32)
  got = np.asarray(B.lattice_level(codes, jnp.full(codes.shape, w, jnp.int32)))
  want = tabs.dec[(1 << w) - 4:(1 << w) - 4 + (1 << w)]
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  if w in (2, 8):
    out = np.asarray(B.lattice_level(codes, jnp.full(codes.shape, 1 if w == 2 else 11,
                                                     jnp.int32)))
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))


def test_the_gf_rows_table_is_each_ranks_gf_row():
  """rng.gf_rows_table (which the Triton kernels read instead of computing the rows in
  every program) holds _gf_row of every rank below 8 for k = 1, 2, 3."""
  t = rng.gf_rows_table()
  for r in range(8):
    for k in (1, 2, 3):
      assert t[r, k - 1] == int(rng._gf_row(jnp.uint32(r), k)), (r, k)
