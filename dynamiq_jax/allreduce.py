"""``allreduce``: a compressed multi-hop all-reduce of a gradient pytree.

Call it inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap`` over
``axis_name``. The pytree is flattened into float32 buckets (any float
leaves, any shapes), each bucket is all-reduced by the codec on the
schedule, and the result is cut back into leaves of the original shapes and
dtypes. Every rank ends with bit-identical values.

One bucket, in order (:func:`_reduce_bucket`):

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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.schedules import hierarchical
from dynamiq_jax.schedules.context import AxisContext, axis_context, axis_names, varying_axes
from dynamiq_jax.schedules.executor import HopOps, execute
from dynamiq_jax.schedules.plan import TreePlan, get_plan, ring_bytes_per_rank

__all__ = [
    "allreduce", "AllReduceStats", "wire_stats", "init_codec_state", "DEFAULT_BUCKET_SIZE",
    "HIERARCHICAL",
]

HIERARCHICAL = hierarchical.HIERARCHICAL

DEFAULT_BUCKET_SIZE = 1 << 26
"""Coordinates per bucket (256 MiB of float32 staging)."""


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


def _flatten(arrays):
  """The leaves as one float32 vector (the buckets are slices of it)."""
  return jnp.concatenate([a.reshape(-1).astype(jnp.float32) for a in arrays])


def _unflatten(vec, arrays, treedef, cast: bool = True):
  """Cuts ``vec`` back into leaves shaped like ``arrays`` (their dtypes if ``cast``)."""
  pieces = jnp.split(vec, np.cumsum([a.size for a in arrays])[:-1])
  leaves_out = [p.reshape(a.shape).astype(a.dtype if cast else jnp.float32)
                for p, a in zip(pieces, arrays)]
  return jax.tree_util.tree_unflatten(treedef, leaves_out)


def _check_codec(codec):
  if not isinstance(codec, Codec):
    raise TypeError(
        f"codec={codec!r} is not a dynamiq_jax codec: pass e.g. codecs.DynamiQ(bits=5), "
        f"or subclass dynamiq_jax.codecs.Codec (see its docstring for the contract)")


def _bucket_bounds(total: int, bucket_size: int, codec):
  _check_codec(codec)
  unit = codec.granularity
  if bucket_size < 1 or bucket_size % unit:
    raise ValueError(
        f"{bucket_size=} must be a positive multiple of {unit} for {type(codec).__name__} "
        f"(its blocks must not straddle buckets); e.g. bucket_size="
        f"{max(unit, bucket_size - bucket_size % unit)}")
  return [(s, min(s + bucket_size, total)) for s in range(0, total, bucket_size)]


def wire_stats(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE) -> AllReduceStats:
  """Exact wire accounting of ``allreduce(tree, codec=codec)`` over ``n`` ranks.

  Args:
    tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``).
    codec: the codec.
    n: number of ranks.
    bucket_size: as passed to :func:`allreduce`.

  Returns:
    :class:`AllReduceStats` of Python numbers.
  """
  total = _total(tree)
  if total == 0:
    return AllReduceStats(0.0, 0.0, 0)
  if n == 1:  # nothing crosses a wire: the all-reduce is the identity
    return AllReduceStats(0.0, 0.0, total)
  bits = plain = 0
  for s, e in _bucket_bounds(total, bucket_size, codec):
    used = _bucket_codec(codec, e - s, n)
    bits += used.wire_bits(e - s, n)
    plain += (e - s) if used is not codec else 0
  return AllReduceStats(bits / total, ring_bytes_per_rank(bits / 8, n), total, uncompressed=plain)


def _bucket_codec(codec, d: int, n: int):
  """``codec``, or bf16 partial sums for a bucket too small for it to compress."""
  return codec if codec.compresses(d, n) else Bf16()


def _total(tree) -> int:
  return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))


def init_codec_state(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE):
  """The codec's initial state for ``allreduce(tree)`` over ``n`` ranks (None if stateless).

  Its structure and shapes do not depend on ``n``; only its values do.
  """
  _check_codec(codec)
  total = _total(tree)
  if not codec.stateful or total == 0:
    return None
  return tuple(codec.init_state(e - s, n) for s, e in _bucket_bounds(total, bucket_size, codec))


def allreduce(tree, *, axis_name, codec, schedule: str = "ring", key,
              average: bool = True, bucket_size: int = DEFAULT_BUCKET_SIZE,
              implementation: str | None = None, codec_state=None,
              return_own: bool = False):
  """Compressed all-reduce of a gradient pytree over ``axis_name``.

  Args:
    tree: pytree of floating arrays (f32/bf16/f16, any shapes, scalars),
      this rank's gradients. Under ``shard_map(check_vma=True)`` they must be
      varying over ``axis_name``.
    axis_name: the data-parallel axis (bound by shard_map, pmap or vmap).
    codec: e.g. ``codecs.DynamiQ(bits=5)`` or ``codecs.Bf16()``.
    schedule: ``"ring"`` (or ``"butterfly"`` for power-of-two axes).
    key: a ``jax.random`` key, identical on every rank (it seeds the shared
      rounding streams); fold the training step into it.
    average: return the mean over ranks (workers pre-divide by n) instead of
      the sum.
    bucket_size: coordinates per bucket, a multiple of the codec's block
      (``codec.granularity``, 256 for DynamiQ); larger trees are reduced
      bucket by bucket.
    implementation: ``None`` (Pallas kernels on GPU, the jnp reference
      elsewhere), ``"pallas"`` (kernels; interpreted off GPU) or ``"xla"``.
      Both give bit-identical results.
    codec_state: the state of a stateful codec from the previous call
      (``stats.codec_state``); None starts from :func:`init_codec_state`.
    return_own: also return this rank's contribution as represented
      (``stats.own``), for error feedback.

  Returns:
    ``(tree, stats)``: the reduced pytree (same structure, shapes and dtypes;
    bit-identical on every rank) and :class:`AllReduceStats`. Each rank sends
    ``stats.bytes_per_rank`` bytes: per hop one chunk payload, i.e.
    ``wire_bits / n`` bits, for ``2 (n - 1)`` hops.

  Raises:
    ValueError: unbound ``axis_name``; gradients already reduced by XLA
      (not varying over the axis); a budget the codec cannot meet.
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
  if schedule in HIERARCHICAL:
    return _hierarchical(tree, axis_name=axis_name, codec=codec, inner=HIERARCHICAL[schedule],
                         key=key, average=average, bucket_size=bucket_size,
                         implementation=implementation, codec_state=codec_state,
                         return_own=return_own)
  _check_codec(codec)
  if return_own and not codec.reports_contribution:
    raise ValueError(
        f"{type(codec).__name__} cannot report a rank's own contribution "
        f"(reports_contribution=False), which error feedback needs; use a codec that "
        f"does, or error_feedback=False")
  leaves, treedef = _check_leaves(tree)
  ctx = axis_context(axis_name)
  _check_varying(leaves, ctx)
  arrays = [jnp.asarray(leaf) for _, leaf in leaves]
  total = sum(a.size for a in arrays)
  if total == 0:
    return tree, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(0))
  flat = _flatten(arrays)
  if average:
    flat = flat / np.float32(ctx.n)
  out, stats, own_flat = _reduce_flat(flat, ctx=ctx, codec=codec, schedule=schedule, key=key,
                                      bucket_size=bucket_size, implementation=implementation,
                                      codec_state=codec_state, return_own=return_own)
  own = None
  if return_own:
    own = _unflatten(own_flat * np.float32(ctx.n) if average else own_flat, arrays, treedef,
                     cast=False)
  return _unflatten(out, arrays, treedef), stats._replace(own=own)


def _reduce_flat(flat, *, ctx: AxisContext, codec, schedule, key, bucket_size, implementation,
                 codec_state, return_own):
  """All-reduces one flat float32 vector bucket by bucket -> (out, stats, own or None)."""
  total = flat.shape[0]
  report = wire_stats(flat, codec=codec, n=ctx.n, bucket_size=bucket_size)
  bounds = _bucket_bounds(total, bucket_size, codec)
  if codec_state is None:
    codec_state = init_codec_state(flat, codec=codec, n=ctx.n, bucket_size=bucket_size)
  states = codec_state if codec_state is not None else (None,) * len(bounds)
  if len(states) != len(bounds):
    raise ValueError(f"codec_state holds {len(states)} buckets, the tree needs {len(bounds)}")
  if ctx.n == 1:  # one rank: the mean is the input, bit for bit, whatever the codec
    get_plan(schedule, 1)  # still validates the schedule's name
    return flat, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(total),
                                codec_state=tuple(states) if codec.stateful else None,
                                error_estimate=jnp.float32(0)), flat
  plan = get_plan(schedule, ctx.n)
  outs, new_states, owns, errs = [], [], [], []
  for b, (s, e) in enumerate(bounds):
    with jax.named_scope(f"allreduce/bucket{b}"):
      bucket = Bucket(b, e - s, ctx.n, implementation)
      keys = Keys.from_key(key, bucket=b, rank=ctx.rank())
      used = _bucket_codec(codec, e - s, ctx.n)
      out, new_state, own, err = _reduce_bucket(flat[s:e], used, bucket, states[b], keys, plan,
                                                ctx, return_own)
      new_state = states[b] if used is not codec else new_state
    outs.append(out)
    new_states.append(new_state)
    owns.append(own)
    errs.append(err)
  out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
  own = (jnp.concatenate(owns) if len(owns) > 1 else owns[0]) if return_own else None
  stats = AllReduceStats(
      jnp.float32(report.bits_per_coord), jnp.float32(report.bytes_per_rank), jnp.int32(total),
      codec_state=tuple(new_states) if codec.stateful else None,
      uncompressed=jnp.int32(report.uncompressed),
      error_estimate=_relative(sum(errs), jnp.sum(out * out)))
  return out, stats, own


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


def _guard(x, ctx: AxisContext):
  """Every rank's agreement on one bucket: (any rank non-finite, power-of-two scale).

  One small all-reduce (max) of two finite numbers per bucket, so it behaves
  the same on every backend (no reliance on how a backend's max treats NaN).
  """
  finite = jnp.isfinite(x)
  amax = jnp.max(jnp.where(finite, jnp.abs(x), 0.0))
  bad = jnp.any(~finite).astype(jnp.float32)
  amax, bad = ctx.pmax((amax, bad))
  _, e = jnp.frexp(amax)  # amax < 2^e
  scale = jnp.ldexp(jnp.float32(1), jnp.minimum(SAFE_EXPONENT - e, 0))  # 1 unless huge
  return bad > 0, finite, scale


def _reduce_bucket(x, codec: Codec, bucket: Bucket, state, keys: Keys, plan: TreePlan,
                   ctx: AxisContext, return_own: bool):
  """One bucket: guard, metadata pass, payload pass, finish -> (out, new state, own,
  estimated squared error: NaN where the codec makes no estimate).

  A value that is NaN or infinite on any rank makes the whole bucket NaN on
  every rank (the codec itself sees zeros there, so its state stays finite);
  finite inputs reach the codec scaled below :data:`SAFE_EXPONENT` exactly.
  """
  with jax.named_scope("guard"):
    nonfinite, finite, scale = _guard(x, ctx)
    x = jnp.where(finite, x, 0.0) * scale  # exact: a power of two, 1 for usual gradients
  meta = codec.metadata(x, bucket, state)
  if meta is not None:
    with jax.named_scope("metadata"):
      meta = _combine(meta, ctx, plan, keys)
  p = codec.plan(x, meta, bucket, state, keys)
  decoded = execute(plan, ctx, p.chunks, _hop_ops(codec, p.aux, keys))
  out, new_state = codec.finish(decoded, p.aux, bucket, state)
  err = codec.error_estimate(out, p.aux, bucket, plan.partials())
  err = jnp.float32(jnp.nan) if err is None else err / (scale * scale)
  out = jnp.where(nonfinite, jnp.float32(jnp.nan), out / scale)
  own = codec.contribution(x, p.aux, bucket) / scale if return_own else None
  return out, new_state, own, err


def _hierarchical(tree, *, axis_name, codec, inner, key, average, bucket_size, implementation,
                  codec_state, return_own):
  """``schedule="hierarchical"``: see :mod:`dynamiq_jax.schedules.hierarchical`."""
  names = axis_names(axis_name)
  if len(names) != 2 or isinstance(axis_name, str):
    raise ValueError(
        f"schedule='hierarchical' needs axis_name=(slow, fast), e.g. ('host', 'local') for a "
        f"2-axis mesh; got axis_name={axis_name!r}. Fix: pass both mesh axes, slow first, or "
        f"use schedule='ring' for one axis")
  _check_codec(codec)
  if return_own or codec_state is not None or codec.stateful:
    raise ValueError(
        f"schedule='hierarchical' supports stateless codecs without error feedback; "
        f"{codec!r} keeps state (or error feedback was asked for). Fix: use a flat schedule "
        f"('ring' or 'butterfly') over axis_name={tuple(names)!r} for this codec")
  slow, fast = names
  leaves, treedef = _check_leaves(tree)
  fast_ctx, slow_ctx = axis_context(fast), axis_context(slow)
  _check_varying(leaves, axis_context(tuple(names)))
  arrays = [jnp.asarray(leaf) for _, leaf in leaves]
  total = sum(a.size for a in arrays)
  if total == 0:
    return tree, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(0))
  flat = _flatten(arrays)
  if average:
    flat = flat / np.float32(fast_ctx.n * slow_ctx.n)
  unit = codec.granularity
  shares = hierarchical.split_shares(flat, fast_ctx.n, unit)
  owned = hierarchical.reduce_scatter_shares(fast_ctx, shares)  # share (r + 1) % size
  key = jax.random.fold_in(key, jax.lax.axis_index(fast))  # fresh rounding per fast rank
  reduced, stats, _ = _reduce_flat(owned, ctx=slow_ctx, codec=codec, schedule=inner, key=key,
                                   bucket_size=bucket_size, implementation=implementation,
                                   codec_state=None, return_own=False)
  out = hierarchical.join_shares(hierarchical.all_gather_shares(fast_ctx, reduced), total, unit)
  # each fast rank's share has its own estimate: weigh them by the shares' norms
  ref = jnp.sum(reduced * reduced)
  err, ref = fast_ctx.psum((stats.error_estimate * ref, ref))
  # the slow axis's cost: every fast rank sends its share at the codec's bits per
  # coordinate (the exact float32 traffic inside the fast axis is not counted)
  return _unflatten(out, arrays, treedef), AllReduceStats(
      stats.bits_per_coord, stats.bytes_per_rank, jnp.int32(total),
      error_estimate=_relative(err, ref))
