"""The hop kernels on a real GPU, through the public record-payload entry points (so
the Mosaic GPU rows include the record <-> planar conversions): each backend's kernel
(Triton ``"pallas"``, Mosaic GPU ``"mosaic"``) and the XLA reference compiled for the
GPU (``"xla"``) against the reference on the CPU, bit for bit, on finite values (what
the all-reduce feeds them: its guard zeroes non-finite values before the codec and
makes the bucket NaN after it, ``dynamiq_jax.engine.guard.guard``); and, with NaN and
-Inf in some super-groups, every other super-group still bit for bit. How a
super-group holding NaN/Inf is encoded is not the same on every platform (seen on an
H100: NaN bit patterns, and Triton's compress can encode a NaN super-group as finite
codes), which is why the guard exists.

Skipped without a CUDA GPU. On a GPU machine, with the CPU beside it::

    JAX_PLATFORMS=cuda,cpu pytest -n 0 tests/test_kernels_on_gpu.py

Interpret mode (tests/test_kernels.py, tests/test_mosaic_gpu.py) checks the same
kernels' bits on CPU, NaN/Inf included; what only a GPU shows is the compiled
kernel: many thread blocks (the large case), real shared memory and barriers,
buffer alignment, and the GPU's float arithmetic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu",
                                reason="needs a CUDA GPU (Mosaic GPU: Hopper or newer)")

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
OPS = ("compress", "decompress", "decompress_accumulate", "decompress_accumulate_recompress")
# (width_set, S, plane_bits, local dtype): a partial last block each; the large case
# spans thousands of thread blocks.
CASES = {
    "w234568-S13-bf16": ((2, 3, 4, 5, 6, 8), 13, 1, jnp.bfloat16),
    "w2345678-S4099-f32": ((2, 3, 4, 5, 6, 7, 8), 4099, 1, jnp.float32),
    "w2468-S777-pb2-f16": ((2, 4, 6, 8), 777, 2, jnp.float16),
}


def _keys(seed):
  k0, k1 = rng.derive_key(seed, 1)
  s0, s1 = rng.derive_key(seed, 2)
  return (k0, k1, s0, s1)


def _inputs(case, nonfinite=False):
  """(x, widths widest first, units with room to spare, a compressed payload of x, the
  codec's geometry), made on the CPU; with ``nonfinite``, NaN in super-group 3 and
  -Inf in 4 (after the payload is made: it stays the finite one)."""
  width_set, s, plane_bits, dtype = CASES[case]
  r = np.random.default_rng(s)
  x = r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1)))
  x = np.clip(x, -6e4, 6e4)  # finite in float16 too
  x[0, :16] = 0.0
  x[2] = 0.0
  w = np.concatenate([list(width_set), r.choice(width_set, s - len(width_set))])
  widths = np.sort(w)[::-1].copy().astype(np.int32)
  units = int(np.sum(widths)) // plane_bits + 3
  geo = dict(eps=EPS, width_set=width_set, plane_bits=plane_bits)
  with jax.default_device(_cpu()):
    payload = R.compress_reference(jnp.asarray(x.astype(np.float32), dtype), widths, units,
                                   keys=_keys(1), rank=5, strata=8,
                                   scale_rounding="stochastic", **geo)
  if nonfinite:
    x[3, 40], x[4, 7] = np.nan, -np.inf
  return jnp.asarray(x.astype(np.float32), dtype), widths, units, payload, geo


def _cpu():
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    pytest.skip("no CPU backend in this process: run with JAX_PLATFORMS=cuda,cpu")


def _op(op, impl, widths, units, geo):
  """``op`` as a jitted function of (payload, x) or (x,), forced to ``impl``."""
  enc = dict(keys=_keys(2), rank=3, strata=3, scale_rounding="up")
  if op == "compress":
    return jax.jit(lambda x: K.compress(x, widths, units, keys=_keys(4), rank=1, strata=8,
                                        scale_rounding="stochastic", **geo,
                                        implementation=impl))
  if op == "decompress":
    return jax.jit(lambda p: K.decompress(p, widths, units, **geo, implementation=impl))
  if op == "decompress_accumulate":
    return jax.jit(lambda p, x: K.decompress_accumulate(p, x, widths, units, **geo,
                                                        implementation=impl))
  return jax.jit(lambda p, x: K.decompress_accumulate_recompress(p, x, widths, units, **enc,
                                                                 **geo, implementation=impl))


def _operands(op, x, payload):
  return (x,) if op == "compress" else (payload,) if op == "decompress" else (payload, x[::-1])


def _same(a, b, what):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, what
  differ = np.flatnonzero(a.view(np.uint8).reshape(-1) != b.view(np.uint8).reshape(-1))
  assert differ.size == 0, f"{what}: {differ.size} bytes differ, first at byte {differ[:5]}"


def _run(op, impl, widths, units, geo, operands, device):
  return _op(op, impl, widths, units, geo)(*jax.device_put(operands, device))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic"])
def test_on_the_gpu_equals_the_cpu_reference(impl, op, case):
  x, widths, units, payload, geo = _inputs(case)
  if impl == "mosaic" and geo["plane_bits"] == 2:
    pytest.skip("the Mosaic GPU kernels take plane_bits=1 only (dispatch falls back)")
  operands = _operands(op, x, payload)
  _same(_run(op, impl, widths, units, geo, operands, jax.devices("gpu")[0]),
        _run(op, "xla", widths, units, geo, operands, _cpu()),
        f"{impl} {op} {case} on the GPU vs the reference on the CPU")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("impl", ["xla", "pallas", "mosaic"])
def test_on_the_gpu_nonfinite_super_groups_leave_the_others_alone(impl, op):
  """NaN in super-group 3 and -Inf in 4 of the values (and, reversed, in 9 and 8 of
  the hop's addend): every other super-group decodes to the CPU reference's bits."""
  case = "w234568-S13-bf16"
  x, widths, units, payload, geo = _inputs(case, nonfinite=True)
  operands = _operands(op, x, payload)
  got = _run(op, impl, widths, units, geo, operands, jax.devices("gpu")[0])
  want = _run(op, "xla", widths, units, geo, operands, _cpu())
  if op in ("compress", "decompress_accumulate_recompress"):  # payloads: compare decoded
    with jax.default_device(_cpu()):
      got, want = (R.decompress_reference(jnp.asarray(np.asarray(p)), widths, units, **geo)
                   for p in (got, want))
  finite_rows = [i for i in range(x.shape[0]) if i not in (3, 4, 8, 9)]
  _same(np.asarray(got)[finite_rows], np.asarray(want)[finite_rows],
        f"{impl} {op}: the finite super-groups")
