"""Static per-width capacities for DynamiQ's variable bit width.

XLA needs static buffer sizes, so each width class gets a fixed number of
super-groups; which super-groups fill which class is decided every step by
ranking the global statistics F (the paper's §3.2).

The capacities come from the paper's threshold rule (§3.2 / App. A): a
super-group gets width ``b`` iff ``T_{a,b} <= F < T_{b,c}``, with thresholds
set so that every extra bit buys the same error reduction. If one
quantisation at width ``w`` leaves a relative MSE ``c_w``, raising a
super-group of statistic F from ``a`` to ``b`` bits saves ``F (c_a - c_b)``
for ``b - a`` bits per coordinate, so equal gain per bit means
``T_{a,b} = lam (b - a) / (c_a - c_b)``, with ``lam`` set so that the expected
width meets the payload budget. The paper uses the model ``c_w = 4^-w``
("one bit = 4x less error"), which gives its ``T_{2,4} = (17/512) T_{4,8}``.
We use each width's *measured* ``c_w`` instead
(:func:`expected_error`): the 4^-w
model says 2 bits are 16x worse than 4, but the ternary 2-bit quantiser is
54x worse (0.70 vs 0.013), so the paper's model sends too many super-groups
to 2 bits (docs/design.md, *How it works*, has the measured effect).

Applied *offline* to a distribution of ``log F`` the rule yields the class
fractions:

* by default the paper's own fit of super-group magnitudes (App. E /
  Table 7: a two-component LogNormal mixture);
* or the user's own gradients, with :func:`fractions_from_norms`.

Capacities come in whole *units* of ``n`` super-groups (one per ring
chunk), so a bucket of ``m`` super-groups has only ``m / n`` units to share
out. With many units, rounding the fractions is harmless; with few (a small
bucket, or a large ``n``) it is not: at 4 units the nearest rounding of the
default fractions is {4: 3, 2: 1}, which leaves 0.8 bit/coordinate unspent
and sends a quarter of the vector at 2 bits. So the default and calibrated
codecs describe the gradients by a *profile* (``log2 F`` at evenly spaced
quantiles) and :func:`best_capacities` picks the whole-unit split that
minimises the same expected error the threshold rule minimises,
``sum_w c_w * (share of sum F sent at width w)``, under the exact budget.
With many units it agrees with the threshold rule; with few it is the best
split that exists. Explicit ``fractions`` are rounded with
:func:`round_capacities`.
"""

from __future__ import annotations

import functools
import math
from typing import Mapping, Sequence

import numpy as np
from ml_dtypes import bfloat16

__all__ = [
    "PAPER_MIXTURE",
    "PROFILE_POINTS",
    "expected_error",
    "level_error",
    "paper_errors",
    "thresholds",
    "fractions_for_budget",
    "fractions_from_norms",
    "fractions_from_profile",
    "mixture_profile",
    "profile_from_norms",
    "check_profile",
    "best_capacities",
    "round_capacities",
    "split_menu",
    "capacities_from_stats",
    "capacities_threshold",
    "hull_widths",
]

PROFILE_POINTS = 256
"""Quantiles in a profile: enough to place class boundaries to well under 1%."""

# App. E: super-group magnitude M ~ 0.79 LogNormal(-3.99, 1.22) + 0.21 LogNormal(-16.41, 4.63).
PAPER_MIXTURE = ((0.79, -3.99, 1.22), (0.21, -16.41, 4.63))


def expected_error(fmt) -> float:
  """Relative MSE of one quantisation of Gaussian super-groups in format ``fmt``.

  ``E ||Q(x) - x||^2 / ||x||^2`` for x ~ N(0, I_256), computed exactly from
  the rounding variance ``(t - lo)(hi - t)`` of every coordinate of a fixed
  sample (group scales taken at the group max). Deterministic; cached. This
  is the ``c_w`` of the equal-gain-per-bit rule.

  Args:
    fmt: a :class:`pallas_kernels.dynamiq_format.Format`.
  """
  return _expected_error(fmt)


def level_error(width: int, eps: float) -> float:
  """:func:`expected_error` of a hierarchical MEE format of any width 2..8."""
  return _level_error(int(width), float(eps))


@functools.lru_cache(maxsize=None)
def _level_error(width: int, eps: float) -> float:
  from pallas_kernels import dynamiq_format as fmt_lib
  lam = fmt_lib._level_table(width, "mee", eps).astype(np.float64)
  return _gaussian_error(lam, 16)


@functools.lru_cache(maxsize=None)
def _expected_error(fmt, supergroups: int = 4096) -> float:
  return _gaussian_error(fmt.table().astype(np.float64), fmt.groups, supergroups)


def _gaussian_error(lam, groups: int, supergroups: int = 4096) -> float:
  x = np.random.default_rng(12345).standard_normal((supergroups, 256))  # one super-group each
  a = np.abs(x).reshape(supergroups, groups, -1)
  s = a.max(-1, keepdims=True) / lam[-1]
  t = a / s
  j = np.clip(np.searchsorted(lam, t, side="right") - 1, 0, lam.size - 2)
  var = (t - lam[j]) * (lam[j + 1] - t) * s**2
  return float(var.sum() / (x**2).sum())


def paper_errors(widths: Sequence[int]) -> dict[int, float]:
  """The paper's error model: one more bit, four times less error."""
  return {w: 4.0**-w for w in widths}


def thresholds(errors: Mapping[int, float]) -> list[float]:
  """log2 of the thresholds between consecutive widths, up to a common offset.

  Args:
    errors: ``{width: relative MSE of one quantisation}``, decreasing in width.
  """
  w = sorted(errors)
  out = []
  for a, b in zip(w[:-1], w[1:]):
    gain = errors[a] - errors[b]
    if not gain > 0:
      raise ValueError(f"errors={dict(errors)} must decrease with the width")
    out.append(math.log2((b - a) / gain))
  return out


def _fractions_at(offset: float, errors, cdf):
  """Class fractions when thresholds sit at log2 F = log2 T + offset."""
  w = sorted(errors)
  cuts = [cdf(t + offset) for t in thresholds(errors)]
  edges = [0.0] + cuts + [1.0]
  return {wi: max(edges[i + 1] - edges[i], 0.0) for i, wi in enumerate(w)}


def _solve(target: float, errors, cdf, lo=-400.0, hi=400.0):
  w = sorted(errors)
  if target <= w[0]:
    return {wi: float(wi == w[0]) for wi in w}
  if target >= w[-1]:
    return {wi: float(wi == w[-1]) for wi in w}
  for _ in range(200):
    mid = 0.5 * (lo + hi)
    f = _fractions_at(mid, errors, cdf)
    if sum(k * v for k, v in f.items()) > target:
      lo = mid  # thresholds too low: too many bits
    else:
      hi = mid
  return _fractions_at(hi, errors, cdf)


def _mixture_cdf_log2f(mixture):
  """CDF of log2 F = 2 log2 M for M a LogNormal mixture."""

  def cdf(x):
    ln_m = x * math.log(2.0) / 2.0
    return sum(p * 0.5 * (1.0 + math.erf((ln_m - mu) / (s * math.sqrt(2.0))))
               for p, mu, s in mixture)

  return cdf


def fractions_for_budget(payload_bits: float, errors: Mapping[int, float],
                         mixture=PAPER_MIXTURE) -> dict[int, float]:
  """Class fractions whose expected code width is ``payload_bits``.

  Args:
    payload_bits: average code bits per coordinate left after metadata.
    errors: ``{width: c_w}``, e.g. :func:`paper_errors` or the codec's own.
    mixture: ``((weight, mu, sigma), ...)`` of ln M, the super-group magnitude.

  Returns:
    ``{width: fraction}``, summing to 1.
  """
  return _solve(payload_bits, errors, _mixture_cdf_log2f(mixture))


def _log2_f(norms):
  """log2 F = 2 log2 |norm| of the finite norms (zeros at -1993, not -inf)."""
  v = np.asarray(norms, np.float64).ravel()
  v = v[np.isfinite(v)]
  if v.size == 0:
    raise ValueError("norms holds no finite value")
  return 2.0 * np.log2(np.maximum(v, 1e-300))


def _profile_cdf(profile):
  """CDF of log2 F for a profile (or any sorted sample of log2 F): a step
  of 1/K at each of its K points, which may repeat (e.g. the many exact
  zeros of an embedding)."""
  x = np.asarray(profile, np.float64)

  def cdf(t):
    return float(np.searchsorted(x, t, side="left")) / x.size

  return cdf


def check_profile(profile):
  """``profile`` as a float64 array; ``ValueError`` unless it is a valid profile."""
  x = np.asarray(profile, np.float64)
  if x.ndim != 1 or x.size < 2 or not np.all(np.isfinite(x)) or np.any(np.diff(x) < 0):
    raise ValueError(f"profile must be >= 2 finite, non-decreasing log2 F quantiles, got "
                     f"{x.size} values; build it with profile_from_norms(...) or "
                     f"DynamiQ.calibrate(...)")
  return x


def mixture_profile(mixture=PAPER_MIXTURE, points: int = PROFILE_POINTS) -> tuple[float, ...]:
  """``log2 F`` at the (i + 1/2) / points quantiles of a LogNormal mixture of M."""
  cdf = _mixture_cdf_log2f(mixture)
  out = []
  for i in range(points):
    p, lo, hi = (i + 0.5) / points, -2000.0, 2000.0
    for _ in range(100):
      mid = 0.5 * (lo + hi)
      lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    out.append(round(0.5 * (lo + hi), 3))
  return tuple(out)


def profile_from_norms(norms, points: int = PROFILE_POINTS) -> tuple[float, ...]:
  """``log2 F`` (F = norm^2) at the (i + 1/2) / points quantiles of measured norms.

  Args:
    norms: global super-group L2 norms from one or more representative steps.
    points: number of quantiles kept.

  Returns:
    a non-decreasing tuple of ``points`` floats, rounded to 1e-3 (0.07% in F):
    small and hashable, so a codec that carries it stays a static argument.
  """
  q = np.quantile(_log2_f(norms), (np.arange(points) + 0.5) / points)
  return tuple(float(round(t, 3)) for t in np.maximum.accumulate(q))


def fractions_from_profile(profile, payload_bits: float,
                           errors: Mapping[int, float]) -> dict[int, float]:
  """The threshold rule on a profile: ``{width: fraction}`` for a payload budget."""
  x = check_profile(profile)
  return _solve(payload_bits, errors, _profile_cdf(x), lo=-4000.0, hi=4000.0)


def _top_share(profile, grid: int = 1 << 14):
  """S(t): share of sum F held by the top ``t`` of super-groups (increasing, S(1) = 1).

  F between profile points is interpolated geometrically (linear in log2 F).
  """
  x = check_profile(profile)
  p = (np.arange(x.size) + 0.5) / x.size
  q = (np.arange(grid) + 0.5) / grid
  log2f = np.interp(q, p, x)[::-1]  # largest first
  f = np.exp2(log2f - log2f[0])
  cum = np.concatenate([[0.0], np.cumsum(f)])
  cum /= cum[-1]
  t = np.linspace(0.0, 1.0, grid + 1)
  return lambda u: np.interp(u, t, cum)


def _checked_widths(widths, units: int, cost_per_unit, budget: float) -> list[int]:
  """Sorted widths (at most 3) whose narrowest fits every unit within ``budget``."""
  w = sorted(int(x) for x in widths)
  if len(w) > 3:
    raise ValueError(f"at most 3 widths, got {w}")
  if units * cost_per_unit[w[0]] > budget:
    raise ValueError(f"even all {units} units at {w[0]} bits cost "
                     f"{units * cost_per_unit[w[0]]} > {budget}")
  return w


def best_capacities(profile, errors: Mapping[int, float], units: int,
                    cost_per_unit: Mapping[int, int], budget: float) -> dict[int, int]:
  """The whole-unit split of minimum expected error that fits the budget.

  Super-groups are ranked by F, the widest class takes the top ones; the
  expected error of a split is ``sum_w errors[w] * (share of sum F in class
  w)``, with shares read off ``profile``. For every count of the widest
  class, the next class takes as many units as the budget allows (each one
  more lowers the error), the narrowest takes the rest; the best of these
  is returned (among equals, the one with the fewest widest units).

  Args:
    profile: ``log2 F`` quantiles (:func:`mixture_profile`,
      :func:`profile_from_norms`).
    errors: ``{width: c_w}``, decreasing in width; at most 3 widths.
    units: units to place (a unit is n super-groups, one per chunk).
    cost_per_unit: ``{width: bits}`` of one unit.
    budget: total bits allowed for all units.

  Returns:
    ``{width: units}``, summing to ``units``, within ``budget``.

  Raises:
    ValueError: if even every unit at the narrowest width exceeds the budget.
  """
  w = _checked_widths(errors, units, cost_per_unit, budget)
  lo = w[0]
  share = _top_share(profile)
  if len(w) == 1:
    return {lo: units}
  hi = w[-1]
  k_hi = np.arange(units + 1) if len(w) == 3 else np.zeros(1, np.int64)
  rest = units - k_hi
  spare = budget - k_hi * cost_per_unit[hi] - rest * cost_per_unit[lo]
  mid = w[1]
  k_mid = np.minimum(rest, np.floor(spare / (cost_per_unit[mid] - cost_per_unit[lo])))
  ok = k_mid >= 0
  k_hi, k_mid = k_hi[ok], k_mid[ok].astype(np.int64)
  s_hi = share(k_hi / units)
  s_mid = share((k_hi + k_mid) / units)
  err = errors[hi] * s_hi + errors[mid] * (s_mid - s_hi) + errors[lo] * (1.0 - s_mid)
  best = int(np.argmin(err))  # first minimum: the fewest widest units
  got = {lo: units - int(k_hi[best]) - int(k_mid[best]), mid: int(k_mid[best])}
  if len(w) == 3:
    got[hi] = int(k_hi[best])
  return got


def fractions_from_norms(norms, payload_bits: float,
                         errors: Mapping[int, float]) -> dict[int, float]:
  """The threshold rule applied offline to measured super-group norms.

  Args:
    norms: array of global super-group L2 norms (or any positive quantity
      monotone in F) from one or more representative steps.
    payload_bits: average code bits per coordinate to spend.
    errors: ``{width: c_w}``; ``DynamiQ.width_errors()`` for a codec.

  Returns:
    ``{width: fraction}``; pass it as ``DynamiQ(fractions=...)``.
  """
  log2f = np.sort(_log2_f(norms))
  return _solve(payload_bits, errors, _profile_cdf(log2f), lo=-2000.0, hi=2000.0)


def round_capacities(fractions: Mapping[int, float], units: int,
                     cost_per_unit: Mapping[int, int], budget: float) -> dict[int, int]:
  """Rounds fractions to whole units under a cost budget.

  Args:
    fractions: ``{width: fraction}``.
    units: number of units to place (a unit is n super-groups, one per chunk).
    cost_per_unit: ``{width: bits}`` for one unit of that width.
    budget: total bits allowed for all units.

  Returns:
    ``{width: units}`` summing to ``units`` whose cost fits the budget.

  Raises:
    ValueError: if even every unit at the narrowest width exceeds the budget.
  """
  w = sorted(fractions)
  ideal = {k: fractions[k] * units for k in w}
  got = {k: int(math.floor(ideal[k])) for k in w}
  rest = units - sum(got.values())
  for k in sorted(w, key=lambda k: ideal[k] - got[k], reverse=True)[:rest]:
    got[k] += 1

  def cost(g):
    return sum(g[k] * cost_per_unit[k] for k in w)

  # Downgrade the widest units until the budget holds.
  while cost(got) > budget:
    for i in range(len(w) - 1, 0, -1):
      if got[w[i]] > 0:
        got[w[i]] -= 1
        got[w[i - 1]] += 1
        break
    else:
      raise ValueError(f"even all {units} units at {w[0]} bits cost {cost(got)} > {budget}")
  # Spend rounding slack where the ideal split is shortest, while it fits.
  while True:
    best = None
    for i in range(len(w) - 1):
      lo, hi = w[i], w[i + 1]
      if got[lo] == 0:
        continue
      trial = dict(got)
      trial[lo] -= 1
      trial[hi] += 1
      if cost(trial) <= budget:
        deficit = ideal[hi] - got[hi]
        if deficit > 0 and (best is None or deficit > best[0]):
          best = (deficit, trial)
    if best is None:
      return got
    got = best[1]


# ----------------------------------------------------------------------------
# Per-round allocation from the global statistics (jnp, traced).


def split_menu(widths: Sequence[int], units: int, cost_per_unit: Mapping[int, int],
               budget: float) -> np.ndarray:
  """Every whole-unit split worth considering under the budget (static).

  For each count of the widest class, the middle class takes as many units
  as the budget allows (each one more lowers the expected error), the
  narrowest the rest: the same candidates as :func:`best_capacities`.

  Args:
    widths: at most 3 widths.
    units: units to place (a unit is n super-groups, one per chunk).
    cost_per_unit: ``{width: bits}`` of one unit.
    budget: total bits allowed for all units.

  Returns:
    int64 ``[K, len(widths)]``: units per width (ascending widths), every
    row summing to ``units`` and within ``budget``.

  Raises:
    ValueError: if even every unit at the narrowest width exceeds the budget.
  """
  w = _checked_widths(widths, units, cost_per_unit, budget)
  lo = w[0]
  if len(w) == 1:
    return np.array([[units]], np.int64)
  hi, mid = w[-1], w[1]
  k_hi = np.arange(units + 1) if len(w) == 3 else np.zeros(1, np.int64)
  rest = units - k_hi
  spare = budget - k_hi * cost_per_unit[hi] - rest * cost_per_unit[lo]
  k_mid = np.minimum(rest, np.floor(spare / (cost_per_unit[mid] - cost_per_unit[lo])))
  ok = k_mid >= 0
  k_hi, k_mid = k_hi[ok], k_mid[ok].astype(np.int64)
  cols = [units - k_hi - k_mid, k_mid] + ([k_hi] if len(w) == 3 else [])
  return np.stack(cols, axis=1).astype(np.int64)


def _prefix_sum(v):
  """Inclusive prefix sum over the last axis by a fixed Hillis-Steele schedule
  (additions only, so no multiply-add contraction; the same on every rank
  and under vmap)."""
  import jax.numpy as jnp
  n = v.shape[-1]
  shift = 1
  while shift < n:
    pad = jnp.zeros(v.shape[:-1] + (shift,), v.dtype)
    v = v + jnp.concatenate([pad, v[..., :n - shift]], axis=-1)
    shift *= 2
  return v


def _bf16_split(v):
  """float32 v = hi + mid + lo exactly, each bf16-exact (float32)."""
  import jax.numpy as jnp
  b = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  hi = b(v)
  mid = b(v - hi)  # v - hi is exact
  return hi, mid, b((v - hi) - mid)


def capacities_from_stats(gnorm, valid, errors: Mapping[int, float], units: int,
                          cost_per_unit: Mapping[int, int], budget: float, n: int):
  """This round's units per width from the global super-group norms (traced).

  The whole-unit split of least expected error ``sum_w c_w * (share of sum F
  sent at width w)`` within the budget — :func:`best_capacities`, applied to
  this round's statistics instead of an offline profile. Super-groups are
  ranked by F = gnorm^2, widest class first; a unit is ``n`` super-groups.

  Deterministic: every rank holds the same ``gnorm`` bit for bit and gets the
  same counts. F is scaled by a power of two (exact) and squared from
  bf16-exact norms (exact), prefix-summed with additions in a fixed order;
  the error of each candidate is a fixed-order sum of exact products
  (bf16-exact coefficients times bf16 halves of the prefix sums), so no
  compiler contraction or reassociation can change the chosen split;
  ``argmin`` picks the first minimum (the fewest widest units).

  Args:
    gnorm: float32 ``[m]`` global super-group norms (bf16-exact, >= 0), ``m =
      units * n``.
    valid: bool ``[m]``: real super-groups (padding is ranked last, F = 0).
    errors: ``{width: c_w}``, decreasing in width; at most 3 widths.
    units: ``m // n`` (static).
    cost_per_unit: ``{width: bits}`` of one unit (static).
    budget: payload bits allowed (static).
    n: super-groups per unit (static).

  Returns:
    int32 ``[len(errors)]``: units per width, ascending widths.
  """
  import jax
  import jax.numpy as jnp
  w = sorted(errors)
  menu = split_menu(w, units, cost_per_unit, budget)
  if menu.shape[0] == 1:
    return jnp.asarray(menu[0], jnp.int32)
  g = jnp.where(valid, jnp.asarray(gnorm, jnp.float32), 0.0)
  g = jnp.where(jnp.isfinite(g), g, jnp.finfo(jnp.float32).max)  # inf/nan: widest
  top = jnp.max(g)
  _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
  r = jnp.ldexp(g, -e).astype(jnp.bfloat16).astype(jnp.float32)  # in [0, 1), bf16-exact
  f = jnp.sort(r * r)[::-1]  # exact squares, largest first
  per_unit = f.reshape(units, n)[::-1, ::-1]  # smallest first
  unit_f = per_unit[:, 0]
  for i in range(1, n):  # fixed order within a unit
    unit_f = unit_f + per_unit[:, i]
  # tail[k]: sum F of the units ranked k.. (summed from the smallest, so the
  # small tails that decide the split are accurate to an ulp).
  tail = jnp.concatenate([_prefix_sum(unit_f)[::-1], jnp.zeros((1,), jnp.float32)])
  # err(split) = c_hi T + (c_mid - c_hi) tail[k_hi] + (c_lo - c_mid) tail[k_hi + k_mid]
  c = [float(errors[x]) for x in w]

  def coef(v):  # bf16-exact, so that coef * bf16 is an exact product
    return np.float32(np.float32(max(v, 0.0)).astype(bfloat16))

  def term(cf, k):
    h, m, l = _bf16_split(tail[k])
    return (cf * h + cf * m) + cf * l

  k_hi = menu[:, 2] if len(w) == 3 else np.zeros(menu.shape[0], np.int64)
  cost = term(coef(c[0] - c[1]), k_hi + menu[:, 1])
  if len(w) == 3:
    cost = cost + term(coef(c[1] - c[2]), k_hi)
  best = jnp.argmin(cost)  # first minimum: fewest widest units (menu is in k_hi order)
  return jnp.asarray(menu, jnp.int32)[best]


def hull_widths(errors: Mapping[int, float], cost_per_unit: Mapping[int, int]) -> list[int]:
  """Widths on the lower convex hull of (cost, error): the only ones the
  equal-marginal-gain rule ever picks (static)."""
  w = sorted(errors)
  hull = []
  for x in w:
    while len(hull) >= 2:
      a, b = hull[-2], hull[-1]
      # slope a->b must be steeper (more error saved per bit) than b->x
      s_ab = (errors[a] - errors[b]) / (cost_per_unit[b] - cost_per_unit[a])
      s_bx = (errors[b] - errors[x]) / (cost_per_unit[x] - cost_per_unit[b])
      if s_bx >= s_ab:
        hull.pop()
      else:
        break
    hull.append(x)
  return hull


def _finite_norms(gnorm):
  """float32 norms with non-finite ones (never produced by the guarded all-reduce)
  as the largest float."""
  import jax.numpy as jnp
  g = jnp.asarray(gnorm, jnp.float32)
  return jnp.where(jnp.isfinite(g), g, jnp.finfo(jnp.float32).max)


def descending_order(gnorm, valid):
  """The permutation that sorts super-groups by norm, largest first, ties by
  index, the ones not ``valid`` (padding) last: the order in which the
  allocation hands out widths."""
  import jax.numpy as jnp
  return jnp.argsort(jnp.where(valid, -_finite_norms(gnorm), jnp.inf), stable=True)


def capacities_threshold(gnorm, valid, errors: Mapping[int, float], units: int,
                         cost_per_unit: Mapping[int, int], budget: float, n: int, order=None):
  """Units per width by the paper's threshold rule, for any number of widths (traced).

  The rule (equal marginal gain per bit, with each width's measured error
  ``c_w``): for a multiplier ``lam``, a unit of statistic F (the sum of its
  n super-groups' F) gets the widest width b with ``F >= lam * t_ab`` for
  every hull boundary ``a | b`` below it, ``t_ab = (cost_b - cost_a) / (c_a
  - c_b)``; ``lam`` is the smallest that fits the budget. Exact and
  deterministic: F as in :func:`capacities_from_stats`; ``lam`` is found by
  bisection on its float32 bit pattern (31 steps), each step comparing
  ``F >= lam * t`` (one rounded product, no sum) and costing the result in
  integers; units that tie at the switching multiplier then take the next
  width while the budget allows.

  Args:
    order: optional, :func:`descending_order` of ``(gnorm, valid)``, when the
      caller has it: the statistics are then put in order by one gather
      instead of a sort (the same values: the map from a norm to its F is
      non-decreasing).

  Returns:
    int32 ``[len(errors)]``: units per width, ascending widths (0 off the hull).
  """
  import jax.numpy as jnp
  w = sorted(errors)
  lo_w = w[0]
  if units * cost_per_unit[lo_w] > budget:
    raise ValueError(f"even all {units} units at {lo_w} bits cost "
                     f"{units * cost_per_unit[lo_w]} > {budget}")
  hull = hull_widths(errors, cost_per_unit)
  if len(hull) == 1:
    return jnp.asarray([units if x == hull[0] else 0 for x in w], jnp.int32)
  g = jnp.where(valid, _finite_norms(gnorm), 0.0)
  top = jnp.max(g)
  _, e = jnp.frexp(jnp.where(top > 0, top, 1.0))
  r = jnp.ldexp(g, -e).astype(jnp.bfloat16).astype(jnp.float32)
  if order is None:
    f = jnp.sort(r * r)[::-1]
  else:  # r * r is non-decreasing in g (>= 0), and 0 where not valid (last in order)
    from pallas_kernels import dynamiq_format as fmt_lib
    f = fmt_lib.take_in_range(r * r, order)
  f = f.reshape(units, n)
  unit_f = f[:, 0]
  for i in range(1, n):
    unit_f = unit_f + f[:, i]
  t = [np.float32((cost_per_unit[b] - cost_per_unit[a]) / (errors[a] - errors[b]))
       for a, b in zip(hull[:-1], hull[1:])]
  step = [int(cost_per_unit[b] - cost_per_unit[a]) for a, b in zip(hull[:-1], hull[1:])]
  base = int(units * cost_per_unit[hull[0]])
  limit = int(math.floor(budget)) - base
  if limit >= sum(step) * units:  # everything at the widest hull width fits
    return jnp.asarray([units if x == hull[-1] else 0 for x in w], jnp.int32)

  def at_least(lam):  # units at or above each hull boundary (nested: t increases)
    return [jnp.sum((unit_f >= lam * tb).astype(jnp.int32)) for tb in t]

  def cost(lam):
    return sum(c * s for c, s in zip(at_least(lam), step))  # int32: fits for buckets < 2^31 bits

  lo = jnp.uint32(0)  # lam = 0: all widest, over budget (checked above)
  hi = jnp.uint32(0x7F800000)  # lam = inf: all narrowest, fits
  import jax
  for _ in range(31):
    mid = lo + (hi - lo) // 2
    ok = cost(jax.lax.bitcast_convert_type(mid, jnp.float32)) <= limit
    lo, hi = jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
  c = at_least(jax.lax.bitcast_convert_type(hi, jnp.float32))
  # Spend what is left on the units that tie at the switching multiplier:
  # those that take the next width at ``lo`` but not at ``hi`` (a prefix
  # extension of each boundary's count), boundary by boundary in order of
  # gain per bit (lowest t first), as many as fit. Integer arithmetic.
  c_lo = at_least(jax.lax.bitcast_convert_type(lo, jnp.float32))
  left = jnp.int32(limit) - sum(ci * st for ci, st in zip(c, step))
  for i in np.argsort(np.asarray(t, np.float64), kind="stable"):
    room = c[i - 1] - c[i] if i > 0 else units - c[i]  # stay nested
    extra = jnp.minimum(jnp.minimum(c_lo[i] - c[i], room), left // step[i])
    extra = jnp.maximum(extra, 0)
    c[i] = c[i] + extra
    left = left - extra * step[i]
  counts = {hull[0]: units - c[0]}
  for i, x in enumerate(hull[1:]):
    counts[x] = c[i] - (c[i + 1] if i + 1 < len(c) else 0)
  return jnp.stack([jnp.asarray(counts.get(x, 0), jnp.int32) for x in w])
