"""Trains a small CNN on scikit-learn's digits, data-parallel, with NNX.

The optimizer is the issue's one-liner with the all-reduce picked by name::

    tx = optax.chain(dq.reducer(config.codec, "data", bits=...), optax.adamw(...))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

(``examples.reduction.make_optimizer`` builds it; ``dq.reducer("dynamiq", ...)`` is
``dq.compressed_psum(codec=DynamiQ(...))``.)
Each rank computes gradients on its slice of the global batch; the chain
all-reduces them (compressed unless ``--codec psum-*``) before AdamW.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dynamiq_jax.training.nnx import DataParallel
from .. import datasets
from .. import reduction
from .config import Config
from ..devices import pad_to_multiple
from ..devices import param_shapes
from ..devices import setup
from ..devices import shard_batch
from ..devices import weighted_mean
from ..metrics import run_metrics
from ..nnx_parallel import train_loop


class CNN(nnx.Module):
  """Two 3x3 convolutions with BatchNorm, average pooling, two dense layers with Dropout.

  Built in training mode (BatchNorm normalises with the batch's statistics and
  updates its running averages; Dropout drops); ``model.eval()``, or
  ``DataParallel.eval_step``, switches to the running averages and no dropout.
  Under ``dq.nnx.DataParallel`` the BatchNorm statistics are those of the global
  batch and every rank draws its own dropout mask from the ``dropout`` stream.
  """

  def __init__(self, *, features: int = 32, hidden: int = 128, dropout: float = 0.1,
               rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, features, (3, 3), use_bias=False, rngs=rngs)
    self.norm1 = nnx.BatchNorm(features, rngs=rngs)
    self.conv2 = nnx.Conv(features, 2 * features, (3, 3), use_bias=False, rngs=rngs)
    self.norm2 = nnx.BatchNorm(2 * features, rngs=rngs)
    self.dense1 = nnx.Linear(4 * 4 * 2 * features, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs)
    self.dense2 = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    """float32[batch, 8, 8, 1] images -> float32[batch, 10] logits."""
    x = nnx.relu(self.norm1(self.conv1(x)))
    x = nnx.relu(self.norm2(self.conv2(x)))
    x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    return self.dense2(self.dropout(nnx.relu(self.dense1(x))))


def make_model(config: Config) -> CNN:
  """The CNN of ``config``, in training mode, initialised from ``config.seed``.

  Parameters come from the default stream (``config.seed``); dropout masks from
  a ``dropout`` stream whose key is derived from the seed too, so that a run is
  reproducible from its seed alone.
  """
  rngs = nnx.Rngs(config.seed, dropout=jax.random.fold_in(jax.random.key(config.seed), 1))
  return CNN(features=config.features, hidden=config.hidden, dropout=config.dropout, rngs=rngs)


def loss_fn(model: CNN, batch) -> jax.Array:
  """Mean cross-entropy over the (local) batch."""
  images, labels = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


def per_example(model: CNN, batch) -> dict:
  """Per-example loss and correctness, for evaluation."""
  images, labels = batch
  logits = model(images)
  return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, labels),
          "correct": (jnp.argmax(logits, -1) == labels).astype(jnp.float32)}


def train_and_evaluate(config: Config) -> dict:
  """Trains the CNN on the training digits, evaluating it on the held-out ones.

  Args:
    config: the settings (``config.get_config()`` plus changes).

  Returns:
    The metrics of :func:`examples.metrics.run_metrics`; ``evals`` and
    ``final`` hold ``test_loss`` and ``test_accuracy``. With a ``workdir``,
    they are written there too, next to the checkpoints a later run
    resumes from, bit for bit (:func:`examples.loop.train_loop`).
  """
  devices, n, mesh = setup(config)
  data = datasets.load_digits(config.test_fraction)

  batches = datasets.EpochBatches(len(data.y_train), config.batch_size, config.seed)

  def batch_fn(position):
    idx = batches.indices(position)
    return shard_batch(mesh, (data.x_train[idx], data.y_train[idx]))

  model = make_model(config)
  params = param_shapes(nnx.state(model, nnx.Param))
  dp = DataParallel.create(model, reduction.make_optimizer(config), mesh=mesh)
  evaluate = dp.eval_step(per_example)  # eval mode: running statistics, no dropout
  (x_test, y_test), weights = pad_to_multiple([data.x_test, data.y_test], n)
  test_batch = shard_batch(mesh, (x_test, y_test))

  def run_eval(state) -> dict:
    out = jax.device_get(evaluate(state, test_batch))
    return {"test_loss": weighted_mean(out["loss"], weights),
            "test_accuracy": weighted_mean(out["correct"], weights)}

  state, history, start = train_loop(dp, config, loss_fn, batch_fn=batch_fn, eval_fn=run_eval,
                                        desc=f"digits {config.codec}")
  final = {k: history.evals[-1][k] for k in ("test_accuracy", "test_loss")}
  return run_metrics("nnx_digits", config, devices=devices, params=params, history=history,
                     start=start, state=state, final=final)
