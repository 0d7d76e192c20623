"""Building a correct data-parallel train step, and the uncompressed baseline.

The trap this module exists for: inside
``jax.shard_map(check_vma=True)``, ``jax.grad`` of *replicated* parameters
returns gradients that XLA has already summed across the axis at full
precision. A compressed all-reduce after that only adds work. The fix is to
differentiate with respect to a per-rank ("varying") copy of the parameters,
which is what :func:`data_parallel_step` does; :func:`dynamiq_jax.allreduce`
raises a clear error when it receives already-reduced gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.schedules.context import axis_size

__all__ = [
    "as_varying", "baseline_psum", "data_parallel_init", "data_parallel_step",
    "DataParallelStep", "SyncedStep", "CPU_SYNC_EVERY", "resolve_sync_every", "is_per_rank",
]


def as_varying(tree, axis_name):
  """Marks replicated values as per-rank inside ``shard_map(check_vma=True)``."""
  cast = getattr(jax.lax, "pcast", None)
  if cast is not None:
    return cast(tree, axis_name, to="varying")
  return jax.lax.pvary(tree, axis_name)  # jax versions before pcast


def baseline_psum(axis_name="data", *, dtype=jnp.bfloat16, average: bool = True
                  ) -> optax.GradientTransformationExtraArgs:
  """The uncompressed baseline: ``jax.lax.psum`` of gradients cast to ``dtype``.

  ``dtype=jnp.bfloat16`` is the paper's BF16 all-reduce; results come back in
  each leaf's own dtype.

  Args:
    axis_name: the data-parallel axis.
    dtype: the dtype on the wire.
    average: mean (like ``pmean``) or sum.
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    n = axis_size(axis_name)  # the library's UnboundAxisError under plain jax.jit

    def one(g):
      s = jax.lax.psum(g.astype(dtype), axis_name)
      s = s.astype(jnp.float32) / n if average else s.astype(jnp.float32)
      return s.astype(g.dtype)

    return jax.tree.map(one, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def is_per_rank(x):
  """Whether ``x`` is a :class:`~dynamiq_jax.transform.PerRank` part of an optimizer
  state (one value per rank, e.g. the error-feedback residual)."""
  from dynamiq_jax.transform import PerRank
  return isinstance(x, PerRank)


def _state_specs(opt_state, axis_name):
  """P(axis) for per-rank (error-feedback) leaves, P() for everything else."""
  return jax.tree.map(
      lambda x: jax.tree.map(lambda _: P(axis_name), x) if is_per_rank(x) else P(),
      opt_state, is_leaf=is_per_rank)


def data_parallel_init(tx: optax.GradientTransformation, params, *, mesh, axis_name="data"):
  """``tx.init(params)`` placed for :func:`data_parallel_step`.

  Replicated state goes to every device (``P()``); per-rank state (the
  error-feedback residuals of ``compressed_psum(error_feedback=True)``) gets
  one slice per rank along ``axis_name``.
  """
  state = tx.init(params)
  n = mesh.shape[axis_name]
  repl = NamedSharding(mesh, P())
  split = NamedSharding(mesh, P(axis_name))

  def place(x):
    if is_per_rank(x):
      return jax.tree.map(lambda a: jax.device_put(jnp.repeat(a, n, axis=0), split), x)
    return jax.device_put(x, repl)

  return jax.tree.map(place, state, is_leaf=is_per_rank)


def data_parallel_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                       *, mesh, axis_name="data", has_aux: bool = False,
                       donate: bool = True, sync_every: int | None = None):
  """A jitted data-parallel step: local gradients, ``tx`` all-reduces them.

  ``tx`` must start with the all-reduce (``compressed_psum`` or
  ``baseline_psum``) over ``axis_name``. The step runs under
  ``jax.shard_map(check_vma=True)`` and differentiates with respect to a
  per-rank copy of the parameters, so gradients reach ``tx`` un-reduced.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), the mean loss over this rank's part of the batch.
    tx: the optimizer chain.
    mesh: a mesh with axis ``axis_name``.
    axis_name: the data-parallel mesh axis.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux is averaged
      over ranks (it must be a pytree of floats).
    donate: donate params and optimizer state buffers.
    sync_every: wait for the results every this many steps (0: never);
      ``None`` means after every step on CPU meshes (:data:`CPU_SYNC_EVERY`,
      which avoids a deadlock of XLA's CPU collectives) and never on others.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss[, aux])``
    with params replicated, the optimizer state placed by
    :func:`data_parallel_init` (or ``jax.device_put`` to ``P()`` when it has
    no per-rank part), and every batch leaf split over ``axis_name`` along
    its leading axis (``jax.device_put`` it with ``NamedSharding(mesh,
    P(axis_name))`` first). ``loss`` is the mean over ranks.
  """

  def local(params, opt_state, batch):
    mine = as_varying(params, axis_name)
    out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(mine, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    out = jax.tree.map(lambda v: jax.lax.pmean(v, axis_name), out)
    if has_aux:
      return params, opt_state, out[0], out[1]
    return params, opt_state, out

  def build(opt_state):
    specs = _state_specs(opt_state, axis_name)
    n_extra = 2 if has_aux else 1
    step = jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P(axis_name)),
                         out_specs=(P(), specs) + (P(),) * n_extra, check_vma=True)
    # Replicated outputs carry the sharding P() that replicated inputs carry, so
    # feeding a step's outputs to the next step hits the jit cache.
    shard = lambda spec: NamedSharding(mesh, spec)
    out_shardings = ((shard(P()), jax.tree.map(shard, specs))
                     + (shard(P()),) * n_extra)
    return jax.jit(step, out_shardings=out_shardings,
                   donate_argnums=(0, 1) if donate else ())

  return DataParallelStep(build, sync_every=resolve_sync_every(sync_every, mesh))


CPU_SYNC_EVERY = 1
"""Steps between waits for results on CPU meshes (the default ``sync_every`` there).

XLA's in-process CPU collectives can deadlock when many steps with
collectives are queued at once: with 8 simulated devices on 2 cores, about
180 asynchronously dispatched BF16 psum steps end in a rendezvous timeout.
Waiting after every step keeps the queue at one step; CPU devices gain
nothing from running ahead.
"""


def resolve_sync_every(sync_every: int | None, mesh) -> int:
  """``sync_every``, or its default for ``mesh``: :data:`CPU_SYNC_EVERY` on CPU, else 0 (never).

  Raises:
    ValueError: for a negative ``sync_every``.
  """
  if sync_every is None:
    return CPU_SYNC_EVERY if mesh.devices.flat[0].platform == "cpu" else 0
  if sync_every < 0:
    raise ValueError(f"{sync_every=} must be >= 0 (0: never wait, k: wait every k steps)")
  return int(sync_every)


class SyncedStep:
  """A jitted step that waits for its results every ``sync_every`` calls.

  Args:
    jitted: the ``jax.jit`` function.
    sync_every: wait (``jax.block_until_ready``) on every ``sync_every``-th
      call's outputs; 0 never waits (calls stay asynchronous).

  Attributes:
    jitted: the underlying ``jax.jit`` function (``.lower``, ``._cache_size``).
    sync_every: as given.
    calls: how many times the step ran.
  """

  def __init__(self, jitted, sync_every: int):
    self.jitted = jitted
    self.sync_every = sync_every
    self.calls = 0

  def __call__(self, *args):
    out = self.jitted(*args)
    self.calls += 1
    if self.sync_every and self.calls % self.sync_every == 0:
      out = jax.block_until_ready(out)
    return out


class DataParallelStep(SyncedStep):
  """The callable :func:`data_parallel_step` returns.

  It waits for its results every ``sync_every`` steps (by default after
  every step on CPU, see :data:`CPU_SYNC_EVERY`, and never on GPUs).

  Attributes:
    jitted: the underlying ``jax.jit`` function (``.lower``, ``._cache_size``),
      built at the first call (its shardings follow the optimizer state).
    sync_every: steps between waits (0: never).
  """

  def __init__(self, build, sync_every: int):
    super().__init__(None, sync_every)
    self._build = build
    self._built = {}

  def __call__(self, params, opt_state, batch):
    structure = jax.tree.structure(opt_state, is_leaf=is_per_rank)
    if structure not in self._built:
      self._built[structure] = self._build(opt_state)
    self.jitted = self._built[structure]
    return super().__call__(params, opt_state, batch)
