"""Kernel dispatch: the fallback when a kernel does not compile, and jax's Triton warning."""

import os
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ
from pallas_kernels import dispatch as D
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_mosaic as M
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import dynamiq_triton as T
from pallas_kernels import rng

import gpu_compile_tools as GT
from _helpers import lower_for

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


def _cuda_text(f, *args, target=True):
  """The program lowered for cuda, from a fresh trace (jit caches traces per function),
  for an abstract H100 (``target=False``: no GPU in context; jax >= 0.11 then cannot
  lower a Triton kernel on this CPU host)."""
  jitted = jax.jit(lambda *a: f(*a))
  if target:
    return lower_for("cuda", jitted, *args)
  return jitted.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def fresh(monkeypatch):
  """Triton's compile probe from scratch, with the Mosaic GPU kernels out of the way
  (``implementation=None`` takes them where Triton's kernel does not compile:
  :class:`TestMosaicAfterTriton` tests that choice)."""
  monkeypatch.setattr(D, "_mosaic_lowers", lambda op, kernels: False)
  D._probed.clear()
  yield
  D._probed.clear()


@pytest.fixture
def cpu_as_local_gpu(monkeypatch, fresh):
  """The probe's "local GPU" is a CPU device: compiling a kernel for it fails for real
  (Pallas compiles only in interpret mode on CPU). Lower with ``target=False``: an
  abstract GPU in context would be another kind, which the probe leaves alone."""
  monkeypatch.setattr(D, "_local_gpus", lambda: jax.devices("cpu")[:1])


@pytest.fixture
def h100_as_local_gpu(monkeypatch, fresh):
  """The probe's "local GPU" is an H100, the kind of the abstract GPU lowered for."""
  monkeypatch.setattr(D, "_local_gpus",
                      lambda: [types.SimpleNamespace(device_kind=GT.H100_KIND)])


def _compress(x):
  return K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0), rank=3, strata=8)


class TestCompileFallback:

  def test_a_kernel_that_fails_to_compile_falls_back_with_one_warning(self, cpu_as_local_gpu):
    x = _x(0)
    with pytest.warns(D.KernelFallbackWarning) as record:
      text = _cuda_text(_compress, x, target=False)
      _cuda_text(_compress, x, target=False)  # same kernel and operands: no second warning
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
                        D.Kernels(T.decompress_accumulate_recompress_pallas),
                        R.decompress_accumulate_recompress_reference, False,
                        (p, x, _w(), UNITS), kw)
    ref = R.decompress_accumulate_recompress_reference(p, x, _w(), UNITS, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))

  def test_a_kernel_that_compiles_stays(self, monkeypatch, h100_as_local_gpu):
    compiled = []
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

  def test_forced_paths_skip_the_probe(self, monkeypatch, h100_as_local_gpu):
    monkeypatch.setattr(D, "_compile_alone", lambda *a: pytest.fail("probed a forced path"))
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      forced = _cuda_text(lambda x: K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0),
                                               implementation="pallas"), _x(0))
      ref = _cuda_text(lambda x: K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0),
                                            implementation="xla"), _x(0))
    assert forced.count(TRITON) == 1
    assert TRITON not in ref

  def test_a_gpu_of_another_kind_is_not_probed(self, monkeypatch, fresh):
    """Lowering for an H100 on a host whose GPU is another kind (ahead of time): compiling
    on the local GPU says nothing about the target, so the kernels stay unprobed."""
    monkeypatch.setattr(D, "_local_gpus",
                        lambda: [types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-40GB")])
    monkeypatch.setattr(D, "_compile_alone", lambda *a: pytest.fail("probed another GPU"))
    assert _cuda_text(_compress, _x(0)).count(TRITON) == 1

  @pytest.mark.skipif(GT.missing() is not None, reason=str(GT.missing()))
  def test_the_probe_compiles_in_the_callers_context(self, monkeypatch, fresh):
    """A compile-only H100 (``jax.experimental.topologies``) as the local GPU: the probe
    really compiles each kernel for it, at top level and inside a ``shard_map`` trace
    over H100s, in the abstract mesh the caller's lowering reads (jax >= 0.11)."""
    [device] = GT.h100_devices(1)
    monkeypatch.setattr(D, "_local_gpus", lambda: [device])
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      assert _cuda_text(_compress, _x(0)).count(TRITON) == 1
      assert len(D._probed) == 1
      mesh = GT.abstract_h100_mesh((8,), ("data",))
      g = jax.ShapeDtypeStruct((8, 1 << 16), jnp.float32,
                               sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))

      def body(x):
        return dq.allreduce(x[0], axis_name="data", codec=DynamiQ(bits=5),
                            key=jax.random.key(4))[0][None]

      step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"),
                                   out_specs=jax.P("data"), check_vma=True))
      text = step.trace(g).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) >= 3
    assert len(D._probed) >= 4 and all(v is None for v in D._probed.values())


MOSAIC = "custom_call @mosaic_gpu"  # a Mosaic GPU kernel in StableHLO (``mosaic_gpu_v2``)
MOSAIC_LOWERS = M.has_interpret()  # jax 0.11.2, 0.12; jax 0.10.2 refuses these kernels at lowering
A100 = "NVIDIA A100-SXM4-40GB"


@pytest.fixture
def mosaic_fresh(monkeypatch):
  """Mosaic-first dispatch on (:data:`pallas_kernels.dispatch.MOSAIC_FIRST`), its probe
  from scratch, and its log lines and warnings again."""
  monkeypatch.setattr(D, "MOSAIC_FIRST", True)
  D._mosaic_probed.clear()
  D._warned.clear()
  yield
  D._mosaic_probed.clear()


def _hop(implementation, s=3, plane_bits=1):
  """A ring hop on ``s`` super-groups of two widths, and its operand types: the smallest
  kernels (two-leaf select trees), cheap to lower."""
  units, ws = s * 4, ((2, 3) if plane_bits == 1 else (2, 4))  # 2-bit planes: even widths
  f = jax.jit(lambda p, x: K.decompress_accumulate_recompress(
      p, x, jnp.full((s,), ws[-1], jnp.int32), units, eps=EPS, width_set=ws, keys=_keys(3),
      strata=8, plane_bits=plane_bits, implementation=implementation))
  return f, (jax.ShapeDtypeStruct((R.payload_bytes(s, units, plane_bits),), jnp.uint8),
             jax.ShapeDtypeStruct((s, 256), jnp.float32))


def _lower_on(device, f, args, platform="cuda"):
  with GT.gpu_target(device):
    return f.trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _on_h100_without_warnings(f, args):
  """``f`` lowered for an H100, a :class:`KernelFallbackWarning` failing the test."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", D.KernelFallbackWarning)
    return _lower_on(GT.h100(), f, args)


class TestMosaicFirst:
  """``implementation=None`` in a ``cuda`` lowering with Mosaic-first dispatch on: Mosaic
  GPU where it lowers for the target GPU, Triton where it does not, each chosen by a probe
  that lowers."""

  def test_off_as_shipped_none_is_triton(self, monkeypatch):
    monkeypatch.setattr(D, "_mosaic_probed", {})
    assert not D.MOSAIC_FIRST  # docs/design.md says why; this test states the default
    text = _lower_on(GT.h100(), *_hop(None))
    assert text.count(TRITON) == 1 and MOSAIC not in text and not D._mosaic_probed

  def test_h100_gets_mosaic_gpu_on_jax_012_and_triton_with_a_warning_on_0_10(self,
                                                                              mosaic_fresh):
    f, args = _hop(None)
    if MOSAIC_LOWERS:
      text = _on_h100_without_warnings(f, args)
      assert text.count(MOSAIC) == 1 and TRITON not in text
    else:
      with pytest.warns(D.KernelFallbackWarning) as record:
        text = _lower_on(GT.h100(), f, args)
      assert text.count(TRITON) == 1 and MOSAIC not in text
      [warning] = record
      for part in ("Mosaic GPU kernel 'decompress_accumulate_recompress'", "does not lower",
                   GT.H100_KIND, f"jax {jax.__version__}", "warpgroup size",
                   "implementation='pallas'", "implementation='mosaic'"):
        assert part in str(warning.message), (part, str(warning.message))
    assert list(D._mosaic_probed.values()) == [None if MOSAIC_LOWERS else ANY_ERROR]

  def test_forcing_each_backend(self, mosaic_fresh):
    def lowered(impl):
      f, args = _hop(impl)
      return _lower_on(GT.h100(), f, args)
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      triton, xla = lowered("pallas"), lowered("xla")
      if MOSAIC_LOWERS:
        mosaic = lowered("mosaic")
        assert mosaic.count(MOSAIC) == 1 and TRITON not in mosaic
      else:  # forced, the error is the user's to see
        with pytest.raises(NotImplementedError, match="warpgroup size"):
          lowered("mosaic")
    assert triton.count(TRITON) == 1 and MOSAIC not in triton
    assert TRITON not in xla and MOSAIC not in xla
    assert not D._mosaic_probed  # a forced path is never probed

  def test_probed_once_per_configuration_not_per_size(self, mosaic_fresh):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", D.KernelFallbackWarning)  # jax 0.10.2: tested above
      texts = [_lower_on(GT.h100(), *_hop(None, s=s)) for s in (3, 20)]
    assert len(D._mosaic_probed) == 1
    kernel = MOSAIC if MOSAIC_LOWERS else TRITON
    assert all(t.count(kernel) == 1 for t in texts)

  def test_a100_gets_triton(self, mosaic_fresh):
    """Older than Hopper: Triton. jax >= 0.11 knows the A100's compute capability (8.0) and
    does not probe; jax 0.10.2 cannot tell, probes, and the lowering fails (warned)."""
    a100 = jax.sharding.AbstractDevice(device_kind=A100, num_cores=108, platform="gpu")
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always", D.KernelFallbackWarning)
      text = _lower_on(a100, *_hop(None))
    assert text.count(TRITON) == 1 and MOSAIC not in text
    warned = [r for r in record if issubclass(r.category, D.KernelFallbackWarning)]
    if D._capability(A100) is not None:
      assert D._capability(A100) == 80 and not warned and not D._mosaic_probed
    else:
      assert len(warned) == 1 and A100 in str(warned[0].message)

  def test_rocm_and_cpu_programs_never_probe_mosaic_gpu(self, monkeypatch, mosaic_fresh):
    """``platform_dependent`` traces the cuda branch for every program: a CPU or ROCm
    program must not lower a Mosaic GPU kernel."""
    monkeypatch.setattr(D, "_mosaic_lowers", _no_probe(D._mosaic_lowers))
    f, (p, x) = _hop(None)
    assert TRITON not in f.trace(p, x).lower(lowering_platforms=("cpu",)).as_text()
    mi300 = jax.sharding.AbstractDevice(device_kind="gfx942", num_cores=304, platform="gpu")
    assert _lower_on(mi300, f, (p, x), platform="rocm").count(TRITON) == 1
    assert not D._mosaic_probed

  def test_unsupported_input_falls_back_to_triton_without_a_warning(self, mosaic_fresh):
    """``plane_bits=2``: the Mosaic GPU kernels raise NotImplementedError (not written);
    the probe reads that as unsupported input, logs it, and Triton runs."""
    f, args = _hop(None, plane_bits=2)
    with warnings.catch_warnings():
      warnings.simplefilter("error", D.KernelFallbackWarning)
      text = _lower_on(GT.h100(), f, args)
    assert text.count(TRITON) == 1 and MOSAIC not in text
    assert "plane_bits=1 only" in next(iter(D._mosaic_probed.values()))


class TestMosaicAfterTriton:
  """``implementation=None`` in a ``cuda`` lowering as shipped (Mosaic-first off): Triton's
  kernel where it is usable, else Mosaic GPU's where it lowers, else the reference. The
  day jax removes the Triton backend, or where a Triton kernel does not compile, the
  fused hop stays fused."""

  @pytest.fixture(autouse=True)
  def fresh(self, monkeypatch):
    monkeypatch.setattr(D, "_mosaic_probed", {})
    monkeypatch.setattr(D, "_warned", set())

  @pytest.mark.parametrize("why", ["no_triton_backend", "triton_does_not_compile"])
  def test_mosaic_gpu_where_triton_is_not_usable(self, monkeypatch, why):
    if why == "no_triton_backend":
      monkeypatch.setattr(D, "triton_backend", lambda: False)
    else:  # what the compile probe says on a GPU where the Triton kernel fails
      monkeypatch.setattr(D, "_kernel_compiles", lambda *args: False)
    f, args = _hop(None)
    if MOSAIC_LOWERS:
      text = _on_h100_without_warnings(f, args)
      assert text.count(MOSAIC) == 1 and TRITON not in text
    else:  # jax 0.10.2: Mosaic GPU refuses the kernels, so the reference, with a warning
      with pytest.warns(D.KernelFallbackWarning, match="the next backend"):
        text = _lower_on(GT.h100(), f, args)
      assert MOSAIC not in text and TRITON not in text
    assert len(D._mosaic_probed) == 1

  def test_triton_first_when_it_is_usable(self, monkeypatch):
    monkeypatch.setattr(D, "_mosaic_lowers", _no_probe(D._mosaic_lowers))
    text = _lower_on(GT.h100(), *_hop(None))
    assert text.count(TRITON) == 1 and MOSAIC not in text and not D._mosaic_probed

  def test_rocm_without_triton_gets_the_reference(self, monkeypatch):
    monkeypatch.setattr(D, "triton_backend", lambda: False)
    monkeypatch.setattr(D, "_mosaic_lowers", _no_probe(D._mosaic_lowers))
    mi300 = jax.sharding.AbstractDevice(device_kind="gfx942", num_cores=304, platform="gpu")
    text = _lower_on(mi300, *_hop(None), platform="rocm")
    assert TRITON not in text and MOSAIC not in text

  def test_forcing_triton_without_the_backend_names_the_fix(self, monkeypatch):
    monkeypatch.setattr(D, "triton_backend", lambda: False)
    with pytest.raises(ValueError, match="has no Pallas Triton backend; use None"):
      _lower_on(GT.h100(), *_hop("pallas"))


class _AnyError:
  def __eq__(self, other):
    return isinstance(other, str) and other.startswith("NotImplementedError")


ANY_ERROR = _AnyError()


def _no_probe(probe):
  """``probe`` that fails the test if it would lower anything."""
  def guarded(op, kernels):
    kind, _ = D.target_gpu()
    if kind is not None and not kind.startswith("gfx"):
      pytest.fail(f"probed Mosaic GPU for {kind}")
    return probe(op, kernels)
  return guarded


def test_jax_triton_deprecation_is_ignored_and_only_it():
  """jax >= 0.11 warns at each Triton lowering; tracing a kernel for GPU filters that alone."""
  _cuda_text(lambda x: K.compress(x, _w(), UNITS, eps=EPS, keys=_keys(0),
                                  implementation="pallas"), _x(0))
  warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future JAX "
                "version.", DeprecationWarning)  # ignored (pytest turns warnings into errors)
  with pytest.raises(DeprecationWarning):
    warnings.warn("something else is deprecated", DeprecationWarning)
  with pytest.raises(UserWarning):
    warnings.warn("The Pallas Triton backend is deprecated", UserWarning)


_STRICT_LOWERING = """
import warnings
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import dynamiq as K, dynamiq_reference as R, dynamiq_triton as KT
import gpu_compile_tools as T
keys = tuple(np.uint32(v) for v in (1, 2, 3, 4))
geo = dict(eps={4: 0.18}, width_set=(4,))
x = jax.ShapeDtypeStruct((11, 256), jnp.float32)
w = jax.ShapeDtypeStruct((11,), jnp.int32)
p = jax.ShapeDtypeStruct((R.payload_bytes(11, 44),), jnp.uint8)
programs = [lambda x, w, p: K.compress(x, w, 44, keys=keys, **geo),
            lambda x, w, p: K.compress(x, w, 44, keys=keys, implementation="pallas", **geo),
            lambda x, w, p: KT.compress_pallas(x, w, 44, keys=keys, **geo),
            lambda x, w, p: K.decompress_accumulate_recompress(p, x, w, 44, keys=keys, **geo)]
for program in programs:
  for _ in range(2):  # the second time the kernel's own jitted launch is a cached trace
    with warnings.catch_warnings(), T.gpu_target():  # restores the filters on exit
      text = jax.jit(program).trace(x, w, p).lower(lowering_platforms=("cuda",)).as_text()
    assert T.TRITON in text or "mosaic_gpu" in text  # None: Triton, else Mosaic GPU
print("lowered", len(programs) * 2)
"""


def test_gpu_lowerings_raise_no_deprecation_warning():
  """``python -W error::DeprecationWarning``: lowering the kernels for a GPU (by dispatch,
  forced, and directly) raises nothing, each time in a fresh ``catch_warnings`` block."""
  res = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                        _STRICT_LOWERING], capture_output=True, text=True, cwd=GT.ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(
                           [str(GT.ROOT), str(GT.ROOT / "tests")]), "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 0, res.stderr[-3000:]
  assert "lowered 8" in res.stdout


def test_mosaic_gpu_cannot_lower_the_kernels_yet(monkeypatch):
  """The measurement behind Triton being the default (docs/design.md): a
  ``pallas_call`` with Mosaic GPU compiler params rejects these kernels on jax
  0.10.2; from jax 0.11 ``pallas_call`` has no Mosaic GPU lowering at all (Mosaic
  GPU kernels are written with ``plgpu.kernel``, and a ``pallas_call`` without
  compiler params lowers with Triton). If this starts failing, Mosaic GPU has
  learnt something: measure it again."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  monkeypatch.setattr(T, "_compiler_params", lambda cfg, interpret: plgpu.CompilerParams())
  # _launch is a module-level jit: drop traces made with Triton params by other
  # tests before, and those made here with Mosaic's after.
  T._launch.clear_cache()
  # jax 0.10.2 also deprecates pallas_call for Mosaic GPU (in favour of plgpu.kernel):
  # expected here, where Mosaic GPU is tried on purpose.
  warnings.filterwarnings("ignore", "Using ``pl.pallas_call`` for Mosaic GPU", DeprecationWarning)
  p = jax.ShapeDtypeStruct((R.payload_bytes(37, 150),), jnp.uint8)
  w = jax.ShapeDtypeStruct((37,), jnp.int32)
  decompress = lambda p, w: T.decompress_pallas(p, w, 150, eps=EPS)
  try:
    if jax.__version_info__ < (0, 11):
      with pytest.raises(NotImplementedError, match="divisible by the warpgroup size"):
        _cuda_text(decompress, p, w)
    else:
      with pytest.raises(AssertionError) as err:  # no lowering rule for these params
        _cuda_text(decompress, p, w)
      assert err.traceback[-1].name == "gpu_lowering"
  finally:
    T._launch.clear_cache()
