"""The compressed collectives on meshes that also shard the model (8 simulated CPU devices).

Meshes (4, 2) and (2, 4) ("data", "model") and (2, 2, 2) ("data", "fsdp", "tensor");
leaves replicated, tensor-sharded (the last dimension over the tensor axis) and
FSDP-sharded (the first over the fsdp axis; "model" on the 2-axis meshes), with
Explicit and Auto axis types.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.bench import hlo
from dynamiq_jax.codecs import DynamiQ, F32
from dynamiq_jax.train import partial_manual

MESHES = {
    "4x2": ((4, 2), ("data", "model"), "model", "model"),
    "2x4": ((2, 4), ("data", "model"), "model", "model"),
    "2x2x2": ((2, 2, 2), ("data", "fsdp", "tensor"), "tensor", "fsdp"),
}
TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _mesh(name, kind):
  shape, names, _, _ = MESHES[name]
  return jax.make_mesh(shape, names, axis_types=(TYPES[kind],) * len(shape))


def _specs(name):
  """Leaf specs over the model axes: replicated, tensor-sharded, FSDP-sharded, both."""
  _, _, tensor, fsdp = MESHES[name]
  both = P(fsdp, tensor) if fsdp != tensor else P(None, tensor)
  return {"repl": P(), "tensor": P(None, tensor), "fsdp": P(fsdp, None), "both": both,
          "bias": P(tensor)}


def _grads(n, seed=0, dyadic=True):
  rng = np.random.default_rng(seed)
  shapes = {"repl": (24, 40), "tensor": (24, 40), "fsdp": (24, 40), "both": (16, 64),
            "bias": (40,)}
  if dyadic:  # every partial sum exact: any summation order agrees
    return {k: rng.integers(-1000, 1000, (n,) + s).astype(np.float32) / 1024
            for k, s in shapes.items()}
  return {k: rng.standard_normal((n,) + s).astype(np.float32) for k, s in shapes.items()}


def _per_data_rank(mesh, fn, stacked, specs):
  """``fn(local tree)`` inside a shard_map manual over "data" only; leaf r of the data
  axis is ``stacked[r]``, sharded over the model axes as ``specs`` say. Returns the
  outputs stacked over the data axis (and the jitted function, for its HLO)."""
  full = jax.tree.map(lambda s: P("data", *s), specs, is_leaf=lambda x: isinstance(x, P))
  shard = jax.tree.map(lambda s: NamedSharding(mesh, s), full, is_leaf=lambda x: isinstance(x, P))

  def body(tree):
    out = fn(jax.tree.map(lambda a: a[0], tree))
    return jax.tree.map(lambda a: a[None], out)

  data = jax.tree.map(lambda _: P("data"), specs, is_leaf=lambda x: isinstance(x, P))
  f = jax.jit(partial_manual(body, mesh=mesh, manual=("data",), in_specs=(data,),
                             out_specs=data, out_shardings=shard, check_vma=False))
  x = jax.device_put(stacked, shard)
  return f(x), f, x


def _data_only(found, what):
  bad = [c for c in found if set(c.axes) - {"data"}]
  assert not bad, f"{what}: collectives over other axes: {[(c.op, c.axes, c.shape) for c in bad]}"


class TestAllreduceOnShards:

  @pytest.mark.parametrize("kind", ["explicit", "auto"])
  @pytest.mark.parametrize("name", list(MESHES))
  def test_f32_equals_pmean_and_talks_over_data_only(self, name, kind):
    mesh = _mesh(name, kind)
    n = mesh.shape["data"]
    specs = _specs(name)
    g = _grads(n)
    pass_specs = specs if kind == "auto" else None
    out, f, x = _per_data_rank(
        mesh, lambda t: dq.allreduce(t, axis_name="data", codec=F32(), key=jax.random.key(0),
                                     specs=pass_specs)[0], g, specs)
    for k in g:
      got = np.asarray(out[k])
      assert (got == got[:1]).all(), f"{k}: data ranks differ"  # replicas bit-identical
      np.testing.assert_array_equal(got[0], g[k].mean(0), err_msg=k)
    _data_only(hlo.collectives(f.lower(x).compile().as_text(), mesh), f"{name} {kind}")

  def test_auto_axes_without_specs_is_an_error_naming_the_fix(self):
    mesh = _mesh("4x2", "auto")
    with pytest.raises(ValueError, match=r"specs=.*Explicit"):
      _per_data_rank(mesh, lambda t: dq.allreduce(t, axis_name="data", codec=F32(),
                                                  key=jax.random.key(0))[0],
                     _grads(4), _specs("4x2"))

  def test_stateful_codec_on_sharded_leaves_is_an_error(self):
    mesh = _mesh("4x2", "explicit")
    with pytest.raises(ValueError, match="keeps state"):
      _per_data_rank(mesh, lambda t: dq.allreduce(t, axis_name="data", codec=dq.codecs.mxfp8(),
                                                  key=jax.random.key(0))[0],
                     _grads(4), _specs("4x2"))

  @pytest.mark.skipif(jax.__version_info__ < (0, 12), reason=(
      "jax < 0.12 gathers Explicit model axes at the boundary of a partial-manual shard_map "
      "itself (dq.data_parallel_step works around it; see train.partial_manual)"))
  def test_plain_shard_map_explicit_has_no_model_gathers(self):
    mesh = _mesh("4x2", "explicit")
    specs = _specs("4x2")
    g = jax.device_put(_grads(4), jax.tree.map(lambda s: NamedSharding(mesh, P("data", *s)),
                                               specs, is_leaf=lambda x: isinstance(x, P)))

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                       axis_names={"data"}, check_vma=False)
    def f(t):
      t = jax.tree.map(lambda a: a[0], t)
      return jax.tree.map(lambda a: a[None], dq.allreduce(t, axis_name="data", codec=F32(),
                                                          key=jax.random.key(0))[0])

    _data_only(hlo.collectives(f.lower(g).compile().as_text(), mesh), "jax.shard_map")

  @pytest.mark.parametrize("seed", [0, 1, 2])
  def test_dynamiq_on_shards_is_the_1d_run_on_the_same_shards(self, seed):
    # Each model rank all-reduces its own shards over the data axis: bit for bit the
    # 1-D run (dq.simulate) on the tree of those shards, so its vNMSE is that run's.
    mesh = _mesh("4x2", "explicit")
    specs = _specs("4x2")
    g = _grads(4, seed, dyadic=False)
    codec = DynamiQ(bits=5)
    key = jax.random.key(seed)
    out, _, _ = _per_data_rank(mesh, lambda t: dq.allreduce(t, axis_name="data", codec=codec,
                                                           key=key)[0], g, specs)
    errs = []
    for m in range(2):  # model rank m's shards
      local = {k: _local(g[k], specs[k], m) for k in g}
      want = dq.simulate(local, codec=codec, key=key)
      for k in g:
        got = _local(np.asarray(out[k]), specs[k], m)
        np.testing.assert_array_equal(got, np.asarray(want[k]), err_msg=f"{k}, model rank {m}")
      errs.append(sum(float(((np.asarray(want[k])[0] - local[k].mean(0)) ** 2).sum())
                      for k in g) / sum(float((local[k].mean(0) ** 2).sum()) for k in g))
    assert all(1e-4 < e < 0.1 for e in errs), errs  # DynamiQ's error, not a lossless copy


def _local(stacked, spec, m):
  """Model rank m's shard of a [n, ...] array sharded over "model" as ``spec`` says."""
  out = stacked
  for dim, entry in enumerate(tuple(spec)):
    if entry is not None:
      size = out.shape[dim + 1] // 2
      out = np.take(out, np.arange(m * size, (m + 1) * size), axis=dim + 1)
  return out


class TestReduceScatter:

  @pytest.mark.parametrize("name", list(MESHES))
  def test_f32_equals_psum_scatter_on_model_sharded_meshes(self, name):
    mesh = _mesh(name, "auto")
    n = mesh.shape["data"]
    specs = _specs(name)
    g = _grads(n)
    _, _, tensor, fsdp = MESHES[name]
    # scatter a dimension no model axis shards; all-reduce the 1-D bias whole
    dims = {"repl": 0, "tensor": 0, "fsdp": 1, "both": None if fsdp != tensor else 0,
            "bias": None}

    def fn(t):
      out, _ = dq.reduce_scatter(t, axis_name="data", codec=F32(), key=jax.random.key(0),
                                 scatter_dimension=dims, specs=specs)
      ref = {k: (jax.lax.psum_scatter(t[k], "data", scatter_dimension=d, tiled=True) / n
                 if d is not None else jax.lax.pmean(t[k], "data")) for k, d in dims.items()}
      return out, ref

    def body(t):
      out, ref = fn(t)
      return {k: out[k] for k in out}, ref

    full = jax.tree.map(lambda s: P("data", *s), specs, is_leaf=lambda x: isinstance(x, P))
    x = jax.device_put(g, jax.tree.map(lambda s: NamedSharding(mesh, s), full,
                                       is_leaf=lambda x: isinstance(x, P)))
    f = jax.jit(jax.shard_map(
        lambda t: jax.tree.map(lambda a: a[None], body(jax.tree.map(lambda a: a[0], t))),
        mesh=mesh, in_specs=(P("data"),), out_specs=P("data"), axis_names={"data"},
        check_vma=False))
    out, ref = f(x)
    for k in g:
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]), err_msg=k)
    _data_only(hlo.collectives(f.lower(x).compile().as_text(), mesh), name)

  def test_scattering_a_model_sharded_dimension_is_an_error(self):
    mesh = _mesh("4x2", "auto")
    specs = _specs("4x2")
    with pytest.raises(ValueError, match="sharded over 'model' on dimension 1"):
      _per_data_rank(mesh, lambda t: dq.reduce_scatter(
          t, axis_name="data", codec=F32(), key=jax.random.key(0), scatter_dimension=1,
          specs=specs)[0], {"tensor": _grads(4)["tensor"]}, {"tensor": specs["tensor"]})


class TestHierarchicalScatter:

  def test_hsdp_f32_exact_and_no_gather_inside_the_host(self):
    mesh = jax.make_mesh((2, 4), ("host", "local"))
    g = _grads(8)
    dims = {"repl": 0, "tensor": 1, "fsdp": 0, "both": 1, "bias": 0}

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(("host", "local")),
                       out_specs=P(("host", "local")), check_vma=False)
    def f(t):
      t = jax.tree.map(lambda a: a[0], t)
      out, _ = dq.reduce_scatter(t, axis_name=("host", "local"), codec=F32(),
                                 key=jax.random.key(0), scatter_dimension=dims,
                                 schedule="hierarchical")
      return jax.tree.map(lambda a: a[None], out)

    x = jax.device_put(g, NamedSharding(mesh, P(("host", "local"))))
    out = jax.tree.map(np.asarray, f(x))
    for k, d in dims.items():
      mean = g[k].mean(0)
      for r in range(8):
        want = mean if d is None else np.split(mean, 4, axis=d)[r % 4]
        np.testing.assert_array_equal(out[k][r], want, err_msg=f"{k} rank {r}")
    found = hlo.collectives(f.lower(x).compile().as_text(), mesh)
    assert not [c for c in found if c.op == "all-gather" and "local" in c.axes], hlo.summary(found)
    assert any(c.op == "all-gather" and c.axes == ("host",) for c in found)  # the codec's
