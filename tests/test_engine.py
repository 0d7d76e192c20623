"""The bucket engine: written once, small per-bucket programs, the statistics' two-step sum."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.engine import buckets
from dynamiq_jax.codecs import F32, DynamiQ
from dynamiq_jax.schedules import axis_context
from dynamiq_jax.schedules.executor import HopOps, two_step

from _helpers import rows_identical


@pytest.mark.parametrize("full", [3, 7])
def test_buckets_of_one_shape_share_one_lowered_program(full):
  """Buckets of one shape (the last padded to it) lower the bucket program to two
  functions (the last's chained value, which nobody reads, is pruned), however many
  buckets: the cost of tracing and lowering follows the shapes, not the buckets."""
  n, size = 4, (8 + full) * 1024 - 256  # 8 + full buckets of 1024
  tree = {"w": jax.ShapeDtypeStruct((n, size), jnp.float32)}
  layout = dq.bucket_layout(jax.ShapeDtypeStruct((size,), jnp.float32), codec=DynamiQ(),
                            bucket_size=1024)
  assert buckets.bucket_sizes(layout) == [1024] * (8 + full)
  assert layout[-1][-1] == (buckets.PADDING, 0, 256)
  f = jax.jit(jax.vmap(lambda t, k: dq.allreduce(t, axis_name="i", codec=DynamiQ(), key=k,
                                                 bucket_size=1024)[0],
                       axis_name="i", in_axes=(0, None)))
  text = f.lower(tree, jax.random.key_data(jax.random.key(0))).as_text()
  assert len(re.findall(r"func\.func private @_run_program", text)) == 2
  assert len(re.findall(r"call @_run_program", text)) == 8 + full


def _sum_ops():
  """float32 partial sums: decode is the identity, so the two-step sum is exact-order."""
  enc = lambda chunk, c, hop: chunk  # noqa: E731
  return HopOps(enc, lambda p: p, lambda p, x, c, hop: p + x, lambda p, x: p + x)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_two_step_sums_in_rank_order_on_every_rank(n):
  rng = np.random.default_rng(n)
  chunks = rng.standard_normal((n, n, 3, 7)).astype(np.float32)  # [rank, chunk, ...]

  def one(x):
    return two_step(axis_context("i"), x, _sum_ops())

  out = np.asarray(jax.vmap(one, axis_name="i")(chunks))
  assert rows_identical(out)
  want = chunks[0].copy()
  for r in range(1, n):  # the owner adds rank 0's, then 1's, ...: float32, in that order
    want = want + chunks[r]
  np.testing.assert_array_equal(out[0], want)


def test_statistics_pass_is_one_all_to_all_and_one_all_gather(mesh):
  """DynamiQ's metadata pass is two collectives, not a ring of hops: per bucket one
  all-to-all, and two all-gathers (the statistics' and the payload's)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  def one(x):
    return dq.allreduce(x[0], axis_name="data", codec=DynamiQ(),
                        key=jax.random.key(0))[0][None]

  f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=False))
  x = jax.device_put(jnp.zeros((8, 1 << 16)), NamedSharding(mesh, P("data")))
  text = f.lower(x).as_text()
  assert text.count("stablehlo.all_to_all") == 1
  assert text.count("stablehlo.all_gather") == 2


def test_decode_sum_adds_in_rank_order_by_default():
  """The contract's default :meth:`Codec.decode_sum` (F32 keeps it): rank 0's payload,
  plus rank 1's, ...: float32 in that order."""
  n = 4
  rng = np.random.default_rng(0)
  payloads = jnp.asarray(rng.standard_normal((n, 5)).astype(np.float32))
  got = F32().decode_sum(payloads, None)
  want = np.asarray(payloads[0])
  for r in range(1, n):
    want = want + np.asarray(payloads[r])
  np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("schedule,mesh_shape", [("ring", None), ("hierarchical", (2, 4))])
def test_results_wait_in_the_codecs_result_dtype(schedule, mesh_shape):
  """A lossy codec's reduced gradient is rounded to bfloat16 (Codec.result_dtype: what
  waits for the optimizer is 2 bytes per coordinate, as pmean's bf16 sums); the float32
  ring's keeps float32. Both come back in the leaves' dtype."""
  g = np.random.default_rng(0).standard_normal((8, 3, 1000)).astype(np.float32)
  for codec, rounded in ((DynamiQ(bits=5), True), (F32(), False)):
    assert (jnp.dtype(codec.result_dtype) == jnp.bfloat16) == rounded
    out = np.asarray(dq.simulate(g, codec=codec, schedule=schedule, mesh_shape=mesh_shape,
                                 average=False))
    assert out.dtype == np.float32 and out.shape == g.shape
    as_bf16 = np.asarray(jnp.asarray(out).astype(jnp.bfloat16).astype(jnp.float32))
    assert np.array_equal(as_bf16, out) == rounded, codec
    np.testing.assert_allclose(out, np.broadcast_to(g.sum(0), g.shape), rtol=0.5, atol=1.0)
