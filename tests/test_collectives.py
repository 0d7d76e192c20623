"""allreduce under shard_map / pmap / vmap on 8 simulated CPU devices."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.codecs import Bf16, DynamiQ, F32

from _helpers import per_rank, rows_identical

N = 8
KEY = jax.random.key(0)


def _reduce(codec, average=True, schedule="ring", key=KEY):
  def fn(tree):
    return dq.allreduce(tree, axis_name="data", codec=codec, schedule=schedule,
                        key=key, average=average)[0]
  return fn


def _psum(dtype, average):
  def fn(tree):
    def one(x):
      s = jax.lax.psum(x.astype(dtype), "data").astype(jnp.float32)
      return (s / N if average else s).astype(x.dtype)
    return jax.tree.map(one, tree)
  return fn


def _mixed_tree(rng, scale=1.0):
  """Mixed dtypes and shapes, sizes not multiples of 256, a scalar."""
  return {
      "dense": {"kernel": (rng.standard_normal((N, 300, 257)) * scale).astype(np.float32),
                "bias": (rng.standard_normal((N, 257)) * scale).astype(np.float32)},
      "emb": jnp.asarray(rng.standard_normal((N, 1000, 33)) * scale, jnp.bfloat16),
      "norm": jnp.asarray(rng.standard_normal((N, 77)) * scale, jnp.float16),
      "temp": (rng.standard_normal((N,)) * scale).astype(np.float32),
  }


class TestLossless:

  @pytest.mark.parametrize("average", [True, False])
  def test_f32_ring_equals_psum_exactly(self, mesh, average):
    # Dyadic values: every partial sum is exact, so any summation order agrees.
    g = np.random.default_rng(0).integers(-1000, 1000, (N, 5000)).astype(np.float32) / 1024
    tree = {"a": g, "b": g[:, :7].copy()}
    out = per_rank(mesh, _reduce(F32(), average), tree)
    ref = per_rank(mesh, _psum(jnp.float32, average), tree)
    assert rows_identical(out)
    for k in tree:
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))

  @pytest.mark.parametrize("average", [True, False])
  def test_bf16_ring_equals_psum_exactly(self, mesh, average):
    # Small integers: all partial sums of 8 are exact in bfloat16.
    g = np.random.default_rng(1).integers(-16, 16, (N, 3000)).astype(np.float32)
    out = per_rank(mesh, _reduce(Bf16(), average), g)
    ref = per_rank(mesh, _psum(jnp.bfloat16, average), g)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

  def test_f32_ring_matches_psum_on_random_data(self, mesh):
    g = np.random.default_rng(2).standard_normal((N, 4096)).astype(np.float32)
    out = np.asarray(per_rank(mesh, _reduce(F32()), g))
    assert rows_identical(out)
    np.testing.assert_allclose(out[0], g.astype(np.float64).mean(0), rtol=1e-5, atol=1e-6)

  def test_bf16_ring_error_is_bf16_rounding(self, mesh):
    g = np.random.default_rng(3).standard_normal((N, 4096)).astype(np.float32)
    out = np.asarray(per_rank(mesh, _reduce(Bf16()), g))[0]
    ref = g.astype(np.float64).mean(0)
    # at most one bf16 rounding of the leaf value plus one per hop (n of them)
    assert np.max(np.abs(out - ref)) <= (N + 1) * 2**-8 * np.abs(g).max()


class TestDynamiQParity:

  # The first runs by default: independent rounding (each rank rounds with its own key), the
  # harder case for identical ranks. The others, each a compile of its own, run in
  # .ci/run-slow; the default DynamiQ's shard_map parity is checked in the default run by
  # test_transform.py::TestTraining::test_compressed_step_equals_simulate, and by
  # test_two_step.py and test_hierarchical.py on their schedules.
  CODECS = [DynamiQ(bits=4, correlated=False), DynamiQ(bits=5),
            DynamiQ(bits=6, widths=(2, 4, 8), scale_rounding="stochastic"),
            DynamiQ(centre=False)]

  @pytest.mark.parametrize("codec", [CODECS[0]] + [pytest.param(c, marks=pytest.mark.slow)
                                                   for c in CODECS[1:]])  # .ci/run-slow
  def test_ranks_identical_and_simulate_equals_shard_map(self, mesh, codec):
    tree = _mixed_tree(np.random.default_rng(4))
    out = per_rank(mesh, _reduce(codec), tree)
    assert rows_identical(out)
    sim = dq.simulate(tree, codec=codec, seed=0)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(sim)):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # shapes and dtypes are those of the input leaves
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
      assert a.shape == np.shape(b) and a.dtype == jnp.asarray(b).dtype

  def test_pmap_equals_simulate(self):
    # The codec and tree of the test above: simulate's compiled code is reused.
    tree = _mixed_tree(np.random.default_rng(4))
    codec = self.CODECS[0]
    out = jax.pmap(_reduce_axis(codec, "i"), axis_name="i")(tree)
    assert rows_identical(out)
    sim = dq.simulate(tree, codec=codec, seed=0)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(sim)):
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _reduce_axis(codec, axis):
  def fn(x):
    return dq.allreduce(x, axis_name=axis, codec=codec, key=KEY)[0]
  return fn


class TestErrors:

  def test_unbound_axis(self):
    with pytest.raises(ValueError, match="axis_name='data' is not bound"):
      dq.allreduce(jnp.ones(10), axis_name="data", codec=F32(), key=KEY)

  def test_wrong_axis_name_inside_shard_map(self, mesh):
    with pytest.raises(ValueError, match="axis_name='batch' is not bound"):
      per_rank(mesh, lambda t: dq.allreduce(t, axis_name="batch", codec=F32(), key=KEY)[0],
               np.ones((N, 10), np.float32))

  def test_already_reduced_gradients_are_caught(self, mesh):
    """The check_vma=True trap: grads of replicated params are already psum'ed."""
    w = jnp.ones((300, 300))
    x = jax.device_put(jnp.ones((N, 300)), NamedSharding(mesh, P("data")))

    def step(w, x):
      g = jax.grad(lambda w: jnp.sum(x @ w))(w)
      return dq.allreduce(g, axis_name="data", codec=DynamiQ(), key=KEY)[0]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                              check_vma=True))
    with pytest.raises(ValueError, match=r"not varying over axis_name='data'.*pcast"):
      f(w, x)

  def test_varying_gradients_pass_the_check(self, mesh):
    w = jnp.ones((300, 300))
    x = jax.device_put(jnp.ones((N, 300)), NamedSharding(mesh, P("data")))

    def step(w, x):
      g = jax.grad(lambda w: jnp.sum(x @ w))(dq.as_varying(w, "data"))
      return dq.allreduce(g, axis_name="data", codec=F32(), key=KEY)[0]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(),
                              check_vma=True))
    np.testing.assert_array_equal(np.asarray(f(w, x)), np.ones((300, 300)))

  def test_budget_that_cannot_be_met(self):
    # no bucket of any size meets 2.5 bits: an error that says how to fix it
    with pytest.raises(ValueError, match=r"bits=2.5.*over n=8.*raise bits"):
      dq.simulate(np.ones((N, 1000), np.float32), codec=DynamiQ(bits=2.5))
    with pytest.raises(ValueError, match=r"bits=5.*1000 coordinates over n=8.*raise bits"):
      DynamiQ(bits=5).layout(1000, N)
    # 5 bits fit large buckets: a small one is sent as bf16, and the stats say so
    g = np.random.default_rng(0).standard_normal((N, 1000)).astype(np.float32)

    def one(x):
      return dq.allreduce(x, axis_name="i", codec=DynamiQ(bits=5), key=jax.random.key(0))

    out, stats = jax.jit(jax.vmap(one, axis_name="i"))(g)  # (eagerly: ~90 small compiles)
    assert int(stats.uncompressed[0]) == 1000 and float(stats.bits_per_coord[0]) == 16.0
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dq.simulate(g, codec=Bf16())))

  def test_integer_leaf_names_its_path(self):
    tree = {"params": {"w": np.ones((N, 4), np.float32)}, "step": np.ones((N,), np.int32)}
    with pytest.raises(TypeError, match=r"\['step'\] has dtype int32"):
      dq.simulate(tree, codec=F32())
    with pytest.raises(TypeError, match=r"\['flag'\] has dtype bool"):
      dq.simulate({"flag": np.ones((N, 3), bool)}, codec=F32())

  def test_bad_codec_arguments(self):
    with pytest.raises(ValueError, match=r"widths=\(1, 4\)"):
      DynamiQ(widths=(1, 4))
    with pytest.raises(ValueError, match=r"widths=\(\)"):
      DynamiQ(widths=())
    with pytest.raises(TypeError, match="widths='248'"):
      DynamiQ(widths="248")
    with pytest.raises(TypeError, match=r"widths=\(2.5, 4\)"):
      DynamiQ(widths=(2.5, 4))
    with pytest.raises(ValueError, match="scale_rounding='down'"):
      DynamiQ(scale_rounding="down")
    with pytest.raises(ValueError, match="eps="):
      DynamiQ(eps={4: 1.5})
    with pytest.raises(TypeError, match="eps="):
      DynamiQ(eps={4: "x"})
    with pytest.raises(TypeError, match="no allocation=.*drop the argument"):
      DynamiQ(allocation="static")
    with pytest.raises(TypeError, match="no fractions=, levels="):
      DynamiQ(levels="uniform", fractions={4: 1.0})
    with pytest.raises(ValueError, match="bits=-1"):
      DynamiQ(bits=-1)
    with pytest.raises(ValueError, match="schedule='tree'"):
      dq.simulate(np.ones((N, 4), np.float32), codec=F32(), schedule="tree")


@pytest.mark.slow  # .ci/run-slow; tools/compile_time.py measures n = 8 vs 64
def test_compile_cost_does_not_grow_with_n():
  """The ring runs as one loop body: n = 64 lowers to the same program size as n = 8."""
  codec = DynamiQ(bits=6)
  sizes = {}
  for n in (8, 64):
    g = jnp.zeros((n, 256 * 64 * 4), jnp.float32)
    t = time.perf_counter()
    lowered = jax.jit(lambda x: dq.simulate(x, codec=codec)).lower(g)
    hlo = lowered.as_text()
    lowered.compile()
    sizes[n] = (len(hlo), time.perf_counter() - t)
  assert sizes[64][0] < 1.3 * sizes[8][0], sizes
  assert sizes[64][1] < 60.0, sizes
