"""Flattening arbitrary gradient pytrees into buckets and back."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dynamiq_jax as dq
from dynamiq_jax.codecs import DynamiQ, F32
from dynamiq_jax.engine import buckets

from dynamiq_jax.bench.reference import vnmse

from _helpers import model_data, rows_identical

N = 8
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _dyadic(rng, shape, dtype):
  # small integers / 4: every sum of 8 is exact in every float dtype here
  return jnp.asarray(rng.integers(-8, 8, shape).astype(np.float32) / 4, dtype)


@settings(max_examples=12, deadline=None)
@given(shapes=st.lists(st.sampled_from([(), (1,), (3,), (255,), (256,), (257,), (7, 33),
                                        (2, 3, 5), (600,)]), min_size=1, max_size=12),
       dtypes=st.lists(st.sampled_from(range(3)), min_size=12, max_size=12),
       seed=st.integers(0, 100))
def test_any_tree_round_trips_with_shapes_and_dtypes(shapes, dtypes, seed):
  rng = np.random.default_rng(seed)
  tree = {f"leaf{i}": _dyadic(rng, (N,) + s, DTYPES[dtypes[i]]) for i, s in enumerate(shapes)}
  out = dq.simulate(tree, codec=F32(), average=False)
  for k, v in tree.items():
    assert out[k].shape == v.shape and out[k].dtype == v.dtype
    want = np.asarray(v, np.float32).sum(0)
    np.testing.assert_array_equal(np.asarray(out[k], np.float32)[0], want)


def test_many_small_leaves_and_none():
  # 100 leaves: the program's size (and compile time, ~0.07 s a leaf on CPU) grows with
  # the leaves, what this checks does not
  rng = np.random.default_rng(0)
  tree = [{"w": _dyadic(rng, (N, 3), jnp.float32), "skip": None} for _ in range(100)]
  out = dq.simulate(tree, codec=F32(), average=False)
  assert len(out) == 100 and all(o["skip"] is None for o in out)
  for o, t in zip(out, tree):
    np.testing.assert_array_equal(np.asarray(o["w"])[0], np.asarray(t["w"]).sum(0))


def test_empty_tree():
  assert dq.simulate({}, codec=DynamiQ()) == {}


def test_simulate_needs_a_common_worker_axis():
  with pytest.raises(ValueError, match="same leading worker axis"):
    dq.simulate({"a": np.ones((8, 3)), "b": np.ones((4, 3))}, codec=F32())


@pytest.mark.parametrize("bucket_size", [1000, 4096, 1 << 20])
def test_buckets_are_transparent_for_lossless_codecs(bucket_size):
  rng = np.random.default_rng(1)
  tree = {"a": _dyadic(rng, (N, 3000), jnp.float32), "b": _dyadic(rng, (N, 50, 41), jnp.float32)}
  out = dq.simulate(tree, codec=F32(), average=False, bucket_size=bucket_size)
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out[k])[0], np.asarray(tree[k]).sum(0))


@pytest.mark.slow  # .ci/run-slow; TestBudget in test_dynamiq checks wire bits per bucket
def test_dynamiq_buckets_each_meet_the_budget():
  g = model_data("heavy", N, 1 << 18, 0)
  codec = DynamiQ(bits=5)
  stats = dq.wire_stats(g[0], codec=codec, n=N, bucket_size=100_096)
  assert stats.bits_per_coord <= 5.0
  out = dq.simulate(g, codec=codec, bucket_size=100_096)
  assert rows_identical(out)
  assert vnmse(np.asarray(out)[0], g) < 5e-3  # ~1.6e-3 for one bucket of 2^20


def test_buckets_must_hold_whole_supergroups():
  with pytest.raises(ValueError, match=r"bucket_size=100000 must be a positive multiple of 256.*99840"):
    dq.simulate(np.ones((N, 300_000), np.float32), codec=DynamiQ(), bucket_size=100_000)


def test_stats_report_bits_and_bytes():
  tree = {"w": np.zeros((N, 100_000), np.float32)}

  def f(x):  # (the bits alone: XLA drops the reduction, which they do not depend on)
    stats = dq.allreduce(x, axis_name="i", codec=DynamiQ(), key=jax.random.key(0))[1]
    return stats.bits_per_coord

  bits = jax.jit(jax.vmap(f, axis_name="i"))(tree)
  exact = dq.wire_stats({"w": jax.ShapeDtypeStruct((100_000,), jnp.float32)}, codec=DynamiQ(),
                        n=N)
  assert float(bits[0]) == pytest.approx(exact.bits_per_coord)
  assert exact.bits_per_coord <= 5.0
  assert exact.bytes_per_rank == pytest.approx(exact.bits_per_coord * 100_000 / 8 * 2 * 7 / 8)


# -- leaves end to end, in the order the backward pass produces them, cut into equal buckets ----


def _layout(tree, **kw):
  return [[tuple(s) for s in b] for b in dq.bucket_layout(tree, **kw)]


def _shapes(*sizes):
  return [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]


def test_layout_lays_leaves_end_to_end_in_reverse_order():
  # leaves 0..3 of 300, 500, 200, 100 coordinates; buckets of 1200: 1100 coordinates are
  # fewer than 8 quarters (300), so the fewest equal buckets of at most a quarter, 4 of 275,
  # the last no padding
  assert _layout(_shapes(300, 500, 200, 100), bucket_size=1200) == [
      [(3, 0, 100), (2, 0, 175)], [(2, 175, 200), (1, 0, 250)],
      [(1, 250, 500), (0, 0, 25)], [(0, 25, 300)]]


def test_layout_cuts_buckets_of_one_size_and_pads_the_last():
  """One bucket size, so that XLA compiles every kernel of the bucket program once: at
  least MIN_BUCKETS buckets (for the overlap) where each holds a quarter of bucket_size,
  at most bucket_size each; the last padded to the size of the others."""
  assert buckets.MIN_BUCKETS == 8 and buckets.SMALLEST_BUCKET_FRACTION == 4
  # 1450 coordinates, bucket_size 512: 8 buckets of ceil(1450 / 8) = 182 (>= 512 // 4)
  assert _layout(_shapes(100, 1300, 50), bucket_size=512) == [
      [(2, 0, 50), (1, 0, 132)],  # leaf 1 goes on in the next bucket
      [(1, 132, 314)], [(1, 314, 496)], [(1, 496, 678)], [(1, 678, 860)], [(1, 860, 1042)],
      [(1, 1042, 1224)], [(1, 1224, 1300), (0, 0, 100), (buckets.PADDING, 0, 6)]]
  # 5150: 8 buckets would pass 512, so the fewest of at most 512: 11 of 469 (5159)
  assert _layout(_shapes(100, 5000, 50), bucket_size=512)[-1] == [
      (1, 4640, 5000), (0, 0, 100), (buckets.PADDING, 0, 9)]
  assert len(_layout(_shapes(100, 5000, 50), bucket_size=512)) == 11
  # 500: fewer than 8 quarters of 512, so the fewest equal buckets of at most 128: 4 of 125
  assert buckets.bucket_sizes(dq.bucket_layout(_shapes(500), bucket_size=512)) == [125] * 4
  codec = DynamiQ()
  for total in (1000, 3 * (1 << 16) + 17, 5 * (1 << 20) + 4099, 40 * (1 << 20) + 1):
    for bucket_size in (1 << 18, 1 << 20):
      layout = dq.bucket_layout(_shapes(total), codec=codec, bucket_size=bucket_size,
                                max_buckets=None)
      sizes = buckets.bucket_sizes(layout)
      assert len(set(sizes)) == 1 and max(sizes) <= bucket_size, (total, bucket_size, sizes)
      assert buckets.layout_coords(layout) == total
      if total >= buckets.MIN_BUCKETS * bucket_size // 4:
        assert len(layout) >= buckets.MIN_BUCKETS, (total, bucket_size, sizes)
      else:  # the fewest buckets of at most a quarter
        assert len(layout) == -(-total // (bucket_size // 4)), (total, bucket_size, sizes)
      if len(layout) > 1:
        assert sum(s.stop - s.start for s in layout[-1] if s.leaf == buckets.PADDING) < (
            codec.granularity * len(layout))
        assert sizes[0] % codec.granularity == 0


def test_pieces_are_cut_at_runtime_offsets_and_round_trip():
  """Pack and unpack slice every piece at an offset XLA cannot fold (a dynamic-slice fed by
  an optimization barrier): a leaf of one shape cut from buckets at different offsets is
  then one kernel, where constant offsets made one kernel per piece. The padding is zeros
  in, dropped out."""
  from dynamiq_jax.engine.buckets import pack, unpack
  tree = [jnp.arange(700, dtype=jnp.float32) + 1000 * i for i in range(5)]
  layout = dq.bucket_layout(_shapes(*[700] * 5), bucket_size=1024, leaf_order="forward")
  assert layout[-1][-1].leaf == buckets.PADDING
  treedef = jax.tree.structure(tree)

  def round_trip(leaves):
    xs = [pack(leaves, segs, None) for segs in layout]
    return xs, unpack(xs, layout, leaves, treedef)

  text = jax.jit(round_trip).lower(tree).as_text()
  pieces = [(s.stop - s.start, sum(t.stop - t.start for t in b)) for b in layout for s in b
            if s.leaf != buckets.PADDING]
  from_leaves = sum(size < 700 for size, _ in pieces)  # pack: a piece short of its leaf
  from_buckets = sum(size < whole for size, whole in pieces)  # unpack: short of its bucket
  assert from_leaves >= 4 and "stablehlo.slice" not in text
  assert text.count("stablehlo.dynamic_slice") == from_leaves + from_buckets
  xs, out = jax.jit(round_trip)(tree)
  assert [x.shape[0] for x in xs] == buckets.bucket_sizes(layout)
  assert float(jnp.abs(xs[-1][-layout[-1][-1].stop:]).max()) == 0.0
  for a, b in zip(out, tree):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layout_orders_and_their_errors():
  tree = _shapes(10, 20, 30)
  assert _layout(tree, bucket_size=1000, leaf_order="forward") == [
      [(0, 0, 10), (1, 0, 20), (2, 0, 30)]]
  assert _layout(tree, bucket_size=24, leaf_order=[1, 2, 0]) == [  # 8 of 60 / 8 -> 8
      [(1, 0, 8)], [(1, 8, 16)], [(1, 16, 20), (2, 0, 4)], [(2, 4, 12)], [(2, 12, 20)],
      [(2, 20, 28)], [(2, 28, 30), (0, 0, 6)], [(0, 6, 10), (buckets.PADDING, 0, 4)]]
  for bad in ([0, 1], [0, 1, 1], [0, 1, 3], "backward", 3):
    with pytest.raises(ValueError, match=r"leaf_order=.*Fix: pass a permutation of range\(3\)"):
      dq.bucket_layout(tree, leaf_order=bad)


def test_layout_skips_empty_leaves_and_round_trips_them():
  tree = {"a": jnp.zeros((N, 0, 3)), "b": jnp.ones((N, 5)), "c": jnp.zeros((N, 0))}
  assert _layout(jax.tree.map(lambda x: x[0], tree), bucket_size=4) == [
      [(1, 0, 1)], [(1, 1, 2)], [(1, 2, 3)], [(1, 3, 4)], [(1, 4, 5)]]
  out = dq.simulate(tree, codec=F32(), bucket_size=4, average=False)
  assert out["a"].shape == (N, 0, 3) and out["c"].shape == (N, 0)
  np.testing.assert_array_equal(np.asarray(out["b"])[0], np.full(5, N, np.float32))


def test_each_bucket_depends_only_on_its_own_leaves():
  """Changing a leaf of one bucket leaves every other bucket's result bit for bit."""
  rng = np.random.default_rng(3)
  tree = {f"w{i}": jnp.asarray(rng.standard_normal((N, 1536)), jnp.float32)
          for i in range(4)}  # 8 buckets of 768, in reverse order: two of each leaf
  kw = dict(codec=DynamiQ(bits=5), bucket_size=2048)
  layout = dq.bucket_layout(jax.tree.map(lambda x: x[0], tree), **kw)
  assert [[s.leaf for s in b] for b in layout] == [[3], [3], [2], [2], [1], [1], [0], [0]]
  base = dq.simulate(tree, **kw)
  changed = dict(tree, w1=tree["w1"] * 3.0 + 1.0)
  out = dq.simulate(changed, **kw)
  for name in ("w0", "w2", "w3"):
    np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(base[name]))
  assert not np.array_equal(np.asarray(out["w1"]), np.asarray(base["w1"]))


def test_leaf_order_changes_the_buckets_not_the_exact_sum():
  rng = np.random.default_rng(4)
  tree = [_dyadic(rng, (N, s), jnp.float32) for s in (700, 300, 900)]
  for order in (None, "forward", [2, 0, 1]):
    out = dq.simulate(tree, codec=F32(), average=False, bucket_size=1000, leaf_order=order)
    for o, t in zip(out, tree):
      np.testing.assert_array_equal(np.asarray(o)[0], np.asarray(t).sum(0))


def test_wire_stats_and_codec_state_follow_the_layout():
  tree = {"a": jax.ShapeDtypeStruct((5000,), jnp.float32),
          "b": jax.ShapeDtypeStruct((3000,), jnp.float32)}
  codec = dq.codecs.mxfp8()
  layout = dq.bucket_layout(tree, codec=codec, bucket_size=4096)
  state = dq.init_codec_state(tree, codec=codec, n=N, bucket_size=4096)
  assert len(state) == len(layout) == buckets.MIN_BUCKETS
  stats = dq.wire_stats(tree, codec=codec, n=N, bucket_size=4096)
  sizes = [sum(s.stop - s.start for s in b) for b in layout]
  assert sizes == [1024] * 8  # 8000 in MIN_BUCKETS, of whole blocks: b, then a, padded
  bits = sum(codec.wire_bits(d, N) for d in sizes)
  assert stats.bits_per_coord == pytest.approx(bits / 8000)


@pytest.mark.parametrize("bucket_size", [4096, 1 << 20])
def test_scatter_wire_stats_is_what_the_reduce_scatter_reports(bucket_size):
  """Outside of tracing, ``scatter_wire_stats`` counts what ``reduce_scatter`` sends: a
  scattered leaf's rows in buckets of ``bucket_size / n`` per rank, the unscattered
  (odd-shaped) leaf all-reduced."""
  tree = {"a": np.zeros((N, 8 * 700), np.float32), "b": np.zeros((N, 8, 300), np.float32),
          "odd": np.zeros((N, 13), np.float32)}
  codec = DynamiQ()

  def f(x):
    return dq.reduce_scatter(x, axis_name="i", codec=codec, bucket_size=bucket_size,
                             scatter_dimension={"a": 0, "b": 0, "odd": None},
                             key=jax.random.key(0))[1][:3]

  bits, nbytes, coords = jax.jit(jax.vmap(f, axis_name="i"))(tree)
  like = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in tree.items()}
  want = dq.scatter_wire_stats(like, codec=codec, n=N, bucket_size=bucket_size,
                               scatter_dimension={"a": 0, "b": 0, "odd": None})
  assert int(coords[0]) == want.coords == 8 * 700 + 8 * 300 + 13
  assert float(bits[0]) == pytest.approx(want.bits_per_coord, rel=1e-6)
  assert float(nbytes[0]) == pytest.approx(want.bytes_per_rank, rel=1e-6)


def test_max_buckets_grows_the_buckets():
  tree = _shapes(*([1000] * 40))
  assert len(dq.bucket_layout(tree, bucket_size=1024, max_buckets=None)) == 40
  layout = dq.bucket_layout(tree, bucket_size=1024, max_buckets=8)
  assert len(layout) <= 8
  covered = collections.Counter()
  for b in layout:
    for s in b:
      covered[s.leaf] += s.stop - s.start
  assert covered == {leaf: 1000 for leaf in range(40)}  # every coordinate, once
  codec = DynamiQ()
  big = dq.bucket_layout(_shapes(10_000_000), codec=codec, bucket_size=1 << 20, max_buckets=4)
  assert len(big) <= 4 and big[-1][-2].stop == 10_000_000 and big[-1][-1].leaf == buckets.PADDING
  assert all(s.stop % codec.granularity == 0 for b in big[:-1] for s in b)  # whole super-groups
  with pytest.raises(ValueError, match="max_buckets=0 must be a positive integer"):
    dq.bucket_layout(tree, max_buckets=0)


def test_hops_run_in_loops_on_cpu_and_unrolled_elsewhere_with_the_same_bits(mesh, monkeypatch):
  """XLA:CPU keeps the ring's hops in a loop; a platform with asynchronous
  collectives gets them unrolled (one collective-permute per hop in the entry
  program), and the results are the same bits."""
  from dynamiq_jax.schedules import executor

  rng = np.random.default_rng(3)
  grads = {"a": rng.normal(size=(N, 3000)).astype(np.float32),
           "b": rng.normal(size=(N, 700)).astype(np.float32)}
  sharded = jax.device_put(grads, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))

  def step(tree):
    local = jax.tree.map(lambda a: a[0], tree)
    out, _ = dq.allreduce(local, axis_name="data", codec=DynamiQ(), key=jax.random.key(0))
    return jax.tree.map(lambda a: a[None], out)

  def run():
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=jax.sharding.PartitionSpec("data"),
                              out_specs=jax.sharding.PartitionSpec("data"), check_vma=False))
    text = f.lower(sharded).as_text()
    return text, f(sharded)

  looped_text, looped = run()
  monkeypatch.setattr(executor, "LOOP_PLATFORMS", ())
  unrolled_text, unrolled = run()
  hops = lambda t: t.count("collective_permute")
  assert "stablehlo.while" in looped_text and "stablehlo.while" not in unrolled_text
  # a ring of 8 makes 7 payload hops: each its own collective-permute when
  # unrolled, one in the loop body otherwise
  assert hops(unrolled_text) >= N - 1 > hops(looped_text)
  for k in grads:
    np.testing.assert_array_equal(np.asarray(looped[k]).view(np.uint32),
                                  np.asarray(unrolled[k]).view(np.uint32))
  assert rows_identical(looped)


def test_large_buckets_hold_whole_super_groups_for_every_n_dividing_64():
  """Buckets of ALIGN_FROM coordinates or more are cut at multiples of ALIGN: DynamiQ then
  splits each into n chunks of whole super-groups with no padding of its own (a copy of
  the bucket) for n | 64; the layout's own zeros stay below 0.4% of a bucket, no bucket
  passes bucket_size, and smaller buckets are cut as before (at the block)."""
  from dynamiq_jax.engine import buckets as B
  codec = DynamiQ()
  tree = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in (50_000_017, 33_333_333, 7_777_777)]
  for bucket_size in (B.DEFAULT_BUCKET_SIZE, 24_999_936):  # (PyTorch DDP's 25 MB, in blocks)
    sizes = B.bucket_sizes(dq.bucket_layout(tree, codec=codec, bucket_size=bucket_size))
    assert len(sizes) < B.DEFAULT_MAX_BUCKETS and max(sizes) <= bucket_size, sizes
    assert all(d >= B.ALIGN_FROM and d % B.ALIGN == 0 for d in sizes), sizes
    assert sum(sizes) - sum(t.size for t in tree) < 0.004 * min(sizes) * len(sizes)
    for d in set(sizes):
      for n in (2, 4, 8, 16, 32, 64):
        assert codec.layout(d, n).padded_supergroups * 256 == d, (d, n)
  small = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in (3000, 700)]
  # 3,700 coordinates: MIN_BUCKETS equal buckets of whole blocks (3,700 / 8 -> 512)
  assert B.bucket_sizes(dq.bucket_layout(small, codec=codec, bucket_size=1024)) == [512] * 8
