"""Where a data-parallel step's arrays live on a mesh's data axes, and the
collectives over those axes the step needs.

Partition specs over the data axes, the placement of optimizer state
(:func:`data_parallel_init`), of parameters split over the data axes
(:func:`zero_shardings`) and of per-rank copies (:func:`per_rank_copies`);
the exact mean over the data axes and the all-gather of split parameters.
:mod:`dynamiq_jax.training.train` builds the step from these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.schedules.context import as_varying
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.local import strip_axes
from dynamiq_jax.api.transform import PerRank
from dynamiq_jax.api.scatter import scatter_dimensions
from dynamiq_jax.schedules.context import varying_axes

__all__ = [
    "is_per_rank", "data_entry", "is_spec", "mesh_spec", "only_axes", "data_dims",
    "data_parallel_init", "zero_shardings", "mean_over", "gather_params", "per_rank_copies",
    "opt_state_specs",
]


def is_per_rank(x):
  """Whether ``x`` is a :class:`~dynamiq_jax.api.transform.PerRank` part of an optimizer
  state (one value per rank, e.g. the error-feedback residual)."""
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


def mean_over(x, axes):
  """The mean of ``x`` over the data ``axes`` in a fixed order (an exact all-gather, then a
  local sum), so that it does not depend on how the backend sums (XLA CPU, gloo, NCCL)."""
  axis = data_entry(axes)
  gathered = jax.lax.all_gather(x, axis, to="invarying") if _checked(axis) else (
      jax.lax.all_gather(x, axis))
  return jnp.mean(gathered, axis=0)


def _checked(axis) -> bool:
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


def per_rank_copies(tree, *, mesh, axis_name="data"):
  """One copy of ``tree`` per rank of ``axis_name``: every leaf stacked ``n`` times along a
  new leading axis split over ``axis_name``, for ``data_parallel_step(..., per_rank=True)``
  (parameters and optimizer state, ``tx.init(params)``, alike)."""
  axes = axis_names(axis_name)
  n = int(np.prod([mesh.shape[a] for a in axes]))
  sharding = NamedSharding(mesh, P(data_entry(axes)))
  return jax.tree.map(lambda a: jax.device_put(
      jnp.broadcast_to(jnp.asarray(a)[None], (n,) + jnp.shape(a)), sharding), tree)


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
