"""Default settings of the character-level LM example; every field is also a flag of ``main.py``."""

from __future__ import annotations

import dataclasses

from ..flags import TrainConfig
from ..flags import flag


@dataclasses.dataclass(frozen=True)
class Config(TrainConfig):
  """Byte-level decoder-only transformer settings (``TrainConfig`` holds the shared ones)."""

  batch_size: int = flag(64, "global batch size in sequences (split over the devices)")
  context: int = flag(64, "sequence length in bytes")
  dim: int = flag(128, "model width")
  heads: int = flag(4, "attention heads")
  layers: int = flag(2, "transformer blocks")
  mlp_ratio: int = flag(4, "MLP hidden width / model width")
  corpus_bytes: int = flag(4_000_000, "bytes of standard-library source to read")
  held_out_every: int = flag(10, "one source file in this many is held out")
  eval_windows: int = flag(512, "held-out windows of --context bytes in the evaluation set")
  # Shared settings with this example's defaults (the others keep TrainConfig's:
  # learning rate 3e-3, evaluation every 100 steps).
  steps: int = 400
  warmup_steps: int = 40
  weight_decay: float = 0.01


def get_config(**overrides) -> Config:
  """The defaults, with ``overrides`` applied."""
  return dataclasses.replace(Config(), **overrides)
