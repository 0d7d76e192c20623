"""Every benchmark runs once at a tiny size, so that it cannot rot."""

import json
import os

from dynamiq_jax.bench import kernels, vnmse


def test_vnmse_tiny(tmp_path):
  results, scaling = vnmse.main(["--tiny", "--out", str(tmp_path), "--cache", ""])
  assert {r["table"] for r in results} == {"table3", "table4", "table6"}
  assert all(r["vnmse"] > 0 for r in results)
  assert {r["codec"] for r in results if r["table"] == "table3"} == {
      c[0] for c in vnmse.codec_table()}
  assert {r["dataset"] for r in results} == {"iid", "lm-word"}
  with open(os.path.join(tmp_path, "vnmse_tiny.json")) as f:
    saved = json.load(f)
  assert len(saved["results"]) == len(results) and saved["scaling"] == scaling
  for png in ("vnmse_budget_tiny.png", "vnmse_scaling_tiny.png"):
    assert os.path.getsize(os.path.join(tmp_path, png)) > 1000


def test_kernels_tiny(tmp_path):
  rows = kernels.main(["--tiny", "--bits", "4", "--out", str(tmp_path)])
  assert {r["op"] for r in rows} == set(kernels.OPS)
  assert all(r["seconds"] > 0 and r["gbs"] > 0 for r in rows)
  (name,) = [f for f in os.listdir(tmp_path) if f.startswith("kernels_")]
  with open(os.path.join(tmp_path, name)) as f:
    saved = json.load(f)
  assert saved["backend_lowering"]["triton"] == "lowers"
