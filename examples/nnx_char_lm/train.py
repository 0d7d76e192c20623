"""Trains a small byte-level decoder-only transformer on Python's own source code.

The text is the standard library's ``.py`` files (read from the local
Python installation, so nothing is downloaded), split by file into a
training text and a held-out text. The model predicts the next byte;
evaluation is the mean cross-entropy on fixed held-out windows, in nats per
byte (``eval_bits_per_byte`` = nats / ln 2).

The optimizer is the issue's one-liner with the all-reduce picked by name
(built by ``examples.reduction.make_optimizer``)::

    tx = optax.chain(dq.reducer(config.codec, "data", bits=...), optax.adamw(...))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
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
from ..metrics import run_metrics
from ..nnx_parallel import train_loop

VOCAB = 256  # bytes


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
    if dim % heads:
      raise ValueError(f"dim={dim} must be a multiple of heads={heads}")
    self.heads = heads
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads), 3, axis=2)
    y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True)
    return self.out(y.reshape(b, t, d))


class Block(nnx.Module):
  """Pre-norm transformer block: attention and a GELU MLP, each residual."""

  def __init__(self, dim: int, heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.attn = CausalSelfAttention(dim, heads, rngs=rngs)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, mlp_ratio * dim, rngs=rngs)
    self.down = nnx.Linear(mlp_ratio * dim, dim, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.norm1(x))
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class CharTransformer(nnx.Module):
  """Byte embeddings + learned positions, blocks, tied output projection."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, config.dim, rngs=rngs)
    self.position = nnx.Param(
        0.02 * jax.random.normal(rngs.params(), (config.context, config.dim)))
    self.blocks = nnx.List([Block(config.dim, config.heads, config.mlp_ratio, rngs=rngs)
                            for _ in range(config.layers)])
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int32[batch, length] bytes -> float32[batch, length, 256] next-byte logits."""
    x = self.embed(tokens) + self.position[:tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


def loss_fn(model: CharTransformer, batch) -> jax.Array:
  """Mean next-byte cross-entropy over the (local) batch."""
  inputs, targets = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()


def per_example(model: CharTransformer, batch) -> jax.Array:
  """Mean cross-entropy of each window, for evaluation."""
  inputs, targets = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean(-1)


def make_optimizer(config: Config, axis_name: str = "data") -> optax.GradientTransformation:
  """:func:`examples.reduction.make_optimizer` decaying to a tenth of the peak, AdamW ``b2=0.99``."""
  return reduction.make_optimizer(config, axis_name, final_lr_fraction=0.1, b2=0.99)


def train_and_evaluate(config: Config) -> dict:
  """Trains the transformer on the training text, evaluating it on held-out windows.

  Args:
    config: the settings (``config.get_config()`` plus changes).

  Returns:
    The metrics of :func:`examples.metrics.run_metrics` and the ``corpus``
    read; ``evals`` and ``final`` hold the held-out ``eval_loss`` (nats per
    byte) and ``eval_bits_per_byte``. With a ``workdir``, they are written
    there too, next to the checkpoints a later run resumes from, bit for bit
    (:func:`examples.loop.train_loop`).
  """
  devices, n, mesh = setup(config)
  corpus = datasets.python_source_corpus(config.corpus_bytes, config.held_out_every)

  def batch_fn(position):
    return shard_batch(mesh, datasets.random_windows(
        corpus.train, config.batch_size, config.context, config.seed, position))

  model = CharTransformer(config, rngs=nnx.Rngs(config.seed))
  params = param_shapes(nnx.state(model, nnx.Param))
  dp = DataParallel.create(model, make_optimizer(config), mesh=mesh)
  evaluate = dp.eval_step(per_example)
  (x_eval, y_eval), weights = pad_to_multiple(
      datasets.even_windows(corpus.held_out, config.eval_windows, config.context), n)
  eval_batch = shard_batch(mesh, (x_eval, y_eval))

  def run_eval(state) -> dict:
    losses = np.asarray(jax.device_get(evaluate(state, eval_batch)), np.float64)
    loss = float(np.sum(losses * weights) / weights.sum())
    return {"eval_loss": loss, "eval_bits_per_byte": loss / math.log(2)}

  state, history, start = train_loop(dp, config, loss_fn, batch_fn=batch_fn, eval_fn=run_eval,
                                        desc=f"char-LM {config.codec}")
  metrics = run_metrics(
      "nnx_char_lm", config, devices=devices, params=params, history=history, start=start,
      state=state, final={k: history.evals[-1][k] for k in ("eval_loss", "eval_bits_per_byte")},
      extra={"corpus": {"root": corpus.root, "files": corpus.files,
                        "train_bytes": int(corpus.train.size),
                        "held_out_bytes": int(corpus.held_out.size),
                        "eval_windows": int(weights.sum()), "sha256": corpus.sha256}})
  return metrics
