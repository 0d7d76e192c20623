"""``allreduce``: a compressed multi-hop all-reduce of a gradient pytree.

Call it inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap`` over
``axis_name``. The leaves (any float dtypes, any shapes) are grouped into
buckets of whole leaves in the order the backward pass produces them (the
reverse of the pytree's leaf order, unless ``leaf_order`` says otherwise;
:func:`bucket_layout`), a leaf larger than a bucket cut into bucket-sized
pieces. Each bucket is all-reduced by the codec on the schedule on its own:
its guard, metadata pass, payload ring and finish depend only on its own
leaves, so the all-reduce of the last layers' gradients can start while the
backward pass still computes the first layers'. The results are cut back
into leaves of the original shapes and dtypes. Every rank ends with
bit-identical values.

One bucket, in order (:func:`_guard`, then :func:`_codec_pass`):

0. the guard: one small all-reduce (max) agreeing on non-finite values and
   on a power-of-two scale; it also carries a value of the previous
   bucket's result, so the buckets' collectives run one bucket after
   another, never merged by the compiler (:func:`_one_after_another`);
1. ``codec.metadata(x)``: this rank's metadata, combined across ranks here
   (an exact ``pmax``, or a sum on the schedule with the codec the metadata
   names), so every rank holds the same global metadata;
2. ``codec.plan(x, metadata)``: the local data cut into n chunks;
3. :func:`dynamiq_jax.schedules.execute`: the payload pass, calling the
   codec's hop functions (``encode``, ``decode_add_encode``, ...) at each hop;
4. ``codec.finish(decoded)``: the flat result and the codec's next state.

All reductions, including the codec's metadata sums, run on the library's
schedule executor, whose summation order is fixed by the plan; so results do
not depend on how the backend implements ``psum`` (XLA CPU, NCCL, gloo)
or on whether the code runs under ``shard_map``, ``pmap`` or ``vmap``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dynamiq_jax._sizes import ceil_div, round_up
from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.schedules import hierarchical
from dynamiq_jax.schedules.context import AxisContext, axis_context, axis_names, varying_axes
from dynamiq_jax.schedules.executor import HopOps, execute
from dynamiq_jax.schedules.local import local_specs, model_axes, run_on_local_shards
from dynamiq_jax.schedules.local import sharding_groups
from dynamiq_jax.schedules.plan import TreePlan, get_plan, ring_bytes_per_rank

__all__ = [
    "allreduce", "AllReduceStats", "wire_stats", "init_codec_state", "bucket_layout", "Segment",
    "DEFAULT_BUCKET_SIZE", "DEFAULT_MAX_BUCKETS", "HIERARCHICAL",
]

HIERARCHICAL = hierarchical.HIERARCHICAL

DEFAULT_BUCKET_SIZE = 1 << 25
"""The most coordinates in one bucket (128 MiB of float32; about 20 MiB on the wire at 5
bits per coordinate). Chosen by measurement and a step-time model: docs/design.md
(*Buckets and overlap*)."""

DEFAULT_MAX_BUCKETS = 32
"""The most buckets one all-reduce makes; larger gradients get larger buckets."""

FIRST_BUCKET_FRACTION = 4
"""The first bucket holds at most ``bucket_size // FIRST_BUCKET_FRACTION`` coordinates."""


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


def _check_leaves(tree):
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


def _check_varying(leaves, ctx: AxisContext):
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


class Segment(NamedTuple):
  """Coordinates ``[start, stop)`` of leaf ``leaf`` (its row-major flattening)."""

  leaf: int
  start: int
  stop: int


Layout = tuple  # tuple[tuple[Segment, ...], ...]: the segments of each bucket, in bucket order


def _leaf_order(num: int, leaf_order) -> tuple[int, ...]:
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
  """How :func:`allreduce` cuts ``tree`` into buckets.

  Leaves are taken in ``leaf_order`` (default: reverse leaf order, the order
  the backward pass produces them) and packed greedily into buckets of at
  most ``bucket_size`` coordinates, the first of at most a quarter of that
  (:data:`FIRST_BUCKET_FRACTION`; as PyTorch DDP's first bucket, so that the
  wire starts early in the backward pass): a leaf that does not fit in the
  open bucket starts the next one; a leaf larger than an empty bucket is cut
  into pieces of the bucket's size, each a bucket of its own, and its
  remainder packs like a leaf. Empty leaves take no place. Where that makes
  more than ``max_buckets`` buckets, the bucket size grows (in multiples of
  the codec's block) until it does not: each bucket is compiled on its own,
  so compile time grows with their number.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``).
    codec: the codec; ``bucket_size`` must be a multiple of its
      ``granularity`` (so a cut leaf's pieces hold whole blocks).
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
    >>> [[tuple(s) for s in b] for b in dq.bucket_layout(tree, bucket_size=512)]
    [[(1, 0, 128)], [(1, 128, 600)], [(0, 0, 300)]]
  """
  unit = 1 if codec is None else codec.granularity
  if codec is not None:
    _check_codec(codec)
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
  order = _leaf_order(len(sizes), leaf_order)
  layout = _pack(sizes, order, int(bucket_size), unit)
  while max_buckets is not None and len(layout) > max_buckets:
    bucket_size = round_up(ceil_div(bucket_size * len(layout), max_buckets), unit)
    layout = _pack(sizes, order, bucket_size, unit)
  return layout


def _pack(sizes, order, bucket_size: int, unit: int) -> Layout:
  """Whole leaves in ``order`` into buckets (see :func:`bucket_layout`)."""
  first = max(unit, bucket_size // FIRST_BUCKET_FRACTION // unit * unit)
  buckets, current, fill = [], [], 0
  for leaf in order:
    start, size = 0, sizes[leaf]
    while start < size:
      capacity = first if not buckets else bucket_size
      if size - start <= capacity - fill:  # the leaf (or what is left of it) fits
        current.append(Segment(leaf, start, size))
        fill, start = fill + size - start, size
      elif current:  # it does not: the next bucket
        buckets.append(tuple(current))
        current, fill = [], 0
      else:  # larger than an empty bucket: a piece of its own
        buckets.append((Segment(leaf, start, start + capacity),))
        start += capacity
  if current:
    buckets.append(tuple(current))
  return tuple(buckets)


def _bucket_sizes(layout: Layout) -> list[int]:
  return [sum(s.stop - s.start for s in segs) for segs in layout]


def _bucket_input(arrays, segs, n_divide: int | None):
  """One bucket's coordinates as one float32 vector (divided by ``n_divide`` if given)."""
  parts = [arrays[s.leaf].reshape(-1)[s.start:s.stop].astype(jnp.float32) for s in segs]
  x = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
  return x / np.float32(n_divide) if n_divide else x


def _assemble(outs, layout: Layout, arrays, treedef, cast: bool = True):
  """Cuts each bucket's flat result back into leaves shaped like ``arrays``
  (their dtypes if ``cast``, float32 otherwise)."""
  pieces = [[] for _ in arrays]
  for segs, out in zip(layout, outs):
    offset = 0
    for s in segs:
      pieces[s.leaf].append(out[offset:offset + s.stop - s.start])
      offset += s.stop - s.start
  leaves = []
  for a, ps in zip(arrays, pieces):
    if not ps:
      flat = jnp.zeros((0,), jnp.float32)
    else:
      flat = ps[0] if len(ps) == 1 else jnp.concatenate(ps)
    leaves.append(flat.reshape(a.shape).astype(a.dtype if cast else jnp.float32))
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_codec(codec):
  if not isinstance(codec, Codec):
    raise TypeError(
        f"codec={codec!r} is not a dynamiq_jax codec: pass e.g. codecs.DynamiQ(bits=5), "
        f"or subclass dynamiq_jax.codecs.Codec (see its docstring for the contract)")


def _report(sizes, codec, n: int) -> AllReduceStats:
  """Wire accounting of buckets of ``sizes`` coordinates over ``n`` ranks."""
  total = sum(sizes)
  if total == 0:
    return AllReduceStats(0.0, 0.0, 0)
  if n == 1:  # nothing crosses a wire: the all-reduce is the identity
    return AllReduceStats(0.0, 0.0, total)
  bits = plain = 0
  for d in sizes:
    used = _bucket_codec(codec, d, n)
    bits += used.wire_bits(d, n)
    plain += d if used is not codec else 0
  return AllReduceStats(bits / total, ring_bytes_per_rank(bits / 8, n), total, uncompressed=plain)


def wire_stats(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
               max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None
               ) -> AllReduceStats:
  """Exact wire accounting of ``allreduce(tree, codec=codec)`` over ``n`` ranks.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``).
    codec: the codec.
    n: number of ranks.
    bucket_size, max_buckets, leaf_order: as passed to :func:`allreduce`.

  Returns:
    :class:`AllReduceStats` of Python numbers.
  """
  layout = bucket_layout(tree, codec=codec, bucket_size=bucket_size, max_buckets=max_buckets,
                         leaf_order=leaf_order)
  return _report(_bucket_sizes(layout), codec, n)


def _bucket_codec(codec, d: int, n: int):
  """``codec``, or bf16 partial sums for a bucket too small for it to compress."""
  return codec if codec.compresses(d, n) else Bf16()


def init_codec_state(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                     max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None):
  """The codec's initial state for ``allreduce(tree)`` over ``n`` ranks (None if stateless).

  One entry per bucket of :func:`bucket_layout`. Its structure and shapes do
  not depend on ``n``; only its values do.
  """
  _check_codec(codec)
  layout = bucket_layout(tree, codec=codec, bucket_size=bucket_size, max_buckets=max_buckets,
                         leaf_order=leaf_order)
  if not codec.stateful or not layout:
    return None
  return tuple(codec.init_state(d, n) for d in _bucket_sizes(layout))


def allreduce(tree, *, axis_name, codec, schedule: str = "ring", key,
              average: bool = True, bucket_size: int = DEFAULT_BUCKET_SIZE,
              max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None,
              implementation: str | None = None, codec_state=None,
              return_own: bool = False, specs=None):
  """Compressed all-reduce of a gradient pytree over ``axis_name``.

  Inside a ``jax.shard_map`` that is manual over ``axis_name`` only and
  leaves other mesh axes (tensor, FSDP) to the compiler, each device reduces
  its own shard of every leaf over ``axis_name``: nothing is gathered over
  the other axes, and the results keep the leaves' shardings
  (:mod:`dynamiq_jax.schedules.local`).

  Args:
    tree: pytree of floating arrays (f32/bf16/f16, any shapes, scalars),
      this rank's gradients. Under ``shard_map(check_vma=True)`` they must be
      varying over ``axis_name``.
    axis_name: the data-parallel axis (bound by shard_map, pmap or vmap);
      ``(slow, fast)`` for ``schedule="hierarchical"``.
    codec: e.g. ``codecs.DynamiQ(bits=5)`` or ``codecs.Bf16()``.
    schedule: ``"ring"``, ``"butterfly"`` (power-of-two axes) or
      ``"hierarchical"``.
    key: a ``jax.random`` key, identical on every rank (it seeds the shared
      rounding streams); fold the training step into it.
    average: return the mean over ranks (workers pre-divide by n) instead of
      the sum.
    bucket_size: the most coordinates in one bucket, a multiple of the
      codec's block (``codec.granularity``, 256 for DynamiQ). Buckets are
      made of whole leaves (:func:`bucket_layout`) and reduced one after
      another, each on its own, so XLA can overlap one bucket's all-reduce
      with the backward pass of the layers before it.
    max_buckets: the most buckets (None: no limit); a gradient that would
      need more gets larger buckets, bounding compile time.
    leaf_order: the order the backward pass produces the leaves, which is
      the order buckets fill: ``None``/``"reverse"`` (reverse leaf order),
      ``"forward"``, or a permutation of leaf indices.
    implementation: ``None`` (Pallas kernels on GPU: Triton's, or Mosaic GPU's
      where they lower once ``pallas_kernels.dispatch.MOSAIC_FIRST`` is on; the
      jnp reference elsewhere),
      ``"pallas"`` (Triton kernels; interpreted off GPU), ``"mosaic"`` (Mosaic GPU
      kernels, DynamiQ only) or ``"xla"``. All give bit-identical results.
    codec_state: the state of a stateful codec from the previous call
      (``stats.codec_state``); None starts from :func:`init_codec_state`.
    return_own: also return this rank's contribution as represented
      (``stats.own``), for error feedback.
    specs: the leaves' ``PartitionSpec`` over the mesh (a pytree shaped like
      ``tree``, e.g. the parameters' specs), needed where the other mesh axes
      are ``AxisType.Auto``; with Explicit axes the leaves' types say it.
      Axes that are already manual are ignored.

  Returns:
    ``(tree, stats)``: the reduced pytree (same structure, shapes and dtypes;
    bit-identical on every rank) and :class:`AllReduceStats`. Each rank sends
    ``stats.bytes_per_rank`` bytes: per hop one chunk payload, i.e.
    ``wire_bits / n`` bits, for ``2 (n - 1)`` hops. With leaves sharded
    over other mesh axes, the stats count one device's shards.

  Raises:
    ValueError: unbound ``axis_name``; gradients already reduced by XLA
      (not varying over the axis); a budget the codec cannot meet; a bad
      ``bucket_size`` or ``leaf_order``; leaves on Auto mesh axes without
      ``specs``; a stateful codec with leaves sharded over other axes.
    TypeError: a non-floating leaf (the message names its path).

  Examples:
    >>> import jax, jax.numpy as jnp, dynamiq_jax as dq
    >>> g = jnp.arange(4 * 1024, dtype=jnp.float32).reshape(4, 1024)
    >>> f = lambda x: dq.allreduce(x, axis_name="i", codec=dq.codecs.F32(),
    ...                            key=jax.random.key(0))[0]
    >>> out = jax.vmap(f, axis_name="i")(g)
    >>> bool(jnp.allclose(out[0], g.mean(0)))
    True
  """
  _check_codec(codec)
  hier = schedule in HIERARCHICAL
  if hier:
    _hierarchical_axes(axis_name, codec, codec_state, return_own)
  if return_own and not codec.reports_contribution:
    raise ValueError(
        f"{type(codec).__name__} cannot report a rank's own contribution "
        f"(reports_contribution=False), which error feedback needs; use a codec that "
        f"does, or error_feedback=False")
  leaves, treedef = _check_leaves(tree)
  ctx = axis_context(tuple(axis_names(axis_name)) if hier else axis_name)
  _check_varying(leaves, ctx)
  local = local_specs(leaves, _flat_specs(specs, treedef), what="allreduce")
  reduce_local = functools.partial(
      _allreduce_local, axis_name=axis_name, codec=codec, schedule=schedule,
      average=average, bucket_size=bucket_size, max_buckets=max_buckets, leaf_order=leaf_order,
      implementation=implementation, codec_state=codec_state, return_own=return_own)
  if local is None:
    out, stats, err, ref = reduce_local(tree, key=key)
    return out, stats._replace(error_estimate=err if ref is None else _relative(err, ref))
  _check_sharded_codec(codec, codec_state)

  groups = sharding_groups(local)

  def body(local_tree, *keys):  # on this device's shards: manual over the model axes too
    flat = treedef.flatten_up_to(local_tree)
    outs, owns, parts, err_sum, ref_sum = [None] * len(flat), [None] * len(flat), [], 0.0, 0.0
    for (sharded_over, idx), k in zip(groups, keys):
      out, stats, err, ref = reduce_local([flat[i] for i in idx], key=k,
                                          leaf_order=_group_order(leaf_order, idx, len(flat)))
      for j, i in enumerate(idx):
        outs[i] = out[j]
        owns[i] = stats.own[j] if return_own else None
      if ref is not None:  # each coordinate counted once: summed over its shards only
        if sharded_over:
          err, ref = jax.lax.psum((err, ref), sharded_over)
        err_sum, ref_sum = err_sum + err, ref_sum + ref
      parts.append(stats._replace(own=None, codec_state=None))
    stats = _sum_stats(parts)._replace(error_estimate=_relative(jnp.float32(err_sum),
                                                                jnp.float32(ref_sum)))
    return (jax.tree_util.tree_unflatten(treedef, outs),
            jax.tree_util.tree_unflatten(treedef, owns) if return_own else None, stats)

  def out_specs(tree_specs):
    return tree_specs, tree_specs if return_own else None, AllReduceStats(
        P(), P(), P(), codec_state=None, own=None, uncompressed=P(), error_estimate=P())

  keys = _group_keys(key, len(groups))
  out, own, stats = run_on_local_shards(body, tree, local, treedef, out_specs=out_specs,
                                       replicated=keys)
  return out, stats._replace(own=own)


def _group_keys(key, count: int) -> tuple:
  """One key per sharding group (:func:`sharding_groups`) as raw words: ``key`` itself for
  one group (the same bytes as on unsharded leaves), else ``fold_in(key, group)``."""
  if count == 1:
    return (_key_data(key),)
  return tuple(_key_data(jax.random.fold_in(key, g)) for g in range(count))


def _group_order(leaf_order, idx: list[int], num: int):
  """``leaf_order`` (over all ``num`` leaves) restricted to the leaves ``idx``, renumbered."""
  if leaf_order is None or isinstance(leaf_order, str):
    return leaf_order
  pos = {i: j for j, i in enumerate(idx)}
  return [pos[i] for i in _leaf_order(num, leaf_order) if i in pos]


def _sum_stats(parts) -> AllReduceStats:
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


def _key_data(key):
  """A key as raw uint32 words (what :meth:`Keys.from_key` takes), to pass into a map."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  return jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def _flat_specs(specs, treedef):
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


def _check_sharded_codec(codec, codec_state):
  if codec.stateful or codec_state is not None:
    raise ValueError(
        f"{codec!r} keeps state from one all-reduce to the next, which leaves sharded over "
        f"the model axes {model_axes()} would make differ between model ranks; it is not "
        f"supported there. Fix: use a stateless codec (DynamiQ, MX(scale='e8m0'), Bf16, ...), or "
        f"make the shard_map manual over every mesh axis")


def _allreduce_local(tree, *, axis_name, codec, schedule, key, average, bucket_size,
                     max_buckets, leaf_order, implementation, codec_state, return_own):
  """:func:`allreduce` of local arrays -> ``(tree, stats, err, ref)``: the estimated
  squared error and the squared norm of the result, or ``(estimate, None)`` where the
  estimate is final (one rank, or an empty tree)."""
  hier = schedule in HIERARCHICAL
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [jnp.asarray(leaf) for leaf in leaves]
  layout = bucket_layout(tree, codec=codec, bucket_size=bucket_size, max_buckets=max_buckets,
                         leaf_order=leaf_order)
  if not layout:
    return tree, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(0)), jnp.float32(0), None
  if hier:
    slow, fast = axis_names(axis_name)
    ctx = axis_context((slow, fast))
    divide = ctx.n if average else None
    return _hierarchical(arrays, treedef, layout, codec=codec, inner=HIERARCHICAL[schedule],
                         slow=slow, fast=fast, key=key, divide=divide,
                         implementation=implementation)
  ctx = axis_context(axis_name)
  divide = ctx.n if average else None
  sizes = _bucket_sizes(layout)
  states = codec_state
  if states is None:
    states = init_codec_state(tree, codec=codec, n=ctx.n, bucket_size=bucket_size,
                              max_buckets=max_buckets, leaf_order=leaf_order)
  states = states if states is not None else (None,) * len(layout)
  if len(states) != len(layout):
    raise ValueError(
        f"codec_state holds {len(states)} buckets, the tree needs {len(layout)} (with "
        f"bucket_size={bucket_size}, max_buckets={max_buckets}, leaf_order={leaf_order!r}): "
        f"pass the state that the previous call with the same tree and bucketing returned")
  xs = [_bucket_input(arrays, segs, divide) for segs in layout]
  outs, new_states, owns, err = _reduce_buckets(
      xs, ctx=ctx, codec=codec, schedule=schedule, key=key, implementation=implementation,
      states=states, return_own=return_own)
  report = _report(sizes, codec, ctx.n)
  stats = AllReduceStats(
      jnp.float32(report.bits_per_coord), jnp.float32(report.bytes_per_rank),
      jnp.int32(report.coords), codec_state=tuple(new_states) if codec.stateful else None,
      uncompressed=jnp.int32(report.uncompressed))
  own = None
  if return_own:
    owns = [o * np.float32(ctx.n) for o in owns] if average else owns
    own = _assemble(owns, layout, arrays, treedef, cast=False)
  stats = stats._replace(own=own)
  if ctx.n == 1:
    return _assemble(outs, layout, arrays, treedef), stats, jnp.float32(0), None
  return (_assemble(outs, layout, arrays, treedef), stats, err,
          sum(jnp.sum(o * o) for o in outs))


def _one_after_another(xs, reduce_one):
  """``[reduce_one(b, x, after) for b, x in enumerate(xs)]``: each bucket's collectives
  after the previous bucket's.

  ``reduce_one(b, x, after)`` returns a tuple whose first element is bucket
  b's result; ``after`` is one element of bucket b-1's result (None for the
  first), which bucket b's first collective (its guard) carries along: so
  bucket b's all-reduce starts once bucket b-1's has finished, and XLA
  cannot combine collectives of different buckets. Its combiners would
  otherwise merge, say, every bucket's guard into one all-reduce that waits
  for the whole gradient, and no bucket would start before the backward
  pass ends.
  """
  results = []
  for b, x in enumerate(xs):
    after = results[-1][0].reshape(-1)[0] if results else None
    with jax.named_scope(f"allreduce/bucket{b}"):
      results.append(reduce_one(b, x, after))
  return results


def _reduce_buckets(xs, *, ctx: AxisContext, codec, schedule, key, implementation, states,
                    return_own):
  """All-reduces each bucket's flat float32 vector on its own -> (outs, new states, owns,
  summed estimated squared error)."""
  if ctx.n == 1:  # one rank: the mean is the input, bit for bit, whatever the codec
    get_plan(schedule, 1)  # still validates the schedule's name
    return list(xs), list(states), list(xs), jnp.float32(0)
  plan = get_plan(schedule, ctx.n)

  def reduce_one(b, x, after):
    d = x.shape[0]
    used = _bucket_codec(codec, d, ctx.n)
    with jax.named_scope("guard"):
      nonfinite, x, scale = _guard(x, ctx, after)
    out, new_state, own, err = _codec_pass(
        x, used, Bucket(b, d, ctx.n, implementation), states[b],
        Keys.from_key(key, bucket=b, rank=ctx.rank()), plan, ctx, return_own)
    own = own / scale if return_own else None
    return (_unguard(out, nonfinite, scale), states[b] if used is not codec else new_state,
            own, err / (scale * scale))

  outs, new_states, owns, errs = zip(*_one_after_another(xs, reduce_one))
  return list(outs), list(new_states), list(owns), sum(errs)


def _relative(err, ref):
  """``err / ref``, 0 where both are 0 (a zero gradient reduced exactly)."""
  return jnp.where(ref > 0, err / jnp.where(ref > 0, ref, 1.0),
                   jnp.where(err > 0, jnp.inf, err * 0.0)).astype(jnp.float32)


def _hop_ops(codec: Codec, aux, keys: Keys) -> HopOps:
  """The codec's hop functions with this bucket's ``aux`` and keys bound: what the
  executor calls at each hop (it passes the chunk index and the step)."""

  def encode(chunk, c, hop):
    return codec.encode(chunk, aux, keys.at(c, hop))

  def decode(payload):
    return codec.decode(payload, aux)

  def decode_add_encode(payload, chunk, c, hop):
    return codec.decode_add_encode(payload, chunk, aux, keys.at(c, hop))

  def decode_add(payload, chunk):
    return codec.decode_add(payload, chunk, aux)

  return HopOps(encode, decode, decode_add_encode, decode_add)


def _combine(meta, ctx: AxisContext, plan: TreePlan, keys: Keys):
  """Pass 1: every rank's metadata combined, identical on every rank."""
  if meta.combine == "max":
    return ctx.pmax(meta.local)
  if isinstance(meta.combine, Codec):
    return execute(plan, ctx, meta.local, _hop_ops(meta.combine, None, keys))
  raise ValueError(f"Metadata.combine={meta.combine!r} must be 'max' or a Codec")


SAFE_EXPONENT = 64
"""Buckets whose largest magnitude reaches 2^64 are scaled down by a power of two
(exactly) before the codec sees them, so that no codec's partial sums, centred
residuals or rounding products can overflow float32 on finite inputs."""


def _guard(x, ctx: AxisContext, after=None):
  """Every rank's agreement on one bucket -> (any rank non-finite, guarded x, scale).

  One small all-reduce (max) of finite numbers per bucket, so it behaves the
  same on every backend (no reliance on how a backend's max treats NaN): a
  value that is NaN or infinite on any rank makes the whole bucket NaN on
  every rank (:func:`_unguard`; the codec itself sees zeros there, so its
  state stays finite), and finite inputs reach the codec scaled below
  :data:`SAFE_EXPONENT` exactly (the scale is a power of two, 1 for usual
  gradients). ``after``, a value of the previous bucket's result, rides
  along as a finite flag: see :func:`_one_after_another`.
  """
  finite = jnp.isfinite(x)
  votes = [jnp.max(jnp.where(finite, jnp.abs(x), 0.0)), jnp.any(~finite).astype(jnp.float32)]
  if after is not None:
    votes.append(jnp.isfinite(after).astype(jnp.float32))
  agreed = ctx.pmax(jnp.stack(votes))
  amax, bad = agreed[0], agreed[1]
  _, e = jnp.frexp(amax)  # amax < 2^e
  scale = jnp.ldexp(jnp.float32(1), jnp.minimum(SAFE_EXPONENT - e, 0))  # 1 unless huge
  return bad > 0, jnp.where(finite, x, 0.0) * scale, scale


def _unguard(out, nonfinite, scale):
  """The codec's result in input units, NaN where :func:`_guard` found a non-finite value."""
  return jnp.where(nonfinite, jnp.float32(jnp.nan), out / scale)


def _codec_pass(x, codec: Codec, bucket: Bucket, state, keys: Keys, plan: TreePlan,
                ctx: AxisContext, return_own: bool):
  """One guarded bucket through the codec: metadata pass, payload pass, finish -> (out, new
  state, own, estimated squared error: NaN where the codec makes no estimate)."""
  meta = codec.metadata(x, bucket, state)
  if meta is not None:
    with jax.named_scope("metadata"):
      meta = _combine(meta, ctx, plan, keys)
  p = codec.plan(x, meta, bucket, state, keys)
  decoded = execute(plan, ctx, p.chunks, _hop_ops(codec, p.aux, keys))
  out, new_state = codec.finish(decoded, p.aux, bucket, state)
  err = codec.error_estimate(out, p.aux, bucket, plan.partials())
  err = jnp.float32(jnp.nan) if err is None else err
  own = codec.contribution(x, p.aux, bucket) if return_own else None
  return out, new_state, own, err


def _hierarchical_axes(axis_name, codec, codec_state, return_own):
  """``(slow, fast)`` of ``schedule="hierarchical"``, or a ValueError saying the fix."""
  names = axis_names(axis_name)
  if len(names) != 2 or isinstance(axis_name, str):
    raise ValueError(
        f"schedule='hierarchical' needs axis_name=(slow, fast), e.g. ('host', 'local') for a "
        f"2-axis mesh; got axis_name={axis_name!r}. Fix: pass both mesh axes, slow first, or "
        f"use schedule='ring' for one axis")
  if return_own or codec_state is not None or codec.stateful:
    raise ValueError(
        f"schedule='hierarchical' supports stateless codecs without error feedback; "
        f"{codec!r} keeps state (or error feedback was asked for). Fix: use a flat schedule "
        f"('ring' or 'butterfly') over axis_name={tuple(names)!r} for this codec")
  return names


def _hierarchical(arrays, treedef, layout: Layout, *, codec, inner, slow, fast, key, divide,
                  implementation):
  """``schedule="hierarchical"`` (see :mod:`dynamiq_jax.schedules.hierarchical`), bucket by
  bucket: the fast axis reduce-scatters the bucket exactly, every fast rank all-reduces
  its share of it with ``codec`` over the slow axis, and the fast axis all-gathers it."""
  fast_ctx, slow_ctx, both_ctx = axis_context(fast), axis_context(slow), axis_context((slow, fast))
  unit = codec.granularity
  plan = get_plan(inner, slow_ctx.n)
  key = jax.random.fold_in(key, jax.lax.axis_index(fast))  # fresh rounding per fast rank

  def reduce_one(b, x, after):
    with jax.named_scope("guard"):  # over both axes: the fast reduce-scatter is guarded too
      nonfinite, x, scale = _guard(x, both_ctx, after)
    with jax.named_scope("fast_reduce_scatter"):  # this rank owns share (r + 1) % size
      owned = hierarchical.reduce_scatter_shares(
          fast_ctx, hierarchical.split_shares(x, fast_ctx.n, unit))
    m = owned.shape[0]
    reduced, err = owned, jnp.float32(0)
    if slow_ctx.n > 1:
      reduced, _, _, err = _codec_pass(
          owned, _bucket_codec(codec, m, slow_ctx.n), Bucket(b, m, slow_ctx.n, implementation),
          None, Keys.from_key(key, bucket=b, rank=slow_ctx.rank()), plan, slow_ctx, False)
    with jax.named_scope("fast_all_gather"):
      out = hierarchical.join_shares(hierarchical.all_gather_shares(fast_ctx, reduced),
                                     x.shape[0], unit)
    unit_sq = scale * scale
    return (_unguard(out, nonfinite, scale), err / unit_sq, jnp.sum(reduced * reduced) / unit_sq,
            m)

  xs = [_bucket_input(arrays, segs, divide) for segs in layout]
  outs, errs, refs, shares = zip(*_one_after_another(xs, reduce_one))
  # each fast rank's shares have their own estimate: weigh them by the shares' norms
  err, ref = fast_ctx.psum((sum(errs), sum(refs)))
  # the slow axis's cost: every fast rank sends its shares at the codec's bits per
  # coordinate (the exact float32 traffic inside the fast axis is not counted)
  report = _report(shares, codec, slow_ctx.n)
  stats = AllReduceStats(
      jnp.float32(report.bits_per_coord), jnp.float32(report.bytes_per_rank),
      jnp.int32(sum(x.shape[0] for x in xs)), uncompressed=jnp.int32(report.uncompressed))
  out = _assemble(outs, layout, arrays, treedef)
  return (out, stats, jnp.float32(0), None) if slow_ctx.n == 1 else (out, stats, err, ref)
