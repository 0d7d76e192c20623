"""DynamiQ's statistics all-reduce (:class:`SupergroupStats`) and a bucket's key tables.

Each super-group's local mean and residual norm are summed over the ranks in
two collectives (the engine's :func:`~dynamiq_jax.engine.programs.combine_metadata`),
carried by this codec; :class:`DynamiQKeyTables` are the keys DynamiQ derives
once per bucket for its hops and for these statistics.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs._exact import hypot
from dynamiq_jax.codecs._exact import hypot_all
from dynamiq_jax.codecs._exact import stochastic_bf16
from dynamiq_jax.codecs._exact import tree_sum
from dynamiq_jax.codecs.base import Codec
from pallas_kernels import dynamiq_stats as stats_kernels
from pallas_kernels import rng

__all__ = ["STATS_BITS", "DynamiQKeyTables", "SupergroupStats", "table_entry", "hop_words",
           "element_index"]

STATS_BITS = 32
"""Bits per super-group of the statistics: two bf16 values."""


class DynamiQKeyTables(NamedTuple):
  """One bucket's keys (:meth:`~dynamiq_jax.codecs.dynamiq.DynamiQ.key_tables`): ``chunk``,
  uint32 rounding keys ``[n, n + 1, 2]`` (chunk, hop, word) and stratum keys ``[n, 2]``
  (:func:`hop_words`); ``stats``, the statistics' keys ``[n, n + 1]`` x 2 (chunk, hop)."""

  chunk: tuple
  stats: tuple


@dataclasses.dataclass(frozen=True)
class SupergroupStats(Codec):
  """The statistics all-reduce: lane 0 sums means, lane 1 combines norms.

  Means are rounded to bf16 *stochastically* at every encode, so the mean
  that is added back is an unbiased estimate of the exact sum of local means
  and the whole all-reduce stays unbiased (round-to-nearest would leave a
  fixed error of up to 2^-9 of every super-group mean). Norms only rank
  super-groups; they are combined as the root of their summed squares with
  exact squares (:func:`~dynamiq_jax.codecs._exact.hypot`, or
  :func:`~dynamiq_jax.codecs._exact.hypot_all` for n at once), so the result
  is ``sqrt(F)`` with ``F`` the sum of local squared norms.

  A bfloat16 chunk is already encoded (DynamiQ's statistics pass encodes the
  first step's payloads as it computes them, with the keys this encode would
  use): :meth:`encode` passes it on. ``implementation`` chooses the kernel of
  :meth:`decode_sum` (:func:`pallas_kernels.dynamiq_stats.stats_sum`).
  """

  implementation: str | None = None

  def wire_bits(self, d: int, n: int) -> int:
    return STATS_BITS * d

  def plan(self, x, meta, bucket, state, keys):
    raise NotImplementedError("SupergroupStats only combines metadata")

  def finish(self, decoded, aux, bucket, state):
    raise NotImplementedError("SupergroupStats only combines metadata")

  def encode(self, chunk, aux, keys):
    del aux
    if chunk.dtype == jnp.bfloat16:  # encoded by the statistics pass
      return chunk
    tables = keys.keys.tables
    if isinstance(tables, DynamiQKeyTables):  # derived for every bucket at once
      k0, k1 = (table_entry(t, keys.chunk, keys.hop) for t in tables.stats)
    else:
      k0, k1 = keys.derive(keys.chunk, keys.hop, rng.Stream.DYNAMIQ_STATS)
    mean = stochastic_bf16(chunk[..., 0], rng.hash_index(k0, k1, element_index(chunk[..., 0])))
    return jnp.stack([mean, chunk[..., 1].astype(jnp.bfloat16)], axis=-1)

  def decode(self, payload, aux):
    """The payload as it is: bfloat16 values are the partial sums themselves, which their
    readers convert where they read them (DynamiQ's allocation and finish kernels read
    the gathered statistics in place, so no converted copy is made)."""
    del aux
    return payload

  def decode_add(self, payload, chunk, aux):
    p = self.decode(payload, aux).astype(jnp.float32)
    return jnp.stack([p[..., 0] + chunk[..., 0], hypot(p[..., 1], chunk[..., 1])], axis=-1)

  def decode_sum(self, payloads, aux):
    """n payloads at once, by a fixed pairwise tree: the means summed, the norms
    combined as ``sqrt(sum of squares)`` (:func:`~dynamiq_jax.codecs._exact.hypot_all`'s
    arithmetic), in one pass (:func:`pallas_kernels.dynamiq_stats.stats_sum`)."""
    del aux
    if not _kernel_payloads(payloads):
      p = jnp.moveaxis(payloads.astype(jnp.float32), 0, -1)  # [..., 2, n]
      return jnp.stack([tree_sum(p[..., 0, :]), hypot_all(p[..., 1, :])], axis=-1)
    return stats_kernels.stats_sum(payloads, implementation=self.implementation)

  def decode_sum_encode(self, payloads, aux, keys):
    """:meth:`decode_sum`, then :meth:`encode` of the sum, in one kernel launch where the
    keys are the engine's tables and the step static
    (:func:`pallas_kernels.dynamiq_stats.stats_sum_encode`): the same bits."""
    tables = keys.keys.tables
    if (not _kernel_payloads(payloads) or not isinstance(tables, DynamiQKeyTables)
        or not isinstance(keys.hop, (int, np.integer))):
      return self.encode(self.decode_sum(payloads, aux), aux, keys)
    k0, k1 = tables.stats
    return stats_kernels.stats_sum_encode(payloads, k0, k1, keys.chunk, stride=k0.shape[-1],
                                          step=int(keys.hop),
                                          implementation=self.implementation)


def _kernel_payloads(payloads) -> bool:
  """Whether the statistics' kernels take ``payloads``: bfloat16 ``[n, s, 2]`` (any other
  dtype or rank takes the jnp arithmetic)."""
  return payloads.dtype == jnp.bfloat16 and payloads.ndim == 3


def table_entry(table, *index):
  """``table[index]`` for uint32 scalar indices (:class:`HopKeys`' chunk and hop), sliced
  directly: unsigned, so the slice carries no sign handling, where ``jnp`` indexing
  converts them to signed and wraps negatives in every fusion that reads a key."""
  index = [jnp.asarray(i, jnp.uint32) for i in index]
  return jax.lax.dynamic_slice(table, index, (1,) * len(index)).reshape(())


def hop_words(chunk_keys, chunk, hop):
  """uint32 [4]: the rounding key of (``chunk``, ``hop``) and the chunk's stratum key from
  :class:`DynamiQKeyTables`' ``chunk`` tables, each pair one unsigned slice (a hop's four
  words adjacent in one table made XLA give each hop's key operand a launch of its own,
  where these slices share one for all the hops)."""
  rounding, strata = chunk_keys
  c, h, zero = jnp.asarray(chunk, jnp.uint32), jnp.asarray(hop, jnp.uint32), jnp.uint32(0)
  return jnp.concatenate([jax.lax.dynamic_slice(rounding, (c, h, zero), (1, 1, 2)).reshape(2),
                          jax.lax.dynamic_slice(strata, (c, zero), (1, 2)).reshape(2)])


def element_index(v):
  return jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape)
