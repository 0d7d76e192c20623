"""Time-to-accuracy over rate-limited links, in the regime the paper is about.

    sudo python -m dynamiq_jax.bench.tta                 # every codec, 3 seeds, 100 and 1000 Mbit/s
    sudo python -m dynamiq_jax.bench.tta --phases measure,real   # keep the simulated runs
    python -m dynamiq_jax.bench.tta --tiny               # smoke test (CI)

The model is a word-level transformer LM (:mod:`dynamiq_jax.bench.lm`,
vocabulary 8192, 2.7 M parameters) trained data-parallel by ``--workers``
ranks with AdamW, each codec through ``dq.reducer`` and
``dq.data_parallel_step``: a model whose gradients carry many near-empty
embedding and output rows (the paper's large-vocabulary setting), and big
enough that one BF16 all-reduce over 100 Mbit/s takes longer than a step's
compute. Every phase runs the same training code (:func:`train_run`):

1. ``simulate``: every codec x seed trains on ``--workers`` simulated CPU
   devices in this process. Target, per seed: BF16's (``psum-bf16``) eval
   loss, smoothed over ``--smooth`` evaluations, at ``--target-at`` of its
   run; steps to target = the first evaluated step at which a run's smoothed
   eval loss is at or below its seed's target.
2. ``measure``: ``--workers`` processes, each in its own network namespace
   with a ``tc``-shaped link (:mod:`dynamiq_jax.bench.netns`), time
   ``--time-steps`` training steps of every codec at every ``--rates`` link
   rate; seconds per step = the median over steps of the slowest process
   (compute and communication included). TTA = steps to target x seconds
   per step.
3. ``real``: full training runs over the links at the first rate, for the
   ``--real`` codecs, clocked (evaluations excluded). They confirm the
   product of phases 1 and 2, and their parameters are compared bit for bit
   with the simulated run of the same codec and seed at every evaluation.

The Moshpit rows (``dq.reducer("moshpit")``: DynamiQ 5b inside the groups of a
virtual grid, 2 x 2 for 4 workers) train each rank's own replica
(``data_parallel_step(per_rank=True)``); their evaluations use the first replica
and record ``replica_spread``, the largest distance of a replica from the
replicas' mean relative to the mean's norm (0 where nobody was absent).

Without root (or with ``--no-shaping``) the processes talk over plain
loopback and the rates are labels only, which the output says. Writes
``docs/results/tta.json`` and ``tta_wallclock.png`` (eval loss against
measured wall-clock seconds at the first rate). Phases left out of
``--phases`` are kept from an existing ``tta.json`` when it was made with the
same training configuration (each keeps its own command and machine); the
simulated runs of codecs left out of ``--codecs`` are kept too (same seeds),
so a codec added to the table needs only its own runs (``provenance`` names
each codec's command and commit). The timed phases run every codec of
``--codecs`` side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench import harness
from dynamiq_jax.bench.harness import BASELINE, CODECS, TRAINING_KEYS, Trainer
from dynamiq_jax.bench.harness import check_training_args, steps_to_target, target_of
from dynamiq_jax.bench.harness import train_run, training_config, wire

__all__ = ["main", "build_parser", "summarize", "markdown"]

PHASES = ("simulate", "measure", "real")

# ---------------------------------------------------------------------------
# worker side (one process per rank)


def _worker(cfg: dict, rank: int, coordinator: str) -> None:
  from dynamiq_jax.bench.netns import driver_commands, join_job

  mesh, say, sync = join_job(cfg, rank, coordinator, barrier="tta-step")
  import jax

  trainers = {}
  for label in cfg["labels"]:
    trainers[label] = Trainer(cfg, mesh, label)
    params, opt = trainers[label].init(0)  # compile (the links are not shaped yet)
    jax.block_until_ready(trainers[label].step(params, opt, trainers[label].batch(0, 0)))
  say("READY", {"rank": rank})
  for cmd in driver_commands("time", "train",
                             usage="time <steps> or train <label index> <seed> <steps>"):
    if cmd[0] == "time":  # time <steps>: every codec, from seed 0's start
      times = {}
      for label, tr in trainers.items():
        times[label] = train_run(tr, 0, int(cmd[1]), sync=sync)["step_s"]
      say("RESULT", {"rank": rank, "step_s": times})
    elif cmd[0] == "train":  # train <label index> <seed> <steps>
      label = cfg["labels"][int(cmd[1])]
      say("RESULT", {"rank": rank, "run": train_run(trainers[label], int(cmd[2]), int(cmd[3]),
                                                   sync=sync)})


# ---------------------------------------------------------------------------
# driver side


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default); ``tiny``: --tiny's defaults."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.tta",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--phases", default=",".join(PHASES),
                 help="comma-separated, of " + ", ".join(PHASES) + "; '' runs none and "
                 "only remakes the table and plot from the stored phases")
  p.add_argument("--codecs", default=",".join(c[0] for c in CODECS),
                 help="comma-separated labels, BF16 psum included")
  harness.add_training_flags(p)
  p.add_argument("--rates", type=float, nargs="+", default=[100.0, 1000.0],
                 help="link rates in Mbit/s; the first is the headline and the real runs'")
  p.add_argument("--time-steps", type=int, default=8, help="timed steps per codec and rate")
  p.add_argument("--real", default="BF16 psum,DynamiQ 5b",
                 help="codecs trained in full over the links at the first rate")
  p.add_argument("--real-seed", type=int, default=0, help="seed of the real runs")
  common.add_process_flags(
      p, heartbeat_s=60, timeout=3600,
      timeout_help="seconds any one multi-process phase may take before it is stopped")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  if tiny:
    p.set_defaults(**harness.TINY_TRAINING, codecs="BF16 psum,DynamiQ 5b", rates=[200.0],
                   time_steps=2, real="DynamiQ 5b")
  return p


def parse(argv=None):
  """``argv`` (unset: the command line) checked, the lists split."""
  argv = sys.argv[1:] if argv is None else list(argv)
  p = build_parser(tiny="--tiny" in argv)
  args = p.parse_args(argv)
  if args.worker is not None:
    return args
  labels = [c[0] for c in CODECS]
  split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
  args.phases, args.codecs, args.real = split(args.phases), split(args.codecs), split(args.real)
  for ph in args.phases:
    if ph not in PHASES:
      p.error(f"--phases: unknown phase {ph!r}; choose from {', '.join(PHASES)}")
  for c in args.codecs + args.real:
    if c not in labels:
      p.error(f"--codecs/--real: unknown codec {c!r}; choose from {', '.join(labels)}")
  if BASELINE not in args.codecs and args.phases != ["simulate"]:
    p.error(f"--codecs must include {BASELINE!r}: every figure is relative to it (only "
            f"--phases simulate may leave it out, to add codecs to an earlier run)")
  args.codecs = [c for c in labels if c in args.codecs]  # the table's order
  check_training_args(p, args)
  if not args.rates or any(r <= 0 for r in args.rates):
    p.error(f"--rates {args.rates}: give one or more link rates in Mbit/s, all > 0")
  if args.real_seed not in args.seeds:
    p.error(f"--real-seed={args.real_seed} must be one of --seeds {args.seeds} (its simulated "
            f"run is the reference)")
  return args


def main(argv=None):
  args = parse(argv)
  if common.run_worker(args, _worker):
    return None
  from dynamiq_jax.examples import devices as ex_devices  # examples/, shipped in the wheel

  devices = ex_devices.select_devices(args.workers)  # before anything else starts JAX
  cfg = training_config(args)
  out_dir = common.results_dir(args.out)
  path = os.path.join(out_dir, "tta_tiny.json" if args.tiny else "tta.json")
  report = _earlier(path, cfg)
  report.update(training=cfg, command=common.command_line(), machine=common.machine())
  if "simulate" in args.phases:
    report["simulate"] = _merge_simulated(report.get("simulate"), _simulate(args, cfg, devices))
    common.write_json(path, report, strict=args.strict)
  if "measure" in args.phases or "real" in args.phases:
    report.update(_multiprocess(args, cfg, report.get("simulate")))
    common.write_json(path, report, strict=args.strict)
  missing = [ph for ph in PHASES if ph not in report]
  if missing:
    print(f"\nwrote {path} (no table: phase(s) {', '.join(missing)} not run yet with this "
          f"training configuration)")
    return report
  report["summary"] = summarize(report, args)
  common.write_json(path, report, strict=args.strict)
  _print(report["summary"])
  print("\n" + markdown(report["summary"]))
  print("\nthe README's rows:\n" + markdown(report["summary"], README_CODECS))
  png = _plot(report, args, out_dir)
  print(f"\nwrote {path} and {png}\nmachine: {report['machine']['platform']}; "
        f"reproduce: {report['command']}")
  return report


def _earlier(path: str, cfg: dict) -> dict:
  """Phases of an existing report made with the same training configuration."""
  try:
    with open(path) as f:
      earlier = json.load(f)
  except FileNotFoundError:
    return {}
  if any(earlier.get("training", {}).get(k) != cfg[k] for k in TRAINING_KEYS):
    print(f"{path}: made with another training configuration; its phases are not kept")
    return {}
  return {ph: earlier[ph] for ph in PHASES if ph in earlier}


def _stamp(args) -> dict:
  return {"command": common.command_line(), "machine": common.machine()}


def _merge_simulated(earlier: dict | None, new: dict) -> dict:
  """The new simulated runs, and the earlier ones of the codecs not run now when they have
  the same seeds (a codec added to the table needs only its own runs). ``provenance``
  names the command and commit of each codec's runs."""
  stamp = {"command": new["command"], "git_commit": new["machine"].get("git_commit")}
  out = dict(new, provenance={label: stamp for label in new["runs"]})
  if not earlier or earlier.get("seeds") != new["seeds"]:
    return out
  old_stamp = {"command": earlier["command"], "git_commit": earlier["machine"].get("git_commit")}
  for label, runs in earlier["runs"].items():
    if label not in out["runs"]:
      out["runs"][label] = runs
      out["provenance"][label] = earlier.get("provenance", {}).get(label, old_stamp)
  out["runs"] = {c[0]: out["runs"][c[0]] for c in CODECS if c[0] in out["runs"]}  # table order
  return out


def _simulate(args, cfg, devices) -> dict:
  import jax
  from tqdm.auto import tqdm

  mesh = jax.make_mesh((args.workers,), ("data",), devices=devices)
  runs = {}
  with tqdm(total=len(args.codecs) * len(args.seeds) * args.steps, desc="simulated training",
            mininterval=10) as bar:
    for label in args.codecs:
      trainer = Trainer(cfg, mesh, label)
      for seed in args.seeds:
        runs.setdefault(label, {})[str(seed)] = train_run(trainer, seed, args.steps,
                                                         progress=bar.update)
  return {"runs": runs, "seeds": args.seeds, **_stamp(args)}


def _multiprocess(args, cfg, simulated) -> dict:
  """The ``measure`` and ``real`` phases: ``--workers`` processes over shaped links."""
  import tempfile

  from dynamiq_jax.bench.netns import shaping, worker_job

  shaped = shaping(args.no_shaping)
  measure, real = "measure" in args.phases, "real" in args.phases
  labels = list(dict.fromkeys((args.codecs if measure else []) + (args.real if real else [])))
  wcfg = dict(cfg, labels=labels, heartbeat_s=args.heartbeat_s)
  out = {}
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(wcfg, f)
    cfg_path = f.name
  try:
    with worker_job("dynamiq_jax.bench.tta", args.workers, cfg_path,
                    shaped=shaped) as (job, net):
      print(f"({len(labels)} training steps)", flush=True)
      job.wait_lines("READY ", timeout=args.timeout)
      link = ("each worker's veth into a bridge namespace rate limited with tc tbf in both "
              "directions" if shaped else "plain loopback, no shaping (rates are labels)")
      if measure:
        rows, loads = [], []  # loads: the machine's load while each rate was timed
        for rate in args.rates:
          if net:
            net.set_rate(rate)
          with common.load_watch(f"measure {rate:g} Mbit/s") as load:  # busy machine?
            job.send(f"time {args.time_steps}")
            per_rank = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
          for label in args.codecs:
            slowest = [max(s) for s in zip(*[r["step_s"][label] for r in per_rank])]
            # the first timed step after a re-shaped link can carry start-up costs
            med = statistics.median(slowest[1:] if len(slowest) > 2 else slowest)
            rows.append({"rate_mbit": rate, "codec": label, "seconds_per_step": med,
                         "seconds_all": slowest})
            print(f"{rate:7g} Mbit/s  {label:<12} {med:8.3f} s/step", flush=True)
          loads.append({"rate_mbit": rate, **load.record})
        out["measure"] = {"rows": rows, "shaped": shaped, "link_model": link,
                          "time_steps": args.time_steps, "load": loads, **_stamp(args)}
      if real:
        runs = {}
        if net:
          net.set_rate(args.rates[0])
        for label in args.real:
          job.send(f"train {labels.index(label)} {args.real_seed} {args.steps}")
          per_rank = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
          run = per_rank[0]["run"]
          # the clock of a step is its slowest process's
          run["step_s"] = [max(s) for s in zip(*[r["run"]["step_s"] for r in per_rank])]
          wall = np.cumsum(run["step_s"])
          for e in run["evals"]:
            e["wall_s"] = float(wall[e["step"] - 1]) if e["step"] else 0.0
          run["ranks_agree"] = all(r["run"]["evals"][i]["digest"] == e["digest"]
                                   for r in per_rank for i, e in enumerate(run["evals"]))
          sim = (simulated or {}).get("runs", {}).get(label, {}).get(str(args.real_seed))
          if sim:
            run["same_as_simulated"] = [a["digest"] == b["digest"]
                                        for a, b in zip(run["evals"], sim["evals"])]
          runs[label] = run
          print(f"real run at {args.rates[0]:g} Mbit/s, {label}: {wall[-1]:.1f} s for "
                f"{args.steps} steps; final eval loss {run['evals'][-1]['eval_loss']:.4f}"
                + (f"; parameters equal to the simulated run's at "
                   f"{sum(run['same_as_simulated'])}/{len(run['same_as_simulated'])} "
                   f"evaluations" if sim else ""), flush=True)
        out["real"] = {"runs": runs, "rate_mbit": args.rates[0], "seed": args.real_seed,
                       "shaped": shaped, "link_model": link, **_stamp(args)}
      job.send("quit")
      job.wait(timeout=120)
  finally:
    os.unlink(cfg_path)
  return out


def _mean_std(values):
  v = np.asarray([x for x in values if x is not None], np.float64)
  if v.size == 0:
    return None, None
  return float(v.mean()), (float(v.std(ddof=1)) if v.size > 1 else 0.0)


def summarize(report: dict, args) -> dict:
  """The TTA table: per codec steps to target, s/step and TTA per rate, final eval loss."""
  sim = report["simulate"]
  seeds = [str(s) for s in sim["seeds"]]
  window, target_at = args.smooth, args.target_at
  targets = {s: target_of(sim["runs"][BASELINE][s], target_at, window) for s in seeds}
  step_s = {(r["rate_mbit"], r["codec"]): r["seconds_per_step"]
            for r in report["measure"]["rows"]}
  rates = list(dict.fromkeys(r["rate_mbit"] for r in report["measure"]["rows"]))  # as measured
  base_q = _mean_std([sim["runs"][BASELINE][s]["evals"][-1]["eval_loss"] for s in seeds])[0]
  rows, known = {}, {c[0] for c in CODECS}
  for label, per_seed in sim["runs"].items():
    if label not in known:
      continue
    k = [steps_to_target(per_seed[s], targets[s], window) for s in seeds if s in per_seed]
    q_mean, q_std = _mean_std([per_seed[s]["evals"][-1]["eval_loss"] for s in seeds
                               if s in per_seed])
    row = {**wire(report["training"], label),
           "steps_to_target": k, "reached": sum(x is not None for x in k),
           "final_eval_loss_mean": q_mean, "final_eval_loss_std": q_std,
           "final_vs_bf16": q_mean / base_q - 1.0 if q_mean is not None else None, "rates": {}}
    for rate in rates:
      s = step_s.get((rate, label))
      tta = _mean_std([None if x is None or s is None else x * s for x in k])[0]
      row["rates"][str(rate)] = {"seconds_per_step": s, "tta_s": tta}
    rows[label] = row
  for rate in rates:
    base = rows[BASELINE]["rates"][str(rate)]["tta_s"]
    for row in rows.values():
      t = row["rates"][str(rate)]["tta_s"]
      row["rates"][str(rate)]["speedup_vs_bf16"] = base / t if base and t else None
  out = {"targets": targets, "target_at": target_at, "smooth": window, "rates": rates,
         "codecs": rows}
  real = report.get("real")
  if real:
    checks = {}
    rate = real["rate_mbit"]
    for label, run in real["runs"].items():
      seed = str(real["seed"])
      k_real = steps_to_target(run, targets[seed], window)
      t_real = None if k_real is None else next(e["wall_s"] for e in run["evals"]
                                                if e["step"] == k_real)
      s = step_s.get((rate, label))
      k_sim = steps_to_target(sim["runs"][label][seed], targets[seed], window)
      predicted = None if k_sim is None or s is None else k_sim * s
      checks[label] = {"seed": int(seed), "steps_to_target_real": k_real,
                       "steps_to_target_simulated": k_sim, "tta_real_s": t_real,
                       "tta_predicted_s": predicted,
                       "ratio": t_real / predicted if t_real and predicted else None,
                       "seconds_per_step_real": statistics.median(run["step_s"]),
                       "same_as_simulated": run.get("same_as_simulated")}
    out["real_check"] = {"rate_mbit": rate, "codecs": checks}
  return out


def _fmt(x, spec):
  return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _print(summary):
  rates = summary["rates"]
  print(f"\n== time to accuracy: target = BF16's smoothed eval loss at {summary['target_at']:g} "
        f"of its run (per seed: {', '.join(f'{v:.4f}' for v in summary['targets'].values())}) ==")
  head = f"{'codec':<12} {'bits':>5} {'steps->tgt':>12}"
  for r in rates:
    head += f" {f's/step@{r:g}':>12} {f'TTA@{r:g} [s]':>14} {'vs BF16':>8}"
  print(head + f" {'final eval loss':>18} {'vs BF16':>8}")
  for label, row in summary["codecs"].items():
    k_mean, _ = _mean_std(row["steps_to_target"])
    line = f"{label:<12} {row['bits_per_coord']:5.2f} {_fmt(k_mean, '7.1f'):>7}({row['reached']}/{len(row['steps_to_target'])})"
    for r in rates:
      c = row["rates"][str(r)]
      line += (f" {_fmt(c['seconds_per_step'], '12.3f')} {_fmt(c['tta_s'], '14.1f')}"
               f" {_fmt(c['speedup_vs_bf16'], '7.2f')}x")
    line += (f" {_fmt(row['final_eval_loss_mean'], '.4f'):>9} +- "
             f"{_fmt(row['final_eval_loss_std'], '.4f'):<6}"
             f" {_fmt(row['final_vs_bf16'] and 100 * row['final_vs_bf16'], '+7.2f')}%")
    print(line)
  check = summary.get("real_check")
  if check:
    print(f"\n== real training runs at {check['rate_mbit']:g} Mbit/s (seed "
          f"{next(iter(check['codecs'].values()))['seed']}) against steps x s/step ==")
    for label, c in check["codecs"].items():
      same = c["same_as_simulated"]
      print(f"{label:<12} real {_fmt(c['tta_real_s'], '.1f')} s to target "
            f"(step {c['steps_to_target_real']}), predicted {_fmt(c['tta_predicted_s'], '.1f')} s "
            f"(step {c['steps_to_target_simulated']}): ratio {_fmt(c['ratio'], '.3f')}; "
            + (f"parameters equal to the simulated run's at {sum(same)}/{len(same)} evaluations"
               if same else "no simulated run to compare with"))


README_CODECS = ("BF16 psum", "bf16 ring", "DynamiQ 5b", "DynamiQ 4b", "MXFP8", "MXFP4", "THC",
                 "OmniReduce", "ARC-Top-K 0.2", "Top-K 0.1 (all-gather)")
"""The README's rows of the table (docs/results.md has every codec's)."""


def markdown(summary: dict, codecs=None) -> str:
  """The TTA table in Markdown: one row per codec (``codecs``: those only, e.g.
  :data:`README_CODECS`), the rates of the run."""
  rates = summary["rates"]
  label = lambda r: f"{r / 1000:g} Gbit/s" if r >= 1000 else f"{r:g} Mbit/s"
  head = ["codec", "bits / coord", "steps to target"]
  for r in rates:
    head += [f"s / step, {label(r)}", f"TTA, {label(r)}"]
  lines = ["| " + " | ".join(head + ["final eval loss vs BF16"]) + " |",
           "|" + "---|" * (len(head) + 1)]
  for name, row in summary["codecs"].items():
    if codecs is not None and name not in codecs:
      continue
    k_mean, _ = _mean_std(row["steps_to_target"])
    cells = [name, f"{row['bits_per_coord']:.2f}",
             f"{_fmt(k_mean, '.0f')} ({row['reached']}/{len(row['steps_to_target'])})"]
    for r in rates:
      c = row["rates"][str(r)]
      cells.append(f"{_fmt(c['seconds_per_step'], '.2f')} s")
      cells.append("-" if c["tta_s"] is None else
                   f"{c['tta_s']:.0f} s ({_fmt(c['speedup_vs_bf16'], '.2f')}x)")
    cells.append(f"{_fmt(row['final_vs_bf16'] and 100 * row['final_vs_bf16'], '+.2f')}%")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _plot(report, args, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  summary = report["summary"]
  rate = summary["rates"][0]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for label, per_seed in report["simulate"]["runs"].items():
    s = summary["codecs"][label]["rates"][str(rate)]["seconds_per_step"]
    if s is None:
      continue
    steps = np.array([e["step"] for e in next(iter(per_seed.values()))["evals"]])
    mean = np.mean([[e["eval_loss"] for e in run["evals"]] for run in per_seed.values()], 0)
    line, = ax.plot(steps * s, mean, label=f"{label} ({s:.2f} s/step)")
    real = report.get("real", {}).get("runs", {}).get(label)
    if real:
      ax.plot([e["wall_s"] for e in real["evals"]], [e["eval_loss"] for e in real["evals"]],
              ls="--", color=line.get_color(), label=f"{label}, real run (seed "
              f"{report['real']['seed']})")
  ax.axhline(np.mean(list(summary["targets"].values())), color="gray", lw=0.8, ls=":",
             label="target")
  ax.set(xlabel=f"wall-clock seconds at {rate:g} Mbit/s (steps x measured s/step)",
         ylabel="eval loss",
         title=f"word LM, {args.workers} workers: eval loss against time "
         f"(mean of {len(report['simulate']['seeds'])} seeds)")
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, "tta_wallclock_tiny.png" if args.tiny else "tta_wallclock.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  try:
    main()
  except (RuntimeError, TimeoutError) as e:  # a failed run: no partial result is reported
    raise SystemExit(f"bench.tta stopped: {e}") from None
