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

import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.training import lossy
from dynamiq_jax.training.data_axes import data_dims
from dynamiq_jax.training.data_axes import data_entry
from dynamiq_jax.training.data_axes import data_parallel_init
from dynamiq_jax.training.data_axes import gather_params
from dynamiq_jax.training.data_axes import is_per_rank
from dynamiq_jax.training.data_axes import is_spec
from dynamiq_jax.training.data_axes import mean_over
from dynamiq_jax.training.data_axes import mesh_spec
from dynamiq_jax.training.data_axes import only_axes
from dynamiq_jax.training.data_axes import opt_state_specs
from dynamiq_jax.training.data_axes import per_rank_copies
from dynamiq_jax.training.data_axes import zero_shardings
from dynamiq_jax.training.step_checks import check_model_state_specs
from dynamiq_jax.training.step_checks import check_per_rank
from dynamiq_jax.training.step_checks import check_replicated
from dynamiq_jax.training.step_checks import check_shard_updates
from dynamiq_jax.training.step_checks import check_state_shared
from dynamiq_jax.training.step_checks import expected_returns
from dynamiq_jax.training.step_checks import settle_model_state
from dynamiq_jax.schedules.context import as_varying
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.context import axis_size

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


def data_parallel_step(loss_fn: Callable[..., Any], tx: optax.GradientTransformation,
                       *, mesh, axis_name="data", has_aux: bool = False,
                       model_state: bool | str = False, donate: bool = True,
                       sync_every: int | None = None, per_rank: bool = False,
                       packet_loss=None, loss=None):
  """A jitted data-parallel step: local gradients, ``tx`` all-reduces them.

  ``tx`` must start with the gradient reduction over ``axis_name``
  (``compressed_psum``, ``compressed_psum_scatter``, ``reducer`` or
  ``baseline_psum``): ``optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))``,
  not ``optax.adamw(1e-3)`` alone, which the step refuses (each rank would step
  with its own gradient). The step runs under
  ``jax.shard_map(check_vma=True)``, manual over the data axes only, and
  differentiates with respect to a per-rank copy of the parameters, so
  gradients reach ``tx`` un-reduced.

  Parameters keep the shardings they arrive with. Over other mesh axes
  (tensor, FSDP) the compiler partitions the forward and backward passes as
  usual and the reduction works on each device's shard, nothing gathered.
  A parameter split over the data axis too (:func:`zero_shardings`) is
  all-gathered at its own precision before the forward pass; ``tx`` must
  then start with :func:`dynamiq_jax.compressed_psum_scatter`, which
  returns this rank's shard of the mean gradient, and the rest of the chain
  updates only that shard (a sharded optimizer: ZeRO, FSDP, HSDP).

  **Donation.** By default (``donate=True``) the step donates the buffers of
  the parameters, the model state and the optimizer state it is given: after
  ``params, opt_state, loss = step(params, opt_state, batch)`` the arrays
  passed in are deleted, and using them again (say, the initial parameters
  of a second run) raises ``RuntimeError: Array has been deleted``. Pass
  ``donate=False`` to keep them usable (at the cost of a second copy).

  **Model state.** With ``model_state=True`` (or ``"mean"``) the step takes
  and returns non-trainable state next to the parameters (Flax Linen's
  ``batch_stats``, a Flax NNX ``nnx.BatchStat`` state):
  ``loss_fn(params, model_state, batch) -> (loss, new_model_state)``, or
  ``(loss, (new_model_state, aux))`` with ``has_aux``. The new state must have
  the structure of the old one. Replicas must not drift apart, so every rank
  must end with the same state:

  * ``model_state=True`` requires it: the loss function computes the state
    from global quantities, e.g. ``nn.BatchNorm(axis_name="data")``, whose
    batch statistics are means over the whole global batch (a ``pmean`` over
    the data axis inside the step), so the running statistics are the global
    batch's on every rank. A new state that differs between ranks raises a
    ValueError naming both fixes.
  * ``model_state="mean"`` averages each floating-point leaf of the new state
    over the ranks (an exact, fixed-order mean). For a batch norm without
    ``axis_name`` that makes the running mean the global batch's, and the
    running variance the mean of the per-rank variances (smaller than the
    global batch's by the variance of the per-rank means).

  **Random keys.** Call the step with ``key=`` (a PRNG key, the same on every
  rank) and the loss function gets ``key=`` too: that key folded with this
  rank's index on the data axes (``jax.lax.axis_index``), so each rank draws
  its own dropout masks. Pass a different key every step, e.g.
  ``key=jax.random.fold_in(seed_key, step_number)``: the masks are then
  reproducible from the seed and differ per rank and per step.

  Args:
    loss_fn: the mean loss over this rank's part of the batch:
      ``loss_fn(params, batch) -> loss``, ``(loss, aux)`` with ``has_aux``;
      with ``model_state`` it takes ``(params, model_state, batch)`` and returns
      ``(loss, new_model_state)`` or ``(loss, (new_model_state, aux))``; called
      with a keyword argument ``key`` when the step is called with ``key=``.
    tx: the optimizer chain, its gradient reduction first.
    mesh: a mesh with axis ``axis_name``.
    axis_name: the data-parallel mesh axis, or a tuple of axes (e.g.
      ``("host", "local")`` for ``schedule="hierarchical"``).
    has_aux: whether ``loss_fn`` returns auxiliary outputs; aux is averaged
      over ranks (it must be a pytree of floats).
    model_state: ``False`` (none), ``True`` (a model state every rank
      computes identically) or ``"mean"`` (averaged over ranks), see above.
      Not with ``per_rank`` or ``packet_loss``.
    donate: donate the parameters', model state's and optimizer state's
      buffers to the step (the arrays passed in are deleted); ``False`` keeps
      them usable.
    sync_every: wait for the results every this many steps (0: never);
      ``None`` means after every step on CPU meshes (:data:`CPU_SYNC_EVERY`,
      which avoids a deadlock of XLA's CPU collectives) and never on others.
    per_rank: every rank keeps its own parameters and optimizer state, for a
      reduction whose results differ between ranks (Moshpit averaging with
      absent ranks, ``schedule=dq.Moshpit(dropout=...)``): every leaf of both
      carries a leading axis of size n split over ``axis_name``, rank r's copy
      at index r (:func:`per_rank_copies` makes them from one copy). Without it,
      such a reduction raises a ValueError rather than let replicas drift.
    packet_loss: a :class:`~dynamiq_jax.PacketLoss`: training over lossy links
      (:mod:`dynamiq_jax.training.lossy`), with ``per_rank=True`` and one data axis. Each
      rank owns a shard of every large leaf: ``tx`` starts with
      ``dq.compressed_psum_scatter(schedule="two_step", packet_loss=...)`` and
      gets that shard (``dq.lossy_init`` makes the replicas and each rank's
      optimizer state of its shard); each owner's updated shard then reaches the
      other replicas packet by packet with the same loss process, and a replica
      that misses a packet keeps its stale values there. After each call,
      ``step.stats["drift"]`` holds the largest L2 distance of a replica from
      the owners' parameters (:func:`dynamiq_jax.lossy.lossy_broadcast`).
    loss: the former name of ``packet_loss``; deprecated (a DeprecationWarning),
      removed in the next release.

  Returns:
    A :class:`DataParallelStep`:
    ``step(params, opt_state, batch, *, key=None) -> (params, opt_state, loss)``,
    with ``model_state``
    ``step(params, model_state, opt_state, batch, *, key=None)
    -> (params, model_state, opt_state, loss)``, and ``aux`` as one more
    output last with ``has_aux``; no other option changes the outputs
    (diagnostics such as the lossy step's drift are in ``step.stats``).
    Params and the two states come back with the shardings they came in
    with (place the optimizer state with :func:`data_parallel_init`); every
    batch leaf is split over ``axis_name`` along its leading axis
    (``jax.device_put`` it with ``NamedSharding(mesh, P(axis_name))`` first).
    ``loss`` is the mean over ranks, summed in a fixed order.

  Raises:
    ValueError: for an ``axis_name`` not in ``mesh``, an unknown
      ``model_state``, or ``model_state`` with ``per_rank``/``packet_loss``
      (at once); at the first call, for a chain without a gradient reduction
      first, a reduction whose result differs between ranks without
      ``per_rank=True``, or a model state that differs between ranks with
      ``model_state=True``.
    TypeError: for both ``packet_loss`` and ``loss``.
  """
  if loss is not None:
    if packet_loss is not None:
      raise TypeError("data_parallel_step got both packet_loss= and its deprecated name "
                      "loss=; pass packet_loss= only")
    warnings.warn("data_parallel_step(loss=...) is deprecated: the option is now "
                  "packet_loss=dq.PacketLoss(...) (loss= is removed in the next release)",
                  DeprecationWarning, stacklevel=2)
    packet_loss = loss
  if model_state not in (False, True, "mean"):
    raise ValueError(f"model_state={model_state!r} must be False, True (a state every rank "
                     f"computes alike, e.g. nn.BatchNorm(axis_name=...)) or 'mean' (averaged "
                     f"over ranks)")
  if model_state and (per_rank or packet_loss is not None):
    raise ValueError(
        f"model_state={model_state!r} runs with replicated parameters; it is not supported "
        f"with per_rank=True or packet_loss=. Fix: drop model_state (keep the state in the "
        f"loss function's closure) or train without per_rank/packet_loss")
  axes = axis_names(axis_name)
  for a in axes:
    if a not in mesh.shape:
      raise ValueError(f"axis_name={axis_name!r}: {a!r} is not an axis of the mesh "
                       f"{dict(mesh.shape)}; pass one of {tuple(mesh.shape)}")
  data = data_entry(axes)
  batch_spec = P(data)
  model = [a for a in mesh.axis_names if a not in axes and mesh.shape[a] > 1]
  if packet_loss is not None:
    lossy.check_lossy_step(packet_loss, per_rank, axes, model)

  def objective(params, mstate, batch, key):
    """``loss_fn`` as ``params -> (loss, (new model state or None, aux or None))``."""
    args = (params, mstate, batch) if model_state else (params, batch)
    out = loss_fn(*args, **({} if key is None else {"key": key}))
    if not (model_state or has_aux):
      return out, (None, None)
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          f"data_parallel_step(has_aux={has_aux}, model_state={model_state!r}) takes a "
          f"loss_fn returning {expected_returns(has_aux, model_state)}; it returned "
          f"{jax.tree.structure(out)}")
    value, rest = out
    if model_state and has_aux:
      if not (isinstance(rest, (tuple, list)) and len(rest) == 2):
        raise TypeError(
            f"with model_state and has_aux, loss_fn returns (loss, (new_model_state, aux)); "
            f"its second output is {jax.tree.structure(rest)}")
      return value, tuple(rest)
    return value, ((rest, None) if model_state else (None, rest))

  def build(param_specs, state_specs, mstate_specs, keyed):
    data_param = jax.tree.map(lambda s: only_axes(s, axes), param_specs,
                              is_leaf=is_spec)
    data_state = jax.tree.map(lambda s: only_axes(s, axes), state_specs,
                              is_leaf=is_spec)
    data_mstate = None
    if model_state:
      data_mstate = jax.tree.map(lambda s: only_axes(s, axes), mstate_specs, is_leaf=is_spec)
      check_model_state_specs(mstate_specs, axes)
    spec_leaves, spec_def = jax.tree.flatten(param_specs, is_leaf=is_spec)
    inner_specs = param_specs  # what a rank's own parameters are sharded over
    if per_rank:
      check_per_rank(spec_leaves, axes)
      inner_specs = jax.tree.map(lambda s: P(*tuple(s)[1:]), param_specs, is_leaf=is_spec)
      spec_leaves = spec_def.flatten_up_to(inner_specs)
    dims = [data_dims(s, axes) for s in spec_leaves]
    sharded = any(dims)
    extra = {"specs": inner_specs} if model else {}

    def local(params, mstate, opt_state, batch, key):
      if key is not None:  # this rank's key
        key = jax.random.fold_in(key, jax.lax.axis_index(data))
      if packet_loss is not None:
        return lossy_local(params, opt_state, batch, key)
      if per_rank:  # this rank's copies (the leading axis, of size 1 here), varying already
        params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
        full = params
      else:
        full = spec_def.unflatten(
            [gather_params(p, d, axes) for p, d in zip(spec_def.flatten_up_to(params), dims)])
      (value, (new_mstate, aux)), grads = jax.value_and_grad(
          objective, has_aux=True)(full, mstate, batch, key)
      with jax.named_scope("optimizer"):
        updates, new_opt_state = tx.update(grads, opt_state, params, **extra)
      if sharded:
        check_shard_updates(updates, params)
      elif not per_rank:
        check_replicated(updates, axes, lambda *a: tx.update(*a, **extra),
                          (grads, opt_state, params))
      if not per_rank:
        check_state_shared(new_opt_state, data_state, axes)
      params = optax.apply_updates(params, updates)
      if per_rank:
        params, new_opt_state = jax.tree.map(lambda a: a[None], (params, new_opt_state))
      if model_state:
        new_mstate = settle_model_state(new_mstate, mstate, model_state, axes)
      value, aux = jax.tree.map(lambda v: mean_over(v, axes), (value, aux))
      return params, new_mstate, new_opt_state, value, aux, {}

    def lossy_local(params, opt_state, batch, key):
      axis = axes[0]
      n, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
      params, opt_state = jax.tree.map(lambda a: a[0], (params, opt_state))
      leaves, treedef = jax.tree.flatten(params)
      dims = lossy.owner_dims(params, n)
      shards = treedef.unflatten([lossy.owner_shard(a, d, r, n) for a, d in zip(leaves, dims)])
      (value, (_, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
          params, None, batch, key)
      bkey = lossy.broadcast_key(opt_state)
      with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, opt_state, shards)
      check_shard_updates(updates, shards)
      shards = optax.apply_updates(shards, updates)
      with jax.named_scope("lossy_broadcast"):
        new, dist2 = lossy.lossy_broadcast(treedef.flatten_up_to(shards), leaves, dims,
                                           packet_loss, bkey, axis)
      params, opt_state = jax.tree.map(lambda a: a[None], (treedef.unflatten(new), opt_state))
      value, aux = jax.tree.map(lambda v: mean_over(v, axes), (value, aux))
      drift = jnp.sqrt(jax.lax.pmax(dist2, axis))
      return params, None, opt_state, value, aux, {"drift": drift}

    # The jitted function takes the step's arguments in the caller's order and returns its
    # outputs followed by the stats dict (empty but for the lossy step).
    def step_fn(*args):
      args = list(args)
      params, mstate = args.pop(0), (args.pop(0) if model_state else None)
      opt_state, batch = args.pop(0), args.pop(0)
      key = args.pop(0) if keyed else None
      params, mstate, opt_state, value, aux, stats = local(params, mstate, opt_state, batch,
                                                           key)
      return ((params,) + ((mstate,) if model_state else ()) + (opt_state, value)
              + ((aux,) if has_aux else ()) + (stats,))

    shard = lambda spec: NamedSharding(mesh, spec)
    shardings = lambda specs: jax.tree.map(shard, specs, is_leaf=is_spec)
    mst = ((data_mstate,) if model_state else ())
    in_specs = (data_param,) + mst + (data_state, batch_spec) + ((P(),) if keyed else ())
    n_extra = 1 + has_aux + 1  # loss, aux, stats
    out_specs = (data_param,) + mst + (data_state,) + (P(),) * n_extra
    out_shardings = ((shardings(param_specs),)
                     + ((shardings(mstate_specs),) if model_state else ())
                     + (shardings(state_specs),) + (shard(P()),) * n_extra)
    step = partial_manual(step_fn, mesh=mesh, manual=axes, in_specs=in_specs,
                          out_specs=out_specs, out_shardings=out_shardings)
    # Outputs carry the shardings the inputs carry, so feeding a step's outputs to the
    # next step hits the jit cache.
    donated = (0, 1, 2) if model_state else (0, 1)
    return jax.jit(step, out_shardings=out_shardings, donate_argnums=donated if donate else ())

  return DataParallelStep(build, mesh=mesh, axes=axes, model_state=bool(model_state),
                          sync_every=resolve_sync_every(sync_every, mesh))


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

  ``step(params, opt_state, batch, *, key=None)``, or
  ``step(params, model_state, opt_state, batch, *, key=None)`` when built with
  ``model_state``. It waits for its results every ``sync_every`` steps (by
  default after every step on CPU, see :data:`CPU_SYNC_EVERY`, and never on
  GPUs).

  Attributes:
    jitted: the underlying ``jax.jit`` function (``.lower``, ``._cache_size``),
      built at the first call (its shardings follow the arguments'). It takes
      the step's arguments positionally (``key`` last, where given) and returns
      the step's outputs followed by its stats dict.
    sync_every: steps between waits (0: never).
    stats: diagnostics of the latest call, a dict of arrays: ``{"drift": ...}``
      for a step built with ``packet_loss`` (the largest L2 distance of a
      replica from the owners' parameters), else empty.
  """

  def __init__(self, build, sync_every: int, *, mesh, axes, model_state: bool = False):
    super().__init__(None, sync_every)
    self._build = build
    self._built = {}
    self._mesh = mesh
    self._axes = axes
    self._model_state = model_state
    self.stats = {}

  def _arguments(self, args) -> tuple:
    """``(params, model_state or None, opt_state, batch)`` from a call's ``args``."""
    names = ("params", "model_state", "opt_state", "batch") if self._model_state else (
        "params", "opt_state", "batch")
    if len(args) != len(names):
      raise TypeError(
          f"this step takes ({', '.join(names)}, *, key=None) (model_state="
          f"{self._model_state} when built); got {len(args)} positional arguments")
    if self._model_state:
      return tuple(args)
    return args[0], None, args[1], args[2]

  def _select(self, params, mstate, opt_state, keyed: bool):
    """The jitted step for these arguments' structures and shardings (built once each)."""
    param_specs = jax.tree.map(lambda p: mesh_spec(p, self._mesh), params)
    state_specs = opt_state_specs(opt_state, self._mesh, self._axes)
    mstate_specs = jax.tree.map(lambda p: mesh_spec(p, self._mesh), mstate)
    key = (jax.tree.structure(params), jax.tree.structure(opt_state, is_leaf=is_per_rank),
           tuple(jax.tree.leaves(param_specs, is_leaf=is_spec)),
           tuple(jax.tree.leaves(state_specs, is_leaf=is_spec)),
           jax.tree.structure(mstate), tuple(jax.tree.leaves(mstate_specs, is_leaf=is_spec)),
           keyed)
    if key not in self._built:
      self._built[key] = self._build(param_specs, state_specs, mstate_specs, keyed)
    return self._built[key]

  def __call__(self, *args, key=None):
    params, mstate, opt_state, _ = self._arguments(args)
    self.jitted = self._select(params, mstate, opt_state, key is not None)
    *out, self.stats = super().__call__(*args, *(() if key is None else (key,)))
    return tuple(out)

  def lower(self, *args, key=None) -> jax.stages.Lowered:
    """The step for these arguments, lowered and not run: ``.compile()`` it for
    ``memory_analysis()`` or the optimized HLO. The arguments may be arrays or
    ``jax.ShapeDtypeStruct`` with their ``sharding``."""
    params, mstate, opt_state, _ = self._arguments(args)
    return self._select(params, mstate, opt_state, key is not None).lower(
        *args, *(() if key is None else (key,)))
