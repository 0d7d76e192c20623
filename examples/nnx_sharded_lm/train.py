"""A byte-level transformer LM on a 2-D mesh: the model sharded over one axis, the
gradient reduced, compressed, over the other.

Two layouts of 8 devices (or any count) on a 2-D mesh, and two on the 1-D data
mesh to compare with (``data``: everything replicated, ``dq.compressed_psum``;
``zero``: parameters and optimizer state split over ``data``,
``dq.compressed_psum_scatter``):

* ``tensor``: mesh ``("data", "model")``. The attention heads and the MLP's hidden
  units are split over ``model`` (Megatron-style tensor parallelism, from the
  logical axis names each layer declares and :data:`RULES`); each device reduces
  its own shard of the gradient over ``data`` with ``dq.compressed_psum``.
* ``hsdp``: mesh ``("host", "local")``. Every parameter and its Adam moments are
  split over ``local`` (FSDP inside a host, ``dq.zero_shardings``) and replicated
  over ``host``; ``dq.compressed_psum_scatter(schedule="hierarchical")`` sums the
  gradient exactly inside the host, compresses it across hosts on each shard, and
  never gathers it back; the parameters are all-gathered at their own precision
  inside the host for the forward pass.

On one machine the devices are simulated CPU devices; with ``--num_processes`` each
process holds ``--local_devices`` of them (one process per host), and only the
``data`` / ``host`` axis crosses processes, so only compressed traffic does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq
from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE

VOCAB = 256  # bytes

RULES = (("embed", None), ("heads", "model"), ("mlp", "model"), ("vocab", None))
"""Logical axis -> mesh axis, for ``layout="tensor"`` (``nnx.logical_axis_rules``)."""

LAYOUTS = ("tensor", "hsdp", "data", "zero")


@dataclasses.dataclass(frozen=True)
class Config:
  """What to train, and how to lay it out.

  Attributes:
    layout: ``"tensor"``, ``"hsdp"``, ``"data"`` or ``"zero"``.
    model_axis: devices along the model axis (``tensor``: ``model``; ``hsdp``:
      ``local``, the devices of one host).
    codec: ``"dynamiq"`` or any name in ``dq.REDUCERS`` whose codec can reduce-scatter.
    bits: DynamiQ's bits per coordinate.
    steps: training steps.
    batch_size: global batch, in sequences.
    context: sequence length, in bytes.
    dim, heads, layers: the transformer's width, attention heads, blocks.
    learning_rate: Adam's.
    seed: initialisation, data order and rounding.
    axis_types: ``"auto"`` (the compiler places what the shardings leave open) or
      ``"explicit"`` (shardings are part of the arrays' types).
    bucket_size: the reduction's most coordinates per bucket (the library's default).
    tp_codec: ``layout="tensor"`` only: the row-parallel projections' all-reduce over
      ``model``: ``"none"`` (the compiler's own, from the shardings) or a name in
      ``dq.TP_CODECS`` (``dq.tp_psum`` with that codec, two-step schedule, in a
      ``shard_map`` manual over ``model``).
  """

  layout: str = "tensor"
  model_axis: int = 2
  codec: str = "dynamiq"
  bits: float = 5.0
  steps: int = 20
  batch_size: int = 32
  context: int = 64
  dim: int = 128
  heads: int = 4
  layers: int = 2
  learning_rate: float = 3e-3
  seed: int = 0
  axis_types: str = "auto"
  bucket_size: int = DEFAULT_BUCKET_SIZE
  tp_codec: str = "none"


def _linear(din, dout, axes, rngs, bias=True):
  return nnx.Linear(din, dout, use_bias=bias, rngs=rngs,
                    kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), axes),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:]))


def _row_parallel_out(x):
  """The output sharding of a row-parallel projection whose result is shaped like ``x``:
  ``x``'s own where the mesh axes are Explicit (the contraction over the sharded
  dimension is then an all-reduce over it), None (the compiler's choice) where they
  are Auto."""
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
    return None
  return sharding.spec


def row_parallel(layer: nnx.Linear, x, out_sharding, tp_codec):
  """``layer(x)`` for a row-parallel layer (input features split over "model"): the
  compiler's all-reduce where ``tp_codec`` is None, else the partial sums reduced by
  ``dq.tp_psum`` inside a ``shard_map`` manual over "model" (the other axes left as
  they are), the bias added after the sum."""
  if tp_codec is None:
    return layer(x, out_sharding=out_sharding)
  lead = (None,) * (x.ndim - 1)
  y = jax.shard_map(lambda x, w: dq.tp_psum(x @ w, "model", codec=tp_codec),
                    in_specs=(P(*lead, "model"), P("model", None)), out_specs=P(),
                    axis_names={"model"})(x, layer.kernel[...])
  return y + layer.bias[...] if layer.bias is not None else y


class Block(nnx.Module):
  """Pre-norm block: causal self-attention (heads split over "heads"), a GELU MLP
  (hidden units split over "mlp"); column- then row-parallel, as in Megatron.
  ``tp_codec``: the row-parallel projections' codec (:func:`row_parallel`)."""

  def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs, tp_codec=None):
    self.heads = heads
    self.tp_codec = tp_codec
    self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
    self.qkv = _linear(dim, 3 * dim, ("embed", "heads"), rngs, bias=False)
    self.out = _linear(dim, dim, ("heads", "embed"), rngs, bias=False)
    self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
    self.up = _linear(dim, 4 * dim, ("embed", "mlp"), rngs)
    self.down = _linear(4 * dim, dim, ("mlp", "embed"), rngs)

  def __call__(self, x):
    b, t, d = x.shape
    # the qkv columns are head-major (head, q|k|v, unit): split over "model" in whole heads,
    # so the reshape needs no gather
    qkv = self.qkv(self.norm1(x)).reshape(b, t, self.heads, 3, d // self.heads)
    q, k, v = (qkv[:, :, :, i] for i in range(3))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + row_parallel(self.out, y.reshape(b, t, d), _row_parallel_out(x), self.tp_codec)
    return x + row_parallel(self.down, nnx.gelu(self.up(self.norm2(x))), _row_parallel_out(x),
                            self.tp_codec)


class ByteLM(nnx.Module):
  """Byte embeddings + learned positions, blocks, tied output projection."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, config.dim, rngs=rngs, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(0.02), ("vocab", "embed")))
    self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(),
                                                       (config.context, config.dim)))
    tp_codec = dq.tp_codec_from_name(config.tp_codec)
    if tp_codec is not None and config.layout != "tensor":
      raise ValueError(f"tp_codec={config.tp_codec!r} compresses the tensor-parallel "
                       f"all-reduce over 'model', which layout={config.layout!r} has not. "
                       f"Fix: --layout tensor, or --tp_codec none")
    self.blocks = nnx.List([Block(config.dim, config.heads, rngs=rngs, tp_codec=tp_codec)
                            for _ in range(config.layers)])
    self.norm = nnx.LayerNorm(config.dim, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.position[:tokens.shape[1]]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x))


def loss_fn(model: ByteLM, batch):
  """Mean next-byte cross-entropy over this rank's part of the batch."""
  inputs, targets = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(inputs), targets).mean()


def make_mesh(config: Config, devices) -> tuple[Mesh, tuple]:
  """The 2-D mesh over ``devices`` (in order: a process's devices are consecutive, so the
  first axis is the one that crosses processes) and the data-parallel axis name(s)."""
  devices = np.asarray(devices)
  kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[config.axis_types]
  if config.layout in ("data", "zero"):
    return Mesh(devices, ("data",), axis_types=(kind,)), "data"
  if devices.size % config.model_axis:
    raise ValueError(f"{devices.size} devices do not split into rows of model_axis="
                     f"{config.model_axis}")
  grid = devices.reshape(-1, config.model_axis)
  if config.layout == "tensor":
    return Mesh(grid, ("data", "model"), axis_types=(kind,) * 2), "data"
  if config.layout == "hsdp":
    return Mesh(grid, ("host", "local"), axis_types=(kind,) * 2), ("host", "local")
  raise ValueError(f"layout={config.layout!r} is not one of {LAYOUTS}")


def make_optimizer(config: Config):
  """The compressed reduction over the data axes, then Adam."""
  codec = dq.codec_from_name(config.codec, **({"bits": config.bits}
                                              if config.codec == "dynamiq" else {}))
  kw = dict(codec=codec, seed=config.seed, bucket_size=config.bucket_size)
  if config.layout in ("tensor", "data"):
    reduce = dq.compressed_psum("data", **kw)
  elif config.layout == "zero":
    reduce = dq.compressed_psum_scatter("data", **kw)
  else:
    reduce = dq.compressed_psum_scatter(("host", "local"), schedule="hierarchical", **kw)
  return optax.chain(reduce, optax.adam(config.learning_rate))


def _put(x, sharding):
  """A value every process holds whole, as a global array (works across processes)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def build(config: Config, devices) -> dq.nnx.DataParallel:
  """The model, sharded as the layout says, and its optimizer, on the mesh."""
  mesh, axis = make_mesh(config, devices)
  # Built on the host (no mesh: the same values in every process), then placed.
  with nnx.use_eager_sharding(False):
    model = ByteLM(config, rngs=nnx.Rngs(config.seed))
  state = nnx.state(model)
  if config.layout == "tensor":  # the layers' logical axis names -> mesh axes
    rules = dict(RULES)
    specs = jax.tree.map(lambda s: P(*[rules.get(a) for a in s]),
                         nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, P))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda x: isinstance(x, P))
  elif config.layout == "data":
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), state)
  else:  # split every parameter over the devices of a host (hsdp), or all of them (zero)
    shardings = dq.zero_shardings(state, mesh=mesh, min_size=0,
                                  axis_name="local" if config.layout == "hsdp" else "data")
  nnx.update(model, jax.tree.map(_put, state, shardings))
  return dq.nnx.DataParallel.create(model, make_optimizer(config), mesh=mesh, axis_name=axis)


def batch(config: Config, text: np.ndarray, step: int):
  """Step ``step``'s global batch: ``batch_size`` random windows (inputs, targets)."""
  rng = np.random.default_rng([config.seed, step])
  starts = rng.integers(0, len(text) - config.context - 1, config.batch_size)
  window = np.stack([text[s:s + config.context + 1] for s in starts]).astype(np.int32)
  return window[:, :-1], window[:, 1:]


def place_batch(dp: dq.nnx.DataParallel, global_batch):
  """This process's rows of the global batch, split over the data axes of the mesh."""
  spec = dp._batch_spec()  # noqa: SLF001 (the data axes, as a PartitionSpec)
  sharding = NamedSharding(dp.mesh, spec)
  return jax.tree.map(lambda x: jax.make_array_from_callback(
      x.shape, sharding, lambda index: x[index]), global_batch)


def train(config: Config, devices, text: np.ndarray, *, on_step=None) -> tuple[list, object]:
  """Trains for ``config.steps`` steps; returns the losses (float32) and the last state.

  ``on_step(step, loss)`` is called after each step (the loss read back waits for it).
  """
  dp = build(config, devices)
  step_fn = dp.train_step(loss_fn)
  state, losses = dp.state, []
  for i in range(config.steps):
    state, loss = step_fn(state, place_batch(dp, batch(config, text, i)))
    value = np.asarray(loss.addressable_data(0), np.float32)
    losses.append(value)
    if on_step is not None:
      on_step(i, value)
  return losses, state
