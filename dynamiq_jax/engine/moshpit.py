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
   mean: the denominator is what arrived. With ``weighted`` (the default) each
   member sends its value times, and counts as, the share ``c / held(t)`` of
   contributions its value holds (``c``: 1 at the start, the group's total
   after each round it takes part in; ``held(t)``: what every value holds at
   round t with everyone present, so that the shares are exactly 1 then, and
   nothing changes, bit for bit): where a rank missed a round, a later group's
   mean is the exact mean of the contributions its members hold.

Absence is simulated (XLA's collectives cannot lose a peer): an absent rank's
hops still run, forwarding the partial sums of the others without adding its
own. Results vary between ranks where some were absent; with every rank
present they are the exact mean up to the codec's error, and bit-identical on
every rank (:meth:`~dynamiq_jax.schedules.moshpit.MoshpitPlan.stream`).

**Absent ranks rejoin: the replicas' average** (:func:`average_replicas`, last in the
chain). Averaging gradients alone cannot hold the replicas together once someone was
absent: each rank steps its own replica by its own result, and nothing pulls the replicas
back, so their distance only accumulates (8% of the parameters' norm after 200 steps of
``bench.tta`` at 10% absent per round). As Moshpit SGD averages the peers' *parameters*,
:func:`average_replicas` runs the same rounds on each rank's updated parameters
(``params + updates``, with the same absences as the gradient's rounds): round t's
present members take their group's mean, so a rank that was absent is averaged back
into its group at its next round, and the replicas contract towards each other every
step. Each member adds ``sum_j (x_j - x_r) / count`` over the group's present members
``j``: where the replicas are equal (nobody absent) that is exactly zero and the step is
unchanged, bit for bit.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dynamiq_jax.engine import programs as engine
from dynamiq_jax.engine.buckets import AllReduceStats, bucket_codec, report
from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.schedules.context import axis_context
from dynamiq_jax.schedules.moshpit import MoshpitPlan, as_moshpit, is_moshpit
from dynamiq_jax.schedules.plan import get_plan

__all__ = ["MoshpitRounds", "DROPOUT_STREAM", "presence", "round_reports", "moshpit_report",
           "check_moshpit", "replica_rounds", "average_replicas", "AverageReplicasState",
           "replica_bytes_per_rank"]

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


def round_reports(sizes, codec, plan: MoshpitPlan, coords: int | None = None
                  ) -> list[AllReduceStats]:
  """What each round of ``plan`` sends for buckets of ``sizes``: round t is an all-reduce
  of every bucket within groups of the side of its axis (every rank present: an absent
  rank's hops still run); per coordinate of the gradient (``coords``, as :func:`report`)."""
  return [report(sizes, codec, plan.grid[plan.axis(t)], coords) for t in range(plan.rounds)]


def moshpit_report(sizes, codec, plan: MoshpitPlan, coords: int | None = None
                   ) -> AllReduceStats:
  """Wire accounting of buckets of ``sizes`` averaged on ``plan``
  (:func:`round_reports`): ``bits_per_coord`` is the codec's per round (the mean over
  rounds), ``bytes_per_rank`` the sum over rounds."""
  reps = round_reports(sizes, codec, plan, coords)
  return AllReduceStats(sum(r.bits_per_coord for r in reps) / len(reps),
                        sum(r.bytes_per_rank for r in reps), reps[0].coords,
                        uncompressed=max(r.uncompressed for r in reps))


@dataclasses.dataclass(frozen=True)
class MoshpitRounds:
  """One bucket's Moshpit averaging: every round of ``plan`` in turn.

  ``program(x, after, words, index, present) ->``
  :class:`~dynamiq_jax.engine.programs.BucketResult` (``out``, ``sent``): ``x`` the bucket's
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
    held = jnp.float32(1)  # the contributions this rank's value holds
    for t in range(self.plan.rounds):
      ctx = self.plan.context(t, self.axis_name, n)
      stream = jnp.asarray(self.plan.stream(t), jnp.uint32)[rank]
      keys = Keys(k0, k1, index, ctx.rank(), (s0, s1)).prefix(jnp.uint32(t), stream)
      share = held / self.plan.held(t) if self.plan.weighted else jnp.float32(1)
      with jax.named_scope(f"round{t}"):
        x, total, sent = self._round(x, after, present[t], share, ctx, keys, index)
        after = engine.chain_value(sent)
      held = jnp.where(present[t] > 0, total * self.plan.held(t), held)
    return engine.BucketResult(x, sent)  # (sent: the last round's payloads)

  def _round(self, x, after, present, share, ctx, keys, index):
    here = present > 0
    mine = jnp.where(here, x * share, 0.0)  # an absent rank sends nothing of its own
    with jax.named_scope("guard"):  # one small collective: the guard's votes and the count
      finite, votes = engine.guard_votes(mine, after)
      agreed = ctx.all_gather(jnp.stack(votes + [present * share]))
      # the members' shares (small integers with everyone present: exact in any order),
      # summed in group order on every member
      count = jnp.sum(agreed[:, -1])
      nonfinite, mine, scale = engine.guarded(mine, finite, jnp.max(agreed[:, 0]),
                                              jnp.max(agreed[:, 1]))
    d = x.shape[0]
    used = bucket_codec(self.codec, d, ctx.n)
    r = engine.codec_pass(mine, used, Bucket(index, d, ctx.n, self.implementation), None, keys,
                          get_plan(self.plan.inner, ctx.n), ctx, False)
    mean = engine.unguard(r.out, nonfinite, scale) / jnp.where(count > 0, count, 1.0)
    return jnp.where(here, mean, x), count, r.sent


# ---------------------------------------------------------------------------
# absent ranks rejoin: the replicas averaged in the same rounds


def replica_rounds(tree, plan: MoshpitPlan, axis_name, present):
  """How far each rank's ``tree`` moves when the plan's rounds average the replicas.

  Round t: every present member of a group receives the values of the group's other
  members (``M - 1`` ``ppermute`` s, f32: :meth:`GroupContext.all_gather`) and the
  members' presence, and moves by ``sum_j (x_j - x_r) / count`` over the present members
  ``j`` (itself included, whose term is 0): to the present members' mean. An absent
  member does not move, and what it sends is not used (simulated absence: the
  ``ppermute`` s still run). Written as differences, the move is exactly
  zero where the present members hold the same values.

  Args:
    tree: this rank's values (a pytree of float arrays).
    plan: the rounds (:meth:`dynamiq_jax.Moshpit.plan`).
    axis_name: the averaged axis (its size ``plan.n``).
    present: float32 ``[rounds]``, this rank's presence per round (:func:`presence`).

  Returns:
    The move, a pytree like ``tree`` in float32: ``tree + move`` is this rank's value
    after the rounds.
  """
  n = axis_context(axis_name).n
  leaves, treedef = jax.tree.flatten(tree)
  x = [jnp.asarray(a, jnp.float32) for a in leaves]
  move = [jnp.zeros_like(a) for a in x]
  for t in range(plan.rounds):
    ctx = plan.context(t, axis_name, n)
    here = present[t]
    with jax.named_scope(f"replicas/round{t}"):
      cur = [a + m for a, m in zip(x, move)]
      peers, there = ctx.all_gather((cur, here))  # [M, ...] each; absent: weight 0
      count = jnp.maximum(jnp.sum(there), 1.0)
      for i, (c, p) in enumerate(zip(cur, peers)):
        w = there.reshape((-1,) + (1,) * c.ndim) > 0
        step = jnp.sum(jnp.where(w, p - c[None], 0.0), axis=0) / count  # absent: not even NaN
        move[i] = move[i] + jnp.where(here > 0, step, 0.0)
  return treedef.unflatten(move)


def replica_bytes_per_rank(tree, plan: MoshpitPlan) -> int:
  """Bytes each rank sends in one :func:`replica_rounds` of ``tree`` (f32 values to each
  of its ``M - 1`` group mates per round, presence flags not counted)."""
  d = sum(int(a.size) for a in jax.tree.leaves(tree))
  return sum(4 * d * (plan.grid[plan.axis(t)] - 1) for t in range(plan.rounds))


class AverageReplicasState(NamedTuple):
  """:func:`average_replicas`' state: the step (drawing each step's absences) and the key."""
  step: jax.Array
  key: jax.Array


def average_replicas(axis_name="data", *, schedule="moshpit", seed: int = 0,
                     every: int = 1) -> optax.GradientTransformationExtraArgs:
  """Averages the replicas in Moshpit rounds after each step, so absent ranks rejoin.

  Put it **last** in the chain of a Moshpit step with each rank's own replica
  (``data_parallel_step(per_rank=True)``), with the gradient reduction's ``schedule``
  and ``seed``::

    mosh = dq.Moshpit(grid=(2, 4), dropout=0.1)
    tx = optax.chain(dq.compressed_psum("data", schedule=mosh), optax.adam(1e-3),
                     dq.average_replicas("data", schedule=mosh))

  It turns the chain's ``updates`` into ``updates + move``, where ``move`` takes each
  rank's updated parameters ``params + updates`` to its groups' means round by round
  (:func:`replica_rounds`), with the same absences as the gradient's rounds of that step
  (the dropout drawn from the same seed and step, or none). A rank absent from a round
  keeps its value there and is averaged back at its next round; the replicas' distance
  stays bounded instead of growing. With every rank present the replicas are equal and
  the move is 0: the step is the gradient reduction's up to float32 rounding (XLA may
  fuse the update differently).

  Each rank sends its parameters in f32 to its ``M - 1`` group mates per round
  (:func:`replica_bytes_per_rank`): more than a compressed gradient, hence ``every``.

  Args:
    axis_name: the data-parallel axis (one mesh axis).
    schedule: the gradient reduction's ``"moshpit"`` or ``dq.Moshpit(...)``: its grid,
      rounds, shuffle and dropout.
    seed: the gradient reduction's ``seed`` (the absences of step t are drawn from
      ``fold_in(key(seed), t)``, as there).
    every: average the replicas every this many steps (1: every step), at steps
      ``every - 1, 2 every - 1, ...``; in between the updates pass unchanged.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs ``params``.

  Raises:
    ValueError: for a schedule that is not Moshpit averaging, an ``every`` below 1, or
      (at the update) no ``params``.

  References:
    Ryabinin, Gorbunov, Plokhotnyuk, Pekhimenko, "Moshpit SGD: Communication-Efficient
    Decentralized Training on Heterogeneous Unreliable Devices", NeurIPS 2021.
  """
  if not is_moshpit(schedule):
    raise ValueError(f"average_replicas(schedule={schedule!r}) averages on Moshpit's grid; "
                     f"pass the gradient reduction's schedule='moshpit' or dq.Moshpit(...)")
  if not isinstance(every, int) or isinstance(every, bool) or every < 1:
    raise ValueError(f"every={every!r} must be an int >= 1 (1: average the replicas every "
                     f"step)")
  mosh = as_moshpit(schedule)

  def init_fn(params):
    del params
    return AverageReplicasState(
        step=jnp.zeros([], jnp.int32),
        key=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("average_replicas needs params: call tx.update(grads, state, params) "
                       "(dq.data_parallel_step does)")
    n = axis_context(axis_name).n
    nxt = AverageReplicasState(optax.safe_increment(state.step), state.key)
    if n == 1 and mosh.grid is None:
      return updates, nxt
    plan = mosh.plan(n)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    here = presence(plan, mosh, key, None, jax.lax.axis_index(axis_name))
    new = jax.tree.map(lambda p, u: p + u, params, updates)

    def averaged(_):
      return replica_rounds(new, plan, axis_name, here)

    if every == 1:
      move = averaged(None)
    else:
      def unchanged(_):  # zeros, varying over the axes the parameters vary over
        return jax.tree.map(lambda a: jnp.where(False, jnp.asarray(a, jnp.float32), 0.0), new)

      move = jax.lax.cond(state.step % every == every - 1, averaged, unchanged, None)
    # where nothing moves, the update itself (not u + 0, which turns a -0 into +0)
    out = jax.tree.map(lambda u, m: jnp.where(m == 0, u, (u + m).astype(u.dtype)), updates,
                       move)
    return out, nxt

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
