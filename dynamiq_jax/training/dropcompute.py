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

import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.training.thresholds import DropCompute
from dynamiq_jax.training.thresholds import ThresholdChoice
from dynamiq_jax.training.thresholds import ThresholdController
from dynamiq_jax.training.thresholds import choose_threshold
from dynamiq_jax.training.thresholds import finished_mask
from dynamiq_jax.training.thresholds import throughput
from dynamiq_jax.training.train import opt_state_specs
from dynamiq_jax.training.train import as_varying
from dynamiq_jax.training.train import is_per_rank

__all__ = [
    "DropCompute", "DropComputeStats", "ThresholdChoice", "ThresholdController",
    "DropComputeStep", "dropcompute_step", "simulated_step", "finished_mask",
    "throughput", "choose_threshold",
]

# Columns of the per-worker record gathered every step (float32, exact for counts < 2**24).
_COUNT, _LOSS, _POST = 0, 1, 2
_TIMES = 3  # the micro-batch times from here on
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
    specs = opt_state_specs(opt_state, self.mesh, (self.axis_name,))
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
      specs = opt_state_specs(opt_state, mesh, (axis_name,))
      fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P(axis_name), P(axis_name)),
                         out_specs=(P(), specs, P(), P()), check_vma=True)
      built[structure] = jax.jit(fn)
    return built[structure](params, opt_state, batches, mask)

  return step
