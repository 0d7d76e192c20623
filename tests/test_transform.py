"""compressed_psum as an optax transform: hygiene, training, shard_map/pmap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ, F32, IntGroup

N = 8


@functools.cache
def _params():
  """Host (numpy) parameters: made by numpy, no JAX program compiled for them."""
  rng = np.random.default_rng(0)
  return {"w": (rng.standard_normal((64, 512)) * 0.05).astype(np.float32),
          "b": np.zeros((512,), np.float32),
          "v": (rng.standard_normal((512, 10)) * 0.05).astype(np.float32)}


def _loss(p, batch):
  x, y = batch
  logits = jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(mesh, seed=0, size=256, nan_rank=None):
  """A global batch split over "data" (made by numpy); ``nan_rank``: that rank's first
  row starts with a NaN (only that rank sees it)."""
  x = np.random.default_rng(seed + 1).standard_normal((size, 64)).astype(np.float32)
  y = (x[:, :8].sum(1) > 0).astype(np.int32) + 2 * (x[:, 9] > 0)
  if nan_rank is not None:
    x[nan_rank * (size // N), 0] = np.nan
  return jax.device_put((x, y), NamedSharding(mesh, P("data")))


def _replicate(tree, mesh):
  return jax.device_put(jax.tree.map(jnp.array, tree), NamedSharding(mesh, P()))


@functools.cache
def _dynamiq_training(mesh):
  """The DynamiQ data-parallel step the hygiene and training tests share, ``(tx, step)``:
  one compiled program for all of them (every call below has the same types). Adam behind
  ``apply_if_finite``, which changes nothing on a finite step."""
  tx = optax.chain(dq.compressed_psum("data"),
                   optax.apply_if_finite(optax.adam(3e-3), max_consecutive_errors=3))
  return tx, dq.data_parallel_step(_loss, tx, mesh=mesh)


class TestHygiene:

  def test_init_accepts_shape_dtype_structs(self):
    tx = dq.compressed_psum()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())
    state = tx.init(shapes)
    assert isinstance(state, dq.CompressedPsumState)
    assert state.step.dtype == jnp.int32 and state.key.dtype == jnp.uint32
    assert jax.tree.structure(jax.eval_shape(tx.init, shapes)) == jax.tree.structure(state)

  def test_state_types_stable_across_init_update_and_jit(self, mesh):
    tx, step = _dynamiq_training(mesh)
    params = _replicate(_params(), mesh)
    with jax.set_mesh(mesh):
      state0 = _replicate(tx.init(params), mesh)
      types0 = jax.tree.map(jax.typeof, state0)
      assert jax.tree.map(jax.typeof, jax.jit(tx.init)(params)) == types0
    params, state1, _ = step(params, state0, _batch(mesh))
    assert jax.tree.map(jax.typeof, state1) == types0
    _, state2, _ = step(params, state1, _batch(mesh))
    assert jax.tree.map(jax.typeof, state2) == types0

  def test_no_recompilation_on_later_steps(self, mesh):
    tx, step = _dynamiq_training(mesh)  # (donates: the default)
    params = _replicate(_params(), mesh)
    state = _replicate(tx.init(params), mesh)
    programs = []
    for i in range(3):
      params, state, _ = step(params, state, _batch(mesh, seed=i))
      programs.append(step.jitted._cache_size())
    assert programs == [1, 1, 1], programs  # (the module's other tests call it alike)
    assert int(state[0].step) == 3


class TestTraining:

  @pytest.mark.parametrize("reduce", ["dynamiq", "baseline"])
  def test_loss_falls_and_replicas_stay_identical(self, mesh, reduce):
    if reduce == "dynamiq":
      tx, step = _dynamiq_training(mesh)  # Adam(3e-3), as the baseline's
    else:
      tx = optax.chain(dq.baseline_psum("data"), optax.adam(3e-3))
      step = dq.data_parallel_step(_loss, tx, mesh=mesh)
    params = _replicate(_params(), mesh)
    state = _replicate(tx.init(params), mesh)
    losses = []
    for i in range(30):
      params, state, loss = step(params, state, _batch(mesh, seed=i % 4))
      losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses
    for leaf in jax.tree.leaves(params):
      shards = [np.asarray(s.data) for s in leaf.addressable_shards]
      assert len(shards) == N
      for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])

  def test_compressed_step_equals_simulate(self, mesh):
    """Step t of the transform == simulate with fold_in(key(seed), t). One update compiled
    once, run twice: the state of the first (t = 0) feeds the second (t = 1)."""
    seed = 5
    grads = np.random.default_rng(0).standard_normal((N, 40_000)).astype(np.float32)
    tx = dq.compressed_psum("data", seed=seed)

    def body(g, state):
      out, state = tx.update(g[0], state)
      return out[None], state

    data, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    # (out_shardings: the state comes back as it went in, so the second call hits the cache)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                              out_specs=(P("data"), P()), check_vma=False),
                out_shardings=(data, repl))
    state = jax.device_put(tx.init(jnp.zeros(40_000)), repl)
    out0, state = f(jax.device_put(grads, data), state)
    assert int(state.step) == 1
    out, _ = f(out0, state)  # second step: t = 1
    assert f._cache_size() == 1
    base = jax.random.key(seed)
    s0 = dq.simulate(grads, codec=DynamiQ(), key=jax.random.fold_in(base, 0))
    s1 = dq.simulate(s0, codec=DynamiQ(), key=jax.random.fold_in(base, 1))
    np.testing.assert_array_equal(np.asarray(out0), np.asarray(s0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(s1))

  def test_pmap(self):
    # A codec whose rounding takes the key (stochastic INT8), cheaper to compile than
    # DynamiQ's: the transform's step and key under pmap. DynamiQ under pmap is
    # test_collectives.py::TestDynamiQParity::test_pmap_equals_simulate; the transform with
    # DynamiQ is test_compressed_step_equals_simulate.
    codec = IntGroup(bits=8, rounding="stochastic")
    grads = np.random.default_rng(1).standard_normal((N, 40_000)).astype(np.float32)
    tx = dq.compressed_psum("i", codec=codec, seed=2)
    state = tx.init(jnp.zeros(40_000))

    def f(g, state):
      return tx.update(g, state)[0]

    out = jax.pmap(f, axis_name="i", in_axes=(0, None))(grads, state)
    sim = dq.simulate(grads, codec=codec, key=jax.random.fold_in(jax.random.key(2), 0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sim))
    other = dq.simulate(grads, codec=codec, key=jax.random.fold_in(jax.random.key(2), 1))
    assert not np.array_equal(np.asarray(other), np.asarray(sim))  # (the key matters)

  def test_nan_on_one_rank_skips_the_step_everywhere(self, mesh):
    tx, step = _dynamiq_training(mesh)  # compressed_psum, then apply_if_finite
    params = _replicate(_params(), mesh)
    state = _replicate(tx.init(params), mesh)
    before = jax.tree.map(np.asarray, params)  # (the step donates its inputs)
    # rank 3 sees a NaN input; the others are clean
    new_params, new_state, _ = step(params, state, _batch(mesh, nan_rank=3))
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(before)):
      for shard in a.addressable_shards:  # on every rank
        np.testing.assert_array_equal(np.asarray(shard.data), b)
    assert int(new_state[1].notfinite_count) == 1

  def test_baseline_psum_is_psum(self, mesh):
    g = np.random.default_rng(2).integers(-8, 8, (N, 1000)).astype(np.float32)
    tx = dq.baseline_psum("data", average=False)

    def body(x):
      return tx.update(x[0], tx.init(x[0]))[0][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              check_vma=False))
    out = np.asarray(f(jax.device_put(g, NamedSharding(mesh, P("data")))))
    np.testing.assert_array_equal(out[0], g.sum(0))


def test_sum_mode_matches_f32_psum(mesh):
  g = np.random.default_rng(3).integers(-64, 64, (N, 2000)).astype(np.float32)
  out = dq.simulate(g, codec=F32(), average=False)
  np.testing.assert_array_equal(np.asarray(out)[0], g.sum(0))
