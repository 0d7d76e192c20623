"""bench.tta: the time-to-accuracy benchmark at a tiny size, and its arithmetic."""

import json
import os

import pytest

from dynamiq_jax.bench import harness
from dynamiq_jax.bench import tta


def _run(evals):
  return {"evals": [{"step": s, "eval_loss": v} for s, v in evals]}


def test_target_and_steps_to_target():
  bf16 = _run([(0, 9.0), (10, 6.0), (20, 5.0), (30, 4.0), (40, 3.0), (50, 2.9)])
  # 0.8 of 50 steps = step 40; smoothed over 2 evaluations: (4.0 + 3.0) / 2
  assert harness.target_of(bf16, 0.8, 2) == pytest.approx(3.5)
  assert harness.target_of(bf16, 0.8, 1) == pytest.approx(3.0)
  assert harness.steps_to_target(bf16, 3.5, 2) == 40
  slow = _run([(0, 9.0), (10, 8.0), (20, 6.0), (30, 5.0), (40, 4.0), (50, 3.4)])
  assert harness.steps_to_target(slow, 3.5, 1) == 50
  assert harness.steps_to_target(slow, 3.5, 2) is None  # (4.0 + 3.4) / 2 > 3.5
  assert harness.steps_to_target(_run([(0, 1.0), (10, 2.0)]), 1.5, 1) is None  # step 0 never counts


def test_bad_flags():
  with pytest.raises(SystemExit):
    tta.parse(["--codecs", "DynamiQ 5b"])  # no BF16 baseline
  with pytest.raises(SystemExit):
    tta.parse(["--codecs", "BF16 psum,zip"])
  with pytest.raises(SystemExit):
    tta.parse(["--phases", "simulate,fly"])
  with pytest.raises(SystemExit):
    tta.parse(["--real-seed", "7"])
  for bad in (["--workers", "1"], ["--target-at", "0"], ["--steps", "5", "--eval-every", "10"]):
    with pytest.raises(SystemExit):
      harness.training_args(bad)


def test_codec_rows_a_benchmark_adds_are_found_only_where_passed():
  row = ("ARC-Top-K 0.2 rows 64", "arc-topk", {"ratio": 0.2, "row": 64})
  assert harness.codec_row("DynamiQ 5b")[1] == "dynamiq"
  assert harness.codec_row(row[0], extra=(row,)) == row
  with pytest.raises(ValueError, match="ARC-Top-K 0.2 rows 64"):
    harness.codec_row(row[0])


def test_earlier_phases_kept_only_for_the_same_training(tmp_path, capsys):
  args = tta.parse(["--tiny"])
  cfg = harness.training_config(args)
  path = os.path.join(tmp_path, "tta_tiny.json")
  with open(path, "w") as f:
    json.dump({"training": cfg, "simulate": {"runs": {}}, "measure": {"rows": []}}, f)
  assert set(tta._earlier(path, cfg)) == {"simulate", "measure"}
  assert tta._earlier(path, dict(cfg, steps=cfg["steps"] + 1)) == {}
  assert "another training configuration" in capsys.readouterr().out


def test_tta_tiny(tmp_path):
  """All three phases: simulated training, timed steps over the links (shaped when
  root), and a real multi-process run equal bit for bit to the simulated one."""
  report = tta.main(["--tiny", "--out", str(tmp_path)])
  summary = report["summary"]
  assert list(summary["codecs"]) == ["BF16 psum", "DynamiQ 5b"]
  runs = report["simulate"]["runs"]
  for label, row in summary["codecs"].items():
    first = runs[label]["0"]["evals"][0]["eval_loss"]
    assert row["final_eval_loss_mean"] < first - 0.2, label  # it learnt
    s = row["rates"]["200.0"]["seconds_per_step"]
    assert s and s > 0, label
  assert runs["DynamiQ 5b"]["0"]["evals"][-1]["digest"] != runs["BF16 psum"]["0"]["evals"][-1][
      "digest"]  # the codec really ran
  check = summary["real_check"]["codecs"]["DynamiQ 5b"]
  assert check["same_as_simulated"] and all(check["same_as_simulated"])
  assert report["real"]["runs"]["DynamiQ 5b"]["ranks_agree"]
  assert check["tta_real_s"] > 0 and check["tta_predicted_s"] > 0
  with open(os.path.join(tmp_path, "tta_tiny.json")) as f:
    saved = json.load(f)
  assert saved["summary"] == json.loads(json.dumps(summary))
  assert os.path.getsize(os.path.join(tmp_path, "tta_wallclock_tiny.png")) > 1000


def test_moshpit_rows_train_each_rank_its_own_replica(tmp_path):
  """The Moshpit rows train per rank (4 workers: a 2 x 2 grid) and record how far the
  replicas are apart: 0 with every rank present, above 0 with absent ranks."""
  report = tta.main(["--tiny", "--workers", "4", "--phases", "simulate", "--codecs",
                     "Moshpit 5b,Moshpit 5b 10% absent", "--out", str(tmp_path)])
  runs = report["simulate"]["runs"]
  present = [e["replica_spread"] for e in runs["Moshpit 5b"]["0"]["evals"]]
  absent = [e["replica_spread"] for e in runs["Moshpit 5b 10% absent"]["0"]["evals"]]
  assert present == [0.0] * len(present)
  assert absent[0] == 0.0 and absent[-1] > 0.0
  assert runs["Moshpit 5b"]["0"]["evals"][-1]["eval_loss"] < runs["Moshpit 5b"]["0"][
      "evals"][0]["eval_loss"] - 0.2  # it learnt
  wire = harness.wire(report["training"], "Moshpit 5b")
  ring = harness.wire(report["training"], "DynamiQ 5b")
  assert wire["bytes_per_rank"] > ring["bytes_per_rank"]  # two rounds of pairs vs a ring of 4
