"""ARC-Top-K: the same rows on every rank, the exact sum on them, zeros elsewhere; EF14 (its
default) and EF21-M."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynamiq_jax as dq
from dynamiq_jax.codecs import ARCTopK, MX
from dynamiq_jax.schedules import AxisContext

from _helpers import per_rank, rows_identical

N, ROW = 8, 32


def _grads(n=N, h=64, seed=0, heavy=()):
  rng = np.random.default_rng(seed)
  g = rng.standard_normal((n, h * ROW)).astype(np.float32)
  for r, size in heavy:  # the same heavy row on every rank
    g[:, r * ROW:(r + 1) * ROW] += size
  return g


def _sent_rows(out):
  """Rows of ``out`` [n, d] that are not all zero, per rank."""
  m = np.abs(np.asarray(out)).reshape(out.shape[0], -1, ROW).sum(-1)
  return [tuple(np.nonzero(r)[0]) for r in m]


@pytest.mark.parametrize("schedule,mesh_shape", [
    ("ring", None), ("butterfly", None), ("hierarchical", (2, 4))])
def test_every_rank_selects_the_same_rows_and_sends_the_exact_mean_there(schedule, mesh_shape):
  g = _grads()
  codec = ARCTopK(ratio=0.1, row=ROW, values="f32")
  out = np.asarray(dq.simulate(g, codec=codec, schedule=schedule, mesh_shape=mesh_shape))
  assert rows_identical(out)
  rows = _sent_rows(out)
  assert len(set(rows)) == 1
  mean = g.astype(np.float64).mean(0).reshape(-1, ROW)
  got = out[0].reshape(-1, ROW)
  sent = np.array(rows[0])
  if mesh_shape is None:
    assert len(sent) == codec.rows(g.shape[1], N)[1]  # k rows, rounded up to a multiple of n
  else:  # the fast axis reduce-scatters first: each of its 4 shares selects its own rows
    assert 0 < len(sent) < got.shape[0] // 4
  np.testing.assert_allclose(got[sent], mean[sent], rtol=0, atol=2e-6)
  unsent = np.setdiff1d(np.arange(got.shape[0]), sent)
  assert (got[unsent] == 0).all()


def test_simulate_equals_the_distributed_all_reduce():
  devices = jax.devices()[:N]
  mesh = jax.make_mesh((N,), ("data",), devices=devices)
  g = _grads(seed=3)
  codec = ARCTopK(ratio=0.2, row=ROW)
  key = jax.random.key(7)
  dist = per_rank(mesh, lambda x: dq.allreduce(x, axis_name="data", codec=codec, key=key)[0], g)
  sim = dq.simulate(g, codec=codec, key=key)
  assert rows_identical(dist)
  np.testing.assert_array_equal(np.asarray(dist), np.asarray(sim))


def test_shared_heavy_rows_are_selected_by_the_sketch():
  heavy = ((5, 6.0), (17, -5.0), (40, 4.0), (63, 5.5))
  for seed in range(5):  # a fresh sketch every time: the heavy rows win every time
    g = _grads(seed=seed, heavy=heavy)
    out = dq.simulate(g, codec=ARCTopK(ratio=8 / 64, row=ROW, rank=4), seed=seed)
    assert {r for r, _ in heavy} <= set(_sent_rows(out)[0])


def test_identity_sketch_selects_the_exact_top_rows_of_the_mean():
  g = _grads(seed=1)
  codec = ARCTopK(ratio=0.25, row=ROW, rank=None, values="f32")
  out = dq.simulate(g, codec=codec)
  norms = (g.astype(np.float64).mean(0).reshape(-1, ROW) ** 2).sum(-1)
  k = codec.rows(g.shape[1], N)[1]
  assert set(_sent_rows(out)[0]) == set(np.argsort(-norms)[:k].tolist())
  # a Gaussian sketch of the same data finds most of them, not all (it is an estimate)
  sketched = set(_sent_rows(dq.simulate(g, codec=ARCTopK(ratio=0.25, row=ROW, rank=4)))[0])
  assert k // 2 <= len(sketched & set(np.argsort(-norms)[:k].tolist())) < k


@pytest.mark.parametrize("codec", [
    ARCTopK(ratio=0.2, row=ROW), ARCTopK(ratio=0.1, row=ROW, values="f32"),
    ARCTopK(ratio=0.2, row=64, rank=None), ARCTopK(ratio=0.3, row=ROW,
                                                   values=MX(element="e4m3", scale="e8m0"))])
@pytest.mark.parametrize("d,n", [(64 * ROW, 8), (1000 * ROW + 5, 3)])
def test_wire_bits_equal_the_formula_and_the_bytes_actually_sent(codec, d, n, monkeypatch):
  h = -(-d // codec.row)
  k = min(-(-max(1, int(codec.ratio * h)) // n) * n, -(-h // n) * n)
  width = codec.row if codec.rank is None else codec.rank
  sketch = 32 * (-(-(-(-h // n) * n * width) // n) * n)
  assert codec.wire_bits(d, n) == sketch + codec.element.wire_bits(k * codec.row, n)
  if codec.values in ("bf16", "f32"):
    assert codec.element.wire_bits(k * codec.row, n) == (16 if codec.values == "bf16" else 32
                                                         ) * k * codec.row
  sent = {"ppermute": set(), "all_to_all": set()}  # bytes of one chunk's payload
  ppermute, all_to_all = AxisContext.ppermute, AxisContext.all_to_all

  def recording(self, tree, perm):
    sent["ppermute"].add(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree)))
    return ppermute(self, tree, perm)

  def recording_rows(self, tree):  # row r: the chunk for rank r
    sent["all_to_all"].add(sum(a.size * a.dtype.itemsize // a.shape[0]
                               for a in jax.tree.leaves(tree)))
    return all_to_all(self, tree)

  monkeypatch.setattr(AxisContext, "ppermute", recording)
  monkeypatch.setattr(AxisContext, "all_to_all", recording_rows)
  one = lambda x: dq.allreduce(x, axis_name="i", codec=codec, key=jax.random.key(0))[0]  # noqa
  jax.eval_shape(jax.vmap(one, axis_name="i"), jax.ShapeDtypeStruct((n, d), jnp.float32))
  # one payload shape per pass: the sketch (all-to-all), the rows' chunks (the ring)
  assert [len(v) for v in sent.values()] == [1, 1]
  chunk = sum(min(v) for v in sent.values())
  assert 8 * n * chunk == codec.wire_bits(d, n)
  assert dq.wire_stats(jnp.zeros(d), codec=codec, n=n).bytes_per_rank == 2 * (n - 1) * chunk


def test_defaults_cost_under_four_bits_and_register_by_name():
  c = ARCTopK()
  # k = 819 of 4096 rows, rounded up to 824 (a multiple of n)
  assert c.wire_bits(1 << 20, 8) / (1 << 20) == 16 * 824 / 4096 + 32 * 4 / 256
  # values by name: OCP MX elements with E8M0 scales per 32 (no metadata pass of their own)
  assert ARCTopK(values="mxfp8").element == MX(element="e4m3", scale="e8m0")
  mx4 = ARCTopK(ratio=0.8, values="mxfp4")
  assert mx4.element == MX(element="e2m1", scale="e8m0")
  # k = 3276 rows, rounded up to 3280, 4.25 bits each, beside the rank-4 float32 sketch
  assert mx4.wire_bits(1 << 20, 8) == 3280 * 256 * 4.25 + 32 * 4 * 4096
  assert dq.codec_from_name("arc-topk", ratio=0.1) == ARCTopK(ratio=0.1)
  assert "arc-topk" in dq.REDUCERS


def test_error_estimate_counts_the_rows_left_out():
  g = _grads(seed=2)
  codec = ARCTopK(ratio=0.25, row=ROW, rank=None, values="f32")

  def one(x):
    return dq.allreduce(x, axis_name="i", codec=codec, key=jax.random.key(0))

  out, stats = jax.vmap(one, axis_name="i")(jnp.asarray(g))
  mean = g.astype(np.float64).mean(0)
  got = np.asarray(out[0])  # the estimate is relative to the result, as for every codec
  exact = np.sum((got - mean) ** 2) / np.sum(got.astype(np.float64) ** 2)
  assert float(stats.error_estimate[0]) == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize("bad,match", [
    (dict(ratio=0), "ratio"), (dict(ratio=1.5), "ratio"), (dict(row=0), "row"),
    (dict(rank=0), "rank"), (dict(values="fp8"), "values"),
    (dict(values=dq.codecs.DynamiQ()), "values")])
def test_bad_options_are_refused_by_name(bad, match):
  with pytest.raises((ValueError, TypeError), match=match):
    ARCTopK(**bad)


def test_bucket_size_must_hold_whole_rows():
  with pytest.raises(ValueError, match="multiple of 256"):
    dq.bucket_layout({"a": jnp.zeros(1000)}, codec=ARCTopK(), bucket_size=1000)


# -- EF21-M ------------------------------------------------------------------------------


def _ef21m_reference(g_steps, codec, eta, key):
  """EF21-M by the formulas, with ``dq.simulate`` as the compressed all-reduce."""
  n, d = g_steps[0].shape
  v = np.zeros((n, d), np.float32)
  u = np.zeros((n, d), np.float32)
  u_bar = np.zeros(d, np.float32)
  outs = []
  for t, g in enumerate(g_steps):
    v = (1 - np.float32(eta)) * v + np.float32(eta) * g
    delta = v - u

    def one(x):
      out, st = dq.allreduce(x, axis_name="i", codec=codec,
                             key=jax.random.fold_in(key, t), return_own=True)
      return out, st.own

    mean_c, own = jax.vmap(one, axis_name="i")(jnp.asarray(delta))
    u = u + np.asarray(own)
    u_bar = u_bar + np.asarray(mean_c[0])
    outs.append(u_bar.copy())
  return outs


def test_ef21m_transform_follows_the_formulas_and_keeps_replicas_equal():
  codec = ARCTopK(ratio=0.25, row=ROW, values="f32")  # f32: u_bar = mean of u up to rounding
  eta, seed = 0.3, 4
  tx = dq.compressed_psum("i", codec=codec, seed=seed, error_feedback="ef21m",
                          ef21m_momentum=eta)
  steps = [_grads(seed=10 + t) for t in range(3)]
  state = tx.init(jnp.zeros(steps[0].shape[1]))
  assert state.mean is not None and set(state.residual.tree) == {"momentum", "sent"}
  states = jax.tree.map(lambda a: jnp.stack([a] * N), state)
  update = jax.vmap(lambda g, s: tx.update(g, s), axis_name="i")
  outs = []
  for g in steps:
    out, states = update(jnp.asarray(g), states)
    assert rows_identical(out) and rows_identical(states.mean)
    outs.append(np.asarray(out[0]))
  ref = _ef21m_reference(steps, codec, eta, jax.random.key(seed))
  for a, b in zip(outs, ref):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  # u_bar is the mean of the ranks' u (what each has sent, summed)
  np.testing.assert_allclose(np.asarray(states.mean[0]),
                             np.asarray(states.residual.tree["sent"][:, 0]).mean(0), atol=1e-5)


def test_error_feedback_choices():
  arc = ARCTopK()
  default = dq.compressed_psum(codec=arc).init(jnp.zeros(8))  # EF14 by default
  assert default.mean is None and default.residual is not None
  assert dq.compressed_psum(codec=arc, error_feedback="ef21m").init(jnp.zeros(8)).mean is not None
  assert dq.compressed_psum(codec=arc, error_feedback=False).init(jnp.zeros(8)).residual is None
  ef14 = dq.compressed_psum(codec=arc, error_feedback="ef14").init(jnp.zeros(8))
  assert ef14.mean is None and ef14.residual is not None
  assert dq.compressed_psum().init(jnp.zeros(8)).residual is None  # DynamiQ: none by default
  with pytest.raises(ValueError, match="error_feedback='ef2'"):
    dq.compressed_psum(codec=arc, error_feedback="ef2")
  with pytest.raises(ValueError, match=r"ef21m_momentum=0.0 must be in \(0, 1\]"):
    dq.compressed_psum(codec=arc, error_feedback="ef21m", ef21m_momentum=0.0)
  # a momentum without EF21-M would change nothing: said, with the fix
  with pytest.raises(ValueError, match=r"ef21m_momentum=0.3 .* is 'ef14' .* error_feedback='ef21m'"):
    dq.compressed_psum(codec=arc, ef21m_momentum=0.3)
  with pytest.raises(ValueError, match=r"is 'none'"):
    dq.compressed_psum(codec=arc, error_feedback=False, ef21m_momentum=0.3)
  with pytest.raises(ValueError, match="compressed_psum_scatter does not run"):
    dq.compressed_psum_scatter(codec=dq.codecs.Bf16(), error_feedback="ef21m")
  with pytest.raises(ValueError, match="reports_contribution=False"):
    dq.compressed_psum(codec=dq.codecs.DynamiQ(), error_feedback="ef21m")


def test_ef21m_trains_a_regression_to_its_optimum():
  """Least squares on 4 ranks, 1/8 of the rows sent per step: EF21-M reaches the
  optimum, replicas equal at every step."""
  rng = np.random.default_rng(0)
  w_true = rng.standard_normal((64, ROW)).astype(np.float32)
  x = rng.standard_normal((4, 32, 64)).astype(np.float32)
  y = x @ w_true
  tx = optax.chain(dq.compressed_psum("i", codec=ARCTopK(ratio=0.125, row=ROW),
                                      error_feedback="ef21m", ef21m_momentum=0.5),
                   optax.sgd(1.0))
  w = jnp.zeros((64, ROW))
  state = jax.tree.map(lambda a: jnp.stack([a] * 4), tx.init(w))
  ws = jnp.stack([w] * 4)

  def step(w, s, xb, yb):
    g = jax.grad(lambda w: jnp.mean((xb @ w - yb) ** 2))(w)
    u, s = tx.update(g, s)
    return optax.apply_updates(w, u), s

  step = jax.jit(jax.vmap(step, axis_name="i"))
  for _ in range(400):
    ws, state = step(ws, state, x, y)
  assert rows_identical(ws)
  assert float(np.mean((np.asarray(ws[0]) - w_true) ** 2)) < 1e-3


# -- the benchmarks' baselines -----------------------------------------------------------


def test_rand_k_sends_the_same_random_rows_everywhere_and_new_ones_each_step():
  from dynamiq_jax.bench.baselines import RandK
  g = _grads(seed=5)
  codec = RandK(ratio=0.125, row=ROW, values="f32")
  picks = []
  for step in range(3):
    out = np.asarray(dq.simulate(g, codec=codec, key=jax.random.key(step)))
    rows = _sent_rows(out)
    assert len(set(rows)) == 1 and len(rows[0]) == codec.rows(g.shape[1], N)[1]
    mean = g.astype(np.float64).mean(0).reshape(-1, ROW)
    np.testing.assert_allclose(out[0].reshape(-1, ROW)[list(rows[0])], mean[list(rows[0])],
                               atol=2e-6, rtol=0)
    picks.append(rows[0])
  assert len(set(picks)) == 3
  assert codec.wire_bits(g.shape[1], N) == 32 * 8 * ROW  # no metadata: the rows only


@pytest.mark.parametrize("row", [1, ROW])
def test_top_k_all_gather_sums_every_ranks_own_top_rows(row):
  from dynamiq_jax.bench.baselines import topk_allgather, topk_wire
  g = _grads(seed=6)
  tx = topk_allgather("i", ratio=0.1, row=row, values="f32", error_feedback=False)
  out, _ = jax.vmap(lambda x, s: tx.update(x, s), axis_name="i")(
      jnp.asarray(g), jax.tree.map(lambda a: jnp.stack([a] * N), tx.init(jnp.zeros(g.shape[1]))))
  assert rows_identical(out)
  rows = g.reshape(N, -1, row)
  k = max(1, int(0.1 * rows.shape[1]))
  want = np.zeros_like(rows[0], np.float64)
  for r in range(N):
    top = np.argsort(-(rows[r].astype(np.float64) ** 2).sum(-1), kind="stable")[:k]
    want[top] += rows[r][top]
  np.testing.assert_allclose(np.asarray(out[0]), (want / N).reshape(-1), atol=2e-6, rtol=0)
  w = topk_wire(g.shape[1], N, 0.1, row, 16)
  assert w["bytes_per_rank"] == (N - 1) * k * (row * 2 + 4)
