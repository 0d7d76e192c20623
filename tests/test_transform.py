"""compressed_psum as an optax transform: hygiene, training, shard_map/pmap."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ, F32

N = 8


def _params(key=0):
  k1, k2 = jax.random.split(jax.random.key(key))
  return {"w": jax.random.normal(k1, (64, 512)) * 0.05, "b": jnp.zeros((512,)),
          "v": jax.random.normal(k2, (512, 10)) * 0.05}


def _loss(p, batch):
  x, y = batch
  logits = jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(mesh, seed=0, size=256):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(k1, (size, 64))
  y = (jnp.sum(x[:, :8], 1) > 0).astype(jnp.int32) + 2 * (x[:, 9] > 0)
  return jax.device_put((x, y), NamedSharding(mesh, P("data")))


def _replicate(tree, mesh):
  return jax.device_put(jax.tree.map(jnp.array, tree), NamedSharding(mesh, P()))


class TestHygiene:

  def test_init_accepts_shape_dtype_structs(self):
    tx = dq.compressed_psum()
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), _params())
    state = tx.init(shapes)
    assert isinstance(state, dq.CompressedPsumState)
    assert state.step.dtype == jnp.int32 and state.key.dtype == jnp.uint32
    assert jax.tree.structure(jax.eval_shape(tx.init, shapes)) == jax.tree.structure(state)

  def test_state_types_stable_across_init_update_and_jit(self, mesh):
    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))
    params = _replicate(_params(), mesh)
    with jax.set_mesh(mesh):
      state0 = _replicate(tx.init(params), mesh)
      types0 = jax.tree.map(jax.typeof, state0)
      assert jax.tree.map(jax.typeof, jax.jit(tx.init)(params)) == types0
    step = dq.data_parallel_step(_loss, tx, mesh=mesh, donate=False)
    _, state1, _ = step(params, state0, _batch(mesh))
    assert jax.tree.map(jax.typeof, state1) == types0
    _, state2, _ = step(params, state1, _batch(mesh))
    assert jax.tree.map(jax.typeof, state2) == types0

  def test_no_recompilation_on_later_steps(self, mesh):
    tx = optax.chain(dq.compressed_psum("data"), optax.adam(1e-3))
    step = dq.data_parallel_step(_loss, tx, mesh=mesh)
    params = _replicate(_params(), mesh)
    state = _replicate(tx.init(params), mesh)
    for i in range(3):
      params, state, _ = step(params, state, _batch(mesh, seed=i))
    assert step.jitted._cache_size() == 1
    assert int(state[0].step) == 3


class TestTraining:

  @pytest.mark.parametrize("reduce", ["dynamiq", "baseline"])
  def test_loss_falls_and_replicas_stay_identical(self, mesh, reduce):
    first = dq.compressed_psum("data") if reduce == "dynamiq" else dq.baseline_psum("data")
    tx = optax.chain(first, optax.adam(3e-3))
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
    """Step t of the transform == simulate with fold_in(key(seed), t)."""
    seed = 5
    grads = np.random.default_rng(0).standard_normal((N, 40_000)).astype(np.float32)
    tx = dq.compressed_psum("data", seed=seed)

    def body(g, state):
      out, state = tx.update(g[0], state)
      out, state = tx.update(out, state)  # second step: t = 1
      return out[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()),
                              out_specs=P("data"), check_vma=False))
    state = tx.init(jnp.zeros(40_000))
    out = np.asarray(f(jax.device_put(grads, NamedSharding(mesh, P("data"))), state))
    base = jax.random.key(seed)
    s0 = dq.simulate(grads, codec=DynamiQ(), key=jax.random.fold_in(base, 0))
    s1 = dq.simulate(s0, codec=DynamiQ(), key=jax.random.fold_in(base, 1))
    np.testing.assert_array_equal(out, np.asarray(s1))

  def test_pmap(self):
    # The shape of test_compressed_step_equals_simulate: simulate's compiled code is reused.
    grads = np.random.default_rng(1).standard_normal((N, 40_000)).astype(np.float32)
    tx = dq.compressed_psum("i", seed=2)
    state = tx.init(jnp.zeros(40_000))

    def f(g, state):
      return tx.update(g, state)[0]

    out = jax.pmap(f, axis_name="i", in_axes=(0, None))(grads, state)
    sim = dq.simulate(grads, codec=DynamiQ(), key=jax.random.fold_in(jax.random.key(2), 0))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(sim))

  def test_nan_on_one_rank_skips_the_step_everywhere(self, mesh):
    tx = optax.chain(dq.compressed_psum("data"),
                     optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3))
    params = _replicate(_params(), mesh)
    state = _replicate(tx.init(params), mesh)

    def loss(p, batch):
      x, y = batch
      # rank 3 sees a NaN input; the others are clean
      x = jnp.where(jax.lax.axis_index("data") == 3, x.at[0, 0].set(jnp.nan), x)
      return _loss(p, (x, y))

    step = dq.data_parallel_step(loss, tx, mesh=mesh, donate=False)
    new_params, new_state, _ = step(params, state, _batch(mesh))
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
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
