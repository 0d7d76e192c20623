"""The collective axis as a schedule sees it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

__all__ = ["AxisContext", "axis_context", "varying_axes", "axis_names"]


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


def axis_context(axis_name) -> AxisContext:
  """Resolves ``axis_name`` in the current trace.

  Raises:
    ValueError: if the name is not bound by an enclosing ``shard_map``,
      ``pmap`` or ``vmap``; the message says how to bind it.
  """
  try:
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
  except NameError:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here. Call this inside "
        f"jax.shard_map(..., mesh=mesh) whose mesh has that axis, or inside "
        f"jax.pmap(..., axis_name={axis_name!r}) / jax.vmap(..., axis_name="
        f"{axis_name!r}); or pass the name your mesh actually uses.") from None
  checked = set(axis_names(axis_name)) <= varying_axes(idx)
  return AxisContext(axis_name=axis_name, n=int(n), invariant_gather=checked)
