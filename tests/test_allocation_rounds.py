"""The default's allocation: widths per chunk position from the global statistics
(allocation.capacities_threshold), against the exact whole-position optimum."""

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


@pytest.mark.parametrize("kind", ["flat", "paper", "zeros", "wide"])
@pytest.mark.parametrize("widths", [(2, 4, 8), (2, 3, 4, 5, 6, 8)])
def test_threshold_rule_near_optimal(kind, widths):
  rng = np.random.default_rng(3)
  n, units = 8, 200
  m = n * units
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  budget = 5.0 * m * 256 - 32 * m
  norms = np.asarray(jnp.asarray(_norms(kind, m, rng), jnp.float32).astype(jnp.bfloat16)
                     .astype(jnp.float32))
  f = lambda g: allocation.capacities_threshold(g, jnp.ones(m, bool), errors, units, cost,
                                                budget, n)
  got = np.asarray(f(jnp.asarray(norms)))
  assert (np.asarray(jax.jit(f)(jnp.asarray(norms))) == got).all()
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


@pytest.mark.parametrize("kind", ["flat", "paper", "zeros", "edge"])
def test_threshold_rule_same_with_the_plans_order(kind):
  """``order=`` (the plan's :func:`descending_order`, a gather instead of a sort)
  gives the sort's counts, with ties, padding rows and non-finite norms."""
  rng = np.random.default_rng(5)
  widths = (2, 3, 4, 5, 6, 8)
  n, units = 4, 96
  m = n * units
  cost = {w: n * (256 * w + 144) for w in widths}
  budget = 5.0 * m * 256 - 32 * m
  if kind == "edge":  # repeated values, zeros, inf, nan, the largest float
    norms = rng.choice(np.float32([0, 1e-30, 1, 1, 2.5, 3e38, np.inf, np.nan]), m)
  else:
    norms = np.asarray(jnp.asarray(_norms(kind, m, rng), jnp.float32))
  valid = jnp.arange(m) < m - 37  # the last super-groups are padding
  errors = _fine_errors(widths)
  g = jnp.asarray(norms)

  @jax.jit
  def both(g):
    sort = allocation.capacities_threshold(g, valid, errors, units, cost, budget, n)
    order = allocation.descending_order(g, valid)
    return sort, allocation.capacities_threshold(g, valid, errors, units, cost, budget, n,
                                                 order=order)

  sort, gather = both(g)
  assert (np.asarray(sort) == np.asarray(gather)).all(), (sort, gather)


def test_same_under_vmap_and_jit():
  """simulate runs the allocation under vmap: every rank must get the same counts."""
  rng = np.random.default_rng(0)
  n, units, widths = 8, 64, (2, 3, 4, 5, 6, 8)
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  m = n * units
  g = jnp.asarray(_norms("paper", m, rng), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
  f = lambda x: allocation.capacities_threshold(x, jnp.ones(m, bool), errors, units, cost,
                                                5.0 * m * 256 - 32 * m, n)
  a = np.asarray(f(g))
  b = np.asarray(jax.jit(f)(g))
  c = np.asarray(jax.vmap(f)(jnp.stack([g] * 3)))
  assert (a == b).all() and (c == a).all()


def test_padding_and_zero_and_inf():
  n, units, widths = 4, 8, (2, 4, 8)
  errors = _fine_errors(widths)
  cost = {w: n * (256 * w + 144) for w in widths}
  budget = 5.0 * n * units * 256 - 32 * n * units
  for g in [np.zeros(n * units), np.full(n * units, np.inf), np.r_[np.ones(5), np.zeros(27)]]:
    got = np.asarray(allocation.capacities_threshold(
        jnp.asarray(g, jnp.float32), jnp.arange(n * units) < 30, errors, units, cost, budget, n))
    assert got.sum() == units
    assert sum(int(k) * cost[w] for w, k in zip(sorted(errors), got)) <= budget


def _bisected_multiplier(position_f, t, step, limit):
  """The oracle of :func:`allocation._switching_multiplier`: 31 bisection steps over the
  float32 bit patterns (the least multiplier whose cost fits, and the one below it)."""

  def cost(lam):
    return sum(s * jnp.sum((position_f >= lam * tb).astype(jnp.int32)) for tb, s in zip(t, step))

  def bisect(_, bounds):
    lo, hi = bounds
    mid = lo + (hi - lo) // 2
    ok = cost(jax.lax.bitcast_convert_type(mid, jnp.float32)) <= limit
    return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

  lo, hi = jax.lax.fori_loop(0, 31, bisect, (jnp.uint32(0), jnp.uint32(0x7F800000)))
  return (jax.lax.bitcast_convert_type(lo, jnp.float32),
          jax.lax.bitcast_convert_type(hi, jnp.float32))


@pytest.mark.parametrize("kind", ["flat", "paper", "zeros", "wide", "ties", "tiny"])
def test_switching_multiplier_is_what_a_bisection_finds(kind, monkeypatch):
  """The loop-free search (candidates, two 16-bit histograms) gives the widths that 31
  bisection steps over the multiplier's bit patterns give, budget by budget."""
  rng = np.random.default_rng(11)
  n, s = 8, 48
  widths = (2, 3, 4, 5, 6, 8)
  errors = _fine_errors(widths)
  cost = {w: n * 256 * w for w in widths}
  if kind == "ties":
    norms = np.round(rng.random(n * s) * 4) / 4
  elif kind == "tiny":  # norms far below the largest: statistics near the subnormal range
    norms = np.exp(np.clip(rng.standard_normal(n * s) * 30, -85, 85))
  else:
    norms = _norms(kind, n * s, rng)
  g = jnp.asarray(norms.astype(np.float32))
  valid = jnp.asarray(rng.random(n * s) < 0.9)
  budgets = s * cost[2] + rng.integers(0, s * (cost[8] - cost[2]), 6)

  def run(budget):
    return np.asarray(jax.jit(lambda g, v: allocation.capacities_threshold(
        g, v, errors, s, cost, float(budget), n, order=allocation.descending_order(g, v)))(
            g, valid))

  got = [run(b) for b in budgets]
  monkeypatch.setattr(allocation, "_switching_multiplier", _bisected_multiplier)
  want = [run(b) for b in budgets]
  for b, x, y in zip(budgets, got, want):
    np.testing.assert_array_equal(x, y, err_msg=f"budget {b}")
