"""``compressed_psum`` and ``compressed_psum_scatter``: the compressed collectives as
optax transforms."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dynamiq_jax._renamed import UNSET, renamed
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE
from dynamiq_jax.engine.buckets import DEFAULT_MAX_BUCKETS
from dynamiq_jax.api.allreduce import layout_states
from dynamiq_jax.api.allreduce import run_allreduce
from dynamiq_jax.codecs.dynamiq import DynamiQ
from dynamiq_jax.engine.options import ERROR_FEEDBACK, ReduceOptions, feedback_mode
from dynamiq_jax.api.scatter import run_reduce_scatter
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.context import axis_size

__all__ = ["CompressedPsumState", "PerRank", "ERROR_FEEDBACK", "feedback_mode", "ef14_init",
           "ef14_update", "ef21m_init", "ef21m_update", "compressed_psum",
           "compressed_psum_scatter"]


class PerRank(NamedTuple):
  """Optimizer-state subtree that differs between ranks (error-feedback residuals).

  Inside the mapped step every leaf has a leading axis of size 1; outside,
  ``shard_map`` sees it with a leading axis of size n split over the data
  axis (:func:`dynamiq_jax.data_parallel_init` and
  :func:`dynamiq_jax.data_parallel_step` do this), and ``pmap`` with its usual
  leading device axis.
  """

  tree: Any


class CompressedPsumState(NamedTuple):
  """State of :func:`compressed_psum`.

  Attributes:
    step: int32 count of all-reduces done; folded into the rounding key.
    key: uint32[2] raw key data of the base key (from ``seed``).
    codec_state: per-bucket state of a stateful codec (MX's scale
      multiplier, OmniReduce's local top-k fraction), identical on every
      rank; None for stateless codecs.
    residual: with ``error_feedback=True``, each rank's residual
      (:class:`PerRank`); otherwise None.
    error_estimate: the codec's estimate of the relative error the last
      all-reduce added (``AllReduceStats.error_estimate``; 0 before the
      first step), identical on every rank: read it to watch the codec.
    mean: with ``error_feedback="ef21m"``, the running mean of what every rank
      has sent (EF21-M's ``u_bar``, the update the transform returns; float32,
      identical on every rank); otherwise None.
  """

  step: jax.Array
  key: jax.Array
  codec_state: Any = None
  residual: Any = None
  error_estimate: Any = 0.0
  mean: Any = None


EF21M_MOMENTUM = 0.5
"""EF21-M's ``eta`` when none is given (the ARC-Top-K authors' synthetic experiment)."""


def check_momentum(ef21m_momentum, mode, error_feedback) -> float:
  """``ef21m_momentum`` checked against the feedback ``mode`` (:func:`feedback_mode`):
  EF21-M's ``eta`` (None: :data:`EF21M_MOMENTUM`); given with another rule, an error (it
  would change nothing)."""
  if ef21m_momentum is None:
    return EF21M_MOMENTUM
  if mode != "ef21m":
    raise ValueError(
        f"ef21m_momentum={ef21m_momentum!r} is EF21-M's momentum, but the error feedback here "
        f"is {mode or 'none'!r} (error_feedback={error_feedback!r}, None: the codec's "
        f"default). Fix: pass error_feedback='ef21m' with it, or drop ef21m_momentum")
  if not (isinstance(ef21m_momentum, (int, float)) and not isinstance(ef21m_momentum, bool)
          and 0 < ef21m_momentum <= 1):
    raise ValueError(f"ef21m_momentum={ef21m_momentum!r} must be in (0, 1] (EF21-M's eta; "
                     f"1: no momentum)")
  return float(ef21m_momentum)


def ef14_init(params) -> PerRank:
  """EF14's residual at step 0: zeros, one slice per rank (of size 1 here)."""
  return PerRank(jax.tree.map(lambda p: jnp.zeros((1,) + tuple(jnp.shape(p)), jnp.float32),
                              params))


def ef14_update(updates, residual: PerRank, reduce):
  """One step of EF14 (EF-SGD): ``p = g + e``; ``e <- p - C(p)``, where ``reduce(p) ->
  (the collective's result, this rank's C(p), info)``, ``info`` anything the caller wants
  back (the collective's stats). Returns ``(the result in the gradients' dtypes, new
  residual, info)``."""
  grads = jax.tree.map(lambda g, e: g.astype(jnp.float32) + e[0], updates, residual.tree)
  out, own, info = reduce(grads)
  residual = PerRank(jax.tree.map(lambda p, c: (p - c)[None], grads, own))
  return jax.tree.map(lambda r, u: r.astype(u.dtype), out, updates), residual, info


def ef21m_init(params) -> tuple[PerRank, Any]:
  """EF21-M's state at step 0 (a cold start: every part zero): ``(PerRank({"momentum": v,
  "sent": u}), u_bar)``, ``v`` and ``u`` per rank, ``u_bar`` identical on every rank."""
  zeros = ef14_init(params).tree
  return (PerRank({"momentum": zeros, "sent": zeros}),
          jax.tree.map(lambda z: z[0], zeros))


def ef21m_update(updates, residual: PerRank, mean, reduce, momentum: float):
  """One step of EF21-M (error feedback with momentum; Fatkhullin et al. 2023).

  ``v <- (1 - eta) v + eta g``; ``c = C(v - u)``; ``u <- u + c``;
  ``u_bar <- u_bar + reduce(c)``, where ``reduce(delta) -> (mean of C(delta) over the
  ranks, this rank's C(delta), info)`` is the compressed collective (``info`` anything the
  caller wants back: its stats) and ``eta`` is ``momentum``. Returns ``(u_bar in the
  gradients' dtypes, new residual, new u_bar, info)``: ``u_bar`` is the mean of every
  rank's ``u``, the same bytes on every rank.
  """
  eta = jnp.float32(momentum)
  v = jax.tree.map(lambda m, g: (1 - eta) * m[0] + eta * g.astype(jnp.float32),
                   residual.tree["momentum"], updates)
  delta = jax.tree.map(lambda a, u: a - u[0], v, residual.tree["sent"])
  reduced, own, info = reduce(delta)
  sent = jax.tree.map(lambda u, c: (u[0] + c)[None], residual.tree["sent"], own)
  mean = jax.tree.map(lambda m, r: m + r.astype(jnp.float32), mean, reduced)
  out = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, updates)
  return (out, PerRank({"momentum": jax.tree.map(lambda a: a[None], v), "sent": sent}), mean,
          info)


def compressed_psum(axis_name="data", *, codec=None, schedule: str = "ring",
                    average: bool = True, seed: int = 0,
                    bucket_size: int = DEFAULT_BUCKET_SIZE,
                    max_buckets: int | None = DEFAULT_MAX_BUCKETS,
                    leaf_order=None,
                    implementation: str | None = None,
                    error_feedback: bool | str | None = None,
                    ef21m_momentum: float | None = None,
                    stacked=None,
                    packet_loss=None,
                    loss=UNSET,
                    ) -> optax.GradientTransformationExtraArgs:
  """Replaces ``jax.lax.pmean``/``psum`` of gradients with a compressed all-reduce.

  Put it first in the chain, inside ``jax.shard_map`` or ``jax.pmap`` over
  ``axis_name``, with per-rank gradients::

    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))

  Each update all-reduces the incoming gradients with ``codec`` on
  ``schedule`` (see :func:`dynamiq_jax.allreduce`); every rank gets the same
  bytes, so replicas never drift (Moshpit averaging with absent ranks is the
  exception, and says so: see ``schedule``).

  Args:
    axis_name: the data-parallel axis name.
    codec: a codec, or its name (``"dynamiq"``, ``"int8"``, ...: the names of
      :func:`dynamiq_jax.reducer`); ``None`` means ``codecs.DynamiQ(bits=5)``.
    schedule: ``"ring"``, ``"butterfly"``, ``"two_step"``, ``"hierarchical"``
      or Moshpit averaging (``"moshpit"``, ``dq.Moshpit(...)``; each rank its own
      result: ``data_parallel_step(per_rank=True)``), see
      :func:`dynamiq_jax.allreduce`.
    average: mean (True, like ``pmean``) or sum (False, like ``psum``).
    seed: seeds the rounding streams; step t uses
      ``jax.random.fold_in(jax.random.key(seed), t)``.
    bucket_size: the coordinates of one bucket: the leaves end to end, cut
      into buckets of this size, each all-reduced on its own so that it can
      overlap with the backward pass (:func:`dynamiq_jax.bucket_layout`).
    max_buckets: the most buckets (None: no limit); larger gradients get
      larger buckets, bounding compile time.
    leaf_order: the order the backward pass produces the gradient's leaves
      (the order buckets fill): ``None`` (reverse leaf order), ``"forward"``
      or a permutation of leaf indices.
    implementation: ``None`` (Pallas kernels on GPU, the jnp reference
      elsewhere), ``"pallas"`` or ``"xla"``; bit-identical results.
    error_feedback: how the compression error is fed back, for the biased
      codecs (MX, OmniReduce's and ARC-Top-K's top-k, THC's clamping):
      ``None`` (default): the codec's own choice
      (``codec.default_error_feedback``: EF14 for ARC-Top-K, none for the
      others); ``False``: none; ``True`` or ``"ef14"``: EF-SGD, each rank
      adds its residual to the next gradient (``p = g + e``, ``e <- p -
      C(p)``, where ``C(p)`` is the rank's contribution as the codec
      represented it); ``"ef21m"``: EF21-M, error feedback with momentum
      (:func:`ef21m_update`: each rank compresses the change of its momentum
      since what it sent, ``C(v - u)``, and the update is the running mean
      of what was sent, ``u_bar``; the biased selection's error is
      corrected at the next steps). The per-rank parts are
      :class:`PerRank` state.
    ef21m_momentum: EF21-M's ``eta`` (``v <- (1 - eta) v + eta g``); 1 is EF21
      without momentum; only with EF21-M (given with another rule: an error). None:
      0.5 (the ARC-Top-K authors' synthetic
      experiment; with AdamW after it, docs/results.md measures 0.1 far worse
      and no momentum better than no feedback).
    stacked: for layers under ``jax.lax.scan``, the leaves stacked along a
      leading axis of layers: a pytree key's name (e.g. ``"layers"``) or a
      callable ``(path, leaf) -> bool``; the gradient is then reduced in
      loops, its bucket program compiled once
      (:func:`dynamiq_jax.allreduce`, :mod:`dynamiq_jax.engine.stacked`).
    packet_loss: a :class:`~dynamiq_jax.PacketLoss` with ``schedule="two_step"``: the
      reduce step loses packets and each chunk's sum is estimated without bias
      from those that arrived (:func:`dynamiq_jax.allreduce`); simulated.
    loss: the old name of ``packet_loss`` (deprecated, with a ``DeprecationWarning``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init`` accepts
    ``jax.ShapeDtypeStruct`` leaves; its state (:class:`CompressedPsumState`)
    is identical on every rank apart from the error-feedback residual.
    ``update`` takes an extra keyword ``specs``: the gradient leaves'
    ``PartitionSpec`` where other mesh axes are ``AxisType.Auto``
    (:func:`dynamiq_jax.allreduce`; ``dq.data_parallel_step`` passes it).

  Examples:
    >>> import optax, dynamiq_jax as dq
    >>> tx = optax.chain(dq.compressed_psum("data"), optax.sgd(0.1))
  """
  loss = renamed(packet_loss, loss, new="packet_loss", old="loss", where="compressed_psum")
  opts = ReduceOptions.build(
      "compressed_psum", codec=codec, default_codec=DynamiQ(), axis_name=axis_name,
      schedule=schedule, average=average, bucket_size=bucket_size, max_buckets=max_buckets,
      leaf_order=leaf_order, implementation=implementation, error_feedback=error_feedback,
      stacked=stacked, loss=loss)
  codec, mode = opts.codec, opts.feedback
  ef21m_momentum = check_momentum(ef21m_momentum, mode, error_feedback)

  def init_fn(params):
    residual = mean = None
    if mode == "ef14":
      residual = ef14_init(params)
    elif mode == "ef21m":
      residual, mean = ef21m_init(params)
    return CompressedPsumState(
        step=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        # structure only: the values depend on the axis size, set at step 0
        codec_state=layout_states(codec, opts.buckets.layout(params), 1),
        residual=residual, error_estimate=jnp.zeros([], jnp.float32), mean=mean)

  @jax.named_scope("compressed_psum")  # labels the reduction's buffers and ops in profiles
  def update_fn(updates, state, params=None, *, specs=None, **extra_args):
    del params, extra_args
    n = axis_size(axis_name)  # raises the library's UnboundAxisError under plain jax.jit
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    codec_state = state.codec_state
    if codec_state is not None:
      fresh = layout_states(codec, opts.buckets.layout(updates), n)
      codec_state = jax.tree.map(lambda f, o: jnp.where(state.step == 0, f, o),
                                 fresh, codec_state)

    def reduce(tree):  # -> (result, own contribution, stats)
      out, stats = run_allreduce(tree, opts, key=key, codec_state=codec_state, specs=specs)
      return out, stats.own, stats

    residual = mean = None
    if mode == "ef21m":
      reduced, residual, mean, stats = ef21m_update(updates, state.residual, state.mean,
                                                    reduce, ef21m_momentum)
    elif mode == "ef14":
      reduced, residual, stats = ef14_update(updates, state.residual, reduce)
    else:
      reduced, _, stats = reduce(updates)
    return reduced, CompressedPsumState(
        step=optax.safe_increment(state.step), key=state.key,
        codec_state=stats.codec_state if codec_state is not None else None,
        residual=residual, error_estimate=jnp.asarray(stats.error_estimate, jnp.float32),
        mean=mean)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _inferred_dims(updates, params, n: int):
  """The dimension of each leaf along which ``params`` holds 1/n of ``updates`` (None:
  the whole leaf), from their shapes."""
  if params is None:
    raise ValueError(
        "compressed_psum_scatter needs params= (this rank's shards of the parameters) to "
        "tell each gradient leaf's scattered dimension from its shape; pass them to "
        "tx.update(grads, state, params), or give scatter_dimension= when building it")

  def one(path, g, p):
    gs, ps = tuple(jnp.shape(g)), tuple(jnp.shape(p))
    if gs == ps:
      return None
    diff = [i for i, (a, b) in enumerate(zip(gs, ps)) if a != b]
    if len(gs) != len(ps) or len(diff) != 1 or gs[diff[0]] != n * ps[diff[0]]:
      raise ValueError(
          f"gradient leaf {jax.tree_util.keystr(path)} has shape {gs} but its parameter "
          f"shard has shape {ps}: a sharded parameter must hold 1/{n} of the gradient along "
          f"one dimension (or the whole leaf). Fix: shard the parameters over the data axis "
          f"with dq.zero_shardings, or pass scatter_dimension=")
    return diff[0]

  return jax.tree_util.tree_map_with_path(one, updates, params)


def compressed_psum_scatter(axis_name="data", *, codec=None, schedule: str = "ring",
                            average: bool = True, seed: int = 0, scatter_dimension="params",
                            bucket_size: int = DEFAULT_BUCKET_SIZE,
                            max_buckets: int | None = DEFAULT_MAX_BUCKETS,
                            leaf_order=None, implementation: str | None = None,
                            error_feedback: bool | str | None = None,
                            packet_loss=None,
                            loss=UNSET,
                            ) -> optax.GradientTransformationExtraArgs:
  """The compressed reduce-scatter of gradients, for optimizers sharded over the data axis.

  Put it first in the chain of a sharded optimizer (ZeRO, FSDP over the data
  axis, HSDP), inside ``jax.shard_map`` over ``axis_name``, with the full
  per-rank gradients and this rank's *shards* of the parameters::

    tx = optax.chain(dq.compressed_psum_scatter("data"), optax.adamw(1e-3))
    updates, state = tx.update(grads, state, param_shards)   # updates: shards

  Each rank receives its shard of the mean gradient
  (:func:`dynamiq_jax.reduce_scatter`: ``(n - 1) / n`` of the bucket on the
  wire per rank, half of an all-reduce), so the rest of the chain updates
  only its shard of the parameters and optimizer state; the parameters are
  then all-gathered at their own precision, uncompressed, for the next
  forward pass (``dq.data_parallel_step`` does all of this for parameters
  placed with :func:`dynamiq_jax.zero_shardings`). The rest of the chain
  sees shards: element-wise transforms (Adam, SGD, weight decay) are exact;
  ones that reduce over a whole leaf or tree (``clip_by_global_norm``) see
  only this rank's shard.

  Args:
    axis_name: the data-parallel axis; ``(slow, fast)`` with
      ``schedule="hierarchical"`` (HSDP: parameters sharded over ``fast``,
      replicated over ``slow``; the gradient reduced exactly over ``fast``
      and with the codec over ``slow``).
    codec: a codec that can reduce-scatter, or its name (as for
      :func:`compressed_psum`); ``None`` means ``DynamiQ(bits=5)``.
    schedule: ``"ring"``, ``"butterfly"``, ``"two_step"`` or ``"hierarchical"``.
    average: mean (True) or sum.
    seed: seeds the rounding streams (step t folds t into it).
    scatter_dimension: ``"params"`` (each leaf's from the shapes of the
      gradient and the parameter shard ``update`` receives: the dimension
      where the shard holds 1/n of it; equal shapes: the leaf is all-reduced
      whole), or as for :func:`dynamiq_jax.reduce_scatter`.
    bucket_size, max_buckets, leaf_order, implementation: as for
      :func:`compressed_psum`.
    error_feedback: ``True`` or ``"ef14"``: keep each rank's residual of its
      *whole* gradient (:class:`PerRank`), for codecs that report their
      contribution; ``None``: the codec's default; ``"ef21m"`` is
      :func:`compressed_psum`'s only (its running mean is the whole update).
    packet_loss: a :class:`~dynamiq_jax.PacketLoss` with ``schedule="two_step"``: each
      shard's owner estimates its shard of the mean from the packets that
      arrived (:func:`dynamiq_jax.reduce_scatter`); with
      ``data_parallel_step(per_rank=True, packet_loss=...)`` the parameter broadcast
      that follows loses packets too.
    loss: the old name of ``packet_loss`` (deprecated, with a ``DeprecationWarning``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` returns this
    rank's shards; its state is a :class:`CompressedPsumState` (its
    ``error_estimate`` is NaN when any leaf is scattered: no estimate is made
    for a reduce-scatter; with every leaf whole, the all-reduce's, model-sharded
    leaves included).
    ``update`` takes the extra keyword ``specs`` as :func:`compressed_psum`.

  Examples:
    >>> import optax, dynamiq_jax as dq
    >>> tx = optax.chain(dq.compressed_psum_scatter("data"), optax.adamw(1e-3))
  """
  loss = renamed(packet_loss, loss, new="packet_loss", old="loss",
                 where="compressed_psum_scatter")
  opts = ReduceOptions.build(
      "compressed_psum_scatter", codec=codec, default_codec=DynamiQ(), axis_name=axis_name,
      schedule=schedule, average=average, bucket_size=bucket_size, max_buckets=max_buckets,
      leaf_order=leaf_order, implementation=implementation, error_feedback=error_feedback,
      loss=loss, scatter=True)
  if opts.feedback == "ef21m":
    raise ValueError(
        "compressed_psum_scatter does not run error_feedback='ef21m' (EF21-M keeps the running "
        "mean of the whole update); use compressed_psum with a replicated optimizer, or "
        "error_feedback='ef14'")
  names = axis_names(axis_name)
  error_feedback = opts.feedback == "ef14"

  def init_fn(params):
    residual = ef14_init(params) if error_feedback else None
    return CompressedPsumState(
        step=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        residual=residual, error_estimate=jnp.zeros([], jnp.float32))

  @jax.named_scope("compressed_psum_scatter")  # as compressed_psum's
  def update_fn(updates, state, params=None, *, specs=None, **extra_args):
    del extra_args
    n = axis_size(names[1] if opts.hierarchical else axis_name)  # the library's UnboundAxisError
    dims = (_inferred_dims(updates, params, n) if isinstance(scatter_dimension, str)
            and scatter_dimension == "params" else scatter_dimension)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)

    def reduce(tree):  # -> (shards, own contribution, stats)
      out, stats = run_reduce_scatter(tree, opts, key=key, scatter_dimension=dims, specs=specs)
      return out, stats.own, stats

    residual = None
    if error_feedback:
      shards, residual, stats = ef14_update(updates, state.residual, reduce)
    else:
      shards, _, stats = reduce(updates)
    return shards, CompressedPsumState(
        step=optax.safe_increment(state.step), key=state.key, residual=residual,
        error_estimate=jnp.asarray(stats.error_estimate, jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
