"""Pallas kernels (interpret mode on CPU) against the jnp reference, bit for bit."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_format as F
from pallas_kernels import rng

import gpu_compile_tools as T
from _helpers import lower_for, model_data, per_rank, rows_identical

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
FORMATS = [
    F.Format(bits=b, levels=lv, eps=EPS[b], hierarchical=h, scale_rounding=sr)
    for b in (2, 4, 8)
    for lv, h, sr in (("mee", True, "up"), ("mee", True, "stochastic"), ("uniform", True, "up"),
                      ("mee", False, "up"), ("uniform", False, "up"))
]
S = 11  # not a multiple of the kernel's block (8 super-groups): one partial block


def _ids(f):
  return f"b{f.bits}-{f.levels}-{'hier' if f.hierarchical else 'flat'}-{f.scale_rounding}"


def _keys(seed):
  k0, k1 = rng.derive_key(seed, 1)
  s0, s1 = rng.derive_key(seed, 2)
  return (k0, k1, s0, s1)


def _x(seed, dtype=jnp.float32, s=S):
  r = np.random.default_rng(seed)
  x = r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1)))
  x[0, :16] = 0.0
  return jnp.asarray(x.astype(np.float32), dtype)


def _same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _tier(f):
  """The default run keeps each width's default format (hierarchical MEE, rounding up) and
  one of each other variant; the rest run in .ci/run-slow."""
  keep = (f.levels, f.hierarchical, f.scale_rounding) == ("mee", True, "up") or (
      f.bits == 4 and (f.levels, f.hierarchical, f.scale_rounding) != ("mee", True, "up"))
  return f if keep else pytest.param(f, marks=pytest.mark.slow)


@pytest.mark.parametrize("fmt", [_tier(f) for f in FORMATS], ids=_ids)
def test_all_four_kernels_equal_the_reference(fmt):
  x = _x(fmt.bits)
  strata = 1 if fmt.levels == "uniform" else 8
  p_ref = F.compress_reference(x, fmt, keys=_keys(1), rank=5, strata=strata)
  _same(K.compress_pallas(x, fmt, keys=_keys(1), rank=5, strata=strata, interpret=True), p_ref)
  _same(K.decompress_pallas(p_ref, fmt, interpret=True), F.decompress_reference(p_ref, fmt))
  _same(K.decompress_accumulate_pallas(p_ref, x, fmt, interpret=True),
        F.decompress_accumulate_reference(p_ref, x, fmt))
  _same(K.decompress_accumulate_recompress_pallas(p_ref, x, fmt, keys=_keys(2), rank=3,
                                                   strata=8, interpret=True),
        F.decompress_accumulate_recompress_reference(p_ref, x, fmt, keys=_keys(2), rank=3,
                                                     strata=8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("s", [1, 8, pytest.param(19, marks=pytest.mark.slow)])
def test_low_precision_inputs_and_sizes(dtype, s):
  fmt = F.Format(bits=4)
  x = _x(3, dtype, s)
  p = F.compress_reference(x, fmt, keys=_keys(3), rank=1, strata=4)
  _same(K.compress_pallas(x, fmt, keys=_keys(3), rank=1, strata=4, interpret=True), p)
  _same(K.decompress_accumulate_recompress_pallas(p, x, fmt, keys=_keys(4), strata=4,
                                                   interpret=True),
        F.decompress_accumulate_recompress_reference(p, x, fmt, keys=_keys(4), strata=4))


@pytest.mark.parametrize("case", ["zeros", "nan", "inf", "1e30", "1e-30"])
def test_edge_values_as_in_the_reference(case):
  fmt = F.Format(bits=8)
  x = np.array(_x(5))
  if case == "zeros":
    x[:] = 0
  elif case == "nan":
    x[2, 40] = np.nan
  elif case == "inf":
    x[3, 7] = -np.inf
  else:
    x = x / np.abs(x).max() * float(case)
  x = jnp.asarray(x)
  p_ref = F.compress_reference(x, fmt, keys=_keys(6))
  p_ker = K.compress_pallas(x, fmt, keys=_keys(6), interpret=True)
  _same(p_ker, p_ref)
  y = K.decompress_pallas(p_ker, fmt, interpret=True)
  _same(y, F.decompress_reference(p_ref, fmt))
  if case in ("zeros",):
    np.testing.assert_array_equal(np.asarray(y), 0.0)
  if case in ("1e30", "1e-30"):
    assert np.all(np.isfinite(np.asarray(y)))


def test_unbiased_through_the_kernels():
  fmt = F.Format(bits=4)
  x = _x(7, s=4)
  draws = 512

  def one(seed):
    p = K.compress_pallas(x, fmt, keys=_keys(seed), rank=2, strata=8, interpret=True)
    return K.decompress_pallas(p, fmt, interpret=True)

  y = np.asarray(jax.jit(jax.vmap(one))(jnp.arange(draws)), np.float64)
  xs = np.asarray(x, np.float64)
  err, var = y.mean(0) - xs, y.var(0, ddof=1)
  for w in (np.ones_like(xs), np.sign(xs)):
    z = np.sum(w * err, 1) / np.sqrt(np.sum(var, 1) / draws + 1e-300)
    assert np.max(np.abs(z)) < 5.0, z


@pytest.mark.slow  # two ring compiles, one in interpret mode; each kernel's parity: above
def test_ring_with_kernels_equals_xla_on_8_devices(mesh):
  g = model_data("heavy", 8, 1 << 15, 1)
  codec = DynamiQ(bits=5)

  def reduce(impl):
    return lambda x: dq.allreduce(x, axis_name="data", codec=codec, key=jax.random.key(4),
                                  implementation=impl)[0]

  ker = per_rank(mesh, reduce("pallas"), g)
  ref = per_rank(mesh, reduce("xla"), g)
  assert rows_identical(ker)
  _same(ker, ref)


def test_kernels_lower_inside_shard_map_with_check_vma():
  """As ``dq.data_parallel_step`` runs them (``check_vma=True``), lowered for cuda
  over a mesh of (abstract) H100s: each pallas_call must declare how its output
  varies over the mesh, or tracing fails. (Interpret mode cannot run there on jax
  0.10.2: its interpreter indexes a varying ref with an invarying index and
  check_vma rejects that.)"""
  mesh = T.abstract_h100_mesh((8,), ("data",))
  g = jax.ShapeDtypeStruct((8, 1 << 16), jnp.float32,  # large enough to be compressed
                           sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))

  def body(x):
    return dq.allreduce(x[0], axis_name="data", codec=DynamiQ(bits=5), key=jax.random.key(4),
                        implementation="pallas")[0][None]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"),
                            check_vma=True))
  text = f.trace(g).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text


class TestDispatch:

  def test_default_is_chosen_by_the_lowering_platform(self):
    """Kernels in a lowering for cuda, the reference for cpu, whatever the host's backend."""
    fmt = F.Format(bits=4)

    def lowered(implementation, platform):
      f = lambda p, x: K.decompress_accumulate_recompress(p, x, fmt, keys=_keys(0),
                                                          implementation=implementation)
      p = jax.ShapeDtypeStruct((S, fmt.record_bytes), jnp.uint8)
      x = jax.ShapeDtypeStruct((S, 256), jnp.float32)
      return lower_for(platform, jax.jit(f), p, x)

    triton = "__gpu$xla.gpu.triton"
    assert lowered(None, "cuda").count(triton) == 1
    assert "stablehlo.while" not in lowered(None, "cuda")  # no XLA:CPU workaround on GPU
    assert triton not in lowered(None, "cpu")
    assert "stablehlo.while" in lowered(None, "cpu")  # the reference's materialize
    assert triton not in lowered("xla", "cuda")
    assert "stablehlo.while" not in lowered("xla", "cuda")
    assert lowered("pallas", "cuda").count(triton) == 1
    assert triton not in lowered("pallas", "cpu")  # interpreted

  def test_default_runs_the_reference_on_cpu(self):
    fmt = F.Format(bits=4)
    x = _x(0)
    ref = F.compress_reference(x, fmt, keys=_keys(0))
    _same(K.compress(x, fmt, keys=_keys(0)), ref)
    _same(jax.jit(lambda x: K.compress(x, fmt, keys=_keys(0)))(x), ref)
    _same(jax.jit(lambda x: K.compress(x, fmt, keys=_keys(0), implementation="pallas"))(x), ref)

  def test_bad_implementation(self):
    with pytest.raises(ValueError, match="implementation='cuda'"):
      K.decompress(jnp.zeros((1, 146), jnp.uint8), F.Format(bits=4), implementation="cuda")

  def test_unsupported_input_falls_back_and_says_so_once(self, caplog):
    fmt = F.Format(bits=4)
    x = _x(8).astype(jnp.float8_e4m3fn)
    K._warned.clear()
    with caplog.at_level(logging.WARNING, logger="dynamiq_jax"):
      a = K.compress(x, fmt, keys=_keys(0), implementation="pallas")
      b = K.compress(x, fmt, keys=_keys(0), implementation="pallas")
    _same(a, F.compress_reference(x, fmt, keys=_keys(0)))
    _same(a, b)
    msgs = [r.getMessage() for r in caplog.records if "float8" in r.getMessage()]
    assert len(msgs) == 1 and "using the XLA reference" in msgs[0]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_lowers_for_gpu_with_triton(bits):
  """Lowering for the cuda platform runs the Pallas->Triton lowering on this CPU machine."""
  fmt = F.Format(bits=bits)
  x = jax.ShapeDtypeStruct((37, 256), jnp.bfloat16)
  p = jax.ShapeDtypeStruct((37, fmt.record_bytes), jnp.uint8)
  fns = [(lambda x: K.compress_pallas(x, fmt, keys=_keys(0), strata=8), (x,)),
         (lambda p: K.decompress_pallas(p, fmt), (p,)),
         (lambda p, x: K.decompress_accumulate_pallas(p, x, fmt), (p, x)),
         (lambda p, x: K.decompress_accumulate_recompress_pallas(p, x, fmt, keys=_keys(0),
                                                                  strata=8), (p, x))]
  for f, args in fns:
    text = lower_for("cuda", jax.jit(f), *args)
    assert "triton" in text
