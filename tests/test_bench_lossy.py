"""bench.lossy: one tiny run (every estimator in its statistics), its flags, the rank sweep's
summary and fit."""

import json
import math

import pytest

from dynamiq_jax.bench import lossy


def test_tiny_run(tmp_path):
  report = lossy.main(["--tiny", "--out", str(tmp_path), "--stats-every", "2",
                       "--stats-keys", "2"])
  with open(tmp_path / "lossy_tiny.json") as f:
    assert json.load(f)["summary"] == report["summary"]
  rows = {(r["setting"], r["estimator"]): r for r in report["summary"]}
  # --tiny trains the unbiased estimate only: the zero fill runs in the statistics below
  assert set(rows) == {("no loss", "unbiased"), ("10%", "unbiased")}
  assert {r["workers"] for r in report["summary"]} == {2}
  assert rows["no loss", "unbiased"]["perplexity_change"] == 0
  assert rows["no loss", "unbiased"]["max_relative_drift"] == 0  # nothing lost, nothing stale
  assert rows["10%", "unbiased"]["max_relative_drift"] > 0
  runs = report["runs"]["2"]
  assert runs["10% / unbiased"]["0"]["train_loss"] != runs["no loss / unbiased"]["0"]["train_loss"]
  # the estimators' statistics, on the lossless run's gradients every 2 steps
  stats = runs["no loss / unbiased"]["0"]["estimator_stats"]
  assert [s["step"] for s in stats] == [0, 2]
  assert "estimator_stats" not in runs["10% / unbiased"]["0"]
  for s in stats:
    for est in ("unbiased", "zero-fill"):
      e = s[f"p=0.1 / {est}"]
      assert 0 < e["error"] and math.isclose(e["bias"] + e["variance"], e["error"])
      assert 0 <= e["direction"] <= e["error"] + 1e-12  # the best rescaling removes some
    # the zero fill drops the lost packets' share: biased low; the estimate is not
    assert s["p=0.1 / zero-fill"]["scale"] < s["p=0.1 / unbiased"]["scale"]
    assert s["codec_error"] > 0 and s["rank_spread"] > 0
  again = lossy.main(["--tiny", "--summarize", str(tmp_path / "lossy_tiny.json")])
  assert again["summary"] == report["summary"]


def _run(final, drift=0.0):
  return {"evals": [{"step": 0, "eval_loss": 8.0}, {"step": 10, "eval_loss": final}],
          "drift": [drift], "param_norm": 1.0,
          "train_loss": []}


def test_summary_per_rank_count_and_the_fit_against_ranks():
  # the perplexity change made exactly a + b / n: the fit must give back a and b
  a, b = 0.004, 0.25
  runs = {}
  for n in (16, 32, 64):
    runs[str(n)] = {"no loss / unbiased": {"0": _run(3.0)},
                    "10% / unbiased": {"0": _run(3.0 + math.log1p(a + b / n), 0.1)},
                    "10% / zero-fill": {"0": _run(3.0 + math.log1p(2 * a), 0.1)}}
  rows = lossy.summarize(runs, smooth=1)
  assert [(r["workers"], r["estimator"]) for r in rows if r["p"] > 0] == [
      (16, "unbiased"), (16, "zero-fill"), (32, "unbiased"), (32, "zero-fill"),
      (64, "unbiased"), (64, "zero-fill")]
  fits = {f["estimator"]: f for f in lossy.fit_against_ranks(rows)}
  assert fits["unbiased"]["a"] == pytest.approx(a, abs=1e-9)
  assert fits["unbiased"]["b"] == pytest.approx(b, abs=1e-9)
  assert fits["unbiased"]["at_64"] == pytest.approx(a + b / 64, abs=1e-9)
  assert fits["zero-fill"]["b"] == pytest.approx(0, abs=1e-9)
  # a report of one rank count, as written before --workers took several
  old = {"training": {"workers": 4}, "runs": runs["16"]}
  assert [r["workers"] for r in lossy.summarize(lossy._by_workers(old), 1)] == [4, 4, 4]
  assert lossy.fit_against_ranks(lossy.summarize(lossy._by_workers(old), 1)) == []


def test_bad_flags(capsys):
  with pytest.raises(SystemExit, match="--settings"):
    lossy.main(["--tiny", "--settings", "50%"])
  with pytest.raises(SystemExit, match="--estimators"):
    lossy.main(["--tiny", "--estimators", "mean"])
  with pytest.raises(SystemExit, match="--workers='16,x'"):
    lossy.main(["--tiny", "--workers", "16,x"])
  with pytest.raises(SystemExit, match="--workers='1'"):
    lossy.main(["--tiny", "--workers", "1"])
  with pytest.raises(SystemExit, match=r"--global-batch=48 .*e\.g\. --global-batch 64"):
    lossy.main(["--tiny", "--workers", "16,32,64", "--global-batch", "48"])
  with pytest.raises(SystemExit, match="--stats-keys=1"):
    lossy.main(["--tiny", "--stats-every", "2", "--stats-keys", "1"])
  with pytest.raises(SystemExit):
    lossy.main(["--tiny", "--links", "gather"])
  assert "--links: invalid choice: 'gather'" in capsys.readouterr().err


def test_summarize_merges_reports_of_other_rank_counts(tmp_path):
  def report(n, final):
    return {"training": {str(n): {"workers": n}}, "workers": [n], "command": f"n={n}",
            "runs": {str(n): {"no loss / unbiased": {"0": _run(3.0)},
                              "10% / unbiased": {"0": _run(final)}}}}
  for n, final in ((16, 3.02), (4, 3.04)):
    with open(tmp_path / f"r{n}.json", "w") as f:
      json.dump(report(n, final), f)
  out = lossy.main(["--summarize", str(tmp_path / "r16.json"), "--merge", str(tmp_path / "r4.json"),
                    "--smooth", "1"])
  assert [(r["workers"], r["setting"]) for r in out["summary"]] == [
      (4, "no loss"), (4, "10%"), (16, "no loss"), (16, "10%")]
  assert out["summary"][1]["perplexity_change"] == pytest.approx(math.exp(0.04) - 1)
  assert out["workers"] == [4, 16] and out["merged"][0]["command"] == "n=4"
  assert len(out["fit"]) == 1 and out["fit"][0]["workers"] == [4, 16]
  with pytest.raises(SystemExit, match="--merge"):
    lossy.main(["--merge", str(tmp_path / "r4.json")])
