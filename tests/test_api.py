"""The public surface: errors outside a bound axis, package attributes."""

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
from dynamiq_jax.training.train import CPU_SYNC_EVERY
from dynamiq_jax.training.train import SyncedStep
from dynamiq_jax.training.train import resolve_sync_every

KEY = jax.random.key(0)


def _sharded_grads(mesh):
  """Gradients as a plain-``jax.jit`` user holds them: global arrays split over ``data``."""
  split = NamedSharding(mesh, P("data"))
  return {"w": jax.device_put(jnp.ones((8, 300)), split),
          "b": jax.device_put(jnp.ones((8,)), split)}


def _assert_library_error(excinfo):
  message = str(excinfo.value)
  assert "axis_name='data' is not bound" in message
  assert "plain jax.jit" in message.lower()
  assert "dynamiq_jax.data_parallel_step" in message
  assert "jax.shard_map" in message


class TestUnboundAxisUnderPlainJit:
  """Plain ``jax.jit`` over sharded arrays binds no axis: every reducer says how to fix it."""

  @pytest.mark.parametrize("name", dq.REDUCERS)
  def test_reducer_update(self, mesh, name):
    grads = _sharded_grads(mesh)
    tx = optax.chain(dq.reducer(name, "data"), optax.sgd(0.1))
    state = tx.init(grads)
    with pytest.raises(dq.UnboundAxisError) as excinfo:
      jax.jit(tx.update)(grads, state, grads)
    _assert_library_error(excinfo)

  @pytest.mark.parametrize("name", [n for n in dq.REDUCERS  # the codecs
                                    if not n.startswith("psum-") and n != "moshpit"])
  def test_allreduce(self, mesh, name):
    codec = dq.codec_from_name(name)
    state = dq.init_codec_state(_sharded_grads(mesh), codec=codec, n=8)
    fn = lambda g: dq.allreduce(g, axis_name="data", codec=codec, key=KEY,
                                codec_state=state)[0]
    with pytest.raises(dq.UnboundAxisError) as excinfo:
      jax.jit(fn)(_sharded_grads(mesh))
    _assert_library_error(excinfo)

  def test_error_feedback_update(self, mesh):
    grads = _sharded_grads(mesh)
    tx = dq.compressed_psum("data", codec=dq.codecs.mxfp4(), error_feedback=True)
    with pytest.raises(dq.UnboundAxisError) as excinfo:
      jax.jit(tx.update)(grads, tx.init(grads))
    _assert_library_error(excinfo)

  def test_is_a_value_error(self):
    # Code written against the earlier ValueError keeps catching it.
    assert issubclass(dq.UnboundAxisError, ValueError)
    assert not issubclass(dq.UnboundAxisError, NameError)

  def test_bound_axis_runs(self, mesh):
    """The fix the message names runs the same kind of transform."""
    tx = optax.chain(dq.compressed_psum("data", codec=dq.codecs.F32()), optax.sgd(1.0))
    params = jax.device_put({"w": jnp.zeros((300,))}, NamedSharding(mesh, P()))
    step = dq.data_parallel_step(lambda p, x: jnp.mean(x @ p["w"]), tx, mesh=mesh,
                                 donate=False)
    x = jax.device_put(jnp.ones((8, 300)), NamedSharding(mesh, P("data")))
    params, _, _ = step(params, jax.device_put(tx.init(params), NamedSharding(mesh, P())), x)
    # Every rank's gradient is ones(300); their mean, exactly, times the step size.
    np.testing.assert_array_equal(np.asarray(params["w"]), -np.ones(300, np.float32))


def test_submodules_are_attributes_loaded_on_first_use():
  """``dq.multiprocess`` and ``dq.nnx`` after ``import dynamiq_jax``; importing stays cheap.

  The plain import pulls in neither flax nor the multi-process module, and
  using ``dq.multiprocess`` starts no distributed runtime.
  """
  code = (
      "import sys\n"
      "import dynamiq_jax as dq, jax\n"
      "assert 'flax' not in sys.modules and 'dynamiq_jax.training.multiprocess' not in sys.modules\n"
      "assert callable(dq.multiprocess.initialize), dq.multiprocess\n"
      "assert callable(dq.multiprocess.global_batch)\n"
      "assert not jax.distributed.is_initialized()\n"
      "assert dq.nnx.DataParallel.__module__ == 'dynamiq_jax.training.nnx'\n"
      "assert {'multiprocess', 'nnx'} <= set(dir(dq))\n"
      "print(jax.process_count())\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == "1"


def test_unknown_attribute_is_an_attribute_error():
  with pytest.raises(AttributeError, match="no attribute 'nope'"):
    dq.nope  # noqa: B018


class TestSyncEvery:
  """Steps wait for their results every ``sync_every`` calls (the CPU deadlock guard)."""

  def test_waits_every_k_calls(self, monkeypatch):
    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda out: waited.append(out) or out)
    step = SyncedStep(lambda i: i, sync_every=3)
    assert [step(i) for i in range(7)] == list(range(7))
    assert waited == [2, 5] and step.calls == 7

  def test_zero_never_waits(self, monkeypatch):
    monkeypatch.setattr(jax, "block_until_ready", lambda out: pytest.fail("waited"))
    step = SyncedStep(lambda i: i, sync_every=0)
    assert [step(i) for i in range(3)] == [0, 1, 2]

  def test_default_waits_every_step_on_cpu(self, mesh):
    assert resolve_sync_every(None, mesh) == CPU_SYNC_EVERY == 1
    assert resolve_sync_every(4, mesh) == 4
    with pytest.raises(ValueError, match="sync_every=-1 must be >= 0"):
      dq.data_parallel_step(lambda p, b: 0.0, optax.sgd(0.1), mesh=mesh, sync_every=-1)


def test_data_parallel_step_lowers_abstract_arguments_as_the_step_runs(mesh):
  """``step.lower`` takes arrays or ShapeDtypeStructs with shardings (a memory or HLO check
  without data) and lowers the very function the step then runs."""
  tx = optax.chain(dq.compressed_psum_scatter("data", codec=dq.codecs.F32()), optax.adam(0.1))
  params = jax.device_put({"w": jnp.ones((64, 16))}, dq.zero_shardings(
      {"w": jnp.ones((64, 16))}, mesh=mesh, min_size=0))
  state = dq.data_parallel_init(tx, params, mesh=mesh)
  x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("data")))
  step = dq.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh=mesh, donate=False)
  abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          (params, state, x))
  lowered = step.lower(*abstract)
  assert lowered.as_text() == step.lower(params, state, x).as_text()
  assert lowered.compile().memory_analysis().argument_size_in_bytes > 0
  step(params, state, x)
  assert step.jitted._cache_size() == 1  # the function lower used, compiled once by the call
  assert len(step._built) == 1
