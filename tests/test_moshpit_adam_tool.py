"""``tools/moshpit_adam.py``: the mixing matrices it trains with are the library's rounds."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np

import dynamiq_jax as dq

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "moshpit_adam.py"
_SPEC = importlib.util.spec_from_file_location("moshpit_adam", _PATH)
moshpit_adam = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(moshpit_adam)


def test_mixing_is_the_rounds():
  n = 8
  x, y = moshpit_adam.mixing(dq.Moshpit(grid=(2, 4)), n, jax.random.key(0))
  np.testing.assert_allclose(x, np.full((n, n), 1 / n), rtol=1e-6)  # everyone present
  np.testing.assert_allclose(y, np.full((n, n), 1 / n), rtol=1e-6)
  mosh = dq.Moshpit(grid=(2, 4), dropout=0.2)
  g = jax.random.normal(jax.random.key(3), (n, 5))
  unequal = 0
  for t in range(4):
    key = jax.random.fold_in(jax.random.key(1), t)
    x, y = (np.asarray(m) for m in moshpit_adam.mixing(mosh, n, key))
    np.testing.assert_allclose(x.sum(1), 1, rtol=1e-5)  # each rank's result: a weighted mean
    np.testing.assert_allclose(y.sum(1), 1, rtol=1e-5)
    # rank r's row of X is what the float32 reduction of these absences gives rank r
    out = dq.simulate(g, codec=dq.codecs.F32(), schedule=mosh, key=key)
    np.testing.assert_allclose(x @ np.asarray(g), out, rtol=1e-5, atol=1e-6)
    unequal += bool(np.ptp(x) > 0.01)
  assert unequal  # some step had someone absent
