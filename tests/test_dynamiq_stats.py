"""DynamiQ's guard + statistics pass and the statistics' sum (pallas_kernels.dynamiq_stats):
kernel against reference bit for bit in interpret mode, the reference against the arithmetic
it replaces (the guard, then the statistics of the guarded bucket: codecs/_exact.py), the
engine's one-pass guard against the two-pass one, and the kernels' compile for an H100."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynamiq_jax as dq
from dynamiq_jax.engine import programs as engine
from dynamiq_jax.codecs.supergroup_stats import DynamiQKeyTables, SupergroupStats
from dynamiq_jax.codecs._exact import hypot_all, row_norm, stochastic_bf16, tree_sum
from pallas_kernels import dynamiq_stats as S
from pallas_kernels import rng

import gpu_compile_tools as GT
import test_gpu_compile as G
from _helpers import Jitted, lower_for, rows_identical

SAFE = engine.SAFE_EXPONENT
TRITON = "__gpu$xla.gpu.triton"
SJ = Jitted(S)  # references and dispatch, each call one compiled program (not op by op)


def _bits(a):
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  np.testing.assert_array_equal(_bits(a), _bits(b))


def _rows(seed, n, s, kind="mixed"):
  """[n s, 256] float32 rows over many decades, with zero rows and, by ``kind``, non-finite
  values ("nonfinite") or rows of 2^64 and more ("huge")."""
  r = np.random.default_rng(seed)
  x = r.standard_normal((n * s, 256)) * np.exp(r.uniform(-15, 15, (n * s, 1)))
  x[1] = 0.0
  x[0, :40] = 0.0
  if kind == "nonfinite":
    x[2, 7], x[3, 0], x[3, 255], x[-1, 100] = np.nan, np.inf, -np.inf, np.nan
  if kind == "huge":
    x[2] = r.standard_normal(256) * 2.0**100
    x[-1] = r.standard_normal(256) * 3e38 / 4  # near float32's largest
  return jnp.asarray(x.astype(np.float32))


@functools.partial(jax.jit, static_argnames=("n", "seed"))  # one compile, not op by op
def _keys(n, seed=0):
  k = jnp.arange(n, dtype=jnp.uint32)
  return rng.mix32(k * 2 + seed), rng.mix32(k * 2 + 1 + seed)


def _old_statistics(x, k0, k1, s):
  """What the codec computed before: the guard's scale, then the stats of the guarded rows
  (codecs/_exact.py) and their first encode (SupergroupStats.encode)."""
  x = np.asarray(x)
  finite = np.isfinite(x)
  amax = np.max(np.where(finite, np.abs(x), 0))
  _, e = np.frexp(amax)
  scale = np.float32(2.0 ** min(SAFE - int(e), 0))
  xg = jnp.asarray(np.where(finite, x, 0) * scale)
  row = np.arange(x.shape[0])
  c, j = row // s, jnp.asarray(row % s, jnp.uint32)
  return _old_encode(xg, k0, k1, c, j), amax, float(~finite.all()), xg


@jax.jit  # one compile (eagerly: one per operation)
def _old_encode(xg, k0, k1, c, j):
  mean = tree_sum(xg) / 256
  norm = row_norm(xg - mean[:, None])
  enc = stochastic_bf16(mean, rng.hash_index(k0[c], k1[c], j))
  return jnp.stack([enc, norm.astype(jnp.bfloat16)], axis=-1)


@jax.jit  # one compile (eagerly: one per operation)
def _old_decode_sum(p):
  """The statistics' sum as the codec's decode computed it before (codecs/_exact.py)."""
  q = jnp.moveaxis(p.astype(jnp.float32), 0, -1)
  return jnp.stack([tree_sum(q[..., 0, :]), hypot_all(q[..., 1, :])], axis=-1)


CASES = [(3, 7, "mixed"), (8, 2, "nonfinite"), (4, 5, "huge"), (1, 17, "mixed")]


@pytest.mark.parametrize("n,s,kind", CASES)
def test_guard_stats_kernel_equals_the_reference(n, s, kind):
  x = _rows(n * 10 + s, n, s, kind)
  k0, k1 = _keys(n)
  want = SJ.guard_stats_reference(x, k0, k1, s=s, safe_exponent=SAFE)
  got = SJ.guard_stats_pallas(x, k0, k1, s=s, safe_exponent=SAFE, interpret=True)
  assert len(want) == len(got) == 6
  for name in ("mean", "norm", "rows_amax", "amax", "bad", "centre", "unshift"):
    _same(getattr(want, name), getattr(got, name))


def test_keys_from_a_table_of_chunks_and_steps():
  """Chunk c's key at entry c (n + 1) + hop of flat [n, n + 1] tables (DynamiQ's)."""
  n, s = 4, 3
  x = _rows(9, n, s)
  t0, t1 = (rng.mix32(jnp.arange(n * (n + 1), dtype=jnp.uint32) + v) for v in (1, 99))
  hop = jnp.int32(2)
  want = SJ.guard_stats_reference(x, t0.reshape(n, n + 1)[:, 2], t1.reshape(n, n + 1)[:, 2],
                                 s=s, safe_exponent=SAFE)
  for impl in ("xla", "pallas"):
    got = SJ.guard_stats(x, t0, t1, hop, s=s, safe_exponent=SAFE, stride=n + 1,
                        implementation=impl, interpret=True)
    for a, b in zip(want, got):
      _same(a, b)


@pytest.mark.parametrize("n,s,kind", CASES)
def test_one_pass_equals_the_guard_then_the_statistics(n, s, kind):
  """Votes, the rescaled statistics and the centring means are the guard's, those of the
  guarded bucket and its :func:`row_mean`, bit for bit (huge rows: the bucket is scaled by
  2^-36 or 2^-64, exactly)."""
  x = _rows(n * 10 + s, n, s, kind)
  k0, k1 = _keys(n, seed=5)
  found = SJ.guard_stats(x, k0, k1, s=s, safe_exponent=SAFE)
  amax, bad = found.amax, found.bad
  want, want_amax, want_bad, guarded = _old_statistics(x, k0, k1, s)
  assert float(amax) == want_amax and float(bad) == want_bad
  shift = S.guard_exponent(amax, SAFE)
  _, e = np.frexp(want_amax)
  assert int(shift) == min(SAFE - int(e), 0) and (int(shift) < 0) == (kind == "huge")
  stats, centred = SJ.rescale(found, shift, safe_exponent=SAFE)
  _same(stats, want)
  _same(centred, SJ.row_mean(guarded))


def test_zero_rows_give_zero_statistics_and_bad_rows_count_as_zeros():
  x = np.zeros((4, 256), np.float32)
  x[1, 3] = np.nan
  x[2, :] = np.inf
  x[3, 5] = 2.0
  found = SJ.guard_stats_pallas(jnp.asarray(x), *_keys(2), s=2, safe_exponent=SAFE,
                                interpret=True)
  mean, norm, rows_amax, votes, centre, unshift = found
  assert votes.shape == (2, 1)  # one program of BLOCK rows
  assert float(found.bad) == 1 and float(found.amax) == 2
  np.testing.assert_array_equal(np.asarray(rows_amax), [0, 0, 0, 2])
  np.testing.assert_array_equal(np.asarray(norm)[:3], 0)
  np.testing.assert_array_equal(np.asarray(mean)[:3], 0)
  np.testing.assert_array_equal(np.asarray(centre), [0, 0, 0, 2 / 256])
  np.testing.assert_array_equal(np.asarray(unshift), 1)
  assert float(norm[3]) == float(jnp.asarray(np.sqrt(255 * (2 / 256) ** 2 + (2 - 2 / 256) ** 2),
                                             jnp.bfloat16))


def test_votes_from_every_program_and_none_past_the_end():
  """The kernel's votes are the largest over its programs' (16 rows each): a largest value
  and a NaN in the last, partial program count, and the rows past the end do not."""
  x = np.full((40, 256), 0.5, np.float32)  # 3 programs, the last of 8 rows
  x[37, 9] = -7.0
  got = SJ.guard_stats_pallas(jnp.asarray(x), *_keys(2), s=20, safe_exponent=SAFE,
                              interpret=True)
  assert float(got.amax) == 7.0 and float(got.bad) == 0
  x[38, 0] = np.nan
  got = SJ.guard_stats_pallas(jnp.asarray(x), *_keys(2), s=20, safe_exponent=SAFE,
                              interpret=True)
  assert float(got.amax) == 7.0 and float(got.bad) == 1


def test_shapes_are_checked():
  k0, k1 = _keys(2)
  with pytest.raises(ValueError, match=r"rows \[S, 256\]"):
    S.guard_stats(jnp.zeros((4, 128)), k0, k1, s=2, safe_exponent=SAFE)
  with pytest.raises(ValueError, match=r"S = n s"):
    S.guard_stats(jnp.zeros((5, 256)), k0, k1, s=2, safe_exponent=SAFE)
  with pytest.raises(ValueError, match=r"\[n, s, 2\]"):
    S.stats_sum(jnp.zeros((4, 3), jnp.bfloat16))


def _payloads(n, s, seed=0):
  r = np.random.default_rng(seed)
  means = r.standard_normal((n, s)) * np.exp(r.uniform(-10, 10, (1, s)))
  norms = np.abs(r.standard_normal((n, s))) * np.exp(r.uniform(-10, 10, (1, s)))
  norms[:, 0] = 0.0  # a zero super-group
  p = np.stack([means, norms], axis=-1).astype(np.float32)
  return jnp.asarray(p).astype(jnp.bfloat16)


@pytest.mark.parametrize("n,s", [(8, 300), (2, 5), (1, 3), (4, 1)])
def test_stats_sum_kernel_equals_the_reference_and_the_old_decode_sum(n, s):
  p = _payloads(n, s, seed=n + s)
  want = SJ.stats_sum_reference(p)
  _same(SJ.stats_sum_pallas(p, interpret=True), want)
  _same(want, _old_decode_sum(p))


@pytest.mark.parametrize("n,s", [(8, 300), (2, 5)])
def test_stats_sum_encode_equals_the_sum_then_the_codecs_encode(n, s):
  """The owner's step in one kernel: the bits of SupergroupStats.encode of stats_sum, with
  the key of (chunk, step) from flat [n, n + 1] tables (non-finite sums pass through)."""
  p = _payloads(n, s, seed=3 * n + s)
  p = p.at[0, 1, 0].set(jnp.inf) if n > 2 else p
  t0, t1 = (rng.mix32(jnp.arange(n * (n + 1), dtype=jnp.uint32) + v) for v in (7, 70))
  chunk = jnp.int32(n - 1)
  want = SJ.stats_sum_encode_reference(p, t0, t1, chunk, stride=n + 1, step=n)
  _same(SJ.stats_sum_encode_pallas(p, t0, t1, chunk, stride=n + 1, step=n, interpret=True),
        want)
  tables = DynamiQKeyTables(None, (t0.reshape(n, n + 1), t1.reshape(n, n + 1)))
  keys = dq.codecs.Keys(jnp.uint32(0), jnp.uint32(0), 0, chunk, (jnp.uint32(0),) * 2,
                        tables=tables).at(chunk, n)
  codec = SupergroupStats(implementation="xla")
  old = jax.jit(lambda p: codec.encode(codec.decode_sum(p, None), None, keys))(p)
  _same(want, old)
  assert (n > 2) == bool(np.isinf(np.asarray(want, np.float32)).any())


def test_stats_sum_of_a_rank_count_not_a_power_of_two_falls_back():
  p = _payloads(6, 9)
  with pytest.raises(NotImplementedError, match="n=6"):
    S.stats_sum_pallas(p, interpret=True)
  _same(SJ.stats_sum(p, implementation="pallas", interpret=True), _old_decode_sum(p))


def test_mosaic_takes_the_default_path():
  """No Mosaic GPU form: implementation="mosaic" (the hops') is the default path, here the
  reference, not an error."""
  x = _rows(5, 2, 3)
  for a, b in zip(SJ.guard_stats(x, *_keys(2), s=3, safe_exponent=SAFE, implementation="mosaic"),
                  SJ.guard_stats_reference(x, *_keys(2), s=3, safe_exponent=SAFE)):
    _same(a, b)
  _same(SJ.row_mean(x, implementation="mosaic"), SJ.row_mean_reference(x))


def test_kernels_under_vmap_equal_the_reference():
  x = jnp.stack([_rows(1, 2, 3), _rows(2, 2, 3, "huge")])
  k0, k1 = _keys(2)
  f = lambda impl: jax.jit(jax.vmap(lambda v: S.guard_stats(  # one compile, not op by op
      v, k0, k1, s=3, safe_exponent=SAFE, implementation=impl, interpret=True)))(x)
  for a, b in zip(f("pallas"), f("xla")):
    _same(a, b)


def _compressed_rows(seed, kind):
  """8 ranks' rows of ``_rows`` as one leaf: 8,192 coordinates per rank, the smallest
  bucket DynamiQ compresses over 8 ranks (a smaller one goes as bf16, and no statistics
  kernel would run)."""
  x = np.asarray(_rows(seed, 8, 32, kind)).reshape(8, -1)
  assert dq.codecs.DynamiQ().compresses(x.shape[1], 8)
  return x


@pytest.mark.parametrize("schedule", ["ring", "two_step"])
@pytest.mark.parametrize("kind", ["mixed", "huge", "nonfinite"])
def test_the_all_reduce_with_the_kernels_equals_the_reference(schedule, kind):
  """The whole DynamiQ all-reduce, kernels (interpret mode) against references: the same
  bits on every rank, non-finite and huge buckets included."""
  x = _compressed_rows(7, kind)

  def run(impl):
    codec = dq.codecs.DynamiQ()
    return np.asarray(dq.simulate({"g": x}, codec=codec, schedule=schedule,
                                  implementation=impl)["g"])

  with_kernels = run("pallas")
  ref = run("xla")
  assert rows_identical(ref)
  np.testing.assert_array_equal(_bits(with_kernels), _bits(ref))
  if kind == "nonfinite":
    assert np.isnan(ref).any() and not np.isfinite(ref[:, 0:4 * 256 * 2]).all()
  else:
    assert np.isfinite(ref).all()


class _NoHook(dq.codecs.DynamiQ):
  """DynamiQ with the engine's two-pass guard (no one-pass hook)."""

  def guard_statistics(self, x, bucket, keys, *, safe_exponent):
    del x, bucket, keys, safe_exponent
    return None


@pytest.mark.parametrize("kind", ["mixed", "huge", "nonfinite"])
def test_one_pass_guard_equals_the_two_pass_guard(kind):
  x = _compressed_rows(3, kind)
  one = dq.simulate({"g": x}, codec=dq.codecs.DynamiQ())["g"]
  two = dq.simulate({"g": x}, codec=_NoHook())["g"]
  np.testing.assert_array_equal(_bits(one), _bits(two))


def test_row_mean_kernel_equals_the_reference_and_the_old_mean():
  x = _rows(4, 3, 7, "huge")
  want = SJ.row_mean_reference(x)
  _same(SJ.row_mean_pallas(x, interpret=True), want)
  _same(want, jax.jit(lambda x: tree_sum(x) / 256)(x))  # one compile, not op by op


def test_kernels_lower_for_cuda():
  x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
  k = jax.ShapeDtypeStruct((4,), jnp.uint32)
  text = lower_for("cuda", jax.jit(lambda x, a, b: S.guard_stats(x, a, b, s=16,
                                                                 safe_exponent=SAFE)), x, k, k)
  assert text.count(TRITON) == 1
  p = jax.ShapeDtypeStruct((8, 16, 2), jnp.bfloat16)
  assert lower_for("cuda", jax.jit(S.stats_sum), p).count(TRITON) == 1
  assert TRITON not in lower_for("cpu", jax.jit(S.stats_sum), p)
  assert lower_for("cuda", jax.jit(S.row_mean), x).count(TRITON) == 1
  t = jax.ShapeDtypeStruct((72,), jnp.uint32)
  c = jax.ShapeDtypeStruct((), jnp.int32)
  encode = jax.jit(lambda p, a, b, c: S.stats_sum_encode(p, a, b, c, stride=9, step=8))
  assert lower_for("cuda", encode, p, t, t, c).count(TRITON) == 1
  assert TRITON not in lower_for("cpu", encode, p, t, t, c)


def compile_kernels():
  """The kernels compiled for one H100 (runs in the child), each with the XLA operation
  that follows it in the codec (a program of one custom call alone emits an empty PTX
  module)."""
  [device] = GT.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  x = jax.ShapeDtypeStruct((4096, 256), jnp.float32, sharding=sharding)
  k = jax.ShapeDtypeStruct((8,), jnp.uint32, sharding=sharding)
  p = jax.ShapeDtypeStruct((8, 512, 2), jnp.bfloat16, sharding=sharding)
  out = []
  with GT.gpu_target(device):
    votes = lambda x, a, b: S.guard_stats_pallas(x, a, b, s=512, safe_exponent=SAFE)[3]
    out.append(jax.jit(votes).trace(x, k, k).lower().compile())
    out.append(jax.jit(lambda x: S.row_mean_pallas(x) * 2).trace(x).lower().compile())
    out.append(jax.jit(lambda p: S.stats_sum_pallas(p).astype(jnp.bfloat16)).trace(p).lower()
               .compile())
    t = jax.ShapeDtypeStruct((72,), jnp.uint32, sharding=sharding)
    c = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)
    encode = lambda p, a, b, c: S.stats_sum_encode_pallas(p, a, b, c, stride=9, step=8) * 2
    out.append(jax.jit(encode).trace(p, t, t, c).lower().compile())
  return out


@G.needs_compiler
def test_kernels_compile_for_h100_without_spills():
  with GT.compile_in_child("test_dynamiq_stats:compile_kernels") as build:
    # (XLA also writes an empty PTX module per program: nothing to assemble)
    ptx = [f for f in build.ptx if ".version" in pathlib.Path(f).read_text()]
    report = GT.ptxas_report(ptx, prefix="dynamiq_")
  names = {"dynamiq_guard_stats", "dynamiq_stats_sum", "dynamiq_row_mean",
           "dynamiq_stats_sum_encode"}
  assert names <= set(report), json.dumps(report)
  assert all(report[k]["spill_bytes"] == 0 for k in names), json.dumps(report)


def test_the_guard_scale_is_frexps_power_of_two_over_the_whole_float32_range():
  """``guard.guarded`` builds its scale from the exponent bits of the ranks' largest
  finite magnitude: it must be ``2^min(SAFE - frexp(amax)[1], 0)`` for zero, subnormals,
  normals around the threshold and the largest float32."""
  from dynamiq_jax.engine.guard import guarded
  tiny = np.finfo(np.float32).tiny
  amax = np.array([0.0, tiny / 2**20, tiny / 2, tiny, 1e-30, 0.5, 1.0, 3.0, 2.0**63,
                   np.nextafter(np.float32(2.0**64), np.float32(0)), 2.0**64, 2.0**64 * 1.5,
                   2.0**100, 2.0**127, np.finfo(np.float32).max], np.float32)
  amax = np.concatenate([amax, np.exp2(np.arange(-149, 128, 0.37)).astype(np.float32)])
  scales = jax.jit(jax.vmap(lambda a: guarded(jnp.zeros(()), True, a, 0.0)[2]))(amax)
  expect = np.array([2.0 ** min(SAFE - int(np.frexp(a)[1]), 0) for a in amax], np.float32)
  np.testing.assert_array_equal(np.asarray(scales), expect)
  assert expect.min() < 1.0 and expect.max() == 1.0  # both sides of the threshold
