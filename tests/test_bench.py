"""Every benchmark runs once at a tiny size, so that it cannot rot."""

import json
import os

from dynamiq_jax.bench import kernels, vnmse


def test_vnmse_tiny(tmp_path):
  results = vnmse.main(["--tiny", "--out", str(tmp_path)])
  assert results and all(r["vnmse"] > 0 for r in results)
  with open(os.path.join(tmp_path, "vnmse_dynamiq_tiny.json")) as f:
    saved = json.load(f)
  assert saved["results"] == results and saved["d"] == 1 << 14
  assert os.path.getsize(os.path.join(tmp_path, "vnmse_dynamiq_tiny.png")) > 1000


def test_kernels_tiny(tmp_path):
  rows = kernels.main(["--tiny", "--bits", "4", "--out", str(tmp_path)])
  assert {r["op"] for r in rows} == set(kernels.OPS)
  assert all(r["seconds"] > 0 and r["gbs"] > 0 for r in rows)
  (name,) = [f for f in os.listdir(tmp_path) if f.startswith("kernels_")]
  with open(os.path.join(tmp_path, name)) as f:
    saved = json.load(f)
  assert saved["backend_lowering"]["triton"] == "lowers"
