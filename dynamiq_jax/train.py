"""Building a correct data-parallel train step, and the uncompressed baseline.

The trap this module exists for (DESIGN.md): inside
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

__all__ = ["as_varying", "baseline_psum", "data_parallel_step", "DataParallelStep"]


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
    n = jax.lax.axis_size(axis_name)

    def one(g):
      s = jax.lax.psum(g.astype(dtype), axis_name)
      s = s.astype(jnp.float32) / n if average else s.astype(jnp.float32)
      return s.astype(g.dtype)

    return jax.tree.map(one, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def data_parallel_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                       *, mesh, axis_name="data", has_aux: bool = False,
                       donate: bool = True):
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

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss[, aux])``
    with params and opt_state replicated and every batch leaf split over
    ``axis_name`` along its leading axis (``jax.device_put`` it with
    ``NamedSharding(mesh, P(axis_name))`` first). ``loss`` is the mean over
    ranks.
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

  n_out = 4 if has_aux else 3
  step = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(axis_name)),
                       out_specs=(P(),) * n_out, check_vma=True)
  # Replicated outputs carry the sharding P() that replicated inputs carry, so
  # feeding a step's outputs to the next step hits the jit cache.
  replicated = NamedSharding(mesh, P())
  jitted = jax.jit(step, out_shardings=(replicated,) * n_out,
                   donate_argnums=(0, 1) if donate else ())
  return DataParallelStep(jitted, sync=mesh.devices.flat[0].platform == "cpu")


class DataParallelStep:
  """The callable :func:`data_parallel_step` returns.

  On the CPU platform each call waits for its results: XLA's in-process CPU
  collectives can deadlock when many steps with collectives are queued at
  once (seen with 8 simulated devices on 2 cores: a rendezvous timeout after
  ~180 asynchronously dispatched BF16 psum steps). On GPUs calls stay
  asynchronous.

  Attributes:
    jitted: the underlying ``jax.jit`` function (``.lower``, ``._cache_size``).
  """

  def __init__(self, jitted, sync: bool):
    self.jitted = jitted
    self.sync = sync

  def __call__(self, params, opt_state, batch):
    out = self.jitted(params, opt_state, batch)
    return jax.block_until_ready(out) if self.sync else out
