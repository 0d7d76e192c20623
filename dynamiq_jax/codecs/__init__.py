"""Codecs: how a partial sum is put on the wire at each hop.

A codec is a frozen dataclass (a valid static jit argument); see
:mod:`dynamiq_jax.codecs.base` for the interface the schedules use.
"""

from dynamiq_jax.codecs import allocation
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.codecs.bf16 import F32
from dynamiq_jax.codecs.dynamiq import DynamiQ
from dynamiq_jax.codecs.dynamiq import DynamiQLayout

__all__ = [
    "allocation",
    "Bf16",
    "F32",
    "DynamiQ",
    "DynamiQLayout",
]
