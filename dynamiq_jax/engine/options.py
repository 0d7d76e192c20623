"""A reduction's options, built and checked once at each front door.

:func:`dynamiq_jax.allreduce`, :func:`dynamiq_jax.reduce_scatter`, the two optax
transforms and :func:`dynamiq_jax.simulate` take the same options as keywords;
each builds one :class:`ReduceOptions` from them (:meth:`ReduceOptions.build`:
the codec resolved from its name, every option checked against the others, a
clear error naming the fix otherwise) and passes it down whole, so that what runs
a reduction never checks an option again. The transforms build theirs when they
are made, not at every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dynamiq_jax.engine import moshpit
from dynamiq_jax.engine import programs
from dynamiq_jax.engine import stacked as loops
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE, DEFAULT_MAX_BUCKETS, Layout
from dynamiq_jax.engine.buckets import bucket_layout
from dynamiq_jax.codec_names import resolve_codec
from dynamiq_jax.codecs.base import Codec
from dynamiq_jax.schedules.context import axis_names
from dynamiq_jax.schedules.loss import PacketLoss
from dynamiq_jax.schedules.moshpit import is_moshpit
from dynamiq_jax.schedules.names import FLAT_SCHEDULES, HIERARCHICAL, SCATTER_SCHEDULES
from dynamiq_jax.schedules.names import SCHEDULES, check_schedule

__all__ = ["ReduceOptions", "Bucketing", "ERROR_FEEDBACK", "feedback_mode"]

ERROR_FEEDBACK = ("ef14", "ef21m")
"""The error-feedback rules (:func:`dynamiq_jax.compressed_psum`'s ``error_feedback``)."""


def feedback_mode(error_feedback, codec: Codec) -> str | None:
  """``error_feedback`` (as :func:`dynamiq_jax.compressed_psum` takes it) as ``None``,
  ``"ef14"`` or ``"ef21m"``; ``None`` is the codec's own default
  (``codec.default_error_feedback``)."""
  if error_feedback is None:
    error_feedback = codec.default_error_feedback
  if error_feedback is False:
    return None
  if error_feedback is True:
    return "ef14"
  if isinstance(error_feedback, str) and error_feedback in ERROR_FEEDBACK:
    if not codec.reports_contribution:
      raise ValueError(
          f"error_feedback={error_feedback!r} needs each rank's own contribution, which "
          f"{type(codec).__name__} does not report (reports_contribution=False); pass "
          f"error_feedback=False with it")
    return error_feedback
  raise ValueError(f"error_feedback={error_feedback!r} must be False, True (= 'ef14'), "
                   f"'ef14', 'ef21m' or None (the codec's default)")


@dataclasses.dataclass(frozen=True)
class Bucketing:
  """How a reduction cuts a gradient into buckets: ``bucket_size``, ``max_buckets`` and
  ``leaf_order`` as :func:`dynamiq_jax.allreduce` takes them, checked by :meth:`build`.

  ``bucket_size`` bounds a bucket over all ranks; each kind of reduction reads it
  here, and only here:

  * the flat and hierarchical schedules and Moshpit: buckets of at most
    ``bucket_size`` coordinates (:meth:`layout`, :func:`dynamiq_jax.bucket_layout`);
  * a reduce-scatter: buckets of ``n`` rank rows, so each row holds a ``1 / n`` share
    of ``bucket_size`` in whole codec blocks (:meth:`rows`);
  * the stacked leaves' loops: one bucket size for every loop, of about
    ``bucket_size`` coordinates, the candidate that pads least (:meth:`loop_size`).

  Attributes:
    codec: the codec whose block a bucket holds whole.
    bucket_size: the most coordinates in one bucket (a multiple of the codec's block).
    max_buckets: the most buckets (None: no limit).
    leaf_order: None, ``"reverse"``, ``"forward"`` or a permutation (a tuple) of the
      leaves.
  """

  codec: Codec
  bucket_size: int = DEFAULT_BUCKET_SIZE
  max_buckets: int | None = DEFAULT_MAX_BUCKETS
  leaf_order: Any = None

  @classmethod
  def build(cls, codec: Codec, bucket_size: int = DEFAULT_BUCKET_SIZE,
            max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None) -> Bucketing:
    """The bucketing, checked: a ValueError naming the fix for a ``bucket_size`` that is
    not a positive multiple of the codec's block, a bad ``max_buckets``, or a
    ``leaf_order`` that is not an order's name or a sequence of indices (which tree's
    permutation it is, each call checks)."""
    if isinstance(leaf_order, str) or leaf_order is None:
      order = leaf_order
    else:
      try:
        order = tuple(int(i) for i in leaf_order)  # hashable; checked per tree later
      except TypeError:
        raise ValueError(f"leaf_order={leaf_order!r} is not a sequence of leaf indices. "
                         f"Fix: pass a permutation of the leaves' indices, 'reverse' or "
                         f"'forward'") from None
    bucket_layout({}, codec=codec, bucket_size=bucket_size, max_buckets=max_buckets)
    return cls(codec, int(bucket_size), max_buckets, order)

  def layout(self, tree, leaf_order=None) -> Layout:
    """``tree``'s buckets (:func:`dynamiq_jax.bucket_layout`), its leaves in
    ``leaf_order`` (None: this bucketing's)."""
    return bucket_layout(tree, codec=self.codec, bucket_size=self.bucket_size,
                         max_buckets=self.max_buckets,
                         leaf_order=self.leaf_order if leaf_order is None else leaf_order)

  def rows(self, pieces, n: int) -> Layout:
    """A reduce-scatter's buckets of the per-rank rows ``pieces`` (one leaf's row each,
    in the order the backward pass produces them): ``bucket_size`` over all ``n``
    ranks, so a ``1 / n`` share of it per row, in whole codec blocks."""
    unit = self.codec.granularity
    return bucket_layout(pieces, codec=self.codec, max_buckets=self.max_buckets,
                         bucket_size=max(unit, self.bucket_size // n // unit * unit),
                         leaf_order="forward")

  def loop_size(self, shapes, flags, n: int) -> int:
    """The one bucket size of the stacked leaves' loops over ``n`` ranks
    (:func:`dynamiq_jax.engine.stacked.loop_bucket`)."""
    return loops.loop_bucket(shapes, flags, self.bucket_size, self.codec.granularity * n)


@dataclasses.dataclass(frozen=True)
class ReduceOptions:
  """How a gradient is reduced: :func:`dynamiq_jax.allreduce`'s options (or
  :func:`dynamiq_jax.reduce_scatter`'s, ``scatter=True``), checked together by
  :meth:`build`. Frozen and hashable (a static argument of a jitted function).

  Attributes:
    schedule: a schedule's name or a ``dq.Moshpit``.
    axis_name: the data-parallel axis; ``(slow, fast)`` for the hierarchical schedules.
    buckets: how the gradient is cut into buckets (:class:`Bucketing`: the codec,
      ``bucket_size``, ``max_buckets``, ``leaf_order``); :attr:`codec` is its codec.
    average: the mean over ranks (True) or the sum.
    implementation: the kernels' implementation (None, ``"pallas"``, ``"mosaic"``,
      ``"xla"``).
    return_own: also return each rank's contribution as the codec represented it.
    feedback: the error-feedback rule the contribution is for (None, ``"ef14"``,
      ``"ef21m"``; :func:`feedback_mode`).
    stacked: which leaves are stacked along an axis of layers (a key's name or a
      callable), reduced in loops; None: none.
    loss: the reduce step's packet loss (``schedule="two_step"``), or None.
    scatter: a reduce-scatter's options (its schedules; its codecs).
  """

  schedule: Any
  axis_name: Any
  buckets: Bucketing
  average: bool = True
  implementation: str | None = None
  return_own: bool = False
  feedback: str | None = None
  stacked: Any = None
  loss: PacketLoss | None = None
  scatter: bool = False

  @classmethod
  def build(cls, what: str, *, codec, axis_name, schedule="ring", default_codec=None,
            average: bool = True, bucket_size: int = DEFAULT_BUCKET_SIZE,
            max_buckets: int | None = DEFAULT_MAX_BUCKETS, leaf_order=None,
            implementation: str | None = None, return_own: bool = False,
            error_feedback=False, stacked=None, loss=None,
            scatter: bool = False) -> ReduceOptions:
    """The options of ``what`` (the front door's name, for messages), checked together.

    ``error_feedback`` as :func:`feedback_mode` takes it (``False``: none, as the
    functional front doors have; None: the codec's default); any rule implies
    ``return_own``. The checks that need the traced axes (their sizes, the leaves)
    stay where the reduction runs.

    Raises:
      ValueError: an unknown codec name or schedule, a schedule this front door does
        not run, a bad ``bucket_size``, ``max_buckets`` or ``leaf_order``, and every
        combination the library does not run (each message names the fix).
      TypeError: a ``codec`` that is neither a codec nor a codec's name; a
        ``packet_loss`` that is not a ``dq.PacketLoss``.
    """
    codec = resolve_codec(codec, default_codec, what=what)
    check_schedule(schedule, SCATTER_SCHEDULES if scatter else SCHEDULES, what=what)
    feedback = feedback_mode(error_feedback, codec)
    return_own = bool(return_own) or feedback is not None
    buckets = Bucketing.build(codec, bucket_size, max_buckets, leaf_order)
    opts = cls(schedule, axis_name, buckets, bool(average), implementation, return_own,
               feedback, stacked, loss, scatter)
    opts._check(what)
    return opts

  @property
  def codec(self) -> Codec:
    """The codec (a :class:`~dynamiq_jax.codecs.Codec`, resolved from its name): the
    buckets' own, held once."""
    return self.buckets.codec

  def program(self, kind: type[programs.FlatProgram] = programs.AllReduce):
    """One bucket's program on a flat schedule with these options: ``kind``
    :class:`~dynamiq_jax.engine.programs.AllReduce` (also a reduce-scatter's whole
    leaves) or :class:`~dynamiq_jax.engine.programs.ReduceScatter`."""
    return kind(self.codec, self.schedule, self.axis_name, self.implementation,
                self.return_own, self.loss)

  @property
  def hierarchical(self) -> bool:
    """Whether the schedule is a hierarchical one (over ``(slow, fast)``)."""
    return isinstance(self.schedule, str) and self.schedule in HIERARCHICAL

  @property
  def moshpit(self) -> bool:
    """Whether the schedule is Moshpit averaging."""
    return is_moshpit(self.schedule)

  def _check(self, what: str):
    codec, schedule = self.codec, self.schedule
    self._check_loss()
    if self.hierarchical:
      self.hierarchical_axes()
    if self.moshpit:
      moshpit.check_moshpit(schedule, self.axis_name, codec, None, self.return_own)
      if self.stacked is not None:
        raise ValueError(f"stacked= runs the flat schedules {FLAT_SCHEDULES}, not "
                         f"schedule={schedule!r}. Fix: leave stacked=None")
    if self.return_own and not codec.reports_contribution:
      raise ValueError(
          f"{type(codec).__name__} cannot report a rank's own contribution "
          f"(reports_contribution=False), which error feedback needs; use a codec that "
          f"does, or error_feedback=False")
    loops.check_stateless(self.stacked, codec)
    if self.stacked is not None and self.hierarchical:
      raise ValueError(
          f"stacked= reduces in loops on the flat schedules {FLAT_SCHEDULES}, not on "
          f"schedule={schedule!r}. Fix: leave stacked=None for the hierarchical schedule, or "
          f"use a flat schedule over one axis")
    if self.scatter:
      if self.stacked is not None:
        raise ValueError(f"{what} does not take stacked=; leave it None")
      if not codec.supports_scatter:
        raise ValueError(
            f"{codec!r} cannot reduce-scatter: its chunks mix coordinates that different "
            "ranks own (supports_scatter=False). Fix: use a codec that can "
            "(codecs.DynamiQ(), codecs.MX(scale='e8m0'), codecs.Bf16(), codecs.F32(), "
            "codecs.GlobalQSGD()), or all-reduce with dq.allreduce / dq.compressed_psum "
            "and keep each rank's slice")
      if codec.stateful:
        raise ValueError(
            f"{codec!r} keeps state from one call to the next, computed from the whole "
            f"result, which no rank of a reduce-scatter has. Fix: use a stateless codec "
            f"(DynamiQ, MX(scale='e8m0'), Bf16, ...)")

  def _check_loss(self):
    loss, schedule = self.loss, self.schedule
    if loss is None:
      return
    if not isinstance(loss, PacketLoss):
      raise TypeError(f"packet_loss={loss!r} must be a dq.PacketLoss(p=...) or None")
    if not (isinstance(schedule, str) and schedule == "two_step"):
      raise ValueError(
          f"packet_loss= runs on schedule='two_step', where a lost packet removes one "
          f"rank's contribution, which the owner of the chunk can count and correct for; on "
          f"schedule={schedule!r} a hop forwards partial sums, and one lost packet would "
          f"take several ranks' contributions with it. Fix: schedule='two_step'")
    if self.stacked is not None:
      raise ValueError("stacked= does not run lossy links; leave stacked=None with "
                       "packet_loss=")

  def hierarchical_axes(self, codec_state=None) -> tuple:
    """``(slow, fast)`` of a hierarchical schedule, or a ValueError saying the fix (also
    for a codec state, which the hierarchical schedules do not carry)."""
    names = axis_names(self.axis_name)
    if len(names) != 2 or isinstance(self.axis_name, str):
      raise ValueError(
          f"schedule={self.schedule!r} needs axis_name=(slow, fast), e.g. ('host', 'local') "
          f"for a 2-axis mesh; got axis_name={self.axis_name!r}. Fix: pass both mesh axes, "
          f"slow first, or use schedule='ring' for one axis")
    if self.return_own or codec_state is not None or self.codec.stateful:
      raise ValueError(
          f"schedule={self.schedule!r} supports stateless codecs without error feedback; "
          f"{self.codec!r} keeps state (or error feedback was asked for). Fix: use a flat "
          f"schedule {FLAT_SCHEDULES} over axis_name={tuple(names)!r} for this codec")
    return names

  def check_state(self, codec_state):
    """A ValueError naming the fix where a codec state is passed that these options cannot
    carry (a hierarchical or Moshpit schedule, ``stacked``)."""
    if codec_state is None:
      return
    if self.hierarchical:
      self.hierarchical_axes(codec_state)
    if self.moshpit:
      moshpit.check_moshpit(self.schedule, self.axis_name, self.codec, codec_state,
                            self.return_own)
    loops.check_stateless(self.stacked, self.codec, codec_state)
