"""Names for gradient reductions, for command-line flags and benchmarks.

    tx = optax.chain(dq.reducer("dynamiq", "data", bits=5), optax.adamw(1e-3))

``reducer(name, axis_name, **options)`` returns the optax transform that
all-reduces gradients over ``axis_name``; :data:`REDUCERS` lists the names.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import optax

from dynamiq_jax.codec_names import CODEC_NAMES
from dynamiq_jax.codec_names import TP_CODECS
from dynamiq_jax.codec_names import codec_from_name
from dynamiq_jax.codec_names import resolve_codec
from dynamiq_jax.codec_names import tp_codec_from_name
from dynamiq_jax.schedules.moshpit import Moshpit
from dynamiq_jax.training.train import baseline_psum
from dynamiq_jax.api.transform import compressed_psum

__all__ = ["REDUCERS", "TP_CODECS", "reducer", "codec_from_name", "tp_codec_from_name",
           "moshpit_options", "resolve_codec"]


_PSUMS = {
    "psum-bf16": jnp.bfloat16,
    "psum-f32": jnp.float32,
}

_MOSHPIT_OPTIONS = tuple(f.name for f in dataclasses.fields(Moshpit))

REDUCERS = tuple(sorted(_PSUMS)) + CODEC_NAMES + ("moshpit",)
"""Every name :func:`reducer` accepts."""


def moshpit_options(options: dict):
  """``reducer("moshpit", **options)``'s parts: ``(dq.Moshpit(...), codec name, the codec's
  options)``."""
  options = dict(options)
  schedule = Moshpit(**{k: options.pop(k) for k in _MOSHPIT_OPTIONS if k in options})
  name = options.pop("codec", "dynamiq")
  if name not in CODEC_NAMES:
    raise ValueError(f"reducer 'moshpit': codec={name!r} is not one of {list(CODEC_NAMES)}")
  return schedule, name, options


def reducer(name: str, axis_name="data", *, schedule: str = "ring", seed: int = 0,
            average: bool = True, implementation=None, error_feedback=None,
            ef21m_momentum: float | None = None, **options) -> optax.GradientTransformationExtraArgs:
  """The gradient all-reduce called ``name`` as an optax transform.

  Args:
    name: ``"psum-bf16"`` / ``"psum-f32"`` (XLA's all-reduce of gradients cast
      to that dtype), ``"moshpit"`` (Moshpit averaging, ``dq.Moshpit``: the options
      ``grid``, ``rounds``, ``dropout``, ``shuffle``, ``inner`` are the schedule's,
      ``codec="dynamiq"`` names the codec inside the groups, the other options are
      that codec's), or a codec name run through
      :func:`dynamiq_jax.compressed_psum`: ``"dynamiq"``, ``"mxfp8"``,
      ``"mxfp6"``, ``"mxfp4"`` (the paper's adaptation), ``"mxfp8-ocp"``
      (E8M0 scales), ``"thc"`` (16 levels), ``"thc120"``, ``"omnireduce"``,
      ``"globalqsgd"``, ``"arc-topk"`` (ARC-Top-K, EF14 by default),
      ``"int8"``, ``"int4"`` (``codecs.IntGroup``, groups of 128),
      ``"bf16-ring"``, ``"f32-ring"``.
    axis_name: the data-parallel axis.
    schedule, seed, average, implementation, error_feedback, ef21m_momentum: as for
      ``compressed_psum`` (ignored by the ``psum-*`` reducers, except
      ``average``).
    **options: codec options, e.g. ``bits=4`` for DynamiQ, ``levels=120``
      for THC.

  Examples:
    >>> import dynamiq_jax as dq
    >>> tx = dq.reducer("dynamiq", "data", bits=4)
    >>> tx = dq.reducer("moshpit", "data", grid=(2, 2), dropout=0.1, bits=5)
  """
  if name in _PSUMS:
    if options:
      raise ValueError(f"reducer {name!r} takes no codec options, got {sorted(options)}")
    return baseline_psum(axis_name, dtype=_PSUMS[name], average=average)
  if name == "moshpit":
    if schedule != "ring":
      raise ValueError(f"reducer 'moshpit' is a schedule; got schedule={schedule!r} too. Fix: "
                       f"leave schedule out and pass the grid's options (grid=, dropout=, ...)")
    schedule, name, options = moshpit_options(options)
  if name not in CODEC_NAMES:
    raise ValueError(f"reducer {name!r} is not one of {list(REDUCERS)}")
  return compressed_psum(axis_name, codec=codec_from_name(name, **options), schedule=schedule,
                         average=average, seed=seed, implementation=implementation,
                         error_feedback=error_feedback, ef21m_momentum=ef21m_momentum)
