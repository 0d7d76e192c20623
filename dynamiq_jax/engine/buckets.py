"""The bucket engine's bookkeeping: how a gradient pytree becomes buckets, and what they cost.

Written once for every reduction of the library (:func:`dynamiq_jax.allreduce`,
:func:`dynamiq_jax.reduce_scatter`, their hierarchical forms, ``simulate`` and
the wire accounting); :mod:`dynamiq_jax.engine.programs` reduces the buckets.

* **Layout** (:func:`bucket_layout`): the leaves in the order the backward pass
  produces them, end to end, cut into buckets of one size (the last padded with
  zeros), so that XLA compiles one program and one set of kernels for them all.
* **Packing** (:func:`pack`, :func:`unpack`): a bucket's pieces of leaves as
  one flat float32 vector, and back into leaves of their shapes and dtypes.
* **Checks** of what a user passes, each naming the value and the fix.
* **Accounting** (:func:`report`, :func:`scatter_report`, :func:`sum_stats`):
  exact bits and bytes on the wire, from static sizes, without tracing.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax._sizes import ceil_div, round_up
from dynamiq_jax.codecs.base import Codec
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.schedules.context import AxisContext, axis_names, varying_axes
from dynamiq_jax.schedules.plan import ring_bytes_per_rank

__all__ = [
    "DEFAULT_BUCKET_SIZE", "DEFAULT_MAX_BUCKETS", "MIN_BUCKETS", "SMALLEST_BUCKET_FRACTION",
    "ALIGN", "ALIGN_FROM", "AllReduceStats",
    "Segment", "PADDING", "Layout", "resolve_leaf_order", "bucket_layout", "pack_layout",
    "bucket_sizes", "layout_coords", "runtime_offsets", "pack", "unpack", "check_codec",
    "check_leaves", "check_varying", "flat_specs", "bucket_codec",
    "report", "scatter_report", "sum_stats", "error_total", "relative", "group_keys", "group_order",
    "key_data",
]

DEFAULT_BUCKET_SIZE = 1 << 25
"""The most coordinates in one bucket (128 MiB of float32; about 20 MiB on the wire at 5
bits per coordinate). Chosen by measurement and a step-time model: docs/design.md
(*Buckets and overlap*)."""

DEFAULT_MAX_BUCKETS = 32
"""The most buckets one all-reduce makes; larger gradients get larger buckets."""

MIN_BUCKETS = 8
"""A gradient is cut into at least this many buckets where each then holds
``bucket_size // SMALLEST_BUCKET_FRACTION`` coordinates or more (:func:`bucket_layout`)."""

SMALLEST_BUCKET_FRACTION = 4
"""A gradient too small for :data:`MIN_BUCKETS` such buckets is cut into the fewest equal
buckets of at most ``bucket_size // SMALLEST_BUCKET_FRACTION`` coordinates."""

ALIGN = 1 << 14
"""Buckets of :data:`ALIGN_FROM` coordinates or more are cut at multiples of this (and of
the codec's block): 64 blocks of 256, so that such a bucket splits into ``n`` equal chunks
of whole DynamiQ super-groups for every ``n`` dividing 64, and the codec pads nothing (a
padded bucket is a copy of it, and one launch more, in every step). The layout still does
not depend on ``n``."""

ALIGN_FROM = 1 << 22
"""The least bucket size cut at multiples of :data:`ALIGN`: its zeros then stay below 0.4%
of the bucket (smaller buckets are cut at the codec's block)."""


class AllReduceStats(NamedTuple):
  """What one all-reduce put on the wire, and what it leaves for the next.

  Attributes:
    bits_per_coord: total payload bits (metadata and padding included) per
      gradient coordinate: the paper's b. Each rank sends ``2 (n-1)/n`` of it.
    bytes_per_rank: bytes each rank sends in one all-reduce.
    coords: number of gradient coordinates reduced.
    codec_state: the codec's state after this call, one entry per bucket
      (None for stateless codecs); pass it back as ``codec_state=``.
    own: with ``return_own=True``, this rank's input as the codec represented
      it in the result (float32 tree, input units): ``input - own`` is the
      residual error feedback carries over.
    uncompressed: coordinates sent as bf16 partial sums because their bucket
      is too small for the codec to compress within its budget
      (:meth:`~dynamiq_jax.codecs.Codec.compresses`); they are counted in
      ``bits_per_coord``.
    error_estimate: the codecs' own estimate of the relative error this
      all-reduce added, ``E ||result - exact||^2 / ||result||^2`` over the
      whole tree (float32, identical on every rank), from the statistics the
      codec already has (:meth:`~dynamiq_jax.codecs.Codec.error_estimate`);
      0 for one rank, NaN where a codec makes no estimate. Comparable with
      the vNMSE of the benchmarks; watch it for a codec out of its depth.
  """

  bits_per_coord: Any
  bytes_per_rank: Any
  coords: Any
  codec_state: Any = None
  own: Any = None
  uncompressed: Any = 0
  error_estimate: Any = 0.0


class Segment(NamedTuple):
  """Coordinates ``[start, stop)`` of leaf ``leaf`` (its row-major flattening); with
  ``leaf == PADDING``, ``stop - start`` zeros that end the last bucket."""

  leaf: int
  start: int
  stop: int


PADDING = -1
"""The ``leaf`` of a :class:`Segment` of zeros: the padding that gives the last bucket the
size of the buckets before it (one shape, one compiled program)."""


Layout = tuple  # tuple[tuple[Segment, ...], ...]: the segments of each bucket, in bucket order


def resolve_leaf_order(num: int, leaf_order) -> tuple[int, ...]:
  """``leaf_order`` (None, ``"reverse"``, ``"forward"`` or a permutation) as a permutation of
  ``range(num)``, the leaf produced first first; a ValueError naming the fix otherwise."""
  if leaf_order is None or (isinstance(leaf_order, str) and leaf_order == "reverse"):
    return tuple(range(num - 1, -1, -1))
  if isinstance(leaf_order, str) and leaf_order == "forward":
    return tuple(range(num))
  fix = (f"Fix: pass a permutation of range({num}) (indices into jax.tree.leaves(grads), the "
         f"leaf whose gradient the backward pass produces first comes first), or 'reverse' "
         f"(the default: backward runs the layers in reverse) or 'forward'")
  if isinstance(leaf_order, str):
    raise ValueError(f"leaf_order={leaf_order!r} is not a leaf order. {fix}")
  try:
    order = tuple(int(i) for i in leaf_order)
  except TypeError:
    raise ValueError(f"leaf_order={leaf_order!r} is not a sequence of leaf indices. {fix}"
                     ) from None
  if sorted(order) != list(range(num)):
    raise ValueError(f"leaf_order={leaf_order!r} does not name each of the tree's {num} "
                     f"leaves exactly once. {fix}")
  return order


def bucket_layout(tree, *, codec=None, bucket_size: int = DEFAULT_BUCKET_SIZE,
                  max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None) -> Layout:
  """How :func:`dynamiq_jax.allreduce` cuts ``tree`` into buckets.

  Leaves are taken in ``leaf_order`` (default: reverse leaf order, the order
  the backward pass produces them) and laid end to end, and that sequence is
  cut into equal buckets (a multiple of the codec's block; from
  :data:`ALIGN_FROM` coordinates on, of :data:`ALIGN`, so that DynamiQ splits a
  large bucket into ``n`` chunks of whole super-groups with no copy for every
  ``n`` dividing 64): the fewest of at most a quarter of ``bucket_size``
  (:data:`SMALLEST_BUCKET_FRACTION`) where those are at most
  :data:`MIN_BUCKETS`, otherwise :data:`MIN_BUCKETS` of them, or the fewest of
  at most ``bucket_size`` where those are more. So the wire starts after the
  first eighth of a large gradient (as PyTorch DDP's first bucket is small),
  and every bucket is the same program: a bucket of another size would compile
  every kernel again (about 5 CPU s of a deviceless H100 compile). The last bucket is
  padded with zeros (a :class:`Segment` of leaf :data:`PADDING`, less than one
  block per bucket) to the size of the others. A leaf may
  so end in one bucket and go on in the next, and a large leaf spans several.
  Empty leaves take no place. Where the cut makes more than ``max_buckets``
  buckets, the bucket size grows (in multiples of the codec's block) until it
  does not.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``).
    codec: the codec; ``bucket_size`` must be a multiple of its
      ``granularity`` (so that every bucket holds whole blocks).
    bucket_size: the most coordinates in one bucket.
    max_buckets: the most buckets (None: no limit).
    leaf_order: ``None`` or ``"reverse"``, ``"forward"``, or a permutation of
      ``range(len(jax.tree.leaves(tree)))`` (the first leaf produced first).

  Returns:
    One tuple of :class:`Segment` per bucket, buckets in the order they are
    reduced (bucket ``b`` keys its random streams by ``b``).

  Examples:
    >>> import jax, dynamiq_jax as dq
    >>> tree = {"a": jax.ShapeDtypeStruct((300,), "float32"),
    ...         "b": jax.ShapeDtypeStruct((600,), "float32")}
    >>> [[tuple(s) for s in b] for b in dq.bucket_layout(tree, bucket_size=1024)]
    [[(1, 0, 225)], [(1, 225, 450)], [(1, 450, 600), (0, 0, 75)], [(0, 75, 300)]]
  """
  unit = 1 if codec is None else codec.granularity
  if codec is not None:
    check_codec(codec)
  if not isinstance(bucket_size, (int, np.integer)) or bucket_size < 1 or bucket_size % unit:
    name = "" if codec is None else f" for {type(codec).__name__}"
    fixed = (max(unit, bucket_size - bucket_size % unit)
             if isinstance(bucket_size, (int, np.integer)) else DEFAULT_BUCKET_SIZE)
    raise ValueError(
        f"{bucket_size=} must be a positive multiple of {unit}{name} (a large leaf is cut "
        f"into bucket-sized pieces, which must hold whole blocks); e.g. bucket_size={fixed}")
  if max_buckets is not None and (not isinstance(max_buckets, (int, np.integer))
                                  or max_buckets < 1):
    raise ValueError(f"{max_buckets=} must be a positive integer (or None: no limit)")
  sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree)]
  order = resolve_leaf_order(len(sizes), leaf_order)
  layout = pack_layout(sizes, order, int(bucket_size), unit)
  while max_buckets is not None and len(layout) > max_buckets:
    bucket_size = round_up(ceil_div(bucket_size * len(layout), max_buckets), unit)
    layout = pack_layout(sizes, order, bucket_size, unit)
  return layout


def pack_layout(sizes, order, bucket_size: int, unit: int) -> Layout:
  """The leaves in ``order``, end to end, cut into buckets (see :func:`bucket_layout`)."""
  total = sum(sizes[leaf] for leaf in order)
  if total == 0:
    return ()
  least = max(unit, bucket_size // SMALLEST_BUCKET_FRACTION)
  shapes = _equal_cut(total, bucket_size, unit, count=min(MIN_BUCKETS, ceil_div(total, least)))
  buckets, current, fill = [], [], 0
  bounds = iter(np.cumsum(shapes).tolist())
  end = next(bounds)
  for leaf in order:
    start, size = 0, sizes[leaf]
    while start < size:
      take = min(size - start, end - fill)
      current.append(Segment(leaf, start, start + take))
      fill, start = fill + take, start + take
      if fill == end:
        buckets.append(tuple(current))
        current, end = [], next(bounds, None)
  if current:  # the last bucket, short of its size: zeros to its end
    buckets.append((*current, Segment(PADDING, 0, end - fill)))
  return tuple(buckets)


def _step(size: int, unit: int) -> int:
  """What a bucket of ``size`` coordinates is a multiple of: ``unit`` (the codec's block),
  and :data:`ALIGN` too from :data:`ALIGN_FROM` coordinates on."""
  return int(np.lcm(unit, ALIGN)) if size >= ALIGN_FROM else unit


def _equal_cut(total: int, most: int, unit: int, count: int = 1) -> list[int]:
  """The fewest bucket sizes, at least ``count``, of at most ``most`` coordinates that hold
  ``total``, all equal (a multiple of ``unit``, and of :data:`ALIGN` where :func:`_step`
  says); their sum passes ``total`` by less than one step per bucket (the last bucket's
  padding). One bucket is ``total`` itself where it is not that large."""
  if total <= most and count <= 1:
    whole = round_up(total, _step(total, unit))
    return [whole if total >= ALIGN_FROM and whole <= most else total]
  count = max(count, ceil_div(total, most))
  while True:  # (a count more where rounding up to the step passes ``most``)
    size = ceil_div(total, count)
    size = round_up(size, _step(size, unit))
    if size <= most or size <= unit:
      return [size] * ceil_div(total, size)
    count += 1


def bucket_sizes(layout: Layout) -> list[int]:
  """Each bucket's size, its padding included: what its codec reduces."""
  return [sum(s.stop - s.start for s in segs) for segs in layout]


def layout_coords(layout: Layout) -> int:
  """The gradient's coordinates in ``layout``: its buckets' sizes without the padding."""
  return sum(s.stop - s.start for segs in layout for s in segs if s.leaf != PADDING)


def runtime_offsets(values):
  """``values`` (ints) as int32 scalars XLA cannot fold: each one passes an
  ``optimization_barrier``, so a slice at that offset is a ``dynamic-slice`` whose start
  is its fusion's parameter. Two slices of the same shapes at different offsets are
  then the same fusion, one kernel XLA compiles once; at constant offsets every
  slice is a kernel of its own (a 1.3 B model's leaves cut from 32 buckets: ~130)."""
  values = tuple(jnp.int32(v) for v in values)
  return jax.lax.optimization_barrier(values) if values else ()


def _cut(flat, start, size: int, whole: int):
  """``flat[start:start + size]`` (``start`` from :func:`runtime_offsets`); ``flat`` itself
  where the piece is all of it (``whole``: its length)."""
  return flat if size == whole else jax.lax.dynamic_slice_in_dim(flat, start, size)


def pack(arrays, segs, n_divide: int | None):
  """One bucket's coordinates as one float32 vector (divided by ``n_divide`` if given),
  zeros where the bucket is padding. Each leaf's piece is cut at a runtime offset (:func:`runtime_offsets`)."""
  starts = runtime_offsets([s.start for s in segs])
  parts = [jnp.zeros((s.stop - s.start,), jnp.float32) if s.leaf == PADDING else
           _cut(arrays[s.leaf].reshape(-1), start, s.stop - s.start, arrays[s.leaf].size)
           .astype(jnp.float32) for s, start in zip(segs, starts)]
  x = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return x / np.float32(n_divide) if n_divide else x


def unpack(outs, layout: Layout, arrays, treedef, cast: bool = True):
  """Cuts each bucket's flat result back into leaves shaped like ``arrays``
  (their dtypes if ``cast``, float32 otherwise; the padding dropped), at runtime offsets
  (:func:`runtime_offsets`): a leaf of a given shape cut from a bucket of a given
  size is one kernel wherever it lies."""
  pieces = [[] for _ in arrays]
  for segs, out in zip(layout, outs):
    sizes = [s.stop - s.start for s in segs]
    offsets = runtime_offsets(np.cumsum([0] + sizes[:-1]).tolist())
    for s, size, offset in zip(segs, sizes, offsets):
      if s.leaf != PADDING:
        pieces[s.leaf].append(_cut(out, offset, size, out.shape[0]))
  leaves = []
  for a, ps in zip(arrays, pieces):
    if not ps:
      flat = jnp.zeros((0,), jnp.float32)
    else:
      flat = ps[0] if len(ps) == 1 else jnp.concatenate(ps)
    leaves.append(flat.reshape(a.shape).astype(a.dtype if cast else jnp.float32))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def check_codec(codec):
  if not isinstance(codec, Codec):
    raise TypeError(
        f"codec={codec!r} is not a dynamiq_jax codec: pass e.g. codecs.DynamiQ(bits=5), "
        f"or subclass dynamiq_jax.codecs.Codec (see its docstring for the contract)")


def check_leaves(tree):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  for path, leaf in leaves:
    dtype = jnp.result_type(leaf)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"leaf {jax.tree_util.keystr(path) or '<root>'} has dtype {dtype}: only "
          f"floating-point gradients can be all-reduced. Fix: leave integer/bool "
          f"state out of the gradient tree (e.g. optax.masked, or nnx.Param "
          f"filters), or cast it to a float dtype.")
  return leaves, treedef


def check_varying(leaves, ctx: AxisContext):
  if not ctx.invariant_gather:
    return
  want = set(axis_names(ctx.axis_name))
  for path, leaf in leaves:
    if not want <= varying_axes(leaf):
      raise ValueError(
          f"gradient leaf {jax.tree_util.keystr(path) or '<root>'} is not varying "
          f"over axis_name={ctx.axis_name!r}: under jax.shard_map(check_vma=True), "
          f"jax.grad of replicated (P()) parameters already summed the gradients "
          f"across ranks with a full-precision psum, so compressing them now only "
          f"wastes time. Fix: differentiate with respect to a per-rank copy, "
          f"`params = jax.lax.pcast(params, {ctx.axis_name!r}, to='varying')` "
          f"before jax.grad (dynamiq_jax.data_parallel_step does this), or run "
          f"the shard_map with check_vma=False.")


def flat_specs(specs, treedef):
  """``specs`` (a tree of ``PartitionSpec`` shaped like the gradient) as one per leaf."""
  if specs is None:
    return None
  try:
    return treedef.flatten_up_to(specs)
  except (ValueError, TypeError) as e:
    raise ValueError(
        f"specs= must be a pytree of PartitionSpecs shaped like the gradient tree "
        f"({treedef}); e.g. the parameters' jax.tree.map(lambda p: p.sharding.spec, "
        f"params). It does not match: {e}") from None


def bucket_codec(codec, d: int, n: int):
  """``codec``, or bf16 partial sums for a bucket too small for it to compress."""
  return codec if codec.compresses(d, n) else Bf16()


def report(sizes, codec, n: int, coords: int | None = None) -> AllReduceStats:
  """Wire accounting of buckets of ``sizes`` coordinates over ``n`` ranks, per coordinate
  of the gradient (``coords``, default ``sum(sizes)``; fewer where buckets are padded)."""
  total = sum(sizes) if coords is None else coords
  if total == 0:
    return AllReduceStats(0.0, 0.0, 0)
  if n == 1:  # nothing crosses a wire: the all-reduce is the identity
    return AllReduceStats(0.0, 0.0, total)
  bits = plain = 0
  for d in sizes:
    used = bucket_codec(codec, d, n)
    bits += used.wire_bits(d, n)
    plain += d if used is not codec else 0
  return AllReduceStats(bits / total, ring_bytes_per_rank(bits / 8, n), total, uncompressed=plain)


def scatter_report(sizes, codec, n: int, coords: int | None = None) -> AllReduceStats:
  """Wire accounting of reduce-scattered buckets of ``sizes`` coordinates (all ranks), per
  coordinate of the gradient (``coords``, default ``sum(sizes)``)."""
  total = sum(sizes) if coords is None else coords
  if total == 0:
    return AllReduceStats(0.0, 0.0, 0)
  if n == 1:
    return AllReduceStats(0.0, 0.0, total)
  bits = sent = plain = 0
  for d in sizes:
    used = bucket_codec(codec, d, n)
    wire, meta = used.wire_bits(d, n), used.metadata_bits(d, n)
    bits += wire
    sent += (wire - meta) * (n - 1) / n + meta * 2 * (n - 1) / n
    plain += d if used is not codec else 0
  return AllReduceStats(bits / total, sent / 8, total, uncompressed=plain)


def sum_stats(parts) -> AllReduceStats:
  """The wire accounting of several reductions as one (error estimate: the first's if
  there is one part, else NaN: the callers that can weigh the parts set it)."""
  coords = sum(p.coords for p in parts)
  bits = sum(jnp.float32(p.bits_per_coord) * jnp.float32(p.coords) for p in parts)
  err = parts[0].error_estimate if len(parts) == 1 else jnp.float32(jnp.nan)
  return AllReduceStats(
      jnp.float32(bits / jnp.maximum(jnp.float32(coords), 1.0)),
      jnp.float32(sum(jnp.float32(p.bytes_per_rank) for p in parts)), jnp.int32(coords),
      uncompressed=jnp.int32(sum(p.uncompressed for p in parts)),
      error_estimate=jnp.float32(err))


def error_total(errs):
  """The buckets' estimated squared errors, each a float32 scalar or an array of terms
  (:meth:`~dynamiq_jax.codecs.Codec.error_estimate`), summed in two operations for the
  whole gradient rather than one per bucket: the terms joined, then one reduction (the
  barrier keeps XLA from rewriting the sum of the joined terms as one sum per bucket)."""
  terms = jnp.concatenate([jnp.ravel(jnp.asarray(e, jnp.float32)) for e in errs])
  return jnp.sum(jax.lax.optimization_barrier(terms))


def relative(err, ref):
  """``err / ref``, 0 where both are 0 (a zero gradient reduced exactly)."""
  return jnp.where(ref > 0, err / jnp.where(ref > 0, ref, 1.0),
                   jnp.where(err > 0, jnp.inf, err * 0.0)).astype(jnp.float32)


def group_keys(key, count: int) -> tuple:
  """One key per sharding group (:func:`sharding_groups`) as raw words: ``key`` itself for
  one group (the same bytes as on unsharded leaves), else ``fold_in(key, group)``."""
  if count == 1:
    return (key_data(key),)
  return tuple(key_data(jax.random.fold_in(key, g)) for g in range(count))


def group_order(leaf_order, idx: list[int], num: int):
  """``leaf_order`` (over all ``num`` leaves) restricted to the leaves ``idx``, renumbered."""
  if leaf_order is None or isinstance(leaf_order, str):
    return leaf_order
  pos = {i: j for j, i in enumerate(idx)}
  return [pos[i] for i in resolve_leaf_order(num, leaf_order) if i in pos]


def key_data(key):
  """A key as raw uint32 words (what :meth:`Keys.from_key` takes), to pass into a map."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  return jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
