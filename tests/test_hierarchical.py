"""Two-level schedule: exact inside the fast axis, compressed across the slow one."""

from functools import partial

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.bench.reference import paper_model_gradients
from dynamiq_jax.bench.reference import vnmse
from dynamiq_jax.codecs import MX
from dynamiq_jax.codecs import DynamiQ
from dynamiq_jax.codecs import F32

D = 1 << 15

# The error tests simulate the schedule of the default parity test below (its simulate
# program compiled once for the three): over 2 hosts the slow axis's butterfly and ring are
# the same exchange, and both schedules give these gradients the same error.
HIER = "hierarchical-butterfly"


@pytest.fixture(scope="module")
def grads():
  return paper_model_gradients("iid", 8, D, 0).astype(np.float32)


def _shard_map_run(g, codec, schedule, check_vma):
  mesh = jax.make_mesh((2, 4), ("host", "local"))
  x = jax.device_put(g.reshape(2, 4, -1), NamedSharding(mesh, P("host", "local")))

  @jax.jit
  @partial(jax.shard_map, mesh=mesh, in_specs=P("host", "local"),
           out_specs=(P("host", "local"), P()), check_vma=check_vma)
  def run(x):
    out, stats = dq.allreduce(x[0, 0], axis_name=("host", "local"), codec=codec,
                              schedule=schedule, key=jax.random.key(5))
    return out[None, None], stats.bytes_per_rank
  out, sent = run(x)
  return np.asarray(out).reshape(8, -1), float(sent)


@pytest.mark.parametrize("schedule,check_vma", [
    pytest.param("hierarchical", True, marks=pytest.mark.slow),  # .ci/run-slow
    ("hierarchical-butterfly", False)])
def test_shard_map_equals_simulate_bitwise(grads, schedule, check_vma):
  codec = DynamiQ(bits=5.0)
  out, sent = _shard_map_run(grads, codec, schedule, check_vma)
  sim = np.asarray(dq.simulate(grads, codec=codec, schedule=schedule, mesh_shape=(2, 4),
                               key=jax.random.key(5)))
  assert np.array_equal(out.view(np.uint32), sim.view(np.uint32))
  assert (out == out[0]).all()
  # only the slow axis is compressed: each rank sends its quarter over 2 hosts
  assert sent == dq.wire_stats(np.zeros(D // 4, np.float32), codec=codec, n=2).bytes_per_rank


def test_lossless_codec_gives_the_mean(grads):
  out = np.asarray(dq.simulate(grads, codec=F32(), schedule="hierarchical", mesh_shape=(2, 4)))
  np.testing.assert_allclose(out[0], grads.astype(np.float64).mean(0), rtol=0, atol=1e-6)


def test_error_class_of_flat_schedules(grads):
  """Fewer compressed hops: no worse than the flat ring over all 8 ranks."""
  codec = DynamiQ(bits=5.0)
  flat = vnmse(np.asarray(dq.simulate(grads, codec=codec))[0], grads)
  hier = vnmse(np.asarray(dq.simulate(grads, codec=codec, schedule=HIER,
                                      mesh_shape=(2, 4)))[0], grads)
  assert hier < flat < 3 * hier


def test_bad_hierarchical_inputs(grads):
  with pytest.raises(ValueError, match="mesh_shape"):
    dq.simulate(grads, codec=F32(), schedule="hierarchical")
  with pytest.raises(ValueError, match=r"slow \* fast = 8"):
    dq.simulate(grads, codec=F32(), schedule="hierarchical", mesh_shape=(3, 4))
  with pytest.raises(ValueError, match="axis_name=\\(slow, fast\\)"):
    jax.vmap(lambda x: dq.allreduce(x, axis_name="i", codec=F32(), schedule="hierarchical",
                                    key=jax.random.key(0)), axis_name="i")(grads)
  with pytest.raises(ValueError, match="stateless codecs"):
    dq.simulate(grads, codec=MX(element="e2m1"), schedule="hierarchical", mesh_shape=(2, 4))


class _F32Blocks(F32):
  """Lossless, but with DynamiQ's granularity: shares interleave whole 256-blocks."""

  granularity = 256


@pytest.mark.parametrize("codec", [F32(), _F32Blocks()], ids=["unit1", "unit256"])
@pytest.mark.parametrize("mesh_shape", [(2, 4), (8, 1), (1, 8)])
def test_interleaved_shares_reassemble_exactly(grads, mesh_shape, codec):
  # a length that is no multiple of 256 * fast: shares are padded, then cut back
  g = grads[:, : D - 100]
  out = np.asarray(dq.simulate(g, codec=codec, schedule="hierarchical", mesh_shape=mesh_shape))
  np.testing.assert_allclose(out[0], g.astype(np.float64).mean(0), rtol=0, atol=1e-6)
  assert out.shape == g.shape and (out == out[0]).all()


def test_layered_gradients_keep_the_error_class(grads):
  """A model's layers lie contiguously: here the first 3/4 of the vector are exact zeros
  (like the embedding rows of absent tokens) and the rest dense. Contiguous fast-axis
  shares would give three ranks only zeros and one only the dense part; interleaved
  shares see the whole mix (the hierarchical schedule's exact inner sums then
  halve the error at least)."""
  g = grads.copy()
  g[:, : 3 * D // 4] = 0.0
  codec = DynamiQ(bits=5.0)
  flat = vnmse(np.asarray(dq.simulate(g, codec=codec))[0], g)
  hier = vnmse(np.asarray(dq.simulate(g, codec=codec, schedule=HIER,
                                      mesh_shape=(2, 4)))[0], g)
  assert hier < flat / 2
