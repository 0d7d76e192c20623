"""ARC-Top-K (Chen, Ma, Li, He, Dong, Yuan): an all-reduce compatible Top-K.

Top-K sparsification keeps the largest coordinates of a gradient, but every
rank picks different ones, so it needs an all-gather of values and indices.
ARC-Top-K makes every rank pick the same *rows*, from a small sketch that the
ranks sum, so the selected rows are summed by an ordinary all-reduce with no
indices on the wire. Per bucket:

1. The bucket is read as rows of ``row`` coordinates (``h = ceil(d / row)``
   rows, the last zero-padded). Every rank draws the same Gaussian matrix
   ``V`` (``row x rank``) from the bucket's random key: no communication.
2. **Metadata pass**: each rank's sketch ``P_i = X_i V`` (``h x rank``,
   float32) is summed over the ranks in a fixed order (two collectives, the
   same bits on every rank, whatever the payload's schedule).
3. Row scores are the squared row norms of the summed sketch, an unbiased
   estimate (times ``rank``) of the squared norms of the rows of the reduced
   gradient; the ``k`` highest-scoring rows are selected (ties: the lower
   row), identically on every rank.
4. **Payload**: the ``k`` selected rows (``k x row`` values) are reduced by
   the schedule through the element codec ``values`` (bf16 partial sums by
   default); every other row decodes to zero.

``k = max(1, floor(ratio x h))``, rounded up to a multiple of ``n`` (the
payload cuts into n equal chunks; the extra rows are the next-best rows, not
padding). ``rank=None`` is the exact variant (the authors' "ArcTopK" without
sketch: ``V`` the identity, ``P_i = X_i``): the selection is then the exact
top-k rows of the reduced gradient, at the cost of a full float32 metadata
all-reduce (32 bits per coordinate); a reference, not for production.

**Rows of the flat bucket, not of the leaves.** The authors' DDP hook takes
the rows of each 2-D parameter (1-D: each coordinate its own row, sketched by
itself; more dimensions: reshaped). The library's buckets lay the leaves end
to end so that every bucket has one shape (one compiled program, see
:func:`dynamiq_jax.bucket_layout`); ARC-Top-K therefore selects fixed-width
rows of that flat sequence. Where ``row`` divides a leaf's last dimension
(the usual case: powers of two), a selected row is a contiguous piece of one
of the leaf's rows; 1-D leaves (biases, norms) share rows with their
neighbours instead of being sketched coordinate by coordinate (which costs
their full size in metadata). docs/results.md (*ARC-Top-K*) measures the two
rules on the same gradients.

Top-K is biased: the optax transform pairs it with EF14 error feedback by
default (``compressed_psum(codec=ARCTopK())``, see
:func:`dynamiq_jax.compressed_psum`'s ``error_feedback``). The ARC-Top-K authors
use EF21-M; on ``bench.arctopk``'s regressions and LM, EF21-M trained worse than
no feedback under AdamW, EF14 never did (docs/results.md, *ARC-Top-K*).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs.base import Bucket, Codec, Metadata, Plan, ceil_div, pad_to, round_up
from dynamiq_jax.codecs.bf16 import F32, Bf16
from dynamiq_jax.codecs.mx import MX
from pallas_kernels import rng

__all__ = ["ARCTopK", "RowSelection"]

_VALUES = {"bf16": Bf16, "f32": F32,  # the selected rows' element codecs, by name
           "mxfp8": lambda: MX(element="e4m3", scale="e8m0"),  # OCP MX: E8M0 block scales,
           "mxfp4": lambda: MX(element="e2m1", scale="e8m0")}  # no metadata pass


def _check_values(values) -> None:
  """Refuses, by name, a ``values`` that :attr:`RowSelection.element` cannot use."""
  if isinstance(values, str):
    if values not in _VALUES:
      raise ValueError(f"values={values!r} must be one of {sorted(_VALUES)} or a codec "
                       f"without a metadata pass, e.g. codecs.MX(element='e4m3', scale='e8m0')")
    return
  if not isinstance(values, Codec):
    raise TypeError(f"values={values!r} must be 'bf16', 'f32' or a dynamiq_jax codec")
  if values.stateful or isinstance(values, RowSelection) or _has_metadata(values):
    raise ValueError(
        f"values={values!r}: the selected rows go through a stateless element codec with no "
        f"metadata pass of its own (one metadata pass per bucket: the sketch); use 'bf16', "
        f"'f32' or codecs.MX(element='e4m3', scale='e8m0')")


def _has_metadata(codec: Codec) -> bool:
  """Whether ``codec`` runs a metadata pass (traced abstractly on a small bucket)."""
  found = []
  d = 2 * codec.granularity

  def probe(x):
    found.append(codec.metadata(x, Bucket(0, d, 2), None) is not None)
    return x

  jax.eval_shape(probe, jax.ShapeDtypeStruct((d,), jnp.float32))
  return found[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowSelection(Codec):
  """Shared body of codecs that all-reduce the same ``k`` rows of a bucket on every rank.

  Subclasses choose the rows (:meth:`select`) from the metadata every rank
  shares; the rows go through the element codec ``values``, the other rows
  decode to zero. Top-k selections are biased: ``default_error_feedback``
  is EF14.
  """

  reports_contribution = True
  supports_scatter = False  # the selected rows of every chunk are gathered into one payload
  default_error_feedback = "ef14"

  ratio: float = 0.2
  row: int = 256
  values: Any = "bf16"

  def __post_init__(self):
    if not (isinstance(self.ratio, (int, float)) and 0 < self.ratio <= 1):
      raise ValueError(f"ratio={self.ratio!r} must be in (0, 1]: the fraction of rows sent")
    if not isinstance(self.row, (int, np.integer)) or self.row < 1:
      raise ValueError(f"row={self.row!r} must be a positive integer (coordinates per row)")
    _check_values(self.values)

  @property
  def granularity(self) -> int:
    return self.row

  @property
  def result_dtype(self):
    """The element codec's: the selected rows' sums are kept in its precision."""
    return self.element.result_dtype

  @property
  def element(self) -> Codec:
    """The element codec the selected rows travel through (checked when built)."""
    return _VALUES[self.values]() if isinstance(self.values, str) else self.values

  def rows(self, d: int, n: int) -> tuple[int, int]:
    """``(h, k)``: the bucket's rows and the rows sent (a multiple of ``n``)."""
    h = ceil_div(d, self.row)
    k = max(1, int(np.floor(self.ratio * h)))
    return h, min(round_up(k, n), round_up(h, n))

  def _payload_bucket(self, bucket: Bucket) -> Bucket:
    _, k = self.rows(bucket.d, bucket.n)
    return Bucket(bucket.index, k * self.row, bucket.n, bucket.implementation)

  def wire_bits(self, d: int, n: int) -> int:
    _, k = self.rows(d, n)
    return self.metadata_bits(d, n) + self.element.wire_bits(k * self.row, n)

  def _matrix(self, x, bucket: Bucket):
    """``x`` as ``[round_up(h, n), row]`` (zero rows at the end)."""
    h, _ = self.rows(bucket.d, bucket.n)
    return pad_to(x, round_up(h, bucket.n) * self.row).reshape(-1, self.row)

  def select(self, meta, bucket: Bucket, keys):
    """The selected rows' indices (int32 ``[k]``, ascending), identical on every rank."""
    raise NotImplementedError

  def plan(self, x, meta, bucket, state, keys):
    del state
    idx = self.select(meta, bucket, keys)
    chosen = self._matrix(x, bucket)[idx].reshape(-1)
    p = self.element.plan(chosen, None, self._payload_bucket(bucket), None, keys)
    return Plan(p.chunks, RowsAux(idx, p.aux, meta))

  def encode(self, chunk, aux, keys):
    return self.element.encode(chunk, aux.inner, keys)

  def decode(self, payload, aux):
    return self.element.decode(payload, aux.inner)

  def decode_add(self, payload, chunk, aux):
    return self.element.decode_add(payload, chunk, aux.inner)

  def decode_add_encode(self, payload, chunk, aux, keys):
    return self.element.decode_add_encode(payload, chunk, aux.inner, keys)

  def decode_sum(self, payloads, aux):
    return self.element.decode_sum(payloads, aux.inner)

  def _scatter_rows(self, rows, idx, bucket: Bucket):
    h_pad = round_up(self.rows(bucket.d, bucket.n)[0], bucket.n)
    out = jnp.zeros((h_pad, self.row), jnp.float32).at[idx].set(rows.reshape(-1, self.row),
                                                                unique_indices=True)
    return out.reshape(-1)[:bucket.d]

  def finish(self, decoded, aux, bucket, state):
    inner_bucket = self._payload_bucket(bucket)
    rows, _ = self.element.finish(decoded, aux.inner, inner_bucket, None)
    return self._scatter_rows(rows, aux.idx, bucket), state

  def contribution(self, x, aux, bucket):
    inner_bucket = self._payload_bucket(bucket)
    chosen = self._matrix(x, bucket)[aux.idx].reshape(-1)
    return self._scatter_rows(self.element.contribution(chosen, aux.inner, inner_bucket),
                              aux.idx, bucket)

  def error_estimate(self, out, aux, bucket, partials):
    """The element codec's estimate on the selected rows; the dropped rows' energy
    is added by subclasses that can estimate it (:meth:`dropped_energy`)."""
    inner_bucket = self._payload_bucket(bucket)
    rows = self._matrix(out, bucket)[aux.idx].reshape(-1)
    inner = self.element.error_estimate(rows, aux.inner, inner_bucket, partials)
    dropped = self.dropped_energy(aux, bucket)
    if inner is None or dropped is None:
      return None
    return inner + dropped

  def dropped_energy(self, aux, bucket):
    """Estimated ``||reduced rows not sent||^2`` (None: no estimate)."""
    del aux, bucket
    return None


class RowsAux(NamedTuple):
  """The selected rows, the element codec's aux, and the shared metadata (the summed sketch)."""

  idx: jax.Array
  inner: Any
  meta: Any


def _scaled_squares(s):
  """Row sums of squares of ``s`` [h, r], scaled by one power of two (the same on every
  rank, exact) so that they cannot overflow; non-finite rows rank first."""
  m = jnp.max(jnp.where(jnp.isfinite(s), jnp.abs(s), 0.0))
  _, e = jnp.frexp(jnp.where(m > 0, m, 1.0))
  t = jnp.ldexp(s, -e)
  return jnp.sum(t * t, axis=-1), e


def gaussian(keys, shape, *words):
  """Standard normal float32 draws of ``shape`` from the stream ``words`` of ``keys``,
  identical on every rank (Box-Muller on the library's counter-based hash)."""
  k0, k1 = keys.derive(*words)
  size = int(np.prod(shape))
  i = jnp.arange(size, dtype=jnp.uint32)
  u1 = rng.uniform24(rng.hash_index(k0, k1, 2 * i))
  u2 = rng.uniform24(rng.hash_index(k0, k1, 2 * i + 1))
  radius = jnp.sqrt(-2.0 * jnp.log1p(-u1))  # u1 < 1: finite
  return (radius * jnp.cos(np.float32(2 * np.pi) * u2)).reshape(shape)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ARCTopK(RowSelection):
  """ARC-Top-K: the same top rows on every rank, chosen from a summed random sketch.

  Args:
    ratio: fraction of rows sent (0.2 in the paper's LLM runs).
    rank: columns of the Gaussian sketch ``V`` (4, the authors' default); None:
      the exact variant (``V`` the identity: a full float32 metadata all-reduce).
    row: coordinates per row (the bucket read as rows of this width).
    values: the selected rows' element codec: ``"bf16"`` (bf16 partial sums),
      ``"f32"``, ``"mxfp8"`` (OCP MX E4M3 elements, E8M0 scales per 32: 8.25 bits),
      ``"mxfp4"`` (E2M1: 4.25 bits), or a stateless codec without a metadata pass
      (e.g. ``codecs.MX(element="e3m2", scale="e8m0")``).

  Bits per coordinate: ``32 rank / row`` for the sketch plus ``k / h`` (``ratio``,
  rounded up to whole chunks) times the element codec's (16 for bf16, 4.25 for
  mxfp4): 3.72 at the defaults.

  Examples:
    >>> from dynamiq_jax.codecs import ARCTopK
    >>> c = ARCTopK(ratio=0.2, rank=4, row=256)
    >>> round(c.wire_bits(1 << 20, 8) / (1 << 20), 3)
    3.719
    >>> round(ARCTopK(ratio=0.8, values="mxfp4").wire_bits(1 << 20, 8) / (1 << 20), 3)
    3.903
  """

  rank: int | None = 4

  def __post_init__(self):
    super().__post_init__()
    if self.rank is not None and (not isinstance(self.rank, (int, np.integer)) or self.rank < 1):
      raise ValueError(f"rank={self.rank!r} must be a positive integer (sketch columns), or "
                       f"None for the exact variant")

  def _sketch_width(self) -> int:
    return self.row if self.rank is None else int(self.rank)

  def metadata_bits(self, d: int, n: int) -> int:
    h, _ = self.rows(d, n)
    return 32 * round_up(round_up(h, n) * self._sketch_width(), n)

  def sketch_matrix(self, keys):
    """The shared Gaussian ``V`` [row, rank] of this bucket (the same on every rank)."""
    return gaussian(keys, (self.row, int(self.rank)), rng.Stream.ARCTOPK_SKETCH)

  def metadata(self, x, bucket, state, keys=None):
    del state
    if keys is None:
      raise ValueError("ARCTopK.metadata needs the bucket's keys (the shared sketch)")
    with jax.named_scope("arctopk/sketch"):
      xm = self._matrix(x, bucket)
      if self.rank is None:
        p = xm
      else:
        p = jnp.dot(xm, self.sketch_matrix(keys), precision=jax.lax.Precision.HIGHEST)
    n = bucket.n
    return Metadata(pad_to(p.reshape(-1), round_up(p.size, n)).reshape(n, -1), combine=F32())

  def _summed(self, meta, bucket):
    h, _ = self.rows(bucket.d, bucket.n)
    w = self._sketch_width()
    return meta.reshape(-1)[:round_up(h, bucket.n) * w].reshape(-1, w)

  def select(self, meta, bucket, keys):
    del keys
    h, k = self.rows(bucket.d, bucket.n)
    with jax.named_scope("arctopk/select"):
      scores, _ = _scaled_squares(self._summed(meta, bucket))
      live = jnp.arange(scores.shape[0]) < h
      scores = jnp.where(live, jnp.where(jnp.isnan(scores), jnp.inf, scores), -1.0)
      _, idx = jax.lax.top_k(scores, k)
      return jnp.sort(idx).astype(jnp.int32)

  def dropped_energy(self, aux, bucket):
    """The sketch's estimate of the rows not sent: ``sum ||S_row||^2 / rank`` over them
    (exact for ``rank=None``)."""
    s = self._summed(aux.meta, bucket)
    scores, e = _scaled_squares(s)
    kept = jnp.zeros(scores.shape, bool).at[aux.idx].set(True)
    total = jnp.sum(jnp.where(kept, 0.0, scores))
    return jnp.ldexp(total, 2 * e) / np.float32(self._sketch_width() if self.rank else 1)
