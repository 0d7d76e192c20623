"""Outputs unchanged where no change was meant: digests of tests/digests.py's cases.

``tests/data/digests.json`` records, for every codec x schedule x
implementation, a hash of ``simulate``'s outputs on fixed data. A few
representative cases run here, in one child process that compiles as a user's
job does (without the flags conftest.py adds for the tests' speed, which change
some roundings); ``python tests/digests.py compare tests/data/digests.json
--all`` runs all of them. A change that is meant to
alter a codec's outputs re-records the file (``tests/digests.py record``)
and says so in its commit.
"""

import json
import os
import subprocess
import sys

import pytest

from dynamiq_jax.bench import common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ["dynamiq5_lattice/ring/xla", "dynamiq6_lattice_indep_stoch_248/butterfly/xla",
         "dynamiq5_per_round/ring/xla", "dynamiq5_per_round/hierarchical/xla", "mxfp4/ring/xla",
         "omnireduce/error_feedback/xla", "thc16/butterfly/xla", "bf16/ring/xla"]


@pytest.fixture(scope="module")
def recorded():
  with open(os.path.join(ROOT, "tests", "data", "digests.json")) as f:
    return json.load(f)["digests"]


def user_xla_flags() -> str:
  """XLA_FLAGS without the ones conftest.py adds for the tests (DYNAMIQ_TEST_XLA_FLAGS)."""
  test_only = tuple(os.environ.get("DYNAMIQ_TEST_XLA_FLAGS", "").split())
  return " ".join(common.xla_flags_less(os.environ, *test_only))


@pytest.fixture(scope="module")
def computed():
  """``{case: digest}`` from ``tests/digests.py compare --only`` in a child process that
  compiles with the user's XLA flags."""
  env = dict(os.environ, XLA_FLAGS=user_xla_flags())
  res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "digests.py"), "compare",
                        os.path.join(ROOT, "tests", "data", "digests.json"), "--only",
                        ",".join(CASES)], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=600, check=False)
  got = {}
  for line in res.stdout.splitlines():  # "same    name digest (recorded ...)" or "DIFFERS ..."
    words = line.split()
    if len(words) >= 3 and words[0] in ("same", "DIFFERS"):
      got[words[1]] = words[2]
  assert set(got) == set(CASES), res.stdout + res.stderr
  return got


def test_the_child_compiles_without_the_test_flags():
  assert "--xla_backend_optimization_level=0" in os.environ["DYNAMIQ_TEST_XLA_FLAGS"]
  assert "--xla_backend_optimization_level=0" in os.environ["XLA_FLAGS"]
  assert "--xla_backend_optimization_level=0" not in user_xla_flags()


@pytest.mark.parametrize("case", CASES)
def test_digest_unchanged(case, recorded, computed):
  assert computed[case] == recorded[case]
