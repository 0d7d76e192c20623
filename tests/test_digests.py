"""Outputs unchanged where no change was meant: digests of tests/digests.py's cases.

``tests/data/digests.json`` records, for every codec x schedule x
implementation, a hash of ``simulate``'s outputs on fixed data. A few
representative cases run here; ``python tests/digests.py compare
tests/data/digests.json --all`` runs all of them. A change that is meant to
alter a codec's outputs re-records the file (``tests/digests.py record``)
and says so in its commit.
"""

import json
import os

import pytest

import digests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ["dynamiq5_per_round/ring/xla", "dynamiq5_per_round/hierarchical/xla", "mxfp4/ring/xla",
         "omnireduce/error_feedback/xla", "thc16/butterfly/xla", "bf16/ring/xla"]


@pytest.fixture(scope="module")
def recorded():
  with open(os.path.join(ROOT, "tests", "data", "digests.json")) as f:
    return json.load(f)["digests"]


@pytest.mark.parametrize("case", CASES)
def test_digest_unchanged(case, recorded):
  got = digests.compute(include_pallas=False, only={case})
  assert got == {case: recorded[case]}
