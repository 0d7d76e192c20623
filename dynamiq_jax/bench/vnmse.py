"""vNMSE benchmark: every codec, on synthetic and on real gradients, beside the paper.

    python -m dynamiq_jax.bench.vnmse            # full size: ~30 min on 2 CPU cores
    python -m dynamiq_jax.bench.vnmse --tiny     # smoke test (CI)

Everything runs through :func:`dynamiq_jax.simulate` (the distributed code
under ``vmap``). vNMSE = ||estimate - mean||^2 / ||mean||^2 against the exact
float64 mean. Data:

* ``iid`` / ``heavy``: the paper's synthetic gradient model, the same data as
  the authors' own simulator results (:mod:`dynamiq_jax.bench.reference`);
* ``lm-word`` / ``lm-byte``: real gradients of a small transformer LM trained
  on the Python standard library's source text (:mod:`dynamiq_jax.bench.lm`),
  snapshots at steps 0, 100 and 300, each worker's gradient on its own
  micro-batch. ``lm-word`` has an 8192-token word vocabulary, like the
  paper's LLMs (embedding/output rows of absent tokens make super-group
  magnitudes heavy-tailed); ``lm-byte`` is byte-level (mild dispersion).

Tables: (1) DynamiQ against the authors' reference; (3) every codec at its
bit budget, ring (and butterfly on synthetic), n = 8, like the paper's
Table 3; (4) DynamiQ's budget sweep beside MXFP8 (Table 4); (6) the ablation
ladder (Table 6); (S) vNMSE against n = 2..64 on real gradients and to 1024
on synthetic ones. Stateful codecs (MXFP4's adaptive scale, OmniReduce's
local k) run ``--rounds`` steps and report the mean of the last 4, as the
authors did. Writes ``docs/results/vnmse.json`` and ``vnmse_*.png``.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from dynamiq_jax.bench import common

__all__ = ["main", "codec_table", "ladder"]


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.vnmse",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--d", type=int, default=1 << 20, help="synthetic coordinates per worker")
  p.add_argument("--seeds", type=int, default=2, help="rounding seeds per stateless point")
  p.add_argument("--rounds", type=int, default=60, help="steps for stateful codecs")
  p.add_argument("--scaling-rounds", type=int, default=12,
                 help="steps for stateful codecs in the scaling with n (2^28 coordinates a step "
                 "at large n)")
  p.add_argument("--max-n", type=int, default=1024, help="largest n of the synthetic scaling")
  p.add_argument("--scaling-cells", type=int, default=1 << 28,
                 help="synthetic scaling: n * d at most this (memory); d = min(--d, this / n)")
  p.add_argument("--max-n-real", type=int, default=64,
                 help="largest n of the real-gradient scaling (<= 64)")
  common.add_data_flags(p)
  p.add_argument("--scaling-codecs", default=None,
                 help="comma-separated codec labels: measure the scaling with n for these only "
                 "(default: all; the run then stays complete: false)")
  p.add_argument("--resume", action="store_true",
                 help="continue an interrupted run: keep the points of the results JSON "
                 "(complete: false) measured with the same settings and measure the rest")
  p.add_argument("--render", metavar="JSON", default=None,
                 help="measure nothing: print the tables of an earlier run's JSON and draw its "
                 "plots beside it")
  return p


def _parse(argv):
  return build_parser().parse_args(argv)


N = 8  # workers of the tables (the paper's)


def lm_gradients(cache: str | None, tiny: bool = False):
  """Per-worker gradients of the two small transformer LMs, captured once (cached).

  Returns ``({(tag, step): float32 [workers, d]}, {tag: model info}, steps)``:
  ``N`` workers at every step, and 64 of the word LM's at the last step (for
  the scaling with n). ``tiny``: one small word LM, two steps (CI).
  """
  from dynamiq_jax.bench import lm
  if tiny:
    cfgs = {"lm-word": lm.LMConfig(vocab=1024, seq_len=32, d_model=32, heads=2, layers=1)}
    steps, kw, last_n = (0, 3), dict(train_batch=4, micro_batch=2), 16
  else:
    cfgs = {"lm-word": lm.LMConfig(vocab=8192, layers=2), "lm-byte": lm.LMConfig()}
    steps, kw, last_n = (0, 100, 300), {}, 64
  grads, info = {}, {}
  for tag, cfg in cfgs.items():
    workers = {s: N for s in steps}
    workers[steps[-1]] = last_n if tag == "lm-word" else N
    g, info[tag] = lm.cached_gradients(cache or None, tag, workers, steps, cfg, **kw)
    grads.update({(tag, s): v for s, v in g.items()})
  return grads, info, steps


_NOT_SCALED = ("MXFP8 OCP-E8M0", "THC 120")  # codecs left out of the scaling with n
TINY_CODECS = ("DynamiQ 5b", "MXFP8", "THC 16")
"""--tiny's codecs (tables 3 and scaling): one of each kind of state (none, MX's adaptive
scale, THC's); every codec of the table runs through ``dq.simulate`` in the tests."""


def simulate_rounds(codec, g, *, schedule="ring", seeds=2, rounds=60, mesh_shape=None):
  """``(stateful, [rank 0's result of each round])`` of ``codec`` on ``g`` [n, d].

  Stateless codecs: one round per rounding seed (``seeds``). Stateful codecs
  (MX's adaptive scale, OmniReduce's k) run ``rounds`` steps carrying their
  state.
  """
  import dynamiq_jax as dq
  stateful = codec.stateful
  outs, state = [], None
  for r in range(rounds if stateful else seeds):
    out = dq.simulate(g, codec=codec, schedule=schedule, seed=r, codec_state=state,
                      return_state=stateful, mesh_shape=mesh_shape)
    if stateful:
      out, state = out
    outs.append(np.asarray(out)[0])
  return stateful, outs


def measure(codec, g, *, schedule="ring", seeds=2, rounds=60, mesh_shape=None):
  """vNMSE of ``codec`` on the workers' gradients ``g`` [n, d], through ``simulate``.

  Stateless codecs: the mean over ``seeds`` rounding seeds. Stateful codecs
  run ``rounds`` steps carrying their state; the mean of the last 4
  (:func:`simulate_rounds`).
  """
  from dynamiq_jax.bench.reference import vnmse
  stateful, outs = simulate_rounds(codec, g, schedule=schedule, seeds=seeds, rounds=rounds,
                                   mesh_shape=mesh_shape)
  vals = [vnmse(o, g) for o in outs]
  return float(np.mean(vals[-4:])) if stateful else float(np.mean(vals))


def codec_table():
  """(name, codec, authors' reference key for the ring, for the butterfly)."""
  from dynamiq_jax.codecs import Bf16, DynamiQ, GlobalQSGD, MX, OmniReduce, THC
  return [
      ("DynamiQ 5b", DynamiQ(bits=5.0), "DynamiQ-5b hier+corr (ring)",
       "DynamiQ-5b hier+corr (butterfly)"),
      ("MXFP8", MX(element="e4m3"), "MXFP8 (ring)", "MXFP8 (butterfly)"),
      ("MXFP6", MX(element="e3m2"), "MXFP6 (ring)", None),
      ("MXFP4", MX(element="e2m1"), "MXFP4 (ring, mu converged)", None),
      ("MXFP8 OCP-E8M0", MX(element="e4m3", scale="e8m0"), None, None),
      ("THC 16", THC(levels=16), "THC, L=16 = 4 bit (ring)", None),
      ("THC 120", THC(levels=120), "THC, launcher default L=120 (ring)", None),
      ("OmniReduce", OmniReduce(), "OmniReduce top-k (50% blocks)", None),
      ("Global-QSGD 8", GlobalQSGD(bits=8), None, None),
      ("BF16 ring", Bf16(), None, None),
  ]


def ladder():
  """An ablation ladder in the manner of the paper's Table 6, at 5 bits, rung by rung:
  the rungs the codec's options express (MEE levels and hierarchical scales
  are always on)."""
  from dynamiq_jax.codecs import DynamiQ
  return [
      ("one width (4 bits)", DynamiQ(bits=5.0, widths=(4,), correlated=False)),
      ("+ widths 2, 4, 8", DynamiQ(bits=5.0, widths=(2, 4, 8), correlated=False)),
      ("+ correlated rounding", DynamiQ(bits=5.0, widths=(2, 4, 8))),
      ("+ widths 2..8", DynamiQ(bits=5.0)),
  ]


def render(path: str):
  """Prints the tables of a results JSON and draws its plots in the same folder."""
  import json
  with open(path) as f:
    saved = json.load(f)
  if not saved.get("complete", True):
    print(f"note: {path} is from a run that did not finish (complete: false); "
          f"these are the measurements it saved")
  args = argparse.Namespace(d=saved["d"])
  _print(saved["results"], saved["scaling"], saved["n"], args, saved["lm"],
         saved.get("dataset_stats", {}))
  suffix = "_tiny" if path.endswith("_tiny.json") else ""
  _plot(saved["results"], saved["scaling"], os.path.dirname(os.path.abspath(path)), suffix)
  return saved


def main(argv=None):
  args = _parse(argv)
  if args.render:
    return render(args.render)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dynamiq_jax as dq
  from dynamiq_jax.bench.reference import AUTHORS_ALL_IN_BITS, REFERENCE, paper_model_gradients
  from dynamiq_jax.codecs import DynamiQ
  from dynamiq_jax.codecs.dynamiq import SUPERGROUP
  from tqdm.auto import tqdm

  wanted = None  # --scaling-codecs, checked before anything is measured
  if args.scaling_codecs is not None:
    wanted = {c.strip() for c in args.scaling_codecs.split(",") if c.strip()}
    known = [c[0] for c in codec_table() if c[0] not in _NOT_SCALED]
    if not wanted or wanted - set(known):
      raise SystemExit(f"--scaling-codecs {args.scaling_codecs!r}: unknown "
                       f"{sorted(wanted - set(known))}; choose from {known}")
  out = common.results_dir(args.out)
  suffix = "_tiny" if args.tiny else ""
  path = os.path.join(out, f"vnmse{suffix}.json")
  if args.resume and not os.path.exists(path):
    raise SystemExit(f"--resume: there is no {path} to continue; run without --resume")
  n = N
  if args.tiny:
    args.d, args.seeds, args.rounds, args.max_n = 1 << 14, 1, 2, 4
    args.scaling_rounds = 2
  sizes_syn = [k for k in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if k <= args.max_n]

  data = {("iid", 0): paper_model_gradients("iid", n, args.d, 0),
          ("heavy", 0): paper_model_gradients("heavy", n, args.d, 0)}
  info, scaling_real, lm_steps, sizes_real = {}, None, (0,), []
  if not args.no_real:
    grads, info, lm_steps = lm_gradients(args.cache, args.tiny)
    for (tag, s), g in grads.items():
      if tag == "lm-word" and s == lm_steps[-1]:
        scaling_real = g  # all captured workers, for the scaling with n
        sizes_real = [k for k in (2, 4, 8, 16, 32, 64) if k <= min(len(g), args.max_n_real)]
      g = g[:n]  # the tables are at n workers
      if args.tiny:  # same shape as the synthetic data: compiled code is reused (smoke test only)
        g = np.pad(g[:, :args.d], ((0, 0), (0, max(0, args.d - g.shape[1]))))
      data[(tag, s)] = g
  last = lm_steps[-1]

  def ref(ds, key, seed=0):
    v = REFERENCE.get((ds, n, key)) if key else None
    return None if v is None or args.d != 1 << 20 else v[seed]

  jobs = []
  datasets3 = [k for k in data if k[0] in ("iid", "heavy") or k[0].startswith("lm")]
  if args.tiny:  # one synthetic and one real dataset, ring only: every code path, little time
    datasets3 = [("iid", 0)] + [k for k in datasets3 if k == ("lm-word", last)]
  for name, codec, ring_key, bfly_key in codec_table():
    if args.tiny and name not in TINY_CODECS:
      continue
    for ds in datasets3:
      jobs.append(("table3", name, codec, ds, "ring", ring_key))
      if ds[0] in ("iid", "heavy") and bfly_key and not args.tiny:
        jobs.append(("table3", name, codec, ds, "butterfly", bfly_key))
  for seed in (0, 1) if not args.tiny else ():
    for ds_name in ("iid", "heavy"):
      if (ds_name, seed) not in data:
        data[(ds_name, seed)] = paper_model_gradients(ds_name, n, args.d, seed)
      jobs.append(("table1", f"DynamiQ {AUTHORS_ALL_IN_BITS}b", DynamiQ(bits=AUTHORS_ALL_IN_BITS),
                   (ds_name, seed), "ring", "DynamiQ-5b hier+corr (ring)"))
  for bits in (3.0, 4.0, 5.0, 6.0) if not args.tiny else (4.0, 5.0):
    for ds in datasets3:
      if ds[0].startswith("lm") and ds[1] != last:
        continue
      jobs.append(("table4", f"DynamiQ {bits:g}b", DynamiQ(bits=bits), ds, "ring",
                   f"DynamiQ-{int(bits)}b hier+corr (ring)"))
      if ds[0] in ("iid", "heavy") and not args.tiny:
        jobs.append(("table4", f"DynamiQ {bits:g}b independent", DynamiQ(bits=bits, correlated=False),
                     ds, "ring", None))
  rungs = ladder()
  for name, codec in [rungs[0], rungs[-1]] if args.tiny else rungs:
    for ds in datasets3[:1] if args.tiny else datasets3:
      if ds[0].startswith("lm") and ds[1] != last:
        continue
      jobs.append(("table6", name, codec, ds, "ring", None))

  results, scaling = [], []
  settings = {"n": n, "d": args.d, "rounding_seeds": args.seeds, "stateful_rounds": args.rounds,
              "scaling_rounds": args.scaling_rounds, "scaling_cells": args.scaling_cells}
  resumed_from = None
  if args.resume:
    with open(path) as f:
      earlier = json.load(f)
    if earlier.get("complete", True):
      raise SystemExit(f"--resume: {path} is from a finished run; nothing to resume")
    if {k: earlier.get(k) for k in settings} != settings:
      raise SystemExit(f"--resume: {path} was measured with "
                       f"{ {k: earlier.get(k) for k in settings} }, not {settings}")
    results, scaling = earlier["results"], earlier["scaling"]
    resumed_from = {"command": earlier["command"], "git_commit": earlier["machine"]["git_commit"]}
  done = {(r["table"], r["codec"], r["dataset"], r["step_or_seed"], r["schedule"]) for r in results}
  done_scaling = {(r["dataset"], r["codec"], r["n"]) for r in scaling}

  # What decides how the codecs compare on a dataset: how much of it is exactly zero
  # (embedding rows of tokens absent from a micro-batch), and how far the workers'
  # gradients are from their mean (noise, which every hop re-quantises).
  stats = {f"{ds}@{s}": {
      "zero_fraction": float(np.mean(data[(ds, s)] == 0)),
      "worker_norm_over_mean_norm": float(np.linalg.norm(data[(ds, s)], axis=1).mean()
                                          / np.linalg.norm(data[(ds, s)].mean(0)))}
      for ds, s in datasets3}

  def save(complete):
    """Writes what is measured so far: an interrupted run keeps its finished tables."""
    return common.write_json(path, {
        "command": common.command_line(), "machine": common.machine(), "complete": complete,
        "resumed_from": resumed_from, **settings,
        "lm": info, "dataset_stats": stats, "results": results, "scaling": scaling},
        strict=args.strict)

  jobs = [j for j in jobs if (j[0], j[1], j[3][0], j[3][1], j[4]) not in done]
  for table, name, codec, ds, schedule, key in tqdm(jobs, desc="vNMSE"):
    g = data[ds]
    v = measure(codec, g, schedule=schedule, seeds=args.seeds, rounds=args.rounds)
    bits = dq.wire_stats(g[0], codec=codec, n=n).bits_per_coord
    authors = ref(ds[0], key, ds[1]) if ds[0] in ("iid", "heavy") else None
    results.append({"table": table, "codec": name, "dataset": ds[0], "step_or_seed": ds[1],
                    "schedule": schedule, "n": int(g.shape[0]), "bits_per_coord": bits, "vnmse": v,
                    "authors": authors, "ratio_to_authors": v / authors if authors else None})
    save(False)

  # Scaling with n.
  scale_codecs = [c for c in codec_table() if c[0] not in _NOT_SCALED]
  if args.tiny:
    scale_codecs = [c for c in scale_codecs if c[0] in TINY_CODECS]
    sizes_syn, sizes_real = [n], [n]  # the shapes of table 3: its compiled code is reused
  # Synthetic: d = 2^20 per worker while n * d fits --scaling-cells, then d shrinks
  # (2^18 at n = 1024: one super-group per ring chunk). A ring chunk holds d / n
  # coordinates, and DynamiQ's widths are shared out in whole super-groups per chunk,
  # so a small d at a large n measures the rounding of a few super-groups, not
  # the codec (at d = 2^16 and n = 64 each chunk held only 4 of them).
  d_syn = {k: args.d if args.tiny else max(SUPERGROUP, min(args.d, args.scaling_cells // k)
                                           // SUPERGROUP * SUPERGROUP) for k in sizes_syn}
  syn = {d: paper_model_gradients("iid", max(k for k in sizes_syn if d_syn[k] == d), d, 3)
         for d in sorted(set(d_syn.values()))}
  # by n, then codec: an interrupted run has every codec at the smaller n
  scale_jobs = [("iid", k, c) for k in sizes_syn for c in scale_codecs]
  if scaling_real is not None:
    scale_jobs += [("lm-word", k, c) for k in sizes_real for c in scale_codecs]
  scale_jobs = [j for j in scale_jobs if (j[0], j[2][0], j[1]) not in done_scaling]
  partial = False
  if wanted is not None:
    partial = any(j[2][0] not in wanted for j in scale_jobs)
    scale_jobs = [j for j in scale_jobs if j[2][0] in wanted]
  for ds, k, (name, codec, _, _) in tqdm(scale_jobs, desc="vNMSE vs n"):
    g = syn[d_syn[k]][:k] if ds == "iid" else scaling_real[:k]
    try:
      v = measure(codec, g, seeds=args.seeds, rounds=args.scaling_rounds)
      bits = dq.wire_stats(g[0], codec=codec, n=k).bits_per_coord
    except ValueError as e:  # a codec that cannot run at this n says why
      scaling.append({"dataset": ds, "codec": name, "n": k, "d": int(g.shape[1]), "vnmse": None,
                      "reason": str(e)[:200]})
    else:
      scaling.append({"dataset": ds, "codec": name, "n": k, "d": int(g.shape[1]), "vnmse": v,
                      "bits_per_coord": bits})
    save(False)

  _print(results, scaling, n, args, info, stats)
  save(not partial)
  _plot(results, scaling, out, suffix)
  print(f"wrote {path}")
  return results, scaling


def _fmt(v):
  return "-" if v is None else f"{v:.3e}"


def _print(results, scaling, n, args, info, stats):
  print(f"\nvNMSE, n={n}, synthetic d={args.d}; LM gradients: "
        + ", ".join(f"{k}: {v['params']:,} params" for k, v in info.items()))
  for k, v in stats.items():
    print(f"  {k:<12} exactly zero: {v['zero_fraction']:6.1%}   "
          f"|worker gradient| / |mean gradient|: {v['worker_norm_over_mean_norm']:.2f}")
  rows = [r for r in results if r["table"] == "table1"]
  if rows:
    print("\n(1) DynamiQ at the authors' all-in rate vs their 'DynamiQ-5b hier+corr (ring)'")
    for r in rows:
      print(f"  {r['dataset']:<6} data seed {r['step_or_seed']}: ours {r['vnmse']:.3e} "
            f"({r['bits_per_coord']:.3f} b)  authors {_fmt(r['authors'])}  "
            f"ratio {r['ratio_to_authors'] or float('nan'):.2f}")
  t3 = [r for r in results if r["table"] == "table3"]
  cols = sorted({(r["dataset"], r["step_or_seed"], r["schedule"]) for r in t3},
                key=lambda c: (c[0].startswith("lm"), c))
  print("\n(3) every codec at its budget (bits/coord measured on the wire); authors' value in []")
  head = f"  {'codec':<16}{'bits':>6}" + "".join(
      f"{(ds + ('@' + str(s) if ds.startswith('lm') else '') + (' bfly' if sch == 'butterfly' else '')):>22}"
      for ds, s, sch in cols)
  print(head)
  for name in dict.fromkeys(r["codec"] for r in t3):
    line = f"  {name:<16}"
    first = next(r for r in t3 if r["codec"] == name)
    line += f"{first['bits_per_coord']:>6.2f}"
    for c in cols:
      r = next((r for r in t3 if r["codec"] == name and (r["dataset"], r["step_or_seed"],
                                                         r["schedule"]) == c), None)
      cell = "" if r is None else (_fmt(r["vnmse"]) + (f" [{r['authors']:.2e}]" if r["authors"] else ""))
      line += f"{cell:>22}"  # "9.311e-04 [1.44e-03]" is 20 wide: keep a gap
    print(line)
  for ds, s, sch in cols:
    if sch != "ring":
      continue
    cell = {r["codec"]: r["vnmse"] for r in t3 if (r["dataset"], r["step_or_seed"],
                                                   r["schedule"]) == (ds, s, sch)}
    ratios = ", ".join(f"/ {name}: {cell['MXFP8'] / cell[name]:.2f}x"
                       for name in ("DynamiQ 5b",) if name in cell)
    print(f"  MXFP8 on {ds}{'@' + str(s) if ds.startswith('lm') else ''} {ratios} "
          f"(paper, real LLM gradients: 2.5-3.1x)")
  print("\n(4) budget sweep, ring")
  for r in [r for r in results if r["table"] == "table4"]:
    print(f"  {r['dataset']:<8}{r['step_or_seed']!s:>4} {r['codec']:<26} {r['bits_per_coord']:.3f} b "
          f"{r['vnmse']:.3e}  authors {_fmt(r['authors'])}")
  print("\n(6) ablation ladder (paper: 0.128 -> 0.071 -> 0.020 -> 0.014 -> 0.009, LLaMA chat)")
  for r in [r for r in results if r["table"] == "table6"]:
    print(f"  {r['dataset']:<8}{r['step_or_seed']!s:>4} {r['codec']:<24} {r['bits_per_coord']:.3f} b "
          f"{r['vnmse']:.3e}")
  print("\n(S) vNMSE against n (ring)")
  for ds in dict.fromkeys(s["dataset"] for s in scaling):
    ns = sorted({s["n"] for s in scaling if s["dataset"] == ds})
    ds_d = {s["n"]: s.get("d") for s in scaling if s["dataset"] == ds}
    print(f"  {ds}: n = {ns}")
    if any(ds_d.values()):  # older results did not record d
      print(f"    {'d':<16}" + " ".join(f"{_fmt_d(ds_d[k]):>10}" for k in ns))
    for name in dict.fromkeys(s["codec"] for s in scaling if s["dataset"] == ds):
      vals = [next((_fmt(s["vnmse"]) for s in scaling if s["dataset"] == ds and s["codec"] == name
                    and s["n"] == k), "-") for k in ns]
      print(f"    {name:<16}" + " ".join(f"{v:>10}" for v in vals))


def _fmt_d(d):
  if not d:
    return "-"
  e = int(np.log2(d))
  return f"2^{e}" if d == 1 << e else str(d)


def _plot(results, scaling, out, suffix):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  t4 = [r for r in results if r["table"] == "table4" and "independent" not in r["codec"]]
  t3 = [r for r in results if r["table"] == "table3" and r["schedule"] == "ring"]
  dsets = list(dict.fromkeys(r["dataset"] for r in t4))
  fig, axes = plt.subplots(1, len(dsets), figsize=(4 * len(dsets), 3.5), squeeze=False)
  for ax, ds in zip(axes[0], dsets):
    pts = sorted((r["bits_per_coord"], r["vnmse"]) for r in t4 if r["dataset"] == ds)
    ax.semilogy(*zip(*pts), "-o", label="DynamiQ")
    for r in t3:
      if r["dataset"] == ds and r["step_or_seed"] == max(q["step_or_seed"] for q in t3 if q["dataset"] == ds) \
          and r["codec"] != "DynamiQ 5b" and r["bits_per_coord"] <= 17:
        ax.semilogy(r["bits_per_coord"], r["vnmse"], "x")
        ax.annotate(r["codec"], (r["bits_per_coord"], r["vnmse"]), fontsize=6)
    ax.set_title(ds)
    ax.set_xlabel("bits/coordinate")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("vNMSE (ring, n=8)")
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"vnmse_budget{suffix}.png"), dpi=110)
  plt.close(fig)

  dsets = list(dict.fromkeys(s["dataset"] for s in scaling))
  fig, axes = plt.subplots(1, len(dsets), figsize=(5 * len(dsets), 3.8), squeeze=False)
  for ax, ds in zip(axes[0], dsets):
    for name in dict.fromkeys(s["codec"] for s in scaling if s["dataset"] == ds):
      pts = [(s["n"], s["vnmse"]) for s in scaling if s["dataset"] == ds and s["codec"] == name
             and s["vnmse"] is not None]
      if pts:
        ax.loglog(*zip(*pts), "-o", markersize=3, label=name)
    ns = sorted({s["n"] for s in scaling if s["dataset"] == ds})
    d_of = {s["n"]: s.get("d") for s in scaling if s["dataset"] == ds}
    varies = len(set(d_of.values())) > 1  # say where d shrinks to fit memory
    ax.set_xticks(ns, [f"{k}\n{_fmt_d(d_of[k])}" if varies else str(k) for k in ns])
    ax.minorticks_off()
    same_d = "" if varies or not d_of[ns[0]] else f", d = {_fmt_d(d_of[ns[0]])}"
    ax.set_title(f"{ds}: vNMSE vs n (ring{same_d})")
    ax.set_xlabel("n (and d, coordinates per rank)" if varies else "n")
    ax.grid(True, which="both", alpha=0.3)
  axes[0][0].set_ylabel("vNMSE")
  axes[0][-1].legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(os.path.join(out, f"vnmse_scaling{suffix}.png"), dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
