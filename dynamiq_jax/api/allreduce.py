"""``allreduce``: a compressed multi-hop all-reduce of a gradient pytree.

Call it inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap`` over
``axis_name``. The leaves (any float dtypes, any shapes), in the order the
backward pass produces them (the reverse of the pytree's leaf order, unless
``leaf_order`` says otherwise), are laid end to end and cut into buckets of
equal size (:func:`~dynamiq_jax.engine.buckets.bucket_layout`). Each bucket is
all-reduced by the codec on the schedule on its own
(:class:`dynamiq_jax.engine.programs.AllReduce`): its guard, metadata pass, payload
ring and finish depend only on its own data, so the all-reduce of the last
layers' gradients can start while the backward pass still computes the
first layers'. The results are cut back into leaves of the original shapes
and dtypes. Every rank ends with bit-identical values.

All reductions, including the codec's metadata sums, run in an order the
library fixes (the schedule's plan, or a fixed order of the ranks), so
results do not depend on how the backend implements ``psum`` (XLA CPU, NCCL,
gloo) or on whether the code runs under ``shard_map``, ``pmap`` or ``vmap``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.engine import programs as engine
from dynamiq_jax.engine import moshpit
from dynamiq_jax.engine import stacked as loops
from dynamiq_jax._renamed import UNSET, renamed
from dynamiq_jax._sizes import ceil_div
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE
from dynamiq_jax.engine.buckets import DEFAULT_MAX_BUCKETS
from dynamiq_jax.engine.buckets import AllReduceStats
from dynamiq_jax.engine.buckets import Segment
from dynamiq_jax.engine.buckets import bucket_layout
from dynamiq_jax.engine.buckets import bucket_sizes
from dynamiq_jax.engine.buckets import check_leaves
from dynamiq_jax.engine.buckets import check_varying
from dynamiq_jax.engine.buckets import error_total
from dynamiq_jax.engine.buckets import flat_specs
from dynamiq_jax.engine.buckets import layout_coords
from dynamiq_jax.engine.buckets import pack
from dynamiq_jax.engine.buckets import relative
from dynamiq_jax.engine.buckets import resolve_leaf_order
from dynamiq_jax.engine.buckets import report
from dynamiq_jax.engine.buckets import unpack
from dynamiq_jax.codec_names import resolve_codec
from dynamiq_jax.engine.options import Bucketing, ReduceOptions
from dynamiq_jax.schedules import hierarchical
from dynamiq_jax.schedules.context import axis_context, axis_names
from dynamiq_jax.schedules.local import local_specs, model_axes
from dynamiq_jax.schedules.moshpit import as_moshpit, is_moshpit
from dynamiq_jax.schedules.names import SCHEDULES, check_schedule

__all__ = [
    "allreduce", "run_allreduce", "allreduce_local", "AllReduceStats", "wire_stats",
    "init_codec_state", "layout_states", "bucket_layout", "Segment", "DEFAULT_BUCKET_SIZE",
    "DEFAULT_MAX_BUCKETS", "HIERARCHICAL", "hierarchical_share",
]

HIERARCHICAL = hierarchical.HIERARCHICAL


def wire_stats(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
               max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None, stacked=None,
               schedule="ring") -> AllReduceStats:
  """Exact wire accounting of ``allreduce(tree, codec=codec)`` over ``n`` ranks.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``).
    codec: the codec, or its name (as for :func:`allreduce`).
    n: number of ranks.
    bucket_size, max_buckets, leaf_order, stacked: as passed to :func:`allreduce`.
    schedule: as passed to :func:`allreduce`; only Moshpit averaging's accounting
      differs from the ring's (every round an all-reduce within groups).

  Returns:
    :class:`AllReduceStats` of Python numbers.
  """
  codec = resolve_codec(codec, what="wire_stats")
  check_schedule(schedule, SCHEDULES, what="wire_stats")
  buckets = Bucketing.build(codec, bucket_size, max_buckets, leaf_order)
  flags = loops.stacked_flags(jax.tree_util.tree_flatten_with_path(tree)[0], stacked)
  if flags is not None:
    return loop_stats([np.shape(x) for x in jax.tree.leaves(tree)], flags, buckets, n)
  layout = buckets.layout(tree)
  if is_moshpit(schedule) and n > 1:
    return moshpit.moshpit_report(bucket_sizes(layout), codec, as_moshpit(schedule).plan(n),
                                  coords=layout_coords(layout))
  return report(bucket_sizes(layout), codec, n, coords=layout_coords(layout))


def init_codec_state(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE,
                     max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None):
  """The codec's initial state for ``allreduce(tree)`` over ``n`` ranks (None if stateless).

  One entry per bucket of :func:`bucket_layout`. Its structure and shapes do
  not depend on ``n``; only its values do.
  """
  codec = resolve_codec(codec, what="init_codec_state")
  layout = Bucketing.build(codec, bucket_size, max_buckets, leaf_order).layout(tree)
  return layout_states(codec, layout, n)


def layout_states(codec, layout, n: int):
  """The codec's initial state of each bucket of ``layout`` over ``n`` ranks (None if
  stateless)."""
  if not codec.stateful or not layout:
    return None
  return tuple(codec.init_state(d, n) for d in bucket_sizes(layout))


def allreduce(tree, *, axis_name, codec, schedule: str = "ring", key=None, seed: int = 0,
              average: bool = True, bucket_size: int = DEFAULT_BUCKET_SIZE,
              max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None,
              implementation: str | None = None, codec_state=None,
              return_own: bool = False, specs=None, stacked=None, absent=None,
              packet_loss=None, loss=UNSET):
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
    codec: e.g. ``codecs.DynamiQ(bits=5)`` or ``codecs.Bf16()``, or a codec's name
      (``"dynamiq"``, ``"int8"``, ...: ``dq.codec_from_name``'s, as ``dq.reducer``).
    schedule: ``"ring"``, ``"butterfly"`` (power-of-two axes), ``"two_step"``
      (one all-to-all, each rank decoding and adding its chunk from every rank,
      one re-encode, one all-gather: every value encoded twice whatever n),
      ``"hierarchical"``, or Moshpit averaging: ``"moshpit"`` or
      ``dq.Moshpit(grid=..., rounds=..., dropout=..., shuffle=...)``
      (:mod:`dynamiq_jax.engine.moshpit`: rounds of group all-reduces on a virtual
      grid; stateless codecs, one axis; results differ between ranks where
      some were absent).
    key: a ``jax.random`` key, identical on every rank (it seeds the shared
      rounding streams); fold the training step into it. None:
      ``jax.random.key(seed)``.
    seed: the rounding key's seed where ``key`` is None (default 0), as
      ``compressed_psum(seed=)`` and ``simulate(seed=)``: the same call repeats
      the same rounding; pass ``key=`` to vary it from step to step.
    average: return the mean over ranks (workers pre-divide by n) instead of
      the sum.
    bucket_size: the coordinates of one bucket, a multiple of the codec's
      block (``codec.granularity``, 256 for DynamiQ). The leaves, end to
      end, are cut into buckets of this size (:func:`bucket_layout`), reduced
      one after another, each on its own, so XLA can overlap one bucket's
      all-reduce with the backward pass of the layers before it.
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
    stacked: for a model whose layers run under ``jax.lax.scan``, the leaves
      stacked along a leading axis of layers: the name of a pytree key
      (every leaf below it, e.g. ``"layers"``) or a callable ``(path, leaf)
      -> bool``. The gradient is then reduced in loops of equal buckets,
      stacked leaves layer by layer, then the others
      (:mod:`dynamiq_jax.engine.stacked`): XLA compiles the bucket program once
      instead of once per bucket, and nothing overlaps the backward
      pass (a scanned model's gradient arrives at once, at the end of its
      backward loop). ``bucket_size`` bounds a bucket; ``max_buckets`` and
      ``leaf_order`` are not used. Flat schedules and stateless codecs only.
    absent: Moshpit averaging only: bool ``[rounds, n]``, the same on every
      rank, True where rank r is absent from round t (simulated dropout,
      besides the schedule's own ``dropout``).
    packet_loss: ``schedule="two_step"`` only: a :class:`~dynamiq_jax.PacketLoss`, the
      reduce step's payload packets lost (simulated: XLA's collectives lose
      nothing) and each chunk's sum estimated without bias from those that
      arrived (:mod:`dynamiq_jax.schedules.loss`). The metadata pass, the guard
      and the gather step are not lossy (every rank keeps the same result: a
      rank that missed a packet of the reduced gradient would step its replica
      apart from the others; the sharded optimizer's parameter broadcast is
      where that loss is absorbed, ``data_parallel_step(packet_loss=...)``).
    loss: the old name of ``packet_loss`` (deprecated: a ``DeprecationWarning``;
      removed in the next release).

  Returns:
    ``(tree, stats)``: the reduced pytree (same structure, shapes and dtypes;
    bit-identical on every rank; a lossy codec's values rounded to bfloat16,
    its :attr:`~dynamiq_jax.codecs.Codec.result_dtype`, as ``psum`` of bf16
    gradients gives) and :class:`AllReduceStats`. Each rank sends
    ``stats.bytes_per_rank`` bytes: per hop one chunk payload, i.e.
    ``wire_bits / n`` bits, for ``2 (n - 1)`` hops. With leaves sharded
    over other mesh axes, the stats count one device's shards.

  Raises:
    ValueError: unbound ``axis_name``; an unknown codec name or schedule;
      gradients already reduced by XLA
      (not varying over the axis); a budget the codec cannot meet; a bad
      ``bucket_size`` or ``leaf_order``; leaves on Auto mesh axes without
      ``specs``; a stateful codec with leaves sharded over other axes, or
      with ``stacked``; ``stacked`` leaves without one common leading axis.
    TypeError: a non-floating leaf (the message names its path); a ``codec`` that
      is neither a codec nor a codec's name.

  Examples:
    >>> import jax, jax.numpy as jnp, dynamiq_jax as dq
    >>> g = jnp.arange(4 * 1024, dtype=jnp.float32).reshape(4, 1024)
    >>> f = lambda x: dq.allreduce(x, axis_name="i", codec=dq.codecs.F32(),
    ...                            key=jax.random.key(0))[0]
    >>> out = jax.vmap(f, axis_name="i")(g)
    >>> bool(jnp.allclose(out[0], g.mean(0)))
    True
  """
  loss = renamed(packet_loss, loss, new="packet_loss", old="loss", where="allreduce")
  opts = ReduceOptions.build(
      "allreduce", codec=codec, axis_name=axis_name, schedule=schedule, average=average,
      bucket_size=bucket_size, max_buckets=max_buckets, leaf_order=leaf_order,
      implementation=implementation, return_own=return_own, stacked=stacked, loss=loss)
  return run_allreduce(tree, opts, key=jax.random.key(seed) if key is None else key,
                       codec_state=codec_state, specs=specs, absent=absent)


def run_allreduce(tree, opts: ReduceOptions, *, key, codec_state=None, specs=None,
                  absent=None):
  """:func:`allreduce` with its options built (:class:`ReduceOptions`, once, by the caller:
  the transforms build theirs when they are made) -> ``(tree, stats)``."""
  opts.check_state(codec_state)
  if absent is not None and not opts.moshpit:
    raise ValueError(f"absent= is a mask of Moshpit averaging's rounds; "
                     f"schedule={opts.schedule!r} has none. Fix: schedule='moshpit' (or "
                     f"dq.Moshpit(...)), or absent=None")
  leaves, treedef = check_leaves(tree)
  flags = loops.stacked_flags(leaves, opts.stacked)
  ctx = axis_context(tuple(axis_names(opts.axis_name)) if opts.hierarchical
                     else opts.axis_name)
  check_varying(leaves, ctx)
  local = local_specs(leaves, flat_specs(specs, treedef), what="allreduce")
  if local is None:
    out, stats, err, ref = allreduce_local(tree, opts, key=key,
                                           leaf_order=opts.buckets.leaf_order,
                                           codec_state=codec_state, stacked=flags,
                                           absent=absent)
    return out, stats._replace(error_estimate=err if ref is None else relative(err, ref))
  _check_sharded_codec(opts.codec, codec_state)
  return engine.run_sharded(
      lambda leaves, idx, **kw: allreduce_local(
          leaves, opts, codec_state=codec_state, absent=absent,
          stacked=None if flags is None else [flags[i] for i in idx], **kw),
      tree, treedef, local, key, leaf_order=opts.buckets.leaf_order,
      return_own=opts.return_own,
      no_estimate=np.nan if opts.moshpit else 0.0)


def allreduce_local(tree, opts: ReduceOptions, *, key, leaf_order, codec_state=None,
                    stacked=None, absent=None):
  """:func:`allreduce` of local arrays -> ``(tree, stats, err, ref)``: the estimated
  squared error and the squared norm of the result, or ``(estimate, None)`` where the
  estimate is final (one rank, or an empty tree). ``leaf_order``: the options' (or, for
  a group of the leaves, theirs); ``stacked``: None, or which leaves are stacked (a flag
  per leaf): the loops of :mod:`dynamiq_jax.engine.stacked`."""
  codec = opts.codec
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  arrays = [jnp.asarray(leaf) for leaf in leaves]
  if stacked is not None:
    resolve_leaf_order(len(arrays), leaf_order)  # still validated
    return _looped(arrays, treedef, stacked, opts, key=key)
  layout = opts.buckets.layout(tree, leaf_order)
  if not layout:
    return tree, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(0)), jnp.float32(0), None
  if opts.hierarchical:
    return _hierarchical(arrays, treedef, layout, opts, key=key)
  if opts.moshpit:
    return _moshpit(arrays, treedef, layout, opts, key=key, absent=absent)
  ctx = axis_context(opts.axis_name)
  sizes = bucket_sizes(layout)
  states = codec_state
  if states is None:
    states = layout_states(codec, layout, ctx.n)
  states = states if states is not None else (None,) * len(layout)
  if len(states) != len(layout):
    b = opts.buckets
    raise ValueError(
        f"codec_state holds {len(states)} buckets, the tree needs {len(layout)} (with "
        f"bucket_size={b.bucket_size}, max_buckets={b.max_buckets}, "
        f"leaf_order={leaf_order!r}): "
        f"pass the state that the previous call with the same tree and bucketing returned")
  xs = [pack(arrays, segs, ctx.n if opts.average else None) for segs in layout]
  rep = report(sizes, codec, ctx.n, coords=layout_coords(layout))
  stats = AllReduceStats(
      jnp.float32(rep.bits_per_coord), jnp.float32(rep.bytes_per_rank), jnp.int32(rep.coords),
      uncompressed=jnp.int32(rep.uncompressed))
  if ctx.n == 1:  # one rank: the mean is the input, bit for bit, whatever the codec
    own = unpack(xs, layout, arrays, treedef, cast=False) if opts.return_own else None
    stats = stats._replace(codec_state=tuple(states) if codec.stateful else None, own=own)
    return unpack(xs, layout, arrays, treedef), stats, jnp.float32(0), None
  program = opts.program()
  program.plan(ctx.n)  # its size fits the schedule, before tracing any bucket
  results = engine.reduce_buckets(xs, program, key=key, states=states)
  outs = [r.out for r in results]
  own = None
  if opts.return_own:
    owns = [r.own * np.float32(ctx.n) if opts.average else r.own for r in results]
    own = unpack(owns, layout, arrays, treedef, cast=False)
  stats = stats._replace(own=own,
                         codec_state=tuple(r.state for r in results) if codec.stateful else None)
  return (unpack(outs, layout, arrays, treedef), stats, error_total(r.err for r in results),
          sum(jnp.sum(o * o) for o in outs))


def loop_stats(shapes, flags, buckets: Bucketing, n: int) -> AllReduceStats:
  """Exact wire accounting of :func:`allreduce` with ``stacked`` over ``n`` ranks: every
  bucket of the loops, padding included, per coordinate of the gradient."""
  sizes, coords = loops.loop_sizes(shapes, flags, buckets.loop_size(shapes, flags, n))
  if coords == 0:
    return AllReduceStats(0.0, 0.0, 0)
  rep = report(sizes, buckets.codec, n)
  return rep._replace(bits_per_coord=rep.bits_per_coord * sum(sizes) / coords, coords=coords)


def _looped(arrays, treedef, flags, opts: ReduceOptions, *, key):
  """:func:`allreduce_local` with ``stacked``: every group of leaves in loops
  (:mod:`dynamiq_jax.engine.stacked`)."""
  return_own = opts.return_own
  n = axis_context(opts.axis_name).n
  program = opts.program()
  program.plan(n)  # its size fits the schedule, before tracing any bucket
  shapes = [a.shape for a in arrays]
  rep = loop_stats(shapes, flags, opts.buckets, n)
  stats = AllReduceStats(jnp.float32(rep.bits_per_coord), jnp.float32(rep.bytes_per_rank),
                         jnp.int32(rep.coords), uncompressed=jnp.int32(rep.uncompressed))
  if n == 1 or rep.coords == 0:  # the mean of one rank is its input, bit for bit
    own = None
    if return_own:
      own = jax.tree_util.tree_unflatten(treedef, [a.astype(jnp.float32) for a in arrays])
    return (jax.tree_util.tree_unflatten(treedef, arrays), stats._replace(own=own),
            jnp.float32(0), None)
  size = opts.buckets.loop_size(shapes, flags, n)
  outs, owns, err, ref = loops.reduce_stacked(arrays, flags, program, key=key, size=size,
                                              n_divide=n if opts.average else None)
  own = None
  if return_own:
    own = jax.tree_util.tree_unflatten(
        treedef, [o * np.float32(n) for o in owns] if opts.average else owns)
  return jax.tree_util.tree_unflatten(treedef, outs), stats._replace(own=own), err, ref


def hierarchical_share(d: int, codec, fast: int) -> int:
  """Coordinates of each fast rank's share of a ``d``-coordinate bucket in
  ``schedule="hierarchical"`` (whole blocks of the codec, interleaved)."""
  unit = codec.granularity
  return ceil_div(d, unit * fast) * unit


def _hierarchical(arrays, treedef, layout, opts: ReduceOptions, *, key):
  """``schedule="hierarchical"`` (see :mod:`dynamiq_jax.schedules.hierarchical`), bucket by
  bucket (:class:`dynamiq_jax.engine.programs.Hierarchical`)."""
  codec = opts.codec
  slow, fast = axis_names(opts.axis_name)
  fast_ctx, slow_ctx = axis_context(fast), axis_context(slow)
  both_n = fast_ctx.n * slow_ctx.n
  xs = [pack(arrays, segs, both_n if opts.average else None) for segs in layout]
  program = engine.Hierarchical(codec, HIERARCHICAL[opts.schedule], slow, fast,
                                opts.implementation)
  key = jax.random.fold_in(key, jax.lax.axis_index(fast))  # fresh rounding per fast rank
  results = engine.reduce_buckets(xs, program, key=key)
  outs = [r.out for r in results]
  # each fast rank's shares have their own estimate: weigh them by the shares' norms
  err, ref = fast_ctx.psum((error_total(r.err for r in results), sum(r.ref for r in results)))
  # the slow axis's cost: every fast rank sends its shares at the codec's bits per
  # coordinate (the exact float32 traffic inside the fast axis is not counted)
  shares = [hierarchical_share(d, codec, fast_ctx.n) for d in bucket_sizes(layout)]
  rep = report(shares, codec, slow_ctx.n)
  stats = AllReduceStats(
      jnp.float32(rep.bits_per_coord), jnp.float32(rep.bytes_per_rank),
      jnp.int32(layout_coords(layout)), uncompressed=jnp.int32(rep.uncompressed))
  out = unpack(outs, layout, arrays, treedef)
  return (out, stats, jnp.float32(0), None) if slow_ctx.n == 1 else (out, stats, err, ref)


def _moshpit(arrays, treedef, layout, opts: ReduceOptions, *, key, absent):
  """Moshpit averaging (:mod:`dynamiq_jax.engine.moshpit`), bucket by bucket: each bucket's
  rounds are one bucket program (:class:`dynamiq_jax.engine.moshpit.MoshpitRounds`)."""
  codec, schedule = opts.codec, opts.schedule
  ctx = axis_context(opts.axis_name)
  xs = [pack(arrays, segs, None) for segs in layout]  # the rounds take means themselves
  nan = jnp.float32(jnp.nan)  # no error estimate: the rounds' errors compound
  if ctx.n == 1 and as_moshpit(schedule).grid is None:  # the mean of one rank: its input
    stats = AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(layout_coords(layout)))
    return unpack(xs, layout, arrays, treedef), stats, jnp.float32(0), None
  plan = as_moshpit(schedule).plan(ctx.n)
  here = moshpit.presence(plan, schedule, key, absent, ctx.rank())
  program = moshpit.MoshpitRounds(codec, plan, opts.axis_name, opts.implementation)
  outs = [r.out for r in engine.reduce_buckets(xs, program, key=key, states=(here,) * len(xs))]
  if not opts.average:
    outs = [o * np.float32(ctx.n) for o in outs]
  rep = moshpit.moshpit_report(bucket_sizes(layout), codec, plan, coords=layout_coords(layout))
  stats = AllReduceStats(jnp.float32(rep.bits_per_coord), jnp.float32(rep.bytes_per_rank),
                         jnp.int32(rep.coords), uncompressed=jnp.int32(rep.uncompressed))
  return unpack(outs, layout, arrays, treedef), stats, nan, None


def _check_sharded_codec(codec, codec_state):
  if codec.stateful or codec_state is not None:
    raise ValueError(
        f"{codec!r} keeps state from one all-reduce to the next, which leaves sharded over "
        f"the model axes {model_axes()} would make differ between model ranks; it is not "
        f"supported there. Fix: use a stateless codec (DynamiQ, MX(scale='e8m0'), Bf16, ...), or "
        f"make the shard_map manual over every mesh axis")
