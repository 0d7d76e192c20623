"""Default settings of the digits example; every field is also a flag of ``main.py``."""

from __future__ import annotations

import dataclasses

from ..flags import TrainConfig
from ..flags import flag


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
  """Digits CNN settings (``TrainConfig`` holds the shared ones and their defaults)."""

  features: int = flag(32, "channels of the first convolution (the second has twice as many)")
  hidden: int = flag(128, "width of the dense layer")
  dropout: float = flag(0.1, "dropout rate before the last dense layer (0: none)")
  test_fraction: float = flag(0.25, "share of the 1,797 digits held out for testing")
  # Shared settings with this example's defaults (the others keep TrainConfig's:
  # 300 steps, batch 256, learning rate 3e-3, 20 warm-up steps, weight decay 1e-4).
  eval_every: int = 50


def get_config(**overrides) -> Config:
  """The defaults, with ``overrides`` applied."""
  return dataclasses.replace(Config(), **overrides)
