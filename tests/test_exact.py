"""``dynamiq_jax.codecs._exact``: the fast CPU ldexp equals ``jnp.ldexp`` bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs import _exact


def test_pow2_flushed_is_cpu_pow():
  """Every exponent _ldexp_cpu can meet (|k| < 300) gives 2.0 ** k's bits on this backend."""
  k = jnp.arange(-300, 300, dtype=jnp.int32)
  want = jax.jit(lambda k: 2 ** k.astype(jnp.float32))(k)
  got = jax.jit(_exact._pow2_flushed)(k)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


def _rows(seed, rows=2048):
  rng = np.random.default_rng(seed)
  top = rng.integers(-160, 128, size=(rows, 1))
  spread = rng.integers(0, 200, size=(rows, 1))
  e = top - rng.integers(0, spread + 1, size=(rows, 256))
  with np.errstate(all="ignore"):
    v = (rng.standard_normal((rows, 256)) * np.exp2(e.astype(np.float64))).astype(np.float32)
  v[rng.random(v.shape) < 0.05] = 0
  v[rng.random(v.shape) < 0.01] *= -0.0
  sub = rng.random(v.shape) < 0.02
  v.view(np.uint32)[sub] = rng.integers(0, 1 << 23, size=int(sub.sum()), dtype=np.uint32)
  v[0, 3], v[1, 5], v[3, 7] = np.nan, np.inf, -np.inf
  v[2], v[4], v[5] = 0, 2.0**-140, 3e38
  return jnp.asarray(v)


def _frexp_flushes_subnormals() -> bool:
  """jax 0.12's ``jnp.frexp`` / ``jnp.ldexp`` flush subnormal inputs to signed zero
  (documented there); jax 0.10.2's do not."""
  return float(jnp.frexp(jnp.float32(2.0**-140))[0]) == 0.0


def test_ldexp_and_row_norm_match_jnp():
  """On finite, zero, subnormal, huge and non-finite values, and shifts both ways.

  ``row_norm`` shifts by minus the exponent of its row's largest magnitude,
  from -128 to 125 (a row whose largest magnitude is subnormal is not
  shifted: XLA:CPU compares a subnormal with zero as zero); there
  ``_ldexp`` equals ``jnp.ldexp`` bit for bit on every jax version. Beyond
  that (+-140 on every element) too, except on a jax whose ``jnp.frexp``
  flushes subnormals to zero (0.12; 0.10.2 reads every subnormal as
  0.5 * 2**-149): a subnormal shifted up by more than 128 is then
  ``jnp.ldexp``'s signed zero and ``_ldexp``'s NaN (its flushed mantissa 0
  times 2**(k-1) = inf).
  """
  flushes = _frexp_flushes_subnormals()
  met = set()  # which of the cases above occurred
  for seed in range(4):
    r = _rows(seed)
    m = jnp.max(jnp.abs(r), axis=-1)
    _, e = jnp.frexp(jnp.where(jnp.isfinite(m) & (m > 0), m, 1.0))
    assert -128 <= int(jnp.min(-e)) and int(jnp.max(-e)) <= 125  # row_norm's shifts
    bits = np.asarray(r).view(np.uint32)
    subnormal = ((bits >> 23) & 0xFF == 0) & (bits & 0x7FFFFF != 0)  # numpy: XLA:CPU flushes
    for k in (-e[:, None], e[:, None], jnp.full(r.shape, 140, jnp.int32),
              jnp.full(r.shape, -140, jnp.int32)):
      want = np.asarray(jax.jit(jnp.ldexp)(r, k))
      got = np.asarray(jax.jit(_exact._ldexp)(r, k))
      shift = np.broadcast_to(np.asarray(k), r.shape)
      beyond = flushes & subnormal & (shift > 128)
      np.testing.assert_array_equal(got[~beyond].view(np.uint32), want[~beyond].view(np.uint32))
      assert np.isnan(got[beyond]).all()
      assert (want[beyond] == 0).all()
      assert (np.signbit(want[beyond]) == np.signbit(np.asarray(r)[beyond])).all()
      met |= {"subnormal"} if subnormal.any() else set()
      met |= {"beyond"} if beyond.any() else set()

    def slow(r):  # row_norm as it was written with jnp.ldexp
      m = jnp.max(jnp.abs(r), axis=-1)
      finite = jnp.isfinite(m) & (m > 0)
      _, e = jnp.frexp(jnp.where(finite, m, 1.0))
      b = _exact.bf16_round(jnp.ldexp(r, -e[..., None]))
      nrm = jnp.ldexp(jnp.sqrt(_exact.tree_sum(b * b)), e)
      return _exact.bf16_round(jnp.where(finite, nrm, m))

    np.testing.assert_array_equal(np.asarray(jax.jit(_exact.row_norm)(r)).view(np.uint32),
                                  np.asarray(jax.jit(slow)(r)).view(np.uint32))
  assert met == ({"subnormal", "beyond"} if flushes else {"subnormal"})
