"""The collective axis as a schedule sees it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["AxisContext", "UnboundAxisError", "axis_context", "axis_size", "varying_axes",
           "axis_names", "as_varying"]


@dataclasses.dataclass(frozen=True)
class AxisContext:
  """The collective axis as seen from inside ``shard_map``/``pmap``/``vmap``.

  Attributes:
    axis_name: the bound axis name (or a tuple of names).
    n: its size.
    invariant_gather: True under ``shard_map(check_vma=True)``: gathers must
      return values typed as invariant over the axis.
  """

  axis_name: Any
  n: int
  invariant_gather: bool = False

  def rank(self):
    return jax.lax.axis_index(self.axis_name)

  def all_gather(self, tree):
    kw = {"to": "invarying"} if self.invariant_gather else {}
    return jax.tree.map(lambda a: jax.lax.all_gather(a, self.axis_name, **kw), tree)

  def all_to_all(self, tree):
    """Leading axis n: rank r's row s goes to rank s, which holds it as its row r."""
    return jax.tree.map(lambda a: jax.lax.all_to_all(a, self.axis_name, 0, 0), tree)

  def pmax(self, tree):
    return jax.tree.map(lambda a: jax.lax.pmax(a, self.axis_name), tree)

  def psum(self, tree):
    return jax.tree.map(lambda a: jax.lax.psum(a, self.axis_name), tree)

  def ppermute(self, tree, perm):
    return jax.lax.ppermute(tree, self.axis_name, perm)


def axis_names(axis_name) -> tuple:
  """``axis_name`` as a tuple of names."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` varies over (empty outside ``shard_map(check_vma=True)``)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "manual_axis_type", None)
    vma = getattr(mat, "varying", frozenset()) if mat is not None else frozenset()
  return frozenset(vma)


def as_varying(tree, axis_name):
  """Marks replicated values as per-rank inside ``shard_map(check_vma=True)``."""
  cast = getattr(jax.lax, "pcast", None)
  if cast is not None:
    return cast(tree, axis_name, to="varying")
  return jax.lax.pvary(tree, axis_name)  # jax versions before pcast


class UnboundAxisError(ValueError):
  """A collective over ``axis_name`` was traced where no enclosing map binds that name.

  The usual cause is calling the compressed all-reduce (``compressed_psum``,
  ``allreduce``, ``baseline_psum``) inside plain ``jax.jit`` over sharded
  arrays: ``jax.jit`` with ``NamedSharding`` inputs partitions the program
  itself (GSPMD) and binds no axis name, so there is no per-rank code for a
  hand-written all-reduce to run in. The message names the fix.
  """


def _unbound(axis_name) -> UnboundAxisError:
  name = axis_name if isinstance(axis_name, str) else axis_names(axis_name)[0]
  return UnboundAxisError(
      f"axis_name={axis_name!r} is not bound here: the gradient all-reduce runs per rank, "
      f"so it must be traced inside a jax.shard_map (or jax.pmap / jax.vmap) that names "
      f"that axis. Plain jax.jit over NamedSharding-ed arrays binds no axis name (XLA "
      f"partitions the program itself and would insert its own full-precision all-reduce). "
      f"Fix: build the step with dynamiq_jax.data_parallel_step(loss_fn, tx, mesh=mesh, "
      f"axis_name={name!r}) (dynamiq_jax.training.nnx.DataParallel for Flax NNX models), or wrap "
      f"the per-rank part yourself: jax.jit(jax.shard_map(step, mesh=mesh, in_specs=..., "
      f"out_specs=...)) with a mesh that has the axis {name!r}, or "
      f"jax.pmap(..., axis_name={name!r}); or pass the axis name your mesh actually uses.")


def axis_size(axis_name) -> int:
  """``jax.lax.axis_size(axis_name)``, raising :class:`UnboundAxisError` where it is unbound."""
  try:
    return jax.lax.axis_size(axis_name)
  except NameError:
    raise _unbound(axis_name) from None


def axis_context(axis_name) -> AxisContext:
  """Resolves ``axis_name`` in the current trace.

  Raises:
    UnboundAxisError: (a ``ValueError``) if the name is not bound by an
      enclosing ``shard_map``, ``pmap`` or ``vmap``, e.g. under plain
      ``jax.jit``; the message says how to bind it.
  """
  n = axis_size(axis_name)
  try:
    idx = jax.lax.axis_index(axis_name)
  except NameError:
    raise _unbound(axis_name) from None
  checked = set(axis_names(axis_name)) <= varying_axes(idx)
  return AxisContext(axis_name=axis_name, n=int(n), invariant_gather=checked)
