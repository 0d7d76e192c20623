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
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax import lossy
from dynamiq_jax.schedules.context import as_varying
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.context import axis_size
from dynamiq_jax.schedules.local import strip_axes

__all__ = [
    "as_varying", "baseline_psum", "data_parallel_init", "data_parallel_step",
    "DataParallelStep", "SyncedStep", "CPU_SYNC_EVERY", "resolve_sync_every", "is_per_rank",
    "zero_shardings", "partial_manual", "mesh_spec", "only_axes", "data_dims", "mean_over",
    "gather_params", "opt_state_specs", "per_rank_copies", "data_entry", "is_spec",
]


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

  @jax.named_scope("baseline_psum")  # labels the reduction's buffers and ops in profiles
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


def data_entry(axes):
  """The data ``axes`` as one entry of a ``PartitionSpec`` or an axis name of a collective:
  the name of one axis, else the tuple."""
  return axes[0] if len(axes) == 1 else tuple(axes)


def is_spec(x) -> bool:
  """Whether ``x`` is a ``PartitionSpec`` (a leaf of a tree of specs)."""
  return isinstance(x, P)


def mesh_spec(x, mesh) -> P:
  """``x``'s ``PartitionSpec`` if it is placed on ``mesh`` (its axes, their sizes), else P()."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and tuple(sharding.mesh.shape.items()) == tuple(
      mesh.shape.items()):
    return sharding.spec
  return P()


def only_axes(spec, axes) -> P:
  """``spec`` with every mesh axis not in ``axes`` dropped (dimensions kept)."""
  return strip_axes(spec, [a for entry in tuple(spec) for a in (
      entry if isinstance(entry, tuple) else (entry,)) if a is not None and a not in axes])


def data_dims(spec, axes) -> list:
  """``[(dim, data axes)]``: the dimensions ``spec`` shards over the data ``axes``."""
  out = []
  for k, entry in enumerate(tuple(only_axes(spec, axes))):
    if entry is not None:
      out.append((k, entry))
  return out


def _path_keys(path) -> tuple:
  return tuple(str(k) for k in path)


def _param_like_specs(params, state, mesh, axes):
  """The spec of every leaf of an optimizer ``state`` built from ``params``.

  A leaf whose key path ends with a parameter's path and has that
  parameter's shape (Adam's moments, ...) takes the parameter's sharding; a
  per-rank residual (:class:`~dynamiq_jax.PerRank`) is split over the data
  ``axes`` along a leading axis and sharded like its parameter after it;
  everything else is replicated.
  """
  param_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  by_path = {_path_keys(path): (jnp.shape(p), mesh_spec(p, mesh)) for path, p in param_leaves}
  data = data_entry(axes)

  def like(path, x):
    keys = _path_keys(path)
    for i in range(len(keys)):
      hit = by_path.get(keys[i:])
      if hit is not None and hit[0] == jnp.shape(x):
        return hit[1]
    return P()

  def per_rank(path, x):
    keys = _path_keys(path)
    for i in range(len(keys)):
      hit = by_path.get(keys[i:])
      if hit is not None and tuple(jnp.shape(x)[1:]) == tuple(hit[0]):
        model = tuple(strip_axes(hit[1], axes))
        return P(data, *model)
    return P(data)

  def place(path, x):
    if is_per_rank(x):
      return jax.tree_util.tree_map_with_path(lambda p, a: per_rank(path + p, a), x)
    return like(path, x)

  return jax.tree_util.tree_map_with_path(place, state, is_leaf=is_per_rank)


def data_parallel_init(tx: optax.GradientTransformation, params, *, mesh, axis_name="data"):
  """``tx.init(params)`` placed for :func:`data_parallel_step`.

  A leaf shaped like a parameter (Adam's moments) takes that parameter's
  sharding, so optimizer state is sharded wherever the parameters are
  (over model axes, and over the data axis for a sharded optimizer, see
  :func:`zero_shardings`); per-rank state (the error-feedback residuals of
  ``error_feedback=True``) gets one slice per rank along ``axis_name``;
  everything else is replicated.
  """
  axes = axis_names(axis_name)
  state = tx.init(params)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  specs = _param_like_specs(params, state, mesh, axes)

  def place(x, spec):
    if is_per_rank(x):
      return jax.tree.map(lambda a, s: jax.device_put(jnp.repeat(a, n, axis=0),
                                                      NamedSharding(mesh, s)), x, spec)
    return jax.device_put(x, NamedSharding(mesh, spec))

  return jax.tree.map(place, state, specs, is_leaf=is_per_rank)


def zero_shardings(params, *, mesh, axis_name="data", min_size: int = 1024):
  """Shardings that split each parameter over ``axis_name`` too (ZeRO / FSDP / HSDP).

  Each leaf keeps its sharding over the other mesh axes and is split over
  ``axis_name`` along its largest dimension that divides and is not already
  sharded (:func:`dynamiq_jax.scatter_dimensions`); leaves with fewer than
  ``min_size`` coordinates, or no such dimension, stay replicated over it.
  :func:`data_parallel_step` then all-gathers each split parameter at its own
  precision before the forward pass, and a chain that starts with
  :func:`dynamiq_jax.compressed_psum_scatter` updates only this rank's shard
  (optimizer state included: place it with :func:`data_parallel_init`). For
  HSDP pass the fast axis (``axis_name="local"``): the parameters are
  sharded inside a host and replicated across hosts.

  Args:
    params: the parameters (arrays, placed or not).
    mesh: the mesh.
    axis_name: the mesh axis (or tuple of axes) to split the parameters over.
    min_size: smaller leaves stay replicated over ``axis_name``.

  Returns:
    A pytree of ``NamedSharding`` shaped like ``params``
    (``jax.device_put(params, zero_shardings(params, mesh=mesh))``).
  """
  from dynamiq_jax.scatter import scatter_dimensions
  axes = axis_names(axis_name)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  specs = jax.tree.map(lambda p: mesh_spec(p, mesh), params)
  dims = scatter_dimensions(params, n=n, specs=specs, min_size=min_size)
  data = data_entry(axes)

  def one(p, spec, dim):
    entries = list(tuple(spec)) + [None] * (jnp.ndim(p) - len(tuple(spec)))
    if dim is not None:
      entries[dim] = data
    return NamedSharding(mesh, P(*entries))

  return jax.tree.map(one, params, specs, dims, is_leaf=lambda x: is_spec(x) or x is None)


# jax 0.10.2 replicates Explicit mesh axes at the boundary of a shard_map that is
# manual over other axes (its in/out shardings name the manual axes only: an
# all-gather in, a slice out); 0.12.0 keeps them (0.11 not checked). The steps
# below then run the partial-manual shard_map with those axes made Auto.
_EXPLICIT_PARTIAL_MANUAL_KEEPS_SHARDING = jax.__version_info__ >= (0, 12)


def partial_manual(fn, *, mesh, manual, in_specs, out_specs, out_shardings, check_vma=True):
  """``jax.shard_map(fn)`` manual over the ``manual`` axes only, the other mesh axes left to
  the compiler (made Auto around the map where this jax would gather Explicit ones)."""
  rest = [a for a in mesh.axis_names if a not in manual]
  explicit = [a for a in rest if a in set(mesh.abstract_mesh.explicit_axes)]
  if not explicit or _EXPLICIT_PARTIAL_MANUAL_KEEPS_SHARDING:
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=frozenset(manual), check_vma=check_vma)

  def auto(*args):
    inner = jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=in_specs,
                          out_specs=out_specs, axis_names=frozenset(manual),
                          check_vma=check_vma)
    return inner(*args)

  return jax.sharding.auto_axes(auto, axes=tuple(explicit), out_sharding=out_shardings)


def mean_over(x, axes):
  """The mean of ``x`` over the data ``axes`` in a fixed order (an exact all-gather, then a
  local sum), so that it does not depend on how the backend sums (XLA CPU, gloo, NCCL)."""
  axis = data_entry(axes)
  gathered = jax.lax.all_gather(x, axis, to="invarying") if _checked(axis) else (
      jax.lax.all_gather(x, axis))
  return jnp.mean(gathered, axis=0)


def _checked(axis) -> bool:
  from dynamiq_jax.schedules.context import varying_axes
  return bool(set(axis_names(axis)) <= varying_axes(jax.lax.axis_index(axis)))


@jax.named_scope("gather_params")  # labels the gathered parameters in profiles
def gather_params(p, dims, axes):
  """A parameter split over the data axes (``dims``: ``[(dim, axes)]``), all-gathered at
  its own precision; a replicated one marked per-rank (so that ``jax.grad`` leaves its
  gradient un-reduced)."""
  gathered = set()
  for k, over in dims:
    p = jax.lax.all_gather(p, over, axis=k, tiled=True)
    gathered |= set(axis_names(over))
  rest = tuple(a for a in axes if a not in gathered)  # e.g. HSDP's host axis
  return as_varying(p, rest) if rest else p


def data_parallel_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                       *, mesh, axis_name="data", has_aux: bool = False,
                       donate: bool = True, sync_every: int | None = None,
                       per_rank: bool = False, loss=None):
  """A jitted data-parallel step: local gradients, ``tx`` all-reduces them.

  ``tx`` must start with the gradient reduction over ``axis_name``
  (``compressed_psum``, ``compressed_psum_scatter`` or ``baseline_psum``).
  The step runs under ``jax.shard_map(check_vma=True)``, manual over the
  data axes only, and differentiates with respect to a per-rank copy of the
  parameters, so gradients reach ``tx`` un-reduced.

  Parameters keep the shardings they arrive with. Over other mesh axes
  (tensor, FSDP) the compiler partitions the forward and backward passes as
  usual and the reduction works on each device's shard, nothing gathered.
  A parameter split over the data axis too (:func:`zero_shardings`) is
  all-gathered at its own precision before the forward pass; ``tx`` must
  then start with :func:`dynamiq_jax.compressed_psum_scatter`, which
  returns this rank's shard of the mean gradient, and the rest of the chain
  updates only that shard (a sharded optimizer: ZeRO, FSDP, HSDP).

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux``), the mean loss over this rank's part of the batch.
    tx: the optimizer chain.
    mesh: a mesh with axis ``axis_name``.
    axis_name: the data-parallel mesh axis, or a tuple of axes (e.g.
      ``("host", "local")`` for ``schedule="hierarchical"``).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; aux is averaged
      over ranks (it must be a pytree of floats).
    donate: donate params and optimizer state buffers.
    sync_every: wait for the results every this many steps (0: never);
      ``None`` means after every step on CPU meshes (:data:`CPU_SYNC_EVERY`,
      which avoids a deadlock of XLA's CPU collectives) and never on others.
    per_rank: every rank keeps its own parameters and optimizer state, for a
      reduction whose results differ between ranks (Moshpit averaging with
      absent ranks, ``schedule=dq.Moshpit(dropout=...)``): every leaf of both
      carries a leading axis of size n split over ``axis_name``, rank r's copy
      at index r (:func:`per_rank_copies` makes them from one copy). Without it,
      such a reduction raises a ValueError rather than let replicas drift.
    loss: a :class:`~dynamiq_jax.PacketLoss`: training over lossy links
      (:mod:`dynamiq_jax.lossy`), with ``per_rank=True`` and one data axis. Each
      rank owns a shard of every large leaf: ``tx`` starts with
      ``dq.compressed_psum_scatter(schedule="two_step", loss=...)`` and gets that
      shard (``dq.lossy_init`` makes the replicas and each rank's optimizer state
      of its shard); each owner's updated shard then reaches the other replicas
      packet by packet with the same loss process, and a replica that misses a
      packet keeps its stale values there.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss[, aux])``.
    Params and optimizer state come back with the shardings they came in
    with (place the state with :func:`data_parallel_init`); every batch leaf
    is split over ``axis_name`` along its leading axis (``jax.device_put``
    it with ``NamedSharding(mesh, P(axis_name))`` first). ``loss`` is the
    mean over ranks, summed in a fixed order. With ``loss``, one more output
    last: the largest L2 distance of a replica from the owners' parameters
    this step (:func:`dynamiq_jax.lossy.lossy_broadcast`).
  """
  axes = axis_names(axis_name)
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"axis_name={axis_name!r}: {a!r} is not an axis of the mesh "
                       f"{dict(mesh.shape)}; pass one of {tuple(mesh.shape)}")
  batch_spec = P(data_entry(axes))
  model = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
  if loss is not None:
    lossy.check_lossy_step(loss, per_rank, axes, model)

  def build(param_specs, state_specs):
    data_param = jax.tree.map(lambda s: only_axes(s, axes), param_specs,
                              is_leaf=is_spec)
    data_state = jax.tree.map(lambda s: only_axes(s, axes), state_specs,
                              is_leaf=is_spec)
    spec_leaves, spec_def = jax.tree.flatten(param_specs, is_leaf=is_spec)
    inner_specs = param_specs  # what a rank's own parameters are sharded over
    if per_rank:
      _check_per_rank(spec_leaves, axes)
      inner_specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), param_specs, is_leaf=is_spec)
      spec_leaves = spec_def.flatten_up_to(inner_specs)
    dims = [data_dims(s, axes) for s in spec_leaves]
    sharded = any(dims)
    extra = {"specs": inner_specs} if model else {}

    def local(params, opt_state, batch):
      if loss is not None:
        return lossy_local(params, opt_state, batch)
      if per_rank:  # this rank's copies (the leading axis, of size 1 here), varying already
        params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
        full = params
      else:
        full = spec_def.unflatten(
            [gather_params(p, d, axes) for p, d in zip(spec_def.flatten_up_to(params), dims)])
      out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(full, batch)
      with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
      if sharded:
        _check_shard_updates(updates, params)
      elif not per_rank:
        _check_replicated(updates, axes)
      params = optax.apply_updates(params, updates)
      if per_rank:
        params, opt_state = jax.tree.map(lambda a: a[None], (params, opt_state))
      out = jax.tree.map(lambda v: mean_over(v, axes), out)
      if has_aux:
        return params, opt_state, out[0], out[1]
      return params, opt_state, out

    def lossy_local(params, opt_state, batch):
      axis = axes[0]
      n, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
      params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
      leaves, treedef = jax.tree.flatten(params)
      dims = lossy.owner_dims(params, n)
      shards = treedef.unflatten([lossy.owner_shard(a, d, r, n) for a, d in zip(leaves, dims)])
      out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)
      key = lossy.broadcast_key(opt_state)
      with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, shards)
      _check_shard_updates(updates, shards)
      shards = optax.apply_updates(shards, updates)
      with jax.named_scope("lossy_broadcast"):
        new, dist2 = lossy.lossy_broadcast(treedef.flatten_up_to(shards), leaves, dims, loss,
                                           key, axis)
      params, opt_state = jax.tree.map(lambda a: a[None], (treedef.unflatten(new), opt_state))
      out = jax.tree.map(lambda v: mean_over(v, axes), out)
      drift = jnp.sqrt(jax.lax.pmax(dist2, axis))
      return (params, opt_state) + (tuple(out) if has_aux else (out,)) + (drift,)

    n_extra = (2 if has_aux else 1) + (loss is not None)
    shard = lambda spec: NamedSharding(mesh, spec)
    out_shardings = ((jax.tree.map(shard, param_specs, is_leaf=is_spec),
                      jax.tree.map(shard, state_specs, is_leaf=is_spec))
                     + (shard(P()),) * n_extra)
    step = partial_manual(local, mesh=mesh, manual=axes,
                          in_specs=(data_param, data_state, batch_spec),
                          out_specs=(data_param, data_state) + (P(),) * n_extra,
                          out_shardings=out_shardings)
    # Outputs carry the shardings the inputs carry, so feeding a step's outputs to the
    # next step hits the jit cache.
    return jax.jit(step, out_shardings=out_shardings, donate_argnums=(0, 1) if donate else ())

  return DataParallelStep(build, mesh=mesh, axes=axes,
                          sync_every=resolve_sync_every(sync_every, mesh))


def _check_per_rank(spec_leaves, axes):
  data = data_entry(axes)
  for spec in spec_leaves:
    entries = tuple(spec)
    if not entries or entries[0] != data or any(
        a in axes for e in entries[1:] for a in (e if isinstance(e, tuple) else (e,))):
      raise ValueError(
          f"per_rank=True takes every parameter and optimizer-state leaf with a leading axis "
          f"of ranks split over {data!r} (and nothing else over it); a leaf is placed with "
          f"{spec}. Fix: make them with dq.per_rank_copies(tree, mesh=mesh, "
          f"axis_name={data!r})")


def _check_replicated(updates, axes):
  from dynamiq_jax.schedules.context import varying_axes
  for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
    if set(axes) & varying_axes(u):
      raise ValueError(
          f"the update of {jax.tree_util.keystr(path)} differs between ranks of {axes}: the "
          f"gradient reduction (e.g. Moshpit averaging, schedule=dq.Moshpit(...)) leaves each "
          f"rank its own result, and replicated parameters would drift apart. Fix: "
          f"data_parallel_step(..., per_rank=True) with each rank's own parameters and "
          f"optimizer state (dq.per_rank_copies), or a schedule whose result every rank "
          f"shares ('ring', 'butterfly', 'hierarchical')")


def per_rank_copies(tree, *, mesh, axis_name="data"):
  """One copy of ``tree`` per rank of ``axis_name``: every leaf stacked ``n`` times along a
  new leading axis split over ``axis_name``, for ``data_parallel_step(..., per_rank=True)``
  (parameters and optimizer state, ``tx.init(params)``, alike)."""
  axes = axis_names(axis_name)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  sharding = NamedSharding(mesh, P(data_entry(axes)))
  return jax.tree.map(lambda a: jax.device_put(
      jnp.broadcast_to(jnp.asarray(a)[None], (n,) + jnp.shape(a)), sharding), tree)


def _check_shard_updates(updates, params):
  u_shapes = jax.tree.map(jnp.shape, updates)
  p_shapes = jax.tree.map(jnp.shape, params)
  if u_shapes != p_shapes:
    raise ValueError(
        "parameters split over the data axis (dq.zero_shardings) need a chain that returns "
        "this rank's shard of the update: start it with dq.compressed_psum_scatter(...) "
        f"(got updates shaped {u_shapes} for parameter shards {p_shapes})")


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
      built at the first call (its shardings follow the arguments').
    sync_every: steps between waits (0: never).
  """

  def __init__(self, build, sync_every: int, *, mesh, axes):
    super().__init__(None, sync_every)
    self._build = build
    self._built = {}
    self._mesh = mesh
    self._axes = axes

  def _select(self, params, opt_state):
    """The jitted step for these arguments' structures and shardings (built once each)."""
    param_specs = jax.tree.map(lambda p: mesh_spec(p, self._mesh), params)
    state_specs = opt_state_specs(opt_state, self._mesh, self._axes)
    key = (jax.tree.structure(params), jax.tree.structure(opt_state, is_leaf=is_per_rank),
           tuple(jax.tree.leaves(param_specs, is_leaf=is_spec)),
           tuple(jax.tree.leaves(state_specs, is_leaf=is_spec)))
    if key not in self._built:
      self._built[key] = self._build(param_specs, state_specs)
    return self._built[key]

  def __call__(self, params, opt_state, batch):
    self.jitted = self._select(params, opt_state)
    return super().__call__(params, opt_state, batch)

  def lower(self, params, opt_state, batch) -> jax.stages.Lowered:
    """The step for these arguments, lowered and not run: ``.compile()`` it for
    ``memory_analysis()`` or the optimized HLO. The arguments may be arrays or
    ``jax.ShapeDtypeStruct`` with their ``sharding``."""
    return self._select(params, opt_state).lower(params, opt_state, batch)


def opt_state_specs(opt_state, mesh, axes):
  """Each optimizer-state leaf's spec as placed; per-rank leaves always split over ``axes``."""
  data = data_entry(axes)

  def one(x):
    if is_per_rank(x):
      def per_rank(a):
        spec = tuple(mesh_spec(a, mesh))
        rest = tuple(strip_axes(P(*spec[1:]), axes)) if spec else ()
        return P(data, *rest)
      return jax.tree.map(per_rank, x)
    return mesh_spec(x, mesh)

  return jax.tree.map(one, opt_state, is_leaf=is_per_rank)
