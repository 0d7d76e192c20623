"""The bucket engine: how each bucket is reduced, written once for every reduction.

:func:`dynamiq_jax.allreduce`, :func:`dynamiq_jax.reduce_scatter`, their
hierarchical forms and ``simulate`` cut the gradient into buckets
(:mod:`dynamiq_jax.engine.buckets`) and hand them to :func:`reduce_buckets`, which
reduces them one after another, each by a *bucket program*:

* :class:`AllReduce`: the guard, the codec's metadata pass, the payload's
  reduce and gather phases on the schedule, the codec's finish;
* :class:`ReduceScatter`: the same with the reduce phase only (each rank
  finishes its own chunk);
* :class:`Hierarchical`: exact reduce-scatter over the fast axis, the
  codec's all-reduce of each share over the slow axis, all-gather over the
  fast axis (without it, HSDP's reduce-scatter).

One bucket, in order: :func:`guard` (one small all-reduce agreeing on
non-finite values and a power-of-two scale, carrying a value of the previous
bucket's last collective so that the buckets' collectives run one after
another: :func:`one_after_another`), then :func:`codec_pass`: ``codec.metadata``
combined across ranks (:func:`combine_metadata`: a ``pmax``, or a sum in two
collectives, :func:`~dynamiq_jax.schedules.executor.two_step`),
``codec.plan``, the schedule executor calling the codec's hop functions
(:func:`hop_ops`), ``codec.finish``.

**Small programs, compiled once.** A bucket program is a jitted function of
its bucket's data, its chained value and its random-key words, with the
configuration static (:func:`run_program`): buckets of one shape trace once
and lower to one function. Its inputs pass an ``optimization_barrier``, and
every bucket's key prefix is computed once for all buckets, as data
(:func:`bucket_keys`), so no bucket program holds a constant of its own: XLA
compiles each of its kernels once for all the buckets of that shape. Only the
wire is chained: a bucket's decode and finish may run later (beside the
optimizer that reads them), while the next buckets are on the wire.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dynamiq_jax.engine.buckets import AllReduceStats, bucket_codec, group_keys, group_order, relative
from dynamiq_jax.engine.buckets import sum_stats
from dynamiq_jax.codecs import base as codec_base
from dynamiq_jax.codecs.base import Bucket, Codec, Keys, bucket_key_states
from dynamiq_jax.codecs.base import key_rows, tables_from_flat
from dynamiq_jax.engine.guard import SAFE_EXPONENT, guard, guard_metadata, guard_votes, guarded
from dynamiq_jax.engine.guard import unguard
from dynamiq_jax.schedules import hierarchical
from dynamiq_jax.schedules.context import AxisContext, axis_context
from dynamiq_jax.schedules.executor import HopOps, Lossy, decode_all, gather_payloads
from dynamiq_jax.schedules.executor import in_chunk_order, reduce_scatter, trace_settings, two_step
from dynamiq_jax.schedules.loss import REDUCE_HOP, loss_key
from dynamiq_jax.schedules.local import run_on_local_shards, sharding_groups
from dynamiq_jax.schedules.plan import TreePlan, get_plan

__all__ = [
    "BucketResult", "chain_value", "SAFE_EXPONENT", "guard", "guard_votes", "guarded",
    "guard_metadata", "unguard", "one_after_another",
    "hop_ops", "combine_metadata", "plan_bucket", "lossy_receive", "codec_pass",
    "FlatProgram", "AllReduce", "ReduceScatter", "Hierarchical", "bucket_keys", "run_program",
    "reduce_buckets", "program_keys", "wire_pass", "decode_pass", "wire_loop", "zeros_after",
    "decode_loop", "run_sharded",
]

class BucketResult(NamedTuple):
  """What a bucket program (and :func:`codec_pass`) returns; None where it has no such value.

  ``out`` the reduced bucket (a reduce-scatter's: this rank's row); ``sent`` an array of
  its last collective, which the next bucket chains to (:func:`one_after_another`: the
  gathered payloads, which wait for the decode anyway, or one value of a result);
  ``state`` the codec's new state (:class:`AllReduce`); ``own`` this rank's contribution
  as the codec represented it (``return_own``); ``err`` the estimated squared error, a
  float32 scalar or terms whose sum it is (:func:`~dynamiq_jax.engine.buckets.error_total`),
  NaN where the codec makes none; ``ref`` the reduced share's squared norm
  (:class:`Hierarchical`).
  """

  out: Any
  sent: Any
  state: Any = None
  own: Any = None
  err: Any = None
  ref: Any = None


def chain_value(sent):
  """float32: the value of a bucket's ``sent`` (:class:`BucketResult`) that the next
  bucket's guard reads, its first element. Taken where it is read, after the barrier of
  :func:`reduce_buckets`, so that it fuses into the guard's votes and costs no launch."""
  return jnp.asarray(sent).reshape(-1)[0].astype(jnp.float32)


def one_after_another(xs, reduce_one):
  """``[reduce_one(b, x, after) for b, x in enumerate(xs)]``: each bucket's collectives
  after the previous bucket's.

  ``reduce_one(b, x, after)`` returns a :class:`BucketResult`, whose ``sent`` is an
  array of bucket b's last collective (its gathered payloads, as they
  arrived); ``after`` is bucket b-1's (None for the first), which bucket b's
  first collective (its guard) reads (:func:`chain_value`: a finite flag among
  its votes): so bucket b's all-reduce starts once bucket b-1's is off the wire,
  and XLA cannot combine collectives of different buckets. Its combiners would
  otherwise merge, say, every bucket's guard into one all-reduce that waits for
  the whole gradient, and no bucket would start before the backward pass ends.
  """
  results = []
  for b, x in enumerate(xs):
    after = results[-1].sent if results else None
    with jax.named_scope(f"allreduce/bucket{b}"):
      results.append(reduce_one(b, x, after))
  return results


def hop_ops(codec: Codec, aux, keys: Keys) -> HopOps:
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

  def decode_sum(payloads):
    return codec.decode_sum(payloads, aux)

  decode_many = (lambda payloads: codec.decode_many(payloads, aux)) if type(
      codec).decode_many is not Codec.decode_many else None  # None: the executor's decodes
  decode_sum_encode = (
      lambda payloads, c, hop: codec.decode_sum_encode(payloads, aux, keys.at(c, hop))
  ) if type(codec).decode_sum_encode is not Codec.decode_sum_encode else None
  return HopOps(encode, decode, decode_add_encode, decode_add, decode_sum, decode_many,
                decode_sum_encode)


def combine_metadata(meta, ctx: AxisContext, keys: Keys):
  """Pass 1: every rank's metadata combined, identical on every rank: an exact ``pmax``,
  or a sum by the codec it names in two collectives (whatever the payload's schedule:
  metadata is small, so one all-to-all and one all-gather beat a ring of n - 1 hops)."""
  if isinstance(meta.combine, str) and meta.combine == "max":
    return ctx.pmax(meta.local)
  if isinstance(meta.combine, Codec):
    return two_step(ctx, meta.local, hop_ops(meta.combine, None, keys))
  raise ValueError(f"Metadata.combine={meta.combine!r} must be 'max' or a Codec")


def plan_bucket(x, local, codec: Codec, bucket: Bucket, state, keys: Keys, ctx: AxisContext):
  """``codec.plan`` of guarded ``x`` given this rank's metadata ``local`` (a
  :class:`~dynamiq_jax.codecs.base.Metadata`, or None): combined over the ranks first,
  and what it kept for the plan (``Metadata.kept``) passed on as ``kept``."""
  if local is None:
    return codec.plan(x, None, bucket, state, keys)
  with jax.named_scope("metadata"):
    meta = combine_metadata(local, ctx, keys)
  if local.kept is None:
    return codec.plan(x, meta, bucket, state, keys)
  return codec.plan(x, meta, bucket, state, keys, kept=local.kept)


def lossy_receive(loss, codec: Codec, bucket: Bucket, keys: Keys, ctx: AxisContext, chunks):
  """What this rank lost of the reduce step's payloads of its chunk (:class:`Lossy`), or
  None without ``loss``: packets of the codec's wire bits per coordinate, cut at its
  blocks, drawn from the bucket's key (identical on every rank)."""
  if loss is None:
    return None
  elements = math.prod(jax.tree.leaves(chunks)[0].shape[1:])
  coords = loss.coords_per_packet(codec.wire_bits(bucket.d, bucket.n) / bucket.d,
                                  codec.granularity)
  return Lossy(loss, loss.lost_elements(loss_key(keys.state), REDUCE_HOP, ctx.n, ctx.rank(),
                                        elements, coords))


def wire_pass(x, codec: Codec, bucket: Bucket, state, keys: Keys, plan: TreePlan,
              ctx: AxisContext, return_own: bool, loss=None, local=None):
  """A guarded bucket's collectives: metadata pass and payload pass -> (gathered payloads in
  rank order, chunk c the payload of rank ``(c + plan.root) % n``; the plan's aux; own
  contribution or None). :func:`decode_pass` finishes it. With
  ``loss`` (a :class:`~dynamiq_jax.schedules.loss.PacketLoss`), the payload's reduce
  step loses packets; the metadata pass and the gather step do not. ``local``: the local
  metadata if made (:func:`guard_metadata`; None: ``codec.metadata``)."""
  meta = local if local is not None else codec.metadata(x, bucket, state, keys)
  p = plan_bucket(x, meta, codec, bucket, state, keys, ctx)
  payloads = gather_payloads(plan, ctx, reduce_scatter(
      plan, ctx, p.chunks, hop_ops(codec, p.aux, keys),
      lossy=lossy_receive(loss, codec, bucket, keys, ctx, p.chunks)), chunk_order=False)
  own = codec.contribution(x, p.aux, bucket) if return_own else None
  return payloads, p.aux, own


def decode_pass(payloads, aux, codec: Codec, bucket: Bucket, state, plan: TreePlan,
                dtype=None):
  """The gathered payloads (:func:`wire_pass`'s, in rank order: chunk c is payload ``(c +
  plan.root) % n``) decoded and finished -> (out, new state, estimated squared error: NaN
  where the codec makes no estimate). ``dtype``: where the codec decodes and finishes at
  once (:meth:`~dynamiq_jax.codecs.Codec.decode_finish`), ``out`` comes rounded to it
  (None: float32)."""
  if type(codec).decode_finish is not Codec.decode_finish:  # decoded and finished at once
    out, new_state, err = codec.decode_finish(payloads, aux, bucket, state, rotate=plan.root,
                                              dtype=dtype, partials=plan.partials())
  else:
    chunks = in_chunk_order(payloads, plan.root)
    out, new_state = codec.finish(decode_all(chunks, hop_ops(codec, aux, None)), aux, bucket,
                                  state)
    err = codec.error_estimate(out, aux, bucket, plan.partials())
  return out, new_state, jnp.float32(jnp.nan) if err is None else err


def codec_pass(x, codec: Codec, bucket: Bucket, state, keys: Keys, plan: TreePlan,
               ctx: AxisContext, return_own: bool, loss=None, local=None, dtype=None):
  """One guarded bucket through the codec: metadata pass, payload pass, finish -> a
  :class:`BucketResult` (``out``, ``state``, ``own``, ``err``, ``sent``).

  ``sent`` is the gathered payloads' first array: what the next bucket
  chains to (:func:`one_after_another`), so that it waits for this bucket's
  collectives only, and this bucket's decode and finish can run later, beside
  the optimizer that reads them, while the next buckets are on the wire: what
  waits in between is the compressed payloads, not the float32 result. ``dtype``: as
  :func:`decode_pass`'s.
  """
  payloads, aux, own = wire_pass(x, codec, bucket, state, keys, plan, ctx, return_own, loss,
                                 local)
  sent = jax.tree.leaves(payloads)[0]
  out, new_state, err = decode_pass(payloads, aux, codec, bucket, state, plan, dtype)
  return BucketResult(out, sent, state=new_state, own=own, err=err)


# ----------------------------------------------------------------------------
# Bucket programs: static configuration, called as program(x, after, words, index, state).


def program_keys(words, index, ctx: AxisContext, codec: Codec | None = None) -> Keys:
  """A bucket program's :class:`Keys` from its key words ``(k0, k1, s0, s1)``, or ``(k0, k1,
  rows)`` with ``rows`` every bucket's :func:`~dynamiq_jax.codecs.base.key_rows`
  (``codec``'s tables), of which the program reads row ``index``."""
  if len(words) == 4:
    k0, k1, s0, s1 = words
    return Keys(k0, k1, index, ctx.rank(), (s0, s1))
  k0, k1, rows = words  # every bucket's rows: this one's is sliced where it is read
  row = jax.lax.dynamic_index_in_dim(rows, jnp.asarray(index).astype(jnp.uint32), 0,
                                     keepdims=False)
  keys = Keys(k0, k1, index, ctx.rank(), (row[0], row[1]))
  return keys._replace(tables=tables_from_flat(codec, keys, ctx.n, row[2:]))


@dataclasses.dataclass(frozen=True)
class FlatProgram:
  """A bucket program on a flat schedule (:class:`AllReduce`, :class:`ReduceScatter`):
  codec, schedule, axis, kernels, whether each rank's own contribution is returned,
  and the reduce step's packet loss (two-step schedule) or None."""

  codec: Codec
  schedule: str
  axis_name: Any
  implementation: str | None
  return_own: bool
  loss: Any = None

  def plan(self, n: int):  # a ValueError where n does not fit the schedule
    return get_plan(self.schedule, n)


@dataclasses.dataclass(frozen=True)
class AllReduce(FlatProgram):
  """One bucket's all-reduce on a flat schedule.

  ``program(x, after, words, index, state) ->`` :class:`BucketResult` (``out``,
  ``state``, ``own`` or None, ``err``, ``sent``): ``x`` the bucket's flat float32 data,
  ``after`` the chained value (:func:`one_after_another`), ``words`` its key words,
  ``state`` the codec's state.
  """

  def __call__(self, x, after, words, index, state):
    ctx = axis_context(self.axis_name)
    plan = self.plan(ctx.n)
    d = x.shape[0]
    used = bucket_codec(self.codec, d, ctx.n)
    bucket = Bucket(index, d, ctx.n, self.implementation)
    keys = program_keys(words, index, ctx, self.codec)
    nonfinite, x, scale, local = guard_metadata(x, used, bucket, keys, ctx, after)
    r = codec_pass(x, used, bucket, state, keys, plan, ctx, self.return_own, self.loss, local,
                   used.result_dtype)
    return BucketResult(unguard(r.out, nonfinite, scale, used.result_dtype), r.sent,
                        state=state if used is not self.codec else r.state,
                        own=r.own / scale if self.return_own else None,
                        err=r.err / (scale * scale))

  def wire(self, x, words, index):
    """The collectives of a stateless bucket -> (payloads, aux, (non-finite, scale), own or
    None): the first half of ``__call__`` (:func:`wire_loop`)."""
    ctx = axis_context(self.axis_name)
    used = bucket_codec(self.codec, x.shape[0], ctx.n)
    bucket = Bucket(index, x.shape[0], ctx.n, self.implementation)
    keys = program_keys(words, index, ctx, self.codec)
    nonfinite, x, scale, local = guard_metadata(x, used, bucket, keys, ctx)
    payloads, aux, own = wire_pass(
        x, used, bucket, None, keys, self.plan(ctx.n), ctx, self.return_own,
        self.loss, local)
    return payloads, aux, (nonfinite, scale), own / scale if self.return_own else None

  def decode(self, payloads, aux, guarded, d: int, index):
    """The second half: :meth:`wire`'s outputs -> (out, estimated squared error)."""
    n = axis_context(self.axis_name).n
    used = bucket_codec(self.codec, d, n)
    out, _, err = decode_pass(payloads, aux, used, Bucket(index, d, n, self.implementation),
                              None, self.plan(n), used.result_dtype)
    nonfinite, scale = guarded
    return unguard(out, nonfinite, scale, used.result_dtype), err / (scale * scale)


@dataclasses.dataclass(frozen=True)
class ReduceScatter(FlatProgram):
  """One bucket's reduce-scatter on a flat schedule.

  ``program(rows, after, words, index, state) ->`` :class:`BucketResult` (``out`` this
  rank's row, ``own`` rows or None, ``sent``): ``rows`` [n, m], row r the slice that
  rank r keeps.
  """

  def __call__(self, rows, after, words, index, state):
    del state
    ctx = axis_context(self.axis_name)
    n = ctx.n
    plan = self.plan(n)
    m = rows.shape[1]
    d = n * m
    x = jnp.roll(rows, -plan.root, axis=0).reshape(-1)  # chunk c: rank (c + root) % n's row
    if n == 1:
      with jax.named_scope("guard"):
        nonfinite, x, scale = guard(x, ctx, after)
      out = unguard(x, nonfinite, scale)
      return BucketResult(out, out[0], own=(x / scale)[None] if self.return_own else None)
    used = bucket_codec(self.codec, d, n)
    bucket = Bucket(index, d, n, self.implementation, scatter=True)
    keys = program_keys(words, index, ctx, self.codec)
    nonfinite, x, scale, meta = guard_metadata(x, used, bucket, keys, ctx, after)
    meta = meta if meta is not None else used.metadata(x, bucket, None, keys)
    p = plan_bucket(x, meta, used, bucket, None, keys, ctx)
    with jax.named_scope("reduce_scatter"):
      mine = reduce_scatter(plan, ctx, p.chunks, hop_ops(used, p.aux, keys), encode_root=False,
                            lossy=lossy_receive(self.loss, used, bucket, keys, ctx, p.chunks))
    c = (ctx.rank() - plan.root) % n  # the chunk this rank owns: its own row
    full = jax.tree.map(
        lambda a: jax.lax.dynamic_update_index_in_dim(jnp.zeros((n,) + a.shape, a.dtype), a, c,
                                                      axis=0), mine)
    out, _ = used.finish(full, p.aux, bucket, None)
    piece = jax.lax.dynamic_slice_in_dim(out, c * m, m)
    own = None
    if self.return_own:
      own = jnp.roll((used.contribution(x, p.aux, bucket) / scale).reshape(n, m), plan.root,
                     axis=0)
    piece = unguard(piece, nonfinite, scale, used.result_dtype)
    return BucketResult(piece, piece[0], own=own)


@dataclasses.dataclass(frozen=True)
class Hierarchical:
  """One bucket of ``schedule="hierarchical"`` over ``(slow, fast)``.

  The fast axis reduce-scatters the bucket exactly, each fast rank reduces
  its share with the codec over the slow axis (on ``inner``, a flat
  schedule), and with ``gather`` the fast axis all-gathers the shares:
  ``program(x, after, words, index, state) ->`` :class:`BucketResult` (``out``, ``err``,
  ``ref``: the share's estimated squared error and squared norm, ``sent``). Without
  ``gather`` (HSDP's reduce-scatter) ``x`` is ``rows`` [L, m], row r the
  slice fast rank r keeps, and ``out`` is this rank's row (no ``err`` nor ``ref``).
  """

  codec: Codec
  inner: str
  slow: Any
  fast: Any
  implementation: str | None
  gather: bool = True

  def __call__(self, x, after, words, index, state):
    del state
    fast, slow = axis_context(self.fast), axis_context(self.slow)
    both = axis_context((self.slow, self.fast))
    unit = self.codec.granularity
    rows = None if self.gather else x
    flat = x if self.gather else x.reshape(-1)
    with jax.named_scope("guard"):  # over both axes: the fast reduce-scatter is guarded too
      nonfinite, flat, scale = guard(flat, both, after)
    with jax.named_scope("fast_reduce_scatter"):
      if self.gather:  # this rank owns share (r + 1) % size
        shares = hierarchical.split_shares(flat, fast.n, unit)
      else:  # rank r owns share (r - root) % L: its own row
        root = hierarchical.ring_plan(fast.n).root if fast.n > 1 else 0
        shares = jnp.roll(flat.reshape(rows.shape), -root, axis=0)
      owned = hierarchical.reduce_scatter_shares(fast, shares)
    m = owned.shape[0]
    reduced, err, dtype = owned, jnp.float32(0), None
    if slow.n > 1:  # (the caller folded the fast rank into the key: fresh rounding per share)
      k0, k1, s0, s1 = words
      used = bucket_codec(self.codec, m, slow.n)
      dtype = used.result_dtype
      r = codec_pass(owned, used, Bucket(index, m, slow.n, self.implementation), None,
                     Keys(k0, k1, index, slow.rank(), (s0, s1)), get_plan(self.inner, slow.n),
                     slow, False)
      reduced, err = r.out, r.err
    if not self.gather:
      mine = unguard(reduced, nonfinite, scale, dtype)
      return BucketResult(mine, mine[0])
    with jax.named_scope("fast_all_gather"):
      out = hierarchical.join_shares(hierarchical.all_gather_shares(fast, reduced),
                                     flat.shape[0], unit)
    unit_sq = scale * scale
    out = unguard(out, nonfinite, scale, dtype)
    return BucketResult(out, out[0], err=err / unit_sq, ref=jnp.sum(reduced * reduced) / unit_sq)


def run_program(inputs, *, program):
  """``program(*inputs)`` as a jitted function: one trace and one lowered function for
  every bucket of the same shape and configuration (``program`` is hashable). The
  switches that tracing reads (the executor's unrolling, the kernels' dispatch) are
  part of the cache key, so changing them retraces."""
  settings = (trace_settings(), codec_base.trace_settings())
  return _run_program(inputs, program=program, settings=settings)


@functools.partial(jax.jit, static_argnames=("program", "settings"))
def _run_program(inputs, *, program, settings):
  del settings
  return program(*inputs)


def bucket_keys(key, count: int):
  """``(k0, k1, (s0, s1))``: the user's key words and, for each of ``count`` buckets,
  its streams' common prefix (:func:`~dynamiq_jax.codecs.base.bucket_key_states`),
  computed once and stored."""
  k0, k1, states = bucket_key_states(key, count)
  return k0, k1, jax.lax.optimization_barrier(states)


def reduce_buckets(xs, program, *, key, states=None):
  """Reduces buckets ``xs`` one after another, each by the bucket program ``program``.

  Each program gets its bucket's data and the chained value of the previous bucket
  (:func:`chain_value` of its ``sent``), its key words and index, and ``states[b]``
  (None by default), all through ``optimization_barrier`` s: the
  program then holds no value of another bucket's and no constant of its own, so
  XLA compiles it once per shape. Returns the programs' outputs, in bucket order
  (``sent`` last).
  """
  k0, k1, (s0, s1) = bucket_keys(key, len(xs))
  states = states if states is not None else (None,) * len(xs)
  rows = None  # a flat program's keys, derived for every bucket at once and stored
  if isinstance(program, (AllReduce, ReduceScatter)):
    rows = key_rows(program.codec, axis_context(program.axis_name).n, s0, s1)
    rows = None if rows is None else jax.lax.optimization_barrier(rows)

  def reduce_one(b, x, after):
    # the first bucket chains to a finite 0: every bucket runs the same program
    x, after = jax.lax.optimization_barrier((x, jnp.float32(0) if after is None else after))
    chained = chain_value(after)  # read after the barrier: it fuses into the guard's votes
    # (a barrier's outputs vary over every mesh axis any of its inputs does: the rank-
    # invariant key words, index and codec state pass one of their own)
    # (the whole key rows: a program reads its own in place, where a row sliced for the
    # barrier would be one more launch per bucket)
    words = (k0, k1, s0[b], s1[b]) if rows is None else (k0, k1, rows)
    words, index, state = jax.lax.optimization_barrier((words, jnp.int32(b), states[b]))
    return run_program((x, chained, words, index, state), program=program)

  return one_after_another(xs, reduce_one)


def _split_static(tree):
  """``tree``'s array leaves, and what rebuilds it from them (its other leaves kept)."""
  leaves, treedef = jax.tree.flatten(tree)
  is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]
  arrays = [leaf for leaf, a in zip(leaves, is_array) if a]
  static = [None if a else leaf for leaf, a in zip(leaves, is_array)]

  def rebuild(arrays):
    it = iter(arrays)
    return jax.tree.unflatten(treedef, [next(it) if a else leaf
                                        for leaf, a in zip(static, is_array)])

  return arrays, rebuild


def wire_loop(bucket, count: int, program, *, key):
  """The collectives of ``count`` equal buckets, one after another in a ``scan``
  (``program.wire``, compiled once whatever the number of buckets): the first of the
  two loops of :mod:`dynamiq_jax.engine.stacked`, whose buckets do not overlap the backward
  pass. ``bucket(b)`` makes bucket ``b`` (traced index) from the gradient, inside the
  loop.

  Bucket ``b`` gets the same key words and index as in :func:`reduce_buckets`.
  Returns ``(wired, own, rebuild)``: ``wired`` what :func:`decode_loop` takes
  (the gathered payloads, the plans' arrays, the guards', the indices; stacked over
  the buckets), ``own`` the stacked own contributions (or None), ``rebuild`` what
  makes a plan's aux from its arrays.
  """
  k0, k1, (s0, s1) = bucket_keys(key, count)
  found = {}

  def one(_, inputs):
    a, b, index = inputs
    payloads, aux, guarded, own = program.wire(bucket(index), (k0, k1, a, b), index)
    arrays, found["rebuild"] = _split_static(aux)
    return None, ((payloads, arrays, guarded, index), own)

  _, (wired, own) = jax.lax.scan(one, None, (s0, s1, jnp.arange(count, dtype=jnp.int32)))
  return wired, own, found["rebuild"]


def zeros_after(shape, dtype, tree):
  """Zeros of ``shape`` made from a value of ``tree`` (0 times its first element): XLA
  cannot allocate them before ``tree`` exists. A loop's results, written in place into
  such zeros, take no memory while the loop's inputs are still alive; a scan's own output
  buffers are zeros XLA may allocate at any time before the loop, e.g. during the
  backward pass."""
  first = jax.tree.leaves(tree)[0].reshape(-1)[0].astype(jnp.float32)
  zero = jnp.where(jnp.isfinite(first), first * 0, jnp.float32(0))
  return jnp.full(shape, zero.astype(dtype))


def decode_loop(wired, rebuild, program, size: int):
  """:func:`wire_loop`'s buckets decoded and finished in a second loop, after every
  bucket's collectives -> (out ``[buckets, size]``, estimated squared error per bucket),
  written in place into buffers made after the collectives (:func:`zeros_after`)."""
  k = jax.tree.leaves(wired)[0].shape[0]

  def one(carry, inputs):
    out, err = carry
    (payloads, arrays, guarded, index), at = inputs
    o, e = program.decode(payloads, rebuild(arrays), guarded, size, index)
    return (jax.lax.dynamic_update_index_in_dim(out, o, at, 0),
            jax.lax.dynamic_update_index_in_dim(err, jnp.sum(e), at, 0)), None

  init = (zeros_after((k, size), jnp.float32, wired[0]),
          zeros_after((k,), jnp.float32, wired[0]))
  (out, err), _ = jax.lax.scan(one, init, (wired, jnp.arange(k, dtype=jnp.int32)))
  return out, err


def run_sharded(reduce_local, tree, treedef, local, key, *, leaf_order, return_own,
                no_estimate: float, scattered: bool = False):
  """A reduction of leaves sharded over the model axes, on each device's own shards.

  Leaves are grouped by the model axes they are sharded over
  (:func:`~dynamiq_jax.schedules.local.sharding_groups`); each group is reduced on
  its own, ``reduce_local(leaves, idx, key=, leaf_order=) -> (leaves, stats, err,
  ref)`` (``idx``: the group's leaf indices), inside a ``shard_map`` manual over
  every mesh axis (:func:`~dynamiq_jax.schedules.local.run_on_local_shards`), with
  a key of its own (:func:`~dynamiq_jax.engine.buckets.group_keys`). The error estimate
  counts each coordinate once (summed over its shards only); it is NaN where
  ``scattered`` (no estimate for a reduce-scatter), ``no_estimate`` where no
  group gave one.

  Returns:
    ``(tree, stats)`` with ``stats.own`` the tree of own contributions (or None).
  """
  groups = sharding_groups(local)

  def body(local_tree, *keys):
    flat = treedef.flatten_up_to(local_tree)
    outs, owns, parts, err_sum, ref_sum = [None] * len(flat), [None] * len(flat), [], 0.0, None
    for (sharded_over, idx), k in zip(groups, keys):
      out, stats, err, ref = reduce_local([flat[i] for i in idx], idx, key=k,
                                          leaf_order=group_order(leaf_order, idx, len(flat)))
      for j, i in enumerate(idx):
        outs[i] = out[j]
        owns[i] = stats.own[j] if return_own else None
      if ref is not None:  # each coordinate counted once: summed over its shards only
        if sharded_over:
          err, ref = jax.lax.psum((err, ref), sharded_over)
        err_sum, ref_sum = err_sum + err, ref if ref_sum is None else ref_sum + ref
      parts.append(stats._replace(own=None, codec_state=None))
    if scattered:
      estimate = jnp.float32(jnp.nan)
    elif ref_sum is None:
      estimate = jnp.float32(no_estimate)
    else:
      estimate = relative(jnp.float32(err_sum), jnp.float32(ref_sum))
    return (jax.tree_util.tree_unflatten(treedef, outs),
            jax.tree_util.tree_unflatten(treedef, owns) if return_own else None,
            sum_stats(parts)._replace(error_estimate=estimate))

  def out_specs(tree_specs):
    return tree_specs, tree_specs if return_own else None, AllReduceStats(
        P(), P(), P(), codec_state=None, own=None, uncompressed=P(), error_estimate=P())

  out, own, stats = run_on_local_shards(body, tree, local, treedef, out_specs=out_specs,
                                       replicated=group_keys(key, len(groups)))
  return out, stats._replace(own=own)
