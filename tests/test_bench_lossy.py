"""bench.lossy: one tiny run of every estimator, and its flags."""

import json

import pytest

from dynamiq_jax.bench import lossy


def test_tiny_run(tmp_path):
  report = lossy.main(["--tiny", "--out", str(tmp_path)])
  with open(tmp_path / "lossy_tiny.json") as f:
    assert json.load(f)["summary"] == report["summary"]
  rows = {(r["setting"], r["estimator"]): r for r in report["summary"]}
  assert set(rows) == {("no loss", "unbiased"), ("10%", "unbiased"), ("10%", "zero-fill")}
  assert rows["no loss", "unbiased"]["perplexity_change"] == 0
  assert rows["no loss", "unbiased"]["max_relative_drift"] == 0  # nothing lost, nothing stale
  assert rows["10%", "unbiased"]["max_relative_drift"] > 0
  runs = report["runs"]
  assert runs["10% / unbiased"]["0"]["train_loss"] != runs["10% / zero-fill"]["0"]["train_loss"]
  assert runs["10% / unbiased"]["0"]["train_loss"] != runs["no loss / unbiased"]["0"]["train_loss"]
  again = lossy.main(["--tiny", "--summarize", str(tmp_path / "lossy_tiny.json")])
  assert again["summary"] == report["summary"]


def test_bad_flags():
  with pytest.raises(SystemExit, match="--settings"):
    lossy.main(["--tiny", "--settings", "50%"])
  with pytest.raises(SystemExit, match="--estimators"):
    lossy.main(["--tiny", "--estimators", "mean"])
