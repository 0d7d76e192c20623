"""ARC-Top-K's defaults cost at most 4 bits per coordinate; bench/arctopk.py's variants and
its --tiny smoke run."""

import json
import os

import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.bench import arctopk
from dynamiq_jax.codecs import ARCTopK


def test_default_costs_at_most_four_bits():
  # bench.tta's LM on 4 ranks, and buckets of 1 M and 16 M on 8 and 64 ranks (a bucket of
  # a few hundred rows costs more: k is rounded up to a multiple of n)
  for d, n in ((2_708_608, 4), (1 << 20, 8), (1 << 24, 64)):
    assert ARCTopK().wire_bits(d, n) / d <= 4.0, (d, n)


def test_variant_parsing_names_the_bad_option():
  v = arctopk.parse_variant("ratio=0.4,values=mxfp8,rank=None,ef=ef14")
  assert v == {"ratio": 0.4, "values": "mxfp8", "rank": None, "ef": "ef14"}
  assert v.codec() == ARCTopK(ratio=0.4, rank=None,
                              values=dq.codecs.MX(element="e4m3", scale="e8m0"))
  assert v.transform_options() == {"error_feedback": "ef14"}
  assert arctopk.parse_variant("default") == {}
  with pytest.raises(ValueError, match="'width'"):
    arctopk.parse_variant("width=3")
  with pytest.raises(ValueError, match="ef='ef2'"):
    arctopk.parse_variant("ef=ef2")


def test_bench_tiny(tmp_path, capsys):
  report = arctopk.main(["--tiny", "--parts", "factors", "--out", str(tmp_path)])
  rows = report["factors"]["rows"]
  assert {(r["optimizer"], r["label"]) for r in rows} == {
      ("adamw", lab) for lab in ("ef=none", "default")}  # --tiny: one model, one optimizer
  assert all(np.isfinite(r["mean_vs_uncompressed"]) and r["bits_per_coord"] <= 4.5
             for r in rows)
  with open(os.path.join(tmp_path, "arctopk_factors_tiny.json")) as f:
    stored = json.load(f)
  assert stored["factors"]["rows"] == json.loads(json.dumps(rows))
  assert stored["machine"]["device_count"] == 8 and stored["command"]
  out = capsys.readouterr().out
  assert "| feedback | ef=none |" in out and "command: " in out


def test_bench_tiny_lm(tmp_path):
  # the LM part with feedback options (their wire bits were once asked of the codec)
  report = arctopk.main(["--tiny", "--parts", "lm", "--lm-variants", "ef=ef14;ef=none",
                         "--lm-seeds", "0", "--out", str(tmp_path)])
  table = {r["label"]: r for r in report["lm"]["table"]}
  assert set(table) == {"BF16 psum", "ARC-Top-K ef=ef14", "ARC-Top-K ef=none"}
  assert table["ARC-Top-K ef=ef14"]["options"]["error_feedback"] == "ef14"
  assert table["ARC-Top-K ef=ef14"]["bits_per_coord"] == table["ARC-Top-K ef=none"][
      "bits_per_coord"] < 16 == table["BF16 psum"]["bits_per_coord"]
  assert all(np.isfinite(r["final_eval_loss"]).all() for r in table.values())
