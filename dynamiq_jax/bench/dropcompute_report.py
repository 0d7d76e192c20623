"""What :mod:`dynamiq_jax.bench.dropcompute`'s runs show: per-run statistics, the
summary against the synchronous BF16 run, the modelled scaling, the tables and the plot.

Pure functions of a results file's runs, so ``--from-json`` recomputes them
without measuring anything.
"""

from __future__ import annotations

import math

import numpy as np

from dynamiq_jax.bench import harness

__all__ = ["MODES", "MODELS", "BASELINE", "QUALITY_TOLERANCE", "run_key", "run_stats",
           "summarize", "model_scaling", "markdown", "plot"]

MODES = ("sync", "dropcompute")
MODELS = {"empirical": "measured times", "gaussian": "Gaussian",
          "empirical_iid": "measured, no slow worker", "gaussian_iid": "Gaussian, no slow worker"}
BASELINE = ("BF16 psum", "sync")
# the issue's quality criterion: a DropCompute run's final eval loss within this fraction of its
# synchronous run's
QUALITY_TOLERANCE = 0.005


def run_stats(run: dict, cfg: dict, workers: int, skip: int = 0) -> dict:
  """Seconds per step, drop rate and throughput of a run (over steps ``skip`` onwards)."""
  step_s = np.asarray(run["step_s"][skip:])
  finished = np.asarray(run["finished"][skip:])
  planned = workers * cfg["micro_batches"]
  thresholds = [t for t in run["threshold_s"][skip:] if t is not None]
  return {"seconds_per_step": float(step_s.mean()), "median_step_s": float(np.median(step_s)),
          "micro_batches": int(finished.sum()),
          "drop_rate": float(1 - finished.sum() / (finished.size * planned)),
          "throughput": float(finished.sum() / step_s.sum()),
          "threshold_s_median": float(np.median(thresholds)) if thresholds else None,
          "steps": int(step_s.size)}


def _full_times(run: dict) -> np.ndarray:
  """``[steps, n, M]`` micro-batch times of the steps in which every one ran."""
  t = np.asarray([[[np.nan if x is None else x for x in w] for w in s] for s in run["times"]],
                 np.float64)
  return t[np.all(np.isfinite(t), axis=(1, 2))]


def _comm_s(run: dict) -> float:
  """Median over full steps of (step time - slowest worker's compute)."""
  full = [s for s, f in enumerate(run["times"]) if all(x is not None for w in f for x in w)]
  gaps = [run["step_s"][s] - max(sum(w) for w in run["times"][s]) for s in full]
  return float(np.median(gaps)) if gaps else 0.0


def summarize(report: dict, args) -> dict:
  """The tables: TTA and quality with noise, cost without, throughput against workers."""
  cfg = report["config"]
  n = cfg["workers"]
  out = {}
  train = report.get("train")
  if train:
    runs = train["runs"]
    base = runs[run_key(*BASELINE)]
    target = harness.target_of(base, args.target_at, args.smooth)
    rows = {}
    for key, run in runs.items():
      label, mode = key.split("|")
      k = harness.steps_to_target(run, target, args.smooth)
      t = None if k is None else next(e["wall_s"] for e in run["evals"] if e["step"] == k)
      rows[key] = {"codec": label, "mode": mode, **run_stats(run, cfg, n),
                   "steps_to_target": k, "tta_s": t,
                   "final_eval_loss": run["evals"][-1]["eval_loss"],
                   "wall_s": float(np.sum(run["step_s"])), "ranks_agree": run["ranks_agree"]}
    for key, row in rows.items():
      sync = rows[run_key(row["codec"], "sync")]
      row["final_vs_sync"] = row["final_eval_loss"] / sync["final_eval_loss"] - 1
      row["speedup_vs"] = {other: (rows[other]["tta_s"] / row["tta_s"]
                                   if row["tta_s"] and rows[other]["tta_s"] else None)
                           for other in rows}
    out["train"] = {"target": target, "target_at": args.target_at, "smooth": args.smooth,
                    "equal_samples": bool(cfg.get("equal_samples")), "rows": rows}
  quiet = report.get("quiet")
  if quiet:
    rows = {key: {"codec": key.split("|")[0], "mode": key.split("|")[1],
                  **run_stats(run, cfg, n)} for key, run in quiet["runs"].items()}
    for row in rows.values():
      sync = rows[run_key(row["codec"], "sync")]
      row["vs_sync"] = row["seconds_per_step"] / sync["seconds_per_step"]
    out["quiet"] = {"rows": rows}
  scaling = report.get("scaling")
  if scaling and train:
    out["scaling"] = _scaling_summary(report, cfg)
  return out


def run_key(label: str, mode: str) -> str:
  return f"{label}|{mode}"


def _scaling_summary(report, cfg) -> dict:
  skip = cfg["policy"]["warmup_steps"]
  label = cfg["scaling_codec"]
  measured = {}
  sources = dict(report["scaling"]["runs"])
  sources[str(cfg["workers"])] = {mode: report["train"]["runs"][run_key(label, mode)]
                                  for mode in MODES}
  for workers, runs in sorted(sources.items(), key=lambda kv: int(kv[0])):
    sync = run_stats(runs["sync"], cfg, int(workers), skip)
    dc = run_stats(runs["dropcompute"], cfg, int(workers), skip)
    measured[workers] = {"sync_throughput": sync["throughput"],
                         "dropcompute_throughput": dc["throughput"],
                         "speedup": dc["throughput"] / sync["throughput"],
                         "drop_rate": dc["drop_rate"], "threshold_s": dc["threshold_s_median"],
                         "sync_seconds_per_step": sync["seconds_per_step"],
                         "dropcompute_seconds_per_step": dc["seconds_per_step"]}
  base_run = report["train"]["runs"][run_key(label, "sync")]
  model = model_scaling(_full_times(base_run), _comm_s(base_run), cfg["model_workers"],
                        seed=cfg["seed"])
  return {"codec": label, "measured": measured, "model": model}


def model_scaling(times: np.ndarray, comm_s: float, workers: list, *, seed: int = 0,
                  measured_steps: int = 20, eval_steps: int = 200) -> dict:
  """Throughput against the number of workers, modelled from measured micro-batch times.

  ``times [steps, n, M]`` are full steps of the main run; its last worker is
  the persistently slow one. For ``w`` workers: ``w - 1`` ordinary workers
  whose micro-batch times are drawn from the pooled times of the ordinary
  measured workers, and one slow worker drawn from the slow one's, with a
  constant ``comm_s`` per step.

  * ``empirical``: the threshold chosen (:func:`dynamiq_jax.choose_threshold`)
    on ``measured_steps`` drawn steps, the throughputs evaluated on
    ``eval_steps`` fresh ones.
  * ``gaussian``: the central-limit model the paper's analysis uses: each
    micro-batch time normal with the measured mean and standard deviation
    (ordinary and slow workers separately), so a worker's compute over
    ``M`` micro-batches is normal with ``M`` times the mean and variance;
    the same choice and evaluation on draws from it.
  * ``empirical_iid``, ``gaussian_iid``: the same without the slow worker
    (all ``w`` drawn like the ordinary ones): the paper's setting of
    independent, identically distributed workers, where the synchronous
    step grows with the expected maximum of ``w`` compute times.
  """
  import dynamiq_jax as dq
  from dynamiq_jax.training.dropcompute import throughput

  rng = np.random.default_rng(seed)
  m = times.shape[-1]
  ordinary = times[:, :-1].ravel()
  slow = times[:, -1].ravel()

  def empirical(steps, w, straggler=True):
    t = rng.choice(ordinary, size=(steps, w, m))
    if straggler:
      t[:, -1] = rng.choice(slow, size=(steps, m))
    return t

  def gaussian(steps, w, straggler=True):
    t = rng.normal(ordinary.mean(), ordinary.std(), size=(steps, w, m))
    if straggler:
      t[:, -1] = rng.normal(slow.mean(), slow.std(), size=(steps, m))
    return np.maximum(t, 0.0)

  iid = lambda draw: lambda steps, w: draw(steps, w, straggler=False)

  out = {"workers": list(workers), "comm_s": comm_s,
         "ordinary_mean_s": float(ordinary.mean()), "ordinary_std_s": float(ordinary.std()),
         "slow_mean_s": float(slow.mean()), "slow_std_s": float(slow.std())}
  for name, draw in (("empirical", empirical), ("gaussian", gaussian),
                     ("empirical_iid", iid(empirical)), ("gaussian_iid", iid(gaussian))):
    rows = []
    for w in workers:
      choice = dq.choose_threshold(draw(measured_steps, w), comm_s=comm_s)
      fresh = draw(eval_steps, w)
      sync = throughput(fresh, None, comm_s=comm_s)[0]
      dc, drop = throughput(fresh, choice.threshold_s, comm_s=comm_s)
      rows.append({"workers": w, "sync_throughput": sync, "dropcompute_throughput": dc,
                   "speedup": dc / sync, "drop_rate": drop, "threshold_s": choice.threshold_s})
    out[name] = rows
  return out


# ---------------------------------------------------------------------------
# driver side: output


def _fmt(x, spec):
  return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _quality_line(train: dict) -> str:
  """Whether each DropCompute run ends within :data:`QUALITY_TOLERANCE` of its synchronous
  run's final eval loss, and at what it was compared (equal steps or equal samples)."""
  rows = [r for r in train["rows"].values() if r["mode"] == "dropcompute"]
  sync_steps = sorted({r["steps"] for r in train["rows"].values() if r["mode"] == "sync"})
  if train.get("equal_samples"):
    how = ("at equal samples (DropCompute runs on until it has finished the synchronous "
           "run's micro-batches, in more steps)")
  else:
    how = (f"at equal steps ({', '.join(map(str, sync_steps))} each; DropCompute finishes "
           f"fewer micro-batches)")
  verdicts = [f"{r['codec']} + DropCompute {100 * r['final_vs_sync']:+.2f}%: "
              + ("met" if abs(r["final_vs_sync"]) <= QUALITY_TOLERANCE else "not met")
              for r in rows]
  return (f"Final eval loss within {100 * QUALITY_TOLERANCE:.1f}% of its synchronous run's, "
          f"{how}: " + "; ".join(verdicts) + ".")


def markdown(summary: dict) -> str:
  """The result tables in Markdown (docs/dropcompute.md's)."""
  lines = []
  train = summary.get("train")
  if train:
    dq_sync = run_key("DynamiQ 5b", "sync")
    lines += ["| all-reduce | step | steps | micro-batches | s / step | drop rate | "
              "micro-batches / s | time to target | vs BF16 sync | vs DynamiQ sync | "
              "final eval loss | vs its sync |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in train["rows"].items():
      tta_cell = "-" if r["tta_s"] is None else f"{r['tta_s']:.0f} s (step {r['steps_to_target']})"
      lines.append(
          f"| {r['codec']} | {r['mode']} | {r['steps']} | {r['micro_batches']} | "
          f"{r['seconds_per_step']:.2f} s | "
          f"{100 * r['drop_rate']:.1f}% | {r['throughput']:.1f} | {tta_cell} | "
          f"{_fmt(r['speedup_vs'].get(run_key(*BASELINE)), '.2f')}x | "
          f"{_fmt(r['speedup_vs'].get(dq_sync), '.2f')}x | {r['final_eval_loss']:.4f} | "
          f"{100 * r['final_vs_sync']:+.2f}% |")
    lines += ["", _quality_line(train)]
  quiet = summary.get("quiet")
  if quiet:
    lines += ["", "| all-reduce, no noise | step | s / step | drop rate | vs sync |",
              "|---|---|---|---|---|"]
    for r in quiet["rows"].values():
      lines.append(f"| {r['codec']} | {r['mode']} | {r['seconds_per_step']:.3f} s | "
                   f"{100 * r['drop_rate']:.1f}% | {r['vs_sync']:.3f}x |")
  scaling = summary.get("scaling")
  if scaling:
    model = {r["workers"]: r for r in scaling["model"]["empirical"]}
    gauss = {r["workers"]: r for r in scaling["model"]["gaussian"]}
    lines += ["", f"| workers ({scaling['codec']}) | sync micro-batches / s | DropCompute | "
              "speed-up | drop rate | modelled speed-up | Gaussian model |",
              "|---|---|---|---|---|---|---|"]
    for w, r in scaling["measured"].items():
      mo, ga = model.get(int(w)), gauss.get(int(w))
      lines.append(f"| {w} | {r['sync_throughput']:.1f} | {r['dropcompute_throughput']:.1f} | "
                   f"{r['speedup']:.2f}x | {100 * r['drop_rate']:.1f}% | "
                   f"{_fmt(mo and mo['speedup'], '.2f')}x | {_fmt(ga and ga['speedup'], '.2f')}x |")
    names = [n for n in MODELS if n in scaling["model"]]
    lines += ["", "| workers, modelled | " + " | ".join(
        f"{MODELS[n]}: speed-up (drop rate)" for n in names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for i, w in enumerate(scaling["model"]["workers"]):
      cells = [scaling["model"][n][i] for n in names]
      lines.append(f"| {w} | " + " | ".join(
          f"{c['speedup']:.2f}x ({100 * c['drop_rate']:.0f}%)" for c in cells) + " |")
  return "\n".join(lines)


def plot(report, summary, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  panels = [p for p in ("train", "scaling") if p in summary]
  panels += ["speedup"] if "scaling" in summary else []
  fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
  for ax, panel in zip(axes[0], panels):
    if panel == "train":
      for key, run in report["train"]["runs"].items():
        ax.plot([e["wall_s"] for e in run["evals"]], [e["eval_loss"] for e in run["evals"]],
                ls="-" if key.endswith("dropcompute") else "--", label=key.replace("|", ", "))
      ax.axhline(summary["train"]["target"], color="gray", lw=0.8, ls=":", label="target")
      ax.set(xlabel="wall-clock seconds (steps only)", ylabel="eval loss",
             title=f"word LM, {report['config']['workers']} workers, with noise")
    elif panel == "speedup":  # DropCompute over synchronous, measured and modelled
      sc = summary["scaling"]
      ax.plot([int(k) for k in sc["measured"]], [r["speedup"] for r in sc["measured"].values()],
              "ko", label="measured")
      for (name, label), ls in zip(MODELS.items(), ("-", ":", "-", ":")):
        if name in sc["model"]:
          ax.plot(sc["model"]["workers"], [r["speedup"] for r in sc["model"][name]], ls,
                  color="C2" if name.endswith("iid") else "C1", lw=1, label=f"model, {label}")
      ax.axhline(1.0, color="gray", lw=0.8)
      ax.set_xscale("log")
      ax.set_xticks(sc["model"]["workers"], [str(t) for t in sc["model"]["workers"]])
      ax.minorticks_off()
      ax.set(xlabel="workers", ylabel="throughput, DropCompute / synchronous",
             title="speed-up against workers")
    else:  # per worker: a synchronous step's straggler wall shows as a falling line
      sc = summary["scaling"]
      for mode, color in (("sync", "C0"), ("dropcompute", "C1")):
        w = [int(k) for k in sc["measured"]]
        ax.plot(w, [r[f"{mode}_throughput"] / int(k) for k, r in sc["measured"].items()], "o",
                color=color, label=f"{mode}, measured")
        for name, ls in (("empirical", "-"), ("gaussian", ":")):
          rows = sc["model"][name]
          ax.plot([r["workers"] for r in rows],
                  [r[f"{mode}_throughput"] / r["workers"] for r in rows], ls, color=color,
                  lw=1, label=f"{mode}, model ({name})")
      ticks = sorted({int(k) for k in sc["measured"]} | set(sc["model"]["workers"]))
      ax.set_xscale("log")
      ax.set_xticks(ticks, [str(t) for t in ticks])
      ax.minorticks_off()
      ax.set(xlabel="workers", ylabel="finished micro-batches per second, per worker",
             title=f"throughput against workers ({sc['codec']})")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
