"""OmniReduce (Fei et al., SIGCOMM 2021) as the DynamiQ authors adapted it: block top-k.

Per bucket, every rank ranks its ``block``-coordinate blocks by local L2
norm and marks its local top-k; the marks are summed across ranks (an
all-reduce of one uint8 count per block) and the union of marked blocks is
all-reduced *uncompressed* (bf16 partial sums, like the BF16 baseline);
every other block is zero. The local k adapts from step to step so that the
union covers ``density`` of the blocks, with the authors' momentum rule
(``k <- 0.75 k + 0.25 k / clip(|union| / target, 0.6, 1/0.6)``), carried as
codec state by the optax transform.

Static shapes: the dense part is a fixed ``capacity = density x blocks``
(rounded up to whole chunks), so the wire cost is fixed (``16 density + 8 /
block`` bits per coordinate: 8.03 at the default 0.5) and never exceeded.
When the union is larger than the capacity, its blocks marked by the most
ranks are kept (ties: lower index); when smaller, the spare slots carry
zeros. Top-k is biased: pair it with ``compressed_psum(error_feedback=True)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs._exact import row_norm
from dynamiq_jax.codecs.base import Metadata, Plan, ceil_div, pad_to, round_up
from dynamiq_jax.codecs.bf16 import Cast

__all__ = ["OmniReduce"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OmniReduce(Cast):
  """Block top-k with a union of local selections, values sent uncompressed.

  Args:
    density: target fraction of blocks in the union (0.5 = 8 bits/coordinate).
    block: coordinates per block (256, OmniReduce's default).
    momentum: weight of the old local k in the adaptation (0.75, the
      authors' simulator).

  Examples:
    >>> from dynamiq_jax.codecs import OmniReduce
    >>> round(OmniReduce().wire_bits(1 << 20, 8) / (1 << 20), 3)
    8.031
  """

  reports_contribution = True

  _dtype = jnp.bfloat16  # the union's blocks travel as bf16 partial sums

  density: float = 0.5
  block: int = 256
  momentum: float = 0.75

  def __post_init__(self):
    if not 0 < self.density <= 1:
      raise ValueError(f"density={self.density} must be in (0, 1]")
    if self.block < 1:
      raise ValueError(f"block={self.block} must be >= 1")
    if not 0 <= self.momentum < 1:
      raise ValueError(f"momentum={self.momentum} must be in [0, 1)")

  @property
  def granularity(self) -> int:
    return self.block

  def _sizes(self, d: int, n: int):
    m = ceil_div(d, self.block)
    m_pad = round_up(m, n)
    capacity = min(m_pad, round_up(math.ceil(self.density * m), n))
    return m, m_pad, capacity

  def wire_bits(self, d: int, n: int) -> int:
    _, m_pad, capacity = self._sizes(d, n)
    if n > 255:
      raise ValueError(f"OmniReduce counts selections in uint8: n={n} must be <= 255")
    return capacity * self.block * 16 + m_pad * 8

  @property
  def stateful(self) -> bool:
    return True

  def init_state(self, d: int, n: int):
    del d, n
    return jnp.asarray(self.density, jnp.float32)  # local top-k fraction

  def _blocks(self, x, bucket):
    _, m_pad, _ = self._sizes(bucket.d, bucket.n)
    return pad_to(x, m_pad * self.block).reshape(m_pad, self.block)

  def metadata(self, x, bucket, state, keys=None):
    """This rank's marks of its local top-k blocks, summed over ranks (uint8 counts)."""
    n, d = bucket.n, bucket.d
    m, m_pad, _ = self._sizes(d, n)
    frac = self.init_state(d, n) if state is None else state
    xb = self._blocks(x, bucket)
    idx = jnp.arange(m_pad)
    with jax.named_scope("omnireduce/select"):
      norms = jnp.where(idx < m, row_norm(xb), -1.0)
      k = jnp.clip(jnp.floor(frac * m), 1, m).astype(jnp.int32)
      rank_local = jnp.argsort(jnp.argsort(-norms, stable=True), stable=True)
      mine = (rank_local < k) & (idx < m)
    return Metadata(mine.astype(jnp.int32).reshape(n, m_pad // n), combine=Cast.of(jnp.uint8))

  def plan(self, x, meta, bucket, state, keys):
    del keys
    n, d = bucket.n, bucket.d
    _, _, capacity = self._sizes(d, n)
    frac = self.init_state(d, n) if state is None else state
    counts = meta.reshape(-1)
    union = counts > 0
    # Slots: union blocks by (more ranks marked it, lower index) first.
    order = jnp.argsort(jnp.where(union, -counts, 1), stable=True)
    sent = order[:capacity]
    sent_ok = union[sent]
    values = jnp.where(sent_ok[:, None], self._blocks(x, bucket)[sent], 0.0)
    return Plan(values.reshape(n, capacity // n, self.block),
                OmniReduceAux(sent, sent_ok, union, frac))

  def finish(self, decoded, aux, bucket, state):
    del state
    d = bucket.d
    m, m_pad, capacity = self._sizes(d, bucket.n)
    dense = jnp.where(aux.sent_ok[:, None], decoded.reshape(capacity, self.block), 0.0)
    out = jnp.zeros((m_pad, self.block), jnp.float32).at[aux.sent].set(dense)
    size = jnp.sum(aux.union).astype(jnp.float32)
    target = np.float32(max(self.density * m, 1.0))
    prop = jnp.clip(size / target, 0.6, 1 / 0.6)
    frac = aux.frac
    new = self.momentum * frac + (1 - self.momentum) * frac / prop
    return out.reshape(-1)[:d], jnp.clip(new, 1.0 / m, 1.0)

  def contribution(self, x, aux, bucket):
    _, m_pad, _ = self._sizes(bucket.d, bucket.n)
    mask = jnp.zeros((m_pad,), bool).at[aux.sent].set(aux.sent_ok)
    kept = jnp.where(mask[:, None], self._blocks(x, bucket), 0.0)
    return kept.astype(jnp.bfloat16).astype(jnp.float32).reshape(-1)[:bucket.d]


class OmniReduceAux(NamedTuple):
  """The blocks sent (their slots and validity), the union mask, and this round's k fraction."""

  sent: jax.Array
  sent_ok: jax.Array
  union: jax.Array
  frac: jax.Array
