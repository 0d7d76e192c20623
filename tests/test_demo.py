"""The main job runs end to end (tiny size) in its own process."""

import os
import subprocess
import sys


def test_demo_prints_the_comparison_table():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "dynamiq_jax.demo", "--steps", "30"],
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.splitlines()
  rows = {l.split()[0] + " " + l.split()[1]: l.split() for l in lines
          if l.startswith(("psum BF16", "DynamiQ"))}
  assert set(rows) == {"psum BF16", "DynamiQ 5-bit"}
  bits = float(rows["DynamiQ 5-bit"][-4])
  assert bits <= 5.0
  assert float(rows["psum BF16"][-4]) == 16.0
  # the codec's own error estimate: a 5-bit codec adds a small, non-zero error
  assert rows["psum BF16"][-1] == "-"
  assert 1e-5 < float(rows["DynamiQ 5-bit"][-1]) < 0.1
