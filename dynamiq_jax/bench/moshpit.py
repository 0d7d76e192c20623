"""Moshpit averaging with absent peers, on a small regression: what drifts, and the fix.

    python -m dynamiq_jax.bench.moshpit            # 3 seeds, 300 steps, 8 ranks on a 2 x 4 grid
    python -m dynamiq_jax.bench.moshpit --tiny     # smoke test (CI)

Each of ``--workers`` simulated CPU devices trains its own replica
(``data_parallel_step(per_rank=True)``) of a two-layer tanh network on a noisy
regression (fresh batches each step, Adam), the gradient averaged by Moshpit
averaging (DynamiQ 5b inside the groups of the grid). Rows:

* ``everyone present``: no dropout (the replicas stay bit-identical);
* ``10% absent: gradients only``: each rank absent from each round with
  probability 0.1, the gradient averaged as before this benchmark existed
  (``weighted=False``: every present member of a group counts alike; an absent
  rank keeps its own gradient);
* ``10% absent: gradients weighted``: the same with ``weighted=True`` (a group's
  members weighed by the contributions their values hold);
* ``10% absent + replicas (unweighted)``, ``10% absent + replicas``: with
  ``average_replicas`` last in the chain, averaging the updated parameters in the
  same rounds so that an absent rank is averaged back at its next round;
  ``... every 4``: the replicas averaged every fourth step only;
* ``everyone present weighted as 10% absent`` (a control): every rank
  present, but each step's mean weighs the ranks' gradients as the mean of the
  ranks' results does in ``10% absent`` with the same draws (found by running that
  step's Moshpit rounds, float32, on one-hot rows), so every rank steps alike on
  what the absent run's replicas receive between them: what the lost contributions
  alone cost.

``--optimizer sgd`` trains with SGD and momentum 0.9 instead of Adam (the rows'
gap under a linear optimizer).

Per row and seed it records the held-out loss of the first replica and of the
replicas' mean, the replicas' spread (the largest distance of a replica from
their mean, relative to the mean's norm) and Adam's moments' spread (the same
for ``mu`` and ``nu``), at every ``--eval-every`` steps; the measured share of
(rank, round) slots absent; the rounds per step; and the bytes each rank sends
per step. The spread is measured after every step (the averaging of
``every 4`` included, which runs at every fourth). The target: the smoothed
held-out loss ``everyone present`` reaches at ``--target-at`` of its run. Writes
``docs/results/moshpit_absent.json``.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench.train import smooth

__all__ = ["main", "ROWS", "run", "summarize", "markdown", "problem", "teacher_output", "loss",
           "mixing_rows", "contribution_weights"]

# (label, dropout, replicas averaged every this many steps: 0 never, Moshpit's weighted,
#  the dropout whose lost contributions every rank's gradient is weighted by: 0 none)
ROWS = (
    ("everyone present", 0.0, 0, True, 0.0),
    ("10% absent: gradients only", 0.1, 0, False, 0.0),
    ("10% absent: gradients weighted", 0.1, 0, True, 0.0),
    ("10% absent + replicas (unweighted)", 0.1, 1, False, 0.0),
    ("10% absent + replicas", 0.1, 1, True, 0.0),
    ("10% absent + replicas every 4", 0.1, 4, True, 0.0),
    ("everyone present weighted as 10% absent", 0.0, 0, True, 0.1),
)
DEFAULT_ROWS = tuple(r[0] for r in ROWS if r[0] != "10% absent: gradients weighted")
BASELINE = ROWS[0][0]
LEARNING_RATES = {"adam": 3e-3, "sgd": 0.05}
"""Each ``--optimizer``'s default learning rate."""
IN, HIDDEN, OUT = 16, 256, 4


def problem(seed: int):
  """The teacher (a fixed random two-layer network), the held-out set and the init."""
  rng = np.random.default_rng([7, seed])
  teacher = (rng.normal(size=(IN, 64)) / np.sqrt(IN), rng.normal(size=(64, OUT)) / 8)
  init = {"w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
          "b1": np.zeros(HIDDEN, np.float32),
          "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32)}
  x = rng.normal(size=(4096, IN)).astype(np.float32)
  return teacher, init, (x, teacher_output(teacher, x))


def teacher_output(teacher, x):
  """The teacher's noiseless output on ``x`` (float32)."""
  return (np.tanh(x @ teacher[0]) @ teacher[1]).astype(np.float32)


def loss(params, batch):
  """Mean squared error of ``(x, y)``, or of ``(x, y, w)`` with each sample's error
  weighted by ``w``."""
  import jax.numpy as jnp
  x, y = batch[:2]
  err = (jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2
  return jnp.mean(err if len(batch) == 2 else batch[2][:, None] * err)


def _optimizer(name: str, lr: float):
  import optax
  if name == "adam":
    return optax.adam(lr)
  if name == "sgd":
    return optax.sgd(lr, momentum=0.9)
  raise ValueError(f"optimizer {name!r}: 'adam' or 'sgd'")


def mixing_rows(mosh, n: int, key):
  """``X`` float32 ``[n, n]``: row r weighs the ranks' gradients in rank r's result of
  ``mosh``'s rounds with the absences drawn from ``key`` (the step's key). Found by
  reducing one-hot rows in float32 (the rounds themselves)."""
  import jax.numpy as jnp

  import dynamiq_jax as dq
  return dq.simulate(jnp.eye(n, dtype=jnp.float32), codec=dq.codecs.F32(), schedule=mosh,
                     key=key)


def contribution_weights(mosh, n: int, key):
  """``c`` float32 ``[n]``: the weight of rank j's gradient in the mean of the ranks'
  results (the mean of :func:`mixing_rows`' rows); sums to 1."""
  import jax.numpy as jnp
  return jnp.mean(mixing_rows(mosh, n, key), axis=0)


def _spread(leaves) -> float:
  """The largest distance of a row from the rows' mean, relative to the mean's norm."""
  flat = np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1) for a in leaves],
                        axis=1)
  mean = flat.mean(0)
  return float(np.max(np.linalg.norm(flat - mean, axis=1)) / max(np.linalg.norm(mean), 1e-30))


def run(cfg: dict, mesh, seed: int, dropout: float, every: int, weighted: bool = True,
        contributions_of: float = 0.0, *, progress=None) -> dict:
  """One training run; returns its evaluations and measurements. ``contributions_of``:
  a dropout whose runs' lost contributions each step's gradient mean reproduces (every
  rank's samples weighted by ``n c`` of :func:`contribution_weights`; 0: none)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from dynamiq_jax.engine.moshpit import average_replicas, presence, replica_bytes_per_rank

  n = mesh.shape["data"]
  mosh = dq.Moshpit(grid=tuple(cfg["grid"]), dropout=dropout, weighted=weighted)
  parts = [dq.compressed_psum("data", codec=dq.codecs.DynamiQ(bits=5.0), schedule=mosh,
                              seed=seed), _optimizer(cfg["optimizer"], cfg["lr"])]
  if every:
    parts.append(average_replicas("data", schedule=mosh, seed=seed, every=every))
  tx = optax.chain(*parts)
  teacher, init, (xe, ye) = problem(seed)
  params, opt = dq.per_rank_copies((init, tx.init(init)), mesh=mesh)
  step = dq.data_parallel_step(loss, tx, mesh=mesh, per_rank=True, donate=False)
  eval_fn = jax.jit(jax.vmap(loss, in_axes=(0, None)))
  data = NamedSharding(mesh, P("data"))
  plan = mosh.plan(n)
  lost = dq.Moshpit(grid=tuple(cfg["grid"]), dropout=contributions_of, weighted=weighted)
  weights = jax.jit(lambda k: n * contribution_weights(lost, n, k))
  grad_bytes = float(dq.wire_stats(jax.ShapeDtypeStruct((sum(a.size for a in init.values()),),
                                                        jnp.float32),
                                   codec=dq.codecs.DynamiQ(bits=5.0), n=n,
                                   schedule=mosh).bytes_per_rank)
  param_bytes = replica_bytes_per_rank(init, plan) / every if every else 0.0
  absent_slots = []

  def measure(s):
    host = jax.device_get(params)
    losses = np.asarray(eval_fn(host, (xe, ye)))
    mean = jax.tree.map(lambda a: a.mean(0), host)
    moments = jax.device_get(opt[1][0])  # ScaleByAdamState, or SGD's TraceState
    adam = cfg["optimizer"] == "adam"
    return {"step": s, "eval_loss": float(losses[0]), "eval_loss_max": float(losses.max()),
            "eval_loss_of_mean": float(eval_fn(jax.tree.map(lambda a: a[None], mean),
                                               (xe, ye))[0]),
            "replica_spread": _spread(jax.tree.leaves(host)),
            "mu_spread": _spread(jax.tree.leaves(moments.mu if adam else moments.trace)),
            "nu_spread": _spread(jax.tree.leaves(moments.nu)) if adam else None}

  evals = [measure(0)]
  train, spreads = [], []
  key = jax.random.key(seed)
  for s in range(cfg["steps"]):
    rng = np.random.default_rng([seed, s])
    x = rng.normal(size=(n * cfg["batch"], IN)).astype(np.float32)
    y = teacher_output(teacher, x) + cfg["noise"] * rng.normal(size=(x.shape[0], OUT)).astype(
        np.float32)
    batch = (x, y)
    if contributions_of:  # rank r's samples weighted by n c_r: the mean is sum_r c_r g_r
      w = np.asarray(weights(jax.random.fold_in(key, s)))
      batch = (x, y, np.repeat(w, cfg["batch"]).astype(np.float32))
    params, opt, value = step(params, opt, jax.device_put(batch, data))
    train.append(float(value))
    spreads.append(_spread(jax.tree.leaves(jax.device_get(params))))  # after every step
    if dropout:  # the mask the reductions drew this step (from the reducer's seed and step)
      here = jax.vmap(lambda r: presence(plan, mosh, jax.random.fold_in(key, s), None, r))(
          jnp.arange(n))
      absent_slots.append(float(1.0 - np.asarray(here).mean()))
    if (s + 1) % cfg["eval_every"] == 0 or s + 1 == cfg["steps"]:
      evals.append(measure(s + 1))
    if progress:
      progress()
  return {"train_loss": train, "evals": evals, "replica_spread": spreads,
          "rounds_per_step": plan.rounds,
          "absent_share": float(np.mean(absent_slots)) if absent_slots else 0.0,
          "bytes_per_rank_step": {"gradient": grad_bytes, "replicas": param_bytes}}


def summarize(runs: dict, cfg: dict) -> list[dict]:
  """Per row: final loss (mean over seeds) against everyone present, steps to the target,
  the spread at the end and its largest value in the run's second half."""
  window = cfg["smooth"]
  targets = {}
  for seed, r in runs[BASELINE].items():
    curve = smooth([e["eval_loss"] for e in r["evals"]], window)
    targets[seed] = float(curve[int(round(cfg["target_at"] * (len(curve) - 1)))])
  base = np.mean([r["evals"][-1]["eval_loss"] for r in runs[BASELINE].values()])
  rows = []
  for label, seeds in runs.items():
    final = [r["evals"][-1]["eval_loss"] for r in seeds.values()]
    reached = []
    for seed, r in seeds.items():
      steps = [e["step"] for e in r["evals"]]
      curve = smooth([e["eval_loss"] for e in r["evals"]], window)
      hit = np.nonzero(curve <= targets[seed])[0]
      reached.append(steps[hit[0]] if hit.size else None)
    half = [r["replica_spread"][cfg["steps"] // 2:] for r in seeds.values()]
    first = next(iter(seeds.values()))
    rows.append({
        "row": label, "final_eval_loss": float(np.mean(final)),
        "vs_everyone_present": float(np.mean(final) / base - 1),
        "final_eval_loss_of_mean": float(np.mean([r["evals"][-1]["eval_loss_of_mean"]
                                                  for r in seeds.values()])),
        "steps_to_target": reached, "reached": sum(s is not None for s in reached),
        "spread_mid": float(np.mean([r["replica_spread"][cfg["steps"] // 2 - 1]
                                     for r in seeds.values()])),
        "spread_end": float(np.mean([r["replica_spread"][-1] for r in seeds.values()])),
        "spread_max_1st_half": float(np.mean([max(r["replica_spread"][:cfg["steps"] // 2])
                                              for r in seeds.values()])),
        "spread_max_2nd_half": float(np.mean([max(h) for h in half])),
        "mu_spread_end": float(np.mean([r["evals"][-1]["mu_spread"] for r in seeds.values()])),
        "nu_spread_end": (None if first["evals"][-1]["nu_spread"] is None else float(
            np.mean([r["evals"][-1]["nu_spread"] for r in seeds.values()]))),
        "absent_share": float(np.mean([r["absent_share"] for r in seeds.values()])),
        "rounds_per_step": first["rounds_per_step"],
        "bytes_per_rank_step": first["bytes_per_rank_step"]})
  return rows


def _percent(v) -> str:
  return "-" if v is None else f"{100 * v:.2f}%"


def markdown(rows: list[dict], n_seeds: int) -> str:
  out = ["| row | final eval loss | vs everyone present | reached target | spread at half "
         "/ end | largest spread, 1st / 2nd half | momentum / Adam nu spread, end | absent slots "
         "| bytes / rank / step (grad + replicas) |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    steps = [s for s in r["steps_to_target"] if s is not None]
    b = r["bytes_per_rank_step"]
    out.append(
        f"| {r['row']} | {r['final_eval_loss']:.4f} | {100 * r['vs_everyone_present']:+.2f}% "
        f"| {r['reached']}/{n_seeds}"
        f"{f' (step {int(np.median(steps))})' if steps else ''} "
        f"| {100 * r['spread_mid']:.3f}% / {100 * r['spread_end']:.3f}% "
        f"| {100 * r['spread_max_1st_half']:.3f}% / {100 * r['spread_max_2nd_half']:.3f}% "
        f"| {100 * r['mu_spread_end']:.2f}% / {_percent(r['nu_spread_end'])} "
        f"| {100 * r['absent_share']:.1f}% "
        f"| {b['gradient'] / 1e3:.1f} kB + {b['replicas'] / 1e3:.1f} kB |")
  return "\n".join(out)


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.moshpit",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--workers", type=int, default=8, help="simulated ranks (a 2 x n/2 grid)")
  p.add_argument("--grid", default="2,2" if tiny else "2,4", help="the Moshpit grid's sides")
  p.add_argument("--steps", type=int, default=12 if tiny else 200, help="training steps")
  p.add_argument("--batch", type=int, default=8 if tiny else 32, help="per rank")
  p.add_argument("--optimizer", choices=sorted(LEARNING_RATES), default="adam",
                 help="after the gradient reduction: Adam, or SGD with momentum 0.9")
  p.add_argument("--lr", type=float, default=None,
                 help=f"learning rate (unset: {LEARNING_RATES})")
  p.add_argument("--noise", type=float, default=0.3, help="label noise's std")
  p.add_argument("--eval-every", type=int, default=4 if tiny else 10,
                 help="steps between evaluations")
  p.add_argument("--smooth", type=int, default=3, help="evaluations in the moving average")
  p.add_argument("--target-at", type=float, default=0.9,
                 help="the target: everyone present's smoothed loss at this share of its run")
  p.add_argument("--seeds", default="0" if tiny else "0,1,2", help="comma-separated seeds")
  p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated rows to run")
  common.add_data_flags(p, real="(unused)")
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser(tiny="--tiny" in argv).parse_args(argv)
  if args.tiny and "--workers" not in argv:
    args.workers = 4
  labels = [s.strip() for s in args.rows.split(",") if s.strip()]
  known = [r[0] for r in ROWS]
  if any(lab not in known for lab in labels) or BASELINE not in labels:
    raise SystemExit(f"--rows: a comma-separated subset of {known} including {BASELINE!r}; "
                     f"got {args.rows!r}")
  grid = tuple(int(g) for g in args.grid.split(","))
  if int(np.prod(grid)) != args.workers:
    raise SystemExit(f"--grid {args.grid} holds {int(np.prod(grid))} ranks but --workers is "
                     f"{args.workers}; the sides' product must be the worker count")
  from dynamiq_jax.examples import devices as ex_devices

  devices = ex_devices.select_devices(args.workers)  # before anything else starts JAX
  import jax

  mesh = jax.make_mesh((args.workers,), ("data",), devices=devices)
  lr = LEARNING_RATES[args.optimizer] if args.lr is None else args.lr
  cfg = {"workers": args.workers, "grid": list(grid), "steps": args.steps, "batch": args.batch,
         "optimizer": args.optimizer, "lr": lr, "noise": args.noise, "eval_every": args.eval_every,
         "smooth": args.smooth, "target_at": args.target_at,
         "model": f"{IN}-{HIDDEN}-{OUT} tanh MLP, teacher {IN}-64-{OUT}"}
  seeds = [int(s) for s in args.seeds.split(",")]
  runs = {}
  args.label = None
  report = {"training": cfg, "codec": "DynamiQ 5b inside the groups", "seeds": seeds,
            "runs": runs, "command": common.command_line(), "machine": common.machine()}
  with common.load_watch("training"):
    for label, dropout, every, weighted, contributions_of in ROWS:
      if label not in labels:
        continue
      for seed in seeds:
        runs.setdefault(label, {})[str(seed)] = run(cfg, mesh, seed, dropout, every, weighted,
                                                    contributions_of)
        last = runs[label][str(seed)]["evals"][-1]
        print(f"{label}, seed {seed}: eval loss {last['eval_loss']:.4f}, spread "
              f"{last['replica_spread']:.2e}", flush=True)
        if not args.tiny:  # what is done so far, in case the run is stopped
          common.write_json(f"{common.results_dir(args.out)}/moshpit_absent_partial.json",
                            report)
  rows = report["summary"] = summarize(runs, cfg)
  common.write_results("moshpit_absent", args, report)
  print(markdown(rows, len(seeds)))
  print(f"machine: {report['machine']['platform']}, {report['machine']['cpu_count']} CPUs")
  return report


if __name__ == "__main__":
  main()
