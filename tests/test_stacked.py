"""allreduce(stacked=...): the stacked gradient of scanned layers, reduced in loops."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynamiq_jax as dq
from dynamiq_jax.engine import stacked
from dynamiq_jax.engine.options import Bucketing
from dynamiq_jax.codecs import Bf16, DynamiQ, F32, MX
from dynamiq_jax.schedules.context import varying_axes

from _helpers import per_rank, rows_identical

N = 8
KEY = jax.random.key(3)


def _tree(rng, layers=3, width=70, embed=1000):
  """Per-rank gradients [N, ...] of a scanned model: stacked layers, an embedding, a norm."""
  return {"layers": {"w": rng.standard_normal((N, layers, 96, width)).astype(np.float32),
                     "b": jnp.asarray(rng.standard_normal((N, layers, width)), jnp.bfloat16)},
          "embed": rng.standard_normal((N, embed)).astype(np.float32),
          "norm": rng.standard_normal((N, 5)).astype(np.float32)}


def _reduce(codec, stacked="layers", schedule="ring", bucket_size=4096, **kw):
  def fn(tree):
    return dq.allreduce(tree, axis_name="data", codec=codec, schedule=schedule, key=KEY,
                        bucket_size=bucket_size, stacked=stacked, **kw)
  return fn


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _mean(tree):
  return jax.tree.map(lambda a: np.asarray(a, np.float32).mean(0), tree)


def _vnmse(out, tree):
  ex = _mean(tree)
  err = sum(float(np.sum((np.asarray(o[0], np.float32) - e) ** 2))
            for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(ex)))
  return err / sum(float(np.sum(e * e)) for e in jax.tree.leaves(ex))


class TestExact:

  @pytest.mark.parametrize("schedule", ["ring", "butterfly"])
  def test_f32_mean(self, mesh, schedule):
    tree = _tree(np.random.default_rng(0))
    out = _host(per_rank(mesh, lambda t: _reduce(F32(), schedule=schedule)(t)[0], tree))
    assert rows_identical(out)
    for o, e, a in zip(jax.tree.leaves(out), jax.tree.leaves(_mean(tree)),
                       jax.tree.leaves(tree)):
      assert o.dtype == a.dtype and o.shape == a.shape
      tol = 1e-2 if a.dtype == jnp.bfloat16 else 1e-6
      np.testing.assert_allclose(np.asarray(o[0], np.float32), e, rtol=tol, atol=tol)

  def test_empty_leaves(self):
    tree = {**_tree(np.random.default_rng(7)), "none": np.zeros((N, 0), np.float32)}
    tree["layers"]["none"] = np.zeros((N, 3, 0), np.float32)
    out = _host(dq.simulate(tree, codec=F32(), bucket_size=4096, stacked="layers"))
    assert out["none"].shape == (N, 0) and out["layers"]["none"].shape == (N, 3, 0)
    np.testing.assert_allclose(out["layers"]["w"][0], _mean(tree)["layers"]["w"], rtol=1e-6,
                               atol=1e-6)

  def test_own_contribution(self, mesh):
    tree = _tree(np.random.default_rng(2))
    own = _host(per_rank(mesh, lambda t: _reduce(F32(), return_own=True)(t)[1].own, tree))
    for o, a in zip(jax.tree.leaves(own), jax.tree.leaves(tree)):
      np.testing.assert_allclose(np.asarray(o), np.asarray(a, np.float32), rtol=1e-6)


class TestCompressed:

  def test_dynamiq_as_accurate_as_unrolled(self, mesh):
    # 49,664 coordinates per layer, 31,744 others: equal buckets pad each group a little
    # (the unrolled layout's 8 buckets of 16,384 hold whole super-groups in every chunk, so
    # that they are compressed, as the loops' are)
    tree = _tree(np.random.default_rng(4), layers=2, width=512, embed=31739)
    looped, stats = _host(per_rank(mesh, _reduce(DynamiQ(), bucket_size=1 << 15), tree))
    unrolled, _ = _host(per_rank(mesh, _reduce(DynamiQ(), stacked=None, bucket_size=1 << 15),
                                 tree))
    assert rows_identical(looped)
    ratio = _vnmse(looped, tree) / _vnmse(unrolled, tree)
    assert 0.5 < ratio < 2.0, ratio
    one = jax.tree.map(lambda a: a[0], tree)
    want = dq.wire_stats(one, codec=DynamiQ(), n=N, bucket_size=1 << 15, stacked="layers")
    assert float(stats.bits_per_coord[0]) == pytest.approx(want.bits_per_coord, rel=1e-6)
    assert float(stats.bytes_per_rank[0]) == want.bytes_per_rank
    assert int(stats.coords[0]) == want.coords == sum(a[0].size for a in jax.tree.leaves(tree))
    # what equal buckets add is their padding: per coordinate sent, no more bits than the
    # unrolled buckets'
    plain = dq.wire_stats(one, codec=DynamiQ(), n=N, bucket_size=1 << 15)
    shapes = [a.shape for a in jax.tree.leaves(one)]
    flags = ["layers" in jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_leaves_with_path(one)]
    size = Bucketing.build(DynamiQ(), 1 << 15).loop_size(shapes, flags, N)
    sizes, coords = stacked.loop_sizes(shapes, flags, size)
    assert coords == want.coords and sum(sizes) > coords
    assert want.bits_per_coord * coords / sum(sizes) <= plain.bits_per_coord * 1.001

  def test_padding_at_scale(self):
    """A 1.3 B transformer's stacked layers (scale.py's shapes) at the default bucket size:
    under 1% of padding, and the default's 5 bits per coordinate."""
    from dynamiq_jax.bench.scale import model_shapes
    shapes = model_shapes(24, 2048, 8192, 32000, scan=True)
    looped = dq.wire_stats(shapes, codec=DynamiQ(), n=N, stacked="layers")
    plain = dq.wire_stats(shapes, codec=DynamiQ(), n=N)
    assert looped.coords == plain.coords
    assert looped.bits_per_coord <= plain.bits_per_coord * 1.01
    assert looped.bits_per_coord == pytest.approx(5.0, abs=0.03)

  def test_simulate_is_the_distributed_code(self, mesh):
    tree = _tree(np.random.default_rng(5), width=300)
    dist, _ = _host(per_rank(mesh, _reduce(DynamiQ(), bucket_size=1 << 14), tree))
    sim = dq.simulate(tree, codec=DynamiQ(), key=KEY, bucket_size=1 << 14, stacked="layers")
    for a, b in zip(jax.tree.leaves(dist), jax.tree.leaves(sim)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  def test_compressed_psum_under_check_vma(self, mesh):
    tree = _tree(np.random.default_rng(6), width=300)
    tx = optax.chain(dq.compressed_psum("data", stacked="layers", bucket_size=1 << 14,
                                        codec=Bf16(), error_feedback=True), optax.sgd(1.0))

    def step(local):
      updates, _ = tx.update(local, tx.init(local), local)
      # typed as identical on every rank, as the unrolled reduction's: out_specs=P() works
      assert all(not varying_axes(u) for u in jax.tree.leaves(updates))
      return updates

    out = _host(per_rank(mesh, step, tree, check_vma=True))
    assert rows_identical(out)
    for o, e in zip(jax.tree.leaves(out), jax.tree.leaves(_mean(tree))):
      np.testing.assert_allclose(-np.asarray(o[0], np.float32), e, rtol=2e-2, atol=2e-2)


def test_one_program_whatever_the_layers():
  """The compiled reduction does not grow with the number of layers (it does unrolled)."""

  def compiled_size(layers, stacked):
    tree = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        _tree(np.random.default_rng(0), layers=layers, width=128))
    fn = jax.jit(jax.vmap(lambda t: _reduce(DynamiQ(), stacked=stacked,
                                            bucket_size=1 << 15)(t)[0], axis_name="data"))
    return len(fn.lower(tree).compile().as_text().splitlines())

  looped = [compiled_size(layers, "layers") for layers in (2, 6)]
  unrolled = [compiled_size(layers, None) for layers in (2, 6)]
  assert looped[0] == looped[1], looped
  assert unrolled[1] > 1.5 * unrolled[0], unrolled


class TestErrors:

  def test_leaf_without_layer_axis(self, mesh):
    tree = _tree(np.random.default_rng(0))
    with pytest.raises(ValueError, match="no leading axis"):
      per_rank(mesh, lambda t: _reduce(F32(), stacked=lambda path, leaf: leaf.ndim == 0
                                       or "norm" in jax.tree_util.keystr(path))(
          {**t, "norm": t["norm"][0]})[0], tree)

  def test_different_layer_axes(self):
    tree = {"a": jnp.zeros((N, 3, 4)), "b": jnp.zeros((N, 2, 4))}
    with pytest.raises(ValueError, match="leading axes differ"):
      dq.simulate(tree, codec=F32(), stacked=lambda path, leaf: True)

  def test_stateful_codec(self):
    with pytest.raises(ValueError, match="keeps state"):
      dq.compressed_psum("data", codec=MX(scale="bf16"), stacked="layers")

  def test_hierarchical(self):
    tree = {"layers": jnp.zeros((N, 3, 4))}
    with pytest.raises(ValueError, match="flat schedules"):
      dq.simulate(tree, codec=F32(), schedule="hierarchical", mesh_shape=(2, 4),
                  stacked="layers")

  def test_bad_type(self):
    with pytest.raises(TypeError, match="stacked=3"):
      dq.wire_stats({"a": jnp.zeros((3, 4))}, codec=F32(), n=2, stacked=3)
