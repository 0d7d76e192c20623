"""Data-parallel Flax NNX training with ``jax.shard_map`` and ``nnx.Optimizer``.

The model and its ``nnx.Optimizer`` (whose optax chain starts with the
gradient all-reduce) are split into one state pytree, placed replicated on a
1-D mesh, and merged again inside a ``jax.shard_map`` step::

    optimizer = nnx.Optimizer(model, optax.chain(dq.compressed_psum("data"),
                                                 optax.adamw(1e-3)), wrt=nnx.Param)
    dp = DataParallel(model, optimizer, mesh=mesh)
    step = dp.train_step(loss_fn)              # loss_fn(model, batch) -> mean loss
    state, loss = step(dp.state, shard_batch(mesh, batch))

(``DataParallel.create(model, tx, mesh=mesh)`` builds the optimizer, and
:meth:`DataParallel.train_loop` runs :func:`examples.common.train_loop`
with that step.)

The step runs with ``check_vma=True`` and differentiates with respect to a
per-rank copy of the parameters (``dq.as_varying``): differentiating the
replicated parameters directly would make ``jax.grad`` return gradients
that XLA already summed at full precision (see the README's "check_vma
trap"). Optimizer state that differs between ranks (``dq.PerRank``, the
error-feedback residuals of ``compressed_psum(error_feedback=True)``) is
split over the data axis; everything else is replicated.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from . import common


def calibrate(config, model: nnx.Module, loss_fn: Callable, batch, n: int):
  """:func:`examples.common.calibrate` for an NNX model, before ``DataParallel.create``.

  Args:
    config: the run's settings.
    model: the freshly initialised model.
    loss_fn: ``loss_fn(model, batch) -> mean loss``.
    batch: the first global batch.
    n: the number of ranks.

  Returns:
    The config with the fitted capacities (or unchanged; see
    :func:`examples.common.calibrate`).
  """
  grad = nnx.jit(nnx.grad(loss_fn))
  return common.calibrate(config, lambda shard: grad(model, shard), batch, n)


def _raw_key(k):
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return getattr(k, attr)
  return k


def _per_rank_prefixes(optimizer: nnx.Optimizer, prefix: tuple) -> list[tuple]:
  """State paths of the optimizer's per-rank subtrees (none if the library has no PerRank)."""
  per_rank = getattr(dq, "PerRank", None)
  if per_rank is None:
    return []
  is_per_rank = lambda x: isinstance(x, per_rank)
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
      starting with the all-reduce over ``axis_name``.
    mesh: a mesh with the axis ``axis_name``.
    axis_name: the data-parallel mesh axis.

  Attributes:
    graphdef: the static structure of ``(model, optimizer)``.
    state: the placed state (pass it to the steps; they return the new one).
    specs: the ``PartitionSpec`` of every state leaf.
  """

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, *, mesh,
               axis_name: str = "data"):
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

  def train_step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], *, donate: bool = True):
    """The jitted step ``step(state, batch) -> (state, loss)``.

    Args:
      loss_fn: ``loss_fn(model, batch) -> loss``, the mean loss over this
        rank's part of the batch.
      donate: donate the state buffers to the step.

    Returns:
      The step. ``batch`` leaves must be split over the data axis along
      their leading axis (:func:`examples.common.shard_batch`); ``loss`` is
      the mean over ranks.
    """
    graphdef, axis_name = self.graphdef, self.axis_name

    def local(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      params_def, params, rest = nnx.split(model, optimizer.wrt, ...)

      def loss_of(params):
        return loss_fn(nnx.merge(params_def, params, rest), batch)

      # Gradients of a per-rank copy stay per-rank; the optimizer's chain
      # all-reduces them (compressed), not XLA.
      loss, grads = jax.value_and_grad(loss_of)(dq.as_varying(params, axis_name))
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), jax.lax.pmean(loss, axis_name)

    mapped = jax.shard_map(local, mesh=self.mesh, in_specs=(self.specs, P(axis_name)),
                           out_specs=(self.specs, P()), check_vma=True)
    # Outputs keep the inputs' shardings, so the next step hits the jit cache.
    return jax.jit(mapped, out_shardings=(self.shardings, NamedSharding(self.mesh, P())),
                   donate_argnums=(0,) if donate else ())

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

  def train_loop(self, config: common.ExampleConfig, loss_fn, *, batch_fn, eval_fn,
                 desc: str = "train"):
    """:func:`examples.common.train_loop` from :attr:`state` with ``train_step(loss_fn)``.

    Checkpoints hold the state as :meth:`checkpoint_tree` gives it.

    Args:
      config: the run's settings (steps, eval and checkpoint cadence, workdir).
      loss_fn: as for :meth:`train_step`.
      batch_fn: ``batch_fn(position) -> batch``, split over the data axis.
      eval_fn: ``eval_fn(state) -> {name: float}``.
      desc: progress bar label.

    Returns:
      ``(state, history, start)``, as :func:`examples.common.train_loop`.
    """
    return common.train_loop(
        config, state=self.state, step_fn=self.train_step(loss_fn), batch_fn=batch_fn,
        eval_fn=eval_fn, to_checkpoint=self.checkpoint_tree,
        from_checkpoint=self.from_checkpoint_tree, desc=desc)

  def checkpoint_tree(self, state) -> dict:
    """``state`` as a plain nested dict of arrays, for orbax."""
    return nnx.to_pure_dict(state)

  def from_checkpoint_tree(self, tree):
    """The inverse of :meth:`checkpoint_tree` (leaves keep their shardings)."""
    state = jax.tree.map(lambda x: x, self.state)
    nnx.replace_by_pure_dict(state, tree)
    return state
