"""Training over lossy links: each rank owns a shard of the parameters, and the owners'
updates reach the other replicas packet by packet.

``data_parallel_step(..., per_rank=True, packet_loss=dq.PacketLoss(p))`` runs this step
(Weintraub, Banner and Orda, "Distributed Training under Packet Loss"):

1. every rank computes its gradient on its own replica of the parameters;
2. ``dq.compressed_psum_scatter(schedule="two_step", packet_loss=...)`` gives each rank
   the unbiased estimate of its shard of the mean gradient from the packets
   that reached it (:class:`~dynamiq_jax.PacketLoss`);
3. the rest of the chain updates that shard (its optimizer state is the
   rank's own: a sharded optimizer);
4. each owner broadcasts its updated shard (:func:`lossy_broadcast`): a replica
   that misses a packet keeps its stale values there. The owner's own shard is
   always current, so a replica's distance from the owners' parameters is what
   it missed since it last heard from them: bounded (in expectation, about
   ``p / (1 - p)`` steps' updates per coordinate), not a random walk.

The step reports that distance every step, in ``step.stats["drift"]``: the
largest over the replicas of the L2 distance between a replica and the owners'
parameters (any two replicas differ by at most twice it). Leaves below
``min_size`` coordinates, or with no dimension that splits over the ranks, are
reduced whole and stepped alike on every replica, so they never differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.api.scatter import scatter_dimensions
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.training.data_axes import per_rank_copies
from dynamiq_jax.schedules.loss import BROADCAST_HOP, PacketLoss, loss_key
from dynamiq_jax.api.transform import CompressedPsumState

__all__ = ["MIN_SIZE", "owner_dims", "owner_shard", "lossy_init", "broadcast_key",
           "lossy_broadcast", "check_lossy_step"]

MIN_SIZE = 1024
"""Leaves with fewer coordinates are not sharded: reduced whole, identical on every replica."""


def owner_dims(params, n: int):
  """The dimension along which each leaf is split among ``n`` owners, or None (whole)."""
  return jax.tree.leaves(scatter_dimensions(params, n=n, min_size=MIN_SIZE),
                         is_leaf=lambda x: x is None)


def owner_shard(leaf, dim, rank, n: int):
  """Rank ``rank``'s shard of ``leaf`` along ``dim`` (the whole leaf where ``dim`` is None)."""
  if dim is None:
    return leaf
  size = leaf.shape[dim] // n
  return jax.lax.dynamic_slice_in_dim(leaf, rank * size, size, axis=dim)


def lossy_init(tx, params, *, mesh, axis_name="data"):
  """``(replicas, opt_state)`` for ``data_parallel_step(..., per_rank=True,
  packet_loss=...)``: one replica of ``params`` per rank, and rank r's optimizer state of
  its own shard (``tx.init`` of it), each with a leading axis of ranks split over
  ``axis_name``."""
  names = axis_names(axis_name)
  if len(names) != 1:
    raise ValueError(f"lossy links run over one data axis; got axis_name={axis_name!r}")
  n = mesh.shape[names[0]]
  leaves, treedef = jax.tree.flatten(params)
  dims = owner_dims(params, n)
  states = [tx.init(treedef.unflatten([owner_shard(jnp.asarray(a), d, r, n)
                                       for a, d in zip(leaves, dims)])) for r in range(n)]
  stacked = jax.tree.map(lambda *s: jnp.stack(s), *states)
  return (per_rank_copies(params, mesh=mesh, axis_name=names[0]),
          jax.device_put(stacked, NamedSharding(mesh, P(names[0]))))


def broadcast_key(opt_state):
  """The parameter broadcast's loss key at this step: from the first
  :class:`~dynamiq_jax.CompressedPsumState` of ``opt_state`` (its seed and step)."""
  for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CompressedPsumState)):
    if isinstance(s, CompressedPsumState):
      words = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(s.key),
                                                     s.step)).reshape(-1)
      return loss_key((words[0], words[-1]))
  raise ValueError(
      "data_parallel_step(packet_loss=...) keys the parameter broadcast's losses by the "
      "reduction's seed and step, from the chain's state; its chain has no "
      "dq.compressed_psum_scatter. Fix: tx = optax.chain(dq.compressed_psum_scatter('data', "
      "schedule='two_step', packet_loss=...), ...)")


def lossy_broadcast(shards, replicas, dims, loss: PacketLoss, key, axis):
  """Each owner's updated shard sent to every replica over lossy links.

  Args:
    shards: this rank's updated shards (flat list, as ``replicas``).
    replicas: this rank's replica of every leaf, from before the step.
    dims: each leaf's owner dimension (None: reduced whole, ``shards`` holds it).
    loss: the loss process; a packet carries ``loss.packet_bytes`` of the leaf's dtype.
    key: :func:`broadcast_key`'s, identical on every rank.
    axis: the data axis.

  Returns:
    ``(new replicas, squared L2 distance of this replica from the owners'
    parameters)``: where a packet from owner s was lost, the replica keeps its
    old values.
  """
  n, r = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
  out, dist2 = [], jnp.float32(0)
  for i, (shard, old, dim) in enumerate(zip(shards, replicas, dims)):
    if dim is None:
      out.append(shard)
      continue
    owners = jax.lax.all_gather(shard, axis, axis=dim, tiled=True)  # what the owners hold
    front = jnp.moveaxis(owners, dim, 0)
    rows = front.reshape(n, -1)
    stale = jnp.moveaxis(old, dim, 0).reshape(n, -1)
    missed = loss.lost_elements(jax.random.fold_in(key, i), BROADCAST_HOP, n, r,
                                rows.shape[1],
                                loss.coords_per_packet(8 * jnp.dtype(shard.dtype).itemsize))
    kept = jnp.where(missed, stale, rows)
    diff = (kept - rows).astype(jnp.float32)
    dist2 = dist2 + jnp.sum(diff * diff)
    out.append(jnp.moveaxis(kept.reshape(front.shape), 0, dim))
  return out, dist2


def check_lossy_step(packet_loss, per_rank: bool, axes, model):
  """``data_parallel_step``'s ``packet_loss=`` checked against its other options."""
  if not isinstance(packet_loss, PacketLoss):
    raise TypeError(f"packet_loss={packet_loss!r} must be a dq.PacketLoss(p=...) or None")
  if not per_rank:
    raise ValueError(
        "data_parallel_step(packet_loss=...) leaves replicas that missed a parameter packet "
        "with stale values, so each rank keeps its own replica: pass per_rank=True, with the "
        "replicas and optimizer state from dq.lossy_init(tx, params, mesh=mesh)")
  if len(axes) != 1 or model:
    raise ValueError(
        f"data_parallel_step(packet_loss=...) runs pure data parallelism over one axis; got "
        f"data axes {tuple(axes)} and other mesh axes {tuple(model)} of size > 1")
