"""Synthetic per-worker gradients: the paper's gradient model (App. E / Table 7).

Super-group magnitudes M follow the two-component LogNormal mixture the
DynamiQ paper fitted to real gradients (weights 0.79 / 0.21, log-means
-3.99 / -16.41, log-sds 1.22 / 4.63); coordinates are N(0, M^2 / 256).
``"iid"`` workers are independent; ``"heavy"`` workers share a signal that
carries half the variance. The same numpy ``Generator`` calls as the
authors' reference data generator, so the arrays are identical bit for bit.
"""

from __future__ import annotations

import numpy as np
from ml_dtypes import bfloat16

__all__ = ["paper_model_gradients"]

SUPER = 256
_PI1, _MU1, _SIG1 = 0.79, -3.99, 1.22
_MU2, _SIG2 = -16.41, 4.63


def paper_model_gradients(dataset: str, n: int, d: int = 1 << 20, seed: int = 0,
                          bf16: bool = True) -> np.ndarray:
  """Per-worker synthetic gradients, float32 [n, d].

  Args:
    dataset: ``"iid"`` or ``"heavy"``.
    n: number of workers.
    d: coordinates per worker (a multiple of 256; the reference uses 2**20).
    seed: data seed (the reference has 0 and 1).
    bf16: round to bfloat16 first, as the reference runs did.
  """
  if d % SUPER:
    raise ValueError(f"{d=} must be a multiple of {SUPER}")
  rng = np.random.default_rng(seed)
  m = d // SUPER
  comp = rng.random(m) < _PI1
  z1 = rng.standard_normal(m)
  z2 = rng.standard_normal(m)
  log_m = np.where(comp, _MU1 + _SIG1 * z1, _MU2 + _SIG2 * z2)
  sd = np.repeat(np.exp(log_m) / np.sqrt(SUPER), SUPER)
  if dataset == "iid":
    g = (sd[None, :] * rng.standard_normal((n, d))).astype(np.float32)
  elif dataset == "heavy":
    s = rng.standard_normal(d)
    e = rng.standard_normal((n, d))
    g = (sd[None, :] * (np.sqrt(0.5) * s[None, :] + np.sqrt(0.5) * e)).astype(np.float32)
  else:
    raise ValueError(f"dataset={dataset!r} must be 'iid' or 'heavy'")
  if bf16:
    g = g.astype(bfloat16).astype(np.float32)
  return g
