"""Bad input never degrades silently: non-finite values, huge values, one rank."""

import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax import codecs

from _helpers import rows_identical

CODECS = {
    "dynamiq": codecs.DynamiQ(), "bf16": codecs.Bf16(), "f32": codecs.F32(),
    "mxfp8": codecs.mxfp8(), "mxfp4": codecs.mxfp4(), "mxfp8_ocp": codecs.MX(scale="e8m0"),
    "thc": codecs.THC(), "globalqsgd": codecs.GlobalQSGD(), "omnireduce": codecs.OmniReduce(),
    "arctopk": codecs.ARCTopK(row=64),
}
N, D = 4, 2048  # every leaf below is one bucket of D coordinates


def _leaves(seed=0):
  rng = np.random.default_rng(seed)
  g = lambda: rng.standard_normal((N, D)).astype(np.float32)
  tree = {"normal": g(), "nan": g(), "inf": g(), "ninf": g(), "rank_nan": g()}
  tree["nan"][2, 1000] = np.nan
  tree["inf"][0, 5] = np.inf
  tree["ninf"][3, 2047] = -np.inf
  tree["rank_nan"][1] = np.nan
  big = g()
  tree["big"] = big / np.abs(big).max() * np.float32(3e38)  # mean finite, near float32's max
  return tree


# The leaves two at a time, (first bucket, second bucket): one compiled program of two
# buckets runs all three pairs (a program's compile time grows with its buckets). Each
# finite bucket comes after a non-finite one, in the same call.
PAIRS = (("rank_nan", "normal"), ("inf", "big"), ("ninf", "nan"))


# mxfp4: .ci/run-slow (a compile of its own); mxfp8 runs the same MX code with the adaptive
# scale and its state (another element grid), and every codec's bucket sits behind the same
# guard (dynamiq_jax.engine.guard), which these values exercise.
@pytest.mark.parametrize("name", [pytest.param(c, marks=pytest.mark.slow) if c == "mxfp4" else c
                                  for c in CODECS])
def test_nonfinite_stays_nonfinite_and_finite_stays_finite(name):
  codec = CODECS[name]
  tree = _leaves()
  out = {}
  for first, second in PAIRS:  # buckets go in reverse leaf order: "b" first
    pair, state = dq.simulate({"a": tree[second], "b": tree[first]}, codec=codec,
                              bucket_size=D, return_state=True)
    pair = {k: np.asarray(v) for k, v in pair.items()}
    assert rows_identical(pair)
    out[first], out[second] = pair["b"], pair["a"]
    if state is not None:  # a NaN step must not poison the codec's state
      assert all(np.isfinite(np.asarray(s)).all() for s in state)
  assert not np.isfinite(out["nan"][:, 1000]).any()
  assert not np.isfinite(out["inf"][:, 5]).any()
  assert not np.isfinite(out["ninf"][:, 2047]).any()
  assert not np.isfinite(out["rank_nan"]).any()
  assert np.isfinite(out["normal"]).all() and np.isfinite(out["big"]).all()
  mean = tree["big"].astype(np.float64).mean(0)
  err = np.sum((out["big"] - mean) ** 2) / np.sum(mean**2)
  small = np.sum((out["normal"] - tree["normal"].mean(0)) ** 2) / np.sum(
      tree["normal"].mean(0) ** 2)
  assert err < 2 * small + 1e-6  # scaled exactly: as accurate as an ordinary bucket


@pytest.mark.parametrize("name", list(CODECS))
def test_one_rank_is_the_identity(name):
  rng = np.random.default_rng(1)
  tree = {"a": rng.standard_normal((1, 3000)).astype(np.float32),
          "b": jnp.asarray(rng.standard_normal((1, 17, 5)), jnp.bfloat16)}
  out = dq.simulate(tree, codec=CODECS[name])
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
  assert dq.wire_stats(tree["a"][0], codec=CODECS[name], n=1).bits_per_coord == 0
