"""Lossy links: the loss process, the unbiased estimate of what arrived, the lossy
parameter broadcast and its bounded drift (dynamiq_jax.schedules.loss, dynamiq_jax.training.lossy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.training import lossy
from dynamiq_jax.schedules.loss import loss_key

N = 4
F32_PACKET = 362  # coordinates of float32 in one 1450-byte packet


class ZeroFill(dq.PacketLoss):
  """The common shortcut, as the benchmark's baseline: lost packets count as zeros."""

  def combine(self, own, others, arrived, n, total):
    return jnp.where(arrived == n - 1, total, own + others)


def _reduce(g, key, loss, codec=None, schedule="two_step", scatter=False):
  codec = codec or dq.codecs.F32()
  if scatter:
    f = lambda x: dq.reduce_scatter(x, axis_name="i", codec=codec, key=key, schedule=schedule,
                                    packet_loss=loss)[0]
  else:
    f = lambda x: dq.allreduce(x, axis_name="i", codec=codec, key=key, schedule=schedule,
                               packet_loss=loss)[0]
  return jax.jit(jax.vmap(f, axis_name="i"))(g)  # one program (eagerly: op by op)


_CODECS = [dq.codecs.F32(), dq.codecs.DynamiQ(), dq.codecs.MX(scale="e8m0"), dq.codecs.IntGroup()]


# DynamiQ's and MX's reduce-scatters (three programs each to compile, DynamiQ's the
# costliest of all) run with .ci/run-slow: their reduce step, where packets are lost and
# estimated, is their all-reduce's, and the reduce-scatter's own path is checked with F32
# and IntGroup (whole groups of 128 to a packet).
@pytest.mark.parametrize("scatter,codec", [
    *((False, c) for c in _CODECS),
    *(pytest.param(True, c, marks=pytest.mark.slow)
      if isinstance(c, (dq.codecs.DynamiQ, dq.codecs.MX)) else (True, c) for c in _CODECS)],
    ids=[f"{op}-{type(c).__name__}" for op in ("allreduce", "reduce_scatter") for c in _CODECS])
def test_no_loss_is_the_lossless_reduction_bit_for_bit(codec, scatter):
  if scatter and not codec.supports_scatter:
    pytest.skip("cannot reduce-scatter")
  g = jax.random.normal(jax.random.key(1), (N, 3 * 4096 + 256))
  key = jax.random.key(3)
  exact = _reduce(g, key, None, codec, scatter=scatter)
  np.testing.assert_array_equal(_reduce(g, key, dq.PacketLoss(0.0), codec, scatter=scatter),
                                exact)
  lossy_out = _reduce(g, key, dq.PacketLoss(0.2), codec, scatter=scatter)
  assert not np.array_equal(lossy_out, exact)  # packets were lost and estimated
  assert np.all(np.isfinite(lossy_out))
  if not scatter:  # the gather step is reliable: every replica gets the same estimate
    np.testing.assert_array_equal(lossy_out[0], lossy_out[N - 1])


@pytest.mark.parametrize("burst", [None, 3.0], ids=["bernoulli", "burst3"])
def test_estimator_is_unbiased_over_2000_keys_and_zero_fill_is_not(burst):
  t = 2000
  vals = jax.random.normal(jax.random.key(1), (N, N)) + 1.0  # rank s, chunk c
  g = jnp.repeat(vals, 2 * F32_PACKET, axis=1)  # two packets per chunk
  exact = np.asarray(g.mean(0))[::F32_PACKET]
  keys = jax.random.split(jax.random.key(0), t)

  def z_scores(loss):
    """(z of the mean over every packet, z of each packet): the Monte Carlo mean's distance
    from the exact mean in units of its standard error, sigma / sqrt(T)."""
    run = jax.jit(jax.vmap(lambda k: _reduce(g, k, loss)[0][::F32_PACKET]))
    out = np.asarray(run(keys), np.float64)
    whole = out.mean(1)
    return ((whole.mean() - exact.mean()) / (whole.std() / np.sqrt(t)),
            (out.mean(0) - exact) / (out.std(0) / np.sqrt(t)))

  z, per_packet = z_scores(dq.PacketLoss(0.1, burst=burst))
  assert abs(z) < 3, z  # within 3 sigma / sqrt(T)
  assert np.all(np.abs(per_packet) < 4), per_packet  # each of 8: 3 sigma, Bonferroni-corrected
  z0, per_packet0 = z_scores(ZeroFill(0.1, burst=burst))
  assert z0 < -10 and np.all(per_packet0 < -10), (z0, per_packet0)  # biased low by about p


def test_burst_channel_keeps_the_rate_and_makes_bursts():
  u = jax.random.uniform(jax.random.key(0), (400, 500))
  for burst in (1.0, 4.0):
    lost = np.asarray(dq.PacketLoss(0.1, burst=burst).lost(u))
    assert abs(lost.mean() - 0.1) < 0.01
    starts = lost[:, 1:] & ~lost[:, :-1]
    mean_run = lost[:, 1:].sum() / max(starts.sum(), 1)
    assert abs(mean_run - burst) < 0.15 * burst, mean_run
  bern = np.asarray(dq.PacketLoss(0.1).lost(u))
  np.testing.assert_array_equal(bern, np.asarray(u) < 0.1)


def test_packets_hold_whole_blocks():
  loss = dq.PacketLoss(0.1)
  assert loss.coords_per_packet(32) == F32_PACKET
  assert loss.coords_per_packet(5.0, 256) == 2304  # DynamiQ: 2320 coordinates, 9 blocks
  assert loss.coords_per_packet(64.0, 256) == 256  # at least one block
  assert dq.PacketLoss(0.1, packet_bytes=9000).coords_per_packet(8.25, 32) == 8704


@pytest.mark.parametrize("kwargs, match", [
    (dict(p=1.0), "probability"), (dict(p=-0.1), "probability"), (dict(p=True), "probability"),
    (dict(p=0.1, packet_bytes=8), "packet_bytes"), (dict(p=0.1, burst=0.5), "burst"),
    (dict(p=0.6, burst=1.0), "p / \\(1 - p\\)"),
])
def test_bad_loss_settings_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dq.PacketLoss(**kwargs)


def test_loss_needs_two_step_and_a_value_codec():
  g = jnp.ones((N, 1024))
  with pytest.raises(ValueError, match="schedule='two_step'"):
    _reduce(g, jax.random.key(0), dq.PacketLoss(0.1), schedule="ring")
  with pytest.raises(TypeError, match="PacketLoss"):
    _reduce(g, jax.random.key(0), 0.1)
  with pytest.raises(ValueError, match="schedule='two_step'"):
    dq.compressed_psum("data", packet_loss=dq.PacketLoss(0.1))
  with pytest.raises(ValueError, match="add as values"):
    _reduce(g, jax.random.key(0), dq.PacketLoss(0.1), codec=dq.codecs.THC())


def _mesh():
  return jax.make_mesh((N,), ("data",))


def _quadratic(d):
  target = jax.random.normal(jax.random.key(7), (d,))

  def loss_fn(p, batch):  # nearly flat: the noise, not the curvature, moves the replicas
    return 0.5e-3 * jnp.sum((p["w"] - target) ** 2) + jnp.sum(p["w"] * batch[0][0]) + jnp.sum(
        p["b"] ** 2)

  return loss_fn


def _pairwise(w):
  w = np.asarray(w)
  return max(np.linalg.norm(w[i] - w[j]) for i in range(N) for j in range(N))


def test_lossy_broadcast_keeps_replica_drift_bounded_over_1000_steps():
  d, steps, lr = 4096, 1000, 0.05
  loss = dq.PacketLoss(0.1)
  mesh = _mesh()
  loss_fn = _quadratic(d)
  tx = optax.chain(dq.compressed_psum_scatter("data", schedule="two_step", packet_loss=loss),
                   optax.sgd(lr))
  step = dq.data_parallel_step(loss_fn, tx, mesh=mesh, per_rank=True, packet_loss=loss)
  reps, opt = dq.lossy_init(tx, {"w": jnp.zeros((d,)), "b": jnp.zeros((3,))}, mesh=mesh)
  noise = NamedSharding(mesh, P("data"))
  with_bc, reported = [], []
  for t in range(steps):
    batch = (jax.device_put(jax.random.normal(jax.random.key(t), (N, 1, d)), noise),)
    reps, opt, _ = step(reps, opt, batch)
    if t % 50 == 49:
      with_bc.append(_pairwise(reps["w"]))
      reported.append(float(step.stats["drift"]))
  assert all(pw <= 2 * r + 1e-6 for pw, r in zip(with_bc, reported))
  np.testing.assert_array_equal(np.asarray(reps["b"])[0], np.asarray(reps["b"])[N - 1])

  # Without the broadcast: each replica steps itself with its own estimate of the mean
  # gradient (its shard's unbiased estimate; other shards forwarded over the same lossy
  # links, a lost packet replaced by its local gradient). Differences random-walk.
  def apart(w, g, key):
    w, g = w[0], g[0]
    shard = dq.reduce_scatter(g, axis_name="data", codec=dq.codecs.F32(), key=key,
                              schedule="two_step", packet_loss=loss)[0]
    est, _ = lossy.lossy_broadcast([shard], [g], [0], loss,
                                   loss_key(jax.random.key_data(key)), "data")
    return (w - lr * est[0])[None]

  run = jax.shard_map(apart, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                      out_specs=P("data"))
  target = jax.random.normal(jax.random.key(7), (d,))

  @jax.jit
  def fifty(w, start):  # steps start, ..., start + 49 in one program (not op by op)
    def one(w, t):
      g = 1e-3 * (w - target) + jax.random.normal(jax.random.key(t), (N, d))
      return run(w, g, jax.random.key(t)), None
    return jax.lax.scan(one, w, start + jnp.arange(50))[0]

  w = jax.device_put(jnp.zeros((N, d)), noise)
  without = []
  for start in range(0, steps, 50):
    w = fifty(w, start)
    without.append(_pairwise(w))
  print("with broadcasts", np.round(with_bc, 3), "without", np.round(without, 3))
  # samples every 50 steps; halves: steps 50-500 and 550-1000
  early, late = np.mean(with_bc[:10]), np.mean(with_bc[10:])
  assert late < 1.25 * early, with_bc  # bounded: no growth
  # a random walk grows as sqrt(steps): the second half's mean about 1.9x the first's
  assert np.mean(without[10:]) > 1.5 * np.mean(without[:10]), without
  assert np.mean(without[10:]) > 10 * late


def test_lossy_step_errors():
  mesh = _mesh()
  tx = optax.chain(dq.compressed_psum_scatter("data", schedule="two_step"), optax.sgd(0.1))
  with pytest.raises(ValueError, match="per_rank=True"):
    dq.data_parallel_step(lambda p, b: 0.0, tx, mesh=mesh, packet_loss=dq.PacketLoss(0.1))
  with pytest.raises(TypeError, match="PacketLoss"):
    dq.data_parallel_step(lambda p, b: 0.0, tx, mesh=mesh, per_rank=True, packet_loss=0.1)
  step = dq.data_parallel_step(_quadratic(4096), optax.sgd(0.1), mesh=mesh, per_rank=True,
                               packet_loss=dq.PacketLoss(0.1))
  reps, opt = dq.lossy_init(optax.sgd(0.1), {"w": jnp.zeros((4096,)), "b": jnp.zeros((3,))},
                            mesh=mesh)
  batch = (jax.device_put(jnp.zeros((N, 1, 4096)), NamedSharding(mesh, P("data"))),)
  with pytest.raises(ValueError, match="compressed_psum_scatter"):
    step(reps, opt, batch)
