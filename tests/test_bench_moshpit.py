"""bench.moshpit: one tiny run of the default rows, and its flags."""

import json

import pytest

from dynamiq_jax.bench import moshpit


def test_tiny_run(tmp_path):
  # the default rows but the unweighted replicas (a flag of the same code path), for CI's time
  chosen = [r for r in moshpit.DEFAULT_ROWS if r != "10% absent + replicas (unweighted)"]
  assert len(chosen) == len(moshpit.DEFAULT_ROWS) - 1
  report = moshpit.main(["--tiny", "--rows", ",".join(chosen), "--out", str(tmp_path)])
  with open(tmp_path / "moshpit_absent_tiny.json") as f:
    assert json.load(f)["summary"] == report["summary"]
  rows = {r["row"]: r for r in report["summary"]}
  assert list(rows) == chosen
  present = rows["everyone present"]
  assert present["vs_everyone_present"] == 0 and present["spread_end"] == 0
  assert present["absent_share"] == 0 and present["rounds_per_step"] == 2
  alone = rows["10% absent: gradients only"]
  pulled = rows["10% absent + replicas"]
  assert alone["absent_share"] > 0
  assert alone["spread_max_2nd_half"] > 3 * pulled["spread_max_2nd_half"]
  assert pulled["bytes_per_rank_step"]["replicas"] > 0 == alone["bytes_per_rank_step"]["replicas"]
  every4 = rows["10% absent + replicas every 4"]["bytes_per_rank_step"]["replicas"]
  assert every4 == pytest.approx(pulled["bytes_per_rank_step"]["replicas"] / 4)
  runs = report["runs"]
  assert runs[alone["row"]]["0"]["train_loss"] != runs[present["row"]]["0"]["train_loss"]
  # the control: every rank alike (no spread), the mean weighted unlike everyone present's
  control = rows["everyone present weighted as 10% absent"]
  assert control["spread_end"] == 0 and control["absent_share"] == 0
  assert runs[control["row"]]["0"]["train_loss"] != runs[present["row"]]["0"]["train_loss"]


def test_contribution_weights():
  import jax
  import numpy as np

  import dynamiq_jax as dq
  everyone = moshpit.contribution_weights(dq.Moshpit(grid=(2, 2)), 4, jax.random.key(0))
  np.testing.assert_allclose(everyone, np.full(4, 0.25), rtol=1e-6)
  mosh = dq.Moshpit(grid=(2, 2), dropout=0.3)
  keys = [jax.random.fold_in(jax.random.key(0), t) for t in range(8)]
  seen = [np.asarray(moshpit.contribution_weights(mosh, 4, k)) for k in keys]
  for c in seen:  # a weighted mean of the ranks' gradients
    assert np.all(c >= 0) and abs(c.sum() - 1) < 1e-5
  assert any(np.ptp(c) > 0.05 for c in seen)  # some step's absences weigh ranks unequally


def test_bad_flags():
  with pytest.raises(SystemExit, match="--rows"):
    moshpit.main(["--tiny", "--rows", "nobody"])
  with pytest.raises(SystemExit, match="--grid"):
    moshpit.main(["--tiny", "--grid", "2,3"])
  with pytest.raises(SystemExit):
    moshpit.main(["--tiny", "--optimizer", "lamb"])
