"""The batched decodes of DynamiQ's gathered payloads (issue 58): one launch for all n.

``decompress_many`` (n payloads of the same widths -> [n, S, 256]) and
``decompress_rows`` (each output row from its slot ``j n + c`` of the n decoded
chunks, plus a mean: DynamiQ's finish), kernel (Pallas Triton, interpret mode here)
against reference bit for bit, and the reference against the per-payload decode
and today's finish; their dispatch and lowering for cuda; a compile for an H100
(sm_90a) from this CPU host without register spills; the codec hooks
``Codec.decode_many`` / ``Codec.decode_finish`` and their use by the executor and
the engine (the same bits as decoding payload by payload, then finishing).
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.engine import programs as engine
from dynamiq_jax.codecs import DynamiQ, IntGroup
from dynamiq_jax.codecs.dynamiq import RowError
from dynamiq_jax.codecs.base import Bucket, Codec, Keys
from dynamiq_jax.schedules import executor
from pallas_kernels import dynamiq as K
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import dynamiq_triton as T
from pallas_kernels import triton_chunk

import gpu_compile_tools as GT
import test_gpu_compile as G
from _helpers import Jitted, lower_for
from test_kernels import EPS, TRITON, WS3, WS6, _keys, _same, _units, _widths, _x

RJ = Jitted(R)  # the references, each call one compiled program (not op by op)

# (plane_bits, width_set, S, n, widths, room): S below, at and past the kernels' BLOCK
SLOW = pytest.mark.slow  # .ci/run-slow: the default tier keeps one case per plane width
CASES = [
    (1, WS6, 11, 3, "mixed", 2),
    pytest.param((1, WS6, 17, 2, "mixed", 0), marks=SLOW),  # two programs per chunk
    (2, WS3, 9, 4, "mixed", 0),
    pytest.param((2, WS3, 5, 2, "mixed", -3), marks=SLOW),  # too few units: truncated
    (1, (3, 5), 6, 3, "mixed", 1),  # the kernels' own transposition for 5-bit codes
    pytest.param((1, WS3, 16, 2, "max", 0), marks=SLOW),  # all 8-bit
]


def _case_id(c):
  pb, ws, s, n, kind, room = c
  return f"p{pb}-w{''.join(map(str, ws))}-S{s}-n{n}-{kind}-room{room}"


def _payloads(case):
  """(payloads uint8 [n, bytes], widths, units, geometry): n ranks' payloads of one chunk
  layout (each its own data, keys and rank)."""
  pb, ws, s, n, kind, room = case
  widths = _widths(s, s, ws, kind)
  units = _units(widths, pb, room)
  geo = dict(eps=EPS, plane_bits=pb, width_set=ws)
  pays = jnp.stack([_encode(_x(100 * s + c, s), widths, units, c, n, geo) for c in range(n)])
  return pays, widths, units, geo


def _encode(x, widths, units, c, n, geo):
  """Rank c's payload of x (its own keys): the rank traced, so that the n ranks' payloads
  are one compiled reference."""
  return RJ.compress_reference(x, widths, units, keys=_keys(c), rank=jnp.int32(c), strata=n,
                               **geo)


def _slots_and_mean(n, s, seed=0, count=None):
  r = np.random.default_rng(seed)
  slots = r.permutation(n * s)[:count]
  mean = r.standard_normal(slots.shape) * np.exp(r.normal(0, 3, slots.shape))
  return jnp.asarray(slots, jnp.int32), jnp.asarray(mean, jnp.float32)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_batched_kernels_equal_the_reference(case):
  pays, widths, units, geo = _payloads(case)
  n, s = pays.shape[0], widths.shape[0]
  many = RJ.decompress_many_reference(pays, widths, units, **geo)
  assert many.shape == (n, s, 256) and many.dtype == jnp.float32
  for c in range(n):  # the reference is the per-payload decode
    _same(many[c], RJ.decompress_reference(pays[c], widths, units, **geo))
  _same(T.decompress_many_pallas(pays, widths, units, **geo, interpret=True), many)
  slots, mean = _slots_and_mean(n, s, seed=s)
  # the reference is today's finish: chunks interleaved by position, gathered, mean added
  gather = RJ.decompress_rows_reference(pays, widths, units, slots, mean, **geo)
  _same(gather, R.take_in_range(many.transpose(1, 0, 2).reshape(-1, 256), slots)
        + mean[:, None])
  _same(T.decompress_rows_pallas(pays, widths, units, slots, mean, **geo, interpret=True),
        gather)
  # the payloads as gathered in rank order, rank (c + k) % n holding chunk c: read in place
  k = n - 1
  rolled = jnp.roll(pays, k, axis=0)
  _same(RJ.decompress_rows_reference(rolled, widths, units, slots, mean, rotate=k, **geo),
        gather)
  _same(T.decompress_rows_pallas(rolled, widths, units, slots, mean, rotate=k, **geo,
                                 interpret=True), gather)
  # stored as bfloat16 (the engine's result dtype): the float32 rows rounded, in the kernel
  as_bf16 = RJ.decompress_rows_reference(rolled, widths, units, slots, mean, rotate=k,
                                         dtype=jnp.bfloat16, **geo)
  assert as_bf16.dtype == jnp.bfloat16
  _same(as_bf16, gather.astype(jnp.bfloat16))
  _same(T.decompress_rows_pallas(rolled, widths, units, slots, mean, rotate=k, **geo,
                                 dtype=jnp.bfloat16, interpret=True), as_bf16)
  # the mean read in place from column 0 of bfloat16 statistics [rows, 2] (a codec's as
  # gathered): the rows of its float32 values
  stats = jnp.stack([mean.astype(jnp.bfloat16), jnp.abs(mean).astype(jnp.bfloat16)], axis=-1)
  want = RJ.decompress_rows_reference(pays, widths, units, slots,
                                      stats[:, 0].astype(jnp.float32), **geo)
  _same(RJ.decompress_rows_reference(pays, widths, units, slots, stats, **geo), want)
  _same(T.decompress_rows_pallas(pays, widths, units, slots, stats, **geo, interpret=True),
        want)
  # with row_sum: the same rows, and a term of each float32 row's squares less its mean,
  # its norm (the statistics' column 1) and its width (the kernel sums a row's squares in
  # its own order: equal but for the last bits)
  rows, terms = T.decompress_rows_pallas(rolled, widths, units, slots, stats, rotate=k, **geo,
                                         dtype=jnp.bfloat16, row_sum=_term, interpret=True)
  _same(rows, RJ.decompress_rows_reference(rolled, widths, units, slots, stats, rotate=k,
                                           dtype=jnp.bfloat16, **geo))
  ref_rows, ref_terms = RJ.decompress_rows_reference(rolled, widths, units, slots, stats,
                                                     rotate=k, dtype=jnp.bfloat16,
                                                     row_sum=_term, **geo)
  _same(ref_rows, rows)
  assert terms.shape == ref_terms.shape == slots.shape and terms.dtype == jnp.float32
  np.testing.assert_allclose(float(jnp.sum(ref_terms)),
                             _term_numpy(want, stats, widths, slots, n), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(terms), np.asarray(ref_terms), rtol=1e-5)
  # fewer rows than slots exist (a partial last program), repeated slots, no mean
  few = jnp.concatenate([slots[:5], slots[:2]])
  _same(T.decompress_rows_pallas(pays, widths, units, few, **geo, interpret=True),
        RJ.decompress_rows_reference(pays, widths, units, few, **geo))
  few_rows, few_terms = T.decompress_rows_pallas(pays, widths, units, few, **geo,
                                                 row_sum=_term, interpret=True)
  _same(few_rows, RJ.decompress_rows_reference(pays, widths, units, few, **geo))
  assert few_terms.shape == few.shape
  np.testing.assert_allclose(float(jnp.sum(few_terms)),
                             _term_numpy(few_rows, None, widths, few, n), rtol=1e-5)


def _term(sq, norm, width):
  """A row term of ``row_sum`` that reads all three of its inputs."""
  w = width.astype(jnp.float32)
  return sq * (1.0 + w) if norm is None else sq * (1.0 + w) + norm * w


def _term_numpy(rows, stats, widths, slots, n):
  """:func:`_term` summed over float32 ``rows`` in numpy (float64)."""
  rows = np.asarray(rows, np.float64)
  mean = 0.0 if stats is None else np.asarray(stats[:, 0], np.float64)[:, None]
  sq = np.sum(np.square(rows - mean), axis=-1)
  w = np.asarray(widths)[np.asarray(slots) // n].astype(np.float64)
  extra = 0.0 if stats is None else np.asarray(stats[:, 1], np.float64) * w
  return float(np.sum(sq * (1.0 + w) + extra))


@pytest.mark.parametrize("case", [CASES[0], CASES[2],
                                  pytest.param((1, WS6, 5, 10, "mixed", 0), marks=SLOW)],
                         ids=_case_id)
def test_decode_sum_kernel_adds_in_rank_order(case):
  """``decompress_sum``: kernel and reference equal, bit for bit, the decode of payload 0
  followed by the decode-add of each next one (the two-step reduction's order); n = 10
  runs the kernel's loop past its unrolled payloads."""
  pays, widths, units, geo = _payloads(case)
  chain = RJ.decompress_reference(pays[0], widths, units, **geo)
  for c in range(1, pays.shape[0]):
    chain = RJ.decompress_accumulate_reference(pays[c], chain, widths, units, **geo)
  _same(RJ.decompress_sum_reference(pays, widths, units, **geo), chain)
  _same(T.decompress_sum_pallas(pays, widths, units, **geo, interpret=True), chain)


def test_nonfinite_and_zero_values_decode_as_the_reference():
  """A chunk with Inf / NaN and an all-zero chunk: the kernel's bytes are the reference's."""
  pb, ws, s, n = 1, WS6, 7, 3
  widths = _widths(3, s, ws, "mixed")
  units = _units(widths, pb, 0)
  geo = dict(eps=EPS, plane_bits=pb, width_set=ws)
  xs = [_x(1, s), jnp.zeros((s, 256)), _x(2, s).at[1, 3].set(jnp.inf).at[4, 0].set(jnp.nan)]
  pays = jnp.stack([RJ.compress_reference(x, widths, units, keys=_keys(9), **geo) for x in xs])
  _same(T.decompress_many_pallas(pays, widths, units, **geo, interpret=True),
        RJ.decompress_many_reference(pays, widths, units, **geo))


def test_under_vmap_each_element_is_its_own_batch():
  """Under ``vmap`` (``dq.simulate``) the kernel is mapped over the batch: each element
  with its own payloads, widths, slots and means."""
  # CASES[0]'s layout and one of all 3-bit widths, in CASES[0]'s payload size: its
  # compiled encode and decode_rows reference serve here too
  pb, ws6, s, n, _, room = CASES[0]
  a = _widths(s, s, ws6, "mixed")
  b = _widths(s, s, ws6, "1")
  units = _units(a, pb, room)
  assert units >= _units(b, pb, 0)
  geo = dict(eps=EPS, plane_bits=pb, width_set=ws6)
  pays = jnp.stack([jnp.stack([_encode(_x(7 * v + c, s), w, units, c, n, geo)
                               for c in range(n)]) for v, w in enumerate((a, b))])
  ws = jnp.stack([a, b])
  slots = jnp.stack([_slots_and_mean(n, s, seed=v)[0] for v in range(2)])
  means = jnp.stack([_slots_and_mean(n, s, seed=v)[1] for v in range(2)])
  ker = lambda p, w, sl, m: T.decompress_rows_pallas(p, w, units, sl, m, **geo, interpret=True)
  ref = lambda p, w, sl, m: R.decompress_rows_reference(p, w, units, sl, m, **geo)
  # each under one jit (one compile, not an eager dispatch per operation): the same vmap
  got = jax.jit(jax.vmap(ker))(pays, ws, slots, means)
  _same(got, jax.jit(jax.vmap(ref))(pays, ws, slots, means))
  _same(got[1], RJ.decompress_rows_reference(pays[1], ws[1], units, slots[1], means[1], **geo))
  # two outputs (rows, row terms) mapped alike
  rows, terms = jax.jit(jax.vmap(lambda p, w, sl, m: T.decompress_rows_pallas(
      p, w, units, sl, m, **geo, row_sum=_term, interpret=True)))(pays, ws, slots, means)
  _same(rows, got)
  want = jax.jit(jax.vmap(lambda r, m, w, sl: R.row_terms(r, m, w, sl, n, _term)))(
      got, means, ws, slots)
  np.testing.assert_allclose(np.asarray(terms), np.asarray(want), rtol=1e-5)
  _same(jax.jit(jax.vmap(lambda p, w: T.decompress_many_pallas(p, w, units, **geo,
                                                               interpret=True)))(pays, ws),
        jax.jit(jax.vmap(lambda p, w: R.decompress_many_reference(p, w, units, **geo)))(
            pays, ws))


class TestDispatch:

  def test_public_names_equal_the_reference_on_cpu(self):
    pays, widths, units, geo = _payloads(CASES[2])
    slots, mean = _slots_and_mean(4, 9)
    many = RJ.decompress_many_reference(pays, widths, units, **geo)
    gather = RJ.decompress_rows_reference(pays, widths, units, slots, mean, **geo)
    for impl in (None, "xla", "pallas"):
      _same(K.decompress_many(pays, widths, units, **geo, implementation=impl), many)
      _same(K.decompress_rows(pays, widths, units, slots, mean, **geo, implementation=impl),
            gather)
    for impl in (None, "xla"):  # (the kernel's dispatch: test_one_triton_launch_...)
      _same(K.decompress_sum(pays, widths, units, **geo, implementation=impl),
            RJ.decompress_sum_reference(pays, widths, units, **geo))

  def test_odd_widths_with_two_bit_planes_fall_back_to_the_reference(self):
    pays, widths, units, _ = _payloads(CASES[0])
    geo = dict(eps=EPS, plane_bits=2, width_set=WS6)
    pays = jnp.zeros((3, R.payload_bytes(11, units, 2)), jnp.uint8)
    with pytest.raises(NotImplementedError, match="odd widths"):
      T.decompress_many_pallas(pays, widths, units, **geo, interpret=True)
    # under one jit (eagerly, the fallback reference compiles each operation apart)
    _same(Jitted(K).decompress_many(pays, widths, units, **geo, implementation="pallas"),
          RJ.decompress_many_reference(pays, widths, units, **geo))

  @pytest.mark.parametrize("fn", [K.decompress_many, R.decompress_many_reference,
                                  T.decompress_many_pallas])
  def test_bad_payloads_name_the_fix(self, fn):
    w = jnp.full((4,), 2, jnp.int32)
    with pytest.raises(ValueError, match=r"must be uint8 \[n, bytes\]"):
      fn(jnp.zeros((R.payload_bytes(4, 3, 1),), jnp.uint8), w, 3, eps=EPS)
    with pytest.raises(ValueError, match=r"payload_bytes\(4, 3, 1\)"):
      fn(jnp.zeros((2, 10), jnp.uint8), w, 3, eps=EPS)

  def test_bad_slots_and_mean_name_the_fix(self):
    w = jnp.full((4,), 2, jnp.int32)
    pays = jnp.zeros((2, R.payload_bytes(4, 8, 1)), jnp.uint8)
    with pytest.raises(ValueError, match=r"slots float32\[8\] must be int32 \[rows\]"):
      K.decompress_rows(pays, w, 8, jnp.zeros((8,), jnp.float32), eps=EPS)
    for mean in (jnp.zeros((3,)), jnp.zeros((3, 2)), jnp.zeros((8, 2, 1))):
      with pytest.raises(ValueError, match=re.escape(
          f"mean float32{list(mean.shape)} must be float [rows] (or [rows, k] statistics")):
        K.decompress_rows(pays, w, 8, jnp.arange(8), mean, eps=EPS)
    for rotate in (2, -1, 0.5):
      with pytest.raises(ValueError, match=rf"rotate={rotate} must be a Python int in \[0, 2\)"):
        K.decompress_rows(pays, w, 8, jnp.arange(8), rotate=rotate, eps=EPS)

  @pytest.mark.parametrize("plane_bits,width_set", [(1, WS6), (2, WS3)])
  def test_one_triton_launch_in_a_cuda_lowering(self, plane_bits, width_set):
    """Whatever n: one Triton call for all the payloads, none in a CPU lowering."""
    s, units, n = 37, 150, 8
    geo = dict(eps=EPS, plane_bits=plane_bits, width_set=width_set)
    p = jax.ShapeDtypeStruct((n, R.payload_bytes(s, units, plane_bits)), jnp.uint8)
    w = jax.ShapeDtypeStruct((s,), jnp.int32)
    rows = jax.ShapeDtypeStruct((n * s,), jnp.int32)
    mean = jax.ShapeDtypeStruct((n * s,), jnp.float32)
    many = jax.jit(lambda p, w: K.decompress_many(p, w, units, **geo))
    gather = jax.jit(lambda p, w, r, m: K.decompress_rows(p, w, units, r, m, **geo))
    total = jax.jit(lambda p, w: K.decompress_sum(p, w, units, **geo))
    for f, args, name in ((many, (p, w), "many"), (gather, (p, w, rows, mean), "rows"),
                          (total, (p, w), "sum")):
      text = lower_for("cuda", f, *args)
      assert text.count(TRITON) == 1, name
      assert f"dynamiq_units_decompress_{name}_p{plane_bits}" in text
      assert TRITON not in lower_for("cpu", f, *args)


def compile_batched(block: int | None = None):
  """Both batched kernels compiled alone for one H100 (runs in the child)."""
  if block is not None:
    T.BLOCK = block
  [device] = GT.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  s, units, n = 37, 150, 8
  out = []
  for pb, ws in ((1, WS6), (2, WS3)):
    geo = dict(eps=EPS, plane_bits=pb, width_set=ws)
    st = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    p, w = st((n, R.payload_bytes(s, units, pb)), jnp.uint8), st((s,), jnp.int32)
    rows, stats = st((n * s,), jnp.int32), st((n * s, 2), jnp.bfloat16)
    for f, args in ((lambda p, w: T.decompress_many_pallas(p, w, units, **geo), (p, w)),
                    # (as the engine launches it: stored as bfloat16, the codecs' result
                    # dtype, with the means read from the statistics and DynamiQ's error
                    # estimate summed)
                    (lambda p, w, r, m: T.decompress_rows_pallas(
                        p, w, units, r, m, **geo, dtype=jnp.bfloat16,
                        row_sum=RowError(n, (1,) * (n - 1), ((2, 0.1), (4, 0.01), (8, 1e-4)))),
                     (p, w, rows, stats)),
                    (lambda p, w: T.decompress_sum_pallas(p, w, units, **geo), (p, w))):
      with GT.gpu_target(device):
        out.append(jax.jit(f).trace(*args).lower().compile())
  return out


@G.needs_compiler
def test_batched_kernels_compile_for_h100_without_spills(record_property):
  with GT.compile_in_child("test_decode_many:compile_batched") as build:
    report = GT.ptxas_report(build.ptx, prefix="dynamiq_units_decompress_")
  record_property("gpu_compile_batched_decode", json.dumps(report))
  want = [f"dynamiq_units_decompress_{k}_p{pb}" for k in ("many", "rows", "sum")
          for pb in (1, 2)]
  assert set(want) <= set(report), report
  assert not [k for k, v in report.items() if v["spill_bytes"]], report


# ----------------------------------------------------------------------------
# The codec hooks.


def _dynamiq_bucket(n=4, d=256 * 4 * 6, seed=0, implementation="pallas"):
  """A DynamiQ bucket's aux and its n gathered payloads (each rank's own encode of its
  chunk), as the gather phase hands them to the decode."""
  codec = DynamiQ(bits=5)
  bucket = Bucket(0, d, n, implementation)
  r = np.random.default_rng(seed)
  x = jnp.asarray(r.standard_normal(d) * np.exp(r.normal(0, 2, d // 256)).repeat(256),
                  jnp.float32)
  keys = Keys.from_key(jax.random.key(seed), bucket=0, rank=0)
  meta = codec.metadata(x, bucket, None, keys)  # one rank's statistics stand in for the sum
  p = codec.plan(x, meta.local, bucket, None, keys)
  payloads = jnp.stack([codec.encode(p.chunks[c], p.aux, keys.at(c, c)) for c in range(n)])
  return codec, bucket, p.aux, payloads


def test_plan_carries_the_widths_plane_table():
  """DynamiQ's plan gives the hops the plane offsets of its widths, made from the
  allocation's counts per width (kernels.plane_table): those each kernel would compute."""
  for bits in (3, 5):  # mixed widths at both budgets
    codec = DynamiQ(bits=bits)
    bucket = Bucket(0, 256 * 4 * 6, 4, None)
    x = jnp.asarray(np.random.default_rng(bits).standard_normal(bucket.d), jnp.float32)
    keys = Keys.from_key(jax.random.key(0), bucket=0, rank=0)
    aux = codec.plan(x, codec.metadata(x, bucket, None, keys).local, bucket, None, keys).aux
    assert len(set(np.asarray(aux.widths).tolist())) > 1
    own = triton_chunk.plane_table_of_widths(aux.widths, aux.layout.plane_bits, aux.layout.units)
    _same(aux.ptab, own)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_dynamiq_hooks_give_the_bits_of_decode_and_finish(implementation):
  def run():  # under one jit, as in the all-reduce (eagerly: a compile per operation)
    codec, bucket, aux, payloads = _dynamiq_bucket(implementation=implementation)
    one_by_one = jnp.stack([codec.decode(payloads[c], aux) for c in range(bucket.n)])
    want, _ = codec.finish(one_by_one, aux, bucket, None)
    got, state, err = codec.decode_finish(payloads, aux, bucket, None)
    assert err is None  # no partials: no estimate
    return (one_by_one, codec.decode_many(payloads, aux), codec.decode_sum(payloads, aux),
            Codec.decode_sum(codec, payloads, aux), want, got, state)

  one_by_one, many, total, default_total, want, got, state = jax.jit(run)()
  _same(many, one_by_one)
  _same(total, default_total)
  assert state is None
  _same(got, want)
  assert got.shape == (256 * 4 * 6,)  # the bucket's d


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_dynamiq_finish_makes_the_error_estimate_of_its_result(implementation):
  """With ``partials``, DynamiQ's one-launch finish also gives the error estimate's terms,
  one per super-group: those of its result (``error_estimate``) but for the order of each
  row's sum, and the same output bits as without it."""
  partials = dq.schedules.ring_plan(4).partials()

  def run():
    codec, bucket, aux, payloads = _dynamiq_bucket(implementation=implementation)
    out, _, err = codec.decode_finish(payloads, aux, bucket, None, partials=partials)
    plain, _, none = codec.decode_finish(payloads, aux, bucket, None)
    assert none is None
    return out, plain, err, codec.error_estimate(out, aux, bucket, partials)

  out, plain, err, want = jax.jit(run)()
  _same(out, plain)
  assert err.shape == want.shape == (24,)  # one per super-group: 4 chunks of 6
  assert np.isfinite(float(jnp.sum(err))) and float(jnp.sum(err)) > 0
  np.testing.assert_allclose(np.asarray(err), np.asarray(want), rtol=1e-5)


def test_executor_and_engine_use_a_codec_s_own_hooks():
  """DynamiQ's hop ops carry its batched decode and the engine its fused finish; a codec
  without them (IntGroup) keeps the executor's per-payload decodes and ``finish``."""
  calls, has_decode_many = [], []

  class Counted(DynamiQ):
    def decode_finish(self, *a, **k):
      calls.append("decode_finish")
      return super().decode_finish(*a, **k)

  def run():  # under one jit, as in the all-reduce (eagerly: a compile per operation)
    codec, bucket, aux, payloads = _dynamiq_bucket()
    ops = engine.hop_ops(codec, aux, None)
    has_decode_many.append(ops.decode_many is not None)
    many = codec.decode_many(payloads, aux)
    plan = dq.schedules.ring_plan(bucket.n)
    assert plan.root  # the engine's payloads come in rank order: rank (c + root) % n's chunk c
    out, _, _ = engine.decode_pass(jnp.roll(payloads, plan.root, axis=0), aux, Counted(bits=5),
                                   bucket, None, plan)
    return executor.decode_all(payloads, ops), many, out, codec.finish(many, aux, bucket,
                                                                       None)[0]

  decoded, many, out, want = jax.jit(run)()
  assert has_decode_many == [True]
  _same(decoded, many)
  assert calls == ["decode_finish"]
  _same(out, want)
  assert engine.hop_ops(IntGroup(), None, None).decode_many is None


def test_contract_defaults_decode_each_payload_then_finish():
  """``Codec.decode_many`` is ``decode`` of each payload; ``Codec.decode_finish`` is
  ``finish`` of that (IntGroup has neither of its own)."""
  codec = IntGroup()
  assert type(codec).decode_many is Codec.decode_many
  n, d = 4, 1024
  bucket = Bucket(0, d, n)

  def run():  # under one jit (eagerly: a compile per operation)
    x = jax.random.normal(jax.random.key(3), (d,))
    keys = Keys.from_key(jax.random.key(3), bucket=0, rank=0)
    meta = codec.metadata(x, bucket, None, keys)
    p = codec.plan(x, None if meta is None else meta.local, bucket, None, keys)
    payloads = jax.vmap(lambda ch, c: codec.encode(ch, p.aux, keys.at(c, 0)))(
        p.chunks, jnp.arange(n))
    each = jnp.stack([codec.decode(jax.tree.map(lambda a: a[c], payloads), p.aux)
                      for c in range(n)])
    rolled = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), payloads)  # chunk c at rank c + 1
    return (each, codec.decode_many(payloads, p.aux), codec.finish(each, p.aux, bucket, None)[0],
            codec.decode_finish(payloads, p.aux, bucket, None)[0],
            codec.decode_finish(rolled, p.aux, bucket, None, rotate=1)[0])

  each, many, want, finished, finished_rolled = jax.jit(run)()
  _same(many, each)
  _same(finished, want)
  _same(finished_rolled, want)
