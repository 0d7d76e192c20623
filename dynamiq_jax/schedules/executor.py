"""The one executor that runs any :class:`TreePlan` with any codec.

Reduce phase, on rank ``r`` (chunk indices mod n):

* step 0: encode own chunk ``r - a_0`` (a leaf compress);
* steps 1..S-1: the chunk received at step j-1 either goes straight into the
  next send (fused ``decode_add_encode``: the ring's only hop type) or is
  decode-added into the local copy, and the next send is encoded from the
  local copy (the butterfly's internal nodes);
* after the last step the root of chunk ``r - root`` encodes its full sum.

Gather phase: an all-gather forwards every root's final payload unchanged
(no re-quantisation) and every rank decodes all of them, so all ranks end
with the same bytes — including each root, which adopts the decoded version
of what it broadcast.

Where to put the hops is a scheduling choice with bit-identical results.
Unrolled, every hop is an instruction of the enclosing computation, so
XLA's scheduler can overlap its transfer with any independent work there:
the backward pass of earlier layers, other buckets' codec kernels. A
``while`` loop runs as one unit on the compute stream, so a hop inside one
overlaps only with work of the same loop body. Otherwise runs of alike
steps (:meth:`TreePlan.segments`: the ring is one run, the butterfly two per
tree level) execute as one ``fori_loop`` body each, so compile time grows
with log n at most. Hops are unrolled for plans of up to
:data:`UNROLL_MAX_STEPS` steps lowered for a platform with asynchronous
collectives; on XLA:CPU (:data:`LOOP_PLATFORMS`), whose collectives run in
program order and overlap nothing, they stay in loops, which compile faster.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.schedules.context import AxisContext
from dynamiq_jax.schedules.plan import TreePlan, TwoStepPlan, two_step_plan

__all__ = [
    "HopOps", "Lossy", "execute", "reduce_scatter", "all_gather", "gather_payloads",
    "in_chunk_order", "chunk_index",
    "two_step", "two_step_sum", "lossy_sum",
    "decode_all", "trace_settings", "UNROLL_MAX_STEPS", "LOOP_PLATFORMS",
]

UNROLL_MAX_STEPS = 16
"""Plans of at most this many reduce steps (a ring of up to 17 ranks) run unrolled."""

LOOP_PLATFORMS = ("cpu",)
"""Platforms whose programs keep every plan's hops in loops (see the module docstring)."""

PyTree = Any


class HopOps(NamedTuple):
  """What the executor does with payloads: four functions of arrays.

  ``c`` is the chunk index and ``hop`` the step at which the payload is sent
  (non-negative integer scalars, possibly traced: the tree schedules pass the chunk
  as uint32); an encode may key its random draws by them. ``allreduce`` builds these
  from a codec's pure hop functions.

  Attributes:
    encode: ``(chunk, c, hop) -> payload``.
    decode: ``payload -> value`` (a chunk's shape, float32 or int32).
    decode_add_encode: ``(payload, chunk, c, hop) -> payload``: one fused hop.
    decode_add: ``(payload, chunk) -> value``.
    decode_sum: ``payloads (leading axis n) -> value``: their decoded sum in a
      fixed order (None: ``decode_add`` in rank order).
    decode_many: ``payloads (leading axis n) -> values (leading axis n)``: every
      payload decoded at once, as ``decode`` of each (None: :func:`decode_all`
      decodes them one by one).
    decode_sum_encode: ``(payloads, c, hop) -> payload``: ``encode(decode_sum(payloads),
      c, hop)`` at once, the two-step owner's step (``hop`` a Python int; None: the two).
  """

  encode: Callable[[PyTree, Any, Any], PyTree]
  decode: Callable[[PyTree], PyTree]
  decode_add_encode: Callable[[PyTree, PyTree, Any, Any], PyTree]
  decode_add: Callable[[PyTree, PyTree], PyTree]
  decode_sum: Callable[[PyTree], PyTree] | None = None
  decode_many: Callable[[PyTree], PyTree] | None = None
  decode_sum_encode: Callable[[PyTree, Any, int], PyTree] | None = None


def _take(chunks, c):
  return jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, c, axis=0, keepdims=False), chunks)


def _put(chunks, c, value):
  return jax.tree.map(
      lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), c, axis=0),
      chunks, value)


def chunk_index(r, s, n: int):
  """``(r - s) mod n`` as a uint32 scalar, for rank ``r`` (in [0, n)) and an offset ``s``
  (an int, or an int32 scalar inside a rolled loop). Unsigned, so that neither this
  modulo nor the slices it indexes carry the sign handling of a signed one: a few
  instructions instead of ~18 in every fusion that recomputes the index."""
  if isinstance(s, (int, np.integer)):
    off = np.uint32((-int(s)) % n)
  else:
    off = (-jnp.asarray(s, jnp.int32) % n).astype(jnp.uint32)
  return jax.lax.rem(jnp.asarray(r).astype(jnp.uint32) + off, np.uint32(n))


def _shift_perm(n: int, shift: int):
  return [(i, (i + shift) % n) for i in range(n)]


def execute(plan: TreePlan | TwoStepPlan, ctx: AxisContext, chunks, ops: HopOps):
  """Runs one all-reduce of ``chunks`` (leading axis n) and returns the decoded chunks.

  Each rank sends ``2 (n - 1)`` payloads of one chunk each.
  """
  return decode_all(gather_payloads(plan, ctx, reduce_scatter(plan, ctx, chunks, ops)), ops)


def reduce_scatter(plan: TreePlan | TwoStepPlan, ctx: AxisContext, chunks, ops: HopOps, *,
                   encode_root: bool = True, lossy: "Lossy | None" = None):
  """The reduce phase: the full sum of chunk ``rank - plan.root`` (mod n).

  With ``encode_root`` (the all-reduce's first half) the root encodes its
  sum once more, for the gather phase to forward; without it (a
  reduce-scatter, which forwards nothing) the root keeps the decoded sum, one
  quantisation fewer. Each rank sends ``n - 1`` payloads of one chunk each:
  one per hop of a tree plan, all in one ``all_to_all`` for the two-step plan
  (:func:`two_step_sum`). ``lossy``: the two-step plan's reduce step loses packets
  (:class:`Lossy`).
  """
  n = plan.n
  if ctx.n != n:
    raise ValueError(f"plan is for n={n} but the axis has size {ctx.n}")
  r = ctx.rank()
  if isinstance(plan, TwoStepPlan):
    if n == 1:
      own = _take(chunks, 0)
      return ops.encode(own, jnp.int32(0), jnp.int32(1)) if encode_root else own
    if encode_root and lossy is None and ops.decode_sum_encode is not None:
      return ops.decode_sum_encode(two_step_exchange(ctx, chunks, ops), r, n)
    total = two_step_sum(ctx, chunks, ops, lossy)
    return ops.encode(total, r, jnp.int32(n)) if encode_root else total

  if lossy is not None:
    raise ValueError(f"lossy links run on schedule='two_step' only, not {plan.name!r}")

  def chunk(s):
    return chunk_index(r, s, n)

  if n == 1:
    own = _take(chunks, 0)
    final = ops.encode(own, jnp.int32(0), jnp.int32(0)) if encode_root else own
  else:
    unrolled = plan.steps <= UNROLL_MAX_STEPS and _lowering_platform() not in LOOP_PLATFORMS
    acc, recv = chunks, None
    for start, length in plan.segments():
      shift = plan.shift(start)
      before = plan.before(start)
      a0, a1 = plan.edges[start][0], plan.edges[min(start + 1, plan.steps - 1)][0]
      b0 = plan.edges[start - 1][1] if start > 0 else 0
      b1 = plan.edges[start][1]

      def step(j, carry, start=start, shift=shift, before=before, a0=a0, a1=a1, b0=b0, b1=b1):
        acc, recv = carry
        i = j - start  # position in the run: a_j = a0 + i (a1 - a0), b_{j-1} likewise
        c_send = chunk(a0 + i * (a1 - a0))
        with jax.named_scope("reduce/hop"):
          if before == "fused":
            payload = ops.decode_add_encode(recv, _take(acc, c_send), c_send, j)
          else:
            if before == "add":
              c_prev = chunk(b0 + i * (b1 - b0))
              acc = _put(acc, c_prev, ops.decode_add(recv, _take(acc, c_prev)))
            payload = ops.encode(_take(acc, c_send), c_send, jnp.asarray(j, jnp.int32))
          recv = ctx.ppermute(payload, _shift_perm(n, shift))
        return acc, recv

      if length == 1 or unrolled:
        for j in range(start, start + length):
          acc, recv = step(j, (acc, recv))
      else:
        acc, recv = jax.lax.fori_loop(start, start + length, step, (acc, recv))
    c_root = chunk(plan.root)
    with jax.named_scope("reduce/root"):
      if plan.fused(plan.steps - 1):
        if encode_root:
          final = ops.decode_add_encode(recv, _take(acc, c_root), c_root,
                                        jnp.int32(plan.steps))
        else:
          final = ops.decode_add(recv, _take(acc, c_root))
      else:
        c_prev = chunk(plan.edges[-1][1])
        acc = _put(acc, c_prev, ops.decode_add(recv, _take(acc, c_prev)))
        final = _take(acc, c_root)
        if encode_root:
          final = ops.encode(final, c_root, jnp.int32(plan.steps))
  return final


def trace_settings() -> tuple:
  """What the executor reads while tracing besides its arguments: the unrolling
  threshold, the loop platforms and the platform being lowered for (a cached
  trace of a bucket program is reused only where these are the same)."""
  return UNROLL_MAX_STEPS, tuple(LOOP_PLATFORMS), _lowering_platform()


def _lowering_platform() -> str:
  """The platform the enclosing program is traced for: the device platform of
  the abstract mesh in context (a ``shard_map``, or a compile-only topology's
  mesh), else the default backend (``vmap`` simulation, ``pmap``). (The kernel
  dispatch reads the mesh the same way, :func:`pallas_kernels.dispatch.mesh_platform`;
  schedules may not import the kernels.)"""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return device.platform if device is not None else jax.default_backend()


def all_gather(plan: TreePlan | TwoStepPlan, ctx: AxisContext, final, ops: HopOps):
  """The gather phase: every root's payload, forwarded unchanged, decoded everywhere.

  Returns the decoded chunks, leading axis n in chunk order, identical on
  every rank (each root adopts the decoded version of what it broadcast).
  """
  return decode_all(gather_payloads(plan, ctx, final), ops)


def gather_payloads(plan: TreePlan | TwoStepPlan, ctx: AxisContext, final,
                    chunk_order: bool = True):
  """The gather phase's collective: every root's final payload, leading axis n in chunk
  order (to decode with :func:`decode_all`, as late as the program likes), or with
  ``chunk_order=False`` in rank order as gathered, where chunk c is payload ``(c +
  plan.root) % n`` (for a decode that reads them so, without the copy that reorders).
  """
  with jax.named_scope("gather"):
    gathered = ctx.all_gather(final)  # [rank, ...]; rank s holds chunk s - root
    return in_chunk_order(gathered, plan.root) if chunk_order else gathered


def in_chunk_order(gathered, root: int):
  """Payloads gathered in rank order (leading axis n, rank ``(c + root) % n`` holding chunk
  c) put in chunk order (the two-step plan's ``root`` 0: as they are)."""
  return jax.tree.map(lambda g: jnp.roll(g, -root, axis=0), gathered) if root else gathered


def decode_all(payloads, ops: HopOps):
  """Every payload (leading axis n) decoded: ``ops.decode_many`` where the codec has a
  batched decode (one kernel launch for all n: DynamiQ). Else ``jax.vmap(ops.decode)``,
  but for up to :data:`UNROLL_MAX_STEPS` + 1 payloads, where the hops are unrolled too
  (not on :data:`LOOP_PLATFORMS`), one decode each, stacked: a kernel under ``vmap``
  runs as a loop over the batch, whose carried copies of the result held several
  buckets' worth of memory at once on XLA's GPU schedule. (On XLA:CPU, unrolled
  decodes of THC under ``simulate`` made one loop fusion whose code generation took
  minutes.)"""
  if ops.decode_many is not None:
    return ops.decode_many(payloads)
  n = jax.tree.leaves(payloads)[0].shape[0]
  if n > UNROLL_MAX_STEPS + 1 or _lowering_platform() in LOOP_PLATFORMS:
    return jax.vmap(ops.decode)(payloads)
  parts = [ops.decode(_take(payloads, c)) for c in range(n)]
  return jax.tree.map(lambda *p: jnp.stack(p), *parts)


class Lossy(NamedTuple):
  """The reduce step of a two-step plan over lossy links, on one receiving rank.

  Attributes:
    loss: the :class:`~dynamiq_jax.schedules.loss.PacketLoss` (its estimator).
    lost: bool ``[n, elements]``: which elements of each rank's decoded payload of this
      rank's chunk were lost (:meth:`~dynamiq_jax.schedules.loss.PacketLoss.lost_elements`;
      this rank's own row never: its own part crosses no link).
  """

  loss: Any
  lost: Any


def two_step_sum(ctx: AxisContext, chunks, ops: HopOps, lossy: Lossy | None = None):
  """The first step of :func:`two_step`: rank r's decoded sum of chunk r.

  Every rank encodes each of its n chunks (keys: chunk c, hop = its rank), one
  ``all_to_all`` gives rank r every rank's payload of chunk r, which it decodes
  and adds in rank order (0, 1, ..., n - 1: the same order on every rank and
  every backend; ``ops.decode_sum`` where given, a codec's own fixed order).
  Each rank sends ``n - 1`` chunk payloads: a reduce-scatter in one collective.
  With ``lossy``, the packets it lost are discarded and the sum is estimated
  from the rest (:func:`lossy_sum`).
  """
  received = two_step_exchange(ctx, chunks, ops)
  n, r = ctx.n, ctx.rank()
  with jax.named_scope("two_step/sum"):
    total = _decoded_sum(received, ops, n)
    if lossy is None:
      return total
  with jax.named_scope("two_step/lossy_sum"):
    return lossy_sum(received, total, ops, lossy, r)


def two_step_exchange(ctx: AxisContext, chunks, ops: HopOps):
  """The collective of :func:`two_step_sum`: every rank encodes each of its n chunks
  (keys: chunk c, hop = its rank) and one ``all_to_all`` gives rank r every rank's
  payload of chunk r (row s: rank s's)."""
  n, r = ctx.n, ctx.rank()
  with jax.named_scope("two_step/encode"):
    payloads = jax.vmap(lambda ch, c: ops.encode(ch, c, r))(chunks,
                                                            jnp.arange(n, dtype=jnp.int32))
  return ctx.all_to_all(payloads)


def _decoded_sum(received, ops: HopOps, n: int):
  if ops.decode_sum is not None:
    return ops.decode_sum(received)
  acc = ops.decode(_take(received, 0))
  for s in range(1, n):
    acc = ops.decode_add(_take(received, s), acc)
  return acc


def lossy_sum(received, total, ops: HopOps, lossy: Lossy, r):
  """Rank r's estimate of its chunk's sum from the packets that arrived.

  Every payload is decoded on its own; per packet, the contributions of the other
  ranks that arrived are summed in rank order and counted, and
  ``lossy.loss.combine`` makes the estimate with rank r's own and ``total``, the
  lossless sum (which it returns bit for bit at ``p = 0``).
  """
  values = jax.vmap(ops.decode)(received)
  leaves = jax.tree.leaves(values)
  if len(leaves) != 1 or not jnp.issubdtype(leaves[0].dtype, jnp.floating):
    raise ValueError(
        "this codec decodes a chunk to "
        f"{[(str(a.dtype), a.shape[1:]) for a in leaves]}, not one floating array of the "
        "chunk's coordinates, so a lost packet cannot be left out of its sum. Fix: a codec "
        "whose contributions add as values (DynamiQ, MX, IntGroup, Bf16, F32), or packet_loss=None")
  n = leaves[0].shape[0]
  flat = leaves[0].reshape(n, -1).astype(jnp.float32)
  rows = jnp.arange(n, dtype=jnp.int32)[:, None]
  came = ~lossy.lost & (rows != r)  # [n, elements]: another rank's value arrived
  others = jnp.where(came[0], flat[0], 0.0)
  for s in range(1, n):
    others = others + jnp.where(came[s], flat[s], 0.0)
  arrived = jnp.sum(came, axis=0, dtype=jnp.int32)
  own = jax.lax.dynamic_index_in_dim(flat, r, axis=0, keepdims=False)
  estimate = lossy.loss.combine(own, others, arrived.astype(jnp.float32), n,
                                total.reshape(-1).astype(jnp.float32))
  return estimate.reshape(total.shape).astype(total.dtype)


def two_step(ctx: AxisContext, chunks, ops: HopOps):
  """An all-reduce of ``chunks`` (leading axis n) in two collectives; the decoded chunks:
  :func:`execute` on the two-step plan.

  :func:`two_step_sum` (one ``all_to_all``: rank r decodes and adds every rank's
  payload of chunk r), one encode of that sum, and one all-gather that forwards
  those payloads unchanged for every rank to decode. Each rank sends ``n - 1``
  chunk payloads in each collective, as many bytes as a ring; every value is
  encoded twice, whatever n (a ring re-encodes at each of its n - 1 hops).
  """
  return execute(two_step_plan(ctx.n), ctx, chunks, ops)
