"""Gradients that arrive at once: stacked (scanned) layers, reduced in loops.

A model whose layers run under ``jax.lax.scan`` (as MaxText and Levanter
write them, or ``nnx.scan``) keeps each parameter of its layers stacked along
a leading axis of layers, and its backward pass produces that stacked
gradient at once, at the end of the backward loop: there is no backward pass
left for the reduction to overlap, and reducing it bucket by bucket, each
bucket inlined into the step, only makes XLA compile the same bucket program
again for every bucket. ``allreduce(..., stacked=...)``
(:func:`dynamiq_jax.allreduce`) reduces such a gradient in loops instead, so
that XLA compiles the bucket program once:

* The buckets: one layer's slices of every stacked leaf, end to end, and the
  other leaves (embedding, output, norms), end to end, each cut into buckets
  of one size, about ``bucket_size`` coordinates (:func:`loop_bucket`: whole
  blocks of the codec in every rank's chunk, so that every bucket is
  compressed, and of the candidate sizes the one that pads least), padded
  with zeros. The padding crosses the wire and is counted in the bits per
  coordinate (:func:`loop_sizes`).
* One loop runs every bucket's collectives
  (:func:`dynamiq_jax.engine.wire_loop`: guard, metadata pass, reduce and
  gather phases), the stacked leaves' layer by layer, then the others'; each
  bucket is made from the gradient inside the loop.
* Then one loop of their decoding (:func:`dynamiq_jax.engine.decode_loop`:
  decode, finish) into one buffer, which the results are cut from.

Between the two loops wait the gathered payloads (about the codec's bits per
coordinate), not float32 results: the stacked gradient is read by the first
loop and the results are written by the second, into a buffer made after it
(:func:`~dynamiq_jax.engine.programs.zeros_after`), so the two are not alive at once.
Bucket ``b`` of the loop (the stacked leaves' first) is keyed by ``b``, as
:func:`~dynamiq_jax.engine.programs.reduce_buckets` keys its buckets. Flat schedules
(``"ring"``, ``"butterfly"``) and stateless codecs only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.engine import programs as engine
from dynamiq_jax._sizes import ceil_div, round_up
from dynamiq_jax.engine.buckets import Segment, pack

__all__ = ["check_stateless", "stacked_flags", "loop_bucket", "loop_sizes", "reduce_stacked"]


def _names(path) -> list:
  """The names along a key path: dict keys, attribute names, sequence indices."""
  out = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        out.append(getattr(k, attr))
        break
  return out


def stacked_flags(leaves_with_paths, stacked) -> list[bool] | None:
  """Which leaves ``stacked`` selects (None: no loop; see :func:`dynamiq_jax.allreduce`).

  ``stacked``: None; a str, the name of a pytree key whose leaves (every leaf
  below it) are stacked (e.g. ``"layers"``); or a callable ``(path, leaf) ->
  bool``. The selected leaves must all have a leading axis of one length;
  a ValueError names the leaf that does not.
  """
  if stacked is None:
    return None
  if isinstance(stacked, str):
    name = stacked
    select = lambda path, leaf: name in _names(path)  # noqa: E731
  elif callable(stacked):
    select = stacked
  else:
    raise TypeError(f"stacked={stacked!r} must be None, a key name (e.g. 'layers': every "
                    f"leaf below that key is stacked) or a callable (path, leaf) -> bool")
  flags = [bool(select(path, leaf)) for path, leaf in leaves_with_paths]
  lengths = {}
  for (path, leaf), f in zip(leaves_with_paths, flags):
    if f:
      shape = np.shape(leaf)
      if not shape or shape[0] < 1:
        raise ValueError(
            f"stacked={stacked!r} selects leaf {jax.tree_util.keystr(path)} of shape "
            f"{shape}, which has no leading axis of layers. Fix: select only the leaves "
            f"stacked along axis 0 (the parameters of layers under jax.lax.scan)")
      lengths.setdefault(shape[0], jax.tree_util.keystr(path))
  if len(lengths) > 1:
    raise ValueError(
        f"stacked={stacked!r} selects leaves whose leading axes differ: "
        f"{ {v: k for k, v in lengths.items()} } (leaf: length). All stacked leaves must "
        f"have one layer axis; select one stack, or reduce the others without stacked=")
  return flags


def check_stateless(stacked, codec, codec_state=None):
  """A ValueError naming the fix where ``stacked`` is asked of a codec that keeps state."""
  if stacked is not None and (codec.stateful or codec_state is not None):
    raise ValueError(
        f"stacked={stacked!r} reduces the gradient in loops, which carry no codec state; "
        f"{codec!r} keeps state from one all-reduce to the next. Fix: use a stateless codec "
        f"(DynamiQ, MX(scale='e8m0'), Bf16, ...), or leave stacked=None")


def _split(arrays, flags):
  """The indices of the stacked leaves and of the others (empty leaves in neither)."""
  full = [int(np.prod(np.shape(a))) > 0 for a in arrays]
  inner = [i for i, f in enumerate(flags) if f and full[i]]
  outer = [i for i, f in enumerate(flags) if not f and full[i]]
  return inner, outer


def _groups(shapes, flags) -> list[tuple[int, int]]:
  """``(coordinates, how many)`` of each group: the other leaves once, a layer's slices
  once per layer."""
  inner, outer = _split(shapes, flags)
  groups = []
  if outer:
    groups.append((sum(int(np.prod(shapes[i])) for i in outer), 1))
  if inner:
    groups.append((sum(int(np.prod(shapes[i][1:])) for i in inner), int(shapes[inner[0]][0])))
  return [(t, m) for t, m in groups if t]


def loop_bucket(shapes, flags, bucket_size: int, unit: int) -> int:
  """The one bucket size of every group's loop (a multiple of ``unit``): each group in the
  fewest buckets of at most about ``bucket_size``, or a few more, whichever pads the
  gradient least (one size: XLA compiles the groups' programs as one kernel set)."""
  groups = _groups(shapes, flags)
  if not groups:
    return unit
  candidates = {round_up(ceil_div(t, k), unit)
                for t, _ in groups for k in range(max(1, ceil_div(t, bucket_size)),
                                                  max(1, ceil_div(t, bucket_size)) + 4)}
  limit = max(candidates) if all(c > bucket_size for c in candidates) else round_up(
      bucket_size, unit)
  fits = [c for c in candidates if c <= limit] or [min(candidates)]
  return min(fits, key=lambda c: (sum(m * (round_up(t, c) - t) for t, m in groups), -c))


def loop_sizes(shapes, flags, size: int) -> tuple[list[int], int]:
  """``(bucket sizes, coordinates)``: every bucket the loops reduce in buckets of
  ``size`` (:func:`loop_bucket`; padding included), and the gradient's coordinates
  (padding excluded)."""
  groups = _groups(shapes, flags)
  return ([size] * sum(m * ceil_div(t, size) for t, m in groups),
          sum(t * m for t, m in groups))


def _cut(flat, like):
  """``flat`` cut into pieces shaped like ``like``, in order."""
  leaves, offset = [], 0
  for a in like:
    leaves.append(flat[offset:offset + a.size].reshape(a.shape))
    offset += a.size
  return leaves


def _flat(arrays, n_divide):
  """``arrays`` end to end as one float32 vector (:func:`~dynamiq_jax.engine.buckets.pack`)."""
  return pack(arrays, [Segment(i, 0, a.size) for i, a in enumerate(arrays)], n_divide)


def _sources(arrays, flags, size: int, n_divide):
  """``(bucket(b), count, (layers, per_layer))``: every bucket of the loop, made from the
  gradient inside it: the stacked leaves' first (layer ``l``'s slices end to end, padded, cut into
  ``per_layer`` buckets), then the other leaves' (end to end, padded, cut)."""
  inner, outer = _split(arrays, flags)
  layers = per_layer = 0
  if inner:
    layers = arrays[inner[0]].shape[0]
    per_layer = ceil_div(sum(arrays[i][0].size for i in inner), size)
  rows = None
  if outer:
    flat = _flat([arrays[i] for i in outer], n_divide)
    count = ceil_div(flat.shape[0], size)
    rows = jnp.pad(flat, (0, count * size - flat.shape[0])).reshape(count, size)
  first = layers * per_layer

  def bucket(b):
    x = None
    if inner:
      layer = jnp.minimum(b // per_layer, layers - 1)
      flat = _flat([jax.lax.dynamic_index_in_dim(arrays[i], layer, 0, keepdims=False)
                    for i in inner], n_divide)
      flat = jnp.pad(flat, (0, per_layer * size - flat.shape[0]))
      x = jax.lax.dynamic_slice_in_dim(flat, (b % per_layer) * size, size)
    if rows is not None:
      other = jax.lax.dynamic_index_in_dim(rows, jnp.clip(b - first, 0, rows.shape[0] - 1),
                                           0, keepdims=False)
      x = other if x is None else jnp.where(b < first, x, other)
    return x

  return bucket, first + (0 if rows is None else rows.shape[0]), (layers, per_layer)


def _unpack(rows, arrays, flags, layers: int, per_layer: int):
  """The loop's rows ``[buckets, size]`` (the stacked leaves' buckets first, layer by
  layer) cut back into float32 leaves shaped like ``arrays``; None for an empty leaf."""
  inner, outer = _split(arrays, flags)
  first = layers * per_layer
  out = [None] * len(arrays)
  if inner:
    like = [jax.ShapeDtypeStruct(arrays[i].shape[1:], arrays[i].dtype) for i in inner]
    total = sum(a.size for a in like)
    mine = rows[:first].reshape(layers, -1)[:, :total]
    offset = 0
    for a, i in zip(like, inner):
      out[i] = mine[:, offset:offset + a.size].reshape(arrays[i].shape)
      offset += a.size
  if outer:
    group = [arrays[i] for i in outer]
    flat = rows[first:].reshape(-1)[:sum(a.size for a in group)]
    for i, x in zip(outer, _cut(flat, group)):
      out[i] = x
  return out


def reduce_stacked(arrays, flags, program, *, key, size: int, n_divide: int | None):
  """All leaves in loops (see the module docstring): one loop of every bucket's
  collectives (:func:`~dynamiq_jax.engine.programs.wire_loop`; the stacked leaves' buckets layer
  by layer, then the others'), then one of their decoding
  (:func:`~dynamiq_jax.engine.programs.decode_loop`) into one buffer made after the collectives,
  which the results are cut from. What waits between the two loops is the payloads; the
  results are new arrays (typed as identical on every rank under ``check_vma``).

  Returns:
    ``(leaves, owns or None, err, ref)`` over the whole gradient, in leaf order: the
    results, the own contributions (float32, of the divided input), the estimated squared
    error and the squared norm of the results.
  """
  bucket, count, (layers, per_layer) = _sources(arrays, flags, size, n_divide)
  with jax.named_scope("loops/wire"):
    wired, own, rebuild = engine.wire_loop(bucket, count, program, key=key)
  with jax.named_scope("loops/decode"):
    rows, err = engine.decode_loop(wired, rebuild, program, size)
  cut = _unpack(rows, arrays, flags, layers, per_layer)
  ref = sum((jnp.sum(x * x) for x in cut if x is not None), jnp.float32(0))
  outs = [a if x is None else x.astype(a.dtype) for a, x in zip(arrays, cut)]
  owns = None
  if own is not None:
    owns = [jnp.zeros(a.shape, jnp.float32) if x is None else x
            for a, x in zip(arrays, _unpack(own, arrays, flags, layers, per_layer))]
  return outs, owns, jnp.sum(err), ref
