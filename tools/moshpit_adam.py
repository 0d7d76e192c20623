"""Which of Adam's moments Moshpit's absent peers move: bench.moshpit's regression in plain JAX.

    python tools/moshpit_adam.py                       # 3 seeds, the variants below
    python tools/moshpit_adam.py --json docs/results/moshpit_adam.json

With absent peers each rank ends a step's Moshpit rounds holding its own partial
mean of the gradients (:func:`dynamiq_jax.moshpit.presence` draws who is absent,
as the reducer does at that step), steps its own Adam on it, and the replicas are
then averaged in the same rounds (``dq.average_replicas``). This script trains
``bench.moshpit``'s regression (same teacher, data, initialisation, learning
rate and steps) with exact float32 gradients, no codec, so that each rank's
gradient is ``X g`` for the rounds' mixing matrix ``X`` (found by
``dq.simulate`` of one-hot rows, float32: the library's weighted rounds) and its
parameters after averaging ``Y p`` (``Y`` from
:func:`dynamiq_jax.moshpit.replica_rounds` of one-hot rows under ``vmap``). The
variants:

* ``everyone present``: no rank absent (``X = Y = 1/n``);
* ``10% absent``: each rank's Adam on its own ``X g`` (what ``bench.moshpit``'s
  ``10% absent + replicas`` runs, less the codec);
* ``10% absent, nu of the mean``: each rank's first moment from its own ``X g``,
  its second moment from the mean over ranks ``c g`` (``c`` = the mean of ``X``'s
  rows; an oracle, since no rank holds ``c g``);
* ``10% absent, mu of the mean``: the converse;
* ``10% absent, moments averaged``: each rank's own ``X g``, and Adam's moments
  averaged with the parameters (``Y mu``, ``Y nu``);
* ``everyone present, lr x f``: the learning rate scaled, to read a gap as a
  learning rate.

Prints the final held-out loss of replica 0 per seed and its mean against
everyone present's, and the share of the contributions a rank's own result holds
and the mean over ranks holds (the effective sample size ``1 / (n sum_j w_j^2)``
of the weights ``w`` = a row of ``X``, or ``c``), averaged over the absent run's
steps; with ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("everyone present", "10% absent", "10% absent, nu of the mean",
            "10% absent, mu of the mean", "10% absent, moments averaged")


def mixing(mosh, n: int, key):
  """``(X, Y)`` float32 ``[n, n]``: row r of ``X`` weighs the ranks' gradients in rank
  r's result of the gradient rounds (``bench.moshpit.mixing_rows``), of ``Y`` the
  replicas in rank r's parameters after ``replica_rounds``; both with the absences drawn
  from ``key``."""
  import jax
  import jax.numpy as jnp

  from dynamiq_jax.bench import moshpit as B
  from dynamiq_jax.engine.moshpit import presence, replica_rounds

  eye = jnp.eye(n, dtype=jnp.float32)
  x = B.mixing_rows(mosh, n, key)
  plan = mosh.plan(n)

  def rep(row):
    here = presence(plan, mosh, key, None, jax.lax.axis_index("data"))
    return row + replica_rounds(row, plan, "data", here)

  return x, jax.vmap(rep, axis_name="data")(eye)


def train(seed: int, variant: str, *, n: int, grid, dropout: float, steps: int, batch: int,
          lr: float, noise: float) -> tuple[float, float, float]:
  """Replica 0's final held-out loss, and the mean over steps of the contributions a rank's
  own result holds (the mean over ranks) and the mean over ranks holds."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import dynamiq_jax as dq
  from dynamiq_jax.bench import moshpit as B

  b1, b2, eps = 0.9, 0.999, 1e-8  # optax.adam's
  absent = dropout if variant.startswith("10%") else 0.0
  mosh = dq.Moshpit(grid=tuple(grid), dropout=absent)
  mix = jax.jit(lambda k: mixing(mosh, n, k))
  grad = jax.jit(jax.vmap(jax.grad(B.loss)))
  teacher, init, (xe, ye) = B.problem(seed)
  p = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), init)
  mu = jax.tree.map(jnp.zeros_like, p)
  nu = jax.tree.map(jnp.zeros_like, p)
  key = jax.random.key(seed)
  mean_for = {"10% absent, nu of the mean": "nu", "10% absent, mu of the mean": "mu"}.get(variant)

  @jax.jit
  def step(p, mu, nu, x, y, t, xm, ym):
    g = grad(p, (x, y))
    own = jax.tree.map(lambda a: jnp.tensordot(xm, a, 1), g)  # each rank's partial mean
    c = jnp.mean(xm, axis=0)
    mean = jax.tree.map(lambda a: jnp.broadcast_to(jnp.tensordot(c, a, 1), a.shape), g)
    gm, gn = (mean if mean_for == "mu" else own), (mean if mean_for == "nu" else own)
    mu = jax.tree.map(lambda m, a: b1 * m + (1 - b1) * a, mu, gm)
    nu = jax.tree.map(lambda v, a: b2 * v + (1 - b2) * a * a, nu, gn)
    upd = jax.tree.map(lambda m, v: -lr * (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + eps),
                       mu, nu)
    p = jax.tree.map(lambda a, u: jnp.tensordot(ym, a + u, 1), p, upd)
    if variant == "10% absent, moments averaged":
      mu, nu = (jax.tree.map(lambda a: jnp.tensordot(ym, a, 1), m) for m in (mu, nu))
    return p, mu, nu

  own_share, mean_share = [], []
  for s in range(steps):
    rng = np.random.default_rng([seed, s])  # bench.moshpit's batches
    x = rng.normal(size=(n * batch, B.IN)).astype(np.float32)
    y = B.teacher_output(teacher, x) + noise * rng.normal(
        size=(x.shape[0], B.OUT)).astype(np.float32)
    xm, ym = mix(jax.random.fold_in(key, s))
    w = np.asarray(xm, np.float64)
    own_share.append(np.mean(1 / (n * np.sum(w * w, axis=1))))
    mean_share.append(1 / (n * np.sum(w.mean(0) ** 2)))
    p, mu, nu = step(p, mu, nu, x.reshape(n, batch, -1), y.reshape(n, batch, -1),
                     jnp.float32(s + 1), xm, ym)
  final = float(B.loss(jax.tree.map(lambda a: a[0], p), (xe, ye)))
  return final, float(np.mean(own_share)), float(np.mean(mean_share))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", default="0,1,2")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--lr-factors", default="0.9,1.1",
                 help="everyone present at these multiples of the learning rate too")
  p.add_argument("--json", default=None, help="write the results here")
  args = p.parse_args(argv)
  from dynamiq_jax.examples import devices as ex_devices
  ex_devices.select_devices(1)
  import numpy as np

  from dynamiq_jax.bench import common
  from dynamiq_jax.bench import moshpit as B
  cfg = dict(n=8, grid=(2, 4), dropout=0.1, steps=args.steps, batch=32,
             lr=B.LEARNING_RATES["adam"], noise=0.3)  # bench.moshpit's defaults
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {}
  jobs = [(v, 1.0) for v in VARIANTS] + [("everyone present", float(f))
                                         for f in args.lr_factors.split(",") if f]
  for variant, f in jobs:
    label = variant if f == 1.0 else f"{variant}, lr x {f:g}"
    runs[label] = [train(s, variant, **dict(cfg, lr=cfg["lr"] * f)) for s in seeds]
  base = float(np.mean([r[0] for r in runs["everyone present"]]))
  rows = []
  for k, v in runs.items():
    final = [r[0] for r in v]
    rows.append({"variant": k, "final_eval_loss": final, "mean": float(np.mean(final)),
                 "vs_everyone_present": float(np.mean(final)) / base - 1,
                 "own_result_share": float(np.mean([r[1] for r in v])),
                 "mean_over_ranks_share": float(np.mean([r[2] for r in v]))})
  print("| variant | final held-out loss per seed | mean | vs everyone present | "
        "contributions held: a rank's result / the mean over ranks |")
  print("|---|---|---:|---:|---:|")
  for r in rows:
    print(f"| {r['variant']} | {', '.join(f'{v:.5f}' for v in r['final_eval_loss'])} | "
          f"{r['mean']:.5f} | {100 * r['vs_everyone_present']:+.2f}% | "
          f"{r['own_result_share']:.1%} / {r['mean_over_ranks_share']:.1%} |")
  if args.json:
    report = {"command": "python tools/moshpit_adam.py " + " ".join(argv or sys.argv[1:]),
              "config": cfg, "seeds": seeds, "rows": rows, "machine": common.machine()}
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
