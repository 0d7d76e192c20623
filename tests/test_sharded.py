"""The compressed collectives on meshes that also shard the model (8 simulated CPU devices).

Meshes (4, 2) and (2, 4) ("data", "model") and (2, 2, 2) ("data", "fsdp", "tensor");
leaves replicated, tensor-sharded (the last dimension over the tensor axis) and
FSDP-sharded (the first over the fsdp axis; "model" on the 2-axis meshes), with
Explicit and Auto axis types.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.bench import hlo
from dynamiq_jax.codecs import DynamiQ, F32, GlobalQSGD
from dynamiq_jax.training.train import partial_manual
from dynamiq_jax.training.train import _EXPLICIT_PARTIAL_MANUAL_KEEPS_SHARDING as _KEEPS_EXPLICIT

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


def _grads(n, seed=0, dyadic=True, scale=1):
  rng = np.random.default_rng(seed)
  shapes = {"repl": (24, 40), "tensor": (24, 40), "fsdp": (24, 40), "both": (16, 64),
            "bias": (40,)}
  shapes = {k: tuple(scale * v for v in s) for k, s in shapes.items()}
  if dyadic:  # every partial sum exact: any summation order agrees
    return {k: rng.integers(-1000, 1000, (n,) + s).astype(np.float32) / 1024
            for k, s in shapes.items()}
  return {k: rng.standard_normal((n,) + s).astype(np.float32) for k, s in shapes.items()}


def _per_data_rank(mesh, fn, stacked, specs, *args):
  """``fn(local tree, *args)`` inside a shard_map manual over "data" only; leaf r of the
  data axis is ``stacked[r]``, sharded over the model axes as ``specs`` say; ``args`` are
  replicated (e.g. raw key words: a new key does not recompile). Returns the outputs
  stacked over the data axis, the jitted function and its arguments (for its HLO)."""
  full = jax.tree.map(lambda s: P("data", *s), specs, is_leaf=lambda x: isinstance(x, P))
  shard = jax.tree.map(lambda s: NamedSharding(mesh, s), full, is_leaf=lambda x: isinstance(x, P))

  def body(tree, *rest):
    out = fn(jax.tree.map(lambda a: a[0], tree), *rest)
    return jax.tree.map(lambda a: a[None], out)

  data = jax.tree.map(lambda _: P("data"), specs, is_leaf=lambda x: isinstance(x, P))
  f = jax.jit(partial_manual(body, mesh=mesh, manual=("data",),
                             in_specs=(data,) + tuple(P() for _ in args), out_specs=data,
                             out_shardings=shard, check_vma=False))
  x = jax.device_put(stacked, shard)
  return f(x, *args), f, (x, *args)


def _data_only(found, what):
  bad = [c for c in found if set(c.axes) - {"data"}]
  assert not bad, f"{what}: collectives over other axes: {[(c.op, c.axes, c.shape) for c in bad]}"


class TestAllreduceOnShards:

  @pytest.mark.parametrize("name,kind", [("4x2", "explicit"), ("2x4", "auto"),
                                         ("2x2x2", "explicit"), ("2x2x2", "auto")])
  def test_f32_equals_pmean_and_talks_over_data_only(self, name, kind):
    mesh = _mesh(name, kind)
    n = mesh.shape["data"]
    specs = _specs(name)
    g = _grads(n)
    # Explicit axes carry the specs in the leaves' types, unless this jax makes them Auto
    # around a partial-manual shard_map (train.partial_manual); then pass them, as
    # dq.data_parallel_step does.
    pass_specs = None if kind == "explicit" and _KEEPS_EXPLICIT else specs
    out, f, args = _per_data_rank(
        mesh, lambda t: dq.allreduce(t, axis_name="data", codec=F32(), key=jax.random.key(0),
                                     specs=pass_specs)[0], g, specs)
    for k in g:
      got = np.asarray(out[k])
      assert (got == got[:1]).all(), f"{k}: data ranks differ"  # replicas bit-identical
      np.testing.assert_array_equal(got[0], g[k].mean(0), err_msg=k)
    _data_only(hlo.collectives(f.lower(*args).compile().as_text(), mesh), f"{name} {kind}")

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
                                                  key=jax.random.key(0), specs=_specs("4x2"))[0],
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

  @pytest.mark.parametrize("codec", [
      DynamiQ(bits=5),
      # the same sharded path (keys, metadata, hops) with another codec's compile: .ci/run-slow
      pytest.param(GlobalQSGD(), marks=pytest.mark.slow)], ids=["dynamiq", "globalqsgd"])
  def test_lossy_codec_on_shards_is_the_1d_run_on_the_same_shards(self, codec):
    # Each model rank all-reduces its own shards over the data axis: bit for bit the 1-D
    # run (dq.simulate) on those shards, so its vNMSE is that run's, seed by seed. (The
    # leaves are all sharded over "model": one sharding group, the caller's key; the
    # grouping is tested below.)
    mesh = _mesh("2x4", "explicit")
    specs = {k: v for k, v in _specs("2x4").items() if k != "repl"}
    run = None
    errs = []
    for seed in range(3):
      g = {k: v for k, v in _grads(2, seed, dyadic=False, scale=2).items() if k in specs}
      key = jax.random.key(seed)
      words = jax.random.key_data(key)
      if run is None:  # compiled once: the key is an argument
        out, run, _ = _per_data_rank(mesh, lambda t, k: dq.allreduce(
            t, axis_name="data", codec=codec, key=k, specs=specs)[0], g, specs, words)
      else:
        out = run(jax.device_put(g, jax.tree.map(lambda a: a.sharding, out)), words)
      for m in range(4):  # model rank m's shards
        local = {k: _local(g[k], specs[k], m, parts=4) for k in g}
        if isinstance(codec, DynamiQ):
          assert codec.compresses(sum(v[0].size for v in local.values()), 2)  # not bf16
        want = dq.simulate(local, codec=codec, key=key)
        got = {k: _local(np.asarray(out[k]), specs[k], m, parts=4) for k in g}
        for k in g:
          np.testing.assert_array_equal(got[k], np.asarray(want[k]), err_msg=f"{k}, rank {m}")
        errs.append(_vnmse(got, local))
    assert all(1e-5 < e < 0.1 for e in errs), errs  # the codec's error, not a lossless copy

  @pytest.mark.parametrize("grouped", [True, False])
  @pytest.mark.parametrize("op", ["allreduce", "reduce_scatter"])
  def test_replicated_leaves_agree_across_model_ranks(self, op, grouped, monkeypatch):
    # GlobalQSGD scales a bucket by its largest coordinate: a replicated leaf bucketed
    # with sharded ones would be scaled differently on each model rank. Reduced in
    # sharding groups, each block comes out the same on every device that holds it;
    # with the grouping switched off (negative control) it does not.
    if not grouped:
      one = lambda specs: [((), list(range(len(specs))))]
      monkeypatch.setattr(importlib.import_module("dynamiq_jax.engine.programs"), "sharding_groups", one)
    mesh = _mesh("2x2x2", "explicit")
    specs = _specs("2x2x2")
    g = _grads(2, 0, dyadic=False)
    g["fsdp"] *= 100  # the largest coordinates differ between the model ranks' shards
    codec = GlobalQSGD()
    if op == "allreduce":
      fn = lambda t: dq.allreduce(t, axis_name="data", codec=codec, key=jax.random.key(0),
                                  specs=specs)[0]
    else:
      fn = lambda t: dq.reduce_scatter(t, axis_name="data", codec=codec, key=jax.random.key(0),
                                       scatter_dimension=None, specs=specs)[0]
    out, _, _ = _per_data_rank(mesh, fn, g, specs)
    differ = []
    for k, spec in specs.items():
      copies = {}
      for shard in out[k].addressable_shards:  # the devices holding the same block
        copies.setdefault(str(shard.index), []).append(np.asarray(shard.data))
      assert max(len(v) for v in copies.values()) > 1 or k == "both", k
      differ += [k for arrays in copies.values() for a in arrays[1:]
                 if not np.array_equal(a, arrays[0])]
    if grouped:
      assert not differ, differ
    else:
      assert "repl" in differ, differ


def _vnmse(out, stacked):
  """sum ||rank 0's result - mean||^2 / sum ||mean||^2 over the leaves."""
  return sum(float(((np.asarray(out[k])[0] - stacked[k].mean(0)) ** 2).sum()) for k in out) / (
      sum(float((stacked[k].mean(0) ** 2).sum()) for k in out))


def _local(stacked, spec, m, parts=2):
  """Model rank m's shard of a [n, ...] array sharded over "model" (``parts`` ranks) as
  ``spec`` says."""
  out = stacked
  for dim, entry in enumerate(tuple(spec)):
    if entry is not None:
      size = out.shape[dim + 1] // parts
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

    def ours(t):
      return dq.reduce_scatter(t, axis_name="data", codec=F32(), key=jax.random.key(0),
                               scatter_dimension=dims, specs=specs)[0]

    def ref(t):  # lax.psum_scatter itself gathers the model axes here: not HLO-checked
      return {k: (jax.lax.psum_scatter(t[k], "data", scatter_dimension=d, tiled=True) / n
                  if d is not None else jax.lax.pmean(t[k], "data")) for k, d in dims.items()}

    def per_rank(fn):
      return jax.jit(jax.shard_map(
          lambda t: jax.tree.map(lambda a: a[None], fn(jax.tree.map(lambda a: a[0], t))),
          mesh=mesh, in_specs=(P("data"),), out_specs=P("data"), axis_names={"data"},
          check_vma=False))

    full = jax.tree.map(lambda s: P("data", *s), specs, is_leaf=lambda x: isinstance(x, P))
    x = jax.device_put(g, jax.tree.map(lambda s: NamedSharding(mesh, s), full,
                                       is_leaf=lambda x: isinstance(x, P)))
    f = per_rank(ours)
    out, want = f(x), per_rank(ref)(x)
    for k in g:
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(want[k]), err_msg=k)
    _data_only(hlo.collectives(f.lower(x).compile().as_text(), mesh), name)

  def test_error_estimate_of_whole_model_sharded_leaves_is_the_1d_runs(self):
    # Bf16 rounds to nearest: its estimate is a function of the result alone, so the
    # sharded run's (each leaf's shards summed over the model axis) is the 1-D run's on
    # whole leaves. A scattered leaf gets no estimate: NaN, as on one axis.
    mesh = _mesh("4x2", "auto")
    specs = _specs("4x2")
    g = _grads(4, dyadic=False)
    codec = dq.codecs.Bf16()

    def estimate(t, dims, specs=None):
      return dq.reduce_scatter(t, axis_name="data", codec=codec, key=jax.random.key(0),
                               scatter_dimension=dims, specs=specs)[1].error_estimate

    full = jax.tree.map(lambda s: P("data", *s), specs, is_leaf=lambda x: isinstance(x, P))
    x = jax.device_put(g, jax.tree.map(lambda s: NamedSharding(mesh, s), full,
                                       is_leaf=lambda x: isinstance(x, P)))
    scattered = {"repl": 0, "tensor": 0, "fsdp": 1, "both": 0, "bias": None}
    whole, part = (float(jax.jit(jax.shard_map(
        lambda t, d=dims: estimate(jax.tree.map(lambda a: a[0], t), d, specs), mesh=mesh,
        in_specs=(P("data"),), out_specs=P(), axis_names={"data"}, check_vma=False))(x))
                   for dims in (None, scattered))
    want = jax.jit(jax.vmap(lambda t: estimate(t, None), axis_name="data"))(g)  # (not eager)
    assert 0 < whole < 1e-3, whole  # bf16's relative error, not NaN
    np.testing.assert_allclose(whole, np.asarray(want)[0], rtol=1e-5)
    assert np.isnan(part)

  def test_scattering_a_model_sharded_dimension_is_an_error(self):
    mesh = _mesh("4x2", "auto")
    specs = _specs("4x2")
    with pytest.raises(ValueError, match="sharded over 'model' on dimension 1"):
      _per_data_rank(mesh, lambda t: dq.reduce_scatter(
          t, axis_name="data", codec=F32(), key=jax.random.key(0), scatter_dimension=1,
          specs={"tensor": specs["tensor"]})[0], {"tensor": _grads(4)["tensor"]},
                     {"tensor": specs["tensor"]})


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


@functools.cache
def _lm_run(layout, model_axis, codec, axis_types, tp_codec):
  """TestDataParallelOnSharded._train's runs, by their arguments."""
  import pathlib
  import sys
  root = str(pathlib.Path(__file__).resolve().parents[1])
  if root not in sys.path:  # the examples live beside the package
    sys.path.insert(0, root)
  from examples.nnx_sharded_lm import train
  config = train.Config(layout=layout, model_axis=model_axis, codec=codec, steps=2, dim=32,
                        heads=2, layers=1, context=16, batch_size=16, axis_types=axis_types,
                        tp_codec=tp_codec)
  text = np.frombuffer(bytes(range(256)) * 64, np.uint8)
  dp = train.build(config, jax.devices())
  want = jax.tree.map(lambda x: x.sharding.spec, dp.state)  # (before the step donates it)
  step = dp.train_step(train.loss_fn)
  state, losses = dp.state, []
  for i in range(config.steps):
    state, loss = step(state, train.place_batch(dp, train.batch(config, text, i)))
    losses.append(float(np.asarray(loss)))
  return dp, step, state, want, config, text, train, losses


class TestDataParallelOnSharded:
  """dq.nnx.DataParallel on the example's layouts: the byte LM, 2 steps, tiny."""

  @staticmethod
  def _train(layout, model_axis, codec="f32-ring", axis_types="auto", tp_codec="none"):
    """``(dp, step, state, want, config, text, train, losses)`` of 2 steps; each run once
    (the tests below share them: one compiled step each). ``want``: the shardings the
    state arrived with."""
    return _lm_run(layout, model_axis, codec, axis_types, tp_codec)

  @pytest.mark.parametrize("layout,model_axis,sharded_over,axis_types,codec", [
      ("tensor", 2, "model", "auto", "f32-ring"), ("tensor", 2, "model", "explicit", "f32-ring"),
      # the default codec on HSDP: the run test_dynamiq_on_sharded_layouts_... checks too
      ("hsdp", 4, "local", "auto", "dynamiq")])
  def test_keeps_shardings_replicas_identical_compiles_once(self, layout, model_axis,
                                                           sharded_over, axis_types, codec):
    dp, step, state, want, config, text, train, _ = self._train(layout, model_axis, codec,
                                                                axis_types)
    got = jax.tree.map(lambda x: x.sharding.spec, state)
    assert got == want  # every leaf keeps the sharding it arrived with
    specs = jax.tree.leaves(got, is_leaf=lambda x: isinstance(x, P))
    assert any(sharded_over in str(s) for s in specs), specs  # the model really is sharded
    _assert_replicas_identical(state)
    assert step.jitted._cache_size() == 1  # noqa: SLF001 (compiled once for both steps)
    lowered = step.jitted.lower(state, train.place_batch(dp, train.batch(config, text, 0)))
    found = hlo.collectives(lowered.compile().as_text(), dp.mesh)
    model = [c for c in found if sharded_over in c.axes]
    if layout == "tensor":  # Megatron's activation all-reduces only: no parameter gathered
      assert not [c for c in model if c.op != "all-reduce"], hlo.summary(found)
      assert any(c.op == "all-reduce" and c.axes == ("data",) for c in found)
    else:  # parameters gathered inside the host; the gradient is never gathered back
      big = [c for c in model if c.op == "all-reduce" and _elements(c.shape) > 64]
      assert not big, [(c.axes, c.shape) for c in big]  # (the codec's guard: 2 scalars)
      back = [c for c in model if c.op == "all-gather" and "/allreduce/" in c.line]
      assert not back, [(c.axes, c.shape) for c in back]  # only the parameters' gathers
      assert any(c.op == "collective-permute" and c.axes == ("local",) for c in found)
      assert any(c.axes == ("host",) for c in found), hlo.summary(found)

  @pytest.mark.parametrize("axis_types", ["auto", "explicit"])
  def test_tp_codec_compresses_the_activation_all_reduces(self, axis_types):
    """``--tp-codec int8``: the row-parallel projections' sums over "model" run as
    ``dq.tp_psum`` (an all-to-all and an all-gather of INT8 payloads), not as XLA's
    all-reduce; the training step stays within INT8's error of the exact one."""
    exact = self._train("tensor", 2, "f32-ring", axis_types)[-1]  # (the run above)
    dp, step, state, _, config, text, train, losses = self._train(
        "tensor", 2, "f32-ring", axis_types, tp_codec="int8")
    _assert_replicas_identical(state)
    lowered = step.jitted.lower(state, train.place_batch(dp, train.batch(config, text, 0)))
    model = [c for c in hlo.collectives(lowered.compile().as_text(), dp.mesh)
             if "model" in c.axes]
    assert {c.op for c in model} >= {"all-to-all", "all-gather"}, hlo.summary(model)
    # what XLA still all-reduces over "model" is the backward pass's (the activation
    # gradients at the column-parallel inputs: tp_psum's docstring says why)
    forward = [c for c in model if c.op == "all-reduce" and "transpose(" not in c.line]
    assert not forward, [c.line[-300:] for c in forward]
    np.testing.assert_allclose(losses, exact, rtol=2e-3)
    assert losses != exact  # (the codec did run)
    with pytest.raises(ValueError, match="Fix: --layout tensor"):
      self._train("data", 1, tp_codec="int8")

  @pytest.mark.parametrize("layout,model_axis", [
      ("hsdp", 4),
      # .ci/run-slow: a compile of its own; the default run checks DynamiQ in a sharded
      # optimizer's step on HSDP (above) and the ZeRO layout with F32 and GlobalQSGD
      # (TestShardedOptimizer)
      pytest.param("zero", 1, marks=pytest.mark.slow)])
  def test_dynamiq_on_sharded_layouts_trains_with_identical_replicas(self, layout, model_axis):
    """The default codec under the step's ``check_vma``: on HSDP its allocation runs on
    values that vary over the host's devices (each holds other shards)."""
    _, _, state, want, _, _, _, _ = self._train(layout, model_axis, "dynamiq")
    assert jax.tree.map(lambda x: x.sharding.spec, state) == want
    assert all(np.all(np.isfinite(np.asarray(p))) for p in jax.tree.leaves(state[0]))
    _assert_replicas_identical(state)


def _assert_replicas_identical(state):
  """Devices holding the same block of a leaf hold the same bits."""
  for leaf in jax.tree.leaves(state):
    blocks = {}
    for shard in leaf.addressable_shards:
      blocks.setdefault(str(shard.index), []).append(np.asarray(shard.data))
    for arrays in blocks.values():
      for a in arrays[1:]:
        np.testing.assert_array_equal(a, arrays[0])


def _elements(shape: str) -> int:
  """Elements of an HLO result type (``f32[4,16]{1,0}``, tuples summed)."""
  import re
  return sum(int(np.prod([int(v) for v in dims.split(",") if v] or [1]))
             for dims in re.findall(r"\[([\d,]*)\]", shape))


def test_data_parallel_rejects_unplaced_logical_names():
  # A model built without a mesh keeps its logical axis names: DataParallel cannot place
  # them and says how to (not silently replicate the model).
  import optax
  from flax import nnx
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  with nnx.use_eager_sharding(False):
    layer = nnx.Linear(8, 16, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("embed", "hidden")))
  with pytest.raises(ValueError, match=r"\['embed', 'hidden'\].*logical_axis_rules"):
    dq.nnx.DataParallel.create(layer, optax.sgd(0.1), mesh=mesh)


def _flax_linear(partitioned=True):
  """nnx.Linear(8, 16) whose parameters declare logical axis names (or none)."""
  from flax import nnx
  wrap = nnx.with_partitioning if partitioned else (lambda init, _: init)
  return nnx.Linear(8, 16, rngs=nnx.Rngs(0),
                    kernel_init=wrap(nnx.initializers.lecun_normal(), ("embed", "hidden")),
                    bias_init=wrap(nnx.initializers.normal(), ("hidden",)))


def _flax_step(dp, mesh):
  """One step of ``dp`` on a fixed batch: the state after it."""
  rng = np.random.default_rng(0)
  batch = jax.device_put((rng.standard_normal((16, 8), np.float32),
                          rng.standard_normal((16, 16), np.float32)),
                         NamedSharding(mesh, P("data")))
  loss_fn = lambda m, b: ((m(b[0]) - b[1]) ** 2).mean()
  return dp.train_step(loss_fn)(dp.state, batch)[0]


def _flax_tx():
  import optax
  return optax.chain(dq.compressed_psum("data", codec=F32()), optax.sgd(0.1))


@functools.cache
def _flax_replicated_step():
  """The replicated model's step (both cases below compare with it: run once), numpy."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  ref = dq.nnx.DataParallel.create(_flax_linear(partitioned=False), _flax_tx(), mesh=mesh)
  return jax.tree.map(np.asarray, _flax_step(ref, mesh)[0])


@pytest.mark.parametrize("how", ["under_the_mesh", "declared"])
def test_data_parallel_places_logical_names_by_flax_rules(how):
  # Flax's logical axis rules give the shardings: either the model is built under the
  # mesh and the rules (its arrays carry them), or DataParallel reads the declared names
  # under the rules. The step keeps them and trains as the replicated model does.
  from flax import nnx
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  rules = (("embed", None), ("hidden", "model"))
  tx = _flax_tx()
  if how == "under_the_mesh":
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
      dp = dq.nnx.DataParallel.create(_flax_linear(), tx, mesh=mesh)
  else:
    with nnx.use_eager_sharding(False):
      model = _flax_linear()
    with nnx.logical_axis_rules(rules):
      dp = dq.nnx.DataParallel.create(model, tx, mesh=mesh)
  before = dp.state
  state = _flax_step(dp, mesh)
  want = _flax_replicated_step()
  for s in (before, state):
    assert s[0]["kernel"].sharding.spec == P(None, "model"), s[0]["kernel"].sharding
    assert s[0]["bias"].sharding.spec == P("model"), s[0]["bias"].sharding
  for k in ("kernel", "bias"):
    np.testing.assert_allclose(np.asarray(state[0][k]), want[k], rtol=1e-6, atol=1e-7)


class TestShardedOptimizer:
  """dq.compressed_psum_scatter in dq.data_parallel_step, parameters from zero_shardings."""

  @staticmethod
  @functools.cache
  def _batch():
    x = np.asarray(jax.random.normal(jax.random.key(2), (64, 16)))
    return x, x.sum(1, keepdims=True)  # host

  @classmethod
  def _run(cls, tx, params, mesh, axis, steps=3):
    batch = jax.device_put(cls._batch(), NamedSharding(mesh, P(axis)))
    opt_state = dq.data_parallel_init(tx, params, mesh=mesh, axis_name=axis)
    step = dq.data_parallel_step(
        lambda p, b: jnp.mean((jnp.tanh(b[0] @ p["w1"]) @ p["w2"] - b[1]) ** 2), tx,
        mesh=mesh, axis_name=axis)
    for _ in range(steps):
      params, opt_state, loss = step(params, opt_state, batch)
    return params, opt_state

  @staticmethod
  @functools.cache
  def _params():
    return {"w1": np.asarray(jax.random.normal(jax.random.key(0), (16, 64))) / 4,
            "w2": np.asarray(jax.random.normal(jax.random.key(1), (64, 8))) / 8}  # host

  @classmethod
  @functools.cache
  def _replicated(cls):
    """The replicated run both layouts must follow (computed once)."""
    import optax
    flat = jax.make_mesh((8,), ("data",))
    ref, _ = cls._run(optax.chain(dq.compressed_psum("data", codec=F32()), optax.adam(1e-2)),
                      jax.device_put(cls._params(), NamedSharding(flat, P())), flat, "data")
    return jax.tree.map(np.asarray, ref)

  @pytest.mark.parametrize("hsdp", [False, True])
  def test_f32_zero_and_hsdp_follow_the_replicated_run(self, hsdp):
    import optax
    params = self._params()
    ref = self._replicated()
    flat = jax.make_mesh((8,), ("data",))
    if hsdp:
      mesh, axis, over = jax.make_mesh((2, 4), ("host", "local")), ("host", "local"), "local"
      reduce = dq.compressed_psum_scatter(axis, codec=F32(), schedule="hierarchical")
    else:
      mesh, axis, over = flat, "data", "data"
      reduce = dq.compressed_psum_scatter("data", codec=F32())
    placed = jax.device_put(params, dq.zero_shardings(params, mesh=mesh, axis_name=over,
                                                      min_size=0))
    got, opt_state = self._run(optax.chain(reduce, optax.adam(1e-2)), placed, mesh, axis)
    for k in params:  # the same training, up to the order of F32 sums
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)
      assert over in str(got[k].sharding.spec), got[k].sharding  # still split
    mu = opt_state[1][0].mu["w1"]  # Adam's first moment: one shard per device of the split
    assert mu.addressable_shards[0].data.size == mu.size // mesh.shape[over]

  def test_error_feedback_keeps_a_per_rank_residual(self):
    import optax
    mesh = jax.make_mesh((8,), ("data",))
    params = self._params()
    placed = jax.device_put(params, dq.zero_shardings(params, mesh=mesh, min_size=0))
    tx = optax.chain(dq.compressed_psum_scatter("data", codec=GlobalQSGD(),
                                                error_feedback=True), optax.adam(1e-2))
    _, opt_state = self._run(tx, placed, mesh, "data", steps=2)
    residual = opt_state[0].residual.tree["w1"]  # [ranks, *w1.shape], one slice per rank
    assert residual.shape == (8, 16, 64)
    r = np.asarray(residual)
    assert np.abs(r).max() > 0 and not (r == r[:1]).all()  # each rank's own rounding error


def _leaves_by_bucket(jaxpr, sources, stack="", out=None):
  """{bucket index: the input leaves that values of ``allreduce/bucket<b>`` depend on},
  by following the data through ``jaxpr`` (sub-jaxprs included; ``sources`` gives each
  input variable's set of leaf indices)."""
  import re
  from jax.extend.core import Literal
  out = {} if out is None else out
  env = dict(zip(jaxpr.invars, sources))

  def read(v):
    return set() if isinstance(v, Literal) else env.get(v, set())

  for eqn in jaxpr.eqns:
    here = f"{stack}/{eqn.source_info.name_stack}"
    ins = [read(v) for v in eqn.invars]
    union = set().union(*ins)
    subs = [getattr(sub, "jaxpr", sub) for param in eqn.params.values()
            for sub in (param if isinstance(param, (tuple, list)) else (param,))
            if hasattr(getattr(sub, "jaxpr", sub), "eqns")]
    outs = None
    for inner in subs:
      if len(inner.invars) == len(ins):  # a call: follow each input into the body
        res = _leaves_by_bucket(inner, ins, here, out)
        outs = outs or [set() for _ in eqn.outvars]
        if len(res) == len(outs):
          outs = [a | b for a, b in zip(outs, res)]
      else:  # a loop or branch: every output may depend on every input
        _leaves_by_bucket(inner, [union] * len(inner.invars), here, out)
    if eqn.primitive.name == "optimization_barrier":  # each output is its input
      outs = ins
    elif outs is None or len(outs) != len(eqn.outvars):
      outs = [union] * len(eqn.outvars)
    m = re.findall(r"allreduce/bucket(\d+)", here)
    if m:
      out.setdefault(int(m[-1]), set()).update(union)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars] if stack else out


@pytest.mark.parametrize("schedule", ["ring", "hierarchical"])
def test_reduce_scatter_reduces_the_last_leaf_first(schedule):
  """Buckets go in the order the backward pass produces the gradients (the reverse of
  the pytree's, by default): the first bucket reduced holds the last leaf, so it can
  start while the backward pass still runs. (Fixed: the scattered leaves, already in
  that order, were reversed once more.)"""
  n = 8
  # per-rank widths 512 (leaf a) and 1536 (leaf b): 2048 per rank, cut in the fewest equal
  # buckets of at most a quarter of 6144, two of 1024: the first holds b alone
  tree = [jnp.ones((n * 512,), jnp.float32), jnp.ones((n * 1536,), jnp.float32)]
  axis = ("host", "local") if schedule == "hierarchical" else "data"

  def f(tree):
    return dq.reduce_scatter(tree, axis_name=axis, codec=DynamiQ(bits=5),
                             key=jax.random.key(0), bucket_size=n * 6144, schedule=schedule)

  if schedule == "hierarchical":  # 2 hosts of 4: scattered over the 4 of a host
    fn = jax.vmap(jax.vmap(f, axis_name="local"), axis_name="host")
    args = [jnp.broadcast_to(x, (2, 4, *x.shape)) for x in tree]
  else:
    fn = jax.vmap(f, axis_name="data")
    args = [jnp.broadcast_to(x, (n, *x.shape)) for x in tree]
  closed = jax.make_jaxpr(fn)(args)
  by_bucket = _leaves_by_bucket(closed.jaxpr, [{0}, {1}])
  # leaf b (index 1) alone in the first bucket, leaf a in the last (which depends on b
  # too: each bucket waits for the one before it)
  assert by_bucket[0] == {1} and 0 in by_bucket[max(by_bucket)], by_bucket
