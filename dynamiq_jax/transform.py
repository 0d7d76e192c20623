"""``compressed_psum``: the compressed all-reduce as an optax transform."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dynamiq_jax.allreduce import DEFAULT_BUCKET_SIZE
from dynamiq_jax.allreduce import DEFAULT_MAX_BUCKETS
from dynamiq_jax.allreduce import allreduce
from dynamiq_jax.allreduce import init_codec_state
from dynamiq_jax.codecs.dynamiq import DynamiQ
from dynamiq_jax.schedules.context import axis_size

__all__ = ["CompressedPsumState", "PerRank", "compressed_psum"]


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
  """

  step: jax.Array
  key: jax.Array
  codec_state: Any = None
  residual: Any = None
  error_estimate: Any = 0.0


def compressed_psum(axis_name="data", *, codec=None, schedule: str = "ring",
                    average: bool = True, seed: int = 0,
                    bucket_size: int = DEFAULT_BUCKET_SIZE,
                    max_buckets: int | None = DEFAULT_MAX_BUCKETS,
                    leaf_order=None,
                    implementation: str | None = None,
                    error_feedback: bool = False,
                    ) -> optax.GradientTransformationExtraArgs:
  """Replaces ``jax.lax.pmean``/``psum`` of gradients with a compressed all-reduce.

  Put it first in the chain, inside ``jax.shard_map`` or ``jax.pmap`` over
  ``axis_name``, with per-rank gradients::

    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))

  Each update all-reduces the incoming gradients with ``codec`` on
  ``schedule`` (see :func:`dynamiq_jax.allreduce`); every rank gets the same
  bytes, so replicas never drift.

  Args:
    axis_name: the data-parallel axis name.
    codec: a codec; ``None`` means ``codecs.DynamiQ(bits=5)``.
    schedule: ``"ring"`` or ``"butterfly"``.
    average: mean (True, like ``pmean``) or sum (False, like ``psum``).
    seed: seeds the rounding streams; step t uses
      ``jax.random.fold_in(jax.random.key(seed), t)``.
    bucket_size: the most coordinates in one bucket: buckets of whole leaves,
      each all-reduced on its own so that it can overlap with the backward
      pass (:func:`dynamiq_jax.bucket_layout`).
    max_buckets: the most buckets (None: no limit); larger gradients get
      larger buckets, bounding compile time.
    leaf_order: the order the backward pass produces the gradient's leaves
      (the order buckets fill): ``None`` (reverse leaf order), ``"forward"``
      or a permutation of leaf indices.
    implementation: ``None`` (Pallas kernels on GPU, the jnp reference
      elsewhere), ``"pallas"`` or ``"xla"``; bit-identical results.
    error_feedback: keep each rank's compression residual and add it to the
      next step's gradient (EF-SGD: ``p = g + e``, ``e <- p - C(p)``, where
      ``C(p)`` is the rank's contribution as the codec represented it). For
      the biased codecs (MX, OmniReduce's top-k, THC's clamping); the
      residual is per-rank state (:class:`PerRank`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. ``init`` accepts
    ``jax.ShapeDtypeStruct`` leaves; its state (:class:`CompressedPsumState`)
    is identical on every rank apart from the error-feedback residual.

  Examples:
    >>> import optax, dynamiq_jax as dq
    >>> tx = optax.chain(dq.compressed_psum("data"), optax.sgd(0.1))
  """
  codec = DynamiQ() if codec is None else codec

  def init_fn(params):
    residual = None
    if error_feedback:
      residual = PerRank(jax.tree.map(
          lambda p: jnp.zeros((1,) + tuple(p.shape), jnp.float32), params))
    return CompressedPsumState(
        step=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        # structure only: the values depend on the axis size, set at step 0
        codec_state=init_codec_state(params, codec=codec, n=1, bucket_size=bucket_size,
                                     max_buckets=max_buckets, leaf_order=leaf_order),
        residual=residual, error_estimate=jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    n = axis_size(axis_name)  # raises the library's UnboundAxisError under plain jax.jit
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    codec_state = state.codec_state
    if codec_state is not None:
      fresh = init_codec_state(updates, codec=codec, n=n, bucket_size=bucket_size,
                               max_buckets=max_buckets, leaf_order=leaf_order)
      codec_state = jax.tree.map(lambda f, o: jnp.where(state.step == 0, f, o),
                                 fresh, codec_state)
    grads = updates
    if error_feedback:
      grads = jax.tree.map(lambda g, e: g.astype(jnp.float32) + e[0], updates,
                           state.residual.tree)
    reduced, stats = allreduce(
        grads, axis_name=axis_name, codec=codec, schedule=schedule, key=key,
        average=average, bucket_size=bucket_size, max_buckets=max_buckets,
        leaf_order=leaf_order, implementation=implementation, codec_state=codec_state, return_own=error_feedback)
    residual = None
    if error_feedback:
      residual = PerRank(jax.tree.map(lambda p, c: (p - c)[None], grads, stats.own))
      reduced = jax.tree.map(lambda r, u: r.astype(u.dtype), reduced, updates)
    return reduced, CompressedPsumState(
        step=optax.safe_increment(state.step), key=state.key,
        codec_state=stats.codec_state if codec_state is not None else None,
        residual=residual, error_estimate=jnp.asarray(stats.error_estimate, jnp.float32))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
