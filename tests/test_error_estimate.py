"""AllReduceStats.error_estimate: the codec's own estimate of the error it added,
checked against the error actually measured against the exact mean."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax import codecs
from dynamiq_jax.bench.families import family

N, D = 8, 1 << 14


@functools.lru_cache(maxsize=None)
def _reducer(codec, schedule):
  f = lambda x: dq.allreduce(x, axis_name="i", codec=codec, schedule=schedule,
                             key=jax.random.key(3))
  return jax.jit(jax.vmap(f, axis_name="i"))


def _reduce(g, codec, schedule="ring"):
  """(measured vNMSE of rank 0's result, every rank's estimate)."""
  out, stats = _reducer(codec, schedule)(jnp.asarray(g))
  exact = np.asarray(g, np.float64).mean(0)
  err = np.sum((np.asarray(out[0], np.float64) - exact) ** 2)
  return err / max(np.sum(exact ** 2), 1e-300), np.asarray(stats.error_estimate)


# (codec, lowest and highest estimate / measured): independent rounding is what
# the estimate models; correlated rounding (the default) adds less than it.
CASES = {
    "dynamiq5-independent": (codecs.DynamiQ(bits=5, correlated=False), 0.7, 1.4),
    "dynamiq5": (codecs.DynamiQ(bits=5), 0.9, 3.0),
    "dynamiq5-248": (codecs.DynamiQ(bits=5, widths=(2, 4, 8)), 0.9, 3.0),
    "bf16": (codecs.Bf16(), 0.5, 2.0),
}


@pytest.mark.parametrize("family_name", ["dense", "paper"])
@pytest.mark.parametrize("name", list(CASES))
def test_estimate_tracks_the_measured_error(name, family_name):
  codec, lo, hi = CASES[name]
  err, est = _reduce(family(family_name, N, D, seed=1), codec)
  assert (est == est[0]).all(), "every rank reports the same estimate"
  assert lo <= est[0] / err <= hi, (est[0], err)


def test_butterfly_partials_are_counted():
  err, est = _reduce(family("dense", N, D, seed=2), codecs.DynamiQ(bits=5, correlated=False),
                     schedule="butterfly")
  assert 0.7 <= est[0] / err <= 1.4, (est[0], err)


def test_one_rank_zero_no_estimate_nan():
  g = family("dense", N, D, seed=0)
  _, est = _reduce(g, codecs.mxfp8())  # MX makes no estimate
  assert np.isnan(est).all()
  _, one = _reduce(g[:1], codecs.DynamiQ())
  assert one[0] == 0.0
  _, zero = _reduce(np.zeros((N, D), np.float32), codecs.DynamiQ(bits=5))
  assert zero[0] == 0.0


def test_noise_is_visible_to_the_user():
  """The estimate tells a user when the codec is out of its depth: 2-bit codes
  only return more noise than signal on dense gradients (vNMSE above 1), and
  the estimate says so."""
  err, est = _reduce(family("dense", N, D, seed=1), codecs.DynamiQ(bits=2.9, widths=(2,)))
  assert err > 1 and est[0] > 1


def test_compressed_psum_state_carries_the_last_estimate():
  """The transform's state holds the estimate of its last all-reduce: zero before, then
  allreduce's own. Bf16 (round to nearest: the key does not matter) is cheap to compile;
  the transform passes any codec's estimate through alike (DynamiQ's estimates are the
  tests above)."""
  g = family("dense", N, D, seed=4)
  codec = codecs.Bf16()
  tx = dq.compressed_psum("i", codec=codec)

  def step(x):
    state = tx.init(x)
    out, new = tx.update(x, state)
    return out, state.error_estimate, new.error_estimate

  out, before, est = jax.jit(jax.vmap(step, axis_name="i"))(g)
  assert (np.asarray(before) == 0).all()
  err, want = _reduce(g, codec)  # (allreduce: compiled for test_estimate_tracks_...[bf16])
  np.testing.assert_array_equal(np.asarray(est), want)
  lo, hi = CASES["bf16"][1:]
  assert lo <= float(est[0]) / err <= hi
  assert isinstance(tx.init(g[0]), dq.CompressedPsumState)


def test_two_step_partials_are_counted():
  err, est = _reduce(family("dense", N, D, seed=2), codecs.DynamiQ(bits=5, correlated=False),
                     schedule="two_step")
  assert 0.7 <= est[0] / err <= 1.4, (est[0], err)
