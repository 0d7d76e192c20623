"""What every codec gives the schedule executor.

A codec is a frozen dataclass (hashable, safe as a static jit argument) with
two methods:

* ``granularity`` (optional class attribute, default 1): bucket sizes must be
  multiples of it, so that the codec's blocks never straddle buckets.
* ``reports_contribution`` (optional class attribute, default False): True
  if ``prepare`` returns ``own`` (error feedback needs it).
* ``wire_bits(d, n)``: the exact number of bits one all-reduce of ``d``
  coordinates over ``n`` ranks puts into payloads, metadata included. Each
  rank of a bandwidth-optimal schedule sends ``2 (n - 1) / n`` of it, so
  ``wire_bits / d`` is the paper's bits per coordinate.
* ``init_state(d, n)`` (optional): the codec's state for one bucket, carried
  across steps by the optax transform (e.g. MX's scale multiplier, OmniReduce's
  local top-k fraction); identical on every rank. Default: no state.
* ``prepare(x, *, ctx, run, key_words, bucket, implementation, state)``:
  takes this rank's flat float32 bucket ``x`` (already pre-divided by ``n``
  when averaging), runs any metadata collective it needs (through ``run``,
  the schedule executor, or a ``pmax``), and returns :class:`Prepared`: the
  local data cut into ``n`` chunks, the per-hop operations, a ``finish``
  function that turns the decoded chunks back into a flat float32 vector of
  length ``len(x)`` and the next state, and optionally ``own``: this rank's
  contribution as the codec represented it (for error feedback).
  ``implementation`` (None, "pallas" or "xla") selects Pallas kernels where
  the codec has them (:mod:`pallas_kernels.dynamiq`).

Chunks and payloads are pytrees of arrays; a chunk's arrays are the local
data of one chunk index, the ``chunks`` pytree carries a leading axis of
size ``n``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp

__all__ = ["AxisContext", "HopOps", "Prepared", "Codec", "Runner", "simple_ops", "cast_ops",
           "is_stateful"]

PyTree = Any


@dataclasses.dataclass(frozen=True)
class AxisContext:
  """The collective axis as seen from inside ``shard_map``/``pmap``/``vmap``.

  Attributes:
    axis_name: the bound axis name.
    n: its size.
    invariant_gather: True under ``shard_map(check_vma=True)``: gathers must
      return values typed as invariant over the axis.
  """

  axis_name: Any
  n: int
  invariant_gather: bool = False

  def rank(self):
    return jax.lax.axis_index(self.axis_name)

  def all_gather(self, tree):
    kw = {"to": "invarying"} if self.invariant_gather else {}
    return jax.tree.map(lambda a: jax.lax.all_gather(a, self.axis_name, **kw), tree)

  def pmax(self, x):
    return jax.lax.pmax(x, self.axis_name)


class HopOps(NamedTuple):
  """Per-hop operations of a codec, closed over this call's metadata.

  ``c`` is the chunk index and ``hop`` the step at which the payload is sent
  (both int32 scalars, possibly traced); they key the random streams.
  """

  encode: Callable[[PyTree, Any, Any], PyTree]
  decode: Callable[[PyTree], PyTree]
  decode_add_encode: Callable[[PyTree, PyTree, Any, Any], PyTree]
  decode_add: Callable[[PyTree, PyTree], PyTree]


class Prepared(NamedTuple):
  """What ``prepare`` returns.

  Attributes:
    chunks: local data, leading axis n.
    ops: the per-hop operations.
    finish: ``finish(decoded_chunks) -> (flat float32 [len(x)], new_state)``.
    own: ``own() -> flat float32 [len(x)]``, this rank's input as the
      codec represented it in the sum (None if the codec cannot say).
  """

  chunks: PyTree
  ops: HopOps
  finish: Callable[[PyTree], tuple[jax.Array, PyTree]]
  own: Callable[[], jax.Array] | None = None


Runner = Callable[[PyTree, HopOps], PyTree]
"""``run(chunks, ops) -> decoded chunks``: one schedule execution."""


class Codec(Protocol):

  def wire_bits(self, d: int, n: int) -> int:
    ...

  def prepare(self, x: jax.Array, *, ctx: AxisContext, run: Runner,
              key_words: tuple[jax.Array, jax.Array], bucket: int,
              implementation: str | None = None, state: PyTree = None) -> Prepared:
    ...


def is_stateful(codec) -> bool:
  """Whether ``codec`` carries state from one all-reduce to the next (MX's adaptive
  scale, OmniReduce's k): it then defines ``init_state`` and it returns a state."""
  init = getattr(codec, "init_state", None)
  return init is not None and init(1, 2) is not None


def simple_ops(encode, decode) -> HopOps:
  """HopOps for a codec whose hops are plain decode / add / encode."""

  def dae(payload, chunk, c, hop):
    return encode(jax.tree.map(lambda p, x: p + x, decode(payload), chunk), c, hop)

  def da(payload, chunk):
    return jax.tree.map(lambda p, x: p + x, decode(payload), chunk)

  return HopOps(encode=encode, decode=decode, decode_add_encode=dae, decode_add=da)


def cast_ops(wire_dtype, value_dtype=None) -> HopOps:
  """HopOps whose payload is the partial sum cast to ``wire_dtype``.

  Decoding gives ``value_dtype`` (float32 for floating payloads, int32 for
  integer ones); a hop adds in that dtype and casts back.
  """
  if value_dtype is None:
    value_dtype = jnp.int32 if jnp.issubdtype(wire_dtype, jnp.integer) else jnp.float32

  def encode(chunk, c, hop):
    del c, hop
    return chunk.astype(wire_dtype)

  def decode(payload):
    return payload.astype(value_dtype)

  return simple_ops(encode, decode)
