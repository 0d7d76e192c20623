"""Every command-line program's ``--help`` gives each flag's meaning and default."""

import argparse
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cli_modules() -> list[str]:
  """Every module with a ``__main__`` block: the package's, the benchmarks', the examples'."""
  files = (sorted((ROOT / "dynamiq_jax").rglob("*.py"))
           + sorted((ROOT / "examples").glob("*/main.py")))
  return [".".join(f.relative_to(ROOT).with_suffix("").parts) for f in files
          if 'if __name__ == "__main__":' in f.read_text()]


CLI_MODULES = _cli_modules()


def test_the_programs_are_found():
  assert {"dynamiq_jax.demo", "dynamiq_jax.training.multiprocess", "dynamiq_jax.bench.train",
          "examples.nnx_digits.main"} <= set(CLI_MODULES)


def _help_entries(help_text: str) -> dict[str, str]:
  """Each option string of a rendered ``--help`` -> its entry (invocation and help text)."""
  entries, current = {}, None
  for line in help_text.splitlines():
    if line.startswith("  -"):  # an option's invocation starts an entry
      current = [line]
      for word in line.strip().split("  ")[0].replace(",", " ").split():
        if word.startswith("-"):
          entries[word] = current
    elif current is not None and line.startswith("   "):
      current.append(line)  # its help, when it continues or starts on the next line
    else:
      current = None
  return {option: " ".join(" ".join(lines).split()) for option, lines in entries.items()}


@pytest.mark.parametrize("module", CLI_MODULES)
def test_every_flag_has_help_and_a_default(module, monkeypatch):
  monkeypatch.setenv("COLUMNS", "400")  # one line per option where it fits
  parser = importlib.import_module(module).build_parser()
  assert isinstance(parser, argparse.ArgumentParser)
  entries = _help_entries(parser.format_help())
  for action in parser._actions:
    if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
      continue
    option = action.option_strings[0]
    assert action.help and action.help.strip(), f"{module}: {option} has no help text"
    if action.required:
      continue  # no default to show
    assert "(default: " in entries[option], (
        f"{module}: {option} does not show its default: {entries[option]!r}")
