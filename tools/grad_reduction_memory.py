"""How much of the local gradient XLA:CPU keeps live, by where the reduce-scatter is.

    JAX_PLATFORMS=cpu python tools/grad_reduction_memory.py

An 8-layer tanh MLP (1024 x 1024 float32 weights, sharded over 8 CPU devices
along their first dimension, gathered for the forward pass), one step, compiled
five ways inside ``jax.shard_map``; for each, from XLA's buffer assignment
(:mod:`dynamiq_jax.bench.buffers`), the most gradient bytes live at once
(backward values + reduction buffers) as a fraction of the whole local gradient:

* ``fsdp``: the gradient taken w.r.t. the shards, so that the gather's transpose
  (``psum_scatter``) runs inside the backward pass;
* ``psum_scatter after grad``: the gradient w.r.t. the gathered weights, then one
  ``psum_scatter`` per leaf;
* ``ppermute ring``: one plain ring reduce-scatter of ``ppermute`` hops per
  leaf, unrolled (no codec, guard or chain between leaves): what the library's
  buckets do, without the library;
* ``dq.reduce_scatter``: the same with the library's compressed reduce-scatter
  (DynamiQ, one leaf per bucket, and one bucket for all).

1/8 + one layer's gradient is 0.156. XLA:CPU's scheduler is its default
(``--xla_cpu_enable_concurrency_optimized_scheduler=true``) unless ``XLA_FLAGS``
says otherwise; with ``=false`` it picks its memory-minimizing schedule.
``python -m dynamiq_jax.bench.sharded --parts gradient`` measures the library's
whole training step under both.
"""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dynamiq_jax as dq  # noqa: E402
from dynamiq_jax.bench import buffers  # noqa: E402
from dynamiq_jax.bench.sharded import mlp_loss  # noqa: E402
from dynamiq_jax.codecs import DynamiQ  # noqa: E402

LAYERS, DIM, BATCH = 8, 1024, 256


def _category(op_name, is_argument):
  if is_argument:
    return "arguments"
  if "transpose(" in op_name:
    return "backward"
  if "reduce_scatter" in op_name:
    return "reduction"
  return "jvp" if "jvp(" in op_name else "other"


def _gathered(ws):
  return [jax.lax.all_gather(w, "data", axis=0, tiled=True) for w in ws]


def _update(ws, g):
  return [w - 1e-3 * gi for w, gi in zip(ws, g)]


def fsdp(ws, x):
  return _update(ws, jax.grad(lambda ws: mlp_loss(_gathered(ws), x))(ws))


def ppermute_ring(g):
  """Each leaf's rows reduce-scattered by a ring of n - 1 ``ppermute`` hops."""
  n = jax.lax.axis_size("data")
  r = jax.lax.axis_index("data")
  perm = [(i, (i + 1) % n) for i in range(n)]
  out = []
  for a in g:
    rows = a.reshape(n, -1)
    recv = None
    for j in range(n - 1):  # hop j sends chunk r - j - 1 (plus what arrived)
      mine = jax.lax.dynamic_index_in_dim(rows, (r - j - 1) % n, 0, keepdims=False)
      recv = jax.lax.ppermute(mine if recv is None else mine + recv, "data", perm)
    own = recv + jax.lax.dynamic_index_in_dim(rows, r, 0, keepdims=False)
    out.append((own / n).reshape(-1, a.shape[1]))
  return out


def after_grad(reduce):
  def step(ws, x):
    g = jax.grad(lambda full: mlp_loss(full, x))(_gathered(ws))
    with jax.named_scope("reduce_scatter"):
      return _update(ws, reduce(g))
  return step


def main():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  shard = NamedSharding(mesh, P("data"))
  ws = [jax.device_put(jnp.full((DIM, DIM), 0.01, jnp.float32), shard) for _ in range(LAYERS)]
  x = jax.device_put(jnp.ones((BATCH * 8, DIM), jnp.float32), shard)
  whole = LAYERS * DIM * DIM * 4
  plain = lambda g: [jax.lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True) for a in g]

  def compressed(bucket_size):
    return lambda g: dq.reduce_scatter(g, axis_name="data", codec=DynamiQ(bits=5),
                                       key=jax.random.key(0), bucket_size=bucket_size)[0]

  steps = [("fsdp", fsdp), ("psum_scatter after grad", after_grad(plain)),
           ("ppermute ring after grad", after_grad(ppermute_ring)),
           ("dq.reduce_scatter, 2^20 buckets (one leaf each)", after_grad(compressed(1 << 20))),
           ("dq.reduce_scatter, one 2^25 bucket", after_grad(compressed(1 << 25)))]
  print(f"jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; whole local "
        f"gradient {whole / 1e6:.1f} MB per device")
  for name, step in steps:
    jitted = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data")),
                                   out_specs=P("data")))
    peak, _ = buffers.breakdown(jitted.trace(ws, x).lower(), _category,
                                {"gradient": ("backward", "reduction")})
    print(f"{name:<50} gradient most live {peak['own_max']['gradient'] / whole:.3f}x")


if __name__ == "__main__":
  main()
