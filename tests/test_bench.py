"""Every benchmark runs once at a tiny size, so that it cannot rot."""

import json
import os

import jax
import pytest

from dynamiq_jax.bench import kernels, schedules, vnmse


@pytest.fixture(scope="module")
def lm_cache(tmp_path_factory):
  """One gradient cache for the benchmarks here: the first run captures the tiny LM's
  gradients (bench.lm), the later ones load them (its ``.npz`` path)."""
  return str(tmp_path_factory.mktemp("lm-grads"))


def test_vnmse_tiny(tmp_path, lm_cache):
  results, scaling = vnmse.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache])
  assert {r["table"] for r in results} == {"table3", "table4", "table6"}
  assert all(r["vnmse"] > 0 for r in results)
  assert {r["codec"] for r in results if r["table"] == "table3"} == set(vnmse.TINY_CODECS)
  assert set(vnmse.TINY_CODECS) <= {c[0] for c in vnmse.codec_table()}
  assert {r["dataset"] for r in results} == {"iid", "lm-word"}
  assert all(r["d"] == 1 << 14 for r in scaling if r["dataset"] == "iid")
  path = os.path.join(tmp_path, "vnmse_tiny.json")
  with open(path) as f:
    saved = json.load(f)
  assert saved["complete"] is True
  assert len(saved["results"]) == len(results) and saved["scaling"] == scaling
  assert set(saved["dataset_stats"]) == {"iid@0", "lm-word@3"}  # the datasets of table 3
  pngs = ("vnmse_budget_tiny.png", "vnmse_scaling_tiny.png")
  for png in pngs:
    assert os.path.getsize(os.path.join(tmp_path, png)) > 1000
    os.remove(os.path.join(tmp_path, png))
  assert vnmse.main(["--render", path]) == saved  # redraws without measuring
  assert all(os.path.exists(os.path.join(tmp_path, png)) for png in pngs)
  # --resume measures only what an interrupted run lacks, and refuses a finished run
  with pytest.raises(SystemExit, match="finished run"):
    vnmse.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache, "--resume"])
  cut = dict(saved, complete=False, results=saved["results"][:-1], scaling=saved["scaling"][:-1])
  with open(path, "w") as f:
    json.dump(cut, f)
  assert scaling[-1]["codec"] != "DynamiQ 5b"
  results2, scaling2 = vnmse.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache,
                                   "--resume", "--scaling-codecs", "DynamiQ 5b"])
  assert results2[:-1] == cut["results"] and scaling2 == cut["scaling"]  # not a DynamiQ point
  assert results2[-1]["vnmse"] == results[-1]["vnmse"]  # the same point, measured again
  with open(path) as f:
    assert json.load(f)["complete"] is False
  _, scaling3 = vnmse.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache, "--resume"])
  assert scaling3[:-1] == cut["scaling"] and scaling3[-1]["vnmse"] == scaling[-1]["vnmse"]
  with open(path) as f:
    assert json.load(f)["complete"] is True


def test_schedules_tiny(tmp_path, lm_cache):
  rows = schedules.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache])
  labels = {schedules._label(*s) for s in schedules.TINY_SCHEDULES}
  assert set(schedules.TINY_SCHEDULES) <= set(schedules.SCHEDULES)
  assert {(r["codec"], r["schedule"]) for r in rows} == {
      (c, s) for c in ("DynamiQ 5b", "MXFP8") for s in labels}
  assert {r["dataset"] for r in rows} == {"iid", "lm-word@3"}
  # MXFP8 keeps state (its adaptive scale), which the hierarchical and Moshpit schedules refuse
  refused = [r for r in rows if r["vnmse"] is None]
  assert {(r["codec"], r["schedule"].split()[0]) for r in refused} == {
      ("MXFP8", "hierarchical"), ("MXFP8", "moshpit")}
  moshpit = [r for r in rows if r["schedule"].startswith("moshpit") and r["vnmse"] is not None]
  assert moshpit and all(r["bytes_vs_ring"] > 1 for r in moshpit)  # a round per grid axis
  assert all("stateless" in r["reason"] for r in refused)
  ran = [r for r in rows if r["vnmse"] is not None]
  assert all(0 < r["vnmse"] < 1 for r in ran)
  flat = [r for r in ran if r["compressed_axis"] == "data"]
  # DynamiQ never exceeds its budget; MX pads to whole blocks per rank, which only adds bits
  assert all(r["bits_per_coord"] <= 5.0 for r in flat if r["codec"] == "DynamiQ 5b")
  assert all(8.5 <= r["bits_per_coord"] < 9.0 for r in flat if r["codec"] == "MXFP8")
  assert all(r["compressed_axis"] == "slow" for r in ran if r not in flat)
  with open(os.path.join(tmp_path, "schedules_tiny.json")) as f:
    assert json.load(f)["rows"] == rows


def test_vnmse_rejects_bad_options_before_measuring(tmp_path):
  with pytest.raises(SystemExit, match="no .* to continue"):
    vnmse.main(["--tiny", "--out", str(tmp_path), "--resume"])
  with pytest.raises(SystemExit, match="unknown \\['DynamiQ 9b'\\]"):
    vnmse.main(["--tiny", "--out", str(tmp_path), "--scaling-codecs", "DynamiQ 9b"])
  assert os.listdir(tmp_path) == []


def test_train_tiny(tmp_path):
  import pathlib
  import sys
  root = str(pathlib.Path(__file__).resolve().parents[1])
  if root not in sys.path:  # the examples live beside the package
    sys.path.insert(0, root)
  from dynamiq_jax.bench import train
  # one example: the benchmark's code is the same for each (tests/test_examples.py runs them all)
  report = train.main(["--tiny", "--examples", "digits", "--codecs", "BF16 psum,DynamiQ 5b",
                       "--out", str(tmp_path)])
  assert set(report["examples"]) == {"digits"}
  for name, summary in report["examples"].items():
    bf16, dyn = summary["codecs"]["BF16 psum"], summary["codecs"]["DynamiQ 5b"]
    assert bf16["quality_vs_bf16"] == 1.0 and bf16["bits_per_coord"] == 16
    assert dyn["bits_per_coord"] <= 5.0
    assert dyn["bytes_per_rank_per_step"] < bf16["bytes_per_rank_per_step"] / 3
    assert dyn["state_sha256"] != bf16["state_sha256"]  # the codec really ran
    assert os.path.getsize(os.path.join(tmp_path, f"train_{name}.png")) > 1000
  with open(os.path.join(tmp_path, "train.json")) as f:
    saved = json.load(f)
  assert saved["examples"].keys() == report["examples"].keys()
  assert all(e["command"] == saved["command"] for e in saved["examples"].values())
  # BF16 alone again: its runs are bit-identical, so DynamiQ's earlier row is kept, as measured
  again = train.main(["--tiny", "--examples", "digits", "--codecs", "BF16 psum",
                      "--out", str(tmp_path)])["examples"]["digits"]["codecs"]
  first = report["examples"]["digits"]["codecs"]
  assert list(again) == ["BF16 psum", "DynamiQ 5b"]
  assert again["BF16 psum"]["state_sha256"] == first["BF16 psum"]["state_sha256"]
  for key in ("quality", "steps_to_target", "state_sha256", "bytes_per_rank_per_step"):
    assert again["DynamiQ 5b"][key] == first["DynamiQ 5b"][key], key
  assert again["DynamiQ 5b"]["measured_by"] == first["DynamiQ 5b"]["measured_by"]
  assert again["BF16 psum"]["measured_by"]["date"] >= first["DynamiQ 5b"]["measured_by"]["date"]


def test_train_drops_earlier_codecs_when_bf16_differs():
  from dynamiq_jax.bench import train
  args = train._parse(["--codecs", "BF16 psum", "--seeds", "0"])
  curve = {"seed": 0, "train_loss": [1.0, 0.5], "evals": []}
  entry = lambda sha: {"quality": [0.9], "curves": [curve], "median_step_time_s": [0.1],
                       "bits_per_coord": 8.5, "bytes_per_rank_per_step": 10, "options_used": [{}],
                       "state_sha256": [sha], "reducer": "mxfp8", "bits_option": None,
                       "overrides": {}}
  earlier = {"metric": "test_accuracy", "steps": 2, "command": "old", "machine": {},
             "codecs": {"BF16 psum": entry("aaa"), "MXFP8": entry("bbb")}}
  runs = {("digits", "BF16 psum", 0): {"state_sha256": "aaa", "train_loss": [1.0, 0.4]}}
  kept = train._reuse_earlier("digits", earlier, args, dict(runs))
  assert [c[0] for c, _ in kept] == ["MXFP8"] and kept[0][1]["command"] == "old"
  runs[("digits", "BF16 psum", 0)]["state_sha256"] = "ccc"  # BF16 changed: targets would not match
  assert train._reuse_earlier("digits", earlier, args, dict(runs)) == []


def test_train_keeps_examples_measured_earlier(tmp_path):
  from dynamiq_jax.bench import train
  path = os.path.join(tmp_path, "train.json")
  assert train._earlier_examples(path) == {}
  with open(path, "w") as f:
    json.dump({"command": "python -m dynamiq_jax.bench.train --examples char_lm",
               "machine": {"cpu_count": 2}, "model": {"workers": 8},
               "examples": {"char_lm": {"steps": 400},
                            "digits": {"steps": 300, "command": "older"}}}, f)
  kept = train._earlier_examples(path)
  assert kept["char_lm"] == {"steps": 400, "machine": {"cpu_count": 2}, "model": {"workers": 8},
                             "command": "python -m dynamiq_jax.bench.train --examples char_lm"}
  assert kept["digits"]["command"] == "older"  # its own record wins


def test_smoothing_and_target():
  from dynamiq_jax.bench import train
  import numpy as np
  np.testing.assert_allclose(train.smooth([4.0, 2.0, 0.0, 2.0], 2), [4.0, 3.0, 1.0, 1.0])
  assert train.steps_to_target([3.0, 2.0, 1.0], 2.0) == 2
  assert train.steps_to_target([3.0, 2.5], 2.0) is None


def test_robustness_tiny(tmp_path, lm_cache):
  from dynamiq_jax.bench import robustness
  rows, sweep = robustness.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache])
  by = {r["data"]: r for r in rows}
  assert {"dense", "signal_noise", "layered", "paper"} <= set(by)
  # no family is noise to the default codec (dense, flat norms: the static-capacity
  # codec it replaced measured about 1 there)
  assert all(0 < r["default"] < 0.1 and 0 < r["widths 2/4/8"] < 0.1 for r in rows)
  assert {p["d"] for p in sweep} == {64, 2049, 8192}
  sent = {p["d"]: (p["compressed"], p["bits_per_coord"]) for p in sweep}
  assert not sent[64][0] and sent[64][1] == 16.0  # too small: bf16, and the bits say so
  assert sent[8192][0] and sent[8192][1] <= 5.0
  for name in ("robustness_tiny.json", "robustness_tiny_size.png"):
    assert os.path.exists(os.path.join(tmp_path, name))


def test_kernels_tiny(tmp_path):
  """The --gpu benchmark's body (the default codec's kernels), interpreted on CPU."""
  rows = kernels.main(["--tiny", "--widths", "4", "--sweep", "--launches", "16x8",
                       "--out", str(tmp_path)])
  main = [r for r in rows if "launch" not in r]
  assert {r["op"] for r in main} == set(kernels.OPS) | {"copy"}
  assert {r["impl"] for r in main if r["op"] != "copy"} == {"pallas", "xla"}
  assert all(r["seconds"] > 0 and r["coords_per_s"] > 0 for r in rows)
  for r in rows:  # every kernel row beside the same run's copy of as many bytes
    if r["op"] != "copy":
      assert r["fraction_of_copy"] == pytest.approx(r["gbs"] / r["copy_gbs"])
  sweep = [r for r in rows if "launch" in r]
  assert sorted((tuple(r["launch"]), r["op"]) for r in sweep) == sorted(
      (launch, op) for launch in [(16, 8)]
      for op in ("compress", "decompress_accumulate_recompress"))
  with open(os.path.join(tmp_path, "kernels_interpret_tiny.json")) as f:
    saved = json.load(f)
  assert saved["interpret"] is True and saved["complete"] is True
  assert len(saved["results"]) == len(main) and len(saved["sweep"]) == len(sweep)
  assert saved["backend_lowering"]["triton"] == "lowers"
  assert saved["backend_lowering"]["mosaic_gpu"] != "lowers"  # test_kernel_dispatch says why
  assert saved["backend_lowering_target"] == kernels.H100[0]  # no GPU here: the abstract H100


def test_kernels_bad_flags(tmp_path):
  with pytest.raises(SystemExit, match="--impls"):
    kernels.main(["--tiny", "--impls", "cuda", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="--launches"):
    kernels.main(["--tiny", "--sweep", "--launches", "16-4", "--out", str(tmp_path)])
  with pytest.raises(ValueError, match="block >= 16"):
    kernels.main(["--tiny", "--sweep", "--launches", "8x8", "--out", str(tmp_path)])


def test_kernels_gpu_fails_without_a_gpu(tmp_path):
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present: --gpu runs")
  with pytest.raises(SystemExit, match="no GPU") as err:
    kernels.main(["--gpu", "--tiny", "--out", str(tmp_path)])
  assert err.value.code != 0


def test_overlap_tiny(tmp_path):
  from dynamiq_jax.bench import gpu_compile, overlap
  if gpu_compile.missing(need_ptxas=False):
    pytest.skip(gpu_compile.missing(need_ptxas=False))
  payload = overlap.main(["--tiny", "--out", str(tmp_path)])
  runs = payload["runs"]
  assert set(runs) == {"pmean", "dynamiq@262144"}
  assert runs["dynamiq@262144"]["buckets"] == 2
  assert runs["pmean"]["collectives"] and runs["dynamiq@262144"]["collectives"]["collective-permute"] > 0
  assert all(r["compile_s"] > 0 for r in runs.values())
  assert all(0 < r["vs_best"] for r in payload["model"]["rows"])
  with open(os.path.join(tmp_path, "overlap_tiny.json")) as f:
    assert json.load(f)["runs"] == runs


def test_sharded_tiny(tmp_path):
  # F32 ring: the plumbing of the HLO and memory parts, without DynamiQ's compile time.
  from dynamiq_jax.bench import sharded
  payload = sharded.main(["--tiny", "--codec", "f32-ring", "--parts", "hlo,memory",
                          "--bucket-sizes", "default", "--out", str(tmp_path)])
  for row in payload["hlo"]:  # Auto axes (test_sharded.py compiles Explicit ones too)
    assert row["all_gathers_over_model"] == 0, row["over_model"]
    assert any(k.endswith("over data") for k in row["collectives"]), row["collectives"]
  mem = {r["layout"]: r for r in payload["memory"]}
  assert set(mem) == {"data", "zero", "hsdp"}
  full = mem["data"]["optimizer_bytes_per_device"]
  # every leaf of the tiny LM splits (min_size=0): Adam's moments are 1/n per device, up to
  # scalars such as the step count
  assert full / 8 <= mem["zero"]["optimizer_bytes_per_device"] < 1.01 * full / 8
  assert full / 4 <= mem["hsdp"]["optimizer_bytes_per_device"] < 1.01 * full / 4
  for r in mem.values():  # the scratch split (bench.buffers) holds all of the live scratch
    assert sum(r["peak"]["at_peak"].values()) == r["peak"]["temp_live_at_peak"] > 0
    assert r["peak"]["xla_peak_recounted"] == r["peak"]["xla_peak"]
    assert r["peak"]["own_max"]["gradient"] > 0
  for layout in ("zero", "hsdp"):  # they gather the parameters for the forward pass
    assert mem[layout]["peak"]["own_max"]["gathered parameters"] >= mem[layout]["param_bytes"] / 2
  assert "gathered parameters" not in mem["data"]["peak"]["own_max"]
  # The gradient (backward values + the reduction's buffers), at the step's peak and at its
  # own most. This LM's activations outweigh its gradient and XLA:CPU runs the whole
  # backward pass before the reductions (test_sharded_tiny_gradient is the model whose
  # gradient dominates), so the sharded steps are not 1/n here; with the default buckets
  # they hold no more gradient than the replicated one (1.00x here with F32): a change that
  # makes them hold more (a copy of the gradient, a bucket kept longer) fails here.
  for layout in ("zero", "hsdp"):
    for when in ("at_peak", "own_max"):
      got, ref = mem[layout]["peak"][when], mem["data"]["peak"][when]
      got, ref = ((sharded.gradient_bytes(got), sharded.gradient_bytes(ref))
                  if when == "at_peak" else (got["gradient"], ref["gradient"]))
      assert got <= 1.05 * ref, (layout, when, got, ref)
  with open(os.path.join(tmp_path, "sharded.json")) as f:
    assert json.load(f)["memory"] == payload["memory"]
  text = (tmp_path / "sharded.md").read_text()
  assert "memory_analysis() per device" in text and "the scratch at the step's peak" in text


def test_sharded_tiny_gradient(tmp_path):
  # Part 4 (F32 ring, for compile time): the sharded step keeps 1/8 of the parameters and of
  # Adam's state per device; under XLA:CPU's memory-minimizing scheduler it reduces each
  # layer's bucket as the backward pass produces it, so less of the local gradient is live at
  # once than in the replicated step, which holds the whole reduced gradient; and never less
  # than one layer's gradient plus the other layers' shards (a broken accounting would).
  from dynamiq_jax.bench import sharded
  payload = sharded.main(["--tiny", "--codec", "f32-ring", "--parts", "gradient",
                          "--out", str(tmp_path)])
  rows = {(r["scheduler"], r["path"]): r for r in payload["gradient"]}
  compiled = {s for s, _ in rows}  # h100: with the gpu-compile extra (CI installs it)
  assert {"concurrency", "memory"} <= compiled <= set(sharded.SCHEDULERS)
  assert set(rows) == {(s, p) for s in compiled for p in sharded.GRADIENT_PATHS}
  for scheduler in compiled:
    zero, repl = rows[scheduler, "zero"], rows[scheduler, "replicated"]
    for key in ("param_bytes_per_device", "optimizer_bytes_per_device"):
      assert repl[key] / 8 <= zero[key] < 1.01 * repl[key] / 8, (scheduler, key)
  zero, repl = rows["memory", "zero"], rows["memory", "replicated"]
  whole, layers = zero["local_gradient_bytes"], zero["mlp"]["layers"]
  assert repl["gradient_most_live"] >= whole
  assert whole * sharded.gradient_floor(layers) <= zero["gradient_most_live"] < 0.75 * whole
  assert "the gradient in the sharded-optimizer step" in (tmp_path / "sharded.md").read_text()


@pytest.mark.slow  # .ci/run-slow: 2 worker processes; test_sharded.py trains hsdp in-process
def test_sharded_tiny_processes(tmp_path):
  from dynamiq_jax.bench import sharded
  payload = sharded.main(["--tiny", "--codec", "f32-ring", "--parts", "hsdp",
                          "--out", str(tmp_path)])
  h = payload["hsdp"]
  assert h["bit_identical"] and len(h["loss_bits_simulated"]) == 3
  assert not h["namespaces"]  # --tiny never creates network namespaces
  with open(os.path.join(tmp_path, "sharded.json")) as f:
    assert json.load(f)["hsdp"]["loss_bits_processes"] == h["loss_bits_processes"]
  assert "bit-identical to the one-process run: True" in (tmp_path / "sharded.md").read_text()


def test_sparse_tiny(tmp_path, lm_cache):
  from dynamiq_jax.bench import sparse
  assert len(jax.devices()) == 8  # started here: the part "training" must not set its own count
  report = sparse.main(["--tiny", "--out", str(tmp_path), "--cache", lm_cache])
  rules = {r["rule"] for r in report["rows"]["rows"]}
  assert {"leaf rows, first axis", "leaf rows, last axis", "fixed rows of 128"} <= rules
  assert all(0 < r["energy_sketch4"] <= r["energy_exact"] + 0.05 <= 1.05
             for r in report["rows"]["rows"])
  curves = report["synthetic"]["curves"]
  assert set(curves) == {"No compressor", "Rand-K", "Local Top-K (all-gather)",
                         "ARC-Top-K exact", "ARC-Top-K sketch r=2"}
  assert all(c["distance"][-1] < c["distance"][0] for c in curves.values())
  assert os.path.getsize(tmp_path / "sparse_synthetic_tiny.png") > 1000
  with open(tmp_path / "sparse_tiny.json") as f:
    assert json.load(f)["synthetic"]["config"]["steps"] == 60
  runs = report["training"]["runs"]
  assert [(r["options"].get("ef21m_momentum"), r["options"]["row"]) for r in runs] == [
      (0.1, 256)]  # --tiny runs the first variant
  assert all(r["final_eval_loss"] < r["evals"][0]["eval_loss"] for r in runs)
