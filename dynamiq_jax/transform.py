"""``compressed_psum``: the compressed all-reduce as an optax transform."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dynamiq_jax.allreduce import DEFAULT_BUCKET_SIZE
from dynamiq_jax.allreduce import allreduce
from dynamiq_jax.codecs.dynamiq import DynamiQ

__all__ = ["CompressedPsumState", "compressed_psum"]


class CompressedPsumState(NamedTuple):
  """State of :func:`compressed_psum`, identical on every rank.

  Attributes:
    step: int32 count of all-reduces done; folded into the rounding key.
    key: uint32[2] raw key data of the base key (from ``seed``).
  """

  step: jax.Array
  key: jax.Array


def compressed_psum(axis_name="data", *, codec=None, schedule: str = "ring",
                    average: bool = True, seed: int = 0,
                    bucket_size: int = DEFAULT_BUCKET_SIZE,
                    implementation: str | None = None,
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
    bucket_size: coordinates per bucket.
    implementation: ``None`` (Pallas kernels on GPU, the jnp reference
      elsewhere), ``"pallas"`` or ``"xla"``; bit-identical results.

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its state
    (:class:`CompressedPsumState`) is replicated and ``init`` accepts
    ``jax.ShapeDtypeStruct`` leaves.

  Examples:
    >>> import optax, dynamiq_jax as dq
    >>> tx = optax.chain(dq.compressed_psum("data"), optax.sgd(0.1))
  """
  codec = DynamiQ() if codec is None else codec

  def init_fn(params):
    del params
    return CompressedPsumState(
        step=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    reduced, _ = allreduce(
        updates, axis_name=axis_name, codec=codec, schedule=schedule, key=key,
        average=average, bucket_size=bucket_size, implementation=implementation)
    return reduced, CompressedPsumState(
        step=optax.safe_increment(state.step), key=state.key)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
