"""Error statistics of DynamiQ's rounding draws: what a change of the draws must keep.

    python tools/draw_stats.py [--level-set mee]   # one JSON line; about 2 minutes on 2 cores

Run it before and after a change to the random draws (``pallas_kernels.rng``,
``dynamiq_block.uniforms``) and compare: DynamiQ 5b on the authors'
synthetic data (the measurements of ``tests/test_dynamiq.py``, from
:mod:`dynamiq_jax.bench.reference`; n = 8):

* ``vnmse_<family>_<data seed>``: vNMSE of the ring all-reduce, mean over 4
  rounding seeds (the authors' simulator's figures are in
  docs/spec REFERENCE_VNMSE);
* ``ratio_corr_ind_<family>``: correlated over independent rounding;
* over 1024 rounding keys (heavy family, d = 2^14): ``bias_share_corr``,
  the squared bias of the correlated all-reduce as a share of its mean
  squared error; ``ind_bias_z``, the independent all-reduce's summed bias in
  standard errors (|z| < 3 for an unbiased one); ``mse_corr_over_ind``.
"""

import json

N, D = 8, 1 << 20  # tests/test_dynamiq.py's


def _vnmse(codec, family, data_seed, seeds):
  import numpy as np

  from dynamiq_jax.bench.reference import paper_model_gradients, simulated_vnmse
  g = paper_model_gradients(family, N, D, data_seed)
  return float(np.mean([simulated_vnmse(codec, g, s) for s in seeds]))


def _many_keys(codec, draws):
  from dynamiq_jax.bench.reference import allreduce_over_keys, paper_model_gradients
  return allreduce_over_keys(codec, paper_model_gradients("heavy", N, 1 << 14, 3), draws)


def main(argv=None):
  import argparse

  import numpy as np

  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  from dynamiq_jax.codecs.dynamiq import LEVEL_SETS
  p.add_argument("--level-set", default=LEVEL_SETS[0], choices=LEVEL_SETS,
                 help="DynamiQ's level set (default: the codec's, lattice)")
  level_set = p.parse_args(argv).level_set

  import functools

  from dynamiq_jax.codecs import DynamiQ as _DynamiQ
  DynamiQ = functools.partial(_DynamiQ, level_set=level_set)

  out = {}
  seeds = (0, 1, 2, 3)
  for family in ("iid", "heavy"):
    for data_seed in (0, 1):
      out[f"vnmse_{family}_{data_seed}"] = _vnmse(DynamiQ(bits=5.0), family, data_seed, seeds)
    ind = _vnmse(DynamiQ(bits=5.0, correlated=False), family, 0, seeds)
    out[f"ratio_corr_ind_{family}"] = out[f"vnmse_{family}_0"] / ind
  y, ref = _many_keys(DynamiQ(bits=5), 1024)
  mse = np.mean(np.sum((y - ref) ** 2, 1))
  out["bias_share_corr"] = np.sum((y.mean(0) - ref) ** 2) / mse
  y_ind, _ = _many_keys(DynamiQ(bits=5, correlated=False), 1024)
  err = y_ind.mean(0) - ref
  out["ind_bias_z"] = np.sum(err) / np.sqrt(np.sum(y_ind.var(0, ddof=1) / y_ind.shape[0]))
  out["mse_corr_over_ind"] = mse / np.mean(np.sum((y_ind - ref) ** 2, 1))
  print(json.dumps({k: round(float(v), 6) for k, v in out.items()}))


if __name__ == "__main__":
  main()
