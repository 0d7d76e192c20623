"""bench.codec_cost: one tiny run (its JSON, wire accounting and break-even rates), and
its flags."""

import json

import pytest

from dynamiq_jax.bench import codec_cost


def test_tiny_run(tmp_path):
  report = codec_cost.main(["--tiny", "--out", str(tmp_path)])
  with open(tmp_path / "codec_cost_tiny.json") as f:
    saved = json.load(f)
  assert saved["complete"] is True
  assert saved["runs"] == report["runs"] and saved["table"] == report["table"]
  again = codec_cost.main(["--summarize", str(tmp_path / "codec_cost_tiny.json")])
  assert again["table"] == report["table"]  # the table remade from the JSON alone
  n, ranks = 1 << 14, saved["ranks"]
  assert ranks == 4
  runs = {r["codec"]: r for r in saved["runs"]}
  assert len(runs) == len(saved["runs"]) == 3 and set(runs) == {"bf16", "dynamiq", "mxfp8"}
  for name, r in runs.items():
    assert "error" not in r, (name, r.get("error"))
    assert r["coords"] == n and len(r["seconds"]) == 1
    assert r["compile_s"] > 0 and r["median_s"] > 0
    assert r["codec_s_per_rank"] == pytest.approx(r["median_s"] / ranks)
    assert r["bytes_per_rank"] == pytest.approx(2 * (ranks - 1) / ranks * n
                                                * r["bits_per_coord"] / 8)
  assert runs["bf16"]["bits_per_coord"] == 16
  assert runs["dynamiq"]["bits_per_coord"] < 8
  b16 = runs["bf16"]["bytes_per_rank"]
  for name in ("dynamiq", "mxfp8"):
    r = runs[name]
    codec_s = r["codec_s_per_rank"]
    assert r["codec_s_per_rank_net"] == pytest.approx(
        (r["median_s"] - runs["bf16"]["median_s"]) / ranks)
    assert r["break_even_gbps_serial"] == pytest.approx(
        (b16 - r["bytes_per_rank"]) * 8 / codec_s / 1e9)
    assert r["break_even_gbps_overlapped"] == pytest.approx(b16 * 8 / codec_s / 1e9)
    at = r["break_even_gbps_serial"] * 1e9  # there, codec + wire = bf16's wire
    assert codec_s + r["bytes_per_rank"] * 8 / at == pytest.approx(b16 * 8 / at)
  table = saved["table"]
  assert {(t["codec"], t["rate_gbps"]) for t in table} == {
      (c, rate) for c in ("dynamiq", "mxfp8") for rate in (100.0, 400.0, 800.0)}
  for t in table:
    r = runs[t["codec"]]
    assert t["wire_s"] == pytest.approx(r["bytes_per_rank"] * 8 / (t["rate_gbps"] * 1e9))
    assert t["bf16_wire_s"] == pytest.approx(b16 * 8 / (t["rate_gbps"] * 1e9))
    assert t["serial_s"] == pytest.approx(t["codec_s_per_rank"] + t["wire_s"])
    assert t["overlapped_s"] == pytest.approx(max(t["codec_s_per_rank"], t["wire_s"]))
    assert t["speedup_serial"] == pytest.approx(t["bf16_wire_s"] / t["serial_s"])
    assert t["speedup_overlapped"] == pytest.approx(t["bf16_wire_s"] / t["overlapped_s"])
    assert t["break_even_gbps_serial"] == r["break_even_gbps_serial"]


def test_break_even_words():
  assert codec_cost.break_even(10.0, 10.0, 1e-3) == "never"
  assert codec_cost.break_even(5.0, 10.0, 0.0) == "always"
  assert codec_cost.break_even(5.0, 10.0, -1e-3) == "always"
  assert codec_cost.break_even(5.0, 10.0, None) is None
  assert codec_cost.break_even(5e9, 10e9, 1.0) == pytest.approx(40.0)
  assert codec_cost.break_even(5e9, 10e9, 1.0, overlapped=True) == pytest.approx(80.0)


@pytest.mark.parametrize("flags, bad", [(["--codecs", "dynamiq,foo"], "'foo'"),
                                        (["--rates", "100,0"], "100,0"),
                                        (["--log2-coords", "28,x"], "28,x")])
def test_bad_flags(flags, bad, capsys):
  with pytest.raises(SystemExit):
    codec_cost.main(flags)
  assert bad in capsys.readouterr().err


def test_a_failed_size_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
  def no_memory(*args):
    raise MemoryError("out of memory (simulated)")

  monkeypatch.setattr(codec_cost, "_gradients", no_memory)
  report = codec_cost.main(["--tiny", "--codecs", "dynamiq", "--out", str(tmp_path)])
  with open(tmp_path / "codec_cost_tiny.json") as f:
    saved = json.load(f)
  assert saved["complete"] is True and saved["table"] == report["table"]
  for t in saved["table"]:  # the wire times stand; nothing that needs a timing is made up
    assert t["codec_s_per_rank"] is None and "serial_s" not in t and t["wire_s"] > 0
  assert [r["codec"] for r in saved["runs"]] == ["bf16", "dynamiq"]
  for r in saved["runs"]:
    assert "out of memory (simulated)" in r["error"] and "median_s" not in r
    assert r["bits_per_coord"] > 0  # the wire accounting needs no memory
  assert "out of memory (simulated)" in capsys.readouterr().err
