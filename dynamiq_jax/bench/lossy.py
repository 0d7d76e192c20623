"""Training over lossy links: the time-to-accuracy benchmark's training at 0-10% packet loss.

    python -m dynamiq_jax.bench.lossy            # 4 ranks, 200 steps, every setting
    python -m dynamiq_jax.bench.lossy --tiny     # smoke test (CI)
    python -m dynamiq_jax.bench.lossy --workers 4,16,32,64 --global-batch 64 --model small \
        --settings 'no loss,10%' --steps 150 --stats-every 25 --stats-keys 4 \
        --name lossy_ranks                         # the ranks' sweep

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
the end). Writes ``docs/results/lossy.json`` (``--name``).

``--workers 16,32,64`` trains every setting at each rank count in turn (one
process, meshes over the first n of the largest count's simulated devices;
``--global-batch`` keeps the global batch fixed across them), writing the JSON
after every run. ``--links reduce`` or ``broadcast`` loses packets on one of the
two lossy hops only. ``--optimizer sgd`` replaces AdamW by SGD with momentum.
``--stats-every K`` measures, every K steps of the lossless run, what each
estimator makes of that step's per-rank gradients at each lossy setting's rate
(:func:`estimator_stats`, ``--stats-keys`` loss draws): its error against the
lossless reduction, split into bias and variance, its scale and its
direction, plain and weighted by the lossless run's AdamW second moment.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench import harness

__all__ = ["main", "SETTINGS", "ESTIMATORS", "MODELS", "ZeroFill", "run", "estimator_stats",
           "summarize", "fit_against_ranks"]

# (label, p, mean burst length in packets or None)
SETTINGS = (("no loss", 0.0, None), ("1%", 0.01, None), ("5%", 0.05, None),
            ("10%", 0.1, None), ("10% in bursts of 4", 0.1, 4.0))
ESTIMATORS = ("unbiased", "zero-fill")
# the LM of bench.tta, and a smaller one for tens of simulated ranks on a few cores
MODELS = {"tta": harness.MODEL,
          "small": dict(vocab=2048, seq_len=32, d_model=64, heads=2, layers=2, mlp=4)}
LINKS = ("both", "reduce", "broadcast")
OPTIMIZERS = ("adamw", "sgd")


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


def _optimizer(cfg: dict):
  import optax
  sched = optax.warmup_cosine_decay_schedule(
      0.0, cfg["lr"], cfg["warmup"], max(cfg["steps"], cfg["warmup"] + 1),
      end_value=cfg["lr"] / 10)
  if cfg.get("optimizer", "adamw") == "sgd":
    return optax.sgd(sched, momentum=0.9)
  return optax.adamw(sched, weight_decay=0.01)


def run(cfg: dict, mesh, seed: int, p: float, burst, estimator: str, progress=None,
        links: str = "both", stats: dict | None = None) -> dict:
  """One training run -> ``{"evals": [{"step", "eval_loss"}], "drift": [...], "train_loss"}``.

  ``links``: where packets are lost (``"both"`` hops, the gradient's ``"reduce"`` step
  only, or the parameter ``"broadcast"`` only). ``stats``: ``{"every": K, "keys": T,
  "rates": [(p, burst), ...]}``: every K steps, :func:`estimator_stats` of this step's
  gradients at each rate, in ``out["estimator_stats"]``.
  """
  import jax
  import optax

  import dynamiq_jax as dq

  if links not in LINKS:
    raise ValueError(f"links={links!r}: one of {LINKS}")
  data = harness.Trainer(cfg, mesh, "DynamiQ 5b")  # model, data and evaluation of bench.tta
  loss = (dq.PacketLoss if estimator == "unbiased" else ZeroFill)(p, burst=burst)
  lossless = dq.PacketLoss(0.0)
  tx = optax.chain(
      dq.compressed_psum_scatter("data", codec=dq.codecs.DynamiQ(bits=5), schedule="two_step",
                                 packet_loss=loss if links != "broadcast" else lossless),
      _optimizer(cfg))
  step = dq.data_parallel_step(data.loss, tx, mesh=mesh, per_rank=True,
                               packet_loss=loss if links != "reduce" else lossless,
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
  if stats:
    out["estimator_stats"] = []
  for s in range(cfg["steps"]):
    batch = data.batch(seed, s)
    if stats and s % stats["every"] == 0:
      out["estimator_stats"].append({"step": s, **estimator_stats(
          data, params, opt, batch, stats["rates"], stats["keys"])})
    params, opt, train_loss = step(params, opt, batch)
    out["train_loss"].append(float(np.asarray(train_loss.addressable_data(0))))
    out["drift"].append(float(np.asarray(step.stats["drift"].addressable_data(0))))
    if (s + 1) % cfg["eval_every"] == 0 or s + 1 == cfg["steps"]:
      out["evals"].append({"step": s + 1, "eval_loss": data.evaluate(params)[0]})
    if progress:
      progress()
  out["param_norm"] = norm(params)
  return out


def _replica0(tree):
  """This process's first replica of per-rank leaves (leading axis of ranks), as numpy."""
  import jax
  return jax.tree.map(lambda a: np.asarray(a.addressable_data(0))[0], tree)


def _full_second_moment(opt, params0, n: int):
  """The AdamW second moment ``nu`` of every leaf, its owners' shards put together (None
  without one, e.g. under SGD)."""
  import jax
  import optax

  from dynamiq_jax.training import lossy as dql
  states = [s for s in jax.tree.leaves(opt, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
  if not states:
    return None
  leaves, treedef = jax.tree.flatten(params0)
  dims = dql.owner_dims(params0, n)
  nus = treedef.flatten_up_to(states[0].nu)
  full = []
  for nu, dim, leaf in zip(nus, dims, leaves):
    shards = [np.asarray(s.data)[0] for s in sorted(nu.addressable_shards,
                                                      key=lambda s: s.index[0].start or 0)]
    full.append(shards[0] if dim is None else np.concatenate(shards, axis=dim))
    assert full[-1].shape == leaf.shape, (full[-1].shape, leaf.shape)
  return np.concatenate([a.reshape(-1) for a in full]).astype(np.float64)


def estimator_stats(data, params, opt, batch, rates, keys: int) -> dict:
  """What the reduce step's estimators make of one step's gradients, against the lossless
  reduction.

  Each rank's gradient at replica 0's parameters on its own part of ``batch`` is
  reduce-scattered as in training (DynamiQ 5b, two-step, the owners' dimensions), with
  ``keys`` keys: once without loss (``g``), and at each ``(p, burst)`` of ``rates`` with
  the unbiased estimate and with the zero fill (``g_hat``; the same key, so the codec's
  rounding is the same and only the lost packets differ). Returns, per ``"p=.. / est"``,
  means over the keys, each relative to ``|g|^2``: ``error`` ``|g_hat - g|^2``; ``bias``
  ``|mean_k g_hat - g|^2`` (which holds ``variance / keys``); ``variance`` the rest;
  ``scale`` ``<g_hat, g> / |g|^2``; ``direction`` ``1 - cos^2(g_hat, g)`` (the error left
  after the best rescaling, what a scale-free optimizer sees); ``energy``
  ``|g_hat|^2 / |g|^2``; and ``adam_error`` / ``adam_direction``, the same two with every
  coordinate divided by ``sqrt(nu) + 1e-8``, AdamW's second moment from ``opt``. Also
  ``codec_error`` (the lossless reduction against the exact mean) and ``rank_spread``
  (the ranks' mean ``|g_r - mean|^2 / |mean|^2``, the gradients' heterogeneity).
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from dynamiq_jax.training import lossy as dql
  n = data.n
  p0 = _replica0(params)
  leaves, treedef = jax.tree.flatten(p0)
  dims = dql.owner_dims(p0, n)
  x, y = (np.asarray(a) for a in batch)
  xs, ys = x.reshape(n, -1, *x.shape[1:]), y.reshape(n, -1, *y.shape[1:])
  est_cls = {"unbiased": dq.PacketLoss, "zero-fill": ZeroFill}
  cache = data.__dict__.setdefault("_stats_fns", {})
  if "grads" not in cache:
    cache["grads"] = jax.jit(jax.vmap(jax.grad(data.loss), in_axes=(None, 0)))
  if cache.get("rates") != rates:
    # the reductions of one key: lossless, then each rate with each estimator
    losses = [dq.PacketLoss(0.0)] + [cls(p, burst=burst) for p, burst in rates
                                     for cls in est_cls.values()]

    def reduce(g, key, loss):
      def local(t):  # on each rank of the mesh: its gradient -> its slices, as in training
        t = jax.tree.map(lambda a: a[0], t)
        out = dq.reduce_scatter(t, axis_name="data", codec=dq.codecs.DynamiQ(bits=5), key=key,
                                schedule="two_step", scatter_dimension=treedef.unflatten(dims),
                                packet_loss=loss)[0]
        return jax.tree.map(lambda a: a[None], out)
      return jax.tree.leaves(jax.shard_map(local, mesh=data.mesh, in_specs=P("data"),
                                           out_specs=P("data"), check_vma=False)(g))
    # one program for all of them: one compile, and the codec's work before the losses
    # (the same key, so the same rounding) is shared
    jitted = jax.jit(lambda g, key: [reduce(g, key, loss) for loss in losses])

    def whole(out):  # each owner's slice put back in place; a whole leaf from rank 0
      out = [np.asarray(o, np.float64) for o in out]
      return np.concatenate([(o[0] if d is None else np.concatenate(list(o), axis=d)).reshape(-1)
                             for o, d in zip(out, dims)])

    def flat(g, key):
      return [whole(out) for out in jitted(g, key)]
    cache["reduce"], cache["rates"] = flat, list(rates)
  grads = jax.device_put(cache["grads"](p0, (xs, ys)), NamedSharding(data.mesh, P("data")))
  per_rank = np.concatenate([np.asarray(a, np.float64).reshape(n, -1)
                             for a in jax.tree.leaves(grads)], axis=1)
  exact = per_rank.mean(0)
  nu = _full_second_moment(opt, p0, n)
  w = None if nu is None else 1.0 / (np.sqrt(nu) + 1e-8)
  out = {"rank_spread": float(np.mean(np.sum((per_rank - exact) ** 2, 1)) / np.sum(exact ** 2))}
  acc: dict = {}
  codec_err = []
  labels = [f"p={p:g}{'' if burst is None else f' burst={burst:g}'} / {est}"
            for p, burst in rates for est in est_cls]
  for k in range(keys):
    g, *lossy = cache["reduce"](grads, jax.random.key(7919 + k))
    codec_err.append(np.sum((g - exact) ** 2) / np.sum(exact ** 2))
    for label, h in zip(labels, lossy):
      a = acc.setdefault(label, {"sum": np.zeros_like(g), "g": g, "rows": []})
      a["sum"] = a["sum"] + (h - g)
      row = {}
      for tag, ww in (("", None), ("adam_", w)):
        if tag and ww is None:
          continue
        gg, hh = (g, h) if ww is None else (g * ww, h * ww)
        e2 = np.sum(gg ** 2)
        row[tag + "error"] = np.sum((hh - gg) ** 2) / e2
        row[tag + "direction"] = 1.0 - np.dot(hh, gg) ** 2 / (np.sum(hh ** 2) * e2)
      row["scale"] = np.dot(h, g) / np.sum(g ** 2)
      row["energy"] = np.sum(h ** 2) / np.sum(g ** 2)
      a["rows"].append(row)
  for name, a in acc.items():
    mean = {k: float(np.mean([r[k] for r in a["rows"]])) for k in a["rows"][0]}
    # |mean over keys of g_hat - g|^2 has expectation bias^2 + variance / keys
    raw = float(np.sum((a["sum"] / keys) ** 2) / np.sum(a["g"] ** 2))
    mean["bias"] = max(0.0, (keys * raw - mean["error"]) / (keys - 1)) if keys > 1 else raw
    mean["variance"] = mean["error"] - mean["bias"]
    out[name] = mean
  out["codec_error"] = float(np.mean(codec_err))
  out["keys"] = keys
  return out


def _by_workers(report: dict) -> dict:
  """``{str(n): {"setting / estimator": {seed: run}}}`` from a report's ``runs`` (a report
  of one rank count, written before ``--workers`` took several, holds the inner dict)."""
  runs = report["runs"]
  if any(" / " in k for k in runs):
    return {str(report["training"]["workers"]): runs}
  return runs


def summarize(runs_by_workers: dict, smooth: int, target_at: float = 0.8) -> list[dict]:
  """Rows: ranks x setting x estimator -> final eval loss, perplexity change vs no loss
  (same ranks, same seed), steps to the target (the lossless run's smoothed eval loss at
  ``target_at`` of its run, as :mod:`dynamiq_jax.bench.tta` defines it), drift."""
  rows = []
  for workers, runs in sorted(runs_by_workers.items(), key=lambda kv: int(kv[0])):
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
            target = harness.target_of(base, target_at, smooth)
            steps.append(harness.steps_to_target(r, target, smooth))
        rows.append({"workers": int(workers), "setting": label, "p": p, "burst": burst,
                     "estimator": est, "eval_loss": float(np.mean(finals)),
                     "perplexity": float(math.exp(np.mean(finals))),
                     "perplexity_change": float(np.mean(changes)),
                     "max_relative_drift": float(np.max(drifts)), "seeds": len(finals),
                     "steps_to_target": steps})
  return rows


def fit_against_ranks(rows: list[dict], at: int = 64) -> list[dict]:
  """Per lossy setting and estimator measured at two or more rank counts: the least-squares
  fit of the perplexity change to ``a + b / n``, its value at ``at`` ranks and its limit
  ``a`` (n -> infinity)."""
  fits = []
  groups: dict = {}
  for r in rows:
    if r["p"] > 0:
      groups.setdefault((r["setting"], r["estimator"]), []).append(r)
  for (setting, est), rs in groups.items():
    if len({r["workers"] for r in rs}) < 2:
      continue
    inv = np.array([1.0 / r["workers"] for r in rs])
    y = np.array([r["perplexity_change"] for r in rs])
    (a, b), *_ = np.linalg.lstsq(np.stack([np.ones_like(inv), inv], 1), y, rcond=None)
    fits.append({"setting": setting, "estimator": est,
                 "workers": [r["workers"] for r in rs], "a": float(a), "b": float(b),
                 f"at_{at}": float(a + b / at), "limit": float(a)})
  return fits


def markdown(rows: list[dict]) -> str:
  lines = ["| ranks | loss | estimator | final eval loss | perplexity | vs no loss "
           "| steps to target | largest drift |", "|---:|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    reached = [s for s in r["steps_to_target"] if s is not None]
    steps = (f"{np.mean(reached):.0f} ({len(reached)}/{len(r['steps_to_target'])})"
             if reached else f"- (0/{len(r['steps_to_target'])})")
    lines.append(f"| {r['workers']} | {r['setting']} | {r['estimator']} | {r['eval_loss']:.4f} | "
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
  p.add_argument("--workers", default="4",
                 help="data-parallel ranks; comma-separated: every setting at each count")
  p.add_argument("--global-batch", type=int, default=None,
                 help="sequences per step over all ranks (a multiple of each --workers); "
                 "unset: 8 per rank")
  p.add_argument("--model", default="tta", choices=sorted(MODELS),
                 help="the LM: bench.tta's, or a smaller one for tens of ranks")
  p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                 help="after the reduce-scatter: AdamW (weight decay 0.01) or SGD, momentum 0.9")
  p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
  p.add_argument("--warmup", type=int, default=20, help="warm-up steps (then cosine to lr/10)")
  p.add_argument("--steps", type=int, default=200, help="training steps per run")
  p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
  p.add_argument("--smooth", type=int, default=3, help="last evaluations averaged")
  p.add_argument("--links", default="both", choices=LINKS,
                 help="where packets are lost: both hops, the gradient's reduce step only, "
                 "or the parameter broadcast only")
  p.add_argument("--stats-every", type=int, default=0,
                 help="every this many steps of the lossless run, the estimators' errors on "
                 "its gradients at each lossy setting's rate (0: never)")
  p.add_argument("--stats-keys", type=int, default=8, help="loss draws per --stats-every step")
  p.add_argument("--summarize", metavar="JSON", default=None,
                 help="train nothing: remake the table of a written lossy.json's runs")
  p.add_argument("--merge", metavar="JSON", nargs="+", default=None,
                 help="with --summarize: add these reports' runs (other rank counts) to it")
  p.add_argument("--tiny", action="store_true",
                 help="smoke test: 2 workers, a tiny LM, no loss and 10%% with the unbiased "
                 "estimate (the zero fill in --stats-every's statistics only)")
  p.add_argument("--name", default=None,
                 help="the JSON's file name, without .json; unset: lossy (lossy_tiny)")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  if tiny:
    p.set_defaults(settings="no loss,10%", estimators="unbiased", seeds="0", workers="2",
                   steps=4, smooth=1)
  return p


def _check(args, split) -> list[int]:
  """The rank counts of ``--workers``, after every flag is checked (SystemExit naming the bad
  value and its fix)."""
  names = [s[0] for s in SETTINGS]
  unknown = [s for s in split(args.settings) if s not in names]
  bad_est = [e for e in split(args.estimators) if e not in ESTIMATORS]
  if unknown or bad_est or not split(args.settings):
    raise SystemExit(f"--settings from {names}, --estimators from {list(ESTIMATORS)}; got "
                     f"{unknown or args.settings} / {bad_est}")
  try:
    workers = [int(w) for w in split(args.workers)]
  except ValueError:
    workers = []
  if not workers or min(workers) < 2:
    raise SystemExit(f"--workers={args.workers!r}: comma-separated rank counts, each >= 2 "
                     f"(e.g. --workers 16,32,64)")
  if args.global_batch is not None and any(args.global_batch % w or args.global_batch < w
                                           for w in workers):
    raise SystemExit(f"--global-batch={args.global_batch} must be a positive multiple of every "
                     f"--workers {workers} (e.g. --global-batch {math.lcm(*workers)})")
  if args.stats_every < 0 or args.stats_keys < 2:
    raise SystemExit(f"--stats-every={args.stats_every} must be >= 0 and --stats-keys="
                     f"{args.stats_keys} >= 2 (the bias is told from the variance across keys)")
  if args.steps < 1 or args.eval_every < 1:
    raise SystemExit(f"--steps={args.steps} and --eval-every={args.eval_every} must be >= 1")
  return workers


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser(tiny="--tiny" in argv).parse_args(argv)
  split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
  workers = _check(args, split)
  if args.merge and not args.summarize:
    raise SystemExit("--merge adds runs to the report of --summarize JSON: pass both")
  settings = [s for s in SETTINGS if s[0] in split(args.settings)]
  if args.summarize:
    import json
    with open(args.summarize) as f:
      report = json.load(f)
    for other in args.merge or []:  # rank counts run apart, joined into one table
      with open(other) as f:
        part = json.load(f)
      report["runs"] = {**_by_workers(report), **_by_workers(part)}
      if isinstance(report["training"].get("model"), dict):  # one rank count's report
        report["training"] = {str(report["training"]["workers"]): report["training"]}
      report["training"].update(part["training"] if "model" not in part["training"] else
                                {str(part["training"]["workers"]): part["training"]})
      report.setdefault("merged", []).append(
          {"file": other, **{k: part.get(k) for k in ("command", "machine", "load", "links")}})
      report["workers"] = sorted(int(n) for n in report["runs"])
    report["summary"] = summarize(_by_workers(report), args.smooth)
    report["fit"] = fit_against_ranks(report["summary"])
    report["summary_command"] = common.command_line()
    common.write_json(args.summarize, report)
    print(markdown(report["summary"]))
    return report
  from dynamiq_jax.examples import devices as ex_devices

  devices = ex_devices.select_devices(max(workers))
  import jax
  from tqdm.auto import tqdm

  targs = harness.training_args(["--tiny"] if args.tiny else [])
  targs.steps, targs.eval_every = args.steps, args.eval_every
  if not args.tiny:
    targs.lr, targs.warmup = args.lr, args.warmup
  seeds = [int(s) for s in split(args.seeds)]
  jobs = [(label, p, burst, est) for label, p, burst in settings
          for est in (["unbiased"] if p == 0 else split(args.estimators))]
  rates = [(p, burst) for _, p, burst in settings if p > 0]
  name = args.name or ("lossy_tiny" if args.tiny else "lossy")
  path = f"{common.results_dir(args.out)}/{name}.json"
  report = {"training": {}, "codec": "DynamiQ 5b, schedule two_step", "links": args.links,
            "seeds": seeds, "workers": workers, "runs": {}, "command": common.command_line()}
  total = len(jobs) * len(seeds) * args.steps * len(workers)
  with tqdm(total=total, desc="lossy training", mininterval=10) as bar:
    for n in workers:
      targs.workers = n
      targs.batch = args.global_batch // n if args.global_batch else targs.batch
      cfg = harness.training_config(targs)
      if not args.tiny:
        cfg["model"] = dict(MODELS[args.model])
      cfg["optimizer"] = args.optimizer
      report["training"][str(n)] = cfg
      mesh = jax.make_mesh((n,), ("data",), devices=devices[:n])
      runs = report["runs"].setdefault(str(n), {})
      for label, p, burst, est in jobs:
        for seed in seeds:
          stats = ({"every": args.stats_every, "keys": args.stats_keys, "rates": rates}
                   if args.stats_every and p == 0 and rates else None)
          with common.load_watch(f"{n} ranks, {label} / {est}, seed {seed}") as watch:
            r = run(cfg, mesh, seed, p, burst, est, progress=bar.update, links=args.links,
                    stats=stats)
          r["wall_s"] = watch.record.get("wall_s")
          runs.setdefault(f"{label} / {est}", {})[str(seed)] = r
          report["summary"] = summarize(report["runs"], args.smooth)
          report["fit"] = fit_against_ranks(report["summary"])
          report["machine"] = common.machine()
          common.write_json(path, report)  # after every run: a long sweep keeps what it made
  print(markdown(report["summary"]))
  for f in report["fit"]:
    print(f"{f['setting']} / {f['estimator']}: perplexity change ~ {100 * f['a']:+.2f}% "
          f"{100 * f['b']:+.1f}% / n over n = {f['workers']}: {100 * f['at_64']:+.2f}% at 64")
  print(f"\nwrote {path}\nmachine: {report['machine']['platform']}; "
        f"reproduce: {report['command']}")
  return report


if __name__ == "__main__":
  main()
