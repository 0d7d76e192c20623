"""Kernel dispatch: the fallback when a kernel does not compile, and jax's Triton warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import dynamiq_triton as T
from pallas_kernels import rng

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
TRITON = "__gpu$xla.gpu.triton"


def _keys(seed):
  return (*rng.derive_key(seed, 1), *rng.derive_key(seed, 2))


def _x(seed, s=11):
  r = np.random.default_rng(seed)
  return jnp.asarray((r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1))))
                     .astype(np.float32))


def _w(s=11):
  return jnp.full((s,), 4, jnp.int32)


UNITS = 44  # 11 super-groups of 4 one-bit planes


def _cuda_text(f, *args):
  """The program lowered for cuda, from a fresh trace (jit caches traces per function)."""
  return jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def fresh():
  D._probed.clear()
  yield
  D._probed.clear()


@pytest.fixture
def cpu_as_local_gpu(monkeypatch, fresh):
  """The probe's "local GPU" is a CPU device: compiling a kernel for it fails for real
  (Pallas compiles only in interpret mode on CPU)."""
  monkeypatch.setattr(D, "_local_gpus", lambda: jax.devices("cpu")[:1])


def _compress(x):
  return K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0), rank=3, strata=8)


class TestCompileFallback:

  def test_a_kernel_that_fails_to_compile_falls_back_with_one_warning(self, cpu_as_local_gpu):
    x = _x(0)
    with pytest.warns(D.KernelFallbackWarning) as record:
      text = _cuda_text(_compress, x)
      _cuda_text(_compress, x)  # same kernel and operands: no second warning
    assert TRITON not in text  # the GPU program runs the reference
    assert "stablehlo.while" not in text  # without XLA:CPU's workaround
    assert len(record) == 1
    msg = str(record[0].message)
    for part in ("'compress'", "Only interpret mode is supported on CPU backend",
                 "implementation='xla'", "implementation='pallas'", "float32[11, 256]"):
      assert part in msg, (part, msg)

  def test_the_fallback_is_the_reference_bit_for_bit(self, cpu_as_local_gpu):
    x = _x(1)
    p = K.compress(_x(2), _w(), UNITS, eps=EPS, keys=_keys(2), implementation="xla")
    kw = dict(eps=tuple(EPS.items()), keys=_keys(1), rank=3, strata=8)
    with pytest.warns(D.KernelFallbackWarning, match="decompress_accumulate_recompress"):
      out = D._gpu_path("decompress_accumulate_recompress",
                        T.decompress_accumulate_recompress_pallas,
                        R.decompress_accumulate_recompress_reference, False,
                        (p, x, _w(), UNITS), kw)
    ref = R.decompress_accumulate_recompress_reference(p, x, _w(), UNITS, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

  def test_a_kernel_that_compiles_stays(self, monkeypatch, fresh):
    compiled = []
    monkeypatch.setattr(D, "_local_gpus", lambda: jax.devices("cpu")[:1])
    monkeypatch.setattr(D, "_compile_alone", lambda kernel, device, args, kw: compiled.append(1))
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      text = _cuda_text(_compress, _x(0))
      _cuda_text(_compress, _x(0))
    assert text.count(TRITON) == 1
    assert compiled == [1]  # probed once per kernel and operand types

  def test_no_local_gpu_keeps_the_kernels_without_probing(self, monkeypatch, fresh):
    monkeypatch.setattr(D, "_compile_alone", lambda *a: pytest.fail("probed without a GPU"))
    assert _cuda_text(_compress, _x(0)).count(TRITON) == 1

  def test_forced_paths_skip_the_probe(self, cpu_as_local_gpu):
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      forced = _cuda_text(lambda x: K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0),
                                               implementation="pallas"), _x(0))
      ref = _cuda_text(lambda x: K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0),
                                            implementation="xla"), _x(0))
    assert forced.count(TRITON) == 1
    assert TRITON not in ref


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
  """The measurement behind Triton being the default (docs/design.md): without
  Triton compiler params a ``pallas_call`` lowers with Mosaic GPU, which rejects
  these kernels. If this starts failing, Mosaic GPU has learnt something: measure
  it again."""
  monkeypatch.setattr(T, "_compiler_params", lambda interpret: None)
  # _launch is a module-level jit: drop traces made with Triton params by other
  # tests before, and those made here with none after.
  T._launch.clear_cache()
  # jax 0.10.2 also deprecates pallas_call for Mosaic GPU (in favour of plgpu.kernel):
  # expected here, where Mosaic GPU is tried on purpose.
  warnings.filterwarnings("ignore", "Using ``pl.pallas_call`` for Mosaic GPU", DeprecationWarning)
  p = jax.ShapeDtypeStruct((R.payload_bytes(37, 150),), jnp.uint8)
  w = jax.ShapeDtypeStruct((37,), jnp.int32)
  try:
    with pytest.raises(NotImplementedError, match="divisible by the warpgroup size"):
      _cuda_text(lambda p, w: T.decompress_pallas(p, w, 150, eps=EPS), p, w)
  finally:
    T._launch.clear_cache()
