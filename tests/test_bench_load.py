"""bench.common's load records: busy phases, --strict, and the record every results JSON gets."""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest

from dynamiq_jax.bench import common

BURN = """
import os, sys, time
t = time.monotonic()
while time.monotonic() - t < {seconds}:
  pass
with open(sys.argv[1] + ".tmp", "w") as f:
  f.write(str(time.process_time()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # whole, once it is there
"""


@pytest.fixture(autouse=True)
def _fresh_phases(monkeypatch):
  monkeypatch.setattr(common, "_PHASES", [])


def _numbers(record):
  assert record["wall_s"] > 0
  for key in ("own_cpu_s", "other_cpu_s", "other_cores"):
    assert isinstance(record[key], float) and math.isfinite(record[key]) and record[key] >= 0, key
  for key in ("loadavg_before", "loadavg_after"):
    assert len(record[key]) == 3 and all(isinstance(v, float) for v in record[key])
  assert isinstance(record["busy"], bool)


def test_idle_phase_has_the_fields():
  with common.load_watch("idle") as w:
    time.sleep(0.3)
  _numbers(w.record)  # busy or not: the machine is shared with other test runs
  assert [p["phase"] for p in common._PHASES] == ["idle"]


def test_another_process_burning_cpu_makes_the_phase_busy(tmp_path, capsys):
  done = tmp_path / "cpu_s"
  # Not our descendant: the shell backgrounds the burner and exits, so it counts as "other".
  sh = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$0" "$1" >/dev/null 2>&1 & echo $!',
                       BURN.format(seconds=1.5), str(done)],
                      capture_output=True, text=True, check=True)
  assert int(sh.stdout)
  with common.load_watch("burn") as w:
    deadline = time.monotonic() + 30
    while not done.exists() or not done.read_text():
      assert time.monotonic() < deadline, "the burner did not finish"
      time.sleep(0.05)
  _numbers(w.record)
  burnt = float(done.read_text())
  assert burnt > 0.3  # it had some CPU, even on a loaded machine
  assert w.record["other_cpu_s"] >= 0.8 * burnt - 0.05, (w.record, burnt)
  assert w.busy and w.record["other_cores"] > common.BUSY_CORES
  assert "busy during burn" in capsys.readouterr().err


def test_our_own_child_is_our_load_not_the_machines(tmp_path):
  done = tmp_path / "cpu_s"
  with common.load_watch() as w:
    subprocess.run([sys.executable, "-c", BURN.format(seconds=0.8), str(done)], check=True)
  assert w.record["own_cpu_s"] >= 0.8 * float(done.read_text()) - 0.05
  assert common._PHASES == []  # unnamed: not kept for the JSON


def _payload():
  return {"benchmark": "x", "command": "python -m x", "machine": common.machine()}


def test_write_results_adds_the_load_record(tmp_path):
  args = argparse.Namespace(tiny=True, label=None, out=str(tmp_path), strict=False)
  with common.load_watch("timed"):
    pass
  path = common.write_results("x", args, _payload())
  with open(path) as f:
    load = json.load(f)["load"]
  assert set(load) >= {"loadavg", "busy_cores", "run", "phases", "busy"}
  _numbers(dict(load["run"], loadavg_before=load["loadavg"], loadavg_after=load["loadavg"]))
  assert [p["phase"] for p in load["phases"]] == ["timed"]
  # a stored report re-summarized by a later process keeps the load it was measured under
  stored = dict(_payload(), machine=dict(common.machine(), date="2020-01-01T00:00:00+00:00"),
                load={"busy": False, "from": "the measuring run"})
  common.write_json(str(tmp_path / "old.json"), stored)
  assert json.loads((tmp_path / "old.json").read_text())["load"]["from"] == "the measuring run"


def test_strict_refuses_results_of_a_busy_machine(tmp_path, monkeypatch, capsys):
  busy = lambda before, after: {"wall_s": 1.0, "own_cpu_s": 0.0, "other_cpu_s": 1.5,
                                "other_cores": 1.5, "busy": True}
  monkeypatch.setattr(common, "_between", busy)
  parser = argparse.ArgumentParser()
  common.add_data_flags(parser)
  args = parser.parse_args(["--tiny", "--out", str(tmp_path), "--strict"])
  args.label = None
  with common.load_watch("timed"):
    pass
  with pytest.raises(SystemExit, match="--strict: not writing .*busy.*1.5 cores during 'timed'"):
    common.write_results("x", args, _payload())
  assert not os.path.exists(tmp_path / "x_tiny.json")
  args.strict = False  # without --strict: written, with a warning
  common.write_results("x", args, _payload())
  assert json.loads((tmp_path / "x_tiny.json").read_text())["load"]["busy"] is True
  assert "measured on a busy machine" in capsys.readouterr().err


def test_every_networked_benchmark_has_strict():
  from dynamiq_jax.bench import codec_cost, kernels, net, tta

  for parser in (net.build_parser(), tta.build_parser(), kernels.build_parser(),
                 codec_cost.build_parser()):
    assert parser.parse_args(["--strict"]).strict


def test_xla_flags_less_drops_only_the_named_flags():
  env = {"XLA_FLAGS": " --xla_backend_optimization_level=0  --xla_cpu_use_fusion_emitters=false"
                      " --xla_force_host_platform_device_count=8"}
  assert common.xla_flags_less(env, "--xla_backend_optimization_level",
                               "--xla_force_host_platform_device_count") == [
                                   "--xla_cpu_use_fusion_emitters=false"]
  assert common.xla_flags_less(env) == env["XLA_FLAGS"].split()
  assert common.xla_flags_less({}, "--xla_backend_optimization_level") == []
