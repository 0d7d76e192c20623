"""Orbax save/restore of the train state continues a run bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq

K, M = 3, 2  # steps before the checkpoint, steps after it


def _loss(params, batch):
  x, y = batch
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def _batch(mesh, step):
  """The step-th global batch: a pure function of the step, like a resumable data loader."""
  k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
  split = NamedSharding(mesh, P("data"))
  return (jax.device_put(jax.random.normal(k1, (32, 16)), split),
          jax.device_put(jax.random.normal(k2, (32, 4)), split))


def _step(mesh, kind="ef14"):
  """The optimizer and the jitted step (built once: a new process would compile the same)."""
  if kind == "ef14":
    # MXFP4 with error feedback: the optimizer state holds the step counter, the
    # rounding key, the codec's adaptive scale state and per-rank residuals.
    reduce = dq.compressed_psum("data", codec=dq.codecs.mxfp4(), error_feedback=True, seed=7)
  else:  # ARC-Top-K with EF21-M: per-rank momentum and sent parts, the running mean
    reduce = dq.compressed_psum("data", codec=dq.codecs.ARCTopK(ratio=0.25, row=16), seed=7,
                                error_feedback="ef21m")
  tx = optax.chain(reduce, optax.adamw(1e-2))
  return tx, dq.data_parallel_step(_loss, tx, mesh=mesh)


def _fresh(mesh, tx):
  """The initial train state, as a new process builds it before it trains or restores."""
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (16, 64)) * 0.3,
            "w2": jax.random.normal(k2, (64, 4)) * 0.3}
  params = jax.device_put(params, NamedSharding(mesh, P()))
  return {"params": params, "opt_state": dq.data_parallel_init(tx, params, mesh=mesh)}


def _train(mesh, step, state, start, stop):
  params, opt_state = state["params"], state["opt_state"]
  for i in range(start, stop):
    params, opt_state, _ = step(params, opt_state, _batch(mesh, i))
  return {"params": params, "opt_state": opt_state}


@pytest.mark.parametrize("kind", ["ef14", "ef21m"])
def test_restored_run_equals_uninterrupted_run(mesh, tmp_path, kind):
  tx, step = _step(mesh, kind)
  uninterrupted = _train(mesh, step, _fresh(mesh, tx), 0, K + M)

  state = _train(mesh, step, _fresh(mesh, tx), 0, K)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()

  like = _fresh(mesh, tx)  # what a new process has: the initial state's structure and shardings
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  ours = restored["opt_state"][0]
  residual = ours.residual.tree["w1" if kind == "ef14" else "sent"]
  residual = residual if kind == "ef14" else residual["w1"]
  assert residual.sharding.spec == P("data") and np.any(np.asarray(residual) != 0)
  if kind == "ef14":
    assert ours.codec_state is not None
  else:
    assert ours.mean["w1"].sharding.spec == P() and np.any(np.asarray(ours.mean["w1"]) != 0)
  at_checkpoint = np.asarray(restored["params"]["w1"])
  resumed = _train(mesh, step, restored, K, K + M)  # donates the restored buffers

  leaves = jax.tree_util.tree_leaves_with_path(uninterrupted)
  for (path, want), got in zip(leaves, jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))
  assert not np.array_equal(np.asarray(resumed["params"]["w1"]), at_checkpoint)  # M steps ran
