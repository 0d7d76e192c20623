"""dynamiq_jax: compressed multi-hop gradient all-reduce for JAX.

    import optax, dynamiq_jax as dq
    tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))
"""

from dynamiq_jax import codecs
from dynamiq_jax import schedules
from dynamiq_jax.allreduce import AllReduceStats
from dynamiq_jax.allreduce import allreduce
from dynamiq_jax.allreduce import init_codec_state
from dynamiq_jax.allreduce import wire_stats
from dynamiq_jax.registry import REDUCERS
from dynamiq_jax.registry import codec_from_name
from dynamiq_jax.registry import reducer
from dynamiq_jax.simulate import simulate
from dynamiq_jax.train import as_varying
from dynamiq_jax.train import baseline_psum
from dynamiq_jax.train import data_parallel_init
from dynamiq_jax.train import data_parallel_step
from dynamiq_jax.transform import CompressedPsumState
from dynamiq_jax.transform import PerRank
from dynamiq_jax.transform import compressed_psum

__version__ = "0.1.0"

__all__ = [
    "codecs",
    "schedules",
    "AllReduceStats",
    "allreduce",
    "init_codec_state",
    "wire_stats",
    "REDUCERS",
    "codec_from_name",
    "reducer",
    "simulate",
    "as_varying",
    "baseline_psum",
    "data_parallel_init",
    "data_parallel_step",
    "CompressedPsumState",
    "PerRank",
    "compressed_psum",
]
