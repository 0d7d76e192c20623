"""Moshpit averaging: grid-group rounds, exact after d rounds, count-weighted under dropout."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from _helpers import model_data, per_rank, rows_identical
from dynamiq_jax.bench.reference import vnmse
from dynamiq_jax.codecs import F32, DynamiQ
from dynamiq_jax.engine.moshpit import average_replicas, presence, replica_rounds

D = 1 << 12


def moshpit_averager(weights, grid, placement, alive):
  """A numpy port of ``MoshpitAverager.__call__`` (yandex-research/moshpit-sgd,
  averaging_experiments/averager.py), one call per round, for vectors: the alive peers
  are put on the grid at their cells, ``nanmean`` along round t's axis, the dead keep
  their weights. ``placement[t]``: each peer's cell in round t; ``alive[t]``: bool."""
  weights = np.asarray(weights, np.float64)
  grid = tuple(grid)
  for t in range(placement.shape[0]):
    axis = t % len(grid)
    live = np.nonzero(alive[t])[0]
    cells = np.unravel_index(placement[t][live], grid)
    on_grid = np.full(grid + weights.shape[1:], np.nan)
    on_grid[cells] = weights[live]
    with warnings.catch_warnings():  # a group with nobody alive: "Mean of empty slice"
      warnings.simplefilter("ignore", RuntimeWarning)
      on_grid[:] = np.nanmean(on_grid, axis=axis, keepdims=True)
    new = weights.copy()
    new[live] = on_grid[cells]
    weights = new
  return weights


def weighted_averager(weights, plan, alive):
  """The weighted rounds (``dq.Moshpit(weighted=True)``) in numpy: each rank carries its
  value and the count of contributions it holds; a group's present members take
  ``sum(count * value) / sum(count)`` and hold ``sum(count)``; the absent keep both."""
  value = np.asarray(weights, np.float64).copy()
  count = np.ones(len(value))
  for t in range(plan.rounds):
    for g in plan.groups(t):
      live = [r for r in g if alive[t, r]]
      if live:
        c = count[live].sum()
        value[live] = (count[live, None] * value[live]).sum(0) / c
        count[live] = c
  return value


def _simulate(g, schedule, codec=None, *, key=0, absent=None):
  return np.asarray(dq.simulate(g, codec=codec or F32(), schedule=schedule,
                                key=jax.random.key(key), absent=absent))


def _spread(x):
  x = np.asarray(x, np.float64)
  return float(np.mean(np.sum((x - x.mean(0)) ** 2, axis=1)))


@pytest.mark.parametrize("grid", [(4, 4), (2, 2, 2)])
def test_exact_mean_after_d_rounds(grid):
  n = int(np.prod(grid))
  g = np.asarray(model_data("iid", n, D, 0), np.float32)
  out = _simulate(g, dq.Moshpit(grid=grid))
  mean = g.astype(np.float64).mean(0)
  np.testing.assert_allclose(out, np.broadcast_to(mean, out.shape), rtol=1e-6,
                             atol=1e-9 * np.abs(mean).max())
  assert rows_identical(out)


def test_fewer_rounds_than_axes_is_not_the_mean():
  """One round of a 4 x 4 grid averages within groups of 4 only: the test above can fail."""
  g = np.asarray(model_data("iid", 16, D, 0), np.float32)
  out = _simulate(g, dq.Moshpit(grid=(4, 4), rounds=1))
  assert not rows_identical(out)
  np.testing.assert_allclose(out[0], g[[0, 4, 8, 12]].mean(0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grid,shuffle", [((4, 4), None), ((2, 2, 2), None), ((4, 4), 3)])
def test_dropout_mask_matches_the_reference_averager(grid, shuffle):
  n, rounds = int(np.prod(grid)), 2 * len(grid)
  rng = np.random.default_rng(7)
  absent = rng.random((rounds, n)) < 0.25
  absent[1, :] = False
  absent[1, :grid[-1]] = True  # a whole group of round 1 absent (on the default placement)
  g = np.asarray(model_data("heavy", n, D, 1), np.float32)
  schedule = dq.Moshpit(grid=grid, rounds=rounds, shuffle=shuffle, weighted=False)
  out = _simulate(g, schedule, absent=jnp.asarray(absent))
  placement = schedule.plan(n).placement()
  want = moshpit_averager(g, grid, placement, ~absent)
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=1e-6 * np.abs(want).max())
  never = absent.all(axis=0)
  np.testing.assert_array_equal(out[never], g[never])  # absent throughout: untouched
  # weighted (the default): each member counts as the contributions its value holds
  weighted = dq.Moshpit(grid=grid, rounds=rounds, shuffle=shuffle)
  out = _simulate(g, weighted, absent=jnp.asarray(absent))
  want_w = weighted_averager(g, weighted.plan(n), ~absent)
  np.testing.assert_allclose(out, want_w, rtol=2e-5, atol=1e-6 * np.abs(want_w).max())
  assert np.abs(want_w - want).max() > 1e-3 * np.abs(want).max()  # the two differ here


def test_weighted_rounds_give_the_exact_mean_of_the_contributions_held():
  """Rank 0 misses round 0 of a 2 x 4 grid, so its round-0 partner (4) averages alone: each
  round-1 group then holds 7 of the 8 contributions, and its weighted mean is their exact
  mean (the unweighted one gives ranks 0 and 4 twice the others' weight)."""
  g = np.asarray(model_data("iid", 8, D, 3), np.float32).astype(np.float64)
  absent = np.zeros((2, 8), bool)
  absent[0, 0] = True
  out = _simulate(g.astype(np.float32), dq.Moshpit(grid=(2, 4)), absent=jnp.asarray(absent))
  plan = dq.Moshpit(grid=(2, 4)).plan(8)
  partner = next(r for grp in plan.groups(0) if 0 in grp for r in grp if r != 0)
  for grp in plan.groups(1):
    held = [r for r in range(8) if r != (partner if 0 in grp else 0)]
    for r in grp:
      np.testing.assert_allclose(out[r], g[held].mean(0), rtol=1e-5, atol=1e-6)
  plain = _simulate(g.astype(np.float32), dq.Moshpit(grid=(2, 4), weighted=False),
                    absent=jnp.asarray(absent))
  want = g[[r for r in range(8) if r != partner]].mean(0)
  assert np.abs(plain[0] - want).max() > 0.05 * np.abs(want).max()


# weighted= sets each member's share (exactly 1 with everyone present) and the count, before
# the codec: the F32 case checks that path; DynamiQ's (two DynamiQ programs to compile)
# runs with .ci/run-slow.
@pytest.mark.parametrize("codec", [F32(), pytest.param(DynamiQ(bits=5), marks=pytest.mark.slow)],
                         ids=["F32", "DynamiQ"])
def test_weighted_changes_nothing_with_everyone_present(codec):
  g = np.asarray(model_data("heavy", 16, D, 4), np.float32)
  a = _simulate(g, dq.Moshpit(grid=(4, 4)), codec)
  b = _simulate(g, dq.Moshpit(grid=(4, 4), weighted=False), codec)
  np.testing.assert_array_equal(a, b)


def test_absent_rank_keeps_its_value_and_the_group_divides_by_the_count():
  g = np.asarray(model_data("iid", 8, D, 2), np.float32)
  absent = np.zeros((1, 8), bool)
  absent[0, 1] = True  # grid (2, 4), round 0 averages along axis 0: groups {r, r + 4}
  absent[0, 6] = True
  out = _simulate(g, dq.Moshpit(grid=(2, 4), rounds=1), absent=jnp.asarray(absent))
  np.testing.assert_array_equal(out[1], g[1])
  np.testing.assert_array_equal(out[6], g[6])
  np.testing.assert_array_equal(out[5], g[5])  # its partner (1) absent: the mean of one
  np.testing.assert_array_equal(out[2], g[2])
  np.testing.assert_allclose(out[0], (g[0] + g[4]) / 2, rtol=1e-6)


def test_spread_falls_tenfold_over_2d_rounds_at_ten_percent_dropout():
  grid = (4, 4)
  g = np.asarray(model_data("heavy", 16, D, 3), np.float32)
  for key in range(3):
    out = _simulate(g, dq.Moshpit(grid=grid, rounds=2 * len(grid), dropout=0.1), key=key)
    assert _spread(out) * 10 <= _spread(g), key


def test_dropout_is_drawn_from_the_key():
  g = np.asarray(model_data("iid", 16, D, 4), np.float32)
  schedule = dq.Moshpit(grid=(4, 4), dropout=0.3)
  a, b, c = (_simulate(g, schedule, key=k) for k in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  assert not rows_identical(a)  # someone was absent: the replicas differ, by design


def test_dynamiq_in_groups_against_the_ring_at_equal_bits():
  """Five bits per coordinate in every round, every rank present: the rounds' errors add,
  but each group's quantisation error is averaged by the later rounds; measured against
  the flat ring of the same codec on the same gradients (docs/guide.md records it)."""
  n, d = 16, 1 << 16
  errs = {}
  for dataset in ("heavy", "iid"):
    g = np.asarray(model_data(dataset, n, d, 5), np.float32)
    for name, schedule in (("ring", "ring"), ("moshpit", dq.Moshpit(grid=(4, 4)))):
      out = _simulate(g, schedule, DynamiQ(bits=5))
      assert rows_identical(out), name
      errs[dataset, name] = vnmse(out[0], g)
    assert errs[dataset, "moshpit"] <= 1.25 * errs[dataset, "ring"], errs


def test_shard_map_matches_simulate(mesh):
  """A 3-d grid, a round per axis, with dropout and a shuffle, on 8 devices and in the
  simulation, bit for bit. (Rounds beyond the axes, ``t mod d``, are the plan's alone and
  the same in both: test_dropout_mask_matches_the_reference_averager checks them; each
  round here is a DynamiQ pass to compile in both programs.)"""
  g = np.asarray(model_data("iid", 8, D, 6), np.float32)
  schedule = dq.Moshpit(grid=(2, 2, 2), rounds=3, dropout=0.2, shuffle=1)
  fn = lambda x: dq.allreduce(x, axis_name="data", codec=DynamiQ(bits=5), schedule=schedule,
                              key=jax.random.key(9))[0]
  got = np.asarray(per_rank(mesh, fn, g))
  want = _simulate(g, schedule, DynamiQ(bits=5), key=9)
  np.testing.assert_array_equal(got, want)


def test_wire_accounting_sums_the_rounds():
  g = {"w": jnp.zeros((1 << 16,), jnp.float32)}
  codec = DynamiQ(bits=5)
  ring = dq.wire_stats(g, codec=codec, n=4)
  plain = dq.wire_stats(g, codec=codec, n=16)
  mosh = dq.wire_stats(g, codec=codec, n=16, schedule=dq.Moshpit(grid=(4, 4)))
  assert mosh.bytes_per_rank == pytest.approx(2 * ring.bytes_per_rank)
  assert mosh.bits_per_coord == pytest.approx(ring.bits_per_coord)
  assert mosh.bytes_per_rank > plain.bytes_per_rank
  from dynamiq_jax.engine.moshpit import round_reports
  rounds = round_reports([1 << 16], codec, dq.Moshpit(grid=(2, 8)).plan(16))
  assert [r.bytes_per_rank for r in rounds] == [
      dq.wire_stats(g, codec=codec, n=m).bytes_per_rank for m in (2, 8)]
  # the stats the all-reduce itself returns (under jit, only they are used: XLA drops the
  # reduction, which run eagerly compiles op by op)
  out = jax.jit(jax.vmap(lambda x: dq.allreduce(x, axis_name="i", codec=codec,
                                                schedule=dq.Moshpit(grid=(4, 4)),
                                                key=jax.random.key(0))[1].bytes_per_rank,
                         axis_name="i"))({"w": jnp.zeros((16, 1 << 16))})
  assert float(out[0]) == pytest.approx(mosh.bytes_per_rank)


def test_grid_defaults_and_errors():
  assert dq.schedules.default_grid(16) == (4, 4)
  assert dq.schedules.default_grid(8) == (2, 4)
  assert dq.Moshpit().plan(12).grid == (3, 4)
  with pytest.raises(ValueError, match=r"prime.*grid=\(7,\)"):
    dq.Moshpit().plan(7)
  with pytest.raises(ValueError, match=r"holds 12 ranks but the axis has 16"):
    dq.Moshpit(grid=(3, 4)).plan(16)
  with pytest.raises(ValueError, match="each an int >= 2"):
    dq.Moshpit(grid=(1, 16))
  with pytest.raises(ValueError, match="probability"):
    dq.Moshpit(dropout=1.0)
  with pytest.raises(ValueError, match="power of two"):
    dq.Moshpit(grid=(3, 4), inner="butterfly").plan(12)
  with pytest.raises(ValueError, match="rounds"):
    dq.Moshpit(rounds=0)


def test_unsupported_options_say_the_fix():
  g = jnp.zeros((4, 1024))
  run = lambda **kw: jax.vmap(lambda x: dq.allreduce(
      x, axis_name="i", key=jax.random.key(0), **kw)[0], axis_name="i")(g)
  with pytest.raises(ValueError, match="stateless codecs without error feedback"):
    run(codec=DynamiQ(), schedule="moshpit", return_own=True)
  with pytest.raises(ValueError, match="absent= is a mask of Moshpit"):
    run(codec=F32(), absent=jnp.zeros((2, 4), bool))
  with pytest.raises(ValueError, match=r"bool array \[rounds, n\] = \[2, 4\]"):
    run(codec=F32(), schedule=dq.Moshpit(grid=(2, 2)), absent=jnp.zeros((1, 4), bool))
  with pytest.raises(ValueError, match="stacked= runs the flat schedules"):
    run(codec=F32(), schedule="moshpit", stacked=lambda path, leaf: True)


def test_nonfinite_poisons_only_its_groups():
  g = np.asarray(model_data("iid", 8, D, 7), np.float32)
  g[3, 10] = np.nan
  out = _simulate(g, dq.Moshpit(grid=(2, 4), rounds=1))  # groups {r, r + 4}
  assert np.isnan(out[3]).all() and np.isnan(out[7]).all()
  assert np.isfinite(out[[0, 1, 2, 4, 5, 6]]).all()


def _loss(p, b):
  x, y = b
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


@functools.cache
def _training_step(mesh, schedule, per_rank, every, codec):
  """The chain and its jitted step, built once per configuration: tests that train the same
  configuration share its compiled program (one DynamiQ step: tens of seconds of compile)."""
  import optax
  last = [average_replicas(schedule=schedule, every=every)] if every else []
  tx = optax.chain(dq.compressed_psum(codec=codec, schedule=schedule), optax.adam(1e-2), *last)
  return tx, dq.data_parallel_step(_loss, tx, mesh=mesh, per_rank=per_rank)


def _regression(mesh, schedule, per_rank, steps=20, every=0, spreads=None, rms=False,
                codec=DynamiQ(bits=5)):
  """``every``: ``average_replicas`` last in the chain, every this many steps (0: not);
  ``spreads``: a list that gets the replicas' spread (:func:`_replica_spread`, ``rms``)
  per step."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  k = jax.random.split(jax.random.key(0), 3)
  params = {"w1": jax.random.normal(k[0], (16, 512)) * 0.3,
            "w2": jax.random.normal(k[1], (512, 4)) * 0.1}
  x = jax.random.normal(k[2], (8 * 32, 16))
  batch = jax.device_put((x, jnp.sin(x[:, :4])), NamedSharding(mesh, P("data")))
  tx, step = _training_step(mesh, schedule, per_rank, every, codec)
  if per_rank:
    params, state = dq.per_rank_copies((params, tx.init(params)), mesh=mesh)
  else:
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = dq.data_parallel_init(tx, params, mesh=mesh)
  losses = []
  for _ in range(steps):
    params, state, value = step(params, state, batch)
    losses.append(float(value))
    if spreads is not None:
      spreads.append(_replica_spread(params, rms))
  return params, losses


def _replica_spread(stacked, rms: bool = False) -> float:
  """The largest distance of a replica from the replicas' mean (``rms``: their root mean
  square), over the mean's norm."""
  flat = np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1)
                         for a in jax.tree.leaves(stacked)], axis=1)
  mean = flat.mean(0)
  dist = np.linalg.norm(flat - mean, axis=1)
  return float((np.sqrt(np.mean(dist ** 2)) if rms else dist.max()) / np.linalg.norm(mean))


def test_training_keeps_each_rank_its_own_parameters(mesh):
  params, losses = _regression(mesh, dq.Moshpit(grid=(2, 4)), per_rank=True)
  assert np.asarray(params["w1"]).shape == (8, 16, 512)
  assert rows_identical(params)  # nobody absent: the replicas stay bit-identical
  assert losses[-1] < 0.5 * losses[0]
  # (F32: an exact reduction, so only the absences can set the replicas apart; the step
  # the drift tests below train with, compiled once)
  params, _ = _regression(mesh, dq.Moshpit(grid=(2, 4), dropout=0.2), per_rank=True, steps=3,
                          codec=F32())
  assert not rows_identical(params)  # absent ranks kept their own gradients


def test_replicated_parameters_refuse_a_per_rank_reduction(mesh):
  with pytest.raises(ValueError, match=r"differs between ranks.*per_rank=True"):
    _regression(mesh, dq.Moshpit(grid=(2, 4)), per_rank=False, steps=1)


def test_per_rank_refuses_replicated_leaves(mesh):
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  tx = optax.chain(dq.compressed_psum(schedule="moshpit"), optax.sgd(0.1))
  params = jax.device_put({"w": jnp.ones((8, 4))}, NamedSharding(mesh, P()))
  step = dq.data_parallel_step(lambda p, b: jnp.sum(p["w"] * b), tx, mesh=mesh, per_rank=True)
  with pytest.raises(ValueError, match=r"leading axis of ranks.*per_rank_copies"):
    step(params, tx.init(params), jax.device_put(jnp.ones((8, 4)),
                                                  NamedSharding(mesh, P("data"))))


def test_reducer_name():
  tx = dq.reducer("moshpit", "data", grid=(2, 2), dropout=0.1, bits=4)
  assert callable(tx.update)
  with pytest.raises(ValueError, match="is a schedule"):
    dq.reducer("moshpit", "data", schedule="butterfly")
  with pytest.raises(ValueError, match="codec='nope'"):
    dq.reducer("moshpit", "data", codec="nope")


def test_group_collectives_stay_within_their_groups():
  """GroupContext's vocabulary (what the executor and the metadata pass call) against
  numpy, on round 1 of a 2 x 4 grid with a shuffle: groups of 4 that are not contiguous."""
  plan = dq.Moshpit(grid=(2, 4), rounds=2, shuffle=5).plan(8)
  groups = plan.groups(1)
  x = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8, 4, 3) ** 1.5  # rank r: [4 rows, 3]

  def f(a):
    ctx = plan.context(1, "i", 8)
    return (ctx.rank(), ctx.all_gather(a), ctx.all_to_all(a), ctx.pmax(a), ctx.psum(a))

  rank, gathered, swapped, top, total = jax.jit(jax.vmap(f, axis_name="i"))(jnp.asarray(x))
  for g in groups:
    for i, r in enumerate(g):
      assert int(rank[r]) == i
      np.testing.assert_array_equal(gathered[r], x[list(g)])
      np.testing.assert_array_equal(swapped[r], x[list(g), i])  # row s: member s's row i
      np.testing.assert_array_equal(top[r], x[list(g)].max(0))
      np.testing.assert_array_equal(total[r], x[g[0]] + x[g[1]] + x[g[2]] + x[g[3]])


# ---------------------------------------------------------------------------
# absent ranks rejoin: the replicas averaged in the same rounds


@functools.cache
def _replica_rounds_program(plan):
  f = lambda a, p: a + replica_rounds(a, plan, "i", p)
  return jax.jit(jax.vmap(f, axis_name="i"))  # one program (eagerly: op by op)


def _replica_rounds(x, plan, absent):
  """``x + replica_rounds(x)`` on every rank (vmap), rank r absent where ``absent[t, r]``."""
  here = 1.0 - np.asarray(absent, np.float32).T  # [n, rounds]
  return np.asarray(_replica_rounds_program(plan)(jnp.asarray(x), here))


@pytest.mark.parametrize("grid, shuffle", [((2, 4), None), ((2, 2, 2), 3)])
def test_replica_rounds_match_the_reference_averager(grid, shuffle):
  """The replicas' rounds are the reference averager's, absences included; with nobody
  absent every replica ends at the exact mean."""
  plan = dq.Moshpit(grid=grid, shuffle=shuffle).plan(8)
  x = np.asarray(model_data("iid", 8, 256, 1), np.float32)
  absent = np.random.default_rng(4).random((plan.rounds, 8)) < 0.3
  absent[0, 0], absent[1:, 0] = True, False  # rank 0 misses round 0 and rejoins after
  out = _replica_rounds(x, plan, absent)
  ref = moshpit_averager(x, grid, plan.placement(), ~absent)
  np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6 * np.abs(x).max())
  everyone = _replica_rounds(x, plan, np.zeros_like(absent))
  np.testing.assert_allclose(everyone, np.broadcast_to(x.astype(np.float64).mean(0), x.shape),
                             rtol=1e-5, atol=1e-6 * np.abs(x).max())


def test_an_absent_rank_rejoins_its_group_average():
  """Rank 0 is absent from round 0 (it keeps its value) and present in round 1: it ends at
  the mean of its round-1 group's values as they stood after round 0."""
  plan = dq.Moshpit(grid=(2, 4)).plan(8)
  x = np.asarray(model_data("iid", 8, 256, 2), np.float32)
  absent = np.zeros((2, 8), bool)
  absent[0, 0] = True
  after0 = _replica_rounds(x, dq.Moshpit(grid=(2, 4), rounds=1).plan(8), absent[:1])
  np.testing.assert_array_equal(after0[0], x[0])  # absent: kept its own value
  out = _replica_rounds(x, plan, absent)
  group = next(g for g in plan.groups(1) if 0 in g)
  mean = after0[list(group)].astype(np.float64).mean(0)
  np.testing.assert_allclose(out[0], mean, rtol=1e-5, atol=1e-6 * np.abs(mean).max())
  for r in group:  # every member of that group holds the same average
    np.testing.assert_allclose(out[r], out[0], rtol=1e-6, atol=1e-7 * np.abs(mean).max())


def test_replicas_stay_bounded_under_a_random_walk():
  """Every rank adds its own noise each step (a stand-in for differing updates) and 10% of
  the (rank, round) slots are absent, over 300 steps: averaged each step the replicas stay
  within a few steps' noise of each other; without it their spread grows like sqrt(t)."""
  n, d, steps = 8, 64, 300
  mosh = dq.Moshpit(grid=(2, 4), dropout=0.1)
  plan = mosh.plan(n)

  def one(carry, s):
    x, y = carry  # x averaged each step, y not
    key = jax.random.fold_in(jax.random.key(0), s)
    noise = jax.random.normal(jax.random.fold_in(key, jax.lax.axis_index("i")), (d,))
    here = presence(plan, mosh, key, None, jax.lax.axis_index("i"))
    x = x + noise
    x = x + replica_rounds(x, plan, "i", here)
    return (x, y + noise), x  # and x after every step

  def walk(x0):
    return jax.lax.scan(one, (x0, x0), jnp.arange(steps))

  (x, y), xs = jax.jit(jax.vmap(walk, axis_name="i"))(jnp.zeros((n, d)))
  noise = np.sqrt(d)  # one step's noise norm per rank
  spread = lambda a: float(np.linalg.norm(a - a.mean(0), axis=1).max())
  assert spread(np.asarray(x)) < 3 * noise
  assert spread(np.asarray(y)) > 10 * noise  # the control: nothing pulls them back

  # the whole run, not only its end: the spread after every step
  xs = np.asarray(xs)  # [n, steps, d]
  per_step = np.linalg.norm(xs - xs.mean(0), axis=2).max(0)
  assert per_step.max() < 4 * noise
  assert per_step[steps // 2:].max() < 2 * per_step[: steps // 2].max()  # not growing


def test_training_with_absent_peers_keeps_the_replicas_together(mesh):
  """Training at 20% absent per round: with the replicas averaged every step the spread
  stays bounded and small; with the gradient alone it grows. Nobody absent: the replicas'
  averaging changes nothing but float32 rounding. (The gradient reduced exactly, F32: what
  moves the replicas apart is the absences, whatever the codec; ``alone[-1] / max(pulled)``
  is 4.8 here and 5.0 with DynamiQ(bits=5), at a tenth of DynamiQ's compile.)"""
  mosh = dq.Moshpit(grid=(2, 4), dropout=0.2)
  pulled, alone = [], []
  _regression(mesh, mosh, per_rank=True, steps=40, every=1, spreads=pulled, codec=F32())
  _regression(mesh, mosh, per_rank=True, steps=40, spreads=alone, codec=F32())
  assert alone[-1] > 4 * max(pulled)  # gradient averaging alone drifts
  assert max(pulled[20:]) < 2 * max(pulled[:20])  # bounded, not growing
  assert alone[-1] > 1.1 * alone[19]  # (the control grows)
  plain, losses = _regression(mesh, dq.Moshpit(grid=(2, 4)), per_rank=True, steps=5,
                              codec=F32())
  again, losses2 = _regression(mesh, dq.Moshpit(grid=(2, 4)), per_rank=True, steps=5,
                               every=1, codec=F32())
  assert rows_identical(again)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(again)):  # (XLA may fuse the
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)  # update anew)
  np.testing.assert_allclose(losses, losses2, rtol=1e-6)


def test_average_replicas_every_k_steps(mesh):
  """every=3: the replicas meet only at steps 2, 5, 8, ...; between those the updates pass
  unchanged. (The spread as a root mean square: a meeting replaces the present ranks of a
  group by their mean, which always lowers it; the largest distance stays where the
  farthest replica was absent. F32 at 20% absent: the step without the replicas' rounds is
  the one the tests above compiled.)"""
  mosh = dq.Moshpit(grid=(2, 4), dropout=0.2)
  spreads, alone = [], []
  _regression(mesh, mosh, per_rank=True, steps=6, every=3, spreads=spreads, rms=True,
              codec=F32())
  _regression(mesh, mosh, per_rank=True, steps=6, spreads=alone, rms=True, codec=F32())
  np.testing.assert_allclose(spreads[:2], alone[:2], rtol=1e-5)  # before the first meeting:
  # the updates pass unchanged (to float32 rounding: XLA fuses the update anew)
  assert spreads[2] < alone[2] and spreads[5] < alone[5]  # the meetings pull them together


def test_average_replicas_errors():
  with pytest.raises(ValueError, match=r"schedule='ring'.*Moshpit"):
    average_replicas(schedule="ring")
  with pytest.raises(ValueError, match=r"every=0 must be an int >= 1"):
    average_replicas(schedule="moshpit", every=0)
  tx = average_replicas(schedule=dq.Moshpit(grid=(2, 4)))
  with pytest.raises(ValueError, match="needs params"):
    jax.vmap(lambda u: tx.update(u, tx.init(u))[0], axis_name="data")(jnp.ones((8, 3)))
