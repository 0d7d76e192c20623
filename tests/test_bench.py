"""Every benchmark runs once at a tiny size, so that it cannot rot."""

import json
import os

from dynamiq_jax.bench import vnmse


def test_vnmse_tiny(tmp_path):
  results = vnmse.main(["--tiny", "--out", str(tmp_path)])
  assert results and all(r["vnmse"] > 0 for r in results)
  with open(os.path.join(tmp_path, "vnmse_dynamiq_tiny.json")) as f:
    saved = json.load(f)
  assert saved["results"] == results and saved["d"] == 1 << 14
  assert os.path.getsize(os.path.join(tmp_path, "vnmse_dynamiq_tiny.png")) > 1000
