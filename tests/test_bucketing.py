"""Flattening arbitrary gradient pytrees into buckets and back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ, F32

from dynamiq_jax.bench.reference import vnmse

from _helpers import model_data, rows_identical

N = 8
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _dyadic(rng, shape, dtype):
  # small integers / 4: every sum of 8 is exact in every float dtype here
  return jnp.asarray(rng.integers(-8, 8, shape).astype(np.float32) / 4, dtype)


@settings(max_examples=12, deadline=None)
@given(shapes=st.lists(st.sampled_from([(), (1,), (3,), (255,), (256,), (257,), (7, 33),
                                        (2, 3, 5), (600,)]), min_size=1, max_size=12),
       dtypes=st.lists(st.sampled_from(range(3)), min_size=12, max_size=12),
       seed=st.integers(0, 100))
def test_any_tree_round_trips_with_shapes_and_dtypes(shapes, dtypes, seed):
  rng = np.random.default_rng(seed)
  tree = {f"leaf{i}": _dyadic(rng, (N,) + s, DTYPES[dtypes[i]]) for i, s in enumerate(shapes)}
  out = dq.simulate(tree, codec=F32(), average=False)
  for k, v in tree.items():
    assert out[k].shape == v.shape and out[k].dtype == v.dtype
    want = np.asarray(v, np.float32).sum(0)
    np.testing.assert_array_equal(np.asarray(out[k], np.float32)[0], want)


def test_many_small_leaves_and_none():
  rng = np.random.default_rng(0)
  tree = [{"w": _dyadic(rng, (N, 3), jnp.float32), "skip": None} for _ in range(500)]
  out = dq.simulate(tree, codec=F32(), average=False)
  assert len(out) == 500 and all(o["skip"] is None for o in out)
  np.testing.assert_array_equal(np.asarray(out[17]["w"])[0],
                                np.asarray(tree[17]["w"]).sum(0))


def test_empty_tree():
  assert dq.simulate({}, codec=DynamiQ()) == {}


def test_simulate_needs_a_common_worker_axis():
  with pytest.raises(ValueError, match="same leading worker axis"):
    dq.simulate({"a": np.ones((8, 3)), "b": np.ones((4, 3))}, codec=F32())


@pytest.mark.parametrize("bucket_size", [1000, 4096, 1 << 20])
def test_buckets_are_transparent_for_lossless_codecs(bucket_size):
  rng = np.random.default_rng(1)
  tree = {"a": _dyadic(rng, (N, 3000), jnp.float32), "b": _dyadic(rng, (N, 50, 41), jnp.float32)}
  out = dq.simulate(tree, codec=F32(), average=False, bucket_size=bucket_size)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out[k])[0], np.asarray(tree[k]).sum(0))


@pytest.mark.slow  # .ci/run-slow; TestBudget in test_dynamiq checks wire bits per bucket
def test_dynamiq_buckets_each_meet_the_budget():
  g = model_data("heavy", N, 1 << 18, 0)
  codec = DynamiQ(bits=5)
  stats = dq.wire_stats(g[0], codec=codec, n=N, bucket_size=100_096)
  assert stats.bits_per_coord <= 5.0
  out = dq.simulate(g, codec=codec, bucket_size=100_096)
  assert rows_identical(out)
  assert vnmse(np.asarray(out)[0], g) < 5e-3  # ~1.6e-3 for one bucket of 2^20


def test_buckets_must_hold_whole_supergroups():
  with pytest.raises(ValueError, match=r"bucket_size=100000 must be a positive multiple of 256.*99840"):
    dq.simulate(np.ones((N, 300_000), np.float32), codec=DynamiQ(), bucket_size=100_000)


def test_stats_report_bits_and_bytes():
  tree = {"w": jnp.zeros((N, 100_000))}

  def f(x):
    return dq.allreduce(x, axis_name="i", codec=DynamiQ(), key=jax.random.key(0))[1]

  stats = jax.jit(jax.vmap(f, axis_name="i"))(tree)
  exact = dq.wire_stats({"w": jnp.zeros(100_000)}, codec=DynamiQ(), n=N)
  assert float(stats.bits_per_coord[0]) == pytest.approx(exact.bits_per_coord)
  assert exact.bits_per_coord <= 5.0
  assert exact.bytes_per_rank == pytest.approx(exact.bits_per_coord * 100_000 / 8 * 2 * 7 / 8)
