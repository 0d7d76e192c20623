"""dq.data_parallel_step with model state (Linen batch_stats), dropout keys per rank and
step, the missing-reduction error, donation, and the packet_loss= option."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq

nn = pytest.importorskip("flax.linen")

N = 8  # ranks (tests/conftest.py sets 8 CPU devices)
MOMENTUM = 0.5


class Net(nn.Module):
  """Dense -> BatchNorm -> relu -> Dropout -> Dense."""
  axis_name: str | None = "data"
  rate: float = 0.5

  @nn.compact
  def __call__(self, x, *, train: bool):
    h = nn.Dense(16)(x)
    h = nn.BatchNorm(use_running_average=not train, momentum=MOMENTUM,
                     axis_name=self.axis_name if train else None)(h)
    h = nn.Dropout(self.rate, deterministic=not train)(nn.relu(h))
    return nn.Dense(1)(h)[:, 0]


def _replicated(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P()))


def _split(mesh, tree):
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


def _same_on_every_device(tree) -> bool:
  """Every device's copy of every leaf bit-identical."""
  for a in jax.tree.leaves(tree):
    copies = [np.asarray(s.data) for s in a.addressable_shards]
    if len(copies) != N or any(c.tobytes() != copies[0].tobytes() for c in copies):
      return False
  return True


def _setup(mesh, net, *, batch=8 * 4):
  x = jax.random.normal(jax.random.key(1), (batch, 6)) * 2.0 + 0.5
  y = jnp.sin(x[:, 0])
  variables = net.init(jax.random.key(0), x[:2], train=False)
  return variables, x, y


def _linen_loss(net):
  def loss_fn(params, batch_stats, batch, *, key):
    x, y = batch
    pred, mutated = net.apply({"params": params, "batch_stats": batch_stats}, x, train=True,
                              mutable=["batch_stats"], rngs={"dropout": key})
    loss = jnp.mean((pred - y) ** 2)
    return loss, (mutated["batch_stats"], {"pred_mean": jnp.mean(pred)})
  return loss_fn


def _tx():
  return optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.sgd(0.1))


def _global_stats(variables, x):
  """The running statistics one BatchNorm step on the whole batch, on one device, gives."""
  net = Net(axis_name=None, rate=0.0)
  _, mutated = net.apply(variables, x, train=True, mutable=["batch_stats"])
  return mutated["batch_stats"]


class TestModelState:

  def test_batch_norm_running_stats_are_the_global_batchs_on_every_rank(self, mesh):
    net = Net()
    variables, x, y = _setup(mesh, net)
    tx = _tx()
    step = dq.data_parallel_step(_linen_loss(net), tx, mesh=mesh, model_state=True,
                                 has_aux=True, donate=False)
    params = _replicated(mesh, variables["params"])
    stats = _replicated(mesh, variables["batch_stats"])
    opt = _replicated(mesh, tx.init(params))
    out = step(params, stats, opt, _split(mesh, (x, y)), key=jax.random.key(3))
    assert len(out) == 5
    new_params, new_stats, _, loss, aux = out
    want = _global_stats(variables, x)
    # not the first rank's statistics: the global batch's
    first = _global_stats(variables, x[: len(x) // N])
    assert not np.allclose(first["BatchNorm_0"]["var"], want["BatchNorm_0"]["var"])
    for name in ("mean", "var"):
      np.testing.assert_allclose(np.asarray(new_stats["BatchNorm_0"][name]),
                                 np.asarray(want["BatchNorm_0"][name]), rtol=1e-5, atol=1e-6)
    assert _same_on_every_device((new_params, new_stats, loss, aux))
    assert np.isfinite(float(loss)) and set(aux) == {"pred_mean"}
    # the step's outputs feed the next step (same shardings: no recompilation)
    step(new_params, new_stats, opt, _split(mesh, (x, y)), key=jax.random.key(4))
    assert step.jitted._cache_size() == 1  # noqa: SLF001

  def test_per_rank_statistics_are_refused(self, mesh):
    net = Net(axis_name=None)
    variables, x, y = _setup(mesh, net)
    tx = _tx()
    step = dq.data_parallel_step(_linen_loss(net), tx, mesh=mesh, model_state=True,
                                 has_aux=True, donate=False)
    params = _replicated(mesh, variables["params"])
    with pytest.raises(ValueError, match=r"differs between ranks.*axis_name='data'.*'mean'"):
      step(params, _replicated(mesh, variables["batch_stats"]),
           _replicated(mesh, tx.init(params)), _split(mesh, (x, y)), key=jax.random.key(3))

  def test_mean_averages_the_per_rank_statistics(self, mesh):
    net = Net(axis_name=None, rate=0.0)
    variables, x, y = _setup(mesh, net)
    tx = _tx()

    def loss_fn(params, batch_stats, batch):  # no key, no aux
      pred, mutated = net.apply({"params": params, "batch_stats": batch_stats}, batch[0],
                                train=True, mutable=["batch_stats"])
      return jnp.mean((pred - batch[1]) ** 2), mutated["batch_stats"]

    step = dq.data_parallel_step(loss_fn, tx, mesh=mesh, model_state="mean", donate=False)
    params = _replicated(mesh, variables["params"])
    out = step(params, _replicated(mesh, variables["batch_stats"]),
               _replicated(mesh, tx.init(params)), _split(mesh, (x, y)))
    assert len(out) == 4
    new_stats = out[1]
    per_rank = [_global_stats(variables, part) for part in np.split(np.asarray(x), N)]
    for name in ("mean", "var"):
      want = np.mean([s["BatchNorm_0"][name] for s in per_rank], axis=0)
      np.testing.assert_allclose(np.asarray(new_stats["BatchNorm_0"][name]), want,
                                 rtol=1e-5, atol=1e-6)
    # the running mean is the global batch's
    np.testing.assert_allclose(np.asarray(new_stats["BatchNorm_0"]["mean"]),
                               np.asarray(_global_stats(variables, x)["BatchNorm_0"]["mean"]),
                               rtol=1e-5, atol=1e-6)
    assert _same_on_every_device(out)

  def test_state_of_another_structure_is_refused(self, mesh):
    tx = _tx()
    step = dq.data_parallel_step(
        lambda p, s, b: (jnp.mean(b @ p["w"]), {"wrapped": s}), tx, mesh=mesh,
        model_state=True, donate=False)
    params = _replicated(mesh, {"w": jnp.ones((4,))})
    with pytest.raises(ValueError, match="structure"):
      step(params, _replicated(mesh, {"count": jnp.zeros(())}),
           _replicated(mesh, tx.init(params)), _split(mesh, jnp.ones((N, 4))))

  def test_bad_options(self, mesh):
    with pytest.raises(ValueError, match="model_state='yes' must be"):
      dq.data_parallel_step(lambda p, s, b: 0.0, _tx(), mesh=mesh, model_state="yes")
    with pytest.raises(ValueError, match="not supported with per_rank"):
      dq.data_parallel_step(lambda p, s, b: 0.0, _tx(), mesh=mesh, model_state=True,
                            per_rank=True)
    step = dq.data_parallel_step(lambda p, s, b: 0.0, _tx(), mesh=mesh, model_state=True)
    with pytest.raises(TypeError, match=r"takes \(params, model_state, opt_state, batch"):
      step({}, {}, jnp.ones((N,)))


class TestKeys:

  def _run(self, mesh, key):
    """One SGD(1) step of ``sum(w * uniform(key))``: ``w`` ends at minus the mean over
    ranks of each rank's uniform draw."""
    tx = _tx()
    step = dq.data_parallel_step(
        lambda p, b, *, key: jnp.sum(p["w"] * jax.random.uniform(key, (5,))) + 0 * jnp.sum(b),
        optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.sgd(1.0)),
        mesh=mesh, donate=False)
    params = _replicated(mesh, {"w": jnp.zeros((5,))})
    new, _, _ = step(params, _replicated(mesh, tx.init(params)), _split(mesh, jnp.ones((N,))),
                     key=key)
    return np.asarray(new["w"])

  def test_each_rank_and_step_draws_its_own(self, mesh):
    seed = jax.random.key(42)
    keys = [jax.random.fold_in(seed, t) for t in range(2)]
    got = [self._run(mesh, k) for k in keys]
    for k, w in zip(keys, got):
      want = -np.mean([np.asarray(jax.random.uniform(jax.random.fold_in(k, r), (5,)))
                       for r in range(N)], axis=0)
      np.testing.assert_allclose(w, want, rtol=1e-6)
      same_key = -np.asarray(jax.random.uniform(k, (5,)))  # every rank with the one key
      assert not np.allclose(w, same_key, atol=1e-3)
    assert not np.allclose(got[0], got[1], atol=1e-3)  # another step, other draws
    np.testing.assert_array_equal(self._run(mesh, keys[0]), got[0])  # reproducible

  def test_linen_dropout_is_reproducible_from_the_key(self, mesh):
    net = Net(rate=0.5)
    variables, x, y = _setup(mesh, net)
    tx = _tx()
    step = dq.data_parallel_step(_linen_loss(net), tx, mesh=mesh, model_state=True,
                                 has_aux=True, donate=False)
    params = _replicated(mesh, variables["params"])
    args = (params, _replicated(mesh, variables["batch_stats"]),
            _replicated(mesh, tx.init(params)), _split(mesh, (x, y)))
    a = step(*args, key=jax.random.key(7))
    b = step(*args, key=jax.random.key(7))
    c = step(*args, key=jax.random.key(8))
    assert float(a[3]) == float(b[3])
    jax.tree.map(np.testing.assert_array_equal, a[0], b[0])
    assert float(a[3]) != float(c[3])  # other masks, other loss


class TestMissingReduction:

  def _step(self, mesh, tx):
    params = _replicated(mesh, {"w": jnp.zeros((16,))})
    step = dq.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh=mesh,
                                 donate=False)
    return step(params, _replicated(mesh, tx.init(params)), _split(mesh, jnp.ones((N, 16))))

  def test_names_the_reduction_to_put_first(self, mesh):
    with pytest.raises(ValueError, match="no gradient reduction") as excinfo:
      self._step(mesh, optax.adamw(1e-3))
    message = str(excinfo.value)
    assert "optax.chain(dq.compressed_psum('data'), optax.adamw(1e-3))" in message
    assert "Moshpit" not in message and "per_rank" not in message

  def test_a_reduction_after_the_optimizer(self, mesh):
    with pytest.raises(ValueError, match=r"optimizer state .*mu.* put the reduction first"):
      self._step(mesh, optax.chain(optax.adam(1e-3), dq.compressed_psum("data")))

  def test_a_per_rank_reduction_still_names_per_rank(self, mesh):
    tx = optax.chain(dq.compressed_psum("data", schedule=dq.Moshpit(grid=(2, 4))),
                     optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"Moshpit.*per_rank=True"):
      self._step(mesh, tx)


class TestDonation:

  def _args(self, mesh, tx):
    params = _replicated(mesh, {"w": jnp.ones((16,))})
    return params, _replicated(mesh, tx.init(params)), _split(mesh, jnp.ones((N, 16)))

  def test_default_donates_the_inputs(self, mesh):
    tx = optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.adam(0.1))
    params, opt, batch = self._args(mesh, tx)
    dq.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh=mesh)(params, opt,
                                                                              batch)
    assert params["w"].is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
      np.asarray(params["w"])

  def test_donate_false_keeps_them(self, mesh):
    tx = optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.adam(0.1))
    params, opt, batch = self._args(mesh, tx)
    step = dq.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh=mesh,
                                 donate=False)
    first = step(params, opt, batch)
    assert not params["w"].is_deleted()
    assert not any(a.is_deleted() for a in jax.tree.leaves(opt))
    again = step(params, opt, batch)  # the same inputs, a second time
    np.testing.assert_array_equal(np.asarray(again[0]["w"]), np.asarray(first[0]["w"]))


def _lossy_tx(loss):
  # the transform's option is being renamed from loss= to packet_loss=: use its name here
  name = ("packet_loss" if "packet_loss" in inspect.signature(
      dq.compressed_psum_scatter).parameters else "loss")
  return optax.chain(dq.compressed_psum_scatter("data", schedule="two_step", **{name: loss}),
                     optax.sgd(0.1))


class TestPacketLoss:
  D = 2048  # sharded among the owners (at least dynamiq_jax.training.lossy.MIN_SIZE coordinates)

  def _run(self, mesh, **option):
    loss = next(iter(option.values()))
    tx = _lossy_tx(loss)
    step = dq.data_parallel_step(lambda p, b: jnp.sum(p["w"] * b[0]), tx, mesh=mesh,
                                 per_rank=True, donate=False, **option)
    reps, opt = dq.lossy_init(tx, {"w": jnp.zeros((self.D,))}, mesh=mesh)
    batch = _split(mesh, jax.random.normal(jax.random.key(0), (N, self.D)))
    out = step(reps, opt, batch)
    return step, out

  def test_packet_loss_returns_three_values_and_stats(self, mesh):
    step, out = self._run(mesh, packet_loss=dq.PacketLoss(0.3))
    assert len(out) == 3
    reps, _, value = out
    assert np.shape(value) == ()
    assert set(step.stats) == {"drift"}
    drift = float(step.stats["drift"])
    w = np.asarray(reps["w"])
    pairwise = max(np.linalg.norm(w[i] - w[j]) for i in range(N) for j in range(N))
    assert 0 < pairwise <= 2 * drift + 1e-6  # 30% loss leaves some replica stale

  def test_loss_is_the_deprecated_name(self, mesh):
    with pytest.warns(DeprecationWarning, match="packet_loss="):
      _, old = self._run(mesh, loss=dq.PacketLoss(0.3))
    _, new = self._run(mesh, packet_loss=dq.PacketLoss(0.3))
    assert len(old) == 3
    np.testing.assert_array_equal(np.asarray(old[0]["w"]), np.asarray(new[0]["w"]))

  def test_both_names_are_refused(self, mesh):
    with pytest.raises(TypeError, match="both packet_loss= and"):
      dq.data_parallel_step(lambda p, b: 0.0, _tx(), mesh=mesh, per_rank=True,
                            packet_loss=dq.PacketLoss(0.1), loss=dq.PacketLoss(0.1))

  def test_other_steps_have_no_stats(self, mesh):
    tx = _tx()
    params = _replicated(mesh, {"w": jnp.ones((16,))})
    step = dq.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh=mesh,
                                 donate=False)
    assert len(step(params, _replicated(mesh, tx.init(params)),
                    _split(mesh, jnp.ones((N, 16))))) == 3
    assert step.stats == {}
