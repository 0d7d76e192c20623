"""DropCompute's threshold: the stop rule, the expected throughput, and how it is chosen.

Host-side policy of :mod:`dynamiq_jax.training.dropcompute` (numpy only, no device
code): :func:`finished_mask` applies the stop rule to a matrix of
micro-batch times, :func:`throughput` is what a threshold buys,
:func:`choose_threshold` picks the best one from measured steps, and
:class:`DropCompute` / :class:`ThresholdController` hold the configuration
and the measure-choose-remeasure cycle of a training run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

__all__ = ["DropCompute", "ThresholdChoice", "ThresholdController", "finished_mask",
           "throughput", "choose_threshold"]

# ---------------------------------------------------------------------------
# the stop rule and the throughput model (numpy; no devices)


def _check_times(times) -> np.ndarray:
  t = np.asarray(times, np.float64)
  if t.ndim < 2 or t.shape[-1] < 1 or t.shape[-2] < 1:
    raise ValueError(f"times has shape {t.shape}; it must be [..., workers, micro_batches] "
                     f"with at least one of each")
  if not np.all(np.isfinite(t)) or np.any(t < 0):
    raise ValueError("times must be finite and >= 0 seconds: pass only steps in which every "
                     "micro-batch ran (no threshold)")
  return t


def _needs(t: np.ndarray) -> np.ndarray:
  """The least threshold at which each micro-batch is started (non-decreasing along m)."""
  ends = np.cumsum(t, axis=-1)
  fastest = np.minimum.accumulate(t, axis=-1)
  need = np.empty_like(t)
  need[..., 0] = -np.inf  # the first micro-batch always runs
  need[..., 1:] = ends[..., :-1] + fastest[..., :-1]
  return np.maximum.accumulate(need, axis=-1)


def finished_mask(times, threshold: float | None):
  """Which micro-batches each worker finishes under ``threshold``, by the stop rule.

  The rule (the one :class:`DropComputeStep` runs): the first micro-batch
  always runs; micro-batch ``m >= 1`` runs if the time spent so far plus
  the shortest micro-batch time so far is at most ``threshold``; once a
  worker stops, it stops for the step.

  Args:
    times: float ``[..., n, M]``: the time each micro-batch of each worker
      takes (seconds), as measured with no threshold.
    threshold: seconds; ``None`` or ``inf``: every micro-batch runs.

  Returns:
    ``(mask, done_s)``: bool ``[..., n, M]`` (a prefix of True per worker)
    and float ``[..., n]``, the time at which each worker leaves its
    micro-batches for the all-reduce.

  Examples:
    >>> mask, done = finished_mask([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]], 4.0)
    >>> mask.astype(int).tolist(), done.tolist()
    ([[1, 1, 1], [1, 1, 0]], [3.0, 4.0])
  """
  t = _check_times(times)
  if threshold is None:
    threshold = math.inf
  mask = _needs(t) <= threshold
  done = np.sum(np.where(mask, t, 0.0), axis=-1)
  return mask, done


def throughput(times, threshold: float | None, *, comm_s: float = 0.0):
  """Expected throughput under ``threshold`` on measured (or modelled) steps.

  Args:
    times: float ``[steps, n, M]`` micro-batch times of full steps.
    threshold: seconds (``None``/``inf``: synchronous).
    comm_s: the time of a step after the last worker's compute (the
      all-reduce and the update).

  Returns:
    ``(micro_batches_per_s, drop_rate)``: finished micro-batches of all
    workers per second (total over total time, the long-run rate) and the
    fraction of micro-batches dropped.

  Examples:
    >>> t = [[[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]]]
    >>> throughput(t, None)        # 8 micro-batches in 8 s
    (1.0, 0.0)
    >>> throughput(t, 4.0)         # the slow worker does 2: 6 in 4 s
    (1.5, 0.25)
  """
  t = _check_times(times)
  if t.ndim == 2:
    t = t[None]
  mask, done = finished_mask(t, threshold)
  total_time = float(np.sum(np.max(done, axis=-1) + comm_s))
  finished = float(mask.sum())
  return finished / total_time, 1.0 - finished / mask.size


class ThresholdChoice(NamedTuple):
  """What :func:`choose_threshold` found on the measured steps.

  Attributes:
    threshold_s: the chosen threshold in seconds (``inf``: dropping does
      not pay on these measurements).
    throughput: expected finished micro-batches per second under it.
    sync_throughput: the same without a threshold.
    drop_rate: expected fraction of micro-batches dropped.
    speedup: ``throughput / sync_throughput``.
    comm_s: the communication time the choice assumed.
  """

  threshold_s: float
  throughput: float
  sync_throughput: float
  drop_rate: float
  speedup: float
  comm_s: float


def _resample(t: np.ndarray, steps: int, seed: int) -> np.ndarray:
  """``steps`` synthetic steps: each worker's row of micro-batch times drawn whole from its
  own measured steps (so slowness that lasts a step, like a busy host, stays together)."""
  s, n, _ = t.shape
  rng = np.random.default_rng(seed)
  return t[rng.integers(0, s, size=(steps, n)), np.arange(n)[None, :]]


def choose_threshold(times, *, comm_s: float = 0.0, resample_steps: int | None = None,
                     seed: int = 0, min_gain: float = 0.0,
                     max_candidates: int = 512) -> ThresholdChoice:
  """The threshold that maximises the expected throughput on measured steps.

  Every threshold at which the stop rule (:func:`finished_mask`) changes
  what some worker computes in some measured step is a candidate; each is
  scored by :func:`throughput` (finished micro-batches of all workers over
  the total step time, ``comm_s`` included), the best kept. Within the
  interval of thresholds that score the same, the midpoint is returned;
  when no threshold beats running every micro-batch by more than
  ``min_gain``, ``inf``.

  Args:
    times: float ``[steps, n, M]`` (or ``[n, M]``): micro-batch times of
      full steps (no threshold), every worker's.
    comm_s: seconds of a step after the slowest worker's compute.
    resample_steps: if set, score on this many synthetic steps in which
      each worker's step (its row of ``M`` times) is drawn, with
      replacement, from its own measured steps: a smoother estimate from few
      measured steps, which assumes that workers, and steps, are independent
      (the times within a worker's step keep whatever they share).
    seed: seeds the resampling (the same seed gives the same choice on every
      process).
    min_gain: a threshold is chosen only if its expected throughput exceeds
      the synchronous one by more than this fraction: dropped samples are a
      cost the throughput does not count, not worth paying for a gain
      within the estimate's noise.
    max_candidates: at most this many candidate thresholds (quantiles of all
      of them when there are more).

  Returns:
    A :class:`ThresholdChoice`.

  Raises:
    ValueError: for times that are not finite and >= 0, or a negative ``comm_s``.

  Examples:
    >>> t = [[[1.0] * 8] * 7 + [[2.0] * 8]]        # 8 workers, one twice as slow
    >>> c = choose_threshold(t)
    >>> float(c.threshold_s), c.throughput, c.sync_throughput  # it does 4 of its 8
    (9.0, 7.5, 4.0)
  """
  t = _check_times(times)
  if t.ndim == 2:
    t = t[None]
  if t.ndim != 3:
    raise ValueError(f"times has shape {t.shape}; it must be [steps, workers, micro_batches]")
  if not comm_s >= 0:
    raise ValueError(f"comm_s={comm_s} must be >= 0 seconds")
  if not min_gain >= 0:
    raise ValueError(f"min_gain={min_gain} must be >= 0 (a fraction of the throughput)")
  if resample_steps:
    t = _resample(t, int(resample_steps), seed)
  needs = _needs(t)
  ends = np.cumsum(t, axis=-1)
  cands = np.unique(needs[np.isfinite(needs)])
  if cands.size > max_candidates:
    cands = np.unique(np.quantile(cands, np.linspace(0.0, 1.0, max_candidates)))
  top = float(needs.max()) if cands.size else 0.0
  # the last candidate is every micro-batch: the synchronous step
  cands = np.append(cands[cands < top], math.inf) if cands.size else np.array([math.inf])
  rates, drops = np.empty(cands.size), np.empty(cands.size)
  for lo in range(0, cands.size, 64):
    chunk = cands[lo:lo + 64]
    started = needs[None] <= chunk[:, None, None, None]           # [c, s, n, M]
    k = started.sum(-1)                                            # [c, s, n]
    done = np.take_along_axis(ends[None], np.maximum(k - 1, 0)[..., None], -1)[..., 0]
    step = done.max(-1) + comm_s                                   # [c, s]
    rates[lo:lo + 64] = k.sum((1, 2)) / step.sum(-1)
    drops[lo:lo + 64] = 1.0 - k.sum((1, 2)) / started[0].size
  best = int(np.flatnonzero(rates >= rates.max() * (1 - 1e-12))[-1])  # ties: the larger one
  if rates[best] <= rates[-1] * (1 + min_gain):
    best = cands.size - 1
  chosen = math.inf
  if math.isfinite(cands[best]):
    nxt = cands[best + 1] if math.isfinite(cands[best + 1]) else top
    chosen = float(0.5 * (cands[best] + nxt))
  sync = float(rates[-1])
  return ThresholdChoice(threshold_s=chosen, throughput=float(rates[best]),
                         sync_throughput=sync, drop_rate=float(drops[best]),
                         speedup=float(rates[best]) / sync, comm_s=float(comm_s))


# ---------------------------------------------------------------------------
# the threshold policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class DropCompute:
  """How the compute-time threshold is set.

  Attributes:
    threshold: ``"auto"`` (chosen from measured steps, see below), a fixed
      number of seconds, or ``None`` (off: every worker computes every
      micro-batch; the synchronous step).
    warmup_steps: with ``"auto"``, full steps (no threshold) measured before
      the first choice.
    reestimate_every: with ``"auto"``, steps between re-estimates; each
      re-estimate measures ``probe_steps`` full steps and chooses again from
      the last ``window`` full steps. 0: choose once.
    probe_steps: full steps measured per re-estimate.
    window: full steps (the most recent) a choice is made from.
    resample_steps: synthetic steps :func:`choose_threshold` scores on (0:
      the measured steps themselves).
    min_gain: the expected throughput gain (a fraction) below which no
      threshold is set (see :func:`choose_threshold`).
    seed: seeds that resampling.

  Examples:
    >>> DropCompute()                       # doctest: +ELLIPSIS
    DropCompute(threshold='auto', warmup_steps=5, ...)
    >>> DropCompute(threshold=0.25).threshold
    0.25
  """

  threshold: float | str | None = "auto"
  warmup_steps: int = 5
  reestimate_every: int = 100
  probe_steps: int = 2
  window: int = 20
  resample_steps: int = 256
  min_gain: float = 0.02
  seed: int = 0

  def __post_init__(self):
    th = self.threshold
    if isinstance(th, str):
      if th != "auto":
        raise ValueError(f"threshold={th!r}: use 'auto', a number of seconds, or None (off)")
    elif th is not None and not (isinstance(th, (int, float)) and th > 0):
      raise ValueError(f"threshold={th!r} must be > 0 seconds; use None to turn DropCompute "
                       f"off or 'auto' to choose it from measured steps")
    for name in ("warmup_steps", "probe_steps", "window"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    for name in ("reestimate_every", "resample_steps", "min_gain"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: none)")
    if self.reestimate_every and self.reestimate_every <= self.probe_steps:
      raise ValueError(f"reestimate_every={self.reestimate_every} must exceed "
                       f"probe_steps={self.probe_steps} (or be 0: never)")

  @property
  def enabled(self) -> bool:
    return self.threshold is not None


class ThresholdController:
  """The host-side state of a :class:`DropCompute` policy, step by step.

  Every process holds one and feeds it the same gathered measurements, so
  every process follows the same schedule of full (probe) steps and, on the
  same numpy, chooses the same threshold. Agreement is not needed for
  correctness: the threshold only decides when a worker stops, never which
  collectives run.

  Attributes:
    choice: the last :class:`ThresholdChoice` (None before the first).
  """

  def __init__(self, policy: DropCompute):
    self.policy = policy
    self.choice: ThresholdChoice | None = None
    self._full: list[np.ndarray] = []   # [n, M] times of full steps
    self._comm: list[float] = []

  def probing(self, step: int) -> bool:
    """Whether ``step`` runs with no threshold to measure full steps."""
    p = self.policy
    if p.threshold != "auto":
      return False
    if step < p.warmup_steps:
      return True
    if not p.reestimate_every:
      return False
    since = step - p.warmup_steps
    return since >= p.reestimate_every and since % p.reestimate_every < p.probe_steps

  def threshold(self, step: int) -> float:
    """The threshold (seconds; ``inf``: none) for ``step``."""
    th = self.policy.threshold
    if th is None:
      return math.inf
    if th != "auto":
      return float(th)
    if self.probing(step) or self.choice is None:
      return math.inf
    return self.choice.threshold_s

  def record(self, step: int, times: np.ndarray, comm_s: float | None) -> None:
    """Feeds the gathered ``[n, M]`` micro-batch times of ``step`` (NaN: not run) and the
    communication time of the step before it (None: unknown); chooses after the last
    full step of a warm-up or re-estimate."""
    p = self.policy
    if comm_s is not None and math.isfinite(comm_s):
      self._comm.append(float(comm_s))
    if not self.probing(step):
      return
    self._full.append(np.asarray(times, np.float64))
    self._full = self._full[-p.window:]
    if not self.probing(step + 1):
      comm = float(np.median(self._comm)) if self._comm else 0.0
      self.choice = choose_threshold(np.stack(self._full), comm_s=comm,
                                     resample_steps=p.resample_steps or None,
                                     seed=p.seed + step, min_gain=p.min_gain)


# ---------------------------------------------------------------------------
# the step
