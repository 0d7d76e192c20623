"""dynamiq_jax.bench.buffers: what a compiled program's scratch holds, from XLA's buffer
assignment (the sharded-optimizer step's ratios are checked in test_bench.py's
test_sharded_tiny, which compiles those steps anyway)."""

import jax
import jax.numpy as jnp
import pytest

from dynamiq_jax.bench import buffers


def _mlp_grad_lowered():
  def loss(ws, x):
    for w in ws:
      x = jnp.tanh(x @ w)
    return jnp.sum(x * x)

  ws = [jnp.ones((128, 128), jnp.float32) * 0.01 for _ in range(3)]
  return jax.jit(jax.grad(loss)).lower(ws, jnp.ones((64, 128), jnp.float32))


def _by_pass(op_name, is_argument):
  if is_argument:
    return "argument"
  return "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "other"


def test_breakdown_adds_up_to_what_xla_reports():
  everything = ("forward", "backward", "other")
  out, compiled = buffers.breakdown(_mlp_grad_lowered(), _by_pass, {"all": everything})
  # the parser reads XLA's live ranges as XLA counts them: its own peak, recomputed
  assert out["xla_peak"] is not None and out["xla_peak_recounted"] == out["xla_peak"]
  assert out["unmatched_values"] == 0
  # the categories hold all of the scratch live at the peak, which fits in the allocation
  assert sum(out["at_peak"].values()) == out["temp_live_at_peak"] > 0
  assert out["own_max"]["all"] == out["temp_live_at_peak"]
  assert 0 <= out["packing"] == out["temp_bytes"] - out["temp_live_at_peak"]
  assert out["temp_bytes"] == compiled.memory_analysis().temp_size_in_bytes
  weights, batch = 3 * 128 * 128 * 4, 64 * 128 * 4
  assert out["arguments"] == {"argument": weights + batch} and out["argument_bytes"] == (
      weights + batch)
  assert out["own_max"]["backward"] > 0  # the gradient's matmuls run in the backward pass


def test_breakdown_names_the_dump_it_could_not_find(tmp_path):
  with pytest.raises(RuntimeError, match="expected one XLA dump file"):
    buffers.read_dump(str(tmp_path))
