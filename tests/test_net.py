"""bench.net: the emulated network, its clean-up, faults, and the tables' arithmetic."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from dynamiq_jax.api.allreduce import DEFAULT_BUCKET_SIZE
from dynamiq_jax.bench import net
from dynamiq_jax.bench.netns import Network, can_shape, sweep_stale

SHAPING, WHY = can_shape()
needs_root = pytest.mark.skipif(not SHAPING, reason=f"no traffic shaping here: {WHY}")


OURS = f"dqn{os.getpid()}-"  # this run's networks; other runs' (or killed ones') are not ours


def _namespaces() -> str:
  return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_method_names():
  assert net.parse_method("psum-f32") == ("psum", "psum-f32", None, None)
  kind, codec, schedule, tile = net.parse_method("dynamiq4/butterfly@0")
  assert (kind, codec.bits, schedule, tile) == ("allreduce", 4.0, "butterfly", 0.0)
  assert net.parse_method("mxfp8/ring")[1].element == "e4m3"
  with pytest.raises(ValueError, match="'<codec>/<schedule>'"):
    net.parse_method("dynamiq")
  with pytest.raises(ValueError, match="schedule 'tree'"):
    net.parse_method("dynamiq/tree")
  with pytest.raises(ValueError, match="not one of"):
    net.parse_method("zip/ring")
  assert net.tile_coords(8) == 4 << 20  # 8 MiB of bf16
  assert net.tile_coords(0) == net.ONE_BUCKET  # @0: the whole gradient in one bucket
  assert net.ONE_BUCKET > DEFAULT_BUCKET_SIZE
  with pytest.raises(ValueError, match="tile 'big' is not a number"):
    net.parse_method("dynamiq/ring@big")


def test_speedups_are_against_the_fastest_uncompressed_and_use_the_slowest_rank():
  ready = [{"wire": {"1|psum-f32": 300.0, "1|bf16-ring/ring": 150.0, "1|dynamiq/ring": 50.0},
            "lm_wire": {}}]
  per_rank = [{"times": {"1|psum-f32": [4.0, 4.0, 4.0], "1|bf16-ring/ring": [2.0, 3.0, 2.0],
                         "1|dynamiq/ring": [1.0, 1.0, 1.0]}, "lm": {}},
              {"times": {"1|psum-f32": [4.0, 4.0, 4.0], "1|bf16-ring/ring": [2.0, 2.0, 2.5],
                         "1|dynamiq/ring": [1.0, 0.5, 1.0]}, "lm": {}}]
  rows = {r["method"]: r for r in net.summarize([(100.0, per_rank)], ready, {})}
  assert rows["bf16-ring/ring"]["seconds"] == 2.5  # median of the per-repeat maxima 2, 3, 2.5
  assert rows["dynamiq/ring"]["baseline"] == "bf16-ring/ring"
  assert rows["dynamiq/ring"]["speedup"] == pytest.approx(2.5)
  assert rows["dynamiq/ring"]["ideal"] == pytest.approx(3.0)
  assert rows["psum-f32"]["speedup"] == pytest.approx(2.5 / 4)


def test_crossover_rate():
  compute = {"a": {"seconds": 0.5}, "b": {"seconds": 0.1}}
  wire = {"a": 25e6, "b": 100e6}
  # saves 75 MB = 600 Mbit for 0.4 s more compute: pays on links below 1500 Mbit/s
  assert net.crossover(compute, wire, "a", "b") == pytest.approx(1500.0)
  assert net.crossover(compute, {"a": 200e6, "b": 100e6}, "a", "b") is None


def test_bad_arguments_are_named():
  with pytest.raises(SystemExit, match="power-of-two"):
    net.main(["--workers", "3", "--methods", "dynamiq/butterfly"])
  with pytest.raises(SystemExit, match="at least 2"):
    net.main(["--workers", "1", "--methods", "psum-f32"])


@needs_root
def test_network_is_removed_on_error():
  with pytest.raises(RuntimeError, match="boom"):
    with Network(2, prefix="dqtest-err") as nw:
      assert "dqtest-err-w1" in _namespaces()
      nw.set_rate(50)
      raise RuntimeError("boom")
  assert "dqtest-err" not in _namespaces()
  with pytest.raises(ValueError, match="rate_mbit=-1"):
    with Network(1, prefix="dqtest-bad") as nw:
      nw.set_rate(-1)
  assert "dqtest-bad" not in _namespaces()


@needs_root
def test_tiny_benchmark_runs_and_cleans_up(tmp_path):
  payload = net.main(["--tiny", "--methods", "psum-bf16", "bf16-ring/ring", "dynamiq/ring",
                       "--out", str(tmp_path)])
  assert payload["shaped"] and payload["workers"] == 2
  rows = {(r["method"], bool(r.get("lm"))): r for r in payload["rows"]}
  assert {m for m, _ in rows} == {"psum-bf16", "bf16-ring/ring", "dynamiq/ring"}
  for r in rows.values():
    assert r["seconds"] > 0 and math.isfinite(r["speedup"])
  for lm in (False, True):  # bytes: bf16 ring / DynamiQ at ~5 bits
    ratio = rows["bf16-ring/ring", lm]["bytes_per_rank"] / rows["dynamiq/ring", lm]["bytes_per_rank"]
    assert 3.0 < ratio < 3.3, ratio
  assert any(r.get("lm") for r in payload["rows"])
  assert json.loads((tmp_path / "net.json").read_text())["rows"]
  assert (tmp_path / "net_speedup.png").exists()
  assert OURS not in _namespaces()


@needs_root
def test_a_link_going_down_stops_the_run_with_an_error(tmp_path):
  t0 = time.monotonic()
  with pytest.raises((RuntimeError, TimeoutError)):
    net.main(["--tiny", "--no-lm", "--no-compute", "--methods", "bf16-ring/ring",
              "--sizes-mb", "8", "--rates", "50", "--heartbeat-s", "5", "--timeout", "90",
              "--inject-fault", "link-down", "--out", str(tmp_path)])
  assert time.monotonic() - t0 < 150
  assert OURS not in _namespaces()
  assert not (tmp_path / "net.json").exists()  # no partial result reported


def _dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid  # reaped: no process has this pid until the kernel reuses it


@needs_root
def test_namespaces_of_killed_runs_are_swept_and_live_ones_kept():
  live = subprocess.Popen(["sleep", "60"])
  dead = _dead_pid()
  made = [f"dqn{dead}-br", f"dqn{dead}-w0", f"dqn{live.pid}-w0", "dqtest-sweep-w0"]
  try:
    for ns in made:
      subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
      os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
    os.makedirs(f"/etc/netns/dqn{dead}-w1", exist_ok=True)  # a folder whose namespace is gone
    swept = sweep_stale()
    assert {f"dqn{dead}-br", f"dqn{dead}-w0", f"dqn{dead}-w1"} <= set(swept)
    names = _namespaces().split()
    assert f"dqn{dead}-w0" not in names and f"dqn{dead}-br" not in names
    assert not any(os.path.exists(f"/etc/netns/dqn{dead}-{s}") for s in ("br", "w0", "w1"))
    assert f"dqn{live.pid}-w0" in names and "dqtest-sweep-w0" in names  # live pid; not ours
    assert os.path.isdir(f"/etc/netns/dqn{live.pid}-w0")
    live.kill()
    live.wait()
    # a network being opened sweeps too
    with Network(1, prefix="dqtest-sweep2"):
      assert f"dqn{live.pid}-w0" not in _namespaces().split()
  finally:
    live.kill()
    live.wait()
    for ns in made + [f"dqn{dead}-w1"]:
      subprocess.run(["ip", "netns", "del", ns], capture_output=True)
      shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
