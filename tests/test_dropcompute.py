"""DropCompute: the stop rule, the threshold chooser, the weighted all-reduce, and a
multi-process step with one slow worker."""

import functools
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.training import multiprocess
from dynamiq_jax.training.dropcompute import ThresholdController
from dynamiq_jax.training.dropcompute import finished_mask
from dynamiq_jax.training.dropcompute import simulated_step
from dynamiq_jax.training.dropcompute import throughput

HERE = os.path.dirname(__file__)


# ---------------------------------------------------------------------------
# the stop rule and the throughput model


def test_stop_rule_on_equal_times_ends_within_the_threshold():
  times = np.array([[0.3] * 8, [0.1] * 8, [1.5] * 8])
  mask, done = finished_mask(times, 1.0)
  assert mask.sum(1).tolist() == [3, 8, 1]  # the first always runs, even past the threshold
  assert done[:2].max() <= 1.0 and done[2] == 1.5
  mask, done = finished_mask(times, None)
  assert mask.all() and done.tolist() == pytest.approx([2.4, 0.8, 12.0])


def test_stop_rule_predicts_with_the_fastest_so_far():
  # after 0.2 + 0.9 = 1.1 s the fastest was 0.2: 1.3 <= 1.5 starts the third, which then
  # overruns; nothing more starts
  mask, done = finished_mask([[0.2, 0.9, 0.6, 0.1]], 1.5)
  assert mask.tolist() == [[True, True, True, False]] and done[0] == pytest.approx(1.7)
  # a stopped worker stays stopped, whatever later micro-batches would take
  mask, _ = finished_mask([[1.0, 5.0, 0.0, 0.0]], 2.0)
  assert mask.tolist() == [[True, True, False, False]]


def test_throughput_counts_finished_micro_batches_over_time():
  t = np.array([[[1.0] * 4, [3.0] * 4]])
  assert throughput(t, None, comm_s=4.0) == (8 / 16, 0.0)
  # the fast one does 3 (3 + 1 > 3 stops the fourth), the slow one 1: 4 in 3 + 4 s
  assert throughput(t, 3.0, comm_s=4.0) == (4 / 7, 0.5)


@pytest.mark.parametrize("times", [[[1.0, np.nan]], [[1.0, -0.5]], [1.0, 2.0]])
def test_bad_times_are_refused(times):
  with pytest.raises(ValueError, match="times"):
    finished_mask(times, 1.0)


# ---------------------------------------------------------------------------
# the threshold chooser


def test_chooser_finds_the_exact_optimum_of_a_deterministic_straggler():
  # 7 workers take 1 s per micro-batch, one takes 2 s; 8 micro-batches. Letting the slow
  # worker do k costs max(2k, 8) s for 56 + k micro-batches: the best is k = 4 (7.5 / s),
  # which every threshold in [8, 10) gives; the chooser returns the middle.
  t = np.array([[[1.0] * 8] * 7 + [[2.0] * 8]])
  c = dq.choose_threshold(t)
  assert c.threshold_s == 9.0 and c.throughput == 7.5 and c.sync_throughput == 4.0
  assert c.drop_rate == pytest.approx(4 / 64) and c.speedup == pytest.approx(7.5 / 4)
  # communication time shrinks the gain but not the choice here: 60 / 10 against 64 / 18
  c = dq.choose_threshold(t, comm_s=2.0)
  assert c.threshold_s == 9.0 and c.speedup == pytest.approx((60 / 10) / (64 / 18))


def test_chooser_keeps_every_micro_batch_when_dropping_does_not_pay():
  c = dq.choose_threshold(np.full((3, 4, 8), 0.5))
  assert c.threshold_s == math.inf and c.drop_rate == 0.0 and c.speedup == 1.0


def _lognormal_steps(rng, steps, *, sigma, slow, n=8, m=16):
  """1 s of compute plus a heavy-tailed delay (mean 0.5 s) per micro-batch; the last
  worker's delays ``slow`` times longer."""
  delay = 0.5 * rng.lognormal(-sigma**2 / 2, sigma, (steps, n, m))
  delay[:, -1] *= slow
  return 1.0 + delay


@pytest.mark.parametrize("sigma,slow,comm,measured", [
    (1.0, 2.0, 2.0, 10),   # heavy tail and a persistent straggler
    (1.0, 1.0, 2.0, 10),   # heavy tail only
    (0.5, 1.0, 0.5, 5),    # light tail: little to gain
    (1.0, 3.0, 10.0, 10),  # slow network
])
def test_chooser_reaches_the_throughput_optimum_on_synthetic_times(sigma, slow, comm, measured):
  """Chosen from a few measured steps, the threshold's true throughput (1000 fresh steps)
  is within 2% of the best over a 150-point grid of thresholds (or none)."""
  truth = _lognormal_steps(np.random.default_rng(0), 1000, sigma=sigma, slow=slow)
  grid = np.quantile(np.cumsum(truth, -1), np.linspace(0.02, 1, 150))
  best = max([throughput(truth, g, comm_s=comm)[0] for g in grid]
             + [throughput(truth, None, comm_s=comm)[0]])
  for seed in range(3):
    measured_steps = _lognormal_steps(np.random.default_rng(100 + seed), measured, sigma=sigma,
                                      slow=slow)
    c = dq.choose_threshold(measured_steps, comm_s=comm, resample_steps=256, seed=seed)
    got = throughput(truth, c.threshold_s, comm_s=comm)[0]
    assert got >= 0.98 * best, (seed, c, got / best)
  if sigma == 1.0:  # worth choosing: a threshold beats the synchronous step by 9% or more
    assert best >= 1.09 * throughput(truth, None, comm_s=comm)[0]


def test_chooser_wants_a_clear_gain_before_dropping():
  # one worker 2% slower: dropping its last micro-batch gains 2 / 98 of the throughput
  t = np.array([[[1.0] * 8] * 7 + [[1.02] * 8]])
  assert dq.choose_threshold(t).threshold_s < 8.16
  assert dq.choose_threshold(t).speedup == pytest.approx((63 / 8.0) / (64 / 8.16))
  choice = dq.choose_threshold(t, min_gain=0.05)
  assert choice.threshold_s == math.inf and choice.drop_rate == 0.0 and choice.speedup == 1.0


def test_resampling_keeps_a_workers_step_together():
  """A busy host slows a worker's whole step, not one micro-batch here and there: drawn
  steps keep each worker's measured rows whole, so they never mix fast and slow ones."""
  from dynamiq_jax.training.thresholds import _resample
  t = np.array([[[1.0] * 4, [1.0] * 4], [[3.0] * 4, [2.0] * 4]])  # step 1: both slow
  drawn = _resample(t, 200, seed=0)
  assert drawn.shape == (200, 2, 4)
  assert np.all(drawn == drawn[..., :1])  # every drawn row is one measured row
  assert {tuple(r) for r in drawn[:, 0, 0:1]} == {(1.0,), (3.0,)}


def test_chooser_refuses_bad_input():
  with pytest.raises(ValueError, match="comm_s"):
    dq.choose_threshold(np.ones((2, 2, 2)), comm_s=-1.0)
  with pytest.raises(ValueError, match="steps, workers, micro_batches"):
    dq.choose_threshold(np.ones((2, 2, 2, 2)))
  with pytest.raises(ValueError, match="min_gain"):
    dq.choose_threshold(np.ones((2, 2, 2)), min_gain=-0.1)


# ---------------------------------------------------------------------------
# the policy


@pytest.mark.parametrize("kwargs,match", [
    ({"threshold": 0.0}, "must be > 0 seconds"),
    ({"threshold": "fast"}, "use 'auto'"),
    ({"warmup_steps": 0}, "warmup_steps=0"),
    ({"reestimate_every": 2, "probe_steps": 2}, "must exceed probe_steps"),
    ({"resample_steps": -1}, "resample_steps=-1"),
    ({"min_gain": -0.01}, "min_gain=-0.01"),
])
def test_bad_policy_is_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dq.DropCompute(**kwargs)


def test_controller_schedule_and_choice():
  policy = dq.DropCompute(warmup_steps=3, reestimate_every=10, probe_steps=2, window=4,
                          resample_steps=0)
  ctl = ThresholdController(policy)
  probes = [s for s in range(40) if ctl.probing(s)]
  assert probes == [0, 1, 2, 13, 14, 23, 24, 33, 34]
  slow = np.array([[1.0] * 8] * 7 + [[2.0] * 8])
  for s in range(3):
    assert ctl.threshold(s) == math.inf
    ctl.record(s, slow, comm_s=None if s == 0 else 0.0)
  assert ctl.threshold(3) == 9.0 and ctl.choice.speedup == pytest.approx(7.5 / 4)
  for s in range(3, 13):
    ctl.record(s, np.where(np.arange(8) < 4, slow, np.nan), comm_s=0.0)  # not full: ignored
  assert ctl.threshold(13) == math.inf and ctl.threshold(12) == 9.0
  ctl.record(13, np.full((8, 8), 1.0), comm_s=0.0)
  ctl.record(14, np.full((8, 8), 1.0), comm_s=0.0)
  assert ctl.threshold(15) == 9.0  # the window still holds the three slow steps
  assert ThresholdController(dq.DropCompute(threshold=0.5)).threshold(0) == 0.5
  assert ThresholdController(dq.DropCompute(threshold=None)).threshold(0) == math.inf


# ---------------------------------------------------------------------------
# the weighted all-reduce (simulated: 8 workers in this process)


D, M = 300, 4


def _linear_loss(params, batch):
  return jnp.sum(params["w"] * batch)  # its gradient is the batch itself


@functools.cache
def _setup(mesh, reducer, d=D):
  """A simulated step of SGD(1) on the linear loss, built once per reducer (tests share its
  compiled program), with zero parameters and a fresh optimizer state."""
  tx = optax.chain(dq.reducer(reducer, "data"), optax.sgd(1.0))
  params = jax.device_put({"w": jnp.zeros((d,))}, NamedSharding(mesh, P()))
  opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  step = simulated_step(_linear_loss, tx, mesh=mesh, micro_batches=M)
  return step, params, opt


def _split(mesh, x):
  return jax.device_put(x, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("counts", [
    [1] * 8,                       # C = 8
    [4, 0, 2, 2, 4, 1, 3, 0],      # C = 16, two workers finish none
    [4] * 8,                       # C = 32: all of them
])
def test_weighted_mean_is_exact_with_f32(mesh, counts):
  """Integer gradients and C / n a power of two: every operation is exact, so the update
  must equal the exact mean over the finished micro-batches, bit for bit."""
  step, params, opt = _setup(mesh, "f32-ring")
  rng = np.random.default_rng(sum(counts))
  batches = rng.integers(-50, 50, (8, M, D)).astype(np.float32)
  mask = np.arange(M)[None] < np.asarray(counts)[:, None]
  params, opt, loss, finished = step(params, opt, _split(mesh, batches), _split(mesh, mask))
  want = -batches[mask].astype(np.float64).sum(0) / mask.sum()
  assert int(finished) == sum(counts)
  np.testing.assert_array_equal(np.asarray(params["w"], np.float64), want)
  assert float(loss) == 0.0  # the loss at w = 0


def test_weighted_mean_with_any_mask_and_no_finisher(mesh):
  step, params, opt = _setup(mesh, "f32-ring")
  rng = np.random.default_rng(1)
  batches = rng.standard_normal((8, M, D)).astype(np.float32)
  mask = np.arange(M)[None] < rng.integers(0, M + 1, 8)[:, None]
  mask[3] = False  # this worker finished nothing: it contributes nothing
  new, opt2, _, _ = step(params, opt, _split(mesh, batches), _split(mesh, mask))
  want = -batches[mask].astype(np.float64).mean(0)
  np.testing.assert_allclose(np.asarray(new["w"]), want, rtol=2e-6, atol=2e-7)
  # nobody finished anything: a zero gradient (SGD leaves the parameters), no NaN
  same, _, loss, finished = step(params, opt, _split(mesh, batches),
                                 _split(mesh, np.zeros((8, M), bool)))
  assert int(finished) == 0 and float(loss) == 0.0
  np.testing.assert_array_equal(np.asarray(same["w"]), np.asarray(params["w"]))


# Codecs beyond DynamiQ take the same path (compressed_psum with another codec) and
# each costs a compile of its own: they run with .ci/run-slow.
@pytest.mark.parametrize("reducer", [
    "psum-f32", "psum-bf16", "dynamiq",
    *(pytest.param(r, marks=pytest.mark.slow)
      for r in ("mxfp8", "thc", "omnireduce", "globalqsgd"))])
def test_weighted_mean_with_every_kind_of_reduction(mesh, reducer):
  """Half the micro-batches dropped, unevenly (C = 16 of 32, so C / n = 2). The reduction
  receives exactly the pre-scaled sums ``g_r / 2``: the update is bit for bit the one the
  same step makes when every worker finishes all 4 micro-batches, the first ``2 g_r`` and
  the rest zero (their sum ``2 g_r``, divided by M = 4, is ``g_r / 2`` exactly). A psum's
  update is also the mean over the finished micro-batches within its dtype's rounding."""
  d = 4096
  step, params, opt = _setup(mesh, reducer, d)
  rng = np.random.default_rng(2)
  batches = (1.0 + 0.5 * rng.standard_normal((8, M, d))).astype(np.float32)
  batches *= np.arange(1, M + 1, dtype=np.float32)[None, :, None]  # later ones larger
  counts = np.array([4, 3, 2, 1, 0, 1, 2, 3])
  mask = np.arange(M)[None] < counts[:, None]
  new, _, _, finished = step(params, opt, _split(mesh, batches), _split(mesh, mask))
  got = -np.asarray(new["w"])
  assert int(finished) == counts.sum() == 16
  sums = np.zeros((8, d), np.float32)
  for m in range(M):  # in the step's order, in float32
    sums = np.where(mask[:, m:m + 1], sums + batches[:, m], sums)
  full = np.zeros_like(batches)
  full[:, 0] = 2 * sums
  same, _, _, all_of_them = step(params, opt, _split(mesh, full),
                                 _split(mesh, np.ones((8, M), bool)))
  assert int(all_of_them) == 8 * M
  np.testing.assert_array_equal(got, -np.asarray(same["w"]))
  if reducer.startswith("psum-"):
    want = batches[mask].astype(np.float64).mean(0)
    np.testing.assert_allclose(got, want, rtol=1e-2 if reducer == "psum-bf16" else 1e-6)
  else:  # and the codec did compress: its update is not the exact mean
    assert not np.array_equal(got, batches[mask].mean(0, dtype=np.float32))


# f32-ring takes DynamiQ's path (compressed_psum) with another codec: with .ci/run-slow.
@pytest.mark.parametrize("reducer", [
    "dynamiq", "psum-bf16", pytest.param("f32-ring", marks=pytest.mark.slow)])
def test_all_finished_is_todays_step_bit_for_bit(mesh, reducer):
  """One micro-batch each, all finished: the same bytes as ``dq.data_parallel_step``, step
  after step (AdamW: its moments carry any difference forward)."""
  tx = optax.chain(dq.reducer(reducer, "data"), optax.adamw(1e-2))
  loss_fn = lambda p, b: jnp.mean((b @ p["w"] - 1.0) ** 2)
  params = jax.device_put({"w": jnp.full((64, 8), 0.1)}, NamedSharding(mesh, P()))
  opt = jax.device_put(tx.init(params), NamedSharding(mesh, P()))
  batch = np.random.default_rng(0).standard_normal((8, 16, 64)).astype(np.float32)
  today = dq.data_parallel_step(loss_fn, tx, mesh=mesh, donate=False)
  ours = simulated_step(loss_fn, tx, mesh=mesh, micro_batches=1)
  p1, o1 = params, opt
  p2, o2 = params, opt
  for _ in range(3):
    p1, o1, l1 = today(p1, o1, _split(mesh, batch.reshape(128, 64)))
    p2, o2, l2, _ = ours(p2, o2, _split(mesh, batch[:, None]), _split(mesh, np.ones((8, 1), bool)))
  np.testing.assert_array_equal(np.asarray(p1["w"]), np.asarray(p2["w"]))
  assert float(l1) == pytest.approx(float(l2), rel=1e-6)


# ---------------------------------------------------------------------------
# the host loop (one worker per process)


def _host_setup(policy, codec=None, clock=None):
  mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  tx = optax.chain(dq.compressed_psum("data", codec=codec or dq.codecs.F32()), optax.sgd(1.0))
  params = jax.device_put({"w": jnp.zeros((D,))}, NamedSharding(mesh1, P()))
  opt = jax.device_put(tx.init(params), NamedSharding(mesh1, P()))
  kw = {"clock": clock} if clock else {}
  return dq.dropcompute_step(_linear_loss, tx, mesh=mesh1, micro_batches=M, policy=policy,
                             **kw), params, opt


class FakeClock:
  """Seconds that advance only when a micro-batch is fetched (by its given duration)."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_host_loop_stops_by_the_rule_and_averages_what_ran():
  clock = FakeClock()
  step, params, opt = _host_setup(dq.DropCompute(threshold=2.5), clock=clock)
  data = np.arange(M * D, dtype=np.float32).reshape(M, D)

  def fetch(m):
    clock.now += 1.0  # every micro-batch takes 1 s
    return data[m]

  params, opt, loss, stats = step(params, opt, fetch)
  # 1 s + 1 s fastest = 2 <= 2.5 starts the second; 2 + 1 > 2.5 stops before the third
  assert stats.finished == 2 and stats.finished_per_worker.tolist() == [2]
  assert stats.drop_rate == 0.5 and stats.threshold_s == 2.5
  assert stats.times[0, :2].tolist() == [1.0, 1.0] and np.isnan(stats.times[0, 2:]).all()
  np.testing.assert_array_equal(np.asarray(params["w"]), -data[:2].mean(0))
  assert loss == 0.0 and stats.compute_s.tolist() == [2.0]


def test_host_loop_all_finished_equals_the_synchronous_step():
  data = [np.random.default_rng(m).standard_normal(D).astype(np.float32) for m in range(M)]
  out = []
  for policy in (dq.DropCompute(threshold=None), dq.DropCompute(threshold=1e9)):
    step, params, opt = _host_setup(policy, codec=dq.codecs.DynamiQ())
    for _ in range(2):
      params, opt, loss, stats = step(params, opt, data)
    assert stats.finished == M and stats.drop_rate == 0.0
    out.append(np.asarray(params["w"]))
  np.testing.assert_array_equal(out[0], out[1])


def test_host_loop_needs_one_device_per_process(mesh):
  tx = optax.chain(dq.compressed_psum("data"), optax.sgd(1.0))
  with pytest.raises(ValueError, match="one worker per process.*holds 8 devices"):
    dq.dropcompute_step(_linear_loss, tx, mesh=mesh, micro_batches=2)
  with pytest.raises(ValueError, match="micro_batches=0"):
    dq.dropcompute_step(_linear_loss, tx, mesh=mesh, micro_batches=0)


# ---------------------------------------------------------------------------
# several processes, one of them slow


def test_a_slow_process_ends_its_step_within_the_budget():
  """2 processes (gloo), a bf16 ring; process 1 takes 0.15 s per micro-batch. With a 0.5 s
  budget its step ends within the budget plus the all-reduce (measured in a step with no
  slowness), not after its 8 x 0.15 s; both processes end with the same parameters.
  (DynamiQ over processes: tests/test_bench.py-style in test_dropcompute_bench_tiny, whose
  compile time this test does without.)"""
  coordinator = f"127.0.0.1:{multiprocess.free_port()}"
  outs = multiprocess.launch(
      [[sys.executable, os.path.join(HERE, "dropcompute_worker.py"), coordinator, "2", str(r),
        "bf16-ring"] for r in range(2)], timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  res = [dict(line.split("=", 1) for line in text.split() if "=" in line) for text in outs]
  assert res[0]["digest"] == res[1]["digest"]
  finished = [int(x) for x in res[0]["finished"].split(",")]
  # 4 x 0.15 > 0.5: the slow one stops after 3 (after fewer where a loaded host makes its
  # micro-batches slower still); the other finishes all 8
  assert finished[0] == 8 and 1 <= finished[1] <= 3, finished
  allreduce_s = float(res[0]["allreduce_s"])
  for r in res:
    assert float(r["slow_step_s"]) <= 0.5 + allreduce_s + 0.25, r
    assert float(r["sync_slow_step_s"]) >= 1.2, r  # under a budget it never reaches: all 8


# ---------------------------------------------------------------------------
# the benchmark, tiny (CI)


def test_noise_model_is_the_stated_one():
  from dynamiq_jax.bench import dropcompute as bench
  cfg = {"micro_batches": 4000, "workers": 3,
         "noise": {"delay_ms": 50.0, "sigma": 1.0, "slow_factor": 3.0, "seed": 0}}
  d = bench.noise_delays(cfg, 0, 0)
  assert d.mean() == pytest.approx(0.05, rel=0.1)  # log-normal with mean delay_ms
  assert np.log(d).std() == pytest.approx(1.0, rel=0.05)
  assert bench.noise_delays(cfg, 0, 2).mean() == pytest.approx(0.15, rel=0.1)  # the slow one
  np.testing.assert_array_equal(d, bench.noise_delays(cfg, 0, 0))  # the same every time
  assert not np.array_equal(d, bench.noise_delays(cfg, 1, 0))


def test_bench_bad_flags():
  from dynamiq_jax.bench import dropcompute as bench
  for argv in (["--codecs", "DynamiQ 5b"], ["--micro-batches", "3"], ["--phases", "scaling"],
               ["--codecs", "BF16 psum", "--scaling-codec", "DynamiQ 5b"],
               ["--slow-factor", "-1"]):
    with pytest.raises(SystemExit):
      bench._parse(argv)


def _run(step_s, finished, times, thresholds, evals):
  """A merged run as the benchmark's driver stores it (2 workers, 2 micro-batches)."""
  return {"step_s": step_s, "finished": finished, "times": times, "threshold_s": thresholds,
          "finished_per_worker": [[2, f - 2] for f in finished], "loss": [0.0] * len(step_s),
          "ranks_agree": True,
          "evals": [{"step": s, "eval_loss": e, "micro_batches": m, "wall_s": w}
                    for s, e, m, w in evals]}


def test_bench_summary_on_stored_runs(tmp_path):
  """The driver's side alone (no processes): the tables and the model from stored runs, and
  --from-json rebuilding them; the processes' side: test_dropcompute_bench_tiny (slow)."""
  import argparse
  import json

  from dynamiq_jax.bench import dropcompute as bench
  full = [[0.5, 0.5], [1.0, 1.0]]  # worker 1 twice as slow
  cut = [[0.5, 0.5], [1.0, None]]  # its second micro-batch dropped
  sync = _run([3.0] * 4, [4] * 4, [full] * 4, [None] * 4,
              [(0, 3.0, 0, 0.0), (2, 2.0, 8, 6.0), (4, 1.5, 16, 12.0)])
  drop = _run([3.0, 2.0, 2.0, 2.0], [4, 3, 3, 3], [full, cut, cut, cut], [None] + [1.2] * 3,
              [(0, 3.0, 0, 0.0), (2, 2.0, 7, 5.0), (4, 1.6, 13, 9.0)])
  runs = {f"{c}|{m}": r for c in ("BF16 psum", "DynamiQ 5b")
          for m, r in (("sync", sync), ("dropcompute", drop))}
  cfg = {"workers": 2, "micro_batches": 2, "policy": {"warmup_steps": 1}, "seed": 0,
         "scaling_codec": "DynamiQ 5b", "model_workers": [2, 4]}
  report = {"benchmark": "dropcompute", "config": cfg, "command": "by hand",
            "machine": {}, "train": {"runs": runs}, "quiet": {"runs": runs},
            "scaling": {"runs": {}}}
  summary = bench.summarize(report, argparse.Namespace(target_at=0.5, smooth=1))
  train = summary["train"]
  assert train["target"] == 2.0  # BF16 sync's loss at half its run
  row = train["rows"]["DynamiQ 5b|dropcompute"]
  assert (row["steps_to_target"], row["tta_s"]) == (2, 5.0)
  assert row["speedup_vs"]["BF16 psum|sync"] == 6.0 / 5.0
  assert row["drop_rate"] == 1 - 13 / 16 and row["throughput"] == 13 / 9
  assert row["final_vs_sync"] == 1.6 / 1.5 - 1 and row["threshold_s_median"] == 1.2
  assert summary["quiet"]["rows"]["BF16 psum|dropcompute"]["vs_sync"] == 9 / 12
  measured = summary["scaling"]["measured"]["2"]  # after the 1 measured step
  assert measured["speedup"] == (9 / 6) / (12 / 9)
  model = summary["scaling"]["model"]
  assert model["comm_s"] == 1.0  # a 3 s step after 2 s of the slowest worker's compute
  assert (model["ordinary_mean_s"], model["slow_mean_s"]) == (0.5, 1.0)
  for name in bench.MODELS:
    assert [r["workers"] for r in model[name]] == [2, 4], name
  table = bench.markdown(summary)
  assert "| DynamiQ 5b | dropcompute | 4 | 13 | 2.25 s | 18.8% |" in table
  assert ("within 0.5% of its synchronous run's, at equal steps (4 each; DropCompute "
          "finishes fewer micro-batches): BF16 psum + DropCompute +6.67%: not met; "
          "DynamiQ 5b + DropCompute +6.67%: not met.") in table
  close = dict(report, config=dict(cfg, equal_samples=True), train={"runs": dict(
      runs, **{"DynamiQ 5b|dropcompute": _run([2.0] * 4, [4] * 4, [full] * 4, [None] * 4, [
          (0, 3.0, 0, 0.0), (2, 2.0, 8, 4.0), (4, 1.504, 16, 8.0)])})})
  line = bench.markdown(bench.summarize(close, argparse.Namespace(target_at=0.5, smooth=1)))
  assert "at equal samples" in line and "DynamiQ 5b + DropCompute +0.27%: met." in line
  # --from-json: the same summary from the file, with its own target settings
  path = tmp_path / "dropcompute.json"
  path.write_text(json.dumps(dict(report, summary=summary)))
  again = bench.main(["--from-json", str(path)])
  assert again["summary"] == json.loads(json.dumps(summary))
  assert (tmp_path / "dropcompute.png").stat().st_size > 1000
  assert (tmp_path / "dropcompute.md").read_text().endswith(table + "\n")
  path.write_text(json.dumps({"benchmark": "tta"}))
  with pytest.raises(SystemExit, match="not a results file"):
    bench.main(["--from-json", str(path)])


def test_dropcompute_bench_smallest_run(tmp_path):
  """The benchmark as CI runs it every time, so that it cannot rot: real worker processes
  (2), one all-reduce, synchronous and DropCompute steps, the table and the files.
  test_dropcompute_bench_tiny (.ci/run-slow) runs every phase and both codecs."""
  import json

  from dynamiq_jax.bench import dropcompute as bench
  report = bench.main(["--tiny", "--phases", "train", "--codecs", "BF16 psum",
                       "--scaling-codec", "BF16 psum", "--out", str(tmp_path)])
  cfg = report["config"]
  runs = report["train"]["runs"]
  assert set(runs) == {"BF16 psum|sync", "BF16 psum|dropcompute"}
  for key, run in runs.items():
    assert run["ranks_agree"], key
    assert len(run["step_s"]) == cfg["steps"], key
    assert run["evals"][-1]["micro_batches"] == sum(run["finished"]), key
    assert run["evals"][-1]["eval_loss"] < run["evals"][0]["eval_loss"], key  # it learnt
  assert "| BF16 psum | dropcompute |" in bench.markdown(report["summary"])
  with open(os.path.join(tmp_path, "dropcompute_tiny.json")) as f:
    assert json.load(f)["summary"] == json.loads(json.dumps(report["summary"]))


@pytest.mark.slow  # .ci/run-slow (a minute or more); test_bench_summary_on_stored_runs and
# test_a_slow_process_ends_its_step_within_the_budget check its two sides faster
def test_dropcompute_bench_tiny(tmp_path):
  """Every phase at a tiny size over real processes (shaped links when root): both codecs,
  synchronous and DropCompute, the table, the model and the plot."""
  import json

  from dynamiq_jax.bench import dropcompute as bench
  report = bench.main(["--tiny", "--out", str(tmp_path)])
  cfg = report["config"]
  planned = cfg["workers"] * cfg["micro_batches"]
  for phase in ("train", "quiet"):
    assert set(report[phase]["runs"]) == {"BF16 psum|sync", "BF16 psum|dropcompute",
                                          "DynamiQ 5b|sync", "DynamiQ 5b|dropcompute"}
    for key, run in report[phase]["runs"].items():
      assert run["ranks_agree"], key  # the same counts, thresholds and parameters everywhere
      if key.endswith("sync"):
        assert run["finished"] == [planned] * len(run["finished"])
        assert all(t is None for t in run["threshold_s"])
      else:  # full steps first; afterwards a threshold, and drops only under one
        warm = cfg["policy"]["warmup_steps"]
        assert run["finished"][:warm] == [planned] * warm
        assert all(t is None for t in run["threshold_s"][:warm])
        for f, t in zip(run["finished"], run["threshold_s"]):
          assert f == planned or t is not None
  for key, run in report["train"]["runs"].items():  # the same steps; DropCompute's fewer samples
    assert len(run["step_s"]) == cfg["steps"], key
    assert run["evals"][-1]["micro_batches"] == sum(run["finished"]), key
  rows = report["summary"]["train"]["rows"]
  first = report["train"]["runs"]["BF16 psum|sync"]["evals"][0]["eval_loss"]
  assert all(r["final_eval_loss"] < first - 0.2 for r in rows.values())  # they all learnt
  model = report["summary"]["scaling"]["model"]
  for name in bench.MODELS:  # with the slow worker and without (the paper's iid workers)
    assert [r["workers"] for r in model[name]] == cfg["model_workers"], name
    assert all(r["speedup"] > 0 for r in model[name]), name
  table = bench.markdown(report["summary"])
  assert table.count("\n| DynamiQ 5b | dropcompute |") == 2
  assert table.count("\n| 16 | ") == 1  # the modelled table, beyond the measured counts
  path = os.path.join(tmp_path, "dropcompute_tiny.json")
  with open(path) as f:
    assert json.load(f)["summary"] == json.loads(json.dumps(report["summary"]))
  assert os.path.getsize(os.path.join(tmp_path, "dropcompute_tiny.png")) > 1000
  # --from-json: the same summary again from the stored runs alone, nothing measured
  os.remove(os.path.join(tmp_path, "dropcompute_tiny.png"))
  again = bench.main(["--from-json", path])
  assert again["summary"] == json.loads(json.dumps(report["summary"]))
  assert again["summarized"]["command"] and again["command"] == report["command"]
  assert os.path.getsize(os.path.join(tmp_path, "dropcompute_tiny.png")) > 1000


# ---------------------------------------------------------------------------
# the docs


def _doc_blocks():
  import pathlib
  import re
  text = (pathlib.Path(HERE).parent / "docs" / "dropcompute.md").read_text()
  return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_docs_have_their_examples():
  blocks = _doc_blocks()
  assert len(blocks) == 3 and "RANK" in blocks[0]  # the per-process sketch is not run here


@pytest.mark.parametrize("code", _doc_blocks()[1:], ids=["choose_threshold", "simulated_step"])
def test_doc_block_runs(code, tmp_path):
  """Each runnable block of docs/dropcompute.md as pasted, in a fresh interpreter."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
      [os.path.dirname(HERE)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
  out = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
  assert "threshold" in out.stdout or "micro-batches finished" in out.stdout, out.stdout
