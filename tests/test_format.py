"""DynamiQ's format: the block arithmetic (pallas_kernels.dynamiq_block), the payload
and its jnp reference (pallas_kernels.dynamiq_reference), and the counter-based RNG."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_dtypes import bfloat16

from dynamiq_jax.codecs import allocation
from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng

from _helpers import Jitted

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
KEYS = tuple(np.uint32(v) for v in (11, 22, 33, 44))
WS6 = (2, 3, 4, 5, 6, 8)
RJ = Jitted(R)  # the references, each call one compiled program (not op by op)


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


def _widths(s, width_set=WS6):
  """int32 [s], widest first, every width of the set at least once (s >= its size)."""
  w = np.resize(np.asarray(sorted(width_set, reverse=True)), s)
  return jnp.asarray(np.sort(w)[::-1].copy(), jnp.int32)


def _round_trip(x, widths, keys, width_set=WS6, **kw):
  units = int(np.sum(np.asarray(widths)))
  geo = dict(eps=EPS, width_set=width_set)
  p = RJ.compress_reference(x, widths, units, keys=keys, **geo, **kw)
  return RJ.decompress_reference(p, widths, units, **geo)


class TestLayout:

  def test_scale_record_and_planes_at_their_bytes(self):
    """Super-group s's scale record: 16 k bytes, then the bf16 super-group scale V
    (k V >= the group's max > (k - 1) V); then plane p of the widest super-groups
    first, one 32-byte unit each."""
    s = 3
    x = _hetero((s, 256), seed=3)
    widths = jnp.asarray([4, 3, 2], jnp.int32)
    p = np.asarray(RJ.compress_reference(x, widths, 9, eps=EPS, keys=_keys(1)))
    assert p.shape == (R.payload_bytes(s, 9),) == (s * 18 + 9 * 32,)
    rec = p[:s * 18].reshape(s, 18)
    for i in range(s):
      v = float(np.frombuffer(rec[i, 16:].tobytes(), dtype="<u2").view(bfloat16)[0])
      gmax = np.abs(np.asarray(x[i])).reshape(16, 16).max(-1)
      assert v * 255 >= gmax.max()
      assert np.all(rec[i, :16].astype(np.float64) * v >= gmax)
      assert np.all((rec[i, :16].astype(np.float64) - 1) * v < gmax)
    # units: plane 0 of sg 0, 1, 2; plane 1 of 0, 1, 2; plane 2 of 0, 1; plane 3 of 0
    body = p[s * 18:].reshape(9, 32)
    planes = np.zeros((s, 8, 32), np.uint8)
    for sg, units in enumerate([[0, 3, 6, 8], [1, 4, 7], [2, 5]]):
      planes[sg, :len(units)] = body[units]
    codes = np.asarray(RJ.codes_of_planes(jnp.asarray(planes), plane_bits=1))
    assert (codes < 2 ** np.asarray(widths)[:, None]).all()
    # and those codes are the values decompress gives: the signed level times k V
    tabs = B.level_tables(EPS, R.WIDTH_SET)
    y = np.asarray(RJ.decompress_reference(jnp.asarray(p), widths, 9, eps=EPS))
    for i, w in enumerate(np.asarray(widths)):
      dbase = tabs.dbase[tabs.widths.index(w)]
      v = np.frombuffer(rec[i, 16:].tobytes(), dtype="<u2").view(bfloat16).astype(np.float32)
      scale = np.repeat(rec[i, :16].astype(np.float32) * v, 16)
      np.testing.assert_array_equal(y[i], tabs.dec[dbase + codes[i]] * scale)

  def test_bad_plane_bits(self):
    with pytest.raises(ValueError, match="plane_bits=3"):
      R.payload_bytes(4, 4, plane_bits=3)


class TestLevels:

  @pytest.mark.parametrize("bits", range(2, 9))
  def test_tables_are_bf16_exact_and_increasing(self, bits):
    lam = B.level_table(bits, B.eps_for(bits, EPS))
    assert lam.shape == (2 ** (bits - 1),)
    assert lam[0] == 0 and lam[-1] == 1.0 and np.all(np.diff(lam) > 0)
    np.testing.assert_array_equal(lam, lam.astype(bfloat16).astype(np.float32))

  def test_mee_levels_follow_the_formula(self):
    q = 1 + 2 * 0.18**2
    want = (q ** np.arange(8) - 1) / (q**7 - 1)
    np.testing.assert_allclose(B.level_table(4, 0.18), want, rtol=2**-8)

  def test_coinciding_levels_name_the_fix(self):
    with pytest.raises(ValueError, match="use a larger eps"):
      B.level_table(8, 0.9)  # lam_1 = 1.6 / 2.62^127 underflows to lam_0 = 0

  def test_expected_error_falls_with_width(self):
    errs = [allocation.level_error(b, EPS[b]) for b in (2, 4, 8)]
    assert errs[0] > 10 * errs[1] > 100 * errs[2]


class TestRoundTrip:

  @pytest.mark.parametrize("scale_rounding", ["up", "stochastic"])
  @pytest.mark.parametrize("strata", [1, 8])
  def test_unbiased(self, scale_rounding, strata):
    """Mean of many independent encodings equals the input, within 5 sigma."""
    self._check_unbiased(strata, scale_rounding=scale_rounding)

  def test_the_unbiasedness_check_catches_log_domain_rounding(self, monkeypatch):
    """Negative control: the authors' CUDA kernel rounds MEE levels in the log
    domain (spec §1.15.1), inflating magnitudes by ~3% at 4 bits."""

    def log_domain(a, s, c, u_scaled, frac, q, **kw):
      lam_real = jnp.log2(1 + a / jnp.where(s > 0, s, 1.0) * (c.c1k / c.k)) * c.c2
      j = jnp.clip(jnp.floor(lam_real), 0, c.r - 1)
      u = jnp.abs(frac + 1) if frac is not None else u_scaled / q
      return (j + (u < lam_real - j)).astype(jnp.int32)

    monkeypatch.setattr(B, "round_levels", log_domain)
    with pytest.raises(AssertionError):
      self._check_unbiased(1)

  def _check_unbiased(self, strata, **kw):
    # Half Gaussian super-groups, half "spiky" ones (one large value per group,
    # the rest near zero, where level spacing and any bias are largest).
    x = np.array(_hetero((12, 256), seed=4))
    spiky = np.random.default_rng(4).normal(0, 0.03, (6, 16, 16))
    spiky[:, :, 0] = 1.0
    x[6:] = spiky.reshape(6, 256) * np.abs(x[6:]).max(1, keepdims=True)
    x = jnp.asarray(x.astype(np.float32))
    widths = _widths(12)
    draws = 2048

    def one(seed):
      return _round_trip(x, widths, _keys(seed), rank=3, strata=strata, **kw)

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

  def test_decoded_values_are_exact_products(self):
    """decoded = ±lam[level] * k * V exactly: no rounding for FMA to change."""
    # _round_trip's shape and arguments: its two compiled references serve both
    x = _hetero((6, 256), seed=5)
    widths = _widths(6)
    units = int(np.sum(np.asarray(widths)))
    geo = dict(eps=EPS, width_set=WS6)
    p = RJ.compress_reference(x, widths, units, keys=_keys(2), **geo)
    y = np.asarray(RJ.decompress_reference(p, widths, units, **geo), np.float64)
    rec = np.asarray(p)[:6 * 18].reshape(6, 18)
    v = np.frombuffer(rec[:, 16:].tobytes(), dtype="<u2").view(bfloat16).astype(np.float64)
    scale = np.repeat(rec[:, :16].astype(np.float64) * v[:, None], 16, axis=1)
    for i, w in enumerate(np.asarray(widths)):
      lam = B.level_table(int(w), B.eps_for(int(w), EPS)).astype(np.float64)
      t = np.abs(y[i]) / np.where(scale[i] > 0, scale[i], 1.0)
      assert np.isin(t, lam).all(), w  # each magnitude a level times the group scale

  @pytest.mark.parametrize("power", [100, -100])
  def test_power_of_two_scaling_is_exact(self, power):
    """x * 2^k encodes to the same codes and decodes to exactly 2^k times (1e+-30).

    Rows span 2^+-5 here: scales of rows far below 1e-30 would be bf16
    subnormals, where no float format keeps its relative precision.
    """
    r = np.random.default_rng(6)
    x = jnp.asarray((r.standard_normal((6, 256)) * 2.0 ** r.uniform(-5, 5, (6, 1)))
                    .astype(np.float32))
    s = np.float32(2.0**power)
    d1 = _round_trip(x, _widths(6), _keys(3))
    d2 = _round_trip(x * s, _widths(6), _keys(3))
    assert np.all(np.isfinite(np.asarray(d2)))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(d1) * s)

  def test_zeros_nan_inf(self):
    x = np.array(_hetero((6, 256), seed=7))
    x[1] = 0.0
    x[2, 17] = np.nan
    x[3, 200] = np.inf
    y = np.asarray(_round_trip(jnp.asarray(x), _widths(6), _keys(4)))
    np.testing.assert_array_equal(y[1], 0.0)
    assert np.all(np.isfinite(y[0]))
    # A non-finite input poisons its scale group; never yields a finite value there.
    grp = lambda i: slice(i // 16 * 16, i // 16 * 16 + 16)
    assert not np.any(np.isfinite(y[2, grp(17)]))
    assert not np.any(np.isfinite(y[3, grp(200)]))

  def test_hop_equals_composition(self):
    x = _hetero((6, 256), seed=8)
    widths = _widths(6)
    geo = dict(eps=EPS, width_set=WS6)
    enc = dict(rank=2, strata=4, **geo)  # the hop's encode also makes its input (one compile)
    p = RJ.compress_reference(x, widths, 27, keys=_keys(5), **enc)
    a = RJ.decompress_accumulate_recompress_reference(p, x, widths, 27, keys=_keys(6), **enc)
    b = RJ.compress_reference(RJ.decompress_reference(p, widths, 27, **geo) + x, widths, 27,
                             keys=_keys(6), **enc)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("plane_bits,width_set", [(1, (2, 3, 4, 5, 6, 8)), (1, (2, 4, 8)),
                                                  (2, (2, 4, 8))])
def test_planes_roundtrip_any_widths(plane_bits, width_set):
  rng = np.random.default_rng(2)
  s = 14
  x = rng.standard_normal((s, 256)).astype(np.float32)
  ws = sorted(width_set)
  counts = np.zeros(len(ws), np.int64)
  counts[:] = s // len(ws)
  counts[0] += s - counts.sum()
  widths = RJ.position_widths(jnp.asarray(counts, jnp.int32), tuple(ws), s)
  w = np.asarray(widths)
  assert (np.diff(w) <= 0).all()
  used = int(sum(w // plane_bits))
  units = used + 3
  geo = dict(plane_bits=plane_bits, width_set=tuple(ws))
  p = RJ.compress_reference(jnp.asarray(x), widths, units, eps=EPS, keys=KEYS, rank=1,
                                 strata=4, **geo)
  assert p.shape == (R.payload_bytes(s, units, plane_bits),)
  assert R.payload_bytes(s, used, plane_bits) == sum(32 * b + 18 for b in w)
  assert not np.asarray(p)[R.payload_bytes(s, used, plane_bits):].any()
  got = np.asarray(RJ.decompress_reference(p, widths, units, eps=EPS, **geo))
  # the same values as the block arithmetic without any byte movement
  tabs = B.level_tables(EPS, tuple(ws))

  @jax.jit  # one compile, as the reference's (eagerly: one per operation)
  def block(xb, widths):
    idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
    codes, k, sg_scale = B.encode_block(xb, widths, tabs,
                                        keys=tuple(jnp.uint32(v) for v in KEYS),
                                        rank=jnp.int32(1), strata=4, idx=idx,
                                        draw_group=idx >> np.uint32(4), lane=idx & np.uint32(15),
                                        pairs=lambda i: jnp.asarray(tabs.pairs)[i])
    return B.decode_block(codes, B.decoded_scale(k, sg_scale), widths, tabs,
                          lookup=lambda i: jnp.asarray(tabs.dec)[i])

  ref = block(jnp.asarray(x).reshape(s, 16, 16), widths)
  np.testing.assert_array_equal(got, np.asarray(ref).reshape(s, 256))


@functools.partial(jax.jit, static_argnames=("bracket",))
def _round_levels(a, s, base, r, c1k, k, c2, table, off, *, bracket):
  """``B.round_levels`` with u = 0 under one jit: every point of a case at once, each
  with its own scale and width's constants (the block arithmetic broadcasts them)."""
  table_fn = lambda i: jnp.take(table, i)
  kw = dict(pairs=table_fn) if bracket == "pairs" else dict(levels=table_fn)
  return B.round_levels(a, s, B.WidthConsts(base, r, c1k, k, c2), jnp.zeros_like(a), None, 1,
                        ops=B.BlockOps(log2=lambda v: jnp.log2(v) + off), **kw)


@pytest.mark.parametrize("eps", [EPS, {2: 0.23, 4: 0.05, 8: 0.02}, {2: 0.3, 4: 0.3, 8: 0.3}])
@pytest.mark.parametrize("log2", ["exact", "above", "below"])
@pytest.mark.parametrize("bracket", ["pairs", "levels"])
def test_rounding_finds_the_exact_bracket(eps, log2, bracket):
  """round_levels's cheap first guess (c1 / s per group, log2, minus
  1/2) never changes the codes: with u = 0 the level is the exact bracket j
  (a > lam_j s rounds up), next to every level boundary of every width 2..8
  and for scales from tiny (the 2^64 rescaling below 2^-64) to huge; also
  with a log2 off by +-2^-20 (an approximate GPU log2); for the reference's
  bracket from level pairs and the kernels' from single levels. Subnormal
  values are left out: XLA:CPU flushes them to zero."""
  width_set = tuple(range(2, 9))
  tabs = B.level_tables(eps, width_set)
  off = {"exact": 0.0, "above": 2.0**-20, "below": -2.0**-20}[log2]
  points, wants, labels = [], [], []
  for i, w in enumerate(width_set):
    lam = tabs.table[tabs.base[i]:tabs.base[i] + tabs.r[i] + 1].astype(np.float64)
    for s in (1.0, 3.0e-5, 255 * 1.5e3, 2.0**-101, 2.0**-80, 2.0**-63, 2.0**-65, 3e38 / 255):
      s = np.float32(s)
      if lam[1] * s < np.finfo(np.float32).tiny:
        continue  # subnormal levels: flushed to zero by XLA:CPU
      pts = (lam[:, None] * np.float64(s)).astype(np.float32)
      a = (pts.view(np.int32) + np.arange(-8, 9)[None, :]).view(np.float32).ravel()
      a = a[((a >= np.finfo(np.float32).tiny) | (a == 0)) & (a <= s)]
      prods = (lam * np.float64(s)).astype(np.float32).astype(np.float64)
      j = np.clip(np.searchsorted(prods, a.astype(np.float64), side="right") - 1, 0, tabs.r[i] - 1)
      # rounds up iff a - lam_j s > 0, a difference XLA:CPU flushes to 0 when subnormal
      wants.append(j + (a - prods[j].astype(np.float32) >= np.finfo(np.float32).tiny))
      base = tabs.pbase[i] if bracket == "pairs" else tabs.lbase[i]
      consts = (s, base, tabs.r[i], tabs.c1k[i], tabs.k[i], tabs.c2[i])
      points.append([np.full(a.shape, v) for v in consts])
      points[-1].insert(0, a)
      labels += [f"{w=} {s=}"] * a.size
  a, s, base, r, c1k, k, c2 = (np.concatenate(col) for col in zip(*points))
  table = tabs.pairs if bracket == "pairs" else tabs.lev
  lvl = np.asarray(_round_levels(
      jnp.asarray(a, jnp.float32), jnp.asarray(s, jnp.float32), jnp.asarray(base, jnp.int32),
      jnp.asarray(r, jnp.int32), jnp.asarray(c1k, jnp.float32), jnp.asarray(k, jnp.float32),
      jnp.asarray(c2, jnp.float32), jnp.asarray(table), jnp.float32(off), bracket=bracket))
  want = np.concatenate(wants)
  bad = np.flatnonzero(lvl != want)
  assert not bad.size, [(labels[i], a[i], lvl[i], want[i]) for i in bad[:10]]


@pytest.mark.parametrize("err", [2.0**-21, -2.0**-21, 2.0**-6])
def test_scale_quotients_with_an_approximate_division(err):
  """The scales' quotients (k = ceil(gmax / U), the stochastic floor) stay exact
  when their first guess comes from a division off by a few ulp (the kernels'
  div.approx.ftz.f32, 2 ulp for divisors in [2^-126, 2^126]); a guess off by
  2^-6 (4 at a quotient of 255) is caught. Divisors from 2^-126 to 2^100 (bf16
  units reach about 2^118); subnormal ones, which the kernels scale by 2^64
  first, cannot be checked here: XLA:CPU flushes them to zero."""
  rng = np.random.default_rng(0)
  # bf16-exact divisors, quotients at and next to every integer 0..255
  d = ((rng.integers(0, 2**7, 4096) | 2**7) * np.exp2(rng.integers(-133, 93, 4096)))
  d = d.astype(np.float32)
  q = rng.integers(0, 256, d.size).astype(np.float64) + rng.choice([-1e-6, 0.0, 1e-6, 0.5],
                                                                   d.size)
  v = (np.clip(q, 0, None) * d.astype(np.float64)).astype(np.float32)
  v, d = jnp.asarray(v), jnp.asarray(d)
  approx = lambda a, b: a / b * np.float32(1.0 + err)
  # each function under one jit (eagerly: a compile per operation)
  both = jax.jit(lambda v, d, fn: (fn(v, d, 255, div=approx), fn(v, d, 255)), static_argnums=2)
  same = [np.array_equal(*map(np.asarray, both(v, d, fn)))
          for fn in (B.ceil_quotient, B.floor_quotient)]
  assert same == [err < 2.0**-10] * 2


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
    a = np.broadcast_to(np.arange(1, q, dtype=np.uint32)[:, None], (q - 1, q))
    b = np.broadcast_to(np.arange(q, dtype=np.uint32)[None, :], (q - 1, q))
    prod = np.asarray(jax.jit(rng._gf_mul, static_argnums=2)(a, b, k))  # one compile
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
  """The reference stores a few intermediates before use (materialize)."""

  @pytest.mark.parametrize("first", [0.0, -0.0, np.nan, -np.inf, 3.5])
  def test_identity(self, first):
    v = jnp.asarray(np.array([first, -1.0, 2.0, np.nan], np.float32))
    out = jax.jit(R.materialize)(v)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), np.asarray(v).view(np.uint32))
    assert jax.jit(R.materialize)(jnp.zeros((0, 3))).shape == (0, 3)

  def test_identity_under_vmap(self):
    v = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32))
    np.testing.assert_array_equal(jax.jit(jax.vmap(R.materialize))(v), v)

  @pytest.mark.parametrize("strata", [1, 4])
  def test_compiled_reference_keeps_the_stores(self, strata):
    # What the CPU speed rests on (see materialize): the one-trip loops must
    # survive XLA's simplifier, or the encode falls back to the slow fused loop.
    # Stored: the input, the element scales, 5 width constants (widths are
    # data), the first guess's 2 per-group factors, and one hash per key.
    x = jnp.zeros((4, B.SUPERGROUP), jnp.float32)
    w = jnp.asarray([8, 4, 3, 2], jnp.int32)
    hlo = jax.jit(lambda x, w, k: R.compress_reference(x, w, 17, eps=EPS, keys=tuple(k), rank=1,
                                                       strata=strata)
                  ).lower(x, w, jnp.arange(4, dtype=jnp.uint32)).compile().as_text()
    assert hlo.count(" while(") == 1 + 1 + 5 + 2 + (2 if strata > 1 else 1), hlo
