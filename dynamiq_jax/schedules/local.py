"""Running a collective on each device's own shard, whatever the other mesh axes do.

Data parallelism is one axis (or a few) of a mesh whose other axes shard
the model: a ``jax.shard_map`` manual over the data axis only
(``axis_names={"data"}``) leaves the tensor / FSDP axes to the compiler, and
a gradient leaf there is the device's slice of the data axis but a *global*
array over the model axes (``float32[256,512@model]`` with Explicit axes; no
sharding in the type with Auto ones). Flattening it for a bucket would make
the compiler gather it over the model axes first.

:func:`run_on_local_shards` avoids that: it runs the all-reduce inside a
second ``shard_map``, manual over every remaining mesh axis, whose
``in_specs`` are the leaves' own shardings, so every device reduces the
shard it already holds over the data axis, and the results come back with
the same shardings. Nothing is gathered and nothing is resharded (the
compiled HLO has collectives over the data axis only). Leaves replicated
over a model axis are reduced by every device of that axis alike (the same
inputs, keys and code give the same bytes).

The shardings come from the leaves' types where the axes are Explicit
(``jax.typeof(x).sharding``), or from ``specs`` (the gradient's
``PartitionSpec`` tree, e.g. the parameters') where they are Auto: the
compiler decides Auto shardings after tracing, so nothing at trace time can
read them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["model_axes", "local_specs", "run_on_local_shards", "sharding_groups",
           "strip_axes"]


def model_axes() -> tuple[str, ...]:
  """The mesh axes of size > 1 that the enclosing ``shard_map`` leaves to the compiler.

  Empty outside a mesh (``vmap``, ``pmap``), and inside a ``shard_map``
  that is manual over every axis.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  manual = set(mesh.manual_axes)
  return tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def strip_axes(spec, axes) -> P:
  """``spec`` without the mesh axes in ``axes`` (entries left empty become None)."""
  drop = set(axes)
  out = []
  for entry in tuple(spec):
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(a for a in names if a is not None and a not in drop)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def sharding_groups(specs) -> list[tuple[tuple[str, ...], list[int]]]:
  """Leaf indices grouped by the mesh axes their ``specs`` shard them over.

  Returns:
    ``[(axes, indices)]`` in order of first appearance; ``axes`` sorted.
  """
  groups: dict = {}
  for i, spec in enumerate(specs):
    axes = tuple(sorted({a for e in tuple(spec)
                         for a in (e if isinstance(e, tuple) else (e,)) if a is not None}))
    groups.setdefault(axes, []).append(i)
  return list(groups.items())


def _spec_of(leaf):
  sharding = getattr(jax.typeof(leaf), "sharding", None)
  return getattr(sharding, "spec", None)


def local_specs(paths_and_leaves, specs, *, what: str = "allreduce"):
  """Each leaf's ``PartitionSpec`` over :func:`model_axes`, or None if there are none.

  Args:
    paths_and_leaves: ``[(path, leaf)]`` as ``jax.tree_util.tree_flatten_with_path`` gives.
    specs: None, or a list of ``PartitionSpec`` (one per leaf, the leaves'
      shardings on the whole mesh; axes already manual are dropped).
    what: the caller's name, for the error message.

  Raises:
    ValueError: a model axis is Auto and ``specs`` is None (the shardings
      cannot be known at trace time), or ``specs`` has the wrong length.
  """
  axes = model_axes()
  if not axes:
    return None
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(mesh.manual_axes)
  if specs is not None:
    if len(specs) != len(paths_and_leaves):
      raise ValueError(f"specs= holds {len(specs)} PartitionSpecs, the gradient has "
                       f"{len(paths_and_leaves)} leaves: pass one per leaf (e.g. the "
                       f"parameters' specs, jax.tree.map(lambda p: p.sharding.spec, params))")
    return [strip_axes(s if s is not None else P(), manual) for s in specs]
  auto = [a for a in axes if a in set(mesh.auto_axes)]
  if auto:
    raise ValueError(
        f"{what} runs inside a shard_map that leaves the mesh axes {tuple(auto)} to the "
        f"compiler (AxisType.Auto), so the gradient's shardings over them are not known "
        f"while tracing, and flattening the leaves would gather them. Fix: pass specs= (the "
        f"leaves' PartitionSpecs, e.g. the parameters'; dq.data_parallel_step and "
        f"dq.nnx.DataParallel do this), make those axes Explicit "
        f"(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Explicit,) * ndim)), or "
        f"make the shard_map manual over every axis")
  out = []
  for _, leaf in paths_and_leaves:
    spec = _spec_of(leaf)
    out.append(strip_axes(spec if spec is not None else P(), manual))
  return out


def run_on_local_shards(fn: Callable[..., Any], tree, specs, treedef, *, out_specs,
                        replicated=()) -> Any:
  """``fn(local_tree, *replicated)`` inside a ``shard_map`` manual over :func:`model_axes`.

  Args:
    fn: ``fn(tree, *replicated) -> outputs``, traced on the device's local shards.
    tree: the pytree (its leaves sharded over the model axes as ``specs`` say).
    specs: one ``PartitionSpec`` per leaf of ``tree`` (over the model axes only).
    treedef: ``tree``'s structure.
    out_specs: ``out_specs(tree_specs) -> the outputs' specs`` (``tree_specs``
      is ``specs`` as a pytree shaped like ``tree``).
    replicated: further arguments, the same on every device (e.g. a key):
      arrays cannot be closed over by the inner map.

  Returns:
    ``fn``'s outputs as global arrays over the model axes.
  """
  tree_specs = jax.tree_util.tree_unflatten(treedef, specs)
  # check_vma=False: fn's results are the same on every rank of the data axis (they
  # decode the same bytes) and replicated leaves the same on every model rank, which
  # the varying-axes types cannot see (the buckets chain one result into the next
  # bucket's guard, so a replicated leaf's bucket would be typed as model-varying).
  rest = tuple(jax.tree.map(lambda _: P(), r) for r in replicated)
  return jax.shard_map(fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=(tree_specs,) + rest,
                       out_specs=out_specs(tree_specs), axis_names=frozenset(model_axes()),
                       check_vma=False)(tree, *replicated)
