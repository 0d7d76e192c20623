"""The default's allocation: widths per chunk position from the global statistics
(allocation.allocate), against the exact whole-position optimum, and the slot of
every super-group against a sort of the statistics."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynamiq_jax.codecs import allocation
from pallas_kernels import dynamiq_block as B


def _exact_error(norms, counts, widths, errors, n):
  """sum_w c_w * share of sum F at width w, float64, super-groups ranked by F."""
  f = np.sort(np.asarray(norms, np.float64) ** 2)[::-1]
  tot = f.sum()
  out, start = 0.0, 0
  for w, k in sorted(zip(widths, counts), reverse=True):
    out += errors[w] * f[start:start + k * n].sum() / tot
    start += k * n
  return out


def _norms(kind, m, rng):
  if kind == "flat":
    return np.abs(1.0 + 0.05 * rng.standard_normal(m))
  if kind == "paper":
    comp = rng.random(m) < 0.79
    return np.exp(np.where(comp, -3.99 + 1.22 * rng.standard_normal(m),
                           -16.41 + 4.63 * rng.standard_normal(m)))
  if kind == "zeros":  # embedding-like: many exact zeros
    v = np.exp(rng.standard_normal(m))
    v[rng.random(m) < 0.6] = 0.0
    return v
  return np.exp(3.0 * rng.standard_normal(m))  # "wide"


def split_menu(widths, positions: int, cost, budget: float) -> np.ndarray:
  """The oracle: every whole-position split worth considering under the budget, for
  at most 3 widths. For each count of the widest width, the middle one takes as
  many positions as the budget allows (each one more lowers the expected error),
  the narrowest the rest. int64 ``[K, len(widths)]``, ascending widths."""
  w = sorted(widths)
  assert len(w) <= 3 and positions * cost[w[0]] <= budget
  if len(w) == 1:
    return np.array([[positions]], np.int64)
  hi, mid, lo = w[-1], w[1], w[0]
  k_hi = np.arange(positions + 1) if len(w) == 3 else np.zeros(1, np.int64)
  rest = positions - k_hi
  spare = budget - k_hi * cost[hi] - rest * cost[lo]
  k_mid = np.minimum(rest, np.floor(spare / (cost[mid] - cost[lo])))
  ok = k_mid >= 0
  k_hi, k_mid = k_hi[ok], k_mid[ok].astype(np.int64)
  cols = [positions - k_hi - k_mid, k_mid] + ([k_hi] if len(w) == 3 else [])
  return np.stack(cols, axis=1).astype(np.int64)


@functools.cache
def _fine_errors(widths):
  out = {}
  x = np.random.default_rng(12345).standard_normal((1024, 256))
  for w in widths:
    lam = B.level_table(w, B.eps_for(w, {2: 0.23, 4: 0.18, 8: 0.10})).astype(np.float64)
    a = np.abs(x).reshape(1024, 16, -1)
    s = a.max(-1, keepdims=True) / lam[-1]
    t = a / s
    j = np.clip(np.searchsorted(lam, t, side="right") - 1, 0, lam.size - 2)
    out[w] = float(((t - lam[j]) * (lam[j + 1] - t) * s**2).sum() / (x**2).sum())
  return out


@functools.cache
def _allocate(errors, positions, cost, budget, n, blocks):
  """allocation.allocate jitted for one set of its static arguments (as tuples of
  ``(width, value)``): every call with the same ones runs the same compiled program."""
  return jax.jit(lambda g, v: allocation.allocate(g, v, dict(errors), positions, dict(cost),
                                                  budget, n, blocks=blocks))


def _run(norms, valid, errors, positions, cost, budget, n, blocks=1):
  f = _allocate(tuple(sorted(errors.items())), positions, tuple(sorted(cost.items())),
                float(budget), n, blocks)
  return [np.asarray(a) for a in f(jnp.asarray(norms), valid)]


_statistic = jax.jit(allocation.statistic)


@pytest.mark.parametrize("kind", ["flat", "paper", "zeros", "wide"])
@pytest.mark.parametrize("widths", [(2, 4, 8), (2, 3, 4, 5, 6, 8)])
def test_threshold_rule_near_optimal(kind, widths):
  rng = np.random.default_rng(3)
  n, units = 8, 200
  m = n * units
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  budget = 5.0 * m * 256 - 32 * m
  norms = _norms(kind, m, rng).astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
  _, got = _run(norms, np.ones(m, bool), errors, units, cost, budget, n)
  assert got.sum() == units
  spent = sum(int(k) * cost[w] for w, k in zip(widths, got))
  assert spent <= budget
  mine = _exact_error(norms, got, widths, errors, n)
  if len(widths) == 3:  # against the exact whole-unit optimum
    menu = split_menu(widths, units, cost, budget)
    best = min(_exact_error(norms, row, widths, errors, n) for row in menu)
    assert mine <= best * 1.02 + 1e-12
  # the multiplier and the tie fill leave less than one upgrade step unspent
  assert budget - spent < max(cost.values()) - min(cost.values())


def _slot_widths(counts, widths, n):
  """The width of every slot ``j n + c`` (position j: widest first)."""
  ws = sorted(widths, reverse=True)
  return np.repeat(np.repeat(ws, [counts[widths.index(w)] for w in ws]), n)


@pytest.mark.parametrize("blocks", ["all", "scatter"])
@pytest.mark.parametrize("kind", ["flat", "paper", "zeros", "ties", "edge"])
def test_slots_follow_the_statistic(kind, blocks):
  """Every super-group gets one slot; within a block a larger statistic never gets a
  narrower width (ties: the lower index first), a width's super-groups keep their index
  order, and in a reduce-scatter chunk c holds block c."""
  rng = np.random.default_rng(5)
  widths = (2, 3, 4, 5, 6, 8)
  n, units = 4, 96
  m = n * units
  cost = {w: n * 256 * w for w in widths}
  budget = 5.0 * m * 256 - 32 * m
  if kind == "ties":
    norms = np.round(rng.random(m) * 4) / 4
  elif kind == "edge":  # repeated values, zeros, tiny, inf, nan, the largest float
    norms = rng.choice(np.float32([0, 1e-30, 1, 1, 2.5, 3e38, np.inf, np.nan]), m)
  else:
    norms = _norms(kind, m, rng)
  norms = np.asarray(norms, np.float32)
  scatter = blocks == "scatter"
  valid = np.arange(m) < (m if scatter else m - 37)  # the last super-groups: padding
  dest, counts = _run(norms, valid, _fine_errors(widths), units, cost, budget, n,
                      blocks=n if scatter else 1)
  np.testing.assert_array_equal(np.sort(dest), np.arange(m))
  assert counts.sum() == units
  width = _slot_widths(list(counts), widths, n)[dest]  # each super-group's width
  f = np.asarray(_statistic(jnp.asarray(norms), valid))
  groups = [np.arange(c * units, (c + 1) * units) for c in range(n)] if scatter else [
      np.arange(m)]
  for c, idx in enumerate(groups):
    ranked = idx[np.lexsort((idx, -f[idx]))]  # by statistic, ties by index
    assert (np.diff(width[ranked]) <= 0).all(), width[ranked]
    for w in set(width[idx].tolist()):
      assert (np.diff(dest[idx[width[idx] == w]]) > 0).all()
    if scatter:
      assert (dest[idx] % n == c).all()


def test_same_under_vmap_and_jit():
  """simulate runs the allocation under vmap: every rank must get the same slots."""
  rng = np.random.default_rng(0)
  n, units, widths = 8, 64, (2, 3, 4, 5, 6, 8)
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  m = n * units
  g = _norms("paper", m, rng).astype(np.float32).astype(jnp.bfloat16).astype(np.float32)
  f = lambda x: allocation.allocate(x, jnp.ones(m, bool), errors, units, cost,
                                    5.0 * m * 256 - 32 * m, n)
  # both jitted, as simulate and shard_map run it (run eagerly, each of its operations
  # would compile on its own: ~190 programs)
  b = [np.asarray(v) for v in jax.jit(f)(g)]
  c = [np.asarray(v) for v in jax.jit(jax.vmap(f))(np.stack([g] * 3))]
  for y, z in zip(b, c):
    assert (z == y).all()


def test_padding_and_zero_and_inf():
  n, units, widths = 4, 8, (2, 4, 8)
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  budget = 5.0 * n * units * 256 - 32 * n * units
  for g in [np.zeros(n * units), np.full(n * units, np.inf), np.r_[np.ones(5), np.zeros(27)]]:
    dest, got = _run(np.asarray(g, np.float32), np.arange(n * units) < 30, errors, units, cost,
                     budget, n)
    assert got.sum() == units
    np.testing.assert_array_equal(np.sort(dest), np.arange(n * units))
    assert sum(int(k) * cost[w] for w, k in zip(sorted(errors), got)) <= budget


def test_one_width_keeps_index_order():
  """A budget that pays for the widest width everywhere: slots in index order."""
  n, units, widths = 4, 8, (2, 4)
  cost = {w: n * 256 * w for w in widths}
  for blocks in (1, n):
    dest, got = _run(np.arange(n * units, dtype=np.float32), np.ones(n * units, bool),
                     _fine_errors(widths), units, cost, 10.0 * n * units * 256, n, blocks)
    assert list(got) == [0, units]
    want = np.arange(n * units) if blocks == 1 else (
        (np.arange(n * units) % units) * n + np.arange(n * units) // units)
    np.testing.assert_array_equal(dest, want)


def _bisected_counts(f, t, step, limit, positions, n):
  """The oracle of the multiplier: the least float32 (zero or normal) whose widths fit,
  by a plain scan over candidate multipliers (every ``f / t`` and its neighbours)."""
  q = (f[:, None] / np.float32(t)[None, :]).astype(np.float32).ravel()
  inf = np.float32(np.inf)
  cands = np.unique(np.concatenate([[np.float32(0)], q, np.nextafter(q, -inf),
                                    np.nextafter(q, inf)]))
  cands = cands[(cands == 0) | (cands >= np.finfo(np.float32).tiny)]

  def beyond(lam):
    return [(int(np.sum(f >= np.float32(lam) * np.float32(tb))) + n - 1) // n for tb in t]

  for lam in cands:  # ascending: the first that fits
    if sum(s * c for s, c in zip(step, beyond(lam))) <= limit:
      return beyond(lam)
  return [0] * len(t)


@pytest.mark.parametrize("kind", ["flat", "paper", "ties", "tiny"])
def test_multiplier_is_the_least_that_fits(kind, monkeypatch):
  """The 31 bisection steps find the least multiplier whose widths fit: without the
  tie fill, the positions beyond each boundary are the oracle's."""
  rng = np.random.default_rng(11)
  n, s = 8, 24
  widths = (2, 4, 8)
  errors = _fine_errors(widths)
  cost = {w: n * 256 * w for w in widths}
  if kind == "ties":
    norms = np.round(rng.random(n * s) * 4) / 4
  elif kind == "tiny":  # norms far below the largest: statistics near the subnormal range
    norms = np.exp(np.clip(rng.standard_normal(n * s) * 30, -85, 85))
  else:
    norms = _norms(kind, n * s, rng)
  g = jnp.asarray(norms.astype(np.float32))
  valid = np.ones(n * s, bool)
  f = np.asarray(_statistic(g, valid))
  hull = allocation.hull_widths(errors, cost)
  t = [(cost[b] - cost[a]) / (errors[a] - errors[b]) for a, b in zip(hull[:-1], hull[1:])]
  step = [cost[b] - cost[a] for a, b in zip(hull[:-1], hull[1:])]
  # the same 4 budgets for every kind (a budget is static: one program each)
  budgets = s * cost[2] + np.random.default_rng(12).integers(0, s * (cost[8] - cost[2]), 4)
  for budget in budgets:
    limit = int(budget) - s * cost[hull[0]]
    want = _bisected_counts(f, t, step, limit, s, n)
    _, got = _run(np.asarray(g), valid, errors, s, cost, float(budget), n)
    beyond = [int(got[widths.index(w):].sum()) for w in hull[1:]]
    # the tie fill only adds positions that switch just below the multiplier
    assert all(b >= w for b, w in zip(beyond, want)), (budget, beyond, want)
    assert sum(st * (b - w) for st, b, w in zip(step, beyond, want)) <= limit - sum(
        st * w for st, w in zip(step, want))
