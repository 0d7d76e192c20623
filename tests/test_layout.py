"""The code's layout: no import cycles and no private names used across modules.

The layers themselves are import-linter's contracts in pyproject.toml
(tests/test_codec_contract.py::test_import_rules_hold); docs/design.md shows them.
"""

import ast
import graphlib
import importlib.util
import pathlib

import grimp
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dynamiq_jax", "pallas_kernels")


def _modules():
  """Every module of the two packages: (dotted name, path)."""
  for pkg in PACKAGES:
    for path in sorted((ROOT / pkg).rglob("*.py")):
      rel = path.relative_to(ROOT).with_suffix("")
      parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
      yield ".".join(parts), path


def _private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(module: str, source: str, modules: set[str]) -> list[str]:
  """The private names of other modules of ``modules`` that ``source`` (of ``module``) uses:
  ``from m import _x``, and ``alias._x`` where ``alias`` is bound to a module ``m``
  (``import m as alias``, ``from p import m``), wherever in the file the import is."""
  is_package = any(m.startswith(module + ".") for m in modules)
  package = module if is_package else module.rpartition(".")[0]
  tree = ast.parse(source)
  found, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = importlib.util.resolve_name("." * node.level + base, package)
      if base.split(".")[0] not in PACKAGES or base == module:
        continue
      for a in node.names:
        if f"{base}.{a.name}" in modules:
          aliases[a.asname or a.name] = f"{base}.{a.name}"
        elif _private(a.name):
          found.append(f"from {base} import {a.name}")
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in PACKAGES and a.asname:
          aliases[a.asname] = a.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and aliases[node.value.id] != module and _private(node.attr)):
      found.append(f"{aliases[node.value.id]}.{node.attr}")
  return found


def test_no_private_names_cross_modules():
  modules = dict(_modules())
  bad = {m: uses for m, p in modules.items()
         if (uses := private_uses(m, p.read_text(), set(modules)))}
  assert not bad, bad


def test_private_uses_finds_what_it_should():
  """The checker above is itself checked: each form it must catch, and what it must not."""
  mods = {"dynamiq_jax.a", "dynamiq_jax.b", "dynamiq_jax"}
  assert private_uses("dynamiq_jax.a", "from dynamiq_jax.b import _x, y", mods) == [
      "from dynamiq_jax.b import _x"]
  assert private_uses("dynamiq_jax.a", "from dynamiq_jax import b\nb._x()", mods) == ["dynamiq_jax.b._x"]
  assert private_uses("dynamiq_jax.a", "def f():\n  import dynamiq_jax.b as q\n  return q._y", mods) == [
      "dynamiq_jax.b._y"]
  assert private_uses("dynamiq_jax.a", "from . import b\nb._z", mods) == ["dynamiq_jax.b._z"]
  assert private_uses("dynamiq_jax.a", "from dynamiq_jax import b\nb.x; b.__doc__; _own()", mods) == []


def _import_graph():
  graph = grimp.build_graph(*PACKAGES)
  return {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}


def test_no_import_cycles():
  """Function-level (deferred) imports count: a cycle hidden in a function is still one."""
  graph = _import_graph()
  try:
    tuple(graphlib.TopologicalSorter(graph).static_order())
  except graphlib.CycleError as e:
    pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_cycle_check_sees_deferred_imports(tmp_path, monkeypatch):
  """A cycle closed by an import inside a function is found."""
  pkg = tmp_path / "cyc"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from cyc import b\n")
  (pkg / "b.py").write_text("def f():\n  from cyc import a\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  graph = grimp.build_graph("cyc", cache_dir=None)
  edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
  with pytest.raises(graphlib.CycleError):
    tuple(graphlib.TopologicalSorter(edges).static_order())


def test_no_module_over_600_lines():
  long = {str(p.relative_to(ROOT)): n for _, p in _modules()
          if (n := len(p.read_text().splitlines())) > 600}
  assert not long, long


def test_every_module_has_a_docstring():
  missing = [str(p.relative_to(ROOT)) for _, p in _modules()
             if ast.get_docstring(ast.parse(p.read_text())) is None
             and p.name != "__init__.py" and p.stat().st_size > 0]
  assert not missing, missing
