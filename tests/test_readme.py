"""The README stays true: its code runs as pasted, its figures are the measured ones,
and it stays short enough to read in five minutes."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "docs" / "results"


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def test_readme_is_short():
  assert len(README.encode()) <= 10 * 1024, len(README.encode())


def test_every_python_block_runs_as_pasted(tmp_path):
  """Each block in a fresh interpreter, from an empty directory (no repository on the path)."""
  blocks = _blocks("python")
  assert len(blocks) >= 2
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  for i, block in enumerate(blocks):
    out = subprocess.run([sys.executable, "-W", "error", "-c", block], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"README python block {i}:\n{block}\n{out.stderr[-3000:]}"


def test_links_point_at_files_in_the_repository():
  for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
    if target.startswith("http"):
      continue
    assert (ROOT / target).exists(), target
  assert "../shared" not in README


ROBUSTNESS_ROWS = {
    "dense, independent workers": "dense",
    "shared signal + noise": "signal_noise",
    "layers over 4 decades": "layered",
    "the paper's gradient model": "paper",
    "word-LM, step 300": "lm-word@300",
    "byte-LM, step 300": "lm-byte@300",
}


def _close(text, value):
  """``text`` is ``value`` to the 3 significant digits it shows."""
  return abs(float(text) - value) <= 0.005 * abs(value) + 1e-12


def test_results_table_is_the_measured_one():
  table = {r["data"]: r for r in json.loads((RESULTS / "robustness.json").read_text())["table"]}
  rows = [line.split("|")[1:-1] for line in README.splitlines() if line.startswith("| ")]
  seen = set()
  for cells in rows:
    label = cells[0].strip()
    if label not in ROBUSTNESS_ROWS:
      continue
    ref = table[ROBUSTNESS_ROWS[label]]
    for text, key in zip(cells[1:], ("default", "static", "mxfp8")):
      assert _close(text.strip(), ref[key]), (label, key, text, ref[key])
    seen.add(label)
  assert seen == set(ROBUSTNESS_ROWS)


def test_network_figures_are_the_measured_ones():
  rows = json.loads((RESULTS / "net.json").read_text())["rows"]
  speedup = {(r["rate_mbit"], r["size_mb"], r["method"]): r["speedup"] for r in rows}
  m = re.search(r"fixed-capacity DynamiQ ring was ([\d.]+)x .*?\(MXFP8 ([\d.]+)x\); at 1 Gbit/s "
                r"it was ([\d.]+)x", README, re.S)
  assert m, "the network sentence moved: update this test"
  assert float(m.group(1)) == pytest.approx(speedup[(100.0, 64.0, "dynamiq/ring")], abs=0.005)
  assert float(m.group(2)) == pytest.approx(speedup[(100.0, 64.0, "mxfp8/ring")], abs=0.005)
  assert float(m.group(3)) == pytest.approx(speedup[(1000.0, 64.0, "dynamiq/ring")], abs=0.005)
