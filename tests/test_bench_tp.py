"""bench.tp: the tensor-parallel LM, its method names and tables, and one tiny run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dynamiq_jax.bench import tp


def test_method_names():
  assert tp.parse_method("psum-bf16") == ("psum", "bfloat16", None)
  assert tp.parse_method("int4/ring") == ("tp", "int4", "ring")
  for bad in ("int4", "int3/ring", "int8/tree", "none/ring"):
    with pytest.raises(ValueError, match="<codec>/<schedule>"):
      tp.parse_method(bad)
  with pytest.raises(SystemExit, match="psum-f32"):
    tp.main(["--methods", "psum-bf16", "int8/two_step"])
  with pytest.raises(SystemExit, match="divide"):
    tp.main(["--tiny", "--workers", "3"])


def test_the_sharded_forward_is_the_one_device_forward():
  """The served model is the trained one: with an exact psum, the forward over 4 model
  ranks (heads and hidden units split) equals the one-device forward, and the cached
  prefill + decode equals the uncached forward."""
  cfg = dict(tp.TINY_MODEL)
  params = jax.tree.map(jnp.asarray, tp.init_params(cfg, 0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
  one, _ = tp.forward(params, tokens, cfg=cfg, reduce=lambda a: a)
  m = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
  specs = tp.param_specs(params)
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(m, s)), params, specs)
  sharded = jax.jit(jax.shard_map(
      lambda p, t: tp.forward(p, t, cfg=cfg, reduce=lambda a: jax.lax.psum(a, "model"))[0],
      mesh=m, in_specs=(specs, P()), out_specs=P()))(placed, tokens)
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(one), rtol=2e-5, atol=2e-5)
  hd = cfg["d_model"] // cfg["heads"]
  cache = [(jnp.zeros((2, 12, cfg["heads"], hd)),) * 2 for _ in range(cfg["layers"])]
  ident = lambda a: a
  first, cache = tp.forward(params, tokens[:, :8], cfg=cfg, reduce=ident, cache=cache)
  rest = []
  for i in range(8, 12):
    lg, cache = tp.forward(params, tokens[:, i:i + 1], cfg=cfg, reduce=ident, start=i,
                           cache=cache)
    rest.append(lg)
  cached = jnp.concatenate([first] + rest, axis=1)
  np.testing.assert_allclose(np.asarray(cached), np.asarray(one), rtol=2e-5, atol=2e-5)


def test_wire_bytes_per_method():
  d = 64 * 256
  assert tp.wire_bytes("psum-bf16", 64, 256, 4) == 2 * 3 / 4 * d * 2
  assert tp.wire_bytes("int8/two_step", 64, 256, 4) == pytest.approx(
      2 * 3 / 4 * d * 8.25 / 8)
  assert tp.wire_bytes("int4/ring", 64, 256, 4) == pytest.approx(2 * 3 / 4 * d * 4.25 / 8)


def test_tiny_run(tmp_path):
  payload = tp.main(["--tiny", "--out", str(tmp_path)])
  assert (tmp_path / "tp_tiny.json").exists()
  (run,) = payload["runs"]
  acc = run["accuracy"]
  assert acc["psum-f32"]["logits_rel_error"] == 0 and acc["psum-f32"]["greedy_agreement"] == 1
  assert 0 < acc["int8/two_step"]["logits_rel_error"] < acc["int4/ring"]["logits_rel_error"]
  rows = run["timing"][0]["rows"]
  assert set(rows) == set(payload["runs"][0]["accuracy"])
  assert all(r["prefill_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows.values())
  assert rows["psum-bf16"]["ttft_speedup_vs_bf16"] == 1
  widths = {(r["family"], r["reduce_bits"], r["gather_bits"]): r
            for r in payload["gather_widths"]["rows"]}
  for family in ("iid", "heavy"):  # a wider step never hurts; bits as the codec counts them
    assert widths[family, 4, 6]["rel_error"] < widths[family, 4, 4]["rel_error"]
    assert widths[family, 8, 8]["rel_error"] < widths[family, 6, 6]["rel_error"]
    assert widths[family, 4, 6]["wire_bits"] == pytest.approx(5.25, abs=0.01)
