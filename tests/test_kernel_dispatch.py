"""Kernel dispatch: jax's Triton warning, and why the kernels are not Mosaic GPU."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_format as F
from pallas_kernels import rng

FMT = F.Format(bits=4)
TRITON = "__gpu$xla.gpu.triton"


def _keys(seed):
  return (*rng.derive_key(seed, 1), *rng.derive_key(seed, 2))


def _x(seed, s=11):
  r = np.random.default_rng(seed)
  return jnp.asarray((r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1))))
                     .astype(np.float32))


def _cuda_text(f, *args):
  """The program lowered for cuda, from a fresh trace (jit caches traces per function)."""
  return jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _compress(x):
  return K.compress(x, FMT, keys=_keys(0), rank=3, strata=8)


def test_jax_triton_deprecation_is_ignored_and_only_it():
  """jax >= 0.11 warns at each Triton lowering; tracing a kernel for GPU filters that alone."""
  _cuda_text(_compress, _x(0))
  warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future JAX "
                "version.", DeprecationWarning)  # ignored (pytest turns warnings into errors)
  with pytest.raises(DeprecationWarning):
    warnings.warn("something else is deprecated", DeprecationWarning)
  with pytest.raises(UserWarning):
    warnings.warn("The Pallas Triton backend is deprecated", UserWarning)


def test_mosaic_gpu_cannot_lower_the_kernels_yet(monkeypatch):
  """The measurement behind Triton being the default (module docstring of
  pallas_kernels.dynamiq): without Triton compiler params a ``pallas_call`` lowers
  with Mosaic GPU, which rejects these kernels. If this starts failing, Mosaic GPU
  has learnt something: measure it again."""
  monkeypatch.setattr(K, "_compiler_params", lambda interpret: None)
  # jax 0.10.2 also deprecates pallas_call for Mosaic GPU (in favour of plgpu.kernel):
  # expected here, where Mosaic GPU is tried on purpose.
  warnings.filterwarnings("ignore", "Using ``pl.pallas_call`` for Mosaic GPU", DeprecationWarning)
  p = jax.ShapeDtypeStruct((37, FMT.record_bytes), jnp.uint8)
  with pytest.raises(NotImplementedError, match="divisible by the warpgroup size"):
    _cuda_text(lambda p: K.decompress_pallas(p, FMT), p)
