"""dynamiq_jax: compressed multi-hop gradient all-reduce for JAX.

    import optax, dynamiq_jax as dq
    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))

Two submodules load on first use, so that ``import dynamiq_jax`` needs only
jax and optax: ``dq.multiprocess`` (one process per worker; POSIX only) and
``dq.nnx`` (Flax NNX data-parallel training; needs flax).
"""

import importlib

from dynamiq_jax import codecs
from dynamiq_jax.training import dropcompute
from dynamiq_jax import schedules
from dynamiq_jax.api.allreduce import AllReduceStats
from dynamiq_jax.api.allreduce import allreduce
from dynamiq_jax.api.allreduce import bucket_layout
from dynamiq_jax.api.allreduce import init_codec_state
from dynamiq_jax.api.allreduce import wire_stats
from dynamiq_jax.training.dropcompute import DropCompute
from dynamiq_jax.training.dropcompute import DropComputeStats
from dynamiq_jax.training.dropcompute import choose_threshold
from dynamiq_jax.training.dropcompute import dropcompute_step
from dynamiq_jax.training.lossy import lossy_init
from dynamiq_jax.engine.moshpit import average_replicas
from dynamiq_jax.registry import REDUCERS
from dynamiq_jax.registry import TP_CODECS
from dynamiq_jax.registry import codec_from_name
from dynamiq_jax.registry import reducer
from dynamiq_jax.registry import tp_codec_from_name
from dynamiq_jax.api.scatter import reduce_scatter
from dynamiq_jax.api.scatter import scatter_dimensions
from dynamiq_jax.api.scatter import scatter_wire_stats
from dynamiq_jax.schedules.context import UnboundAxisError
from dynamiq_jax.schedules.loss import PacketLoss
from dynamiq_jax.schedules.moshpit import Moshpit
from dynamiq_jax.api.simulate import simulate
from dynamiq_jax.api.tp import tp_psum
from dynamiq_jax.training.train import as_varying
from dynamiq_jax.training.train import baseline_psum
from dynamiq_jax.training.train import data_parallel_init
from dynamiq_jax.training.train import data_parallel_step
from dynamiq_jax.training.train import per_rank_copies
from dynamiq_jax.training.train import zero_shardings
from dynamiq_jax.api.transform import CompressedPsumState
from dynamiq_jax.api.transform import PerRank
from dynamiq_jax.api.transform import compressed_psum
from dynamiq_jax.api.transform import compressed_psum_scatter

__version__ = "0.1.0"

_LAZY_SUBMODULES = ("multiprocess", "nnx")


def __getattr__(name):
  """Imports ``dq.multiprocess`` and ``dq.nnx`` when first used."""
  if name in _LAZY_SUBMODULES:
    return importlib.import_module(f"{__name__}.training.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))


__all__ = [
    "codecs",
    "dropcompute",
    "schedules",
    "multiprocess",
    "AllReduceStats",
    "allreduce",
    "bucket_layout",
    "init_codec_state",
    "wire_stats",
    "reduce_scatter",
    "scatter_dimensions",
    "scatter_wire_stats",
    "DropCompute",
    "DropComputeStats",
    "choose_threshold",
    "dropcompute_step",
    "REDUCERS",
    "codec_from_name",
    "reducer",
    "TP_CODECS",
    "tp_codec_from_name",
    "UnboundAxisError",
    "Moshpit",
    "average_replicas",
    "PacketLoss",
    "lossy_init",
    "simulate",
    "tp_psum",
    "as_varying",
    "baseline_psum",
    "data_parallel_init",
    "data_parallel_step",
    "per_rank_copies",
    "zero_shardings",
    "CompressedPsumState",
    "PerRank",
    "compressed_psum",
    "compressed_psum_scatter",
]
