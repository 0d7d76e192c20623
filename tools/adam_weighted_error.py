"""Compression error weighted by Adam's per-coordinate scale, on the byte-LM gradients.

A one-off check of a guess in docs/results.md (*Training*): that MXFP4 trains
better than DynamiQ despite a higher vNMSE because Adam divides each
coordinate by its own RMS, so noise on small coordinates matters more than
vNMSE says. For each codec it prints, on the byte-LM snapshot at step 300
(ring, n = 8, the mean of the last 2 rounds):

* vNMSE = sum_i e_i^2 / sum_i g_i^2, with e = mean_hat - mean, g = mean;
* the Adam-weighted error sum_i w_i e_i^2 / sum_i w_i g_i^2, with
  w_i = 1 / E[g_i^2] and E over the snapshots at steps 0, 100 and 300
  (floored at the 1st percentile of the non-zero values), a rough stand-in
  for Adam's second moment.

Uses the gradients ``python -m dynamiq_jax.bench.vnmse`` captures (cached
under ~/.cache/dynamiq_jax; captured here if missing, about 10 minutes)::

    python tools/adam_weighted_error.py
"""

from __future__ import annotations

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

from dynamiq_jax import codecs as C  # noqa: E402
from dynamiq_jax.bench import lm  # noqa: E402
from dynamiq_jax.bench import vnmse as bench_vnmse  # noqa: E402


def main():
  cache = os.path.expanduser("~/.cache/dynamiq_jax")
  steps = (0, 100, 300)
  snaps, _ = lm.cached_gradients(cache, "lm-byte", {s: bench_vnmse.N for s in steps}, steps,
                                 lm.LMConfig())
  g = snaps[300]
  pad = (-g.shape[1]) % C.DynamiQ.granularity
  gp = np.pad(g, ((0, 0), (0, pad)))
  mean = gp.mean(0).astype(np.float64)
  v = np.mean([np.pad(snaps[s].mean(0), (0, pad)).astype(np.float64) ** 2 for s in steps], 0)
  w = 1.0 / np.maximum(v, np.percentile(v[v > 0], 1))
  codecs = {
      "DynamiQ 5b": C.DynamiQ(bits=5),
      "MXFP8": C.MX(element="e4m3"),
      "MXFP6": C.MX(element="e3m2"),
      "MXFP4": C.MX(element="e2m1"),
  }
  print(f"byte-LM step 300, ring, n = {g.shape[0]}, d = {g.shape[1]}")
  for name, codec in codecs.items():
    _, outs = bench_vnmse.simulate_rounds(codec, gp, seeds=2, rounds=12)
    e2 = np.mean([(o.astype(np.float64) - mean) ** 2 for o in outs[-2:]], 0)
    print(f"{name:42s} vNMSE {e2.sum() / (mean ** 2).sum():.3e}   "
          f"Adam-weighted {(e2 * w).sum() / (mean ** 2 * w).sum():.3e}")


if __name__ == "__main__":
  main()
