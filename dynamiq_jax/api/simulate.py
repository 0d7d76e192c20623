"""``simulate``: n virtual workers on one device, by running the real code under vmap.

``jax.vmap(..., axis_name=...)`` supports ``ppermute``, ``all_gather`` and
``axis_index``, so the distributed :func:`dynamiq_jax.allreduce` runs
unchanged with the batch axis as the worker axis. Because every reduction is
done by the library's fixed-order schedule, the result is bit-identical to
the same call under ``jax.shard_map`` on n devices.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from dynamiq_jax._renamed import UNSET, renamed
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE
from dynamiq_jax.engine.buckets import DEFAULT_MAX_BUCKETS
from dynamiq_jax.api.allreduce import HIERARCHICAL
from dynamiq_jax.api.allreduce import run_allreduce
from dynamiq_jax.engine.options import ReduceOptions

__all__ = ["simulate", "SIM_AXIS"]

SIM_AXIS = "dynamiq_sim"


SIM_HOST_AXIS = "dynamiq_sim_host"


@functools.partial(jax.jit, static_argnames=("opts", "mesh_shape"))
def _run(grads, key, codec_state, absent, *, opts: ReduceOptions, mesh_shape):

  def one(tree):
    out, stats = run_allreduce(tree, opts, key=key, codec_state=codec_state, absent=absent)
    return out, stats.codec_state

  if mesh_shape:  # workers laid out [slow, fast]: nested vmaps bind both axes
    grid = jax.tree.map(lambda x: x.reshape(mesh_shape + x.shape[1:]), grads)
    out, state = jax.vmap(jax.vmap(one, axis_name=SIM_AXIS), axis_name=SIM_HOST_AXIS)(grid)
    out = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), out)
    return out, jax.tree.map(lambda s: s[0, 0], state)
  out, state = jax.vmap(one, axis_name=SIM_AXIS)(grads)
  return out, jax.tree.map(lambda s: s[0], state)  # identical on every worker


def simulate(grads, *, codec, schedule: str = "ring", seed: int = 0, key=None,
             average: bool = True,
             bucket_size: int = DEFAULT_BUCKET_SIZE,
             max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None,
             implementation: str | None = None,
             codec_state=None, return_state: bool = False, mesh_shape=None,
             stacked=None, absent=None, packet_loss=None, layers=UNSET, loss=UNSET):
  """All-reduces per-worker gradients stacked on axis 0, on one device.

  Args:
    grads: pytree whose leaves have a leading worker axis of size n (positional).
    codec: the codec, or its name (as for :func:`dynamiq_jax.allreduce`).
    schedule: ``"ring"``, ``"butterfly"``, ``"two_step"``, ``"hierarchical"`` (with
      ``mesh_shape``) or Moshpit averaging (``"moshpit"``, ``dq.Moshpit(...)``).
    seed: the rounding key is ``jax.random.key(seed)`` (unless ``key`` is
      given): the same as ``allreduce(..., key=jax.random.key(seed))`` on n
      devices, and as step 0 of ``compressed_psum(seed=seed)`` after folding
      the step (pass ``key=jax.random.fold_in(jax.random.key(seed), t)``).
    key: explicit rounding key, overriding ``seed``.
    average: mean (True) or sum (False).
    bucket_size: the most coordinates in one bucket (as for
      :func:`dynamiq_jax.allreduce`).
    max_buckets, leaf_order: as for :func:`dynamiq_jax.allreduce`.
    implementation: as for :func:`dynamiq_jax.allreduce`.
    codec_state: a stateful codec's state from a previous call (None: fresh).
    return_state: also return the codec's state after this call, to carry
      into the next (e.g. MX's adaptive scale over training rounds).
    mesh_shape: ``(slow, fast)`` for ``schedule="hierarchical"``: the n
      workers are laid out row-major on that grid (worker ``i`` is slow rank
      ``i // fast``, fast rank ``i % fast``), as on a 2-axis mesh.
    stacked: as for :func:`dynamiq_jax.allreduce`: the leaves stacked along an
      axis of layers (after the worker axis; e.g. ``"layers"``, a pytree key),
      reduced in loops.
    absent: Moshpit averaging's mask of absent workers, bool ``[rounds, n]``
      (as for :func:`dynamiq_jax.allreduce`).
    packet_loss: a :class:`~dynamiq_jax.PacketLoss` (``schedule="two_step"``): the
      reduce step's packets lost, as for :func:`dynamiq_jax.allreduce`.
    layers: the old name of ``stacked`` (deprecated, with a ``DeprecationWarning``).
    loss: the old name of ``packet_loss`` (deprecated, with a ``DeprecationWarning``).

  Returns:
    The per-worker results stacked on axis 0 (all rows identical, except under
    Moshpit averaging with absent workers); with
    ``return_state``, ``(results, codec_state)``.

  Examples:
    >>> import jax, jax.numpy as jnp, dynamiq_jax as dq
    >>> g = jax.random.normal(jax.random.key(1), (8, 4096))
    >>> out = dq.simulate(g, codec=dq.codecs.DynamiQ(bits=6))
    >>> bool((out == out[0]).all())
    True
  """
  stacked = renamed(stacked, layers, new="stacked", old="layers", where="simulate")
  packet_loss = renamed(packet_loss, loss, new="packet_loss", old="loss", where="simulate")
  leaves = jax.tree.leaves(grads)
  if not leaves:
    return grads
  lead = sorted({np.shape(x)[0] if np.ndim(x) else -1 for x in leaves})
  if len(lead) != 1 or lead[0] < 1:
    raise ValueError(
        f"every leaf of `grads` needs the same leading worker axis; got leading "
        f"sizes {[s if s >= 0 else 'scalar' for s in lead]}. Stack per-worker "
        f"gradients with jax.tree.map(lambda *g: jnp.stack(g), *per_worker).")
  if mesh_shape is not None:
    mesh_shape = tuple(int(k) for k in mesh_shape)
    if len(mesh_shape) != 2 or mesh_shape[0] * mesh_shape[1] != lead[0]:
      raise ValueError(f"mesh_shape={mesh_shape} must be (slow, fast) with slow * fast = "
                       f"{lead[0]} workers")
  elif schedule in HIERARCHICAL:
    raise ValueError(f"schedule={schedule!r} simulates a 2-axis mesh: pass "
                     f"mesh_shape=(slow, fast), e.g. (2, {lead[0] // 2})")
  opts = ReduceOptions.build(
      "simulate", codec=codec,
      axis_name=(SIM_HOST_AXIS, SIM_AXIS) if mesh_shape is not None else SIM_AXIS,
      schedule=schedule, average=average, bucket_size=bucket_size, max_buckets=max_buckets,
      leaf_order=leaf_order, implementation=implementation, stacked=stacked,
      loss=packet_loss)
  if key is None:
    key = jax.random.key(seed)
  out, state = _run(grads, key, codec_state, absent, opts=opts, mesh_shape=mesh_shape)
  return (out, state) if return_state else out
