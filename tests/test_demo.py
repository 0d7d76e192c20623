"""The main job runs end to end, as the README runs it, and prints what the README shows."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rows(text):
  return {" ".join(l.split()[:2]): l.split() for l in text.splitlines()
          if l.startswith(("psum BF16", "DynamiQ"))}


def test_demo_prints_the_readme_table():
  # as a user's shell runs it: without the suite's CPU compile flags (the root conftest.py)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-m", "dynamiq_jax.demo"],  # the README's command
                       capture_output=True, text=True, env=env, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = _rows(out.stdout)
  assert set(rows) == {"psum BF16", "DynamiQ 5-bit"}
  assert float(rows["DynamiQ 5-bit"][-4]) <= 5.0
  assert float(rows["psum BF16"][-4]) == 16.0
  # the codec's own error estimate: a 5-bit codec adds a small, non-zero error
  assert rows["psum BF16"][-1] == "-"
  assert 1e-5 < float(rows["DynamiQ 5-bit"][-1]) < 0.1

  readme = (ROOT / "README.md").read_text()
  shown = re.search(r"```\n(Digits MLP.*?)```", readme, re.S).group(1)
  printed = out.stdout[out.stdout.index("Digits MLP"):]
  assert shown.splitlines()[:2] == printed.splitlines()[:2], "README's demo header is stale"
  for name, cells in _rows(shown).items():
    got = rows[name]
    # bits, bytes and their ratio are exact; losses and accuracies are the run's
    assert cells[-4:-1] == got[-4:-1], (name, cells, got)
    assert abs(float(cells[-7]) - float(got[-7])) <= 2e-3, (name, cells, got)
    assert abs(float(cells[-6].rstrip("%")) - float(got[-6].rstrip("%"))) <= 1.0, (name, cells, got)
