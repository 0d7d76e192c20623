"""The examples' gradient all-reduce: the codec's options, the optimizer, the wire."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import numpy as np
import optax

import dynamiq_jax as dq
from .flags import ExampleConfig
from .flags import TrainConfig


def _bits_field(codec_name: str):
  """The ``bits`` init field of the codec named ``codec_name``, or None."""
  try:
    codec = dq.codec_from_name(codec_name)
  except ValueError:
    return None  # the psum-* reducers have no codec and no options
  if dataclasses.is_dataclass(codec):
    return next((f for f in dataclasses.fields(codec) if f.init and f.name == "bits"), None)
  return inspect.signature(type(codec)).parameters.get("bits")


def reducer_options(config: ExampleConfig) -> dict:
  """Codec options from the flags: ``bits=`` for codecs that take a budget.

  Codecs without a ``bits`` setting (and the ``psum-*`` reducers) ignore
  ``config.bits``; the metrics record the options actually used.

  Raises:
    ValueError: if the codec takes whole bits and ``config.bits`` is not whole.
  """
  if config.bits is None:
    return {}
  field = _bits_field(config.codec)
  if field is None:
    return {}
  kind = str(getattr(field, "type", getattr(field, "annotation", "")))
  if "int" in kind and "float" not in kind:
    if not float(config.bits).is_integer():
      raise ValueError(f"codec {config.codec!r} takes whole bits; got bits={config.bits}")
    return {"bits": int(config.bits)}
  return {"bits": config.bits}


def make_reducer(config: ExampleConfig, axis_name: str = "data"):
  """The optax transform that all-reduces gradients as ``config.codec`` says.

  Goes through :func:`dynamiq_jax.reducer`, so every name in
  ``dynamiq_jax.REDUCERS`` works, including ones added after this example.
  """
  return dq.reducer(config.codec, axis_name, schedule=config.schedule, seed=config.seed,
                    **reducer_options(config))


def make_optimizer(config: TrainConfig, axis_name: str = "data", *,
                   final_lr_fraction: float = 0.0, **adamw) -> optax.GradientTransformation:
  """The gradient all-reduce named by ``config.codec``, then AdamW with warm-up + cosine.

  The learning rate rises linearly from 0 to ``config.learning_rate`` over
  ``config.warmup_steps`` (at most ``steps - 1``), then follows a cosine
  down to ``final_lr_fraction * config.learning_rate`` at ``config.steps``.

  Args:
    config: the run's settings.
    axis_name: the data-parallel axis the all-reduce runs over.
    final_lr_fraction: the learning rate at the end, as a share of the peak.
    **adamw: more ``optax.adamw`` options (e.g. ``b2``).
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, min(config.warmup_steps, config.steps - 1), config.steps,
      end_value=final_lr_fraction * config.learning_rate)
  return optax.chain(make_reducer(config, axis_name),
                     optax.adamw(schedule, weight_decay=config.weight_decay, **adamw))


def make_codec(config: ExampleConfig):
  """The codec ``config.codec`` names, with :func:`reducer_options`; None for ``psum-*``."""
  try:
    return dq.codec_from_name(config.codec, **reducer_options(config))
  except ValueError:
    return None  # the psum-* reducers have no codec


_PSUM_BITS = {"bf16": 16, "f16": 16, "fp16": 16, "f32": 32, "fp32": 32}


def wire_report(config: ExampleConfig, params, n: int) -> dict:
  """Bits per coordinate and bytes each rank sends per all-reduce of ``params``.

  Compressed codecs are measured with :func:`dynamiq_jax.wire_stats`; an
  XLA ``psum-<dtype>`` is taken as a ring all-reduce of that dtype, which
  sends ``2 (n-1)/n`` of the payload per rank. Unknown psum names give
  ``None``.
  """
  coords = int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))
  bf16_bytes = 2.0 * coords * 2 * (n - 1) / n
  codec = make_codec(config)
  if codec is not None:
    stats = dq.wire_stats(params, codec=codec, n=n)
    bits, sent = float(stats.bits_per_coord), float(stats.bytes_per_rank)
  else:
    bits = _PSUM_BITS.get(config.codec.split("-", 1)[-1])
    sent = None if bits is None else bits / 8 * coords * 2 * (n - 1) / n
  return {"coords": coords, "bits_per_coord": bits, "bytes_per_rank_per_step": sent,
          "vs_bf16": None if sent is None or n == 1 else sent / bf16_bytes}
