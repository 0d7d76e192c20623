"""``tools/level_sets.py`` at its smoke-test size: both level sets on every family."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "level_sets.py"
_SPEC = importlib.util.spec_from_file_location("level_sets", _PATH)
level_sets = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(level_sets)


def test_both_level_sets_on_every_family(tmp_path):
  rows = level_sets.main(["--tiny", "--cache", "", "--json", str(tmp_path / "out.json")])
  assert {r["family"].split("/")[0].split("@")[0] for r in rows} == {"iid", "lm-word"}
  for r in rows:
    assert 0 < r["mee"] < 1 and 0 < r["lattice"] < 1
    assert np.isclose(r["ratio"], r["lattice"] / r["mee"])
  assert (tmp_path / "out.json").exists()
