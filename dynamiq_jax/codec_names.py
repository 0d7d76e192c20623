"""Codec names: the one resolver of ``codec=`` for every front door, and ``dq.reducer``'s.

    dq.compressed_psum("data", codec="int8")     # the same as codec=dq.codecs.IntGroup(bits=8)

:func:`resolve_codec` turns a name (:data:`CODEC_NAMES`) into the codec it names, built
with its defaults; :func:`codec_from_name` builds one with options. Below the collectives
in the layers (it imports only the codecs), so ``allreduce``, ``reduce_scatter``,
``tp_psum``, ``simulate`` and the transforms resolve names here, as ``dq.reducer`` does.
"""

from __future__ import annotations

from typing import Callable

from dynamiq_jax import codecs

__all__ = ["CODEC_NAMES", "TP_CODECS", "codec_from_name", "tp_codec_from_name",
           "resolve_codec"]


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

CODEC_NAMES = tuple(sorted(_CODECS))
"""Every name :func:`codec_from_name` and :func:`resolve_codec` accept."""


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
    raise ValueError(f"codec {name!r} is not one of {CODEC_NAMES}") from None
  return make(**options)


def resolve_codec(codec, default=None, *, what: str = "codec"):
  """``codec`` as a codec object: every front door's one resolver of ``codec=``.

  Args:
    codec: a :class:`~dynamiq_jax.codecs.Codec`, a name of :func:`codec_from_name`
      (``"dynamiq"``, ``"int8"``, ``"mxfp8-ocp"``, ...: the names of
      :func:`dynamiq_jax.reducer`, built with their defaults), or None.
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
    if codec not in CODEC_NAMES:
      raise ValueError(f"{what}: codec={codec!r} is not one of {CODEC_NAMES}. Fix: one "
                       f"of those names, or a codec object, e.g. dq.codecs.DynamiQ(bits=5)")
    return codec_from_name(codec)
  if not isinstance(codec, codecs.Codec):
    raise TypeError(f"{what}: codec={codec!r} is neither a codec name nor a dynamiq_jax "
                    f"codec. Fix: a name from {CODEC_NAMES} (e.g. codec='int8'), a codec "
                    f"object (e.g. dq.codecs.DynamiQ(bits=5)), or a subclass of "
                    f"dq.codecs.Codec")
  return codec
