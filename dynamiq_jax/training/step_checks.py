"""The checks :func:`dynamiq_jax.data_parallel_step` runs while it builds a step.

Each names what is wrong and how to fix it, instead of letting a misconfigured
step train with replicas that drift apart: model state that differs between
ranks, per-rank parameters placed wrongly, an optimizer chain with no gradient
reduction (or one that is not first), and a sharded chain that does not return
this rank's shard of the update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dynamiq_jax.training.data_axes import data_dims
from dynamiq_jax.training.data_axes import data_entry
from dynamiq_jax.training.data_axes import is_spec
from dynamiq_jax.training.data_axes import mean_over
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.context import varying_axes

__all__ = [
    "expected_returns", "check_model_state_specs", "settle_model_state", "check_per_rank",
    "check_replicated", "check_state_shared", "check_shard_updates",
]


def expected_returns(has_aux, model_state) -> str:
  if model_state:
    return "(loss, (new_model_state, aux))" if has_aux else "(loss, new_model_state)"
  return "(loss, aux)"


def check_model_state_specs(mstate_specs, axes):
  for spec in jax.tree.leaves(mstate_specs, is_leaf=is_spec):
    if data_dims(spec, axes):
      raise ValueError(
          f"data_parallel_step(model_state=...) keeps the model state replicated over the "
          f"data axes {tuple(axes)}; a leaf is placed with {spec}. Fix: jax.device_put the "
          f"model state replicated over them, e.g. with NamedSharding(mesh, P())")


def settle_model_state(new, old, mode, axes):
  """The new model state, the same on every rank: checked (``True``) or averaged
  (``"mean"``)."""
  if jax.tree.structure(new) != jax.tree.structure(old):
    raise ValueError(
        f"loss_fn returned a new model state of structure {jax.tree.structure(new)} for one "
        f"of structure {jax.tree.structure(old)}: return the updated state itself (for Flax "
        f"Linen, the 'batch_stats' entry of apply's mutated variables)")

  def one(path, x):
    if not set(axes) & varying_axes(x):
      return x
    name = jax.tree_util.keystr(path)
    if mode == "mean" and jnp.issubdtype(x.dtype, jnp.inexact):
      return mean_over(x, axes).astype(x.dtype)
    if mode == "mean":
      raise ValueError(
          f"model state leaf {name} ({x.dtype}) differs between ranks of {tuple(axes)} and "
          f"model_state='mean' averages floating-point leaves only. Fix: compute it alike on "
          f"every rank (from values reduced over {data_entry(axes)!r})")
    raise ValueError(
        f"model state leaf {name} differs between ranks of {tuple(axes)} (each rank computed "
        f"it from its own shard of the batch), so replicas would drift apart. Fix: compute "
        f"it from the global batch (Flax: nn.BatchNorm(axis_name={data_entry(axes)!r}), "
        f"which averages the batch statistics over ranks), or pass "
        f"data_parallel_step(..., model_state='mean') to average the new state over ranks")

  return jax.tree_util.tree_map_with_path(one, new)


def check_per_rank(spec_leaves, axes):
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


def check_replicated(updates, axes, update, args):
  """Replicated parameters need updates every rank shares. ``update(*args)`` is the chain's
  update, traced again only to tell a missing reduction from a per-rank one."""
  for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
    if set(axes) & varying_axes(u):
      name = jax.tree_util.keystr(path)
      if not _communicates(jax.make_jaxpr(update)(*args).jaxpr, axes):
        raise ValueError(
            f"the update of {name} differs between ranks of {axes}: the optimizer chain has "
            f"no gradient reduction over {data_entry(axes)!r}, so each rank would step with "
            f"its own gradient. Fix: put the reduction first in the chain, e.g. "
            f"optax.chain(dq.compressed_psum({data_entry(axes)!r}), optax.adamw(1e-3)) "
            f"(or dq.reducer(name, {data_entry(axes)!r}), dq.baseline_psum("
            f"{data_entry(axes)!r})) instead of optax.adamw(1e-3) alone")
      raise ValueError(
          f"the update of {name} differs between ranks of {axes}: the "
          f"gradient reduction (e.g. Moshpit averaging, schedule=dq.Moshpit(...)) leaves each "
          f"rank its own result, and replicated parameters would drift apart. Fix: "
          f"data_parallel_step(..., per_rank=True) with each rank's own parameters and "
          f"optimizer state (dq.per_rank_copies), or a schedule whose result every rank "
          f"shares ('ring', 'butterfly', 'hierarchical')")


# Primitives that name an axis but move no data between ranks.
_LOCAL_AXIS_PRIMITIVES = frozenset({"axis_index", "axis_size", "pvary", "pbroadcast", "pcast"})


def _communicates(jaxpr, axes) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) has a collective over one of ``axes``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _LOCAL_AXIS_PRIMITIVES:
      for name in ("axes", "axis_name"):
        if name in eqn.params and set(axis_names(_flat_axes(eqn.params[name]))) & set(axes):
          return True
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else (value,)):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns") and _communicates(sub, axes):
          return True
  return False


def _flat_axes(names) -> tuple:
  if isinstance(names, (tuple, list)):
    return tuple(a for n in names for a in _flat_axes(n))
  return (names,)


def check_state_shared(opt_state, data_state, axes):
  """The optimizer state replicated over the data axes must stay the same on every rank: a
  reduction that is not first in the chain leaves the transforms before it per-rank."""
  specs = jax.tree.leaves(data_state, is_leaf=is_spec)
  leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  if len(specs) != len(leaves):
    return
  for (path, x), spec in zip(leaves, specs):
    if not data_dims(spec, axes) and set(axes) & varying_axes(x):
      raise ValueError(
          f"the optimizer state {jax.tree_util.keystr(path)} differs between ranks of {axes}: "
          f"a transform before the gradient reduction saw each rank's own gradient. Fix: "
          f"put the reduction first in the chain, e.g. optax.chain(dq.compressed_psum("
          f"{data_entry(axes)!r}), optax.adamw(1e-3))")


def check_shard_updates(updates, params):
  u_shapes = jax.tree.map(jnp.shape, updates)
  p_shapes = jax.tree.map(jnp.shape, params)
  if u_shapes != p_shapes:
    raise ValueError(
        "parameters split over the data axis (dq.zero_shardings) need a chain that returns "
        "this rank's shard of the update: start it with dq.compressed_psum_scatter(...) "
        f"(got updates shaped {u_shapes} for parameter shards {p_shapes})")
