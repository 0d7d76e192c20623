"""The two-level schedule: exact inside the fast axis, compressed across the slow one.

``axis_name=(slow, fast)``, e.g. ``("host", "local")``:

1. the fast axis reduce-scatters the float32 gradient exactly
   (:func:`reduce_scatter_shares`: a float32 ring, NVLink inside a host);
2. each fast rank all-reduces its ``1/L`` share with the codec over the slow
   axis (the NIC; ``allreduce`` runs this part with the flat schedule);
3. the fast axis all-gathers the reduced shares (:func:`all_gather_shares`).

Shares are interleaved in blocks of the codec's granularity (share r holds
blocks r, r + L, r + 2L, ...: whole super-groups for DynamiQ), so every share
has the whole gradient's mix of large and small blocks; with contiguous
shares one share would hold all embedding rows and another all dense layers.

The fast axis sends ``2 (L - 1) / L`` of the float32 bucket per rank; the
slow axis sends what the codec sends for a ``1/L`` share.
"""

from __future__ import annotations

import jax.numpy as jnp

from dynamiq_jax._sizes import ceil_div

from dynamiq_jax.schedules.context import AxisContext
from dynamiq_jax.schedules.executor import HopOps, all_gather, reduce_scatter
from dynamiq_jax.schedules.names import HIERARCHICAL
from dynamiq_jax.schedules.plan import ring_plan

__all__ = ["HIERARCHICAL", "split_shares", "join_shares", "reduce_scatter_shares",
           "all_gather_shares"]


def _exact_f32_ops() -> HopOps:
  """float32 partial sums, added in the ring's fixed order."""

  def encode(chunk, c, hop):
    del c, hop
    return chunk.astype(jnp.float32)

  def decode(payload):
    return payload

  def decode_add(payload, chunk):
    return payload + chunk

  def decode_add_encode(payload, chunk, c, hop):
    return encode(decode_add(payload, chunk), c, hop)

  return HopOps(encode, decode, decode_add_encode, decode_add)


def split_shares(flat, size: int, unit: int):
  """flat float32 [total] -> [size, m]: share r holds blocks r, r + size, ... of ``unit``."""
  total = flat.shape[0]
  blocks = ceil_div(total, unit * size)
  m = blocks * unit
  chunks = jnp.pad(flat, (0, m * size - total)).reshape(blocks, size, unit)
  return chunks.transpose(1, 0, 2).reshape(size, m)


def join_shares(shares, total: int, unit: int):
  """Inverse of :func:`split_shares`: [size, m] -> flat [total]."""
  size, m = shares.shape
  return shares.reshape(size, m // unit, unit).transpose(1, 0, 2).reshape(-1)[:total]


def reduce_scatter_shares(ctx: AxisContext, shares):
  """Exact float32 reduce-scatter over the fast axis.

  Rank r ends with the sum of share ``(r + 1) % size``, accumulated in the
  ring's fixed order, so the bits do not depend on the backend.
  """
  if ctx.n == 1:
    return shares[0]
  return reduce_scatter(ring_plan(ctx.n), ctx, shares, _exact_f32_ops())


def all_gather_shares(ctx: AxisContext, share):
  """Every fast rank's reduced share, in share order: [size, m]."""
  if ctx.n == 1:
    return share[None]
  return all_gather(ring_plan(ctx.n), ctx, share, _exact_f32_ops())
