"""tools/mutations.py's list stays current: every planted bug still applies to the code
and names tests that exist (running the mutations themselves is the tool's job)."""

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool():
  spec = importlib.util.spec_from_file_location("mutations", ROOT / "tools" / "mutations.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


MUTATIONS = _tool().MUTATIONS


def test_names_are_unique():
  names = [m.name for m in MUTATIONS]
  assert len(names) == len(set(names)) and len(names) >= 10


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_and_still_parses(m):
  source = (ROOT / m.path).read_text()
  assert source.count(m.old) == 1, f"{m.name}: its snippet is not in {m.path} exactly once"
  ast.parse(source.replace(m.old, m.new))
  assert m.new != m.old


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_tests_that_exist(m):
  """Each node id's file exists and defines its test (and class), so a renamed test
  makes the list fail here instead of reporting a mutation 'killed' by a collection
  error."""
  for node in m.tests:
    path, *parts = node.split("::")
    tree = ast.parse((ROOT / path).read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    for part in parts:
      assert part.split("[")[0] in names, f"{m.name}: {node} not found"
