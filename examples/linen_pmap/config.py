"""Default settings of the Linen + pmap example; every field is also a flag of ``main.py``.

The example trains the digits CNN of ``nnx_digits`` on the same data, so it
takes the same settings with the same defaults.
"""

from __future__ import annotations

import dataclasses

from ..nnx_digits import config as digits_config


@dataclasses.dataclass(frozen=True)
class Config(digits_config.Config):
  """Digits CNN settings: those of ``examples.nnx_digits.config.Config``."""


def get_config(**overrides) -> Config:
  """The defaults, with ``overrides`` applied."""
  return dataclasses.replace(Config(), **overrides)
