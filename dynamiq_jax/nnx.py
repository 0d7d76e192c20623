"""Data-parallel Flax NNX training with the compressed all-reduce.

:class:`DataParallel` splits an NNX model and its ``nnx.Optimizer`` (whose
optax chain starts with the gradient all-reduce) into one state pytree,
places it replicated on a 1-D mesh and builds a ``jax.shard_map`` step that
merges them again on every rank::

    import dynamiq_jax as dq
    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))
    dp = dq.nnx.DataParallel.create(model, tx, mesh=mesh)
    step = dp.train_step(loss_fn)            # loss_fn(model, batch) -> mean loss
    state = dp.state
    for batch in batches:                    # leaves split over "data" (NamedSharding)
      state, loss = step(state, batch)
    model, optimizer = dp.merge(state)

The step runs with ``check_vma=True`` and differentiates with respect to a
per-rank copy of the parameters (:func:`dynamiq_jax.as_varying`):
differentiating the replicated parameters directly would make ``jax.grad``
return gradients that XLA already summed at full precision. Optimizer state
that differs between ranks (:class:`dynamiq_jax.PerRank`, the
error-feedback residuals of ``compressed_psum(error_feedback=True)``) is
split over the data axis; everything else is replicated.

Needs flax (``pip install "dynamiq-jax[examples]"``); ``import dynamiq_jax``
loads this module only when ``dq.nnx`` is first used.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.train import SyncedStep
from dynamiq_jax.train import is_per_rank
from dynamiq_jax.train import as_varying
from dynamiq_jax.train import resolve_sync_every

__all__ = ["DataParallel"]


def _raw_key(k):
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _per_rank_prefixes(optimizer: nnx.Optimizer, prefix: tuple) -> list[tuple]:
  """State paths of the optimizer's per-rank (:class:`~dynamiq_jax.PerRank`) subtrees."""
  found = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      optimizer.opt_state, is_leaf=is_per_rank)[0]:
    if is_per_rank(leaf):
      found.append(prefix + ("opt_state",) + tuple(_raw_key(k) for k in path))
  return found


class DataParallel:
  """An NNX model and its optimizer as one state pytree on a data-parallel mesh.

  Args:
    model: the NNX module (its state must change only through the optimizer:
      no batch statistics or RNG streams updated in the forward pass).
    optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with ``tx``
      starting with the all-reduce over ``axis_name``
      (:func:`dynamiq_jax.compressed_psum`, :func:`dynamiq_jax.reducer`).
    mesh: a mesh with the axis ``axis_name``.
    axis_name: the data-parallel mesh axis.

  Attributes:
    graphdef: the static structure of ``(model, optimizer)``.
    state: the initial state, placed on ``mesh`` (pass it to the steps; they
      return the new one).
    specs: the ``PartitionSpec`` of every state leaf.
    shardings: the ``NamedSharding`` of every state leaf.
  """

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, *, mesh,
               axis_name: str = "data"):
    if axis_name not in mesh.shape:
      raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                       f"{dict(mesh.shape)}; pass one of {tuple(mesh.shape)}")
    self.mesh = mesh
    self.axis_name = axis_name
    n = mesh.shape[axis_name]
    self.graphdef, state = nnx.split((model, optimizer))
    per_rank = _per_rank_prefixes(optimizer, (1,))

    def spec(path, _):
      keys = tuple(_raw_key(k) for k in path)
      return P(axis_name) if any(keys[:len(p)] == p for p in per_rank) else P()

    self.specs = jax.tree_util.tree_map_with_path(spec, state)
    self.shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                                  is_leaf=lambda x: isinstance(x, P))

    def place(x, s):
      if s.spec != P():  # per-rank leaves start equal: one copy per rank
        x = jnp.repeat(x, n, axis=0)
      return jax.device_put(x, s)

    self.state = jax.tree.map(place, state, self.shardings)

  @classmethod
  def create(cls, model: nnx.Module, tx, *, mesh, axis_name: str = "data") -> DataParallel:
    """``DataParallel(model, nnx.Optimizer(model, tx, wrt=nnx.Param), ...)``.

    Args:
      model: the NNX module.
      tx: the optax chain, starting with the all-reduce over ``axis_name``.
      mesh: a mesh with the axis ``axis_name``.
      axis_name: the data-parallel mesh axis.
    """
    return cls(model, nnx.Optimizer(model, tx, wrt=nnx.Param), mesh=mesh, axis_name=axis_name)

  def merge(self, state=None):
    """``(model, optimizer)`` from ``state`` (default: the initial state)."""
    return nnx.merge(self.graphdef, self.state if state is None else state)

  def shard_batch(self, batch):
    """Puts every leaf of a host batch on the mesh, split along its leading axis."""
    return jax.device_put(batch, NamedSharding(self.mesh, P(self.axis_name)))

  def train_step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], *, donate: bool = True,
                 sync_every: int | None = None) -> SyncedStep:
    """The jitted step ``step(state, batch) -> (state, loss)``.

    Args:
      loss_fn: ``loss_fn(model, batch) -> loss``, the mean loss over this
        rank's part of the batch.
      donate: donate the state buffers to the step.
      sync_every: wait for the results every this many steps (0: never);
        ``None`` means after every step on a CPU mesh
        (:data:`dynamiq_jax.train.CPU_SYNC_EVERY`: XLA's CPU collectives can
        deadlock when many steps are queued) and never elsewhere.

    Returns:
      The step (its ``jitted`` attribute is the ``jax.jit`` function).
      ``batch`` leaves must be split over the data axis along their leading
      axis (:meth:`shard_batch`); ``loss`` is the mean over ranks.
    """
    graphdef, axis_name = self.graphdef, self.axis_name

    def local(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      params_def, params, rest = nnx.split(model, optimizer.wrt, ...)

      def loss_of(params):
        return loss_fn(nnx.merge(params_def, params, rest), batch)

      # Gradients of a per-rank copy stay per-rank; the optimizer's chain
      # all-reduces them (compressed), not XLA.
      loss, grads = jax.value_and_grad(loss_of)(as_varying(params, axis_name))
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), jax.lax.pmean(loss, axis_name)

    mapped = jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, P(axis_name)),
                           out_specs=(self.specs, P()), check_vma=True)
    # Outputs keep the inputs' shardings, so the next step hits the jit cache.
    jitted = jax.jit(mapped, out_shardings=(self.shardings, NamedSharding(self.mesh, P())),
                     donate_argnums=(0,) if donate else ())
    return SyncedStep(jitted, resolve_sync_every(sync_every, self.mesh))

  def eval_step(self, per_example_fn: Callable[[nnx.Module, Any], Any]):
    """The jitted ``evaluate(state, batch) -> per-example outputs`` (split like the batch).

    Args:
      per_example_fn: ``fn(model, batch) -> pytree`` of arrays with the
        batch's leading axis (e.g. per-example loss and correctness).
    """
    graphdef, axis_name = self.graphdef, self.axis_name

    def local(state, batch):
      model, _ = nnx.merge(graphdef, state)
      return per_example_fn(model, batch)

    return jax.jit(jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, P(axis_name)),
                                 out_specs=P(axis_name), check_vma=True))

  def checkpoint_tree(self, state) -> dict:
    """``state`` as a plain nested dict of arrays, e.g. for orbax."""
    return nnx.to_pure_dict(state)

  def from_checkpoint_tree(self, tree):
    """The inverse of :meth:`checkpoint_tree` (leaves keep the placed state's shardings)."""
    state = jax.tree.map(lambda x: x, self.state)
    nnx.replace_by_pure_dict(state, tree)
    return state
