"""The main job: data-parallel training with compressed all-reduce vs BF16 psum.

Trains a small Flax NNX MLP on scikit-learn's digits data on 8 simulated CPU
devices, twice from the same initialisation and data order: once with
``jax.lax.psum`` of bf16 gradients (the paper's baseline) and once with
DynamiQ's 5-bit compressed ring all-reduce, then prints final train loss,
test accuracy, bits per coordinate on the wire and all-reduce bytes per
step. Needs the ``examples`` extra (flax, scikit-learn, tqdm)::

    pip install -e ".[examples]" && python -m dynamiq_jax.demo

Wall-clock times on simulated CPU devices say nothing about networks, so the
demo reports bytes, not speed (see ``python -m dynamiq_jax.bench.net``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SYNC_EVERY = 1
"""Default ``--sync-every``: wait for every step (see docs/guide.md, Troubleshooting)."""


def build_parser() -> argparse.ArgumentParser:
  """The demo's command-line flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.demo", description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (data-parallel ranks)")
  p.add_argument("--steps", type=int, default=300, help="training steps of each run")
  p.add_argument("--batch", type=int, default=256, help="global batch size")
  p.add_argument("--hidden", type=int, default=256, help="width of the MLP's two hidden layers")
  p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
  p.add_argument("--bits", type=float, default=5.0, help="DynamiQ budget, bits/coordinate")
  p.add_argument("--seed", type=int, default=0,
                 help="seeds the initialisation, the data split and order, and the rounding")
  p.add_argument("--sync-every", type=int, default=SYNC_EVERY,
                 help="wait for the step's results every this many steps (0: never); "
                 "XLA's CPU collectives can deadlock when many steps are queued")
  return p


def _parse(argv):
  return build_parser().parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax

  jax.config.update("jax_num_cpu_devices", args.devices)

  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  from tqdm.auto import tqdm

  import dynamiq_jax as dq
  from dynamiq_jax.schedules import ring_bytes_per_rank

  n = args.devices
  if jax.device_count() < n:
    sys.exit(f"JAX initialised with {jax.device_count()} devices before the demo could ask "
             f"for {n}; run it as its own process: python -m dynamiq_jax.demo")
  if args.batch % n:
    sys.exit(f"--batch={args.batch} must be a multiple of --devices={n}")
  mesh = jax.make_mesh((n,), ("data",))

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=args.seed,
                                            stratify=y)

  class MLP(nnx.Module):

    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, args.hidden, rngs=rngs)
      self.l2 = nnx.Linear(args.hidden, args.hidden, rngs=rngs)
      self.l3 = nnx.Linear(args.hidden, 10, rngs=rngs)

    def __call__(self, v):
      return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(v)))))

  graphdef, init_params = nnx.split(MLP(nnx.Rngs(args.seed)), nnx.Param)

  def logits_fn(params, v):
    return nnx.merge(graphdef, params)(v)

  def loss_fn(params, batch):
    v, t = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, v), t).mean()

  eval_logits = jax.jit(logits_fn)
  order = np.random.default_rng(args.seed).integers(0, len(x_tr), (args.steps, args.batch))
  repl = NamedSharding(mesh, P())
  shard = NamedSharding(mesh, P("data"))
  grads_like = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), init_params)

  runs = {
      "psum BF16": (dq.baseline_psum("data", dtype=jnp.bfloat16), None),
      f"DynamiQ {args.bits:g}-bit ring": (
          dq.compressed_psum("data", codec=dq.codecs.DynamiQ(bits=args.bits), seed=args.seed),
          dq.codecs.DynamiQ(bits=args.bits)),
  }
  rows = []
  for name, (reduce, codec) in runs.items():
    tx = optax.chain(reduce, optax.adam(args.lr))
    step = dq.data_parallel_step(loss_fn, tx, mesh=mesh, sync_every=args.sync_every)
    params = jax.device_put(jax.tree.map(jnp.array, init_params), repl)
    state = jax.device_put(tx.init(params), repl)
    estimates = []  # the codec's own estimate of the error each all-reduce added
    t0 = time.perf_counter()
    for i in tqdm(range(args.steps), desc=name, leave=False):
      batch = jax.device_put((x_tr[order[i]], y_tr[order[i]]), shard)
      params, state, loss = step(params, state, batch)
      if codec is not None:
        estimates.append(state[0].error_estimate)
    seconds = time.perf_counter() - t0
    estimate = float(np.mean(jax.device_get(estimates))) if estimates else float("nan")
    train_loss = float(optax.softmax_cross_entropy_with_integer_labels(
        eval_logits(params, x_tr), y_tr).mean())
    acc = float(np.mean(np.argmax(np.asarray(eval_logits(params, x_te)), -1) == y_te))
    if codec is None:
      d = sum(a.size for a in jax.tree.leaves(grads_like))
      bits, sent = 16.0, ring_bytes_per_rank(2.0 * d, n)
    else:
      report = dq.wire_stats(grads_like, codec=codec, n=n)
      bits, sent = report.bits_per_coord, report.bytes_per_rank
    rows.append((name, train_loss, acc, bits, sent, seconds, estimate))

  d = sum(a.size for a in jax.tree.leaves(grads_like))
  base = rows[0]
  print(f"\nDigits MLP ({d:,} parameters), {n} simulated CPU devices, {args.steps} steps, "
        f"global batch {args.batch}, Adam lr {args.lr:g}, seed {args.seed}")
  print(f"{'all-reduce':<22} {'train loss':>10} {'test acc':>9} {'vs BF16':>8} "
        f"{'bits/coord':>10} {'bytes/step/rank':>16} {'vs BF16':>8} {'est. error':>10}")
  for name, loss, acc, bits, sent, _, est in rows:
    est_text = "-" if np.isnan(est) else f"{est:.2e}"
    print(f"{name:<22} {loss:>10.4f} {acc:>9.2%} {acc / base[2]:>8.2%} {bits:>10.3f} "
          f"{sent:>16,.0f} {sent / base[4]:>8.1%} {est_text:>10}")
  print("bytes/step/rank: what each rank sends per all-reduce (ring: 2(n-1)/n of the "
        "payload); bits/coord counts all metadata and padding.\n"
        "est. error: the codec's own estimate of the relative error its all-reduce added, "
        "||result - mean||^2 / ||result||^2,\naveraged over the steps "
        "(AllReduceStats.error_estimate).")
  print("(wall time on simulated devices, not a network measurement: "
        + ", ".join(f"{r[0]} {r[5]:.1f}s" for r in rows) + ")")
  return rows


if __name__ == "__main__":
  main()
