"""Data-parallel Flax NNX training with the compressed all-reduce.

:class:`DataParallel` splits an NNX model and its ``nnx.Optimizer`` (whose
optax chain starts with the gradient reduction) into one state pytree,
places it on the mesh and builds a ``jax.shard_map`` step that merges them
again on every rank::

    import dynamiq_jax as dq
    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))
    dp = dq.nnx.DataParallel.create(model, tx, mesh=mesh)
    step = dp.train_step(loss_fn)            # loss_fn(model, batch) -> mean loss
    state = dp.state
    for batch in batches:                    # leaves split over "data" (NamedSharding)
      state, loss = step(state, batch)
    model, optimizer = dp.merge(state)

Every state leaf keeps the sharding it arrives with (a model built under
``jax.set_mesh(mesh)`` with sharding annotations, ``nnx.with_partitioning``,
carries them), or else takes the one its variable's metadata declares
(``nnx.get_partition_spec``), or else is replicated. The step is manual over
the data axis only: the compiler partitions the model over the other mesh
axes (tensor, FSDP) as usual, and the gradient is reduced over the data
axis on each device's shard. Parameters split over the data axis too
(:func:`dynamiq_jax.zero_shardings`) are all-gathered at their own
precision before the forward pass and need a chain starting with
:func:`dynamiq_jax.compressed_psum_scatter` (a sharded optimizer).

The step runs with ``check_vma=True`` and differentiates with respect to a
per-rank copy of the parameters (:func:`dynamiq_jax.as_varying`):
differentiating the replicated parameters directly would make ``jax.grad``
return gradients that XLA already summed at full precision. Optimizer state
that differs between ranks (:class:`dynamiq_jax.PerRank`, the
error-feedback residuals of ``compressed_psum(error_feedback=True)``) is
split over the data axis.

The model's other state goes through the step too, the same on every rank
(docs/guide.md, "Dropout, BatchNorm and model state"): RNG streams keep one
stored key and count, and each rank folds its index over the data axis into
the keys it draws with (its own dropout masks); ``nnx.BatchNorm`` layers
without an ``axis_name`` average their batch moments over the data axis, so
they normalise with, and keep running statistics of, the global batch; any
other variable the forward pass leaves different on each rank becomes its
mean over the data axis (a float) or is refused (an integer).

Needs flax (``pip install "dynamiq-jax[examples]"``); ``import dynamiq_jax``
loads this module only when ``dq.nnx`` is first used.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.context import varying_axes
from dynamiq_jax.schedules.local import strip_axes
from dynamiq_jax.training.step_checks import check_replicated
from dynamiq_jax.training.train import SyncedStep
from dynamiq_jax.training.train import data_dims
from dynamiq_jax.training.train import data_entry
from dynamiq_jax.training.train import gather_params
from dynamiq_jax.training.train import is_per_rank
from dynamiq_jax.training.train import is_spec
from dynamiq_jax.training.train import mean_over
from dynamiq_jax.training.train import mesh_spec
from dynamiq_jax.training.train import only_axes
from dynamiq_jax.training.train import partial_manual
from dynamiq_jax.training.train import resolve_sync_every

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


def _placed(x, mesh) -> bool:
  sharding = getattr(x, "sharding", None)
  return isinstance(sharding, NamedSharding) and tuple(sharding.mesh.shape.items()) == tuple(
      mesh.shape.items())


def _keys(path) -> tuple:
  return tuple(_raw_key(k) for k in path)


def _flat_by_path(tree) -> dict:
  return {_keys(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=is_spec)[0]}


def _sync_batch_norm(model: nnx.Module, data) -> None:
  """Sets ``axis_name=data`` on every ``nnx.BatchNorm`` of ``model`` that has none, so that
  it normalises with, and keeps running averages of, the statistics of the global batch
  (Flax's ``lax.pmean`` of the per-rank moments over the data axes)."""
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
      module.axis_name = data


def _rank_keys(keys, axes):
  """Every RNG stream's key with this rank's index folded in: the ranks draw different
  numbers from the one stored (replicated) stream."""
  rank = jax.lax.axis_index(data_entry(axes))

  def fold(key):  # a stack of keys (a scanned layer's streams) key by key
    one = lambda k: jax.random.fold_in(k, rank)
    for _ in range(jnp.ndim(key)):
      one = jax.vmap(one)
    return one(key)

  return jax.tree.map(fold, keys)


def _consistent(new, old, axes):
  """The model state ``new`` (its non-parameter variables after the forward pass), each
  leaf that differs between ranks replaced by its mean over the data ``axes``.

  Raises:
    ValueError: the forward pass created variables (``sow``, a lazily built one), or left
      a per-rank value that has no mean (an integer or boolean).
  """
  def names(tree):
    return {jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}

  if names(new) != names(old):
    created = ", ".join(sorted(names(new) - names(old)))
    dropped = ", ".join(sorted(names(old) - names(new)))
    raise ValueError(
        f"the forward pass created the model variables {created or '(none)'}"
        f"{f' and dropped {dropped}' if dropped else ''}; the state of a "
        f"DataParallel step keeps its structure. Fix: create every variable in the "
        f"model's __init__, or remove the new ones in loss_fn before it returns "
        f"(e.g. nnx.pop(model, nnx.Intermediate))")

  def one(path, x):
    if not set(axes) & varying_axes(x):
      return x  # the same on every rank already (a count, statistics reduced by the model)
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      raise ValueError(
          f"the model variable {jax.tree_util.keystr(path)} ({jax.typeof(x)}) takes a different "
          f"value on each rank of {axes} in the forward pass, and an integer has no mean "
          f"to keep the replicas equal. Fix: reduce it over the data axis in the model "
          f"(e.g. jax.lax.psum(value, {data_entry(axes)!r})), or keep it a float")
    return mean_over(x, axes).astype(jnp.result_type(x))

  return jax.tree_util.tree_map_with_path(one, new)


class DataParallel:
  """An NNX model and its optimizer as one state pytree on a data-parallel mesh.

  Args:
    model: the NNX module, in the mode the train step runs it in (NNX's
      default, training). Its state besides the parameters (RNG streams,
      BatchNorm statistics, variables of its own) is carried through the
      steps and kept the same on every rank; see the module docstring.
    optimizer: ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with ``tx``
      starting with the gradient reduction over ``axis_name``
      (:func:`dynamiq_jax.compressed_psum`, :func:`dynamiq_jax.reducer`, or
      :func:`dynamiq_jax.compressed_psum_scatter` for parameters split over
      the data axis).
    mesh: a mesh with the axis ``axis_name``; other axes may shard the model.
    axis_name: the data-parallel mesh axis, or a tuple of axes.

  Attributes:
    graphdef: the static structure of ``(model, optimizer)``.
    state: the initial state, placed on ``mesh`` (pass it to the steps; they
      return the new one).
    specs: the ``PartitionSpec`` of every state leaf.
    shardings: the ``NamedSharding`` of every state leaf.
  """

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, *, mesh,
               axis_name="data"):
    axes = axis_names(axis_name)
    for a in axes:
      if a not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r}: {a!r} is not an axis of the mesh "
                         f"{dict(mesh.shape)}; pass one of {tuple(mesh.shape)}")
    self.mesh = mesh
    self.axis_name = axis_name
    self._axes = axes
    n = int(np.prod([mesh.shape[a] for a in axes]))
    data = data_entry(axes)
    self.graphdef, state = nnx.split((model, optimizer))
    per_rank = _per_rank_prefixes(optimizer, (1,))
    declared = _flat_by_path(nnx.get_partition_spec(state))

    def own_spec(keys, x):  # as placed on this mesh, else as declared, else replicated
      spec = mesh_spec(x, mesh)
      if (not _placed(x, mesh) and isinstance(declared.get(keys), P)
          and declared[keys] != P()):
        spec = declared[keys]
        names = [a for e in tuple(spec) for a in (e if isinstance(e, tuple) else (e,)) if a]
        unknown = [a for a in names if a not in mesh.shape]
        if unknown:
          raise ValueError(
              f"state leaf {keys} declares the sharding {spec}, whose names {unknown} are not "
              f"axes of the mesh {dict(mesh.shape)} (logical axis names?), and it is not "
              f"placed on the mesh. Fix: create the model under jax.set_mesh(mesh) (with "
              f"nnx.logical_axis_rules(rules) for logical names), so its arrays carry their "
              f"shardings, or jax.device_put its state before DataParallel")
      return spec

    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    params = {_keys(path)[1:]: (jnp.shape(x), own_spec(_keys(path), x))
              for path, x in leaves if _keys(path)[:1] == (0,)}
    self._per_rank = set()

    def param_spec(keys, shape):  # the spec of the parameter whose path ends ``keys``
      for i in range(len(keys)):
        hit = params.get(keys[i:])
        if hit is not None and tuple(hit[0]) == tuple(shape):
          return hit[1]
      return None

    def spec(path, x):
      keys = _keys(path)
      for prefix in per_rank:
        if keys[:len(prefix)] == prefix:  # a residual: one slice per rank, then its parameter's
          self._per_rank.add(keys)
          model_spec = param_spec(keys, jnp.shape(x)[1:]) or P()
          return P(data, *tuple(strip_axes(model_spec, axes)))
      own = own_spec(keys, x)
      if not _placed(x, mesh) and keys[:1] == (1,):  # optimizer state shaped like a parameter
        return param_spec(keys, jnp.shape(x)) or own
      return own

    self.specs = jax.tree_util.tree_map_with_path(spec, state)
    self.shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                                  is_leaf=is_spec)

    def place(path, x, s):
      if _keys(path) in self._per_rank:  # per-rank leaves start equal: one copy per rank
        x = jnp.repeat(x, n, axis=0)
      return jax.device_put(x, s)

    self.state = jax.tree_util.tree_map_with_path(place, state, self.shardings)

  @classmethod
  def create(cls, model: nnx.Module, tx, *, mesh, axis_name="data") -> DataParallel:
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
    return jax.device_put(batch, NamedSharding(self.mesh, self._batch_spec()))

  def _batch_spec(self) -> P:
    return P(self._axes[0] if len(self._axes) == 1 else tuple(self._axes))

  def _data_specs(self):
    """The specs of the state over the data axes only (the shard_map's in/out specs)."""
    return jax.tree.map(lambda s: only_axes(s, self._axes), self.specs,
                        is_leaf=is_spec)

  def _full_params(self, params, params_keys):
    """``params`` (an ``nnx.State``) with each split parameter all-gathered at its own
    precision and the others marked per-rank."""
    specs = _flat_by_path(self.specs)

    def one(path, p):
      return gather_params(p, data_dims(specs[params_keys + _keys(path)], self._axes), self._axes)

    return jax.tree_util.tree_map_with_path(one, params)

  def _param_specs(self, params, params_keys):
    specs = _flat_by_path(self.specs)
    return jax.tree_util.tree_map_with_path(lambda path, _: specs[params_keys + _keys(path)],
                                            params)

  def train_step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], *, donate: bool = True,
                 sync_every: int | None = None) -> SyncedStep:
    """The jitted step ``step(state, batch) -> (state, loss)``.

    Args:
      loss_fn: ``loss_fn(model, batch) -> loss``, the mean loss over this
        rank's part of the batch. What it changes in the model's state (RNG
        counts, BatchNorm statistics, its own variables) is kept: the same
        on every rank, per-rank floats averaged over the data axis.
      donate: donate the state buffers to the step.
      sync_every: wait for the results every this many steps (0: never);
        ``None`` means after every step on a CPU mesh
        (:data:`dynamiq_jax.training.train.CPU_SYNC_EVERY`: XLA's CPU collectives can
        deadlock when many steps are queued) and never elsewhere.

    Returns:
      The step (its ``jitted`` attribute is the ``jax.jit`` function).
      ``batch`` leaves must be split over the data axis along their leading
      axis (:meth:`shard_batch`); ``loss`` is the mean over ranks.

    Raises:
      ValueError: (when the step is first traced) the forward pass created
        variables, or left an integer variable different on each rank.
    """
    graphdef, axes = self.graphdef, self._axes
    model_axes = [a for a in self.mesh.axis_names if a not in axes and self.mesh.shape[a] > 1]

    def local(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      _sync_batch_norm(model, data_entry(axes))
      params_def, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)

      def loss_of(params, keys, rest):  # the model merged here, so its state may change here
        m = nnx.merge(params_def, params, keys, rest, copy=True)
        loss = loss_fn(m, batch)
        return loss, nnx.split(m, optimizer.wrt, nnx.RngKey, ...)[3]

      # Gradients of a per-rank copy stay per-rank; the optimizer's chain
      # reduces them (compressed), not XLA.
      (loss, new_rest), grads = jax.value_and_grad(loss_of, has_aux=True)(
          self._full_params(params, (0,)), _rank_keys(keys, axes), rest)
      nnx.update(model, _consistent(new_rest, rest, axes))  # the stored keys stay unfolded
      extra = {"specs": self._param_specs(params, (0,))} if model_axes else {}
      with jax.named_scope("optimizer"):  # the reduction and the update, labelled in profiles
        optimizer.update(model, grads, **extra)
      self._check_reduced(nnx.state(model, optimizer.wrt), state, grads, extra)
      return nnx.state((model, optimizer)), mean_over(loss, axes)

    data_specs = self._data_specs()
    repl = NamedSharding(self.mesh, P())
    mapped = partial_manual(local, mesh=self.mesh, manual=axes,
                            in_specs=(data_specs, self._batch_spec()),
                            out_specs=(data_specs, P()), out_shardings=(self.shardings, repl))
    # Outputs keep the inputs' shardings, so the next step hits the jit cache.
    jitted = jax.jit(mapped, out_shardings=(self.shardings, repl),
                     donate_argnums=(0,) if donate else ())
    return SyncedStep(jitted, resolve_sync_every(sync_every, self.mesh))

  def _check_reduced(self, params, state, grads, extra):
    """The updated replicated parameters must be the same on every rank: a ValueError
    naming the fix where they vary over the data axes (no reduction in the chain)."""
    specs = _flat_by_path(self.specs)
    replicated = {".".join(map(str, _keys(path))): p
                  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]
                  if not data_dims(specs[(0,) + _keys(path)], self._axes)}
    graphdef = self.graphdef

    def update(state, grads):  # the optimizer's step again, traced only to look for collectives
      model, optimizer = nnx.merge(graphdef, state)
      optimizer.update(model, grads, **extra)
      return nnx.state(model, optimizer.wrt)

    check_replicated(replicated, self._axes, update, (state, grads))

  def eval_step(self, per_example_fn: Callable[[nnx.Module, Any], Any], *,
                eval_mode: bool = True):
    """The jitted ``evaluate(state, batch) -> per-example outputs`` (split like the batch).

    The model handed to ``per_example_fn`` is in evaluation mode, as after
    ``model.eval()``: ``deterministic=True`` (no dropout) and
    ``use_running_average=True`` (BatchNorm normalises with the running
    statistics the train step kept) on every submodule that has them. The
    evaluation changes no state: what ``per_example_fn`` does to the model
    (an RNG stream drawn, statistics updated) is discarded.

    Args:
      per_example_fn: ``fn(model, batch) -> pytree`` of arrays with the
        batch's leading axis (e.g. per-example loss and correctness).
      eval_mode: ``False`` hands over the model in the mode it was built in
        (e.g. dropout on, for Monte Carlo dropout: each rank then draws its
        own masks, as in the train step, from the stored stream, whose count
        the evaluation does not advance).
    """
    graphdef, axes = self.graphdef, self._axes

    def local(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      if eval_mode:
        model.set_attributes(deterministic=True, use_running_average=True,
                             raise_if_not_found=False)
      _sync_batch_norm(model, data_entry(axes))
      params_def, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey, ...)
      full = self._full_params(params, (0,))
      return per_example_fn(nnx.merge(params_def, full, _rank_keys(keys, axes), rest), batch)

    spec = self._batch_spec()
    return jax.jit(partial_manual(local, mesh=self.mesh, manual=self._axes,
                                  in_specs=(self._data_specs(), spec), out_specs=spec,
                                  out_shardings=NamedSharding(self.mesh, spec)))

  def checkpoint_tree(self, state) -> dict:
    """``state`` as a plain nested dict of arrays, e.g. for orbax."""
    return nnx.to_pure_dict(state)

  def from_checkpoint_tree(self, tree):
    """The inverse of :meth:`checkpoint_tree` (leaves keep the placed state's shardings)."""
    state = jax.tree.map(lambda x: x, self.state)
    nnx.replace_by_pure_dict(state, tree)
    return state
