"""Codecs: how a partial sum is put on the wire at each hop.

A codec is a frozen dataclass (a valid static jit argument) implementing
:class:`Codec`; see :mod:`dynamiq_jax.codecs.base` for the contract.
"""

from dynamiq_jax.codecs import allocation
from dynamiq_jax.codecs.arctopk import ARCTopK
from dynamiq_jax.codecs.arctopk import RowSelection
from dynamiq_jax.codecs.base import Bucket
from dynamiq_jax.codecs.base import Codec
from dynamiq_jax.codecs.base import HopKeys
from dynamiq_jax.codecs.base import Keys
from dynamiq_jax.codecs.base import Metadata
from dynamiq_jax.codecs.base import Plan
from dynamiq_jax.codecs.base import ceil_div
from dynamiq_jax.codecs.base import pad_to
from dynamiq_jax.codecs.base import round_up
from dynamiq_jax.codecs.bf16 import Bf16
from dynamiq_jax.codecs.bf16 import F32
from dynamiq_jax.codecs.dynamiq import DynamiQ
from dynamiq_jax.codecs.dynamiq import DynamiQLayout
from dynamiq_jax.codecs.intgroup import IntGroup
from dynamiq_jax.codecs.mx import MX
from dynamiq_jax.codecs.mx import mxfp4
from dynamiq_jax.codecs.mx import mxfp6
from dynamiq_jax.codecs.mx import mxfp8
from dynamiq_jax.codecs.omnireduce import OmniReduce
from dynamiq_jax.codecs.thc import THC
from dynamiq_jax.codecs.thc import GlobalQSGD
from pallas_kernels.rng import Stream

__all__ = [
    "allocation",
    "Bucket",
    "Codec",
    "HopKeys",
    "Keys",
    "Metadata",
    "Plan",
    "Stream",
    "ceil_div",
    "pad_to",
    "round_up",
    "Bf16",
    "F32",
    "DynamiQ",
    "DynamiQLayout",
    "IntGroup",
    "MX",
    "mxfp4",
    "mxfp6",
    "mxfp8",
    "OmniReduce",
    "ARCTopK",
    "RowSelection",
    "THC",
    "GlobalQSGD",
]
