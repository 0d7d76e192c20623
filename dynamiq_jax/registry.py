"""Names for gradient reductions, for command-line flags and benchmarks.

    tx = optax.chain(dq.reducer("dynamiq", "data", bits=5), optax.adamw(1e-3))

``reducer(name, axis_name, **options)`` returns the optax transform that
all-reduces gradients over ``axis_name``; :data:`REDUCERS` lists the names.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import optax

from dynamiq_jax import codecs
from dynamiq_jax.schedules.moshpit import Moshpit

__all__ = ["REDUCERS", "TP_CODECS", "reducer", "codec_from_name", "tp_codec_from_name",
           "moshpit_options", "resolve_codec"]


def _dynamiq(bits=5.0, **kw):
  return codecs.DynamiQ(bits=bits, **kw)


_CODECS: dict[str, Callable[..., object]] = {
    "dynamiq": _dynamiq,
    "bf16-ring": lambda **kw: codecs.Bf16(**kw),
    "f32-ring": lambda **kw: codecs.F32(**kw),
    "mxfp8": lambda **kw: codecs.MX(element="e4m3", **kw),
    "mxfp6": lambda **kw: codecs.MX(element="e3m2", **kw),
    "mxfp4": lambda **kw: codecs.MX(element="e2m1", **kw),
    "mxfp8-ocp": lambda **kw: codecs.MX(element="e4m3", scale="e8m0", **kw),
    "thc": lambda **kw: codecs.THC(**kw),
    "thc120": lambda **kw: codecs.THC(levels=120, **kw),
    "omnireduce": lambda **kw: codecs.OmniReduce(**kw),
    "globalqsgd": lambda **kw: codecs.GlobalQSGD(**kw),
    "arc-topk": lambda **kw: codecs.ARCTopK(**kw),
    "int8": lambda **kw: codecs.IntGroup(bits=8, **kw),
    "int4": lambda **kw: codecs.IntGroup(bits=4, **kw),
}

_TP_CODECS: dict[str, str] = {  # tp codec name -> its name in _CODECS
    "bf16": "bf16-ring",
    "int8": "int8",
    "int4": "int4",
    "dynamiq": "dynamiq",
    "mxfp8": "mxfp8-ocp",  # stateless E8M0 scales: tp_psum cannot carry MX's adaptive state
}

_PSUMS = {
    "psum-bf16": jnp.bfloat16,
    "psum-f32": jnp.float32,
}

_MOSHPIT_OPTIONS = tuple(f.name for f in dataclasses.fields(Moshpit))

REDUCERS = tuple(sorted(_PSUMS)) + tuple(sorted(_CODECS)) + ("moshpit",)
"""Every name :func:`reducer` accepts."""


TP_CODECS = ("none",) + tuple(_TP_CODECS)
"""The names :func:`tp_codec_from_name` accepts: ``"none"`` (``jax.lax.psum``)."""


def tp_codec_from_name(name: str):
  """The codec of :func:`dynamiq_jax.tp_psum` called ``name`` (None for ``"none"``:
  ``jax.lax.psum``): ``"int8"`` / ``"int4"`` (Flash Communication's, groups of 128),
  ``"dynamiq"`` (5 bits), ``"mxfp8"`` (E4M3, E8M0 block scales: stateless), ``"bf16"``
  (uncompressed bf16 partial sums through the same schedule, for comparison)."""
  if name == "none":
    return None
  try:
    return codec_from_name(_TP_CODECS[name])
  except KeyError:
    raise ValueError(f"tp codec {name!r} is not one of {TP_CODECS}") from None


def codec_from_name(name: str, **options):
  """The codec registered as ``name`` (e.g. ``"dynamiq"``), built with ``options``."""
  try:
    make = _CODECS[name]
  except KeyError:
    raise ValueError(f"codec {name!r} is not one of {sorted(_CODECS)}") from None
  return make(**options)


def resolve_codec(codec, default=None, *, what: str = "codec"):
  """``codec`` as a codec object: every front door's one resolver of ``codec=``.

  Args:
    codec: a :class:`~dynamiq_jax.codecs.Codec`, a name of :func:`codec_from_name`
      (``"dynamiq"``, ``"int8"``, ``"mxfp8-ocp"``, ...: the names of
      :func:`reducer`, built with their defaults), or None.
    default: what None means (a codec, or None where ``codec=`` is required).
    what: the argument, for the message (e.g. ``"allreduce(codec=...)"``).

  Returns:
    The codec.

  Raises:
    ValueError: an unknown name (the message lists the names).
    TypeError: anything else that is not a codec.
  """
  if codec is None:
    codec = default
  if isinstance(codec, str):
    if codec not in _CODECS:
      raise ValueError(f"{what}: codec={codec!r} is not one of {sorted(_CODECS)}. Fix: one "
                       f"of those names, or a codec object, e.g. dq.codecs.DynamiQ(bits=5)")
    return codec_from_name(codec)
  if not isinstance(codec, codecs.Codec):
    raise TypeError(f"{what}: codec={codec!r} is neither a codec name nor a dynamiq_jax "
                    f"codec. Fix: a name from {sorted(_CODECS)} (e.g. codec='int8'), a codec "
                    f"object (e.g. dq.codecs.DynamiQ(bits=5)), or a subclass of "
                    f"dq.codecs.Codec")
  return codec


def moshpit_options(options: dict):
  """``reducer("moshpit", **options)``'s parts: ``(dq.Moshpit(...), codec name, the codec's
  options)``."""
  options = dict(options)
  schedule = Moshpit(**{k: options.pop(k) for k in _MOSHPIT_OPTIONS if k in options})
  name = options.pop("codec", "dynamiq")
  if name not in _CODECS:
    raise ValueError(f"reducer 'moshpit': codec={name!r} is not one of {sorted(_CODECS)}")
  return schedule, name, options


def reducer(name: str, axis_name="data", *, schedule: str = "ring", seed: int = 0,
            average: bool = True, implementation=None, error_feedback=None,
            ef21m_momentum: float = 0.5, **options) -> optax.GradientTransformationExtraArgs:
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
      ``"globalqsgd"``, ``"arc-topk"`` (ARC-Top-K, EF21-M by default),
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
  from dynamiq_jax.train import baseline_psum  # train and transform resolve codecs here
  from dynamiq_jax.transform import compressed_psum

  if name in _PSUMS:
    if options:
      raise ValueError(f"reducer {name!r} takes no codec options, got {sorted(options)}")
    return baseline_psum(axis_name, dtype=_PSUMS[name], average=average)
  if name == "moshpit":
    if schedule != "ring":
      raise ValueError(f"reducer 'moshpit' is a schedule; got schedule={schedule!r} too. Fix: "
                       f"leave schedule out and pass the grid's options (grid=, dropout=, ...)")
    schedule, name, options = moshpit_options(options)
  if name not in _CODECS:
    raise ValueError(f"reducer {name!r} is not one of {list(REDUCERS)}")
  return compressed_psum(axis_name, codec=codec_from_name(name, **options), schedule=schedule,
                         average=average, seed=seed, implementation=implementation,
                         error_feedback=error_feedback, ef21m_momentum=ef21m_momentum)
