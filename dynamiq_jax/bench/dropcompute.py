"""DropCompute against synchronous steps, with BF16 psum and with DynamiQ, over shaped links.

    sudo python -m dynamiq_jax.bench.dropcompute          # the full run (about 40 min, 2 cores)
    python -m dynamiq_jax.bench.dropcompute --tiny        # smoke test (CI)

``--workers`` processes, each in its own network namespace behind a
``tc``-shaped link (:mod:`dynamiq_jax.bench.netns`; plain loopback without
root, which the output says), train the word LM of the time-to-accuracy
benchmark (:mod:`dynamiq_jax.bench.tta`: the same model, data and
evaluation) with gradient accumulation: each worker's
``--batch`` sequences per step are ``--micro-batches`` micro-batches, one
jitted call each, under :func:`dynamiq_jax.dropcompute_step`.

The noise model, injected per micro-batch on the host (a sleep before the
micro-batch's compute, counted in its time like any slowness): a delay of
``--delay-ms`` on average drawn from a log-normal distribution with
``sigma = --sigma`` (mean 1; heavy-tailed, like the delays the paper's
reference implementation injects), and the last worker persistently slow,
its delays ``--slow-factor`` times longer. Delays are drawn from
``(--noise-seed, step, worker, micro-batch)``, so every configuration
meets the same ones.

Phases, in one group of processes, the configurations of a phase
interleaved step by step (step ``s`` of each in turn), so that a change in
the machine's load falls on all of them alike:

1. ``train``: with noise, every codec x {synchronous, DropCompute (threshold
   "auto")} trains from the same initialisation on the same data stream for
   the same ``--steps`` steps under the same AdamW schedule (the
   time-to-accuracy benchmark's: a linear warm-up, then a cosine decay to
   ``lr / 10`` at the last step). A DropCompute step averages over the
   micro-batches that ran, so its run sees fewer samples: that is its cost,
   and the final eval loss shows it. (``--equal-samples`` instead runs
   DropCompute on until it has finished as many micro-batches as the
   synchronous run, its extra steps at the schedule's final rate: the same
   samples in more updates.) The clock runs
   over steps only (evaluations excluded), a step's time being its slowest
   process's, from a common barrier. Target: the synchronous BF16 run's
   smoothed eval loss at ``--target-at`` of its run; time to accuracy
   (TTA): the clock at the first evaluation at or below it; final quality:
   the last evaluation's loss.
2. ``quiet``: without noise, ``--quiet-steps`` steps of each: what
   DropCompute costs when nothing straggles.
3. ``scaling``: groups of each ``--scaling-workers`` count (plus the main
   one, from phase 1) time ``--scaling-steps`` noisy steps of
   ``--scaling-codec``, synchronous and DropCompute: throughput (finished
   micro-batches per second, over the steps after DropCompute's warm-up)
   against the number of workers (the synchronous runs here have an
   infinite threshold: DropCompute's program, so a group compiles one), and
   beyond the measured counts modelled from the micro-batch times measured
   in phase 1 (resampled per worker, the slow worker kept slow) and from a
   Gaussian (central-limit) model of them, against the paper's analysis.

Writes ``docs/results/dropcompute.json`` (with the machine's load average at
the start and the end), ``dropcompute.png`` and ``dropcompute.md`` (the
tables; ``dropcompute_equal_samples.*`` with ``--equal-samples``). ``--from-json PATH`` recomputes a results file's
summary, table and plot from its stored runs, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench import harness
from dynamiq_jax.bench.dropcompute_report import BASELINE, MODELS, MODES
from dynamiq_jax.bench.dropcompute_report import markdown, model_scaling, plot, run_key, summarize

__all__ = ["main", "noise_delays", "summarize", "markdown", "model_scaling", "MODELS"]

PHASES = ("train", "quiet", "scaling")


# ---------------------------------------------------------------------------
# the noise model


def noise_delays(cfg: dict, step: int, rank: int) -> np.ndarray:
  """Injected delays (seconds) of ``rank``'s micro-batches at ``step`` (the module's model)."""
  m = cfg["micro_batches"]
  if not cfg["noise"]["delay_ms"]:
    return np.zeros(m)
  sigma = cfg["noise"]["sigma"]
  z = np.random.default_rng([cfg["noise"]["seed"], step, rank]).standard_normal(m)
  delay = cfg["noise"]["delay_ms"] / 1e3 * np.exp(sigma * z - sigma**2 / 2)  # mean delay_ms
  if rank == cfg["workers"] - 1:
    delay = delay * cfg["noise"]["slow_factor"]
  return delay


# ---------------------------------------------------------------------------
# worker side


class _Worker:
  """One process: the LM, its data, and a DropCompute step per (codec, mode)."""

  def __init__(self, cfg: dict, mesh):
    import jax

    self.cfg, self.mesh = cfg, mesh
    self.n, self.rank = mesh.shape["data"], jax.process_index()
    # tta's Trainer: the LM, its data, and label's all-reduce before AdamW with a linear
    # warm-up and a cosine decay to lr / 10 at cfg["steps"] (held there after)
    self.trainers = {label: harness.Trainer(cfg, mesh, label) for label in cfg["labels"]}

  def micro_batches(self, trainer, seed: int, step: int, noise: bool):
    """``fetch(m)``: this worker's micro-batch ``m`` of ``step`` (the rows tta's Trainer
    gives this rank), after its injected delay."""
    cfg = self.cfg
    rng = np.random.default_rng([seed, step])  # tta.Trainer.batch's windows
    length = trainer.lcfg.seq_len + 1
    starts = rng.integers(0, trainer.train_tokens.size - length, self.n * cfg["batch"])
    mine = starts[self.rank * cfg["batch"]:(self.rank + 1) * cfg["batch"]]
    per = cfg["batch"] // cfg["micro_batches"]
    delays = noise_delays(dict(cfg, workers=self.n), step, self.rank) if noise else None

    def fetch(m):
      if delays is not None:
        time.sleep(delays[m])
      window = trainer.train_tokens[mine[m * per:(m + 1) * per, None] + np.arange(length)]
      return window[:, :-1], window[:, 1:]

    return fetch

  def step_fn(self, label: str, mode: str):
    import dynamiq_jax as dq

    tr = self.trainers[label]
    cfg = self.cfg
    # sync: DropCompute off (today's step); in the scaling groups an infinite threshold
    # instead, which runs DropCompute's program, so that a group compiles one per codec
    off = math.inf if cfg.get("sync_counted") else None
    policy = dq.DropCompute(threshold=off) if mode == "sync" else dq.DropCompute(
        warmup_steps=cfg["policy"]["warmup_steps"],
        reestimate_every=cfg["policy"]["reestimate_every"],
        probe_steps=cfg["policy"]["probe_steps"])
    return dq.dropcompute_step(tr.loss, tr.tx, mesh=self.mesh,
                               micro_batches=cfg["micro_batches"], policy=policy)

  def run(self, configs: list, *, noise: bool, steps: int, evaluate: bool, equal_samples: bool,
          sync) -> dict:
    """Trains every ``(label, mode)`` of ``configs`` from seed ``cfg['seed']``, interleaved:
    step ``s`` of each in turn (the order rotating), so that a change in the machine's load
    falls on all of them alike.

    A run takes ``steps`` steps; with ``equal_samples`` a DropCompute run goes on until it
    has finished as many micro-batches as ``steps`` full steps hold (at most twice as many
    steps). Returns ``{"label|mode": what the driver needs}``.
    """
    seed = self.cfg["seed"]
    budget = steps * self.n * self.cfg["micro_batches"]
    runs = []
    for label, mode in configs:
      tr = self.trainers[label]
      params, opt = tr.init(seed)
      out = {"step_s": [], "times": [], "threshold_s": [], "finished": [], "loss": [],
             "evals": []}
      if evaluate:
        loss0, digest0 = tr.evaluate(params)
        out["evals"].append({"step": 0, "eval_loss": loss0, "digest": digest0,
                             "micro_batches": 0})
      until = 2 * steps if equal_samples and mode != "sync" else steps
      runs.append({"tr": tr, "step": self.step_fn(label, mode), "params": params, "opt": opt,
                   "out": out, "seen": 0, "until": until, "done": False})
    s = 0
    while not all(r["done"] for r in runs):
      active = [r for r in runs if not r["done"]]
      for i in range(len(active)):
        run = active[(s + i) % len(active)]
        fetch = self.micro_batches(run["tr"], seed, s, noise)
        sync()
        run["params"], run["opt"], loss, stats = run["step"](run["params"], run["opt"], fetch)
        out = run["out"]
        out["step_s"].append(stats.step_s)
        out["times"].append([None if math.isnan(t) else t for t in stats.times[self.rank]])
        out["threshold_s"].append(None if math.isinf(stats.threshold_s) else stats.threshold_s)
        out["finished"].append(stats.finished_per_worker.tolist())
        out["loss"].append(loss)
        run["seen"] += stats.finished  # the same on every process: they stop together
      s += 1
      for run in active:
        last = s == run["until"] or (run["until"] > steps and run["seen"] >= budget)
        run["done"] = last
        if evaluate and (s % self.cfg["eval_every"] == 0 or last):
          value, digest = run["tr"].evaluate(run["params"])
          run["out"]["evals"].append({"step": s, "eval_loss": value, "digest": digest,
                                      "micro_batches": run["seen"]})
    return {run_key(label, mode): run["out"] for (label, mode), run in zip(configs, runs)}


def _worker(cfg: dict, rank: int, coordinator: str) -> None:
  from dynamiq_jax.bench.netns import driver_commands, join_job

  mesh, say, sync = join_job(cfg, rank, coordinator, barrier="dropcompute-step")
  worker = _Worker(cfg, mesh)
  everything = [(label, mode) for label in cfg["labels"] for mode in MODES]
  worker.run(everything, noise=False, steps=1, evaluate=True, equal_samples=False,
             sync=sync)  # compile, on the unshaped links
  say("READY", {"rank": rank})
  for cmd in driver_commands("run", usage="run <noise 0|1> <steps> <evaluate 0|1> <equal "
                                            "samples 0|1> <label index>:<mode> ..."):
    configs = [(cfg["labels"][int(c.split(":")[0])], c.split(":")[1]) for c in cmd[5:]]
    res = worker.run(configs, noise=cmd[1] == "1", steps=int(cmd[2]), evaluate=cmd[3] == "1",
                     equal_samples=cmd[4] == "1", sync=sync)
    say("RESULT", {"rank": rank, "runs": res})


# ---------------------------------------------------------------------------
# driver side: running


def _merge(per_rank: list) -> dict:
  """One run from every rank's RESULT: a step takes its slowest process's time."""
  n = len(per_rank)
  first = per_rank[0]
  steps = len(first["step_s"])
  step_s = [max(r["step_s"][s] for r in per_rank) for s in range(steps)]
  times = [[per_rank[r]["times"][s] for r in range(n)] for s in range(steps)]
  finished = [int(sum(f)) for f in first["finished"]]
  agree = all(r["finished"] == first["finished"] and r["threshold_s"] == first["threshold_s"]
              for r in per_rank)
  agree &= all(r["evals"][i]["digest"] == e["digest"] for r in per_rank
               for i, e in enumerate(first["evals"]))
  wall = np.cumsum(step_s)
  evals = [{"step": e["step"], "eval_loss": e["eval_loss"], "micro_batches": e["micro_batches"],
            "wall_s": float(wall[e["step"] - 1]) if e["step"] else 0.0}
           for e in first["evals"]]
  return {"step_s": step_s, "times": times, "finished": finished,
          "finished_per_worker": first["finished"], "threshold_s": first["threshold_s"],
          "loss": first["loss"], "evals": evals, "ranks_agree": bool(agree)}


def _group(args, cfg: dict, workers: int, labels: list, plan: list, shaped: bool) -> dict:
  """Spawns ``workers`` processes and runs ``plan``: ``[(phase, noise, steps, evaluate,
  equal_samples, [(label, mode), ...])]``, each phase's configurations interleaved step by
  step (see :meth:`_Worker.run`).

  Returns ``{phase: {"label|mode": merged run}}``.
  """
  from dynamiq_jax.bench.netns import worker_job

  wcfg = dict(cfg, workers=workers, labels=labels, heartbeat_s=args.heartbeat_s)
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(wcfg, f)
    cfg_path = f.name
  out = {}
  try:
    with worker_job("dynamiq_jax.bench.dropcompute", workers, cfg_path,
                    shaped=shaped) as (job, net):
      t0 = time.monotonic()
      job.wait_lines("READY ", timeout=args.timeout)
      print(f"  {workers} workers ready after {time.monotonic() - t0:.0f} s", flush=True)
      if net:
        net.set_rate(args.rate)
      for phase, noise, steps, evaluate, equal_samples, configs in plan:
        t0 = time.monotonic()
        names = " ".join(f"{labels.index(label)}:{mode}" for label, mode in configs)
        job.send(f"run {int(noise)} {steps} {int(evaluate)} {int(equal_samples)} {names}")
        per_rank = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
        runs = out[phase] = {key: _merge([r["runs"][key] for r in per_rank])
                             for key in per_rank[0]["runs"]}
        print(f"  {workers} workers, {phase} ({'noise' if noise else 'no noise'}), "
              f"interleaved [{time.monotonic() - t0:.0f} s]:", flush=True)
        for key, run in runs.items():
          fin = sum(run["finished"]) / (len(run["finished"]) * workers * cfg["micro_batches"])
          tail = (f"; final eval loss {run['evals'][-1]['eval_loss']:.4f}" if run["evals"]
                  else "")
          print(f"    {key.replace('|', ' '):<24} {len(run['step_s'])} steps, "
                f"{np.mean(run['step_s']):.3f} s/step, drop rate {1 - fin:.3f}{tail}",
                flush=True)
      job.send("quit")
      job.wait(timeout=120)
  finally:
    os.unlink(cfg_path)
  return out


def _stamp() -> dict:
  return {"command": common.command_line(), "machine": common.machine()}


# ---------------------------------------------------------------------------
# command line


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default); ``tiny``: --tiny's defaults."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.dropcompute",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--phases", default=",".join(PHASES),
                 help="comma-separated, of " + ", ".join(PHASES))
  p.add_argument("--codecs", default="BF16 psum,DynamiQ 5b",
                 help="comma-separated tta labels; 'BF16 psum' is the baseline")
  p.add_argument("--workers", type=int, default=4, help="worker processes of the main group")
  p.add_argument("--steps", type=int, default=80, help="training steps of each noisy run")
  p.add_argument("--batch", type=int, default=8, help="sequences per worker per step")
  p.add_argument("--micro-batches", type=int, default=8,
                 help="micro-batches per worker per step (dividing --batch)")
  p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
  p.add_argument("--warmup", type=int, default=20, help="warm-up steps (then cosine to lr/10)")
  p.add_argument("--equal-samples", action="store_true",
                 help="train: DropCompute runs go on until they have finished as many "
                      "micro-batches as the synchronous runs, at the schedule's final rate "
                      "(more updates); writes dropcompute_equal_samples.json")
  p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the data")
  p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
  p.add_argument("--eval-windows", type=int, default=64, help="held-out sequences evaluated")
  p.add_argument("--smooth", type=int, default=3, help="evaluations in the moving average")
  p.add_argument("--target-at", type=float, default=0.8,
                 help="target = synchronous BF16's smoothed eval loss at this fraction of its run")
  p.add_argument("--rate", type=float, default=100.0, help="link rate in Mbit/s")
  p.add_argument("--delay-ms", type=float, default=100.0,
                 help="mean injected delay per micro-batch (log-normal)")
  p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the delays")
  p.add_argument("--slow-factor", type=float, default=3.0,
                 help="the last worker's delays are this many times longer")
  p.add_argument("--noise-seed", type=int, default=0, help="seed of the injected delays")
  p.add_argument("--warmup-steps", type=int, default=5,
                 help="DropCompute: full steps measured before the first threshold")
  p.add_argument("--reestimate-every", type=int, default=40,
                 help="DropCompute: steps between re-estimates of the threshold")
  p.add_argument("--probe-steps", type=int, default=2,
                 help="DropCompute: full steps measured per re-estimate")
  p.add_argument("--quiet-steps", type=int, default=20, help="timed steps of each without noise")
  p.add_argument("--scaling-workers", type=int, nargs="*", default=[2, 8],
                 help="further worker counts timed for the throughput plot")
  p.add_argument("--scaling-steps", type=int, default=25, help="timed noisy steps per count")
  p.add_argument("--scaling-codec", default="DynamiQ 5b", help="the codec of the scaling phase")
  p.add_argument("--model-workers", type=int, nargs="+",
                 default=[2, 4, 8, 16, 32, 64, 128, 256],
                 help="worker counts of the modelled throughput curves")
  common.add_process_flags(
      p, heartbeat_s=60, timeout=3600,
      timeout_help="seconds any one command of a group may take before it is stopped")
  p.add_argument("--tiny", action="store_true",
                 help="smoke test: 2 workers, a tiny LM, a few steps")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  p.add_argument("--from-json", default=None, metavar="PATH",
                 help="measure nothing: recompute the summary, table and plot of the runs "
                      "stored in PATH (a results file of this benchmark) and write them back")
  if tiny:
    p.set_defaults(workers=2, steps=10, batch=4, micro_batches=4, warmup=2, eval_every=2,
                   eval_windows=4, smooth=1, rate=200.0, delay_ms=5.0, slow_factor=4.0,
                   warmup_steps=3, reestimate_every=5, quiet_steps=3, scaling_workers=[],
                   model_workers=[2, 4, 16])
  return p


def _parse(argv):
  argv = sys.argv[1:] if argv is None else list(argv)
  p = build_parser(tiny="--tiny" in argv)
  args = p.parse_args(argv)
  if args.worker is not None:
    return args
  labels = [c[0] for c in harness.CODECS]
  split = lambda s: [x.strip() for x in s.split(",") if x.strip()]
  args.phases, args.codecs = split(args.phases), split(args.codecs)
  for ph in args.phases:
    if ph not in PHASES:
      p.error(f"--phases: unknown phase {ph!r}; choose from {', '.join(PHASES)}")
  for c in args.codecs + [args.scaling_codec]:
    if c not in labels:
      p.error(f"--codecs/--scaling-codec: unknown codec {c!r}; choose from {', '.join(labels)}")
  if BASELINE[0] not in args.codecs:
    p.error(f"--codecs must include {BASELINE[0]!r}: the target is its synchronous run's")
  if args.scaling_codec not in args.codecs:
    p.error(f"--scaling-codec {args.scaling_codec!r} must be one of --codecs (its noisy "
            f"training run is the scaling plot's main point)")
  if "scaling" in args.phases and "train" not in args.phases:
    p.error("--phases: scaling needs train (its main point and its model come from there)")
  if args.workers < 2 or any(w < 2 for w in args.scaling_workers):
    p.error(f"--workers={args.workers}, --scaling-workers={args.scaling_workers}: an "
            f"all-reduce needs at least 2 workers")
  if args.micro_batches < 1 or args.batch % args.micro_batches:
    p.error(f"--micro-batches={args.micro_batches} must be >= 1 and divide "
            f"--batch={args.batch}")
  if args.steps < args.eval_every:
    p.error(f"--steps={args.steps} must be at least --eval-every={args.eval_every}")
  if not 0 < args.target_at <= 1:
    p.error(f"--target-at must be in (0, 1]; got {args.target_at}")
  if args.delay_ms < 0 or args.sigma < 0 or args.slow_factor < 0:
    p.error(f"--delay-ms={args.delay_ms}, --sigma={args.sigma}, --slow-factor="
            f"{args.slow_factor}: the noise model's parameters must be >= 0")
  if args.rate <= 0:
    p.error(f"--rate={args.rate} must be > 0 Mbit/s")
  return args


def _config(args) -> dict:
  return {"model": dict(harness.TINY_MODEL if args.tiny else harness.MODEL),
          "workers": args.workers,
          "batch": args.batch, "micro_batches": args.micro_batches, "steps": args.steps,
          "eval_every": args.eval_every, "eval_windows": args.eval_windows, "lr": args.lr,
          "warmup": args.warmup, "schedule": "warm-up, then cosine to lr / 10 at --steps",
          "equal_samples": args.equal_samples, "seed": args.seed, "rate_mbit": args.rate,
          "noise": {"delay_ms": args.delay_ms, "sigma": args.sigma,
                    "slow_factor": args.slow_factor, "seed": args.noise_seed,
                    "model": "per micro-batch, a sleep of delay_ms x exp(sigma Z - sigma^2/2), "
                             "Z standard normal (mean delay_ms); the last worker's delays "
                             "x slow_factor"},
          "policy": {"warmup_steps": args.warmup_steps, "reestimate_every": args.reestimate_every,
                     "probe_steps": args.probe_steps},
          "scaling_codec": args.scaling_codec, "model_workers": args.model_workers}


def main(argv=None):
  args = _parse(argv)
  if common.run_worker(args, _worker):
    return None
  if args.from_json:
    return _resummarize(args)
  from dynamiq_jax.bench.netns import shaping

  cfg = _config(args)
  shaped = shaping(args.no_shaping)
  out_dir = common.results_dir(args.out)
  stem = "dropcompute" + ("_equal_samples" if args.equal_samples else "") + (
      "_tiny" if args.tiny else "")
  path = os.path.join(out_dir, stem + ".json")
  report = {"benchmark": "dropcompute", "config": cfg, "shaped": shaped,
            "link_model": (f"each worker's veth into a bridge namespace rate limited with tc tbf "
                           f"to {args.rate:g} Mbit/s in both directions" if shaped else
                           "plain loopback, no shaping (the rate is a label)"), **_stamp()}
  started = time.monotonic()
  load_start = list(os.getloadavg())
  everything = [(c, mode) for c in args.codecs for mode in MODES]
  main_plan = []
  if "train" in args.phases:
    main_plan.append(("train", True, args.steps, True, args.equal_samples, everything))
  if "quiet" in args.phases:
    main_plan.append(("quiet", False, args.quiet_steps, False, False, everything))
  if main_plan:
    print(f"main group: {args.workers} workers", flush=True)
    for phase, runs in _group(args, cfg, args.workers, args.codecs, main_plan,
                              shaped).items():
      report[phase] = {"runs": runs}
  if "scaling" in args.phases:
    report["scaling"] = {"runs": {}}
    for w in args.scaling_workers:
      print(f"scaling group: {w} workers", flush=True)
      plan = [("scaling", True, args.scaling_steps, False, False,
               [(args.scaling_codec, mode) for mode in MODES])]
      runs = _group(args, dict(cfg, sync_counted=True), w, [args.scaling_codec], plan,
                    shaped)["scaling"]
      report["scaling"]["runs"][str(w)] = {key.split("|")[1]: run for key, run in runs.items()}
  report["load_average"] = {"start": load_start, "end": list(os.getloadavg())}
  report["summary"] = summarize(report, args)
  report["wall_s"] = time.monotonic() - started
  table, png = _write(report, path, strict=args.strict)
  print("\n" + table)
  print(f"\nwrote {path} and {png} in {report['wall_s'] / 60:.1f} min\nmachine: "
        f"{report['machine']['platform']}, {report['machine']['cpu_count']} CPUs; "
        f"links: {report['link_model']}\nreproduce: {report['command']}")
  return report


def _write(report: dict, path: str, *, strict: bool = False) -> tuple[str, str]:
  """Writes the report to ``path``, its plot and its tables (Markdown, with the command,
  commit and machine) beside it; returns ``(tables, plot path)``. ``strict``: not on a
  busy machine (:func:`common.write_json`)."""
  common.write_json(path, report, strict=strict)
  stem = os.path.splitext(path)[0]
  table = markdown(report["summary"])
  if report["summary"]:
    plot(report, report["summary"], stem + ".png")
  m = report["machine"]
  again = ""
  if report.get("summarized"):
    again = (f" Summary, tables and plot recomputed from the stored runs (nothing measured) "
             f"by `{report['summarized']['command']}` at commit "
             f"{report['summarized']['machine'].get('git_commit')}.")
  with open(stem + ".md", "w") as f:
    f.write(f"Measured by `{report['command']}` at commit {m.get('git_commit')} on "
            f"{m.get('platform')}, {m.get('cpu_count')} CPUs; links: {report.get('link_model')}."
            f"{again}\n\n{table}\n")
  return table, stem + ".png"


def _resummarize(args) -> dict:
  """``--from-json``: the summary, table and plot again from stored runs (no measuring);
  the report keeps its measuring command and machine and records this one beside them."""
  with open(args.from_json) as f:
    report = json.load(f)
  if report.get("benchmark") != "dropcompute":
    raise SystemExit(f"--from-json {args.from_json}: not a results file of this benchmark")
  stored = report.get("summary", {}).get("train", {})  # the stored run's target
  args.target_at = stored.get("target_at", args.target_at)
  args.smooth = stored.get("smooth", args.smooth)
  report["summary"] = summarize(report, args)
  report["summarized"] = _stamp()
  table, png = _write(report, args.from_json)
  print(table)
  print(f"\nrewrote the summary of {args.from_json} and {png} (measured by: "
        f"{report['command']}, commit {report['machine'].get('git_commit')})")
  return report


if __name__ == "__main__":
  try:
    main()
  except (RuntimeError, TimeoutError) as e:  # a failed run: no partial result is reported
    raise SystemExit(f"bench.dropcompute stopped: {e}") from None
