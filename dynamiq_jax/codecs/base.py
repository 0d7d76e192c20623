"""The codec contract: what a codec is, as data and pure functions.

A codec never sees an axis, a collective or the schedule executor.
:func:`dynamiq_jax.allreduce` runs each bucket in two passes and calls the
codec between them:

1. **metadata** (optional): ``local = codec.metadata(x, bucket, state, keys)``
   gives this rank's small arrays and how they combine across ranks
   (:class:`Metadata`: an elementwise ``"max"``, or a sum carried by another
   codec in two collectives, e.g. DynamiQ's statistics); ``allreduce``
   combines them, so every rank holds the same global metadata, bit for bit.
2. **payload**: ``codec.plan(x, meta, bucket, state, keys)`` cuts the local data
   into ``n`` chunks and returns the arrays the hops need (:class:`Plan`);
   the schedule moves payloads and calls the codec's hop functions
   ``encode``, ``decode``, ``decode_add`` and ``decode_add_encode`` on them;
   ``codec.finish`` turns the decoded chunks into the flat result (and the
   codec's next state).

Everything a hop needs travels as arguments: the chunk, the payload, the
plan's ``aux`` arrays and the random :class:`HopKeys` of that hop.

A complete example, a stochastic-rounding int8 codec in 30 lines, is in
docs/design.md ("Writing a codec"); ``tests/test_codec_contract.py`` runs it.
"""

from __future__ import annotations

import abc
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax._sizes import ceil_div, round_up
from pallas_kernels import rng

__all__ = [
    "Bucket", "Keys", "HopKeys", "bucket_key_states", "trace_settings", "Metadata", "Plan",
    "Codec", "padded_length", "pad_to", "round_up", "ceil_div", "partial_sum_energy",
    "key_rows", "tables_from_flat",
]

PyTree = Any

_UNROLL_SUM = 17
""":meth:`Codec.decode_sum` adds up to this many payloads unrolled, more in a loop."""


def padded_length(d: int, n: int) -> int:
  """``d`` rounded up to a multiple of ``n`` (so that it cuts into n equal chunks)."""
  return round_up(d, n)


def pad_to(x, length: int):
  """A flat array zero-padded at the end to ``length``."""
  return jnp.pad(x, (0, length - x.shape[0]))


def partial_sum_energy(total_sq, self_sq, n: int, partials: tuple[int, ...]):
  """Expected ``sum_k ||P_k||^2`` over the quantised partial sums of a reduction.

  A model with one common part ``c`` and independent parts ``e_r`` of equal
  size on every rank: ``E ||P_k||^2 = k s2 + k^2 c2`` for a partial of ``k``
  ranks. ``total_sq`` is ``||sum_r x_r||^2`` (the reduced result) and
  ``self_sq`` is ``sum_r ||x_r||^2``, per row (arrays of one shape); they give
  ``c2`` and ``s2``. ``self_sq=None`` assumes independent ranks (``c2 = 0``),
  the larger estimate for a given ``total_sq``.
  """
  k = np.asarray(partials, np.float64)
  a, b = np.float32(k.sum()), np.float32((k * k).sum())
  if self_sq is None or n == 1:
    return total_sq * (a / np.float32(n))
  c2 = jnp.clip((total_sq - self_sq) / np.float32(n * n - n), 0.0, self_sq / np.float32(n))
  s2 = self_sq / np.float32(n) - c2
  return s2 * a + c2 * b


class Bucket(NamedTuple):
  """Static description of one bucket of one all-reduce.

  Attributes:
    index: the bucket's position in the gradient (an int, or an int32 scalar that
      may be traced: a bucket program serves every bucket of its shape).
    d: coordinates in the bucket.
    n: ranks taking part.
    implementation: ``None``, ``"pallas"`` (Triton), ``"mosaic"`` (Mosaic GPU, DynamiQ
      only) or ``"xla"``: which implementation
      of its hop arithmetic a codec with Pallas kernels uses (the results are
      bit-identical; see :mod:`pallas_kernels.dynamiq`).
    scatter: the bucket is reduce-scattered (:func:`dynamiq_jax.reduce_scatter`):
      ``d`` is a multiple of ``n * granularity``, the rank that ends with chunk
      c needs exactly coordinates ``[c d/n, (c+1) d/n)``, so the plan must cut
      the chunks there (see :attr:`Codec.supports_scatter`).
  """

  index: int
  d: int
  n: int
  implementation: str | None = None
  scatter: bool = False


class Keys(NamedTuple):
  """The random key words of one bucket on one rank.

  Attributes:
    k0, k1: uint32 words of the user's key, identical on every rank.
    bucket: the bucket index (an int, or an int32 scalar).
    rank: int32 scalar, this rank's index on the axis.
    state: the fold state of :func:`pallas_kernels.rng.derive_key` after ``(k0,
      k1, bucket)``, the prefix of every stream of the bucket (computed once).
    tables: the keys the codec derives from ``state`` for this bucket
      (:meth:`Codec.key_tables`), computed for every bucket at once outside the
      bucket programs, or None (the codec derives them itself).
  """

  k0: Any
  k1: Any
  bucket: Any
  rank: Any
  state: Any = None
  tables: Any = None

  @classmethod
  def from_key(cls, key, *, bucket, rank) -> "Keys":
    """From a ``jax.random`` key (new-style or raw uint32 data)."""
    k0, k1, _ = bucket_key_states(key, 0)
    return cls(k0, k1, bucket, jnp.asarray(rank, jnp.int32),
               rng.absorb(rng.KEY_INIT, k0, k1, bucket))

  def derive(self, *words):
    """``(k0, k1)`` of the stream named by ``words`` (see :class:`pallas_kernels.rng.Stream`):
    ``rng.derive_key(k0, k1, bucket, *words)``."""
    return rng.finish_key(self.prefix(*words).state)

  def prefix(self, *words) -> "Keys":
    """These keys with ``words`` absorbed into the prefix: ``k.prefix(*a).derive(*b) ==
    k.derive(*a, *b)``, the common part computed once (the words may be arrays: the
    state is then one per element)."""
    state = self.state if self.state is not None else rng.absorb(
        rng.KEY_INIT, self.k0, self.k1, self.bucket)
    return self._replace(state=rng.absorb(state, *words))

  def at(self, chunk, hop) -> "HopKeys":
    """The keys of the encode of ``chunk`` sent at step ``hop`` (both kept as uint32
    scalars: words of the keys' hash, and table indices without sign handling)."""
    return HopKeys(self, _word(chunk), _word(hop))


def trace_settings() -> tuple:
  """What the codecs' kernels read while tracing besides their arguments (the kernel
  dispatch's switch and the platform of the mesh in context), so that a cached trace of
  a bucket program is reused only where they are the same."""
  from pallas_kernels import dispatch  # pylint: disable=import-outside-toplevel
  return (dispatch.MOSAIC_FIRST, dispatch.mesh_platform())


def bucket_key_states(key, count: int):
  """``(k0, k1, (s0, s1))``: the words of the user's ``jax.random`` key and, for each of
  ``count`` buckets b, the fold state after ``(k0, k1, b)`` (uint32 ``[count]`` each):
  what :meth:`Keys.from_key` computes for one bucket, for all of them at once."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if not jnp.issubdtype(key.dtype, jnp.integer):
    raise TypeError(f"key must be a jax.random key, got dtype {key.dtype}; pass "
                    f"jax.random.key(seed)")
  words = key.reshape(-1).astype(jnp.uint32)
  k0, k1 = rng.derive_key(*[words[i] for i in range(words.shape[0])])
  return k0, k1, rng.absorb(rng.KEY_INIT, k0, k1, jnp.arange(count, dtype=jnp.uint32))


def _word(v):
  """A non-negative index as a uint32 scalar (a Python int exactly; an array converted)."""
  if isinstance(v, (int, np.integer)):
    if v < 0:
      raise ValueError(f"a chunk or hop index must be >= 0, got {v}")
    return np.uint32(v)
  return jnp.asarray(v).astype(jnp.uint32)


class HopKeys(NamedTuple):
  """The keys of one encode: the bucket's :class:`Keys` plus chunk and hop (uint32
  scalars)."""

  keys: Keys
  chunk: Any
  hop: Any

  @property
  def rank(self):
    return self.keys.rank

  def derive(self, *words):
    return self.keys.derive(*words)

  def uniform(self, shape, *words):
    """float32 uniforms on [0, 1) for an array of ``shape``: element i draws from
    the stream ``words`` at counter i (e.g. ``Stream.USER, keys.chunk, keys.hop,
    keys.rank`` for this rank's private draws at this hop)."""
    k0, k1 = self.derive(*words)
    size = math.prod(shape)
    idx = jnp.arange(size, dtype=jnp.uint32).reshape(shape)
    return rng.uniform24(rng.hash_index(k0, k1, idx))


class Metadata(NamedTuple):
  """One rank's metadata and how ``allreduce`` combines it across ranks.

  Attributes:
    local: a pytree of arrays. With ``combine="max"``, any shapes; with a
      codec, chunks with a leading axis of size n.
    combine: ``"max"`` (elementwise maximum over ranks: exact in any order)
      or a :class:`Codec` that carries a sum in two collectives, in a fixed
      order (:func:`dynamiq_jax.schedules.executor.two_step`: each rank
      encodes its chunks, the owner of chunk c sums every rank's with
      :meth:`Codec.decode_sum`, encodes the sum, all ranks decode it; e.g.
      DynamiQ's statistics, OmniReduce's counts); the combined value is that
      codec's decoded chunks.
    kept: local values made in the same pass that the codec's own
      :meth:`Codec.plan` reads and no collective carries (None: none); the engine
      passes them as ``plan(..., kept=kept)`` (DynamiQ: its centring means).
  """

  local: PyTree
  combine: Any = "max"
  kept: PyTree = None


class Plan(NamedTuple):
  """What :meth:`Codec.plan` returns.

  Attributes:
    chunks: this rank's data cut into n chunks (leading axis n), a pytree.
    aux: whatever the hop functions and ``finish`` need besides a chunk and a
      payload (arrays, or static values): the codec's global metadata for
      this bucket, e.g. DynamiQ's super-group order and reduced means.
  """

  chunks: PyTree
  aux: PyTree = None


class Codec(abc.ABC):
  """How a partial sum is put on the wire at each hop.

  Subclasses are frozen dataclasses (hashable: valid static jit arguments)
  holding only configuration. Every method is a pure function of its
  arguments.

  Class attributes:
    granularity: bucket sizes must be multiples of it (a codec's blocks never
      straddle buckets).
    reports_contribution: :meth:`contribution` is implemented (error feedback
      needs it).
    default_error_feedback: what :func:`dynamiq_jax.compressed_psum` feeds back
      when its ``error_feedback`` is None: ``False``, ``"ef14"`` or ``"ef21m"``.
    self_scaled: every payload carries its own scales, computed at each encode, and
      a non-finite value decodes as non-finite: the codec needs no agreed scale
      before it runs (:func:`dynamiq_jax.tp_psum` then skips the guard's
      all-reduce).
    result_dtype: the dtype a bucket's reduced gradient is rounded to and kept in
      until the optimizer reads it (its leaves get their own dtypes back there).
      bfloat16, as ``psum`` of bf16 gradients gives, for every lossy codec: the
      rounding's relative error (at most 2^-9, a relative MSE near 3e-6) is small
      beside the codec's own. The cast codecs (and THC, Global-QSGD and OmniReduce,
      built on them) keep their payload's precision; ARC-Top-K its element codec's.
  """

  granularity: int = 1
  result_dtype: Any = jnp.dtype(jnp.bfloat16)
  reports_contribution: bool = False
  self_scaled: bool = False
  default_error_feedback: bool | str = False

  # -- static description -----------------------------------------------------

  @abc.abstractmethod
  def wire_bits(self, d: int, n: int) -> int:
    """Exact bits one all-reduce of ``d`` coordinates over ``n`` ranks puts on the wire.

    Payloads and metadata, padding included. Each rank of a bandwidth-optimal
    schedule sends ``2 (n - 1) / n`` of it, so ``wire_bits / d`` is the
    paper's bits per coordinate.
    """

  def compresses(self, d: int, n: int) -> bool:
    """Whether a bucket of ``d`` coordinates over ``n`` ranks is compressed.

    ``allreduce`` sends a bucket the codec declines as bf16 partial sums
    (``AllReduceStats.uncompressed`` counts them): a codec whose format
    cannot meet its budget on a small bucket declines it, rather than failing
    or sending noise. A codec that cannot meet its budget on any bucket
    raises instead.
    """
    del d, n
    return True

  def key_tables(self, keys: Keys, n: int) -> PyTree:
    """The random keys this codec derives for one bucket over ``n`` ranks, from
    ``keys.state`` alone (None: none).

    The bucket engine computes them for every bucket at once, outside the bucket
    programs, and hands each program its bucket's as :attr:`Keys.tables`: derived
    inside, their hashes are a few hundred HLO instructions that XLA's passes visit
    again for every bucket. A codec reading ``keys.tables`` must give the same bits
    as when it is None (it derives them then).
    """
    del keys, n
    return None

  @property
  def stateful(self) -> bool:
    """Whether the codec carries state from one all-reduce to the next."""
    return False

  def init_state(self, d: int, n: int) -> PyTree:
    """The state of a bucket before its first all-reduce (None: stateless).

    Its structure and shapes do not depend on ``n``; only its values do.
    """
    del d, n
    return None

  @property
  def supports_scatter(self) -> bool:
    """Whether the codec can run a reduce-scatter (:func:`dynamiq_jax.reduce_scatter`).

    True means: for a bucket with ``bucket.scatter`` (``d`` a multiple of
    ``n * granularity``), :meth:`plan`'s chunk c holds coordinates
    ``[c d/n, (c+1) d/n)`` of ``x`` (in any order inside the chunk), and
    :meth:`finish`'s output there depends only on chunk c and ``aux``; so the
    owner of chunk c can finish it alone. A codec that mixes coordinates
    across chunks (a rotation, a top-k packing) cannot.
    """
    return False

  def metadata_bits(self, d: int, n: int) -> int:
    """The part of :meth:`wire_bits` that the metadata pass sends (a full all-reduce
    even in a reduce-scatter, which sends only ``(n - 1) / n`` of the rest)."""
    del d, n
    return 0

  # -- pass 1: metadata -----------------------------------------------------------

  def metadata(self, x, bucket: Bucket, state, keys: Keys | None = None) -> Metadata | None:
    """This rank's metadata for ``x`` (flat float32 [d]); None if none is needed.

    ``keys`` are the bucket's random keys (as for :meth:`plan`), for metadata
    drawn from shared randomness (ARC-Top-K's sketch).
    """
    del x, bucket, state, keys
    return None

  # -- pass 2: payload -------------------------------------------------------------

  @abc.abstractmethod
  def plan(self, x, meta, bucket: Bucket, state, keys: Keys) -> Plan:
    """Cuts ``x`` (flat float32 [d]) into n chunks, given the global metadata.

    ``keys`` are the bucket's random keys, for a codec that quantises each
    rank's data once before the schedule (THC, Global-QSGD).
    """

  @abc.abstractmethod
  def encode(self, chunk, aux, keys: HopKeys):
    """One chunk (a partial sum, float32 or int32) -> its payload."""

  @abc.abstractmethod
  def decode(self, payload, aux):
    """A payload -> the partial sum it carries (the chunk's shape)."""

  def decode_add(self, payload, chunk, aux):
    """``decode(payload) + chunk``."""
    return jax.tree.map(lambda p, x: p + x, self.decode(payload, aux), chunk)

  def decode_add_encode(self, payload, chunk, aux, keys: HopKeys):
    """One ring hop: ``encode(decode(payload) + chunk)``; kernels fuse it."""
    return self.encode(self.decode_add(payload, chunk, aux), aux, keys)

  def decode_sum(self, payloads, aux):
    """The sum of ``n`` decoded payloads (leading axis n): what one rank of a two-step
    reduction holds once every rank's payload of its chunk has arrived.

    The default adds them in rank order, ``decode_add(p[n-1], ... decode_add(p[1],
    decode(p[0])))``; a codec may override it with any other order that is fixed
    (the same on every rank and backend), e.g. a pairwise tree, or with a kernel.
    """
    n = jax.tree.leaves(payloads)[0].shape[0]
    take = lambda s: jax.tree.map(lambda a: a[s], payloads)  # noqa: E731
    acc = self.decode(take(0), aux)
    if n <= _UNROLL_SUM:
      for s in range(1, n):
        acc = self.decode_add(take(s), acc, aux)
      return acc
    return jax.lax.fori_loop(1, n, lambda s, a: self.decode_add(take(s), a, aux), acc)

  def decode_sum_encode(self, payloads, aux, keys: HopKeys):
    """``encode(decode_sum(payloads))``: the owner's step of a two-step reduction, ending
    in the payload it forwards. A codec overrides it to fuse the two, with the same
    bits (DynamiQ's statistics: one kernel); the executor calls a codec's own."""
    return self.encode(self.decode_sum(payloads, aux), aux, keys)

  def decode_many(self, payloads, aux):
    """Every gathered payload decoded: payloads (leading axis n) -> the partial sums they
    carry (leading axis n), each as :meth:`decode` gives it.

    The default decodes them one by one (``jax.vmap`` of :meth:`decode`). A codec with
    a batched kernel overrides it (DynamiQ: one launch for all n). The schedule
    executor calls a codec's own; for one without, it decodes the payloads itself
    (one decode each where the hops are unrolled: a kernel under ``vmap`` runs as a
    loop).
    """
    return jax.vmap(lambda p: self.decode(p, aux))(payloads)

  def decode_finish(self, payloads, aux, bucket: Bucket, state, rotate: int = 0, dtype=None,
                    partials: tuple[int, ...] | None = None):
    """``finish(decode_many(chunks), aux, bucket, state)``: the gathered payloads
    (leading axis n, in rank order: chunk c is payload ``(c + rotate) % n``) decoded and
    finished at once -> ``(flat [d], new state, estimate)``, float32, or rounded to
    ``dtype`` (the engine's :attr:`result_dtype`: a kernel can store its result so);
    ``estimate``: :meth:`error_estimate` with ``partials`` (None without them: no
    estimate made).

    A codec overrides it to fuse the two, with the same results (DynamiQ: one kernel
    decodes each super-group straight into its place and adds its mean, reading the
    payloads in chunk order where they lie); the bucket engine calls a codec's own, and
    for one without, puts the payloads in chunk order, decodes and finishes apart.
    """
    chunks = jax.tree.map(lambda p: jnp.roll(p, -rotate, axis=0), payloads) if rotate \
        else payloads
    out, state = self.finish(self.decode_many(chunks, aux), aux, bucket, state)
    err = None if partials is None else self.error_estimate(out, aux, bucket, partials)
    return (out if dtype is None else out.astype(dtype)), state, err

  @abc.abstractmethod
  def finish(self, decoded, aux, bucket: Bucket, state):
    """Decoded chunks (leading axis n) -> ``(flat float32 [d], new state)``."""

  def error_estimate(self, out, aux, bucket: Bucket, partials: tuple[int, ...]):
    """The expected squared error ``||out - exact sum||^2`` this bucket's
    all-reduce added (the units of ``x``), or None: a float32 scalar, or an array
    of terms whose sum it is (DynamiQ: one per super-group), which the engine
    sums with the other buckets' in one operation (:func:`dynamiq_jax.buckets.error_total`).

    Computed from what the codec already has (its aux, the reduced ``out``);
    ``partials`` (:meth:`TreePlan.partials`) says how many ranks' data each
    quantised partial sum of a chunk carries. None: the codec makes no
    estimate (``AllReduceStats.error_estimate`` is then NaN).
    """
    del out, aux, bucket, partials
    return None

  def contribution(self, x, aux, bucket: Bucket):
    """This rank's ``x`` as the codec represented it in the sum (flat float32 [d])."""
    raise NotImplementedError(
        f"{type(self).__name__} does not report a rank's own contribution "
        f"(reports_contribution=False), which error feedback needs; use "
        f"error_feedback=False with it")


def _table_shapes(codec: "Codec", n: int):
  probe = Keys(None, None, None, None, (jnp.uint32(0), jnp.uint32(0)))
  return jax.eval_shape(lambda: codec.key_tables(probe, n))


def tables_from_flat(codec: "Codec", keys: Keys, n: int, flat):
  """``codec``'s key tables (:meth:`Codec.key_tables`) from their flat uint32 words
  ``flat`` (a row of :func:`key_rows` less its first two words)."""
  shapes = _table_shapes(codec, n)
  leaves, treedef = jax.tree.flatten(shapes)
  out, at = [], 0
  for leaf in leaves:
    size = math.prod(leaf.shape)
    out.append(flat[at:at + size].reshape(leaf.shape).astype(leaf.dtype))
    at += size
  return jax.tree.unflatten(treedef, out)


def key_rows(codec: "Codec", n: int, s0, s1):
  """uint32 ``[buckets, 2 + t]``: each bucket's prefix state ``(s0, s1)`` and ``codec``'s
  key tables (:meth:`~dynamiq_jax.codecs.Codec.key_tables`), flat; computed for every
  bucket at once, so that the bucket programs hold no hash of their own. None if the
  codec has no key tables."""
  leaves = jax.tree.leaves(_table_shapes(codec, n))
  if not leaves or any(leaf.dtype != jnp.uint32 for leaf in leaves):
    return None

  def one(a, b):
    tables = codec.key_tables(Keys(None, None, None, None, (a, b)), n)
    return jnp.concatenate([jnp.stack([a, b])] + [t.reshape(-1) for t in jax.tree.leaves(tables)])

  return jax.vmap(one)(s0, s1)
