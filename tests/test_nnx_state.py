"""dq.nnx.DataParallel with model state beyond the parameters: RNG streams (dropout),
BatchNorm statistics, a custom variable, and the eval step that uses them.

One tiny model on a 4 x 2 ("data", "model") mesh, so the step's shard_map is manual over
"data" only (the partial-manual map the library builds for sharded models). Two steps are
trained once per module (``run``) and the tests read what they left.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dynamiq_jax as dq

N_DATA, N_MODEL, WIDTH, PER_RANK = 4, 2, 32, 4
MOMENTUM = 0.5  # BatchNorm's running averages move half way per step: the test sees them


class Seen(nnx.Variable):
  """A variable the forward pass writes (neither a parameter nor a batch statistic)."""


class Net(nnx.Module):
  """BatchNorm first (its input is the batch itself), dropout on a vector of ones (the
  mask itself), then a linear layer. ``masks`` records this rank's mask in the rank's own
  row, zeros elsewhere: after DataParallel's mean over the data axis, row r times the
  number of ranks is rank r's mask. ``calls`` counts forward passes."""

  def __init__(self, rngs: nnx.Rngs):
    self.bn = nnx.BatchNorm(WIDTH, momentum=MOMENTUM, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)
    self.masks = Seen(jnp.zeros((N_DATA, WIDTH)))
    self.calls = Seen(jnp.zeros((), jnp.int32))

  def __call__(self, x):
    mask = self.drop(jnp.ones((WIDTH,)))
    rank = jax.lax.axis_index("data")
    self.masks[...] = jnp.zeros((N_DATA, WIDTH)).at[rank].set(mask)
    self.calls[...] += 1
    return self.out(self.bn(x) * mask)


def loss_fn(model, batch):
  x, y = batch
  return ((model(x) - y) ** 2).mean()


def make_batch(step):
  """The global batch: rank r's rows shifted by 3 r, so that each rank's statistics are
  far from the global batch's (the mean of the ranks' variances is not the variance)."""
  rng = np.random.default_rng(100 + step)
  x = rng.standard_normal((N_DATA * PER_RANK, WIDTH)).astype(np.float32)
  x += 3.0 * np.repeat(np.arange(N_DATA, dtype=np.float32), PER_RANK)[:, None]
  return x, x[:, :1].copy()


def build(seed):
  mesh = jax.make_mesh((N_DATA, N_MODEL), ("data", "model"))
  tx = optax.chain(dq.baseline_psum("data", dtype=jnp.float32), optax.sgd(0.1))
  return dq.nnx.DataParallel.create(Net(nnx.Rngs(seed)), tx, mesh=mesh)


def host(x):
  return np.asarray(jax.device_get(x))


def every_copy(x):
  """The value each device holds of a replicated state leaf."""
  return [np.asarray(s.data) for s in x.addressable_shards]


def masks_of(state):
  return host(state[0]["masks"][...]) * N_DATA  # row r: rank r's mask


@pytest.fixture(scope="module")
def run():
  """Two steps from seed 0 (states kept: donate=False), their batches, the step."""
  dp = build(0)
  step = dp.train_step(loss_fn, donate=False)
  states, batches = [dp.state], [make_batch(0), make_batch(1)]
  for x, y in batches:
    states.append(step(states[-1], dp.shard_batch((x, y)))[0])
  return dp, step, states, batches


def test_each_rank_draws_its_own_dropout_mask(run):
  _, _, states, _ = run
  masks = masks_of(states[1])
  assert set(np.unique(masks)) <= {0.0, 2.0}, masks  # one whole mask per row, scaled 1/0.5
  assert len({m.tobytes() for m in masks}) == N_DATA, masks


def test_the_stream_advances_every_step(run):
  _, _, states, _ = run
  first, second = masks_of(states[1]), masks_of(states[2])
  assert all(not np.array_equal(a, b) for a, b in zip(first, second)), (first, second)
  key = states[0][0]["drop"]["rngs"]["key"][...]
  for i, state in enumerate(states):
    stream = state[0]["drop"]["rngs"]
    # the stored stream stays the one replicated key; only its count moves, on every rank
    assert host(jax.random.key_data(stream["key"][...])).tolist() == host(
        jax.random.key_data(key)).tolist()
    assert [int(c) for c in every_copy(stream["count"][...])] == [i] * N_DATA * N_MODEL


def test_the_masks_are_reproducible_from_the_seed(run):
  dp, step, states, batches = run
  x, y = batches[0]
  again = step(build(0).state, dp.shard_batch((x, y)))[0]
  other = step(build(1).state, dp.shard_batch((x, y)))[0]
  np.testing.assert_array_equal(masks_of(again), masks_of(states[1]))
  assert not np.array_equal(masks_of(other), masks_of(states[1]))


def test_batch_norm_keeps_the_global_batchs_statistics_on_every_rank(run):
  _, _, states, batches = run
  mean, var = np.zeros(WIDTH), np.ones(WIDTH)  # BatchNorm's initial running statistics
  for state, (x, _) in zip(states[1:], batches):
    mean = MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0)
    var = MOMENTUM * var + (1 - MOMENTUM) * x.var(0)
    for got in every_copy(state[0]["bn"]["mean"][...]):
      np.testing.assert_allclose(got, mean, rtol=1e-5, atol=1e-5)
    for got in every_copy(state[0]["bn"]["var"][...]):
      np.testing.assert_allclose(got, var, rtol=1e-4, atol=1e-4)


def test_a_custom_variable_is_carried_and_kept_equal(run):
  _, _, states, _ = run
  for i, state in enumerate(states):
    assert [int(c) for c in every_copy(state[0]["calls"][...])] == [i] * N_DATA * N_MODEL
  copies = every_copy(states[2][0]["masks"][...])  # per rank in the pass, averaged after it
  assert all(np.array_equal(c, copies[0]) for c in copies)
  assert np.count_nonzero(copies[0]) > 0


def test_eval_step_uses_the_running_statistics_without_dropout(run):
  dp, _, states, batches = run
  state = states[2]
  x = batches[1][0]
  bn, out = state[0]["bn"], state[0]["out"]
  normed = (x - host(bn["mean"][...])) / np.sqrt(host(bn["var"][...]) + 1e-5)
  hidden = normed * host(bn["scale"][...]) + host(bn["bias"][...])
  want = hidden @ host(out["kernel"][...]) + host(out["bias"][...])
  got = host(dp.eval_step(lambda model, x: model(x))(state, dp.shard_batch(x)))
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  # the same model as trained (eval_mode=False): batch statistics and dropout, not the above
  trained = host(dp.eval_step(lambda model, x: model(x), eval_mode=False)(
      state, dp.shard_batch(x)))
  assert not np.allclose(trained, want, rtol=1e-2, atol=1e-2)


def test_the_users_own_eval_call_works_too(run):
  dp, _, states, batches = run
  x = batches[1][0]

  def evaluate(model, x):
    model.eval()  # as in a plain NNX loop
    return model(x)

  plain = dp.eval_step(lambda model, x: model(x))(states[2], dp.shard_batch(x))
  mine = dp.eval_step(evaluate, eval_mode=False)(states[2], dp.shard_batch(x))
  np.testing.assert_array_equal(host(mine), host(plain))


class Counter(nnx.Module):
  """A linear layer that counts, per rank, the positive inputs it has seen."""

  def __init__(self, rngs, dtype):
    self.lin = nnx.Linear(WIDTH, 1, rngs=rngs)
    self.positive = Seen(jnp.zeros((), dtype))

  def __call__(self, x):
    self.positive[...] += (x > 0).sum().astype(self.positive.dtype)
    return self.lin(x)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
def test_a_per_rank_variable_is_averaged_or_refused(dtype):
  mesh = jax.make_mesh((N_DATA * N_MODEL,), ("data",))
  tx = optax.chain(dq.baseline_psum("data", dtype=jnp.float32), optax.sgd(0.1))
  dp = dq.nnx.DataParallel.create(Counter(nnx.Rngs(0), dtype), tx, mesh=mesh)
  step = dp.train_step(loss_fn)
  x, y = make_batch(0)
  x, y = np.resize(x, (8 * PER_RANK, WIDTH)) - 1.5, np.resize(y, (8 * PER_RANK, 1))
  if dtype == jnp.int32:
    with pytest.raises(ValueError, match=r"\['positive'\].*integer has no mean.*jax.lax.psum"):
      step(dp.state, dp.shard_batch((x, y)))
    return
  state, _ = step(dp.state, dp.shard_batch((x, y)))
  want = (x > 0).sum() / (N_DATA * N_MODEL)  # the mean of the ranks' counts
  for got in every_copy(state[0]["positive"][...]):
    assert float(got) == pytest.approx(want)


class Normed(nnx.Module):

  def __init__(self, rngs):
    self.bn = nnx.BatchNorm(WIDTH, momentum=MOMENTUM, rngs=rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(self.bn(x))


def test_a_batch_norm_step_equals_one_on_the_whole_batch():
  # synchronised BatchNorm: the gradient flows through the average of the ranks' moments,
  # so the step is the single-device step on the global batch (exact reduction, SGD)
  x, y = make_batch(0)
  mesh = jax.make_mesh((N_DATA, N_MODEL), ("data", "model"))
  tx = optax.chain(dq.baseline_psum("data", dtype=jnp.float32), optax.sgd(0.5))
  dp = dq.nnx.DataParallel.create(Normed(nnx.Rngs(0)), tx, mesh=mesh)
  state, _ = dp.train_step(loss_fn)(dp.state, dp.shard_batch((x, y)))

  model = Normed(nnx.Rngs(0))
  grads = nnx.grad(loss_fn)(model, (x, y))
  want = jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(model, nnx.Param), grads)
  got = nnx.state(dp.merge(state)[0], nnx.Param)
  for (path, w), g in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)):
    np.testing.assert_allclose(host(g), host(w), rtol=1e-4, atol=1e-5, err_msg=str(path))


class Stacked(nnx.Module):
  """Three dropout layers built under nnx.vmap (as scanned layers are): one stream each,
  stored as a stack of 3 keys. ``masks`` as in ``Net``: [rank, layer, unit]."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return nnx.Dropout(0.5, rngs=rngs)

    self.drops = make(rngs)
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)
    self.masks = Seen(jnp.zeros((8, 3, WIDTH)))

  def __call__(self, x):
    masks = nnx.vmap(lambda drop, ones: drop(ones), in_axes=(0, None))(
        self.drops, jnp.ones((WIDTH,)))
    self.masks[...] = jnp.zeros((8, 3, WIDTH)).at[jax.lax.axis_index("data")].set(masks)
    return self.out(x * masks.mean(0))


def test_stacked_streams_draw_per_rank_and_per_layer():
  mesh = jax.make_mesh((8,), ("data",))
  tx = optax.chain(dq.baseline_psum("data", dtype=jnp.float32), optax.sgd(0.1))
  dp = dq.nnx.DataParallel.create(Stacked(nnx.Rngs(0)), tx, mesh=mesh)
  x = np.ones((8 * PER_RANK, WIDTH), np.float32)
  state, _ = dp.train_step(loss_fn)(dp.state, dp.shard_batch((x, x[:, :1])))
  masks = host(state[0]["masks"][...]).reshape(8 * 3, WIDTH) * 8
  assert set(np.unique(masks)) <= {0.0, 2.0}, masks
  assert len({m.tobytes() for m in masks}) == 8 * 3, masks
  assert host(state[0]["drops"]["rngs"]["count"][...]).tolist() == [1, 1, 1]


class Late(nnx.Module):
  """A variable first set in ``__call__``: the state after the step has one more leaf."""

  def __init__(self, rngs):
    self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    self.last = Seen(x.mean())
    return self.out(x)


def test_variables_created_in_the_forward_pass_are_refused_with_the_fix(mesh):
  tx = optax.chain(dq.baseline_psum("data", dtype=jnp.float32), optax.sgd(0.1))
  dp = dq.nnx.DataParallel.create(Late(nnx.Rngs(0)), tx, mesh=mesh)
  x, y = make_batch(0)
  x, y = np.resize(x, (8 * PER_RANK, WIDTH)), np.resize(y, (8 * PER_RANK, 1))
  with pytest.raises(ValueError, match=r"created the model variables \['last'\];.*__init__"):
    dp.train_step(loss_fn)(dp.state, dp.shard_batch((x, y)))


def test_a_chain_without_the_reduction_is_refused_with_the_fix(mesh):
  """optax.adam alone (no compressed_psum first): each rank would step with its own
  gradient; the error says where the reduction goes (not JAX's out_specs error, which
  suggests check_vma=False)."""
  dp = dq.nnx.DataParallel.create(nnx.Linear(WIDTH, 1, rngs=nnx.Rngs(0)), optax.adam(1e-3),
                                  mesh=mesh)
  x, y = make_batch(0)
  x, y = np.resize(x, (8 * PER_RANK, WIDTH)), np.resize(y, (8 * PER_RANK, 1))
  with pytest.raises(ValueError, match=r"no gradient reduction over 'data'.*Fix: put the "
                                       r"reduction first.*dq\.compressed_psum\('data'\)"):
    step = dp.train_step(lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    step(dp.state, dp.shard_batch((x, y)))
