"""Codecs: how a partial sum is put on the wire at each hop.

A codec is a frozen dataclass (a valid static jit argument); see
:mod:`dynamiq_jax.codecs.base` for the interface the schedules use.
"""

from dynamiq_jax.codecs import allocation
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.codecs.bf16 import F32
from dynamiq_jax.codecs.dynamiq import DynamiQ
from dynamiq_jax.codecs.dynamiq import DynamiQLayout
from dynamiq_jax.codecs.mx import MX
from dynamiq_jax.codecs.mx import mxfp4
from dynamiq_jax.codecs.mx import mxfp6
from dynamiq_jax.codecs.mx import mxfp8
from dynamiq_jax.codecs.omnireduce import OmniReduce
from dynamiq_jax.codecs.thc import THC
from dynamiq_jax.codecs.thc import GlobalQSGD

__all__ = [
    "allocation",
    "Bf16",
    "F32",
    "DynamiQ",
    "DynamiQLayout",
    "MX",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "OmniReduce",
    "THC",
    "GlobalQSGD",
]
