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


def test_results_table_is_the_measured_one():
  from dynamiq_jax.bench import tta
  summary = json.loads((RESULTS / "tta.json").read_text())["summary"]
  assert tta.markdown(summary, tta.README_CODECS) in README, (
      "the README's TTA table is not tta.json's: paste the README's rows that "
      "`python -m dynamiq_jax.bench.tta --phases ''` prints")
  results = (ROOT / "docs" / "results.md").read_text()
  assert tta.markdown(summary) in results, "docs/results.md's TTA table is not tta.json's"
  rows = summary["codecs"]
  speed = lambda label, rate: rows[label]["rates"][rate]["speedup_vs_bf16"]
  text = " ".join(README.split())
  m = re.search(r"DynamiQ 5b reaches the target ([\d.]+)x sooner than BF16 \(4 bits: ([\d.]+)x\)"
                r".*? ends ([\d.]+)% above BF16's eval loss; at 1 Gbit/s .*? \(([\d.]+)x; "
                r"MXFP8 ([\d.]+)x\)", text)
  assert m, "the TTA sentence moved: update this test"
  assert float(m.group(1)) == pytest.approx(speed("DynamiQ 5b", "100.0"), abs=0.005)
  assert float(m.group(2)) == pytest.approx(speed("DynamiQ 4b", "100.0"), abs=0.005)
  assert float(m.group(3)) == pytest.approx(100 * rows["DynamiQ 5b"]["final_vs_bf16"], abs=0.005)
  assert float(m.group(4)) == pytest.approx(speed("DynamiQ 5b", "1000.0"), abs=0.005)
  assert float(m.group(5)) == pytest.approx(speed("MXFP8", "1000.0"), abs=0.005)
  m = re.search(r"ARC-Top-K 0.2 \(([\d.]+) bits\) ends ([\d.]+)% above BF16 here, Top-K with an "
                r"all-gather ([\d.]+)% below at ([\d.]+) bits, ([\d.]+)x", text)
  assert m, "the sparsifiers' sentence moved: update this test"
  arc, topk = rows["ARC-Top-K 0.2"], rows["Top-K 0.1 (all-gather)"]
  assert float(m.group(1)) == pytest.approx(arc["bits_per_coord"], abs=0.05)
  assert float(m.group(2)) == pytest.approx(100 * arc["final_vs_bf16"], abs=0.05)
  assert -float(m.group(3)) == pytest.approx(100 * topk["final_vs_bf16"], abs=0.05)
  assert float(m.group(4)) == pytest.approx(topk["bits_per_coord"], abs=0.05)
  assert float(m.group(5)) == pytest.approx(speed("Top-K 0.1 (all-gather)", "100.0"), abs=0.005)
  assert all(summary["real_check"]["codecs"]["DynamiQ 5b"]["same_as_simulated"])


def _close(text, value):
  """``text`` is ``value`` to the 3 significant digits it shows."""
  return abs(float(text) - value) <= 0.005 * abs(value) + 1e-12


def test_network_figures_are_the_measured_ones():
  """docs/results.md's network table (and its summary row) against net_64mb/net.json."""
  rows = json.loads((RESULTS / "net_64mb" / "net.json").read_text())["rows"]
  speedup = {(r["rate_mbit"], r["size_mb"], r["method"]): r["speedup"] for r in rows}
  results = (ROOT / "docs" / "results.md").read_text()
  for label, method in (("DynamiQ 5b", "dynamiq/ring"), ("DynamiQ 4b", "dynamiq4/ring"),
                        ("MXFP8", "mxfp8/ring")):
    m = re.search(r"^\| " + re.escape(label) + r" \| [^|]+ \| \**([\d.]+)x\** \| \**([\d.]+)x",
                  results, re.M)
    assert m, f"results.md's network row of {label} moved: update this test"
    for got, rate in zip(m.groups(), (100.0, 1000.0)):
      assert float(got) == pytest.approx(speedup[(rate, 64.0, method)], abs=0.005), (label, rate)
  m = re.search(r"DynamiQ 5b ([\d.]+)x faster than `psum` of bf16 at 100 Mbit/s, ([\d.]+)x at "
                r"1 Gbit/s", results)
  assert m, "results.md's network summary moved: update this test"
  assert float(m.group(1)) == pytest.approx(speedup[(100.0, 64.0, "dynamiq/ring")], abs=0.005)
  assert float(m.group(2)) == pytest.approx(speedup[(1000.0, 64.0, "dynamiq/ring")], abs=0.005)


def test_the_tested_versions_agree():
  """pyproject's jax range, the version .ci/run pins for its oldest run, and the README's
  set-up line name the same ends."""
  low, cap = re.search(r'"jax>=([\d.]+),<([\d.]+)"',
                       (ROOT / "pyproject.toml").read_text()).groups()
  ci = (ROOT / ".ci" / "run").read_text()
  assert re.search(r"^OLDEST_JAX=([\d.]+)", ci, re.M).group(1) == low
  oldest, newest = re.search(r"Python 3\.11 \(jax ([\d.]+)\) and 3\.13 \(jax ([\d.]+)\)",
                             README).groups()
  version = lambda v: tuple(int(p) for p in v.split("."))
  assert oldest == low and version(low) <= version(newest) < version(cap)
