"""``dq.codecs.IntGroup`` (Flash Communication's quantiser) and ``dq.tp_psum`` (the
compressed psum of a row-parallel layer), on the two-step schedule and the ring."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from _helpers import model_data, rows_identical
from dynamiq_jax.codecs import F32, DynamiQ, IntGroup, Keys
from dynamiq_jax.codecs.minifloat import pack_bits, unpack_bits

KEY = jax.random.key(0)


@functools.cache
def _encoder(codec):
  """``_encode``'s computation under jit: one program per codec and shape (eagerly, each
  operation compiles apart), as inside the all-reduce."""

  def run(x):
    keys = Keys.from_key(KEY, bucket=0, rank=0).at(0, 0)
    payload = codec.encode(x, None, keys)
    _, scale, _ = codec.quantize(x)
    return payload, codec.decode(payload, None), scale

  return jax.jit(run)


def _encode(codec, x):
  """One encode of ``x`` [groups, group] -> (payload, decoded, the groups' scales)."""
  payload, decoded, scale = _encoder(codec)(jnp.asarray(x))
  return payload, np.asarray(decoded), np.asarray(scale)


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_packing_round_trips(bits):
  codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 128)).astype(np.uint32)
  packed = jax.jit(pack_bits, static_argnums=1)(jnp.asarray(codes), bits)
  assert packed.shape == (3, 128 * bits // 8) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(
      np.asarray(jax.jit(unpack_bits, static_argnums=1)(packed, bits)), codes)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_one_encode_is_within_half_a_scale_and_a_grid_round_trips(bits, symmetric):
  codec = IntGroup(bits=bits, symmetric=symmetric)
  rng = np.random.default_rng(bits)
  x = (rng.standard_normal((64, 128)) * rng.uniform(1e-3, 1e3, (64, 1))
       + rng.uniform(-5, 5, (64, 1)) * (not symmetric)).astype(np.float32)
  payload, dec, scale = _encode(codec, x)
  assert payload.shape == (64, 128 * bits // 8 + (2 if symmetric else 4))
  assert (np.abs(dec - x) <= scale / 2 * (1 + 1e-5)).all()
  # values on a group's grid, both ends present, come back exactly
  top = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
  q = rng.integers(-top if symmetric else 0, top + 1, (64, 128))
  q[:, 0], q[:, 1] = top, -top if symmetric else 0
  grid = (q * np.float32(0.375) + np.float32(0 if symmetric else -3.5)).astype(np.float32)
  np.testing.assert_array_equal(_encode(codec, grid)[1], grid)


def test_wire_bits_and_bad_arguments():
  assert IntGroup().wire_bits(1024, 8) / 1024 == 8.25
  assert IntGroup(bits=4).wire_bits(1024, 8) / 1024 == 4.25
  assert IntGroup(bits=4, symmetric=True).wire_bits(1024, 8) / 1024 == 4.125
  assert IntGroup(scale_dtype="float32").wire_bits(1024, 8) / 1024 == 8.5
  for bad in (dict(bits=5), dict(group=130), dict(group=0), dict(scale_dtype="int8"),
              dict(rounding="up")):
    with pytest.raises(ValueError, match=next(iter(bad))):
      IntGroup(**bad)


def test_non_finite_values_stay_in_their_group():
  codec = IntGroup()
  x = np.ones((4, 128), np.float32)
  x[1, 3], x[2, 5] = np.nan, np.inf
  x[3, 0] = -1e5  # a zero point beyond float16's range: that group decodes as NaN, loudly
  _, dec, _ = _encode(codec, x)
  assert np.isfinite(dec[0]).all()
  for g in (1, 2, 3):
    assert not np.isfinite(dec[g]).all()
  assert np.isfinite(_encode(IntGroup(scale_dtype="float32"), x[3:])[1]).all()


def _two_step_by_hand(codec, g):
  """The two-step all-reduce written out: every rank's encode of every chunk, each
  owner's sum in rank order, its encode; -> (result, per-coordinate bound)."""
  n, d = g.shape
  chunks = g.reshape(n, n, -1, codec.group)  # [rank, chunk, groups, group]
  out, bound = [], []
  for c in range(n):
    acc, half = 0.0, 0.0
    for r in range(n):
      _, dec, scale = _encode(codec, chunks[r, c])
      acc = acc + dec if r else dec
      half = half + scale / 2
    _, final, scale = _encode(codec, acc.astype(np.float32))
    out.append(final)
    bound.append(half + scale / 2)
  shape = lambda parts: np.broadcast_to(np.stack(parts), (n, chunks.shape[2], codec.group))
  return shape(out).reshape(d), shape(bound).reshape(d)


@pytest.mark.parametrize("bits", [8, 4])
def test_two_step_error_is_within_the_sum_of_half_scales_per_group(bits):
  codec = IntGroup(bits=bits)
  n, d = 4, 4 * 8 * 128
  g = np.asarray(model_data("heavy", n, d, 5), np.float32)
  by_hand, bound = _two_step_by_hand(codec, g)
  exact = g.astype(np.float64).sum(0)
  assert (np.abs(by_hand - exact) <= bound * (1 + 1e-4) + 1e-6 * np.abs(exact).max()).all()
  got = jax.jit(jax.vmap(lambda v: dq.tp_psum(v, "m", codec=codec), axis_name="m"))(
      jnp.asarray(g))
  np.testing.assert_array_equal(np.asarray(got[0]), by_hand)  # tp_psum is that algorithm
  assert rows_identical(got)


def test_int8_two_step_error_is_flat_in_n_where_the_rings_grows():
  """(n = 2 against n = 8; each run one program, its error measured in numpy.)"""
  errs = {}
  for n in (2, 8):
    g = jnp.asarray(model_data("iid", n, 1 << 14, 7), jnp.float32)
    exact = np.asarray(g).sum(0, dtype=np.float32)
    for schedule in ("two_step", "ring"):
      out = np.asarray(jax.jit(jax.vmap(lambda v, s=schedule: dq.tp_psum(v, "m", schedule=s),
                                        axis_name="m"))(g))
      errs[schedule, n] = float(np.sum((out[0] - exact) ** 2) / np.sum(exact ** 2))
  assert errs["two_step", 8] < 1.3 * errs["two_step", 2], errs
  assert errs["ring", 8] > 2.0 * errs["ring", 2], errs
  assert errs["two_step", 8] < errs["ring", 8], errs


@pytest.fixture(scope="module")
def mesh2x4():
  return jax.make_mesh((2, 4), ("data", "model"))


@functools.cache  # one jit (and compile) per configuration, whichever test asks first
def _row_parallel(mesh, codec, *, tp=True, every_rank=False):
  """A row-parallel projection ``x @ w`` (features split over "model") summed by
  ``tp_psum`` (or ``psum``), under ``check_vma``; ``every_rank``: every model rank's
  result, stacked (without ``check_vma``, which would call them replicated)."""

  def body(x, w):
    part = x @ w
    y = dq.tp_psum(part, "model", codec=codec) if tp else jax.lax.psum(part, "model")
    return y[None] if every_rank else y

  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P("data", None, "model"), P("model", None)),
      out_specs=P("model", "data") if every_rank else P("data"), check_vma=not every_rank))


def _activations(mesh):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16, 512)).astype(np.float32)
  w = (rng.standard_normal((512, 256)) / np.sqrt(512)).astype(np.float32)
  return (jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))),
          jax.device_put(w, NamedSharding(mesh, P("model", None))))


def test_int8_two_step_on_a_2x4_mesh_is_within_1e_2_of_psum_and_ranks_agree(mesh2x4):
  x, w = _activations(mesh2x4)
  ref = np.asarray(_row_parallel(mesh2x4, None, tp=False)(x, w))
  got = np.asarray(_row_parallel(mesh2x4, IntGroup())(x, w))
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2
  per_rank = np.asarray(_row_parallel(mesh2x4, IntGroup(), every_rank=True)(x, w))
  assert per_rank.shape == (4, 8, 16, 256)
  assert rows_identical(per_rank)
  np.testing.assert_array_equal(per_rank[0], got)
  int4 = np.asarray(_row_parallel(mesh2x4, IntGroup(bits=4))(x, w))
  assert 1e-2 < np.linalg.norm(int4 - ref) / np.linalg.norm(ref) < 0.2


@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no-vma"])
def test_the_backward_rule_gives_psums_gradient(mesh2x4, check_vma):
  x, w = _activations(mesh2x4)

  v = jax.device_put(np.asarray(w).T.copy(), NamedSharding(mesh2x4, P(None, "model")))

  def grads(codec, tp):
    def block(x, w, v):  # row-parallel, then column-parallel: per-rank values again
      y = dq.tp_psum(x @ w, "model", codec=codec) if tp else jax.lax.psum(x @ w, "model")
      return jnp.tanh(y) @ v

    def loss(x, w, v):
      z = jax.shard_map(block, mesh=mesh2x4, in_specs=(P("data", None, "model"),
                                                        P("model", None), P(None, "model")),
                        out_specs=P("data", None, "model"), check_vma=check_vma)(x, w, v)
      return jnp.sum(z ** 2)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, v)

  exact = grads(None, False)
  for a, b in zip(grads(F32(), True), exact):  # an exact codec: psum's gradient, bit for bit
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(grads(IntGroup(), True), exact):  # INT8: close to it
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 3e-2


def test_dynamiq_and_bf16_inputs(mesh2x4):
  x, w = _activations(mesh2x4)
  ref = np.asarray(_row_parallel(mesh2x4, None, tp=False)(x, w))
  got = np.asarray(_row_parallel(mesh2x4, DynamiQ(bits=5))(x, w))
  assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.2
  xb = x.astype(jnp.bfloat16)
  out = jax.jit(jax.shard_map(lambda x, w: dq.tp_psum(x @ w.astype(x.dtype), "model"),
                              mesh=mesh2x4, in_specs=(P("data", None, "model"),
                                                      P("model", None)),
                              out_specs=P("data")))(xb, w)
  assert out.dtype == jnp.bfloat16 and out.shape == ref.shape


def test_bad_input_gets_a_clear_error(mesh2x4):
  with pytest.raises(dq.UnboundAxisError, match="'model' is not bound"):
    dq.tp_psum(jnp.ones(8), "model")
  run = lambda f, x: jax.vmap(f, axis_name="model")(x)
  with pytest.raises(TypeError, match="int32"):
    run(lambda v: dq.tp_psum(v, "model"), jnp.ones((4, 8), jnp.int32))
  with pytest.raises(ValueError, match="schedule='tree'"):
    run(lambda v: dq.tp_psum(v, "model", schedule="tree"), jnp.ones((4, 8)))
  with pytest.raises(ValueError, match="keeps state"):
    run(lambda v: dq.tp_psum(v, "model", codec=dq.codecs.mxfp8()), jnp.ones((4, 8)))
  with pytest.raises(ValueError, match="not varying over axis_name='model'"):
    jax.shard_map(lambda x: dq.tp_psum(x, "model"), mesh=mesh2x4, in_specs=P(),
                  out_specs=P())(jnp.ones(8))
  one = jax.vmap(lambda v: dq.tp_psum(v, "model"), axis_name="model")(jnp.ones((1, 8)))
  np.testing.assert_array_equal(np.asarray(one), np.ones((1, 8)))  # n = 1: identity


def test_usable_from_a_flax_nnx_layer(mesh2x4):
  """An NNX row-parallel layer: a partial-manual shard_map over "model" (the data axis
  left to the compiler) around its matmul and ``tp_psum``; ``nnx.grad`` through it."""
  nnx = pytest.importorskip("flax.nnx")
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  class RowParallel(nnx.Module):
    def __init__(self, din, dout, rngs):
      w = jax.random.normal(rngs.params(), (din, dout)) / np.sqrt(din)
      self.w = nnx.Param(jax.device_put(w, NamedSharding(mesh, P("model", None))))

    def __call__(self, x, codec):
      return jax.shard_map(lambda x, w: dq.tp_psum(x @ w, "model", codec=codec), mesh=mesh,
                           in_specs=(P(None, None, "model"), P("model", None)),
                           out_specs=P(), axis_names={"model"})(x, self.w[...])

  layer = RowParallel(512, 256, nnx.Rngs(0))
  x = jax.device_put(np.random.default_rng(1).standard_normal((8, 16, 512)).astype(np.float32),
                     NamedSharding(mesh, P("data", None, "model")))

  @nnx.jit(static_argnums=2)
  def loss_and_grad(layer, x, codec):
    return nnx.value_and_grad(lambda m: jnp.mean(m(x, codec) ** 2))(layer)

  (l8, g8), (l32, g32) = loss_and_grad(layer, x, IntGroup()), loss_and_grad(layer, x, F32())
  assert abs(float(l8) - float(l32)) < 2e-2 * float(l32)
  assert np.linalg.norm(g8.w[...] - g32.w[...]) / np.linalg.norm(g32.w[...]) < 3e-2
