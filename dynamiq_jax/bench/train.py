"""Training benchmark: final quality and time-to-accuracy of every codec against BF16.

    python -m dynamiq_jax.bench.train                  # 3 examples x 8 codecs x 3 seeds
    python -m dynamiq_jax.bench.train --examples digits --seeds 0,1,2
    python -m dynamiq_jax.bench.train --tiny           # smoke test (CI)

It trains the programs in ``examples/`` (shipped in the wheel as
``dynamiq_jax.examples``: ``nnx_digits``, ``nnx_char_lm``, ``linen_pmap``) through their
``train_and_evaluate`` on 8 simulated CPU devices (every local GPU when there
are several), once per codec and seed, with everything else equal.

Quality: the final test accuracy (digits) or held-out loss (char LM) of each
codec, mean +- std over seeds, and the mean relative to BF16 (``psum-bf16``).

Time-to-accuracy, with the model printed beside the table:

* target, per seed: the train loss (moving average over ``--smooth`` steps)
  that the BF16 run of that seed reaches at ``--target-at`` of its run
  (paired: the same initialisation and data order);
* steps to target: the first step at which a run's smoothed train loss is at
  or below its seed's target ("-" when a run never reaches it);
* seconds per step = compute + communication. Communication is the bytes each
  rank really sends per step (``dynamiq_jax.wire_stats``; a ring all-reduce
  of bf16 for ``psum-bf16``) over a link of ``--link-gbps``. Compute is the
  measured median step time of the BF16 run of the same example and seed
  (``model`` column): on simulated CPU devices the codec arithmetic of all
  ranks shares the host's cores, so a codec run's own step time measures the
  simulation, not a GPU (``bench.kernels`` measures the kernels). The
  ``own`` column uses each run's own measured step time instead, for
  completeness.

Writes ``docs/results/train.json`` and ``train_<example>.png`` (loss curves).
Examples already in ``train.json`` and not run again are kept, each with the
command and machine that measured it. Within an example run again, codecs of
the earlier run that ``--codecs`` leaves out are kept too when the new BF16
runs are bit-identical to the earlier ones (so a changed codec can be
re-measured alone); every codec row records the command and commit that
measured it (``measured_by``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os

import numpy as np

__all__ = ["main", "CODECS", "EXAMPLES", "steps_to_target", "smooth"]

# (label, registry name, bits, more config overrides). docs/results/train.json also
# holds, from an earlier run, "DynamiQ 5b static cal": the static-capacity codec this
# library had before, fitted to the first batch.
CODECS = (
    ("BF16 psum", "psum-bf16", None, {}),
    ("DynamiQ 5b", "dynamiq", 5.0, {}),
    ("DynamiQ 4b", "dynamiq", 4.0, {}),
    ("MXFP8", "mxfp8", None, {}),
    ("MXFP6", "mxfp6", None, {}),
    ("MXFP4", "mxfp4", None, {}),
    ("THC", "thc", None, {}),
    ("OmniReduce", "omnireduce", None, {}),
)

# name -> (module, quality metric, higher is better, tiny-size overrides)
EXAMPLES = {
    "digits": ("dynamiq_jax.examples.nnx_digits", "test_accuracy", True,
               dict(steps=6, eval_every=3, batch_size=64)),
    "char_lm": ("dynamiq_jax.examples.nnx_char_lm", "eval_loss", False,
                dict(steps=4, eval_every=2, dim=32, heads=2, layers=1, context=16,
                     batch_size=16, corpus_bytes=200_000, eval_windows=16, warmup_steps=1)),
    "linen_pmap": ("dynamiq_jax.examples.linen_pmap", "test_accuracy", True,
                   dict(steps=6, eval_every=3, batch_size=64)),
}


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.train",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated, of "
                 + ", ".join(EXAMPLES))
  p.add_argument("--codecs", default=None,
                 help="comma-separated labels (unset: all; --tiny: BF16 psum, DynamiQ 5b, "
                 "MXFP4), of: " + ", ".join(c[0] for c in CODECS))
  p.add_argument("--seeds", default=None, help="comma-separated seeds (unset: 0,1,2; --tiny: 0)")
  p.add_argument("--steps", type=int, default=None,
                 help="override every example's steps (unset: each example's own)")
  p.add_argument("--link-gbps", default="100,1",
                 help="link rates (Gbit/s) of the time-to-accuracy model; the first is the "
                 "headline (100, as in the paper)")
  p.add_argument("--target-at", type=float, default=0.8,
                 help="target = BF16's smoothed train loss at this fraction of its run")
  p.add_argument("--smooth", type=int, default=20, help="moving-average window of the train loss")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  return p


def _parse(argv):
  p = build_parser()
  args = p.parse_args(argv)
  if args.codecs is None:
    args.codecs = "BF16 psum,DynamiQ 5b,MXFP4" if args.tiny else ",".join(c[0] for c in CODECS)
  if args.seeds is None:
    args.seeds = "0" if args.tiny else "0,1,2"
  labels = {c[0]: c for c in CODECS}
  args.examples = [e.strip() for e in args.examples.split(",") if e.strip()]
  args.codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
  for e in args.examples:
    if e not in EXAMPLES:
      p.error(f"--examples: unknown example {e!r}; choose from {', '.join(EXAMPLES)}")
  for c in args.codecs:
    if c not in labels:
      p.error(f"--codecs: unknown codec {c!r}; choose from {', '.join(labels)}")
  if "BF16 psum" not in args.codecs:
    p.error("--codecs must include 'BF16 psum': every figure is relative to it")
  args.codecs = [labels[c] for c in args.codecs]
  args.seeds = [int(s) for s in args.seeds.split(",")]
  args.link_gbps = [float(r) for r in args.link_gbps.split(",")]
  if not 0 < args.target_at <= 1:
    p.error(f"--target-at must be in (0, 1]; got {args.target_at}")
  return args


def smooth(losses, window: int) -> np.ndarray:
  """Trailing moving average (shorter window at the start)."""
  x = np.asarray(losses, np.float64)
  c = np.concatenate([[0.0], np.cumsum(x)])
  i = np.arange(1, len(x) + 1)
  lo = np.maximum(0, i - window)
  return (c[i] - c[lo]) / (i - lo)


def steps_to_target(curve, target: float) -> int | None:
  """1-based step at which ``curve`` first reaches ``target`` (None: never)."""
  hit = np.nonzero(np.asarray(curve) <= target)[0]
  return int(hit[0]) + 1 if hit.size else None


def _mean_std(values):
  v = np.asarray([x for x in values if x is not None], np.float64)
  if v.size == 0:
    return None, None
  return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _fmt(x, spec):
  return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def main(argv=None):
  args = _parse(argv)
  from dynamiq_jax.examples import devices as ex_devices  # examples/, shipped in the wheel

  devices = ex_devices.select_devices(None)  # before anything else starts JAX
  from dynamiq_jax.bench import common
  from tqdm.auto import tqdm

  report = {"machine": common.machine(), "command": common.command_line(),
            "model": {"target": f"per seed, the BF16 run's smoothed train loss at "
                                f"{args.target_at:g} of its run",
                      "smooth_window": args.smooth, "link_gbps": args.link_gbps,
                      "workers": len(devices),
                      "seconds_per_step": "compute + bytes_per_rank_per_step * 8 / link rate; "
                      "compute 'model' = BF16 run's measured median step time (same example "
                      "and seed), 'own' = the run's own measured median step time"},
            "examples": {}}
  out_dir = common.results_dir(args.out)
  path = os.path.join(out_dir, "train.json")
  # Examples measured by earlier invocations stay, each with its own command and machine.
  report["examples"] = _earlier_examples(path)
  runs = {}
  jobs = [(e, c, s) for e in args.examples for c in args.codecs for s in args.seeds]
  with tqdm(total=len(jobs), desc="training runs") as bar:
    for example in args.examples:  # results are written after each example
      module, *_, tiny = EXAMPLES[example]
      config_lib = importlib.import_module(module + ".config")
      train = importlib.import_module(module + ".train")
      for label, name, bits, extra in args.codecs:
        for seed in args.seeds:
          overrides = dict(codec=name, bits=bits, seed=seed, progress=False, devices=len(devices),
                           **extra)
          if args.tiny:
            overrides.update(tiny)
          if args.steps:
            overrides["steps"] = args.steps
          runs[(example, label, seed)] = train.train_and_evaluate(
              config_lib.get_config(**overrides))
          bar.update()
      measured_by = _origin(report)
      codecs, provenance = list(args.codecs), {c[0]: measured_by for c in args.codecs}
      for codec, origin in _reuse_earlier(example, report["examples"].get(example), args, runs):
        codecs.append(codec)
        provenance[codec[0]] = origin
      order = [c[0] for c in CODECS]
      codecs.sort(key=lambda c: order.index(c[0]))
      summary = _summarise(example, args, runs, codecs)
      for label, entry in summary["codecs"].items():
        entry["measured_by"] = provenance[label]
      report["examples"][example] = {**summary, "command": report["command"],
                                     "machine": report["machine"], "model": report["model"]}
      _print(example, report["examples"][example], args, report["model"])
      _plot(example, args, runs, out_dir, codecs)
      common.write_json(path, report)
  print(f"\nwrote {path}\nmachine: {report['machine']['platform']}, "
        f"{report['machine']['device_count']} {report['machine']['backend']} devices; "
        f"reproduce: {report['command']}")
  return report


def _earlier_examples(path: str) -> dict:
  """The examples of an existing ``train.json``, each tagged with the run that measured it."""
  import json
  try:
    with open(path) as f:
      earlier = json.load(f)
  except FileNotFoundError:
    return {}
  examples = earlier.get("examples", {})
  for entry in examples.values():
    for key in ("command", "machine", "model"):
      entry.setdefault(key, earlier.get(key))
  return examples


def _origin(record) -> dict:
  """``measured_by`` of a report (or example entry): its command, commit and date."""
  machine = record.get("machine") or {}
  return {"command": record.get("command"), "git_commit": machine.get("git_commit"),
          "date": machine.get("date")}


def _reuse_earlier(example, earlier, args, runs):
  """Codecs of an earlier run of ``example`` that this run did not repeat, if still valid.

  They are kept only when this run's BF16 runs are bit-identical to the
  earlier ones (same seeds, steps and final-state hashes): then the targets
  and data order are the same, and each kept codec's stored per-seed curves,
  quality, bytes and step times give its row exactly as if it had been run
  again (its time-to-accuracy is recomputed with this run's BF16 step
  times). Adds their per-seed records to ``runs``; returns ``[(codec tuple,
  measured_by)]``.
  """
  if not earlier or "BF16 psum" not in earlier.get("codecs", {}):
    return []
  ran = {c[0] for c in args.codecs}
  left = [label for label in earlier["codecs"] if label not in ran]
  if not left:
    return []
  old = earlier["codecs"]["BF16 psum"]
  new_sha = [runs[(example, "BF16 psum", s)]["state_sha256"] for s in args.seeds]
  new_steps = len(runs[(example, "BF16 psum", args.seeds[0])]["train_loss"])
  if ([c["seed"] for c in old["curves"]] != list(args.seeds) or earlier.get("steps") != new_steps
      or old.get("state_sha256") != new_sha):
    print(f"{example}: dropping the earlier results of {', '.join(left)}: this run's BF16 "
          "runs differ from theirs (seeds, steps or final state), so their targets would not "
          "match; run them again with --codecs")
    return []
  known = {c[0] for c in CODECS}
  origin_default = _origin(earlier)
  kept = []
  for label in left:
    if label not in known:
      continue
    c = earlier["codecs"][label]
    for i, seed in enumerate(args.seeds):
      runs[(example, label, seed)] = {
          "final": {earlier["metric"]: c["quality"][i]},
          "train_loss": c["curves"][i]["train_loss"], "evals": c["curves"][i]["evals"],
          "timing": {"median_step_time_s": c["median_step_time_s"][i]},
          "wire": {"bits_per_coord": c["bits_per_coord"],
                   "bytes_per_rank_per_step": c["bytes_per_rank_per_step"]},
          "reducer": {"options": c["options_used"][i]}, "state_sha256": c["state_sha256"][i]}
    kept.append(((label, c["reducer"], c["bits_option"], c["overrides"]),
                 c.get("measured_by") or origin_default))
  return kept


def _summarise(example, args, runs, codecs) -> dict:
  _, metric, higher, _ = EXAMPLES[example]
  bf16 = [runs[(example, "BF16 psum", s)] for s in args.seeds]
  steps = len(bf16[0]["train_loss"])
  at = max(1, min(steps, round(args.target_at * steps)))
  # paired targets: each seed's runs chase the BF16 run of the same seed (same data
  # order and initialisation), so seed-to-seed spread does not decide who "arrives"
  targets = [float(smooth(m["train_loss"], args.smooth)[at - 1]) for m in bf16]
  bf16_quality = float(np.mean([m["final"][metric] for m in bf16]))
  out = {"metric": metric, "higher_is_better": higher, "steps": steps,
         "target_loss": float(np.mean(targets)), "target_loss_per_seed": targets,
         "target_step_bf16": at, "codecs": {}}
  for label, name, bits, extra in codecs:
    ms = [runs[(example, label, s)] for s in args.seeds]
    quality = [m["final"][metric] for m in ms]
    q_mean, q_std = _mean_std(quality)
    to_target = [steps_to_target(smooth(m["train_loss"], args.smooth), t)
                 for m, t in zip(ms, targets)]
    wire = ms[0]["wire"]
    tta = {}
    for rate in args.link_gbps:
      comm = wire["bytes_per_rank_per_step"] * 8 / (rate * 1e9)
      for kind in ("model", "own"):
        secs = []
        for m, b, k in zip(ms, bf16, to_target):
          compute = (b if kind == "model" else m)["timing"]["median_step_time_s"]
          secs.append(None if k is None else k * (compute + comm))
        mean, std = _mean_std(secs)
        tta[f"{kind}@{rate:g}"] = {"seconds_mean": mean, "seconds_std": std,
                                   "reached": sum(s is not None for s in secs),
                                   "comm_s_per_step": comm}
    out["codecs"][label] = {
        "reducer": name, "bits_option": bits, "overrides": extra,
        "options_used": [m["reducer"]["options"] for m in ms], "bits_per_coord": wire["bits_per_coord"],
        "bytes_per_rank_per_step": wire["bytes_per_rank_per_step"],
        "quality": quality, "quality_mean": q_mean, "quality_std": q_std,
        "quality_vs_bf16": q_mean / bf16_quality if q_mean is not None else None,
        "steps_to_target": to_target,
        "median_step_time_s": [m["timing"]["median_step_time_s"] for m in ms],
        "tta": tta,
        "state_sha256": [m["state_sha256"] for m in ms],
        "curves": [{"seed": sd, "train_loss": m["train_loss"], "evals": m["evals"]}
                   for sd, m in zip(args.seeds, ms)],
    }
  return out


def _print(example, summary, args, model):
  metric = summary["metric"]
  rate = args.link_gbps[0]
  print(f"\n== {example}: final {metric}, {len(args.seeds)} seeds "
        f"({'higher' if summary['higher_is_better'] else 'lower'} is better), "
        f"{summary['steps']} steps ==")
  print(f"time-to-accuracy target: each seed's BF16 smoothed train loss at step "
        f"{summary['target_step_bf16']} (mean {summary['target_loss']:.4f}); "
        f"seconds/step = {model['seconds_per_step']}")
  head = (f"{'codec':<17} {'bits':>6} {metric + ' mean+-std':>22} {'vs BF16':>8} "
          f"{'steps->tgt':>11}" + "".join(f" {'TTA ' + k + ' [s]':>16}"
                                          for k in (f"model@{r:g}G" for r in args.link_gbps))
          + f" {'TTA own@' + format(rate, 'g') + 'G':>14}")
  print(head)
  for label, c in summary["codecs"].items():
    k_mean, _ = _mean_std(c["steps_to_target"])
    row = (f"{label:<17} {_fmt(c['bits_per_coord'], '6.2f')} "
           f"{_fmt(c['quality_mean'], '.4f'):>12} +- {_fmt(c['quality_std'], '.4f'):<6} "
           f"{_fmt(c['quality_vs_bf16'] and 100 * c['quality_vs_bf16'], '7.2f')}% "
           f"{_fmt(k_mean, '7.1f'):>7}({sum(k is not None for k in c['steps_to_target'])}/"
           f"{len(c['steps_to_target'])})")
    for r in args.link_gbps:
      t = c["tta"][f"model@{r:g}"]
      row += f" {_fmt(t['seconds_mean'], '16.2f')}"
    row += f" {_fmt(c['tta'][f'own@{rate:g}']['seconds_mean'], '14.2f')}"
    print(row)


def _plot(example, args, runs, out_dir, codecs):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  _, metric, _, _ = EXAMPLES[example]
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
  for label, *_ in codecs:
    ms = [runs[(example, label, s)] for s in args.seeds]
    curves = np.stack([smooth(m["train_loss"], args.smooth) for m in ms])
    ax.plot(np.arange(1, curves.shape[1] + 1), curves.mean(0), label=label)
    steps = [e["step"] for e in ms[0]["evals"]]
    vals = np.mean([[e[metric] for e in m["evals"]] for m in ms], axis=0)
    bx.plot(steps, vals, marker="o", label=label)
  ax.set(xlabel="step", ylabel=f"train loss (moving average, {args.smooth} steps)",
         yscale="log", title=f"{example}: train loss, mean of {len(args.seeds)} seeds")
  bx.set(xlabel="step", ylabel=metric, title=f"{example}: {metric}")
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out_dir, f"train_{example}.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


if __name__ == "__main__":
  main()
