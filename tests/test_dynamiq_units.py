"""Prototype unit-packed chunk layout (pallas_kernels.dynamiq_units)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dynamiq_format as F
from pallas_kernels import dynamiq_units as U

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
KEYS = tuple(np.uint32(v) for v in (11, 22, 33, 44))


@pytest.mark.parametrize("rounding", ["up", "stochastic"])
@pytest.mark.parametrize("strata", [1, 8])
def test_same_values_as_per_class_format(rounding, strata):
  rng = np.random.default_rng(0)
  s = 12
  x = (rng.standard_normal((s, 256)) * np.exp(2 * rng.standard_normal((s, 1)))).astype(np.float32)
  x[3] = 0.0
  counts = jnp.array([4, 5, 3], jnp.int32)  # 2, 4, 8 bits
  widths = U.position_widths(counts, s)
  geo = dict(plane_bits=2, width_set=U.WIDTHS)
  units = U.units_for_budget(s, s * U.SCALE_BYTES + 64 * (4 + 10 + 12) + 100, plane_bits=2)
  p = U.compress_units_reference(jnp.asarray(x), widths, units, eps=EPS, keys=KEYS, rank=3,
                                 strata=strata, scale_rounding=rounding, **geo)
  assert p.shape == (U.payload_bytes(s, units, plane_bits=2),) and p.dtype == jnp.uint8
  got = np.asarray(U.decompress_units_reference(p, widths, units, eps=EPS, **geo))
  w = np.asarray(widths)
  for b in (2, 4, 8):
    fmt = F.Format(bits=b, eps=EPS[b], scale_rounding=rounding)
    ref = np.asarray(F.decompress_reference(
        F.compress_reference(jnp.asarray(x), fmt, keys=KEYS, rank=3, strata=strata), fmt))
    np.testing.assert_array_equal(got[w == b], ref[w == b])
  # the unused units are zero, the payload fits the per-class record bytes
  assert not np.asarray(p[s * U.SCALE_BYTES + 64 * 26:]).any()
  assert U.payload_bytes(s, 26, plane_bits=2) == sum((32 * b + 18) for b in w)


def test_hop_matches_per_class_hop():
  rng = np.random.default_rng(1)
  s = 8
  x = rng.standard_normal((s, 256)).astype(np.float32)
  y = rng.standard_normal((s, 256)).astype(np.float32)
  widths = jnp.full((s,), 4, jnp.int32)
  geo = dict(plane_bits=2, width_set=U.WIDTHS)
  units = 2 * s
  p = U.compress_units_reference(jnp.asarray(x), widths, units, eps=EPS, keys=KEYS, **geo)
  q = U.decompress_accumulate_recompress_units_reference(p, jnp.asarray(y), widths, units,
                                                         eps=EPS, keys=KEYS, **geo)
  fmt = F.Format(bits=4, eps=EPS[4])
  pr = F.compress_reference(jnp.asarray(x), fmt, keys=KEYS)
  qr = F.decompress_accumulate_recompress_reference(pr, jnp.asarray(y), fmt, keys=KEYS)
  np.testing.assert_array_equal(np.asarray(U.decompress_units_reference(q, widths, units,
                                                                       eps=EPS, **geo)),
                                np.asarray(F.decompress_reference(qr, fmt)))


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
  widths = U.position_widths_general(jnp.asarray(counts, jnp.int32), ws, s)
  w = np.asarray(widths)
  assert (np.diff(w) <= 0).all()
  used = int(sum(w // plane_bits))
  units = used + 3
  geo = dict(plane_bits=plane_bits, width_set=tuple(ws))
  p = U.compress_units_reference(jnp.asarray(x), widths, units, eps=EPS, keys=KEYS, rank=1,
                                 strata=4, **geo)
  assert p.shape == (U.payload_bytes(s, units, plane_bits),)
  assert U.payload_bytes(s, used, plane_bits) == sum(32 * b + 18 for b in w)
  assert not np.asarray(p[U.payload_bytes(s, used, plane_bits):]).any()
  got = np.asarray(U.decompress_units_reference(p, widths, units, eps=EPS, **geo))
  # the same values as the block arithmetic without any byte movement
  tabs = U._tables(EPS, tuple(ws))
  xb = jnp.asarray(x).reshape(s, 16, 16)
  idx = jnp.arange(xb.size, dtype=jnp.uint32).reshape(xb.shape)
  codes, k, unit = U.encode_block_var(xb, widths, tabs, pairs=U._pairs(tabs), idx=idx,
                                      keys=tuple(jnp.uint32(v) for v in KEYS),
                                      rank=jnp.int32(1), strata=4)
  ref = U.decode_block_var(codes, k.astype(jnp.float32) * unit[:, None], widths, tabs,
                           lookup=U._lookup(tabs))
  np.testing.assert_array_equal(got, np.asarray(ref).reshape(s, 256))


@pytest.mark.parametrize("eps", [EPS, {2: 0.23, 4: 0.05, 8: 0.02}, {2: 0.3, 4: 0.3, 8: 0.3}])
@pytest.mark.parametrize("log2", ["exact", "above", "below"])
@pytest.mark.parametrize("bracket", ["pairs", "levels"])
def test_rounding_finds_the_exact_bracket(eps, log2, bracket):
  """_round_levels_var's cheap first guess (c1 / s per group, log2, minus
  1/2) never changes the codes: with u = 0 the level is the exact bracket j
  (a > lam_j s rounds up), next to every level boundary of every width 2..8
  and for scales from tiny (the 2^64 rescaling below 2^-64) to huge; also
  with a log2 off by +-2^-20 (an approximate GPU log2); for the reference's
  bracket from level pairs and the kernels' from single levels. Subnormal
  values are left out: XLA:CPU flushes them to zero."""
  width_set = tuple(range(2, 9))
  tabs = U._tables(eps, width_set)
  lookup = U._pairs(tabs)
  off = {"exact": 0.0, "above": 2.0**-20, "below": -2.0**-20}[log2]
  fn = lambda v: jnp.log2(v) + np.float32(off)
  for i, w in enumerate(width_set):
    lam = tabs.table[tabs.base[i]:tabs.base[i] + tabs.r[i] + 1].astype(np.float64)
    for s in (1.0, 3.0e-5, 255 * 1.5e3, 2.0**-101, 2.0**-80, 2.0**-63, 2.0**-65, 3e38 / 255):
      s = np.float32(s)
      if lam[1] * s < np.finfo(np.float32).tiny:
        continue  # subnormal levels: flushed to zero by XLA:CPU
      pts = (lam[:, None] * np.float64(s)).astype(np.float32)
      a = (pts.view(np.int32) + np.arange(-8, 9)[None, :]).view(np.float32).ravel()
      a = a[((a >= np.finfo(np.float32).tiny) | (a == 0)) & (a <= s)]
      by_levels = {} if bracket == "pairs" else dict(
          levels=lambda j: jnp.take(jnp.asarray(tabs.lev), j), lbase=jnp.int32(tabs.lbase[i]))
      lvl = U._round_levels_var(jnp.asarray(a), jnp.float32(s), lookup, jnp.int32(tabs.pbase[i]),
                                jnp.int32(tabs.r[i]), jnp.float32(tabs.c1k[i]),
                                jnp.float32(tabs.k[i]), jnp.float32(tabs.c2[i]), jnp.zeros(a.shape, jnp.float32), 1,
                                log2=fn, **by_levels)
      prods = (lam * np.float64(s)).astype(np.float32).astype(np.float64)
      j = np.clip(np.searchsorted(prods, a.astype(np.float64), side="right") - 1, 0, tabs.r[i] - 1)
      # rounds up iff a - lam_j s > 0, a difference XLA:CPU flushes to 0 when subnormal
      want = j + (a - prods[j].astype(np.float32) >= np.finfo(np.float32).tiny)
      np.testing.assert_array_equal(np.asarray(lvl), want, err_msg=f"{w=} {s=}")


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
  same = [np.array_equal(np.asarray(fn(v, d, 255, div=approx)), np.asarray(fn(v, d, 255)))
          for fn in (F._ceil_quotient, F._floor_quotient)]
  assert same == [err < 2.0**-10] * 2
