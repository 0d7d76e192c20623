"""The sparsification baselines ARC-Top-K replaces, as optax transforms (benchmarks only).

* :class:`RandK`: Rand-K with shared random rows: every rank sends the same
  ``k`` rows, drawn from the step's key (no metadata), reduced like ARC-Top-K's.
* :func:`topk_allgather`: Top-K with an all-gather of values and indices, what
  ARC-Top-K replaces: each rank keeps its own ``k`` largest rows (``row=1``:
  coordinates), every rank gathers every rank's values and int32 indices and
  adds them up in rank order.

:func:`reducer` and :func:`wire` name them as ``dq.reducer`` and ``dq.wire_stats``
name the library's codecs; :mod:`~dynamiq_jax.bench.sparse` measures them and
:mod:`~dynamiq_jax.bench.harness` trains with them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from dynamiq_jax.api.transform import ef14_init, ef14_update, ef21m_init, ef21m_update
from dynamiq_jax.codecs.arctopk import RowSelection
from dynamiq_jax.codecs.base import round_up
from dynamiq_jax.schedules.context import axis_context
from pallas_kernels import rng

__all__ = ["RandK", "TopKState", "topk_rows", "topk_wire", "topk_allgather", "REDUCERS",
           "reducer", "wire"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RandK(RowSelection):
  """Rand-K with shared random rows: the same ``k`` rows on every rank, drawn from the
  bucket's key (no metadata pass); the rows reduced as ARC-Top-K's (``values``).

  Examples:
    >>> round(RandK(ratio=0.2, row=256).wire_bits(1 << 20, 8) / (1 << 20), 3)
    3.219
  """

  def select(self, meta, bucket, keys):
    del meta
    h, k = self.rows(bucket.d, bucket.n)
    k0, k1 = keys.derive(rng.Stream.RANDK_ROWS)
    rows = jnp.arange(round_up(h, bucket.n), dtype=jnp.uint32)
    draw = jnp.where(rows < h, (rng.hash_index(k0, k1, rows) >> 1).astype(jnp.int32), -1)
    _, idx = jax.lax.top_k(draw, k)  # k distinct rows, uniformly at random
    return jnp.sort(idx).astype(jnp.int32)


class TopKState(NamedTuple):
  """:func:`topk_allgather`'s state: the error feedback's per-rank and shared parts."""

  residual: Any = None
  mean: Any = None


def topk_rows(d: int, row: int, ratio: float) -> tuple[int, int]:
  """``(h, k)``: :func:`topk_allgather`'s rows of ``d`` coordinates, and the rows each rank
  sends."""
  h = -(-d // row)
  return h, max(1, int(math.floor(ratio * h)))


def topk_wire(d: int, n: int, ratio: float, row: int = 1, value_bits: int = 16) -> dict:
  """Bytes each rank sends in :func:`topk_allgather` of ``d`` coordinates, and the bits
  per coordinate an all-reduce would need to send as much (``2 (n - 1) / n`` of its
  ``bits x d``)."""
  _, k = topk_rows(d, row, ratio)
  sent = (n - 1) * k * (row * value_bits + 32) / 8  # a ring all-gather: n - 1 hops of k rows
  return {"bytes_per_rank": float(sent), "bits_per_coord": sent * 8 / (2 * (n - 1) / n * d),
          "k": k}


def topk_allgather(axis_name="data", *, ratio: float = 0.1, row: int = 1,
                   values: str = "bf16", average: bool = True,
                   error_feedback="ef21m", ef21m_momentum: float = 0.5):
  """Top-K with an all-gather of values and indices, as an optax transform (benchmarks only).

  The gradient's leaves are laid end to end and read as rows of ``row``
  coordinates; each rank keeps the ``k = max(1, floor(ratio h))`` rows of
  largest norm of its own (``row=1``: the classic element-wise Top-K), all
  ranks gather every rank's values (``values``: bf16 or f32) and int32 row
  indices, and add them up in rank order (the same bytes on every rank).
  ``error_feedback``: ``"ef21m"`` (default), ``"ef14"`` or False.
  """
  dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[values]
  mode = {"ef21m": "ef21m", "ef14": "ef14", False: None, None: None}[error_feedback]

  def reduce(tree):
    flat, unravel = ravel_pytree(tree)
    flat = flat.astype(jnp.float32)
    d = flat.shape[0]
    h, k = topk_rows(d, row, ratio)
    rows = jnp.pad(flat, (0, h * row - d)).reshape(h, row)
    _, idx = jax.lax.top_k(jnp.sum(rows * rows, axis=-1), k)
    mine = rows[idx].astype(dtype)
    ctx = axis_context(axis_name)  # typed invariant under shard_map(check_vma=True)
    everyone, where = ctx.all_gather((mine, idx.astype(jnp.int32)))
    total = jnp.zeros((h, row), jnp.float32)
    for r in range(everyone.shape[0]):  # rank order: the same sum on every rank
      total = total.at[where[r]].add(everyone[r].astype(jnp.float32), unique_indices=True)
    total = total / np.float32(ctx.n) if average else total
    own = jnp.zeros((h, row), jnp.float32).at[idx].set(mine.astype(jnp.float32))
    return unravel(total.reshape(-1)[:d]), unravel(own.reshape(-1)[:d]), None

  def init_fn(params):
    if mode == "ef21m":
      residual, mean = ef21m_init(params)
      return TopKState(residual, mean)
    if mode == "ef14":
      return TopKState(ef14_init(params))
    return TopKState()

  def update_fn(updates, state, params=None, **extra):
    del params, extra
    if mode == "ef21m":
      out, residual, mean, _ = ef21m_update(updates, state.residual, state.mean, reduce,
                                            ef21m_momentum)
      return out, TopKState(residual, mean)
    if mode == "ef14":
      out, residual, _ = ef14_update(updates, state.residual, reduce)
      return out, TopKState(residual)
    out, _, _ = reduce(updates)
    return jax.tree.map(lambda o, g: o.astype(g.dtype), out, updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


REDUCERS = ("topk-allgather", "randk")
"""The baselines' reducer names (:func:`reducer`), beside the library's ``dq.REDUCERS``."""


def reducer(name: str, axis_name="data", *, seed: int = 0, ratio: float = 0.1, row: int = 1,
            values: str = "bf16", error_feedback="ef21m", ef21m_momentum: float = 0.5, **kw):
  """A baseline by name, as an optax transform: ``"topk-allgather"`` or ``"randk"``."""
  import dynamiq_jax as dq
  if name == "topk-allgather":
    return topk_allgather(axis_name, ratio=ratio, row=row, values=values,
                          error_feedback=error_feedback, ef21m_momentum=ef21m_momentum, **kw)
  if name == "randk":
    return dq.compressed_psum(axis_name, codec=RandK(ratio=ratio, row=row, values=values),
                              seed=seed, error_feedback=error_feedback,
                              ef21m_momentum=ef21m_momentum, **kw)
  raise ValueError(f"baseline {name!r} is not one of {REDUCERS}")


def wire(name: str, d: int, n: int, **options) -> dict:
  """``{"bits_per_coord", "bytes_per_rank"}`` of a baseline on ``d`` coordinates."""
  import dynamiq_jax as dq
  options = {k: v for k, v in options.items() if k not in ("error_feedback", "ef21m_momentum")}
  if name == "topk-allgather":
    values = options.get("values", "bf16")
    w = topk_wire(d, n, options.get("ratio", 0.1), options.get("row", 1),
                  16 if values == "bf16" else 32)
    return {"bits_per_coord": w["bits_per_coord"], "bytes_per_rank": w["bytes_per_rank"]}
  st = dq.wire_stats(jax.ShapeDtypeStruct((d,), jnp.float32), codec=RandK(**options), n=n)
  return {"bits_per_coord": float(st.bits_per_coord), "bytes_per_rank": float(st.bytes_per_rank)}
