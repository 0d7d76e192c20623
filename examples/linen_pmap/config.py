"""Default settings of the Linen + pmap example; every field is also a flag of ``main.py``.

The example trains the CNN of ``nnx_digits`` without its BatchNorm and Dropout,
on the same data, so it takes the same settings with the same defaults, less
``dropout``.
"""

from __future__ import annotations

import dataclasses

from ..flags import TrainConfig
from ..flags import flag


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
  """Digits CNN settings: those of ``examples.nnx_digits.config.Config`` but ``dropout``."""

  features: int = flag(32, "channels of the first convolution (the second has twice as many)")
  hidden: int = flag(128, "width of the dense layer")
  test_fraction: float = flag(0.25, "share of the 1,797 digits held out for testing")
  # Shared settings with this example's defaults (the others keep TrainConfig's:
  # 300 steps, batch 256, learning rate 3e-3, 20 warm-up steps, weight decay 1e-4).
  eval_every: int = 50


def get_config(**overrides) -> Config:
  """The defaults, with ``overrides`` applied."""
  return dataclasses.replace(Config(), **overrides)
