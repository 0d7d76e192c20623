"""``schedule="moshpit"``: the gradient averaged in rounds of small compressed group
all-reduces (:mod:`dynamiq_jax.schedules.moshpit` places the ranks on the grid).

Each bucket runs every round in turn (:class:`MoshpitRounds`, a bucket program of
:func:`dynamiq_jax.engine.reduce_buckets`). In round t a rank's group:

1. agrees in one small collective on non-finite values, a power-of-two scale
   and the *count* of members present (the metadata every present member
   sends; a rank absent this round sends nothing of its own);
2. all-reduces the present members' values with the codec on the inner
   schedule (the flat schedule's metadata pass, hops and gather, run within
   the group: :func:`dynamiq_jax.engine.codec_pass`);
3. divides the sum by the count: present members take the group's mean, an
   absent member keeps its own value. Nothing is filled with zeros in the
   mean: the denominator is what arrived.

Absence is simulated (XLA's collectives cannot lose a peer): an absent rank's
hops still run, forwarding the partial sums of the others without adding its
own. Results vary between ranks where some were absent; with every rank
present they are the exact mean up to the codec's error, and bit-identical on
every rank (:meth:`~dynamiq_jax.schedules.moshpit.MoshpitPlan.stream`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dynamiq_jax import engine
from dynamiq_jax.buckets import AllReduceStats, bucket_codec, report
from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.schedules.context import axis_context
from dynamiq_jax.schedules.moshpit import MoshpitPlan, as_moshpit
from dynamiq_jax.schedules.plan import get_plan

__all__ = ["MoshpitRounds", "DROPOUT_STREAM", "presence", "round_reports", "moshpit_report",
           "check_moshpit"]

DROPOUT_STREAM = 0x6D6F7368
"""What the call's key is folded with to draw the dropout masks (``"mosh"``)."""


def check_moshpit(schedule, axis_name, codec, codec_state, return_own):
  """The schedule's options that Moshpit averaging does not support, as clear errors."""
  if not isinstance(axis_name, str) and len(tuple(axis_name)) != 1:
    raise ValueError(f"schedule={schedule!r} averages over one axis; got "
                     f"axis_name={axis_name!r}. Fix: pass one mesh axis")
  if return_own or codec_state is not None or codec.stateful:
    raise ValueError(
        f"schedule={schedule!r} supports stateless codecs without error feedback; a rank's "
        f"contribution is re-encoded in every round. {codec!r} keeps state (or error "
        f"feedback was asked for). Fix: a stateless codec (DynamiQ, Bf16, F32, MX(scale="
        f"'e8m0'), ...) with error_feedback=False, or schedule='ring'")


def presence(plan: MoshpitPlan, schedule, key, absent, rank):
  """This rank's presence in each round, float32 ``[rounds]`` (1 present, 0 absent): absent
  where ``absent[t, rank]`` (bool ``[rounds, n]``, the same on every rank) or where the
  schedule's ``dropout`` draws it from ``key``."""
  gone = jnp.zeros((plan.rounds, plan.n), bool)
  if absent is not None:
    absent = jnp.asarray(absent)
    if absent.shape != (plan.rounds, plan.n) or absent.dtype != jnp.bool_:
      raise ValueError(
          f"absent must be a bool array [rounds, n] = [{plan.rounds}, {plan.n}] (True: rank "
          f"absent from that round), the same on every rank; got {absent.dtype}"
          f"{list(absent.shape)}")
    gone = absent
  p = float(as_moshpit(schedule).dropout)
  if p > 0:
    gone = gone | jax.random.bernoulli(jax.random.fold_in(key, DROPOUT_STREAM), p, gone.shape)
  return 1.0 - gone[:, rank].astype(jnp.float32)


def round_reports(sizes, codec, plan: MoshpitPlan) -> list[AllReduceStats]:
  """What each round of ``plan`` sends for buckets of ``sizes``: round t is an all-reduce
  of every bucket within groups of the side of its axis (every rank present: an absent
  rank's hops still run)."""
  return [report(sizes, codec, plan.grid[plan.axis(t)]) for t in range(plan.rounds)]


def moshpit_report(sizes, codec, plan: MoshpitPlan) -> AllReduceStats:
  """Wire accounting of buckets of ``sizes`` averaged on ``plan``
  (:func:`round_reports`): ``bits_per_coord`` is the codec's per round (the mean over
  rounds), ``bytes_per_rank`` the sum over rounds."""
  reps = round_reports(sizes, codec, plan)
  return AllReduceStats(sum(r.bits_per_coord for r in reps) / len(reps),
                        sum(r.bytes_per_rank for r in reps), sum(sizes),
                        uncompressed=max(r.uncompressed for r in reps))


@dataclasses.dataclass(frozen=True)
class MoshpitRounds:
  """One bucket's Moshpit averaging: every round of ``plan`` in turn.

  ``program(x, after, words, index, present) -> (out, sent)``: ``x`` the bucket's
  float32 data, ``present`` this rank's presence per round (float32 ``[rounds]``:
  :func:`presence`), ``out`` its value after the last round.
  """

  codec: Codec
  plan: MoshpitPlan
  axis_name: Any
  implementation: str | None

  def __call__(self, x, after, words, index, present):
    n = axis_context(self.axis_name).n
    rank = jax.lax.axis_index(self.axis_name)
    k0, k1, s0, s1 = words
    for t in range(self.plan.rounds):
      ctx = self.plan.context(t, self.axis_name, n)
      stream = jnp.asarray(self.plan.stream(t), jnp.uint32)[rank]
      keys = Keys(k0, k1, index, ctx.rank(), (s0, s1)).prefix(jnp.uint32(t), stream)
      with jax.named_scope(f"round{t}"):
        x, after = self._round(x, after, present[t], ctx, keys, index)
    return x, after

  def _round(self, x, after, present, ctx, keys, index):
    here = present > 0
    mine = jnp.where(here, x, 0.0)  # an absent rank sends nothing of its own
    with jax.named_scope("guard"):  # one small collective: the guard's votes and the count
      finite, votes = engine.guard_votes(mine, after)
      agreed = ctx.all_gather(jnp.stack(votes + [present]))
      count = jnp.sum(agreed[:, -1])  # small integers: exact in any order
      nonfinite, mine, scale = engine.guarded(mine, finite, jnp.max(agreed[:, 0]),
                                              jnp.max(agreed[:, 1]))
    d = x.shape[0]
    used = bucket_codec(self.codec, d, ctx.n)
    total, _, _, _, sent = engine.codec_pass(
        mine, used, Bucket(index, d, ctx.n, self.implementation), None, keys,
        get_plan(self.plan.inner, ctx.n), ctx, False)
    mean = engine.unguard(total, nonfinite, scale) / jnp.maximum(count, 1.0)
    return jnp.where(here, mean, x), sent
