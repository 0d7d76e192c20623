"""vNMSE benchmark: DynamiQ against the authors' own simulator on the same data.

    python -m dynamiq_jax.bench.vnmse            # full size (d = 2^20, n = 8), ~1 min on 2 cores
    python -m dynamiq_jax.bench.vnmse --tiny     # smoke test

Runs :func:`dynamiq_jax.simulate` (the distributed code under ``vmap``) on
the paper's synthetic gradient model (:mod:`dynamiq_jax.bench.reference`),
ring, n = 8, and prints:

1. DynamiQ at the authors' all-in bit rate (5.1) and at the default 5.0,
   beside the authors' "5-bit hierarchical + correlated" result;
2. the budget sweep 3..6 bits, correlated and independent rounding, beside
   the authors' 4- and 6-bit points.

Writes ``docs/results/vnmse_dynamiq.json`` and ``vnmse_dynamiq.png``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

__all__ = ["main"]


def _parse(argv):
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.vnmse")
  p.add_argument("--d", type=int, default=1 << 20, help="coordinates per worker")
  p.add_argument("--n", type=int, default=8, help="workers")
  p.add_argument("--seeds", type=int, default=2, help="rounding seeds averaged per point")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  p.add_argument("--out", default=None, help="results directory (default docs/results)")
  return p.parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dynamiq_jax as dq
  from dynamiq_jax.bench import common
  from dynamiq_jax.bench.reference import (AUTHORS_ALL_IN_BITS, AUTHORS_STATS_BITS,
                                           AUTHORS_WIRE_BITS, REFERENCE,
                                           paper_model_gradients, vnmse)
  from dynamiq_jax.codecs import DynamiQ
  from tqdm.auto import tqdm

  if args.tiny:
    args.d, args.seeds = 1 << 14, 1
  n, d = args.n, args.d
  data = {}

  def grads(ds, seed):
    if (ds, seed) not in data:
      data[(ds, seed)] = paper_model_gradients(ds, n, d, seed)
    return data[(ds, seed)]

  def measure(codec, ds, seed):
    g = grads(ds, seed)
    vals = [vnmse(np.asarray(dq.simulate(g, codec=codec, seed=s))[0], g)
            for s in range(args.seeds)]
    return float(np.mean(vals)), float(np.std(vals))

  def ref(ds, method, seed):
    v = REFERENCE.get((ds, n, method))
    return None if v is None or d != 1 << 20 else v[seed]

  jobs = []
  for ds in ("iid", "heavy"):
    for seed in (0, 1):
      for bits in (AUTHORS_ALL_IN_BITS, 5.0):
        jobs.append(("reference", ds, seed, bits, True))
  for ds in ("iid", "heavy"):
    for bits in (3.0, 4.0, 5.0, 6.0):
      for corr in (True, False):
        jobs.append(("budget", ds, 0, bits, corr))
  results = []
  for table, ds, seed, bits, corr in tqdm(jobs, desc="vNMSE"):
    codec = DynamiQ(bits=bits, correlated=corr)
    mean, std = measure(codec, ds, seed)
    results.append({"table": table, "dataset": ds, "data_seed": seed, "bits": bits,
                    "correlated": corr, "vnmse": mean, "std_over_seeds": std,
                    "bits_per_coord": codec.layout(d, n).bits_per_coord})

  print(f"\nDynamiQ vNMSE, ring, n={n}, d={d}, {args.seeds} rounding seed(s) per point")
  print("1. Against the authors' simulator ('DynamiQ-5b hier+corr (ring)', ~5.1 bits all-in)")
  print(f"{'data':<6} {'seed':>4} {'budget':>6} {'our bits':>8} {'ours':>10} {'authors':>10} {'ratio':>6}")
  for r in results:
    if r["table"] != "reference":
      continue
    a = ref(r["dataset"], "DynamiQ-5b hier+corr (ring)", r["data_seed"])
    r["authors"] = a
    ratio = f"{r['vnmse'] / a:.2f}x" if a else "-"
    print(f"{r['dataset']:<6} {r['data_seed']:>4} {r['bits']:>6.2f} {r['bits_per_coord']:>8.3f} "
          f"{r['vnmse']:>10.3e} {a if a else float('nan'):>10.3e} {ratio:>6}")
  print("\n2. Budget sweep (data seed 0); authors' hier+corr points where they exist")
  print(f"{'data':<6} {'budget':>6} {'correlated':>11} {'independent':>11} {'corr/ind':>8} {'authors':>17}")
  for ds in ("iid", "heavy"):
    for bits in (3.0, 4.0, 5.0, 6.0):
      c = next(r for r in results if r["table"] == "budget" and r["dataset"] == ds
               and r["bits"] == bits and r["correlated"])
      i = next(r for r in results if r["table"] == "budget" and r["dataset"] == ds
               and r["bits"] == bits and not r["correlated"])
      a = ref(ds, f"DynamiQ-{int(bits)}b hier+corr (ring)", 0)
      wire = AUTHORS_WIRE_BITS.get((ds, n, int(bits)))
      c["authors"] = a
      c["authors_bits"] = wire + AUTHORS_STATS_BITS if (a and wire) else None
      auth = f"{a:.3e} @{c['authors_bits']:.2f}b" if c["authors_bits"] else "-"
      print(f"{ds:<6} {bits:>6.1f} {c['vnmse']:>11.3e} {i['vnmse']:>11.3e} "
            f"{c['vnmse'] / i['vnmse']:>8.2f} {auth:>17}")
  print("(authors' points at their own all-in bits: wire incl. scales + 0.078 statistics)")

  out = common.results_dir(args.out)
  suffix = "_tiny" if args.tiny else ""
  path = common.write_json(os.path.join(out, f"vnmse_dynamiq{suffix}.json"), {
      "command": common.command_line(), "machine": common.machine(),
      "n": n, "d": d, "rounding_seeds": args.seeds, "results": results})
  _plot(results, os.path.join(out, f"vnmse_dynamiq{suffix}.png"), n, d)
  print(f"wrote {path}")
  return results


def _plot(results, path, n, d):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for ds, color in (("iid", "C0"), ("heavy", "C1")):
    for corr, style in ((True, "-o"), (False, "--s")):
      pts = sorted((r["bits"], r["vnmse"]) for r in results if r["table"] == "budget"
                   and r["dataset"] == ds and r["correlated"] == corr)
      ax.semilogy(*zip(*pts), style, color=color,
                  label=f"{ds}, {'correlated' if corr else 'independent'}")
    auth = [(r["authors_bits"], r["authors"]) for r in results
            if r["table"] == "budget" and r["dataset"] == ds and r["correlated"]
            and r.get("authors_bits")]
    if auth:
      ax.semilogy(*zip(*auth), "x", color=color, markersize=9, label=f"{ds}, authors")
  ax.set_xlabel("budget, bits/coordinate (all metadata)")
  ax.set_ylabel("vNMSE")
  ax.set_title(f"DynamiQ ring, n={n}, d={d}")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
