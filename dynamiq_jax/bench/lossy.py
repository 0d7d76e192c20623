"""Training over lossy links: the time-to-accuracy benchmark's training at 0-10% packet loss.

    python -m dynamiq_jax.bench.lossy            # 4 ranks, 200 steps, every setting
    python -m dynamiq_jax.bench.lossy --tiny     # smoke test (CI)

The word-level LM, data, AdamW schedule and evaluations of
:mod:`dynamiq_jax.bench.tta` (its ``simulate`` phase: ``--workers`` simulated
CPU devices in this process), trained by ``dq.data_parallel_step(per_rank=True,
packet_loss=...)``: DynamiQ 5b reduce-scatters the gradient on the two-step schedule,
whose reduce step loses packets (:class:`dynamiq_jax.PacketLoss`), each rank's
AdamW steps its shard, and the owners' shards reach the other replicas over the
same lossy links (stale values kept). Every loss setting runs twice: with the
library's unbiased estimate of what arrived, and with the zero fill (lost
packets counted as zeros, the common shortcut; a subclass of ``PacketLoss``
defined here, for comparison only). Loss is simulated on the library's hops:
XLA's collectives deliver everything, and the receiver discards what the seeded
loss process drops.

Reports per run: the final eval loss (mean of the last ``--smooth``
evaluations, replica 0), the perplexity change against the lossless run of the
same seed, the steps to reach the lossless run's smoothed eval loss at 80% of
its run (the time-to-accuracy benchmark's target), and the largest replica
drift of the run (the step's ``step.stats["drift"]``: L2
distance of a replica from the owners' parameters, relative to their norm at
the end). Writes ``docs/results/lossy.json``.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench import tta

__all__ = ["main", "SETTINGS", "ESTIMATORS", "ZeroFill", "run"]

# (label, p, mean burst length in packets or None)
SETTINGS = (("no loss", 0.0, None), ("1%", 0.01, None), ("5%", 0.05, None),
            ("10%", 0.1, None), ("10% in bursts of 4", 0.1, 4.0))
ESTIMATORS = ("unbiased", "zero-fill")


@functools.cache
def _zero_fill_class():
  import dynamiq_jax as dq

  class ZeroFill(dq.PacketLoss):
    """Lost packets count as zeros: biased by about -p (the benchmark's baseline)."""

    def combine(self, own, others, arrived, n, total):
      import jax.numpy as jnp
      return jnp.where(arrived == n - 1, total, own + others)

  return ZeroFill


def ZeroFill(*args, **kwargs):  # noqa: N802 (a class, made once jax may load)
  """``ZeroFill(p, ...)``: a :class:`dynamiq_jax.PacketLoss` whose estimate counts lost
  packets as zeros (the benchmark's baseline only)."""
  return _zero_fill_class()(*args, **kwargs)


def run(cfg: dict, mesh, seed: int, p: float, burst, estimator: str, progress=None) -> dict:
  """One training run -> ``{"evals": [{"step", "eval_loss"}], "drift": [...], "train_loss"}``."""
  import jax
  import optax

  import dynamiq_jax as dq

  data = tta.Trainer(cfg, mesh, "DynamiQ 5b")  # model, data and evaluation of bench.tta
  loss = (dq.PacketLoss if estimator == "unbiased" else ZeroFill)(p, burst=burst)
  tx = optax.chain(
      dq.compressed_psum_scatter("data", codec=dq.codecs.DynamiQ(bits=5), schedule="two_step",
                                 packet_loss=loss),
      optax.adamw(optax.warmup_cosine_decay_schedule(
          0.0, cfg["lr"], cfg["warmup"], max(cfg["steps"], cfg["warmup"] + 1),
          end_value=cfg["lr"] / 10), weight_decay=0.01))
  step = dq.data_parallel_step(data.loss, tx, mesh=mesh, per_rank=True, packet_loss=loss,
                               donate=False)
  from flax import nnx

  from dynamiq_jax.bench import lm
  _, state = nnx.split(lm.CharTransformer(data.lcfg, seed=seed), nnx.Param)
  params, opt = dq.lossy_init(tx, jax.tree.map(np.asarray, nnx.to_pure_dict(state)), mesh=mesh)
  data.per_rank = True  # evaluate replica 0

  def norm(tree):
    return math.sqrt(sum(float(np.sum(np.asarray(a.addressable_data(0), np.float64) ** 2))
                         for a in jax.tree.leaves(tree)))

  out = {"train_loss": [], "drift": [], "evals": [{"step": 0,
                                                    "eval_loss": data.evaluate(params)[0]}]}
  for s in range(cfg["steps"]):
    params, opt, train_loss = step(params, opt, data.batch(seed, s))
    out["train_loss"].append(float(np.asarray(train_loss.addressable_data(0))))
    out["drift"].append(float(np.asarray(step.stats["drift"].addressable_data(0))))
    if (s + 1) % cfg["eval_every"] == 0 or s + 1 == cfg["steps"]:
      out["evals"].append({"step": s + 1, "eval_loss": data.evaluate(params)[0]})
    if progress:
      progress()
  out["param_norm"] = norm(params)
  return out


def summarize(runs: dict, smooth: int, target_at: float = 0.8) -> list[dict]:
  """Rows: setting x estimator -> final eval loss, perplexity change vs no loss, steps to
  the target (the lossless run's smoothed eval loss at ``target_at`` of its run, as
  :mod:`dynamiq_jax.bench.tta` defines it), drift."""
  rows = []
  for label, p, burst in SETTINGS:
    for est in ESTIMATORS:
      key = f"{label} / {est}"
      if key not in runs:
        continue
      finals, changes, drifts, steps = [], [], [], []
      for seed, r in runs[key].items():
        final = float(np.mean([e["eval_loss"] for e in r["evals"][-smooth:]]))
        base = runs.get("no loss / unbiased", {}).get(seed)
        base_final = (float(np.mean([e["eval_loss"] for e in base["evals"][-smooth:]]))
                      if base else float("nan"))
        finals.append(final)
        changes.append(math.exp(final - base_final) - 1.0)
        drifts.append(max(r["drift"]) / r["param_norm"])
        if base:
          steps.append(tta.steps_to_target(r, tta.target_of(base, target_at, smooth), smooth))
      rows.append({"setting": label, "p": p, "burst": burst, "estimator": est,
                   "eval_loss": float(np.mean(finals)),
                   "perplexity": float(math.exp(np.mean(finals))),
                   "perplexity_change": float(np.mean(changes)),
                   "max_relative_drift": float(np.max(drifts)), "seeds": len(finals),
                   "steps_to_target": steps})
  return rows


def markdown(rows: list[dict]) -> str:
  lines = ["| loss | estimator | final eval loss | perplexity | vs no loss | steps to target "
           "| largest drift |", "|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    reached = [s for s in r["steps_to_target"] if s is not None]
    steps = (f"{np.mean(reached):.0f} ({len(reached)}/{len(r['steps_to_target'])})"
             if reached else f"- (0/{len(r['steps_to_target'])})")
    lines.append(f"| {r['setting']} | {r['estimator']} | {r['eval_loss']:.4f} | "
                 f"{r['perplexity']:.2f} | {100 * r['perplexity_change']:+.2f}% | {steps} | "
                 f"{r['max_relative_drift']:.1e} |")
  return "\n".join(lines)


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.lossy",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--settings", default=",".join(s[0] for s in SETTINGS),
                 help="comma-separated loss settings")
  p.add_argument("--estimators", default=",".join(ESTIMATORS), help="comma-separated")
  p.add_argument("--seeds", default="0", help="comma-separated seeds")
  p.add_argument("--workers", type=int, default=4, help="data-parallel ranks")
  p.add_argument("--steps", type=int, default=200, help="training steps per run")
  p.add_argument("--smooth", type=int, default=3, help="last evaluations averaged")
  p.add_argument("--summarize", metavar="JSON", default=None,
                 help="train nothing: remake the table of a written lossy.json's runs")
  p.add_argument("--tiny", action="store_true", help="smoke test: 2 workers, a tiny LM")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  if tiny:
    p.set_defaults(settings="no loss,10%", seeds="0", workers=2, steps=4, smooth=1)
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser(tiny="--tiny" in argv).parse_args(argv)
  split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
  names = [s[0] for s in SETTINGS]
  settings = [s for s in SETTINGS if s[0] in split(args.settings)]
  unknown = [s for s in split(args.settings) if s not in names]
  bad_est = [e for e in split(args.estimators) if e not in ESTIMATORS]
  if unknown or bad_est or not settings:
    raise SystemExit(f"--settings from {names}, --estimators from {list(ESTIMATORS)}; got "
                     f"{unknown or args.settings} / {bad_est}")
  if args.summarize:
    import json
    with open(args.summarize) as f:
      report = json.load(f)
    report["summary"] = summarize(report["runs"], args.smooth)
    report["summary_command"] = common.command_line()
    common.write_json(args.summarize, report)
    print(markdown(report["summary"]))
    return report
  from dynamiq_jax.examples import devices as ex_devices

  devices = ex_devices.select_devices(args.workers)
  import jax
  from tqdm.auto import tqdm

  targs = tta.build_parser(tiny=args.tiny).parse_args(["--tiny"] if args.tiny else [])
  targs.workers, targs.steps = args.workers, args.steps
  cfg = tta._training_config(targs)  # pylint: disable=protected-access
  mesh = jax.make_mesh((args.workers,), ("data",), devices=devices)
  seeds = [int(s) for s in split(args.seeds)]
  jobs = [(label, p, burst, est) for label, p, burst in settings
          for est in (["unbiased"] if p == 0 else split(args.estimators))]
  runs = {}
  with tqdm(total=len(jobs) * len(seeds) * args.steps, desc="lossy training",
            mininterval=10) as bar:
    for label, p, burst, est in jobs:
      for seed in seeds:
        runs.setdefault(f"{label} / {est}", {})[str(seed)] = run(
            cfg, mesh, seed, p, burst, est, progress=bar.update)
  rows = summarize(runs, args.smooth)
  report = {"training": cfg, "codec": "DynamiQ 5b, schedule two_step", "seeds": seeds,
            "runs": runs, "summary": rows, "command": common.command_line(),
            "machine": common.machine()}
  path = common.write_json(
      f"{common.results_dir(args.out)}/{'lossy_tiny' if args.tiny else 'lossy'}.json", report)
  print(markdown(rows))
  print(f"\nwrote {path}\nmachine: {report['machine']['platform']}; "
        f"reproduce: {report['command']}")
  return report


if __name__ == "__main__":
  main()
