"""``allreduce``: a compressed multi-hop all-reduce of a gradient pytree.

Call it inside ``jax.shard_map``, ``jax.pmap`` or ``jax.vmap`` over
``axis_name``. The pytree is flattened into float32 buckets (any float
leaves, any shapes), each bucket is all-reduced by the codec on the
schedule, and the result is cut back into leaves of the original shapes and
dtypes. Every rank ends with bit-identical values.

All reductions, including the codec's own metadata, run on the library's
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

from dynamiq_jax.codecs.base import AxisContext, is_stateful
from dynamiq_jax.schedules.executor import execute
from dynamiq_jax.schedules.plan import get_plan
from pallas_kernels import rng

__all__ = [
    "allreduce", "AllReduceStats", "wire_stats", "init_codec_state", "DEFAULT_BUCKET_SIZE",
]

HIERARCHICAL = {"hierarchical": "ring", "hierarchical-butterfly": "butterfly"}
"""Two-level schedules for ``axis_name=(slow, fast)``, and their slow-axis schedule."""

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
  """

  bits_per_coord: Any
  bytes_per_rank: Any
  coords: Any
  codec_state: Any = None
  own: Any = None


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    mat = getattr(aval, "manual_axis_type", None)
    vma = getattr(mat, "varying", frozenset()) if mat is not None else frozenset()
  return frozenset(vma)


def _names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_context(axis_name) -> AxisContext:
  """Resolves ``axis_name`` in the current trace; clear error if unbound."""
  try:
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
  except NameError:
    raise ValueError(
        f"axis_name={axis_name!r} is not bound here. Call this inside "
        f"jax.shard_map(..., mesh=mesh) whose mesh has that axis, or inside "
        f"jax.pmap(..., axis_name={axis_name!r}) / jax.vmap(..., axis_name="
        f"{axis_name!r}); or pass the name your mesh actually uses.") from None
  checked = set(_names(axis_name)) <= _varying_axes(idx)
  return AxisContext(axis_name=axis_name, n=int(n), invariant_gather=checked)


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
  want = set(_names(ctx.axis_name))
  for path, leaf in leaves:
    if not want <= _varying_axes(leaf):
      raise ValueError(
          f"gradient leaf {jax.tree_util.keystr(path) or '<root>'} is not varying "
          f"over axis_name={ctx.axis_name!r}: under jax.shard_map(check_vma=True), "
          f"jax.grad of replicated (P()) parameters already summed the gradients "
          f"across ranks with a full-precision psum, so compressing them now only "
          f"wastes time. Fix: differentiate with respect to a per-rank copy, "
          f"`params = jax.lax.pcast(params, {ctx.axis_name!r}, to='varying')` "
          f"before jax.grad (dynamiq_jax.data_parallel_step does this), or run "
          f"the shard_map with check_vma=False.")


def _key_words(key):
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if not jnp.issubdtype(key.dtype, jnp.integer):
    raise TypeError(f"key must be a jax.random key, got dtype {key.dtype}")
  words = key.reshape(-1).astype(jnp.uint32)
  return rng.derive_key(*[words[i] for i in range(words.shape[0])])


def _flatten(arrays):
  """The leaves as one float32 vector (the buckets are slices of it)."""
  return jnp.concatenate([a.reshape(-1).astype(jnp.float32) for a in arrays])


def _unflatten(vec, arrays, treedef, cast: bool = True):
  """Cuts ``vec`` back into leaves shaped like ``arrays`` (their dtypes if ``cast``)."""
  pieces = jnp.split(vec, np.cumsum([a.size for a in arrays])[:-1])
  leaves_out = [p.reshape(a.shape).astype(a.dtype if cast else jnp.float32)
                for p, a in zip(pieces, arrays)]
  return jax.tree_util.tree_unflatten(treedef, leaves_out)


def _bucket_bounds(total: int, bucket_size: int, codec):
  unit = getattr(codec, "granularity", 1)
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
  bits = sum(codec.wire_bits(e - s, n) for s, e in _bucket_bounds(total, bucket_size, codec))
  return AllReduceStats(bits / total, bits / 8 * 2 * (n - 1) / n, total)


def _total(tree) -> int:
  return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(tree))


def init_codec_state(tree, *, codec, n: int, bucket_size: int = DEFAULT_BUCKET_SIZE):
  """The codec's initial state for ``allreduce(tree)`` over ``n`` ranks (None if stateless).

  Its structure and shapes do not depend on ``n``; only its values do.
  """
  init = getattr(codec, "init_state", None)
  total = _total(tree)
  if init is None or total == 0:
    return None
  states = tuple(init(e - s, n) for s, e in _bucket_bounds(total, bucket_size, codec))
  return None if all(s is None for s in states) else states


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
  if return_own and not getattr(codec, "reports_contribution", False):
    raise ValueError(
        f"{type(codec).__name__} cannot report a rank's own contribution, which error "
        f"feedback needs; use error feedback with MX, THC, OmniReduce or GlobalQSGD "
        f"(DynamiQ is unbiased and needs none)")
  leaves, treedef = _check_leaves(tree)
  ctx = axis_context(axis_name)
  _check_varying(leaves, ctx)
  arrays = [jnp.asarray(leaf) for _, leaf in leaves]
  total = sum(a.size for a in arrays)
  report = wire_stats(arrays, codec=codec, n=ctx.n, bucket_size=bucket_size)
  if total == 0:
    return tree, AllReduceStats(jnp.float32(0), jnp.float32(0), jnp.int32(0))
  bounds = _bucket_bounds(total, bucket_size, codec)
  if codec_state is None:
    codec_state = init_codec_state(arrays, codec=codec, n=ctx.n, bucket_size=bucket_size)
  states = codec_state if codec_state is not None else (None,) * len(bounds)
  if len(states) != len(bounds):
    raise ValueError(f"codec_state holds {len(states)} buckets, the tree needs {len(bounds)}")
  plan = get_plan(schedule, ctx.n)
  run = functools.partial(execute, plan, ctx)
  key_words = _key_words(key)
  flat = _flatten(arrays)
  if average:
    flat = flat / np.float32(ctx.n)
  outs, new_states, owns = [], [], []
  for b, (s, e) in enumerate(bounds):
    with jax.named_scope(f"allreduce/bucket{b}"):
      prep = codec.prepare(flat[s:e], ctx=ctx, run=run, key_words=key_words, bucket=b,
                           implementation=implementation, state=states[b])
      out, new_state = prep.finish(run(prep.chunks, prep.ops))
      outs.append(out)
      new_states.append(new_state)
      if return_own:
        owns.append(prep.own())

  out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
  own = None
  if return_own:
    own_flat = jnp.concatenate(owns) if len(owns) > 1 else owns[0]
    own = _unflatten(own_flat * np.float32(ctx.n) if average else own_flat, arrays, treedef,
                     cast=False)
  stats = AllReduceStats(
      jnp.float32(report.bits_per_coord), jnp.float32(report.bytes_per_rank), jnp.int32(total),
      codec_state=None if all(v is None for v in new_states) else tuple(new_states), own=own)
  return _unflatten(out, arrays, treedef), stats


def _local_reduce_scatter(chunks, axis_name, size):
  """Exact float32 ring reduce-scatter of ``chunks`` ([size, m]) over ``axis_name``.

  Rank r ends with the sum of chunk ``(r + 1) % size``, accumulated in the
  fixed order c, c+1, ..., so the bits do not depend on the backend.
  """
  r = jax.lax.axis_index(axis_name)
  perm = [(i, (i + 1) % size) for i in range(size)]
  send = jnp.take(chunks, r, axis=0)
  for j in range(size - 1):
    recv = jax.lax.ppermute(send, axis_name, perm)
    send = recv + jnp.take(chunks, (r - 1 - j) % size, axis=0)
  return send


def _hierarchical(tree, *, axis_name, codec, inner, key, average, bucket_size, implementation,
                  codec_state, return_own):
  """Exact reduction inside the fast axis, compressed all-reduce across the slow one.

  ``axis_name=(slow, fast)``, e.g. ``("host", "local")``: the fast axis
  reduce-scatters in float32 (NVLink inside a host), each fast rank
  all-reduces its 1/L share with ``codec`` over the slow axis (the NIC,
  ``inner`` schedule), and the fast axis all-gathers the results.

  Shares are interleaved in blocks of the codec's granularity (share r
  holds blocks r, r + L, r + 2L, ...: whole super-groups for DynamiQ), so
  every share has the whole gradient's mix of large and small blocks. With
  contiguous shares a model's layers fall into different shares (one all
  embedding rows, another all dense layers), and DynamiQ's static class
  capacities fit none of them: on the word-LM gradients of
  ``bench.schedules`` a (2, 4) mesh measured 4.3e-3 vNMSE with contiguous
  shares against 9.4e-4 for the flat ring.
  """
  names = _names(axis_name)
  if len(names) != 2 or isinstance(axis_name, str):
    raise ValueError(
        f"schedule='hierarchical' needs axis_name=(slow, fast), e.g. ('host', 'local') for a "
        f"2-axis mesh; got axis_name={axis_name!r}. Fix: pass both mesh axes, slow first, or "
        f"use schedule='ring' for one axis")
  if return_own or codec_state is not None or is_stateful(codec):
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
  size = fast_ctx.n
  flat = _flatten(arrays)
  if average:
    flat = flat / np.float32(size * slow_ctx.n)
  unit = getattr(codec, "granularity", 1)
  blocks = -(-total // (unit * size))  # per share
  m = blocks * unit
  chunks = jnp.pad(flat, (0, m * size - total)).reshape(blocks, size, unit)
  chunks = chunks.transpose(1, 0, 2).reshape(size, m)  # share r: blocks r, r + size, ...
  owned = _local_reduce_scatter(chunks, fast, size) if size > 1 else chunks[0]
  key = jax.random.fold_in(key, jax.lax.axis_index(fast))  # fresh rounding per fast rank
  reduced, stats = allreduce(owned, axis_name=slow, codec=codec, schedule=inner, key=key,
                             average=False, bucket_size=bucket_size,
                             implementation=implementation)
  if size > 1:
    gathered = fast_ctx.all_gather(reduced)  # rank r holds chunk (r + 1) % size
    shares = jnp.roll(gathered, 1, axis=0).reshape(size, blocks, unit)
    out = shares.transpose(1, 0, 2).reshape(-1)[:total]
  else:
    out = reduced[:total]
  # the slow axis's cost: every fast rank sends its share at the codec's bits per
  # coordinate (the exact float32 traffic inside the fast axis is not counted)
  return _unflatten(out, arrays, treedef), AllReduceStats(
      stats.bits_per_coord, stats.bytes_per_rank, jnp.int32(total))
