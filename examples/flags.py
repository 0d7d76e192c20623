"""The examples' config fields and their command-line flags.

Every example's ``config.py`` is a frozen dataclass extending
:class:`ExampleConfig` (or :class:`TrainConfig`); each field made with
:func:`flag` is also a ``--name`` flag of its ``main.py``, with help text and
choices (:func:`build_parser`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Sequence

import dynamiq_jax as dq


SCHEDULES = ("ring", "butterfly")


def flag(default, help: str, choices: Callable[[], Sequence[Any]] | Sequence[Any] | None = None):
  """A config field that :func:`parse_flags` turns into ``--name``.

  A subclass gives such a field another default by declaring it again with
  a bare value (``steps: int = 400``); the flag keeps this help text.
  """
  return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)


class ExampleConfig:
  """Settings every example takes; each example's ``config.py`` extends it."""

  codec: str = flag("dynamiq", "gradient all-reduce: any name in dynamiq_jax.REDUCERS "
                    "('psum-bf16' is the uncompressed BF16 baseline)", lambda: dq.REDUCERS)
  bits: float | None = flag(None, "bits per coordinate, passed as bits= to codecs that take "
                            "a budget (default: the codec's own, 5 for DynamiQ); others ignore it")
  schedule: str = flag("ring", "all-reduce schedule of the compressed codecs", SCHEDULES)
  devices: int | None = flag(None, "data-parallel ranks (default: every local GPU when there "
                             "are several, otherwise 8 simulated CPU devices)")
  steps: int = flag(300, "training steps")
  seed: int = flag(0, "seeds the initialisation, the data order and the rounding")
  workdir: str | None = flag(None, "where metrics.json and checkpoints/ go (nothing is "
                             "written when unset); a run resumes from the latest checkpoint")
  eval_every: int = flag(100, "evaluate every this many steps (0: only at the end)")
  checkpoint_every: int = flag(0, "checkpoint every this many steps and at the end "
                               "(0: no checkpoints)")
  progress: bool = flag(True, "show a progress bar")


@dataclasses.dataclass(frozen=True)


class TrainConfig(ExampleConfig):
  """:class:`ExampleConfig` plus the batch size and the :func:`make_optimizer` settings.

  An example's ``Config`` extends it and sets its own defaults by declaring
  a field again, e.g. ``warmup_steps: int = 40``.
  """

  batch_size: int = flag(256, "global batch size (split over the devices)")
  learning_rate: float = flag(3e-3, "peak AdamW learning rate")
  warmup_steps: int = flag(20, "linear warm-up steps before the cosine decay")
  weight_decay: float = flag(1e-4, "AdamW weight decay")


def _parser_for(type_name: str):
  base = type_name.replace(" | None", "").strip()
  parse = {"int": int, "float": float, "str": str}[base]
  if "None" not in type_name:
    return parse
  return lambda text: None if text.lower() in ("none", "") else parse(text)


def _flag_metadata(cls: type, name: str) -> dict:
  """Help and choices of field ``name``: from the nearest class declaring it with :func:`flag`."""
  for klass in cls.__mro__:
    field = getattr(klass, "__dataclass_fields__", {}).get(name)
    if field is not None and "help" in field.metadata:
      return field.metadata
  return {}


def build_parser(default: ExampleConfig, *, prog: str | None = None,
                 description: str | None = None,
                 required: Sequence[str] = ()) -> argparse.ArgumentParser:
  """The command-line flags of a config, one ``--name`` per config field.

  ``--help`` shows each flag's meaning and default.

  Args:
    default: the defaults (an :class:`ExampleConfig` subclass instance).
    prog: program name for ``--help``.
    description: text for ``--help``.
    required: fields that must be given on the command line.
  """
  parser = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for field in dataclasses.fields(default):
    value = getattr(default, field.name)
    names = [f"--{field.name}"]
    if "_" in field.name:
      names.append(f"--{field.name.replace('_', '-')}")
    help_text = _flag_metadata(type(default), field.name).get("help", "")
    if field.type == "bool":
      parser.add_argument(*names, dest=field.name, default=value, help=help_text,
                          action=argparse.BooleanOptionalAction)
      continue
    choices = _flag_metadata(type(default), field.name).get("choices")
    choices = choices() if callable(choices) else choices
    is_required = field.name in required
    parser.add_argument(*names, dest=field.name, type=_parser_for(field.type),
                        default=argparse.SUPPRESS if is_required else value,
                        required=is_required, choices=tuple(choices) if choices else None,
                        help=help_text)
  return parser


def parse_flags(default: ExampleConfig, argv: Sequence[str] | None = None) -> ExampleConfig:
  """Builds a config from command-line flags (:func:`build_parser`).

  Args:
    default: the defaults (an :class:`ExampleConfig` subclass instance).
    argv: the arguments (default ``sys.argv[1:]``).

  Returns:
    ``default`` with the given flags replaced.
  """
  return dataclasses.replace(default, **vars(build_parser(default).parse_args(argv)))


def validate(config: ExampleConfig) -> None:
  """Checks the settings every example shares.

  Raises:
    ValueError: naming the setting and the values it can take.
  """
  if config.codec not in dq.REDUCERS:
    raise ValueError(
        f"codec={config.codec!r} is not one of dynamiq_jax.REDUCERS={list(dq.REDUCERS)}")
  if config.schedule not in SCHEDULES:
    raise ValueError(f"schedule={config.schedule!r} must be one of {SCHEDULES}")
  if config.steps < 1:
    raise ValueError(f"steps={config.steps} must be >= 1")
  if config.devices is not None and config.devices < 1:
    raise ValueError(f"devices={config.devices} must be >= 1 (or None for the default)")
  for name in ("eval_every", "checkpoint_every"):
    if getattr(config, name) < 0:
      raise ValueError(f"{name}={getattr(config, name)} must be >= 0")


def example_parser(get_config: Callable[[], ExampleConfig], *, prog: str,
                   doc: str) -> argparse.ArgumentParser:
  """The flags of an example's ``main.py``: its config's fields, ``--workdir`` required.

  Args:
    get_config: the example's ``config.get_config`` (the flags' defaults).
    prog: program name for ``--help``.
    doc: the ``main.py`` docstring; its first line describes the program in ``--help``.
  """
  return build_parser(get_config(), prog=prog, description=doc.split("\n")[0],
                      required=("workdir",))
