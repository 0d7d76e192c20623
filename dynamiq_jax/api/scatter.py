"""``reduce_scatter``: the compressed reduce-scatter of a gradient pytree.

A sharded optimizer (ZeRO-1/2, FSDP over the data axis, HSDP) needs on each
rank only its shard of the mean gradient: the reduce half of the all-reduce's
schedule, ``(n - 1) / n`` of the bucket per rank instead of ``2 (n - 1) / n``.
Rank r ends with slice r of every leaf along its ``scatter_dimension``, as
``jax.lax.psum_scatter(x, axis_name, scatter_dimension=k, tiled=True) / n``
gives it.

How a bucket is made: each scattered leaf is cut into its n rank slices
(slice r: ``leaf`` split into n along dimension k, row-major), the slices
of the bucket's leaves are laid side by side per rank, each rank's row padded
to whole codec blocks, and row r is put where the schedule's reduce phase
leaves the chunk that rank r owns. The codec cuts such a bucket at the rows
(:attr:`~dynamiq_jax.codecs.Codec.supports_scatter`; DynamiQ then ranks each
chunk's super-groups on their own, with this round's widths shared by
position, so every chunk still gets the same code budget). Then, as in
:func:`dynamiq_jax.allreduce`: the guard, the metadata pass (a full
all-reduce of the small metadata), the reduce phase with compressed hops,
and the owner keeps the decoded sum of its chunk (no last re-encode, no
gather phase) and finishes it alone.

``schedule="hierarchical"`` with ``axis_name=(slow, fast)`` is HSDP: each
leaf is scattered over the fast axis only; the fast axis reduce-scatters the
float32 bucket exactly (the ring of
:func:`~dynamiq_jax.schedules.hierarchical.reduce_scatter_shares`), each fast
rank all-reduces its own slice with the codec over the slow axis, and there
is no all-gather back inside the fast axis.

Leaves with ``scatter_dimension`` None are all-reduced whole
(:func:`dynamiq_jax.allreduce`, in buckets of their own), e.g. biases too
small to shard.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.engine import programs as engine
from dynamiq_jax._renamed import UNSET, renamed
from dynamiq_jax._sizes import round_up
from dynamiq_jax.api.allreduce import HIERARCHICAL
from dynamiq_jax.api.allreduce import allreduce_local
from dynamiq_jax.api.allreduce import hierarchical_share
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE
from dynamiq_jax.engine.buckets import DEFAULT_MAX_BUCKETS
from dynamiq_jax.engine.buckets import AllReduceStats
from dynamiq_jax.engine.buckets import bucket_sizes
from dynamiq_jax.engine.buckets import check_leaves
from dynamiq_jax.engine.buckets import check_varying
from dynamiq_jax.engine.buckets import flat_specs
from dynamiq_jax.engine.buckets import layout_coords
from dynamiq_jax.engine.buckets import relative
from dynamiq_jax.engine.buckets import PADDING
from dynamiq_jax.engine.buckets import report
from dynamiq_jax.engine.buckets import resolve_leaf_order
from dynamiq_jax.engine.buckets import scatter_report
from dynamiq_jax.engine.buckets import sum_stats
from dynamiq_jax.codec_names import resolve_codec
from dynamiq_jax.engine.options import Bucketing, ReduceOptions
from dynamiq_jax.schedules.context import axis_context, axis_names
from dynamiq_jax.schedules.names import SCATTER_SCHEDULES, check_schedule
from dynamiq_jax.schedules.local import local_specs

__all__ = ["reduce_scatter", "run_reduce_scatter", "scatter_dimensions", "scatter_wire_stats"]

WHOLE_LEAVES_STREAM = 0x5CA7
"""Folded into the key of the leaves all-reduced whole, so that their buckets' random
streams differ from the scattered buckets' with the same index."""


def reduce_scatter(tree, *, axis_name, codec, key=None, seed: int = 0,
                   scatter_dimension: Any = 0, schedule: str = "ring", average: bool = True,
                   bucket_size: int = DEFAULT_BUCKET_SIZE,
                   max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None,
                   implementation: str | None = None, return_own: bool = False, specs=None,
                   packet_loss=None, loss=UNSET):
  """Compressed reduce-scatter of a gradient pytree over ``axis_name``.

  Args:
    tree: pytree of floating arrays, this rank's (full) gradients.
    axis_name: the data-parallel axis (bound by shard_map, pmap or vmap);
      ``(slow, fast)`` for ``schedule="hierarchical"`` (HSDP: the leaves are
      scattered over ``fast`` and all-reduced over ``slow``).
    codec: a codec with ``supports_scatter`` (DynamiQ, MX, Bf16, F32,
      GlobalQSGD; THC's rotation and OmniReduce's packing mix chunks) and no
      state, or its name (as for :func:`dynamiq_jax.allreduce`).
    key: a ``jax.random`` key, identical on every rank; None:
      ``jax.random.key(seed)``.
    seed: the rounding key's seed where ``key`` is None (default 0), as for
      :func:`dynamiq_jax.allreduce`.
    scatter_dimension: the dimension of each leaf that is split over the
      axis: an int for every leaf, or a pytree (a prefix of ``tree``) of int
      or None; None all-reduces that leaf whole (every rank gets all of it).
      The dimension's size must be a multiple of the number of ranks it is
      split over (:func:`scatter_dimensions` picks such dimensions).
    schedule: ``"ring"``, ``"butterfly"``, ``"two_step"`` or ``"hierarchical"``.
    average: the mean over ranks (workers pre-divide by n) or the sum.
    bucket_size: the most coordinates in one bucket (all ranks' slices).
    max_buckets: the most buckets of scattered leaves (and as many again of
      whole ones).
    leaf_order: as for :func:`dynamiq_jax.allreduce`.
    implementation: as for :func:`dynamiq_jax.allreduce`.
    return_own: also return this rank's whole input as the codec represented
      it (``stats.own``, full leaves), for error feedback (flat schedules).
    specs: the leaves' ``PartitionSpec`` on the mesh, needed where other mesh
      axes are ``AxisType.Auto`` (:func:`dynamiq_jax.allreduce`). A leaf's
      scattered dimension must not be sharded over another mesh axis.
    packet_loss: a :class:`~dynamiq_jax.PacketLoss` (``schedule="two_step"``): the
      payload packets lost on their way to each slice's owner, who estimates
      its slice of the sum from those that arrived, as :func:`dynamiq_jax.allreduce`.
    loss: the old name of ``packet_loss`` (deprecated, with a ``DeprecationWarning``).

  Returns:
    ``(tree, stats)``: each scattered leaf replaced by this rank's slice of the
    mean (or sum), each other leaf by the whole mean; and
    :class:`~dynamiq_jax.AllReduceStats`: ``bits_per_coord`` is the codec's
    (as for an all-reduce), ``bytes_per_rank`` what each rank sends: per
    scattered bucket ``(n - 1) / n`` of its payload plus the metadata's
    all-reduce (HSDP: what the slow axis carries for a rank's slice);
    ``error_estimate`` is NaN where a leaf was scattered (no estimate is made
    for a reduce-scatter), else the all-reduce's (over every model shard).

  Raises:
    ValueError: a codec that cannot reduce-scatter, or keeps state; a
      dimension that does not divide; a schedule that is not one of
      :data:`~dynamiq_jax.schedules.names.SCATTER_SCHEDULES`; the checks of
      :func:`dynamiq_jax.allreduce`.

  Examples:
    >>> import jax, jax.numpy as jnp, dynamiq_jax as dq
    >>> g = jnp.arange(4 * 8 * 256, dtype=jnp.float32).reshape(4, 8, 256)
    >>> f = lambda x: dq.reduce_scatter(x, axis_name="i", codec=dq.codecs.F32(),
    ...                                 key=jax.random.key(0))[0]
    >>> out = jax.vmap(f, axis_name="i")(g)  # rank r: rows 2r, 2r + 1 of the mean
    >>> out.shape, bool(jnp.allclose(out.reshape(8, 256), g.mean(0)))
    ((4, 2, 256), True)

  References:
    ZeRO++ (Wang et al., 2023) quantises the same collective, hierarchically (qgZ).
  """
  loss = renamed(packet_loss, loss, new="packet_loss", old="loss", where="reduce_scatter")
  opts = ReduceOptions.build(
      "reduce_scatter", codec=codec, axis_name=axis_name, schedule=schedule,
      average=average, bucket_size=bucket_size, max_buckets=max_buckets,
      leaf_order=leaf_order, implementation=implementation, return_own=return_own,
      loss=loss, scatter=True)
  return run_reduce_scatter(tree, opts, key=jax.random.key(seed) if key is None else key,
                            scatter_dimension=scatter_dimension, specs=specs)


def run_reduce_scatter(tree, opts: ReduceOptions, *, key, scatter_dimension: Any = 0,
                       specs=None):
  """:func:`reduce_scatter` with its options built (:class:`ReduceOptions`, once, by the
  caller) -> ``(tree, stats)``."""
  names = axis_names(opts.axis_name)
  leaves, treedef = check_leaves(tree)
  ctx = axis_context(tuple(names) if opts.hierarchical else opts.axis_name)
  check_varying(leaves, ctx)
  n = axis_context(names[1]).n if opts.hierarchical else ctx.n
  dims = _dims(scatter_dimension, leaves, treedef, n)
  local = local_specs(leaves, flat_specs(specs, treedef), what="reduce_scatter")
  run = functools.partial(_reduce_scatter_local, opts=opts)
  if local is None:
    out, stats, _, _ = run(tree, dims=dims, key=key, leaf_order=opts.buckets.leaf_order)
    return out, stats
  for (path, _), spec, dim in zip(leaves, local, dims):
    if dim is not None and dim < len(spec) and spec[dim] is not None:
      raise ValueError(
          f"leaf {jax.tree_util.keystr(path)} is sharded over {spec[dim]!r} on dimension "
          f"{dim}, the dimension it would be scattered on: the slices would not line up with "
          f"the mesh. Fix: scatter it on another dimension (scatter_dimension=), or shard it "
          f"over that axis on another one")

  return engine.run_sharded(
      lambda leaves, idx, **kw: run(leaves, dims=[dims[i] for i in idx], **kw), tree, treedef,
      local, key, leaf_order=opts.buckets.leaf_order, return_own=opts.return_own,
      no_estimate=float("nan"),
      scattered=any(d is not None for d in dims))


def _dims(scatter_dimension, leaves, treedef, n: int) -> list:
  """One int or None per leaf, checked against the leaves' (local) shapes."""
  if scatter_dimension is None or isinstance(scatter_dimension, (int, np.integer)):
    dims = [scatter_dimension] * len(leaves)
  else:
    try:
      dims = treedef.flatten_up_to(scatter_dimension)
    except (ValueError, TypeError) as e:
      raise ValueError(f"scatter_dimension must be an int, None, or a pytree shaped like the "
                       f"gradient (a prefix of it) of int or None: {e}") from None
  out = []
  for (path, leaf), dim in zip(leaves, dims):
    shape = np.shape(leaf)
    name = jax.tree_util.keystr(path) or "<root>"
    if dim is None:
      out.append(None)
      continue
    if not isinstance(dim, (int, np.integer)) or not -len(shape) <= dim < len(shape):
      raise ValueError(f"scatter_dimension={dim!r} of leaf {name} (shape {shape}) is not one "
                       f"of its dimensions; pass an index in [0, {len(shape)}) or None (all-"
                       f"reduce the leaf whole)")
    dim = int(dim) % len(shape)
    if shape[dim] % n:
      raise ValueError(
          f"leaf {name} has shape {shape}: dimension {dim} ({shape[dim]}) cannot be split "
          f"over {n} ranks. Fix: scatter another dimension, pass None for this leaf (it is "
          f"then all-reduced whole), or pick the dimensions with "
          f"dq.scatter_dimensions(tree, n={n})")
    out.append(dim)
  return out


def scatter_dimensions(tree, *, n: int, specs=None, min_size: int = 0):
  """For each leaf, a dimension that splits over ``n`` ranks, or None.

  The largest dimension whose size is a multiple of ``n`` and that ``specs``
  (optional, the leaves' ``PartitionSpec``) does not shard over another
  mesh axis, ties to the first; None for leaves with fewer than ``min_size``
  coordinates or no such dimension (they are all-reduced whole).

  Args:
    tree: the parameters or gradients (arrays or ``jax.ShapeDtypeStruct``).
    n: the number of ranks to split over.
    specs: optional pytree of ``PartitionSpec`` shaped like ``tree``.
    min_size: leaves smaller than this stay whole.

  Returns:
    A pytree shaped like ``tree`` of int or None (``scatter_dimension=``).

  Examples:
    >>> import jax, dynamiq_jax as dq
    >>> dq.scatter_dimensions({"w": jax.ShapeDtypeStruct((6, 16), "float32"),
    ...                        "b": jax.ShapeDtypeStruct((3,), "float32")}, n=4)
    {'b': None, 'w': 1}
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  spec_list = [None] * len(leaves) if specs is None else treedef.flatten_up_to(specs)
  out = []
  for leaf, spec in zip(leaves, spec_list):
    shape = tuple(np.shape(leaf))
    taken = {i for i, e in enumerate(tuple(spec or ())) if e is not None}
    fits = [i for i, s in enumerate(shape) if s % n == 0 and s > 0 and i not in taken]
    if not fits or int(np.prod(shape)) < min_size:
      out.append(None)
    else:
      out.append(max(fits, key=lambda i: (shape[i], -i)))
  return jax.tree_util.tree_unflatten(treedef, out)


def _rank_rows(a, dim: int, n: int):
  """leaf -> float32 [n, size / n]: row r is slice r along ``dim``, row-major."""
  shape = a.shape
  split = shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:]
  return jnp.moveaxis(a.astype(jnp.float32).reshape(split), dim, 0).reshape(n, -1)


def _from_rank_rows(rows, shape, dim: int):
  """Inverse of :func:`_rank_rows`: [n, size / n] -> the leaf's shape."""
  n = rows.shape[0]
  moved = (n,) + shape[:dim] + (shape[dim] // n,) + shape[dim + 1:]
  return jnp.moveaxis(rows.reshape(moved), 0, dim).reshape(shape)


def _shard_shape(shape, dim: int, n: int):
  return shape[:dim] + (shape[dim] // n,) + shape[dim + 1:]


def _reduce_scatter_local(tree, *, opts: ReduceOptions, dims, key, leaf_order):
  """:func:`reduce_scatter` of local arrays -> ``(tree, stats, err, ref)``: ``err`` and
  ``ref`` the whole leaves' expected squared error and squared norm (None: no whole
  leaves, or no estimate from the codec), for a caller that weighs several groups."""
  codec, schedule, axis_name = opts.codec, opts.schedule, opts.axis_name
  average, return_own = opts.average, opts.return_own
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [jnp.asarray(a) for a in leaves]
  hier = opts.hierarchical
  names = axis_names(axis_name)
  ctx = axis_context(tuple(names) if hier else axis_name)
  scat_ctx = axis_context(names[1]) if hier else ctx
  n = scat_ctx.n
  unit = codec.granularity
  order = resolve_leaf_order(len(arrays), leaf_order)
  scat = [i for i in order if dims[i] is not None]
  whole = [i for i in order if dims[i] is None]
  outs: list = [None] * len(arrays)
  owns: list = [None] * len(arrays)
  parts = []  # AllReduceStats of the two groups

  if scat:
    rows_of = {i: _rank_rows(arrays[i], dims[i], n) for i in scat}
    pieces = [jax.ShapeDtypeStruct((rows_of[i].shape[1],), jnp.float32) for i in scat]
    layout = opts.buckets.rows(pieces, n)
    buckets, widths = [], []
    for segs in layout:
      cols = [jnp.zeros((n, s.stop - s.start), jnp.float32) if s.leaf == PADDING
              else rows_of[scat[s.leaf]][:, s.start:s.stop] for s in segs]
      rows = cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)
      width = rows.shape[1]
      rows = jnp.pad(rows, ((0, 0), (0, round_up(width, unit) - width)))
      buckets.append(rows / np.float32(ctx.n) if average else rows)
      widths.append(width)
    if hier:  # HSDP: no all-gather back; fresh rounding per fast rank
      program = engine.Hierarchical(codec, HIERARCHICAL[schedule], names[0], names[1],
                                    opts.implementation, gather=False)
      bucket_key = jax.random.fold_in(key, jax.lax.axis_index(names[1]))
    else:
      program = opts.program(engine.ReduceScatter)
      bucket_key = key
    results = engine.reduce_buckets(buckets, program, key=bucket_key)
    mine = {i: [] for i in scat}
    own_rows = {i: [] for i in scat}
    for segs, width, result in zip(layout, widths, results):
      piece, own = result.out, result.own
      off = 0
      for s in segs:
        if s.leaf == PADDING:
          continue
        i = scat[s.leaf]
        mine[i].append(piece[off:off + s.stop - s.start])
        if return_own:
          own_rows[i].append(own[:, off:off + s.stop - s.start])
        off += s.stop - s.start
    for i in scat:
      flat = mine[i][0] if len(mine[i]) == 1 else jnp.concatenate(mine[i])
      outs[i] = flat.reshape(_shard_shape(arrays[i].shape, dims[i], n)).astype(arrays[i].dtype)
      if return_own:
        rows = own_rows[i][0] if len(own_rows[i]) == 1 else jnp.concatenate(own_rows[i], axis=1)
        rows = rows * np.float32(ctx.n) if average else rows
        owns[i] = _from_rank_rows(rows, arrays[i].shape, dims[i])
    parts.append(_scattered_report([rows.shape[1] for rows in buckets], codec, n, hier,
                                   ctx.n // n, sum(int(np.prod(arrays[i].shape)) for i in scat)))

  err = ref = None
  if whole:
    sub = [arrays[i] for i in whole]
    out, stats, err, ref = allreduce_local(
        sub, opts, key=jax.random.fold_in(key, WHOLE_LEAVES_STREAM), leaf_order="forward")
    for j, i in enumerate(whole):
      outs[i] = out[j]
      if return_own:
        owns[i] = stats.own[j]
    parts.append(stats._replace(error_estimate=err if ref is None else relative(err, ref),
                                own=None))

  return jax.tree_util.tree_unflatten(treedef, outs), sum_stats(parts)._replace(
      own=jax.tree_util.tree_unflatten(treedef, owns) if return_own else None), err, ref


def _scattered_report(widths, codec, n: int, hier: bool, slow: int, coords: int
                      ) -> AllReduceStats:
  """Wire accounting of the scattered buckets, each ``widths[b]`` (padded) coordinates per
  rank: ``bits_per_coord`` per real coordinate; HSDP counts the slow axis only."""
  if hier:  # each fast rank all-reduces its slices over the slow axis
    rep = report(widths, codec, slow)
    real = coords / n
  else:
    rep = scatter_report([w * n for w in widths], codec, n)
    real = coords
  total = float(rep.bits_per_coord) * rep.coords
  return rep._replace(bits_per_coord=total / real if real else 0.0, coords=coords,
                      error_estimate=float("nan"))


def scatter_wire_stats(tree, *, codec, n: int, scatter_dimension: Any = 0,
                       schedule: str = "ring", slow: int = 1,
                       bucket_size: int = DEFAULT_BUCKET_SIZE,
                       max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None
                       ) -> AllReduceStats:
  """Exact wire accounting of :func:`reduce_scatter` of ``tree``, outside of tracing.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``), one rank's.
    codec: the codec, or its name.
    n: ranks the leaves are scattered over (the fast axis's size for
      ``schedule="hierarchical"``).
    scatter_dimension: as for :func:`reduce_scatter`.
    schedule: ``"ring"``, ``"butterfly"`` or ``"hierarchical"``.
    slow: the slow axis's size (``schedule="hierarchical"``).
    bucket_size, max_buckets, leaf_order: as for :func:`reduce_scatter`.

  Returns:
    :class:`~dynamiq_jax.AllReduceStats` of Python numbers (``error_estimate``
    NaN where leaves are scattered).
  """
  codec = resolve_codec(codec, what="scatter_wire_stats")
  check_schedule(schedule, SCATTER_SCHEDULES, what="scatter_wire_stats")
  buckets = Bucketing.build(codec, bucket_size, max_buckets)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  dims = _dims(scatter_dimension, [((), a) for a in leaves], treedef, n)
  order = resolve_leaf_order(len(leaves), leaf_order)
  hier = schedule in HIERARCHICAL
  unit = codec.granularity
  parts = []
  scat = [i for i in order if dims[i] is not None]
  whole = [i for i in order if dims[i] is None]
  if scat:
    pieces = [jax.ShapeDtypeStruct((int(np.prod(np.shape(leaves[i]))) // n,), jnp.float32)
              for i in scat]
    layout = buckets.rows(pieces, n)
    sizes = [round_up(sum(s.stop - s.start for s in segs), unit) for segs in layout]
    parts.append(_scattered_report(sizes, codec, n, hier, slow,
                                   sum(int(np.prod(np.shape(leaves[i]))) for i in scat)))
  if whole:  # all-reduced whole, in the same buckets as the scattered rows' options
    lay = buckets.layout([leaves[i] for i in whole], leaf_order="forward")
    if hier:
      shares = [hierarchical_share(d, codec, n) for d in bucket_sizes(lay)]
      parts.append(report(shares, codec, slow)._replace(coords=layout_coords(lay),
                                                        error_estimate=0.0))
    else:
      parts.append(report(bucket_sizes(lay), codec, n, coords=layout_coords(lay)))
  if not parts:
    return AllReduceStats(0.0, 0.0, 0)
  coords = sum(p.coords for p in parts)
  return AllReduceStats(
      sum(p.bits_per_coord * p.coords for p in parts) / max(coords, 1),
      sum(p.bytes_per_rank for p in parts), coords,
      uncompressed=sum(p.uncompressed for p in parts),
      error_estimate=parts[0].error_estimate if len(parts) == 1 else float("nan"))
