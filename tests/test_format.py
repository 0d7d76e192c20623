"""The DynamiQ wire format and the counter-based RNG (pallas_kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ml_dtypes import bfloat16

from dynamiq_jax.codecs import allocation
from pallas_kernels import dynamiq_format as F
from pallas_kernels import rng

ALL_FORMATS = [
    F.Format(bits=b, levels=lv, eps={2: 0.23, 4: 0.18, 8: 0.10}[b], hierarchical=h,
             scale_rounding=sr)
    for b in (2, 4, 8) for lv in ("mee", "uniform") for h in (True, False)
    for sr in (("up", "stochastic") if h else ("up",))
]


def _ids(f):
  return f"b{f.bits}-{f.levels}-{'hier' if f.hierarchical else 'flat'}-{f.scale_rounding}"


def _keys(seed):
  k0, k1 = rng.derive_key(seed, 11)  # private part
  s0, s1 = rng.derive_key(seed, 13)  # shared part (same on every rank, new per step)
  return (k0, k1, s0, s1)


def _hetero(shape, seed=0):
  """Super-groups with magnitudes spread over many octaves, some exact zeros."""
  r = np.random.default_rng(seed)
  x = r.standard_normal(shape) * np.exp(r.normal(0, 3, (shape[0], 1)))
  x[0, :16] = 0.0
  x[1, 5] = 0.0
  return jnp.asarray(x.astype(np.float32))


class TestLayout:

  @pytest.mark.parametrize("bits", [2, 4, 8])
  def test_hierarchical_record_is_32b_plus_18(self, bits):
    fmt = F.Format(bits=bits)
    assert fmt.record_bytes == 32 * bits + 18
    x = _hetero((3, 256))
    assert F.compress_reference(x, fmt, keys=_keys(0)).shape == (3, 32 * bits + 18)

  @pytest.mark.parametrize("bits,gs", [(2, 32), (4, 16), (8, 64), (4, 256)])
  def test_flat_record(self, bits, gs):
    fmt = F.Format(bits=bits, hierarchical=False, group_size=gs)
    assert fmt.record_bytes == 32 * bits + 2 * 256 // gs

  @settings(max_examples=25, deadline=None)
  @given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 4), seed=st.integers(0, 2**16))
  def test_pack_roundtrip_lsb_first(self, bits, rows, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, 256)).astype(np.uint8)
    packed = np.asarray(F.pack_codes(jnp.asarray(codes), bits))
    assert packed.shape == (rows, 256 * bits // 8)
    per = 8 // bits
    # Coordinate k sits at bits [bits*(k % per), ...) of byte k // per.
    k = np.arange(256)
    got = (packed[:, k // per] >> (bits * (k % per))) & (2**bits - 1)
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(np.asarray(F.unpack_codes(jnp.asarray(packed), bits)), codes)

  def test_hierarchical_byte_positions(self):
    fmt = F.Format(bits=4)
    x = _hetero((2, 256), seed=3)
    p = np.asarray(F.compress_reference(x, fmt, keys=_keys(1)))
    rec = p[1]
    # Group g: 8 code bytes then its k byte; last 2 bytes the bf16 unit.
    k = rec[np.arange(16) * 9 + 8]
    unit = np.frombuffer(rec[-2:].tobytes(), dtype="<u2").view(bfloat16)[0]
    gmax = np.abs(np.asarray(x[1])).reshape(16, 16).max(-1)
    assert float(unit) * 255 >= gmax.max()
    assert np.all(k.astype(np.float64) * float(unit) >= gmax)
    assert np.all((k.astype(np.float64) - 1) * float(unit) < gmax)

  def test_bad_formats(self):
    with pytest.raises(ValueError, match="bits=3"):
      F.Format(bits=3)
    with pytest.raises(ValueError, match="group_size=24"):
      F.Format(bits=4, hierarchical=False, group_size=24)
    with pytest.raises(ValueError, match="levels"):
      F.Format(bits=4, levels="log")
    with pytest.raises(ValueError, match="stochastic"):
      F.Format(bits=4, hierarchical=False, scale_rounding="stochastic")
    with pytest.raises(ValueError, match=r"\[supergroups, 256\]"):
      F.compress_reference(jnp.zeros((4, 100)), F.Format(bits=4), keys=_keys(0))


class TestLevels:

  @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_ids)
  def test_tables_are_bf16_exact_and_increasing(self, fmt):
    lam = fmt.table()
    assert lam.shape == (fmt.top + 1,)
    assert lam[0] == 0 and np.all(np.diff(lam) > 0)
    np.testing.assert_array_equal(lam, lam.astype(bfloat16).astype(np.float32))
    assert lam[-1] == (fmt.top if fmt.levels == "uniform" else 1.0)

  def test_mee_levels_follow_the_formula(self):
    fmt = F.Format(bits=4, eps=0.18)
    q = 1 + 2 * 0.18**2
    want = (q ** np.arange(8) - 1) / (q**7 - 1)
    np.testing.assert_allclose(fmt.table(), want, rtol=2**-8)

  def test_expected_error_falls_with_width(self):
    errs = [allocation.expected_error(F.Format(bits=b)) for b in (2, 4, 8)]
    assert errs[0] > 10 * errs[1] > 100 * errs[2]


class TestRoundTrip:

  @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_ids)
  @pytest.mark.parametrize("strata", [1, 8])
  def test_unbiased(self, fmt, strata):
    """Mean of many independent encodings equals the input, within 5 sigma."""
    self._check_unbiased(fmt, strata)

  def test_the_unbiasedness_check_catches_log_domain_rounding(self, monkeypatch):
    """Negative control: the authors' CUDA kernel rounds MEE levels in the log
    domain (spec §1.15.1), inflating magnitudes by ~3% at 4 bits."""
    fmt = F.Format(bits=4, eps=0.18)
    q = 1 + 2 * 0.18**2

    def log_domain(a, s, fmt, lookup, u_scaled, nq):
      t = a / jnp.where(s > 0, s, 1.0)
      lam_real = jnp.log1p(t * np.float32(q**7 - 1)) / np.float32(np.log(q))
      j = jnp.clip(jnp.floor(lam_real), 0, 6)
      return (j + (u_scaled < (lam_real - j) * nq)).astype(jnp.int32)

    monkeypatch.setattr(F, "_round_levels", log_domain)
    with pytest.raises(AssertionError):
      self._check_unbiased(fmt, 1)

  def _check_unbiased(self, fmt, strata):
    # Half Gaussian super-groups, half "spiky" ones (one large value per group,
    # the rest near zero, where level spacing and any bias are largest).
    x = np.array(_hetero((8, 256), seed=fmt.bits))
    spiky = np.random.default_rng(fmt.bits).normal(0, 0.03, (4, 16, 16))
    spiky[:, :, 0] = 1.0
    x[4:] = spiky.reshape(4, 256) * np.abs(x[4:]).max(1, keepdims=True)
    x = jnp.asarray(x.astype(np.float32))
    draws = 2048

    def one(seed):
      p = F.compress_reference(x, fmt, keys=_keys(seed), rank=3, strata=strata)
      return F.decompress_reference(p, fmt)

    y = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(draws)), np.float64)
    mean = y.mean(0)
    var = y.var(0, ddof=1)
    xs = np.asarray(x, np.float64)
    # Per-coordinate z-scores mislead where one outcome is too rare to be seen
    # in `draws` tries, so test sums: per super-group and overall, plain and
    # signed (the signed sum catches magnitude inflation, e.g. the authors'
    # log-domain MEE rounding, +3% at 4 bits).
    err = mean - xs
    for w in (np.ones_like(xs), np.sign(xs)):
      z_sg = np.sum(w * err, 1) / np.sqrt(np.sum(var, 1) / draws + 1e-300)
      assert np.max(np.abs(z_sg)) < 5.0, z_sg
      z_all = np.sum(w * err) / np.sqrt(np.sum(var) / draws)
      assert abs(z_all) < 5.0, z_all

  @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_ids)
  def test_decoded_products_are_exact(self, fmt):
    """decoded = lam[code] * scale exactly: no rounding for FMA to change."""
    x = _hetero((4, 256), seed=5)
    p = F.compress_reference(x, fmt, keys=_keys(2))
    packed, scale = F._disassemble(p, fmt)
    codes = F.unpack_codes(packed.reshape(packed.shape[0], -1), fmt.bits)
    lam = fmt.table().astype(np.float64)
    lvl = np.asarray(codes, np.int64) - fmt.top
    want = np.sign(lvl) * lam[np.abs(lvl)] * np.repeat(np.asarray(scale, np.float64),
                                                        256 // fmt.groups, axis=1)
    np.testing.assert_array_equal(np.asarray(F.decompress_reference(p, fmt), np.float64), want)

  @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_ids)
  @pytest.mark.parametrize("power", [100, -100])
  def test_power_of_two_scaling_is_exact(self, fmt, power):
    """x * 2^k encodes to the same codes and decodes to exactly 2^k times (1e+-30).

    Rows span 2^+-5 here: units of rows far below 1e-30 would be bf16
    subnormals, where no float format keeps its relative precision.
    """
    r = np.random.default_rng(6)
    x = jnp.asarray((r.standard_normal((4, 256)) * 2.0 ** r.uniform(-5, 5, (4, 1))).astype(np.float32))
    s = np.float32(2.0**power)
    d1 = F.decompress_reference(F.compress_reference(x, fmt, keys=_keys(3)), fmt)
    d2 = F.decompress_reference(F.compress_reference(x * s, fmt, keys=_keys(3)), fmt)
    assert np.all(np.isfinite(np.asarray(d2)))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d1) * s)

  @pytest.mark.parametrize("fmt", ALL_FORMATS, ids=_ids)
  def test_zeros_nan_inf(self, fmt):
    x = np.array(_hetero((4, 256), seed=7))
    x[1] = 0.0
    x[2, 17] = np.nan
    x[3, 200] = np.inf
    y = np.asarray(F.decompress_reference(F.compress_reference(jnp.asarray(x), fmt,
                                                               keys=_keys(4)), fmt))
    np.testing.assert_array_equal(y[1], 0.0)
    assert np.all(np.isfinite(y[0]))
    # A non-finite input poisons its scale group; never yields a finite value there.
    g = 16 if fmt.hierarchical else fmt.group_size
    grp = lambda i: slice(i // g * g, i // g * g + g)
    assert not np.any(np.isfinite(y[2, grp(17)]))
    assert not np.any(np.isfinite(y[3, grp(200)]))

  def test_dae_equals_composition(self):
    fmt = F.Format(bits=4)
    x = _hetero((4, 256), seed=8)
    p = F.compress_reference(x, fmt, keys=_keys(5))
    a = F.decompress_accumulate_recompress_reference(p, x, fmt, keys=_keys(6), rank=2, strata=4)
    b = F.compress_reference(F.decompress_reference(p, fmt) + x, fmt, keys=_keys(6),
                             rank=2, strata=4)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class TestRng:

  def test_uniform24_range_and_resolution(self):
    h = jnp.array([0, 255, 256, 2**32 - 1], jnp.uint32)
    u = np.asarray(rng.uniform24(h))
    np.testing.assert_array_equal(u, [0.0, 0.0, 2.0**-24, 1 - 2.0**-24])

  def test_hash_is_uniform(self):
    h = rng.hash_index(123, 456, jnp.arange(1 << 16))
    counts = np.bincount(np.asarray(h >> 24), minlength=256)
    chi2 = np.sum((counts - 256.0) ** 2 / 256.0)
    assert chi2 < 400  # 255 dof: mean 255, sd 22.6

  @pytest.mark.parametrize("n", [2, 3, 100, 1000])
  def test_uniform_int(self, n):
    v = np.asarray(rng.uniform_int(rng.hash_index(1, 2, jnp.arange(1 << 16)), n))
    assert v.min() >= 0 and v.max() < n
    # exact for 24-bit inputs: floor(m n / 2^24)
    m = np.arange(0, 1 << 24, 4099, dtype=np.int64)
    got = np.asarray(rng.uniform_int(jnp.asarray((m << 8).astype(np.uint32)), n))
    np.testing.assert_array_equal(got, (m * n) >> 24)

  @pytest.mark.parametrize("k", range(1, 11))
  def test_gf_polynomials_are_irreducible(self, k):
    q = 1 << k
    a = jnp.broadcast_to(jnp.arange(1, q, dtype=jnp.uint32)[:, None], (q - 1, q))
    b = jnp.broadcast_to(jnp.arange(q, dtype=jnp.uint32)[None, :], (q - 1, q))
    prod = np.asarray(rng._gf_mul(a, b, k))
    assert all(len(set(row)) == q for row in prod)  # x -> alpha x is a bijection

  def test_lane_bits_pairs_are_well_spread(self):
    """rng.lane_bits: each lane's multiplier is odd (a bijection: exact
    marginals), and for every pair of lanes the lattice of (h K_i, h K_j)
    has no vector shorter than 2^13.5 (Gauss reduction of (1, K_j / K_i),
    (0, 2^32))."""
    k = [int(v) for v in np.asarray(rng.lane_bits(jnp.uint32(1), jnp.arange(rng.GROUP)))]
    assert all(v % 2 for v in k) and len(set(k)) == rng.GROUP
    m = 1 << 32

    def shortest(a):
      u, v = (1, a % m), (0, m)
      norm = lambda w: w[0] * w[0] + w[1] * w[1]
      if norm(u) > norm(v):
        u, v = v, u
      while True:
        t = round((u[0] * v[0] + u[1] * v[1]) / norm(u))
        v = (v[0] - t * u[0], v[1] - t * u[1])
        if norm(v) >= norm(u):
          return norm(u) ** 0.5
        u, v = v, u

    worst = min(shortest(kj * pow(ki, -1, m)) for ki in k for kj in k if ki != kj)
    assert worst > 2.0**13.5, np.log2(worst)

  @pytest.mark.parametrize("n", [2, 5, 6, 8, 12, 64])
  def test_stratum_is_a_pairwise_uniform_permutation(self, n):
    q = rng.strata_count(n)
    h = rng.hash_index(9, 9, jnp.arange(40000))
    pis = np.stack([np.asarray(rng.stratum(h, r, n)) for r in range(n)], 1)
    assert pis.min() >= 0 and pis.max() < q
    assert all(len(set(row)) == n for row in pis[:2000])
    if q <= 16:
      pairs = np.bincount(pis[:, 0] * q + pis[:, 1], minlength=q * q).reshape(q, q)
      off = pairs[~np.eye(q, dtype=bool)]
      assert np.all(np.diag(pairs) == 0)
      expect = pis.shape[0] / (q * (q - 1))
      assert np.all(np.abs(off - expect) < 6 * np.sqrt(expect))


class TestMaterialize:
  """The reference stores an encode's input and (2/4 bits) its draws before use."""

  @pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 3.5])
  def test_identity(self, first):
    v = jnp.asarray(np.array([first, -1.0, 2.0, np.nan], np.float32))
    out = jax.jit(F.materialize)(v)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(v).view(np.uint32))
    assert jax.jit(F.materialize)(jnp.zeros((0, 3))).shape == (0, 3)

  def test_identity_under_vmap(self):
    v = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32))
    np.testing.assert_array_equal(jax.jit(jax.vmap(F.materialize))(v), v)

  @pytest.mark.parametrize("bits,stores", [(2, 2), (4, 2), (8, 1)])
  def test_compiled_reference_keeps_the_stores(self, bits, stores):
    # What the CPU speed rests on (see materialize): the one-trip loops must
    # survive XLA's simplifier, or the encode falls back to the slow fused loop.
    fmt = F.Format(bits=bits)
    x = jnp.zeros((4, F.SUPERGROUP), jnp.float32)
    hlo = jax.jit(lambda x, k: F.compress_reference(x, fmt, keys=tuple(k), rank=1, strata=4)
                  ).lower(x, jnp.arange(4, dtype=jnp.uint32)).compile().as_text()
    assert hlo.count(" while(") == stores, hlo
