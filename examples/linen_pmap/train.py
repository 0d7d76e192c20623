"""The classic Flax loop: Linen module, ``TrainState``, ``jax.pmap(axis_name="batch")``.

Nothing changes in the loop but the optimizer. Under ``pmap`` each device's
``jax.grad`` returns that device's gradients; where a classic loop would
call ``jax.lax.pmean(grads, "batch")``, the first transform of the chain
all-reduces them instead, compressed::

    tx = optax.chain(dq.compressed_psum("batch"), optax.adamw(1e-3))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    ...
    state = state.apply_gradients(grads=grads)   # inside the pmapped step

(Here the all-reduce is picked by name, ``dq.reducer(config.codec, "batch", ...)``,
in the chain ``examples.reduction.make_optimizer`` builds.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax import linen as nn
from flax import serialization
from flax.training import train_state

from .. import datasets
from .. import loop
from .. import reduction
from .config import Config
from ..devices import pad_to_multiple
from ..devices import param_shapes
from ..devices import setup
from ..devices import weighted_mean
from ..metrics import run_metrics

AXIS = "batch"


class CNN(nn.Module):
  """Two 3x3 convolutions, average pooling, two dense layers."""

  features: int = 32
  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    """float32[batch, 8, 8, 1] images -> float32[batch, 10] logits."""
    x = nn.relu(nn.Conv(self.features, (3, 3))(x))
    x = nn.relu(nn.Conv(2 * self.features, (3, 3))(x))
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(10)(nn.relu(nn.Dense(self.hidden)(x)))


def create_train_state(config: Config, rng) -> train_state.TrainState:
  """Parameters, and the optimizer whose first transform all-reduces over ``AXIS``."""
  model = CNN(features=config.features, hidden=config.hidden)
  params = model.init(rng, jnp.zeros((1, 8, 8, 1), jnp.float32))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=reduction.make_optimizer(config, AXIS))


def loss_fn(apply_fn, params, images, labels):
  """Mean cross-entropy of ``images`` under ``params``."""
  logits = apply_fn({"params": params}, images)
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_step(state: train_state.TrainState, images, labels):
  """One step on one device's share of the batch (run under ``jax.pmap``)."""
  loss, grads = jax.value_and_grad(loss_fn, argnums=1)(  # this device's gradients
      state.apply_fn, state.params, images, labels)
  state = state.apply_gradients(grads=grads)               # tx all-reduces them first
  return state, jax.lax.pmean(loss, AXIS)


def eval_step(state: train_state.TrainState, images, labels):
  """Per-example loss and correctness on one device's share (under ``jax.pmap``)."""
  logits = state.apply_fn({"params": state.params}, images)
  return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
          "correct": (jnp.argmax(logits, -1) == labels).astype(jnp.float32)}


def _per_device(n: int, *arrays):
  return tuple(a.reshape((n, -1) + a.shape[1:]) for a in arrays)


def train_and_evaluate(config: Config) -> dict:
  """Trains the Linen CNN on the digits under ``jax.pmap``, as ``nnx_digits`` does with NNX.

  Args:
    config: the settings (``config.get_config()`` plus changes).

  Returns:
    The metrics, as for ``examples.nnx_digits.train.train_and_evaluate``
    (written to the ``workdir`` too, next to the checkpoints a later run
    resumes from), plus ``replicas_identical``: whether every device ends
    with the same parameters.
  """
  devices, n, _ = setup(config, AXIS)
  data = datasets.load_digits(config.test_fraction)

  batches = datasets.EpochBatches(len(data.y_train), config.batch_size, config.seed)
  state = create_train_state(config, jax.random.key(config.seed))
  params = param_shapes(state.params)
  # One copy of the state per device, stacked on a leading axis: the pmap way.
  # Naming the mesh axis like pmap's gives the copies the sharding the step
  # returns, so the second step does not compile again.
  state = jax_utils.replicate(state, devices, axis_name=AXIS)
  p_train_step = jax.pmap(train_step, axis_name=AXIS, devices=devices, donate_argnums=(0,))
  p_eval_step = jax.pmap(eval_step, axis_name=AXIS, devices=devices)
  (x_test, y_test), weights = pad_to_multiple([data.x_test, data.y_test], n)
  test_batch = _per_device(n, x_test, y_test)

  def run_eval(state) -> dict:
    out = jax.device_get(p_eval_step(state, *test_batch))
    return {"test_loss": weighted_mean(out["loss"], weights),
            "test_accuracy": weighted_mean(out["correct"], weights)}

  def batch_fn(position):
    idx = batches.indices(position)
    return _per_device(n, data.x_train[idx], data.y_train[idx])

  def step_fn(state, batch):
    return p_train_step(state, *batch)

  # Checkpoints hold the per-device copies as they are (state dicts of the
  # stacked arrays), so per-rank optimizer state survives a restore too.
  to_checkpoint = serialization.to_state_dict
  from_checkpoint = functools.partial(serialization.from_state_dict, state)

  state, history, start = loop.train_loop(
      config, state=state, step_fn=step_fn, batch_fn=batch_fn, eval_fn=run_eval,
      to_checkpoint=to_checkpoint, from_checkpoint=from_checkpoint,
      desc=f"linen pmap {config.codec}")
  final = {k: history.evals[-1][k] for k in ("test_accuracy", "test_loss")}
  # Every device holds its own copy; the all-reduce gives every rank the same bytes.
  replicas_identical = all(bool(np.all(a == a[:1]))
                           for a in jax.tree.leaves(jax.device_get(state.params)))
  return run_metrics(
      "linen_pmap", config, devices=devices, params=params, history=history, start=start,
      state=to_checkpoint(state), final=final,
      extra={"replicas_identical": replicas_identical})
