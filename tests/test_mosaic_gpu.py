"""The planar payload layout (pallas_kernels.dynamiq_planar) and the Mosaic GPU kernels
(pallas_kernels.dynamiq_mosaic: decompress, decompress-accumulate, compress, the ring
hop), bit for bit against the jnp reference in Mosaic GPU's interpret mode (jax
0.11.2 and 0.12; skipped, saying so, where it does not exist), their lowering for
cuda on this CPU machine, and what the compiled GPU program hands them.

Interpret-mode sizes: every case has a partial last block (S not a multiple of
the kernel's 8 super-groups) and, together, they cover every width 2..8 (one to
eight planes), narrower codes' masked planes, unused units, a truncated payload
(planes past the units masked), zero groups and a zero super-group, NaN/Inf/
subnormal scales, NaN/Inf values, bfloat16/float16 values (float32 in the slow
encode case), both scale roundings and power-of-two and other stratum counts.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynamiq_jax.codecs import DynamiQ
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_mosaic as M
from pallas_kernels import dynamiq_planar as P
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng

import gpu_compile_tools as T
from _helpers import Jitted, lower_for

RJ = Jitted(R)  # the references, each call one compiled program (not op by op)

EPS = {2: 0.23, 4: 0.18, 8: 0.10}
LATTICE = "lattice"  # the default level set
WS6 = (2, 3, 4, 5, 6, 8)
WS3 = (2, 4, 8)
MOSAIC = re.compile(r"custom_call @mosaic_gpu")  # a Mosaic GPU kernel in StableHLO

needs_interpret = pytest.mark.skipif(
    not M.has_interpret(),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpret mode (InterpretGPUParams: jax 0.11.2 and 0.12 have it)")


def _keys(seed):
  k0, k1 = rng.derive_key(seed, 1)
  s0, s1 = rng.derive_key(seed, 2)
  return (k0, k1, s0, s1)


def _chunk(seed, s, width_set, kind="mixed", dtype=jnp.float32):
  """x [s, 256] (a zero group, a zero super-group) and int32 widths, widest first."""
  r = np.random.default_rng(seed)
  x = r.standard_normal((s, 256)) * np.exp(r.normal(0, 3, (s, 1)))
  x[0, :16] = 0.0
  if s > 2:
    x[2] = 0.0
  if kind == "mixed":
    w = np.concatenate([list(width_set), r.choice(width_set, max(s - len(width_set), 0))])[:s]
  else:
    w = np.full(s, int(kind))
  return (jnp.asarray(x.astype(np.float32), dtype),
          jnp.asarray(np.sort(w)[::-1].copy(), jnp.int32))


def _random_payload(seed, s, units, plane_bits=1, edge=False):
  """A record payload (uint8 ``[payload_bytes]``) of random bytes: random ``k`` (some
  zero), bf16 super-group scales of random magnitude and, with ``edge``, NaN, +Inf and
  subnormal scales; random code units (a decoder reads any bytes)."""
  r = np.random.default_rng(seed)
  k = r.integers(0, 256, (s, 16)).astype(np.uint8)
  k[r.random((s, 16)) < 0.1] = 0
  v = (np.abs(r.standard_normal(s)) * np.exp(r.normal(0, 10, s))).astype(np.float32)
  bits = (v.view(np.uint32) >> 16).astype(np.uint16)
  if edge:
    bits[1:4] = [0x7FC0, 0x7F80, 0x0001][:len(bits[1:4])]
  rec = np.concatenate([k, bits.view(np.uint8).reshape(s, 2)], axis=1)
  body = r.integers(0, 256, units * R.unit_bytes(plane_bits)).astype(np.uint8)
  return jnp.asarray(np.concatenate([rec.reshape(-1), body]))


def _same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# ----------------------------------------------------------------------------
# The planar layout.


@pytest.mark.parametrize("s,units,plane_bits", [(1, 5, 1), (13, 64, 1), (37, 150, 1),
                                                (11, 20, 2), (300, 1200, 2)])
def test_planar_payload_is_todays_size_with_aligned_planes(s, units, plane_bits):
  k0, u0, s0, end = P.plane_offsets(s, units, plane_bits)
  assert end == P.planar_bytes(s, units, plane_bits) == R.payload_bytes(s, units, plane_bits)
  assert k0 % P.GRANULE == u0 % P.GRANULE == s0 % P.GRANULE == 0


@pytest.mark.parametrize("d,n", [(1 << 20, 8), (100_000, 8), (300_001, 3)])
def test_wire_bits_of_the_default_codec_unchanged(d, n):
  """The default codec's chunk payloads, planar, give the same wire bits: 5.00 per
  coordinate on test_dynamiq's budget size (2^20 over 8 ranks), padding included."""
  lay = DynamiQ().layout(d, n)
  s = lay.padded_supergroups // n
  planar_bits = lay.stats_bits + 8 * n * P.planar_bytes(s, lay.units, lay.plane_bits)
  assert planar_bits == lay.wire_bits
  if d == 1 << 20:
    assert f"{planar_bits / d:.2f}" == "5.00"


@pytest.mark.parametrize("plane_bits,s,units", [(1, 13, 40), (2, 9, 7)])
def test_planar_round_trip_is_bit_exact(plane_bits, s, units):
  pay = _random_payload(0, s, units, plane_bits)
  planar = P.to_planar(pay, s, units, plane_bits)
  assert planar.shape == pay.shape
  _same(P.from_planar(planar, s, units, plane_bits), pay)
  # the planes hold the records' bytes: k, then the units unchanged, then the scales
  rec = np.asarray(pay[:s * R.SCALE_BYTES]).reshape(s, R.SCALE_BYTES)
  k16, words, sc16 = (np.asarray(a) for a in P.planes(planar, s, units, plane_bits))
  np.testing.assert_array_equal(k16.view(np.uint8).reshape(s, 16), rec[:, :16])
  np.testing.assert_array_equal(sc16.view(np.uint8).reshape(s, 2), rec[:, 16:])
  np.testing.assert_array_equal(words.view(np.uint8), np.asarray(pay[s * R.SCALE_BYTES:]))


def test_bad_planar_payload_names_the_fix():
  with pytest.raises(ValueError, match=r"payload_bytes\(3, 4, 1\)"):
    P.to_planar(jnp.zeros(10, jnp.uint8), 3, 4)


# ----------------------------------------------------------------------------
# The Mosaic GPU decode kernels, in GPU interpret mode.

# (width_set, S, kind, room, addend dtype, payload: random bytes, "edge": odd values too).
# Random payloads decode like compressed ones (the decoder reads any bytes, and masks
# the planes a width lacks); compress_reference's compile alone would cost ~13 s here.
CASES = [
    # the default codec's widths, unused units; NaN, +Inf, subnormal scales, NaN/Inf in x
    (WS6, 13, "mixed", 3, jnp.bfloat16, "edge"),
    ((2, 3, 4, 5, 6, 7, 8), 9, "mixed", -4, jnp.float16, "random"),  # every width; truncated
]


def _case_id(c):
  return f"w{''.join(map(str, c[0]))}-S{c[1]}-{c[5]}"


@needs_interpret
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_kernels_equal_the_reference(case):
  _check_decode(case)


def _check_decode(case, eps=EPS):
  width_set, s, kind, room, dtype, payload = case
  x, widths = _chunk(s, s, width_set, kind, dtype)
  units = max(int(np.sum(np.asarray(widths))) + room, 0)
  geo = dict(eps=eps, width_set=width_set)
  pay = _random_payload(s, s, units, edge=payload == "edge")
  if payload == "edge":
    x = x.at[3, 40].set(jnp.nan).at[4, 7].set(-jnp.inf)
  planar = P.to_planar(pay, s, units)
  _same(M.decompress_planar(planar, widths, units, eps=eps, width_set=width_set,
                            interpret=True),
        RJ.decompress_reference(pay, widths, units, **geo))
  _same(M.decompress_accumulate_planar(planar, x, widths, units, eps=eps,
                                       width_set=width_set, interpret=True),
        RJ.decompress_accumulate_reference(pay, x, widths, units, **geo))


@needs_interpret
def test_decode_under_vmap_equals_the_reference():
  """The gather phase decodes every chunk under vmap: plgpu.kernel batches the launch."""
  s, ws = 3, (2, 3)
  _, widths = _chunk(4, s, ws)
  units = int(np.sum(np.asarray(widths)))
  pays = jnp.stack([_random_payload(i, s, units) for i in range(2)])
  planars = jax.vmap(lambda p: P.to_planar(p, s, units))(pays)
  _same(jax.vmap(lambda q: M.decompress_planar(q, widths, units, eps=EPS, width_set=ws,
                                               interpret=True))(planars),
        jax.vmap(lambda p: R.decompress_reference(p, widths, units, eps=EPS,
                                                  width_set=ws))(pays))


@needs_interpret
def test_decompress_rows_reads_rank_ordered_payloads_as_the_reference():
  """decompress_rows(implementation="mosaic"): the payloads as gathered in rank order (rank
  ``(c + rotate) % n`` holding chunk c) give the reference's rows, bit for bit."""
  s, n, ws = 3, 3, (2, 3)
  _, widths = _chunk(5, s, ws)
  units = int(np.sum(np.asarray(widths)))
  pays = jnp.stack([_random_payload(10 + i, s, units) for i in range(n)])
  r = np.random.default_rng(0)
  slots = jnp.asarray(r.permutation(n * s), jnp.int32)
  mean = jnp.asarray(r.standard_normal(n * s), jnp.float32)
  want = R.decompress_rows_reference(pays, widths, units, slots, mean, eps=EPS, width_set=ws)
  rolled = jnp.roll(pays, 2, axis=0)
  _same(K.decompress_rows(rolled, widths, units, slots, mean, eps=EPS, width_set=ws,
                          rotate=2, implementation="mosaic", interpret=True), want)
  _same(K.decompress_rows(rolled, widths, units, slots, mean, eps=EPS, width_set=ws,
                          rotate=2, dtype=jnp.bfloat16, implementation="mosaic",
                          interpret=True), want.astype(jnp.bfloat16))


# (width_set, S, dtype): compress runs with the default codec's rounding (stochastic
# scales, 8 strata: a power-of-two q), the ring hop with the other paths ("up", 3 strata)
ENCODE_CASES = [
    (WS6, 13, jnp.bfloat16),
    pytest.param(((2, 3, 4, 5, 6, 7, 8), 9, jnp.float32), marks=pytest.mark.slow),
]


def _encode_id(c):
  return f"w{''.join(map(str, c[0]))}-S{c[1]}"


@needs_interpret
@pytest.mark.parametrize("case", ENCODE_CASES, ids=_encode_id)
def test_encode_kernels_equal_the_reference(case):
  """compress and the ring hop, planar, equal the reference's record payloads read back:
  NaN, -Inf, a zero group and a zero super-group in x, a partial last block, unused
  units."""
  _check_encode(case)


def _check_encode(case, eps=EPS):
  width_set, s, dtype = case
  x, widths = _chunk(s, s, width_set, "mixed", dtype)
  x = x.at[3, 40].set(jnp.nan).at[4, 7].set(-jnp.inf)
  units = int(np.sum(np.asarray(widths))) + 3
  geo = dict(eps=eps, width_set=width_set)
  enc = dict(keys=_keys(1), rank=5, strata=8, scale_rounding="stochastic", **geo)
  pay = RJ.compress_reference(x, widths, units, **enc)
  _same(P.from_planar(M.compress_planar(x, widths, units, **enc, interpret=True), s,
                      units),
        pay)
  y = x[::-1]  # another chunk's values, same widths
  hop = dict(keys=_keys(2), rank=2, strata=3, scale_rounding="up", **geo)
  _same(P.from_planar(M.decompress_accumulate_recompress_planar(
      P.to_planar(pay, s, units), y, widths, units, **hop, interpret=True), s, units),
        RJ.decompress_accumulate_recompress_reference(pay, y, widths, units, **hop))


@needs_interpret
def test_lattice_kernels_equal_the_reference():
  """The lattice levels (the default): compress, the ring hop (8 and 3 strata, both scale
  roundings) and the decodes, as the MEE cases above."""
  _check_encode(ENCODE_CASES[0], eps=LATTICE)
  _check_decode(next(c for c in CASES if not hasattr(c, "marks")), eps=LATTICE)


def test_implementation_mosaic_forces_the_mosaic_kernels():
  """The public hop (record payloads) lowered for cuda: implementation="mosaic" carries the
  Mosaic GPU kernel (whose bits test_encode_kernels_equal_the_reference checks), None the
  Triton one (Mosaic-first dispatch is off: test_kernel_dispatch.TestMosaicFirst); off GPU
  "mosaic" is the reference."""
  s, units, ws = 3, 9, (2, 3)
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units),), jnp.uint8)
  x = jax.ShapeDtypeStruct((s, 256), jnp.float32)
  widths = jnp.asarray([3, 3, 3], jnp.int32)
  geo = dict(eps=EPS, width_set=ws, keys=_keys(3), strata=8, scale_rounding="stochastic")
  hop = lambda impl: jax.jit(lambda p, x: K.decompress_accumulate_recompress(
      p, x, widths, units, **geo, implementation=impl))
  default = lower_for("cuda", hop(None), p, x)
  if M.has_interpret():
    mosaic = lower_for("cuda", hop("mosaic"), p, x)
    assert len(MOSAIC.findall(mosaic)) == 1 and "triton" not in mosaic
  else:  # jax 0.10.2's Mosaic GPU refuses copies under 128 bytes, at lowering: forced, it raises
    with pytest.raises(NotImplementedError, match="warpgroup size"):
      lower_for("cuda", hop("mosaic"), p, x)
  assert not MOSAIC.findall(default) and "triton" in default
  on_cpu = lower_for("cpu", hop("mosaic"), p, x)
  assert not MOSAIC.findall(on_cpu) and "triton" not in on_cpu


def test_bad_implementation_names_the_choices():
  with pytest.raises(ValueError, match="'mosaic' \\(Mosaic GPU\\)"):
    K.decompress(jnp.zeros(R.payload_bytes(1, 2), jnp.uint8), jnp.asarray([2], jnp.int32), 2,
                 eps=EPS, implementation="mosaic_gpu")


def test_two_bit_planes_are_not_written_yet():
  x, widths = _chunk(0, 3, WS3)
  with pytest.raises(NotImplementedError, match="plane_bits=1 only"):
    M.decompress_planar(jnp.zeros(R.payload_bytes(3, 5, 2), jnp.uint8), widths, 5,
                        eps=EPS, plane_bits=2, width_set=WS3)


@pytest.mark.skipif(M.has_interpret(), reason="this jax has the interpret mode")
def test_interpret_mode_missing_says_which_jax_has_it():
  with pytest.raises(NotImplementedError, match="jax 0.11.2 and 0.12 have it"):
    M.interpret_params()


def test_kernels_lower_for_cuda():
  """Pallas -> Mosaic GPU lowering of three kernels for an H100 on this CPU host: one
  Mosaic GPU custom call each, no Triton. (jax 0.10.2's Mosaic GPU rejects copies below 128 bytes: skipped.)"""
  s, units = 37, 150
  x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((s,), jnp.int32)
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units),), jnp.uint8)
  eps = EPS
  enc = dict(eps=eps, keys=_keys(0), strata=8, scale_rounding="stochastic")
  # (decompress_accumulate is decompress's body and an add: the ring hop covers both)
  fns = [(lambda p, w: M.decompress_planar(p, w, units, eps=eps), (p, w)),
         (lambda x, w: M.compress_planar(x, w, units, **enc), (x, w)),
         (lambda x, w: M.compress_planar(x, w, units, **dict(enc, eps=LATTICE)), (x, w)),
         (lambda p, x, w: M.decompress_accumulate_recompress_planar(p, x, w, units, **enc),
          (p, x, w))]
  for f, args in fns:
    try:
      text = lower_for("cuda", jax.jit(f), *args)
    except NotImplementedError as e:
      if M.has_interpret():
        raise
      pytest.skip(f"jax {jax.__version__}: {e}")
    assert len(MOSAIC.findall(text)) == 1 and "triton" not in text


# ----------------------------------------------------------------------------
# What the compiled GPU program hands the Mosaic GPU kernels.


def compile_small_record_ops():
  """Decompress (without, then with :func:`pallas_kernels.dynamiq_mosaic._launch`'s
  barriers) and the ring hop, record payloads of 13 super-groups, forced to Mosaic GPU,
  compiled for one compile-only H100 (runs in the child of
  :func:`gpu_compile_tools.compile_in_child`)."""
  [device] = T.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  s = 13
  _, widths = _chunk(s, s, WS6)
  widths = np.asarray(widths)
  units = int(widths.sum()) + 3
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units),), jnp.uint8, sharding=sharding)
  x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16, sharding=sharding)
  geo = dict(eps=EPS, width_set=WS6, implementation="mosaic")
  decompress = lambda p: K.decompress(p, widths, units, **geo)
  hop = lambda p, x: K.decompress_accumulate_recompress(p, x, widths, units, keys=_keys(1),
                                                        strata=8, **geo)
  out = []
  launch = M._launch
  for f, args, barriers in ((decompress, (p,), False), (decompress, (p,), True),
                            (hop, (p, x), True)):
    M._launch = launch if barriers else (lambda kernel, ops: M._vary_like(kernel(*ops), ops))
    jax.clear_caches()  # the kernel wrappers are jitted: no trace of the other build
    try:
      with T.gpu_target(device):
        out.append(jax.jit(f).trace(*args).lower().compile())
    finally:
      M._launch = launch
  return out


@pytest.mark.skipif(T.missing(need_ptxas=False) is not None,
                    reason=str(T.missing(need_ptxas=False)))
@pytest.mark.skipif(not M.has_interpret(),
                    reason=f"jax {jax.__version__}'s Mosaic GPU refuses these kernels at lowering")
def test_no_plane_reaches_a_mosaic_kernel_as_a_slice():
  """The Mosaic GPU custom call needs 256-byte aligned buffers; a plane is a slice of the
  payload at a 16-byte offset. Without the barriers, XLA:GPU hands a small chunk's plane
  to the kernel in place (a dynamic-slice fusion: on an H100 "Input buffer 0 is not
  256-byte aligned"); with them, every operand is a buffer of its own."""
  with T.compile_in_child("test_mosaic_gpu:compile_small_record_ops") as build:
    bare, decompress, hop = build.hlo
  for text in (decompress, hop):
    assert len(re.findall(r'custom_call_target="mosaic_gpu', text)) == 1
    assert "dynamic_slice_fusion" not in text
  assert "dynamic_slice_fusion" in bare  # the check sees the fusion where it forms
