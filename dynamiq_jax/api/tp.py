"""``tp_psum``: a compressed drop-in for the ``psum`` that ends a row-parallel matmul.

In tensor-parallel inference every row-parallel layer (attention's output
projection, the MLP's down projection) ends in an all-reduce of activations
over the model axis; without NVLink, or across hosts, that all-reduce is the
bottleneck (Flash Communication, Li, Zhang, Ye et al.). ``tp_psum`` sums ``x``
over the axis with a codec, by default Flash Communication's: INT8 in groups
of 128 (:class:`~dynamiq_jax.codecs.IntGroup`) on the two-step schedule (one
all-to-all, each rank decoding and adding its chunk from every rank, one
re-encode, one all-gather: every value quantised twice whatever the number
of ranks).

The activation is one message: no bucketing, no state. A codec whose payloads
carry their own scales (``Codec.self_scaled``: IntGroup, ``MX(scale="e8m0")``)
runs in exactly the schedule's collectives; any other codec (DynamiQ, MX with
bf16 scales) first agrees on non-finite values and a power-of-two scale in one
small all-reduce (:func:`dynamiq_jax.engine.guard`), and adds its metadata
pass.

**Backward.** ``tp_psum`` has a ``custom_vjp`` that sends nothing compressed:
the cotangent of a sum is the cotangent of its result, on every rank. Under
``shard_map(check_vma=True)`` (the default) the result is typed replicated
over the axis, so the cotangent that reaches it is already summed: JAX adds
the all-reduce of the activation gradient where the replicated result first
meets per-rank values (the next column-parallel layer's ``pcast``'s
transpose, a full-precision ``psum``), and the backward of ``tp_psum`` is the
identity. With ``check_vma=False`` JAX cannot tell replicated from per-rank
values and transposes ``psum`` to ``psum``; the backward then does the same
(an exact ``psum`` of the cotangent), so the gradient equals ``psum``'s in
both modes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from dynamiq_jax.engine import programs as engine
from dynamiq_jax.engine.buckets import bucket_codec
from dynamiq_jax.codecs.base import Bucket, Codec, round_up
from dynamiq_jax.codecs.intgroup import IntGroup
from dynamiq_jax.codec_names import resolve_codec
from dynamiq_jax.schedules.context import UnboundAxisError
from dynamiq_jax.schedules.context import as_varying, axis_context, axis_names, varying_axes
from dynamiq_jax.schedules.names import FLAT_SCHEDULES, check_schedule
from dynamiq_jax.schedules.plan import get_plan

__all__ = ["tp_psum", "TP_SCHEDULES", "check_tp_codec"]

TP_SCHEDULES = ("two_step",) + tuple(s for s in FLAT_SCHEDULES if s != "two_step")
"""The flat schedules :func:`tp_psum` runs (every one of
:data:`~dynamiq_jax.schedules.names.FLAT_SCHEDULES`), its default first."""

_TP_FIX = ("codec=None (codecs.IntGroup(bits=8), Flash Communication's INT8), 'int4', "
           "'dynamiq' (codecs.DynamiQ(bits=5)), 'mxfp8-ocp' (codecs.MX(scale='e8m0')) or "
           "'bf16-ring' (codecs.Bf16())")
"""The codecs :func:`tp_psum`'s errors suggest."""


def check_tp_codec(codec: Codec) -> None:
  """Raises a ValueError, saying why and what to use instead, for a codec :func:`tp_psum`
  cannot use: one that keeps state from call to call, or one that relies on error
  feedback to be right on average (a top-k selection: ARC-Top-K)."""
  if codec.default_error_feedback:
    raise ValueError(
        f"tp_psum cannot use {codec!r}: its selection is biased (it drops what it does not "
        f"select), and what makes it converge in training is error feedback "
        f"({codec.default_error_feedback!r}: compressed_psum carries each rank's dropped "
        f"part into the next step's gradient). An activation is summed once and has no next "
        f"step to carry its error to: tp_psum with it measured a relative error of about "
        f"0.7-0.9. Fix: {_TP_FIX}")
  if codec.stateful:
    raise ValueError(
        f"tp_psum cannot use {codec!r}: it keeps state from one all-reduce to the next (an "
        f"adaptive scale, a momentum, an error-feedback residual), and tp_psum is one message "
        f"per call with no state to carry. Fix: {_TP_FIX}")


def tp_psum(x, axis_name: Any = "model", *, codec: Codec | str | None = None,
            schedule: str = "two_step", key=None, seed: int = 0,
            implementation: str | None = None):
  """``jax.lax.psum(x, axis_name)``, compressed by ``codec`` on ``schedule``.

  Call it inside ``jax.shard_map`` (manual over ``axis_name``, fully or
  partially: other mesh axes may stay with the compiler), ``jax.pmap`` or
  ``jax.vmap``, on this rank's partial sums, e.g. ``x @ w`` of a row-parallel
  layer whose input features and weight rows are split over ``axis_name``.

  Args:
    x: a floating array (any shape, f32 / bf16 / f16), this rank's partial sum.
      Under ``shard_map(check_vma=True)`` it must vary over ``axis_name``.
    axis_name: the tensor-parallel axis.
    codec: a stateless codec that is unbiased without error feedback (default
      ``codecs.IntGroup(bits=8, group=128)``, Flash Communication's INT8);
      ``codecs.IntGroup(bits=4)`` for INT4, ``codecs.DynamiQ(bits=5)``,
      ``codecs.MX(scale="e8m0")``, ``codecs.Bf16()``, ...; or its name
      (``"int8"``, ``"int4"``, ``"dynamiq"``, ``"mxfp8-ocp"``, ``"bf16-ring"``: the
      names of :func:`dynamiq_jax.codec_from_name`). Not ARC-Top-K (or any codec
      that relies on error feedback) and not a stateful codec (MX's adaptive
      scales, OmniReduce's momentum): see :func:`check_tp_codec`.
    schedule: ``"two_step"`` (default), ``"ring"`` or ``"butterfly"``.
    key: a ``jax.random`` key for codecs that round stochastically (DynamiQ,
      ``IntGroup(rounding="stochastic")``), the same on every rank; None:
      ``jax.random.key(seed)`` (rounding streams repeat from call to call).
    seed: the rounding key's seed where ``key`` is None (default 0), as for
      :func:`dynamiq_jax.allreduce`.
    implementation: the codec's kernels, as in :func:`dynamiq_jax.allreduce`.

  Returns:
    The sum over the axis, ``x``'s shape and dtype, bit-identical on every rank
    (typed replicated over ``axis_name`` under ``check_vma``). Differentiable:
    see the module docstring for what the backward sends.

  Raises:
    TypeError: a non-floating ``x`` or a codec that is neither a ``Codec`` nor a
      codec's name.
    ValueError: an unbound ``axis_name`` (:class:`~dynamiq_jax.UnboundAxisError`:
      call it inside a ``jax.shard_map`` manual over the model axis), an unknown
      schedule or codec name, a codec it cannot use (:func:`check_tp_codec`), or
      (under ``check_vma``) an ``x`` already replicated over the axis.

  Examples:
    >>> import jax, jax.numpy as jnp, dynamiq_jax as dq
    >>> x = jnp.linspace(-1, 1, 4 * 256).reshape(4, 256)
    >>> y = jax.vmap(lambda v: dq.tp_psum(v, "model"), axis_name="model")(x)
    >>> bool(jnp.allclose(y[0], x.sum(0), atol=0.02))
    True
  """
  codec = resolve_codec(codec, IntGroup(), what="tp_psum")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"tp_psum sums floating activations; got dtype {x.dtype}. Fix: cast x to "
                    f"float32 / bfloat16 first, or use jax.lax.psum for integers")
  check_tp_codec(codec)
  check_schedule(schedule, TP_SCHEDULES, what="tp_psum")
  try:
    ctx = axis_context(axis_name)
  except UnboundAxisError:
    raise _unbound_model_axis(axis_name) from None
  want = set(axis_names(axis_name))
  if ctx.invariant_gather and not want <= varying_axes(x):
    raise ValueError(
        f"x is not varying over axis_name={axis_name!r}: it is already the same on every "
        f"rank, and psum would multiply it by {ctx.n}. tp_psum sums per-rank partial sums "
        f"(e.g. x_shard @ w_rows of a row-parallel layer). Fix: pass the partial sums, or "
        f"drop the tp_psum")
  if ctx.n == 1 or x.size == 0:
    return x
  key = jax.random.key(seed) if key is None else key
  words = jax.lax.stop_gradient(engine.bucket_keys(key, 1))
  program = TensorParallelSum(codec, schedule, axis_name, implementation,
                              ctx.invariant_gather)
  return _tp_sum(program, x, words)


def _unbound_model_axis(axis_name) -> UnboundAxisError:
  """tp_psum's :class:`~dynamiq_jax.UnboundAxisError`: the tensor-parallel fix, not the
  gradient all-reduce's."""
  return UnboundAxisError(
      f"tp_psum: axis_name={axis_name!r} is not bound here. tp_psum sums a row-parallel "
      f"layer's per-rank partial sums over the tensor-parallel (model) axis, so it must run "
      f"inside a jax.shard_map that is manual over that axis; plain jax.jit binds no axis "
      f"name. Fix: wrap the row-parallel matmul and its sum, e.g. jax.shard_map(lambda x, w: "
      f"dq.tp_psum(x @ w, {axis_name!r}), mesh=mesh, in_specs=(P(None, {axis_name!r}), "
      f"P({axis_name!r}, None)), out_specs=P(), axis_names={{{axis_name!r}}}), on a mesh "
      f"with the axis {axis_name!r}; the same works in a model run by dq.data_parallel_step "
      f"or dq.nnx.DataParallel on such a mesh (their shard_map is manual over the data axis "
      f"only). Or pass the name your mesh gives its model axis: data_parallel_step's "
      f"axis_name= is the gradient all-reduce's data axis, not the one activations are "
      f"summed over")


@dataclasses.dataclass(frozen=True)
class TensorParallelSum:
  """The program of one :func:`tp_psum`: ``program(x, words) -> sum`` (static config)."""

  codec: Codec
  schedule: str
  axis_name: Any
  implementation: str | None
  checked: bool  # shard_map(check_vma=True): the result is typed replicated

  def __call__(self, x, words):
    ctx = axis_context(self.axis_name)
    flat = x.reshape(-1).astype(jnp.float32)
    d = flat.shape[0]
    flat = jnp.pad(flat, (0, round_up(d, self.codec.granularity) - d))
    used = bucket_codec(self.codec, flat.shape[0], ctx.n)
    k0, k1, (s0, s1) = words
    keys = engine.program_keys((k0, k1, s0[0], s1[0]), jnp.int32(0), ctx)
    bucket = Bucket(jnp.int32(0), flat.shape[0], ctx.n, self.implementation)
    plan = get_plan(self.schedule, ctx.n)
    if used.self_scaled:
      out = engine.codec_pass(flat, used, bucket, None, keys, plan, ctx, False).out
    else:
      with jax.named_scope("guard"):
        nonfinite, guarded, scale = engine.guard(flat, ctx)
      out = engine.codec_pass(guarded, used, bucket, None, keys, plan, ctx, False)[0]
      out = engine.unguard(out, nonfinite, scale)
    return out[:d].reshape(x.shape).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tp_sum(program, x, words):
  with jax.named_scope("tp_psum"):
    return program(x, words)


def _tp_sum_fwd(program, x, words):
  return _tp_sum(program, x, words), None


def _tp_sum_bwd(program, _, ct):
  if program.checked:  # ct is replicated over the axis: already the sum's cotangent
    missing = tuple(a for a in axis_names(program.axis_name) if a not in varying_axes(ct))
    return (as_varying(ct, missing) if missing else ct), None
  return jax.lax.psum(ct, program.axis_name), None


_tp_sum.defvjp(_tp_sum_fwd, _tp_sum_bwd)
