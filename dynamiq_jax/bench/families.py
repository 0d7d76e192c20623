"""Synthetic gradient families for testing codec robustness.

Four deterministic families of per-worker gradients, ``float32 [n, d]``,
chosen so that a codec tuned to one gradient model (DynamiQ's class
capacities fitted to the paper's heavy-tailed model) is exercised on data
unlike it. ``family(name, n, d, seed)`` regenerates the same arrays bit for
bit from numpy ``Generator`` calls (seeded by ``seed`` only; independent of
JAX), for any ``n >= 1`` and ``d >= 1``.

Families (``x_i`` is worker i's gradient, ``N`` a standard normal):

``"dense"``
  Dense, equal norms, independent workers: ``x_i = N(0, I_d)``, independent
  over workers and coordinates. Every super-group has the same expected
  norm, the mean's norm is ``1/sqrt(n)`` of a worker's: the hardest case for
  a ranking-based width allocation (nothing to rank) and for multi-hop
  error growth (partial sums do not grow coherently).

``"signal_noise"``
  Common signal plus half-size per-worker noise: ``x_i = s + 0.5 e_i`` with
  ``s, e_i ~ N(0, I_d)`` (s shared by all workers). Dense, flat norms, but
  workers agree: the mean is dominated by ``s``.

``"layered"``
  A model-like vector: consecutive "layers" of random sizes
  (``256 * 2^U(0, 10)`` coordinates each, cut at ``d``), each with its own
  scale ``10^U(-4, 0)`` (four decades), coordinates
  ``scale * (0.7 s + 0.7 e_i)`` (a common signal and per-worker noise of
  equal size). One layer in five (and always the first) is an embedding
  table of rows of 64 coordinates; each of its rows is nonzero on a worker
  with probability 0.3 (token present in that worker's batch), exactly zero
  otherwise, and about a quarter of the rows are zero on every worker
  (absent tokens): exact zeros mixed with nonzeros, within and across
  super-groups.

``"paper"``
  The paper's App. E model, independent workers:
  :func:`dynamiq_jax.bench.reference.paper_model_gradients` ``("iid", n, d,
  seed)`` (bf16-cast; ``d`` is rounded up to whole super-groups and cut back).

Examples:
  >>> from dynamiq_jax.bench.families import family
  >>> family("dense", 2, 8, 0).shape
  (2, 8)
"""

from __future__ import annotations

import numpy as np

from dynamiq_jax.bench.reference import paper_model_gradients

__all__ = ["FAMILIES", "family"]

FAMILIES = ("dense", "signal_noise", "layered", "paper")

_EMBED_ROW = 64


def _dense(rng, n, d):
  return rng.standard_normal((n, d), dtype=np.float32)


def _signal_noise(rng, n, d):
  s = rng.standard_normal(d, dtype=np.float32)
  e = rng.standard_normal((n, d), dtype=np.float32)
  return s[None, :] + np.float32(0.5) * e


def _layered(rng, n, d):
  out = np.zeros((n, d), np.float32)
  start, layer = 0, 0
  while start < d:
    size = min(int(256 * 2 ** rng.uniform(0.0, 10.0)), d - start)
    scale = np.float32(10.0 ** rng.uniform(-4.0, 0.0))
    s = rng.standard_normal(size, dtype=np.float32)
    e = rng.standard_normal((n, size), dtype=np.float32)
    block = scale * np.float32(0.7) * (s[None, :] + e)
    if layer % 5 == 0:  # embedding table: rows present per worker, some absent on all
      rows = -(-size // _EMBED_ROW)
      absent = rng.random(rows) < 0.25
      present = (rng.random((n, rows)) < 0.3) & ~absent[None, :]
      mask = np.repeat(present, _EMBED_ROW, axis=1)[:, :size]
      block = np.where(mask, block, np.float32(0.0))
    out[:, start:start + size] = block
    start += size
    layer += 1
  return out


def _paper(seed, n, d):
  padded = -(-d // 256) * 256
  return paper_model_gradients("iid", n, padded, seed=seed)[:, :d]


def family(name: str, n: int, d: int, seed: int = 0) -> np.ndarray:
  """Per-worker gradients of one family, float32 ``[n, d]`` (see module doc).

  Args:
    name: one of :data:`FAMILIES`.
    n: number of workers.
    d: coordinates per worker.
    seed: data seed.
  """
  if n < 1 or d < 1:
    raise ValueError(f"need n >= 1 and d >= 1, got {n=}, {d=}")
  if name == "paper":
    return _paper(seed, n, d)
  rng = np.random.default_rng(seed)
  if name == "dense":
    return _dense(rng, n, d)
  if name == "signal_noise":
    return _signal_noise(rng, n, d)
  if name == "layered":
    return _layered(rng, n, d)
  raise ValueError(f"name={name!r} must be one of {FAMILIES}")
