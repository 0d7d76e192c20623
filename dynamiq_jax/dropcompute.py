"""Straggler-tolerant steps (DropCompute): a compute-time budget per worker.

Synchronous data parallelism with gradient accumulation waits every step for
the slowest worker's ``M`` micro-batches. DropCompute (Giladi et al., NeurIPS
2023) gives every worker a compute-time threshold per step: a worker that
reaches it stops accumulating, drops its remaining micro-batches and joins
the all-reduce, which then averages over the micro-batches actually
computed by all workers.

The stop rule, on the host between jitted micro-batch calls (each call
synchronised, so the times are the device's): a worker always computes its
first micro-batch; before micro-batch ``m >= 1`` it stops if the time spent
on this step plus the shortest micro-batch time of this step so far would
pass the threshold. So a worker whose micro-batches take equal times ends
within the threshold, and one hit by an unexpectedly slow micro-batch
overruns it by at most that micro-batch. :func:`finished_mask` applies the
same rule to a matrix of times, which is how the threshold is chosen and
how the simulated form on one process decides who drops what.

The all-reduce: every worker sends its gradient *sum* ``g_r`` over its
``k_r`` finished micro-batches, pre-scaled to ``g_r / (C / n)`` with
``C = sum_r k_r`` (an exact reduction of the counts, riding beside the
gradient), so that the averaging all-reduce of ``tx`` (``compressed_psum``
or ``baseline_psum``) returns ``sum_r g_r / C``: the mean over the finished
micro-batches of every worker. A worker that finished none sends zeros;
when every worker finishes all ``M``, ``C / n = M`` and the step is the
plain synchronous accumulation step, bit for bit.

The threshold (:class:`DropCompute`): ``"auto"`` measures full steps (no
threshold) first, then picks the threshold that maximises the expected
throughput -- finished micro-batches per second over all workers, the
communication time included -- on those measurements
(:func:`choose_threshold`), and re-measures a few full steps every
``reestimate_every`` steps; a number fixes it; ``None`` turns DropCompute
off (the synchronous step, without even the count reduction).

References:
  Giladi, Gottlieb, Shkolnik, Karnieli, Banner, Hoffer, Levy, Soudry,
  "DropCompute: simple and more robust distributed synchronous training via
  compute variance reduction", NeurIPS 2023 (arXiv 2306.10598).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.train import _state_specs
from dynamiq_jax.train import as_varying
from dynamiq_jax.train import is_per_rank

__all__ = [
    "DropCompute", "DropComputeStats", "ThresholdChoice", "ThresholdController",
    "DropComputeStep", "dropcompute_step", "simulated_step", "finished_mask",
    "throughput", "choose_threshold",
]

# Columns of the per-worker record gathered every step (float32, exact for counts < 2**24).
_COUNT, _LOSS, _POST = 0, 1, 2
_TIMES = 3


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


class DropComputeStats(NamedTuple):
  """What one DropCompute step did (host values, identical on every process).

  Attributes:
    step: the step's index (0-based).
    threshold_s: the threshold it ran under (``inf``: none; a full step).
    finished: micro-batches finished by all workers together.
    planned: ``n * M``.
    drop_rate: ``1 - finished / planned``.
    finished_per_worker: int ``[n]``.
    times: float ``[n, M]``: each micro-batch's time (NaN where dropped);
      with the policy off, only this process's row is known (others NaN).
    compute_s: float ``[n]``: the time each worker spent on micro-batches.
    step_s: this process's time for the whole step (micro-batches, all-reduce,
      update, results ready).
    loss: mean loss over the finished micro-batches.
    choice: the policy's current :class:`ThresholdChoice` (None: none yet).
  """

  step: int
  threshold_s: float
  finished: int
  planned: int
  drop_rate: float
  finished_per_worker: np.ndarray
  times: np.ndarray
  compute_s: np.ndarray
  step_s: float
  loss: float
  choice: ThresholdChoice | None


def _reduce_and_update(tx, params, opt_state, grad_sum, record, *, axis_name, n: int,
                       micro_batches: int, counted: bool):
  """The all-reduce of the pre-scaled gradient sums, and the update (inside shard_map).

  ``record`` is this worker's float32 row ``[1, K]``: ``[count, loss_sum, post_s,
  times...]``. With ``counted`` the rows are gathered (exactly) and the
  gradient sums divided by ``C / n``; otherwise every worker finished all
  ``M`` and they are divided by ``M``, as a synchronous accumulation step does.
  """
  if counted:
    # every worker's row, exactly (x + 0 = x) and replicated: a psum of one-row matrices
    mine = jax.lax.axis_index(axis_name) == jnp.arange(n)[:, None]
    rows = jax.lax.psum(jnp.where(mine, record, np.float32(0)), axis_name)    # [n, K]
    total = jnp.sum(rows[:, _COUNT])
    loss = jnp.sum(rows[:, _LOSS]) / jnp.maximum(total, 1)
    per = jnp.where(total > 0, total / np.float32(n), np.float32(1))
  else:
    rows = None
    loss = jax.lax.psum(record[0, _LOSS], axis_name) / np.float32(n * micro_batches)
    per = np.float32(micro_batches)
  grads = jax.tree.map(lambda g: g / per, grad_sum)
  updates, new_opt = tx.update(grads, opt_state, params)
  if n == 1:
    # allreduce returns its input unchanged on one rank, still typed per-rank; a psum over
    # the size-1 axis (free) makes it replicated, as the parameters are.
    updates = jax.lax.psum(updates, axis_name)
  # No jnp.where to skip the update when nothing finished (only a simulated mask can do
  # that; the host loop always runs a first micro-batch): the gradient is then zero, and
  # the update is left as XLA compiles today's step, so it stays bit for bit the same.
  return optax.apply_updates(params, updates), new_opt, loss, rows


def _grad_fn(loss_fn):
  """``(acc, loss_acc, params, batch) -> (acc + grad, loss_acc + loss)``; ``acc`` has a
  leading axis of 1 (this worker's row of the global ``[n, ...]`` sums), float32."""

  def one(acc, loss_acc, params, batch):
    loss, g = jax.value_and_grad(loss_fn)(params, batch)
    acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32)[None], acc, g)
    return acc, loss_acc + loss.astype(jnp.float32)

  return one


def _check_micro_batches(micro_batches):
  if not (isinstance(micro_batches, (int, np.integer)) and micro_batches >= 1):
    raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1 (the micro-batches "
                     f"each worker accumulates per step)")
  return int(micro_batches)


@functools.lru_cache(maxsize=16)
def _accumulate_program(loss_fn):
  """The jitted micro-batch call (shared by every step built for ``loss_fn``)."""
  return jax.jit(_grad_fn(loss_fn), donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def _global_program(tx, mesh, axis_name, micro_batches, counted, spec_treedef, spec_leaves):
  """The jitted all-reduce and update (shared by every step with these arguments, so a
  second policy with the same ``tx`` compiles nothing new)."""
  specs = jax.tree.unflatten(spec_treedef, spec_leaves)
  n = mesh.shape[axis_name]

  def body(params, opt_state, grad_sum, record):
    grad_sum = jax.tree.map(lambda g: g[0], grad_sum)
    return _reduce_and_update(tx, params, opt_state, grad_sum, record, axis_name=axis_name,
                              n=n, micro_batches=micro_batches, counted=counted)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis_name), P(axis_name)),
                     out_specs=(P(), specs, P(), P() if counted else None), check_vma=True)
  shard = lambda spec: NamedSharding(mesh, spec)
  out_shardings = (shard(P()), jax.tree.map(shard, specs), shard(P()),
                   shard(P()) if counted else None)
  return jax.jit(fn, out_shardings=out_shardings)


class DropComputeStep:
  """The callable :func:`dropcompute_step` returns (one worker per process).

  Attributes:
    controller: the :class:`ThresholdController`.
    steps: how many steps ran.
  """

  def __init__(self, loss_fn, tx, *, mesh, axis_name, micro_batches: int, policy: DropCompute,
               clock: Callable[[], float]):
    self.n = mesh.shape[axis_name]
    self.mesh, self.axis_name, self.tx = mesh, axis_name, tx
    self.micro_batches = micro_batches
    self.policy = policy
    self.controller = ThresholdController(policy)
    self.clock = clock
    self.steps = 0
    self._post_s = math.nan
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if len(mine) != 1:
      raise ValueError(
          f"dropcompute_step runs one worker per process, but this process holds {len(mine)} "
          f"devices of the mesh: give each process one device "
          f"(dq.multiprocess.initialize(..., local_devices=1)), or use "
          f"dq.dropcompute.simulated_step for many workers in one process")
    self.device = mine[0]
    self.rank = list(mesh.devices.flat).index(self.device)
    self._accumulate = _accumulate_program(loss_fn)

  def _global_step(self, opt_state):
    specs = _state_specs(opt_state, self.mesh, (self.axis_name,))
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, P))
    return _global_program(self.tx, self.mesh, self.axis_name, self.micro_batches,
                           self.policy.enabled, treedef, tuple(leaves))

  def _global(self, local, spec_shape):
    sharding = NamedSharding(self.mesh, P(self.axis_name))
    return jax.make_array_from_single_device_arrays((self.n,) + tuple(spec_shape[1:]),
                                                    sharding, [local])

  def __call__(self, params, opt_state, batches):
    """Runs one step: this worker's micro-batches under the budget, then the all-reduce.

    Args:
      params: replicated parameters (global arrays over the mesh).
      opt_state: the optimizer state, placed as for :func:`dynamiq_jax.data_parallel_step`.
      batches: this worker's micro-batches: a sequence of ``M`` pytrees, or
        a callable ``m -> pytree`` (called only for micro-batches that run,
        its time counted in the budget).

    Returns:
      ``(params, opt_state, loss, stats)``: ``loss`` the mean over finished
      micro-batches (a float), ``stats`` a :class:`DropComputeStats`.
    """
    fetch = batches if callable(batches) else batches.__getitem__
    if not callable(batches) and len(batches) != self.micro_batches:
      raise ValueError(f"got {len(batches)} micro-batches; this step was built for "
                       f"micro_batches={self.micro_batches}")
    step = self.steps
    threshold = self.controller.threshold(step)
    local = jax.tree.map(lambda a: a.addressable_data(0), params)
    acc = jax.tree.map(lambda a: jnp.zeros((1,) + a.shape, jnp.float32, device=self.device),
                       local)
    loss_acc = jnp.zeros((), jnp.float32, device=self.device)
    times = np.full(self.micro_batches, np.nan)
    start = self.clock()
    fastest = math.inf
    for m in range(self.micro_batches):
      if m and (self.clock() - start) + fastest > threshold:
        break
      t0 = self.clock()
      batch = jax.device_put(fetch(m), self.device)
      acc, loss_acc = self._accumulate(acc, loss_acc, local, batch)
      jax.block_until_ready((acc, loss_acc))
      times[m] = self.clock() - t0
      fastest = min(fastest, times[m])
    loop_end = self.clock()
    count = int(np.sum(~np.isnan(times)))
    record = np.concatenate([[count, float(loss_acc), self._post_s], times])
    record = jax.device_put(record.astype(np.float32)[None], self.device)
    g_acc = jax.tree.map(lambda a: self._global(a, (self.n,) + a.shape[1:]), acc)
    g_rec = self._global(record, (self.n,) + record.shape[1:])
    fn = self._global_step(opt_state)
    params, opt_state, loss, rows = fn(params, opt_state, g_acc, g_rec)
    jax.block_until_ready((params, opt_state, loss))
    end = self.clock()
    self._post_s = end - loop_end
    stats = self._stats(step, threshold, rows, times, float(np.asarray(loss.addressable_data(0))),
                        end - start)
    self.steps += 1
    return params, opt_state, stats.loss, stats

  def _stats(self, step, threshold, rows, times, loss, step_s):
    n, M = self.n, self.micro_batches
    if rows is None:  # off: every worker finished everything; only this row's times known
      all_times = np.full((n, M), np.nan)
      all_times[self.rank] = times
      per = np.full(n, M)
    else:
      rows = np.asarray(rows.addressable_data(0), np.float64)
      all_times = rows[:, _TIMES:]
      per = rows[:, _COUNT].astype(np.int64)
      post = rows[:, _POST]
      # the communication time of the previous step: its fastest worker's wait after compute
      comm = float(np.min(post)) if step and np.all(np.isfinite(post)) else None
      self.controller.record(step, all_times, comm)
    finished = int(per.sum())
    return DropComputeStats(
        step=step, threshold_s=threshold, finished=finished, planned=n * M,
        drop_rate=1.0 - finished / (n * M), finished_per_worker=per, times=all_times,
        compute_s=np.nansum(all_times, axis=1), step_s=step_s, loss=loss,
        choice=self.controller.choice)


def dropcompute_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, *, mesh,
                     micro_batches: int, policy: DropCompute | None = None,
                     axis_name: str = "data",
                     clock: Callable[[], float] = time.perf_counter) -> DropComputeStep:
  """A data-parallel step with gradient accumulation under a compute-time budget.

  One worker per process (``dq.multiprocess``, one device each): each
  process runs its own micro-batches, one jitted call each, synchronised
  and timed on the host, and stops by the rule in the module docstring;
  then every process runs the same jitted all-reduce and update, so the
  collectives stay in the same order on every process whatever each one
  dropped.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss``, the mean loss over one
      micro-batch.
    tx: the optimizer chain; it must start with an averaging all-reduce over
      ``axis_name`` (:func:`dynamiq_jax.compressed_psum` with any codec, or
      :func:`dynamiq_jax.baseline_psum`), which receives each worker's
      pre-scaled gradient sum.
    mesh: a mesh over every process's device with axis ``axis_name``.
    micro_batches: ``M``, the micro-batches each worker accumulates per step.
    policy: a :class:`DropCompute`; None means ``DropCompute()`` (``"auto"``).
    axis_name: the data-parallel mesh axis.
    clock: seconds, monotonic (tests pass a fake one).

  Returns:
    A :class:`DropComputeStep`: ``step(params, opt_state, batches) ->
    (params, opt_state, loss, stats)``.

  Raises:
    ValueError: for a process holding other than one device of the mesh, or
      ``micro_batches`` < 1.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, dynamiq_jax as dq
    >>> mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    >>> tx = optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.sgd(1.0))
    >>> loss_fn = lambda p, b: 0.5 * jnp.sum((b - p["w"]) ** 2)   # SGD(1) moves w to b
    >>> step = dq.dropcompute_step(loss_fn, tx, mesh=mesh,
    ...                            micro_batches=2, policy=dq.DropCompute(threshold=None))
    >>> params = jax.device_put({"w": jnp.zeros(2)}, jax.NamedSharding(mesh, jax.P()))
    >>> opt = jax.device_put(tx.init(params), jax.NamedSharding(mesh, jax.P()))
    >>> params, opt, loss, stats = step(params, opt, [jnp.ones(2), 3 * jnp.ones(2)])
    >>> params["w"].tolist(), loss, stats.drop_rate     # the mean of the micro-batches
    ([2.0, 2.0], 5.0, 0.0)
  """
  policy = DropCompute() if policy is None else policy
  return DropComputeStep(loss_fn, tx, mesh=mesh, axis_name=axis_name,
                         micro_batches=_check_micro_batches(micro_batches), policy=policy,
                         clock=clock)


def simulated_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation, *, mesh,
                   micro_batches: int, axis_name: str = "data"):
  """The DropCompute step for many workers in one process, given who finished what.

  The same pre-scaling, count reduction and update as
  :func:`dropcompute_step`, in one jitted ``shard_map`` program: rank ``r``
  accumulates the gradients of its micro-batches ``m`` with
  ``mask[r, m]`` (all of them are computed; the mask selects), e.g. a mask
  from :func:`finished_mask` on a time model.

  Args:
    loss_fn: as for :func:`dropcompute_step`.
    tx: as for :func:`dropcompute_step`.
    mesh: a mesh with axis ``axis_name`` (e.g. simulated CPU devices).
    micro_batches: ``M``.
    axis_name: the data-parallel axis.

  Returns:
    ``step(params, opt_state, batches, mask) -> (params, opt_state, loss,
    finished)``: ``batches`` leaves ``[n, M, ...]`` and bool ``mask [n, M]``,
    both split over ``axis_name`` (``jax.device_put`` them with
    ``NamedSharding(mesh, P(axis_name))``); ``finished`` the total count.
    The step is jitted (the optimizer state's placement as for
    :func:`dynamiq_jax.data_parallel_step`).
  """
  M = _check_micro_batches(micro_batches)
  n = mesh.shape[axis_name]
  one = _grad_fn(loss_fn)

  def body(params, opt_state, batches, mask):
    mine = as_varying(params, axis_name)
    mask = mask[0]
    batches = jax.tree.map(lambda b: b[0], batches)
    acc = jax.tree.map(lambda p: jnp.zeros((1,) + p.shape, jnp.float32), mine)
    loss_acc = jnp.zeros((), jnp.float32)
    for m in range(M):  # unrolled: M is small, and each micro-batch is its own gradient
      acc_m, loss_m = one(acc, loss_acc, mine, jax.tree.map(lambda b: b[m], batches))
      acc = jax.tree.map(lambda new, old: jnp.where(mask[m], new, old), acc_m, acc)
      loss_acc = jnp.where(mask[m], loss_m, loss_acc)
    count = jnp.sum(mask.astype(jnp.float32))
    record = jnp.zeros((1, _TIMES + M), jnp.float32)
    record = record.at[0, _COUNT].set(count).at[0, _LOSS].set(loss_acc)
    params, opt_state, loss, rows = _reduce_and_update(
        tx, params, opt_state, jax.tree.map(lambda a: a[0], acc), record,
        axis_name=axis_name, n=n, micro_batches=M, counted=True)
    return params, opt_state, loss, jnp.sum(rows[:, _COUNT]).astype(jnp.int32)

  built = {}

  def step(params, opt_state, batches, mask):
    structure = jax.tree.structure(opt_state, is_leaf=is_per_rank)
    if structure not in built:
      specs = _state_specs(opt_state, mesh, (axis_name,))
      fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis_name), P(axis_name)),
                         out_specs=(P(), specs, P(), P()), check_vma=True)
      built[structure] = jax.jit(fn)
    return built[structure](params, opt_state, batches, mask)

  return step
