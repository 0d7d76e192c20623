"""vNMSE of each schedule at n = 8: ring, butterfly, the two-level hierarchy, Moshpit.

    python -m dynamiq_jax.bench.schedules            # ~4 min on 2 cores, 8 with the LM capture
    python -m dynamiq_jax.bench.schedules --tiny     # smoke test (CI)

The same codec through different schedules, on the same data as
:mod:`dynamiq_jax.bench.vnmse` (the spec's synthetic gradients, data seed 0,
d = 2^20, where the authors' ring and butterfly values exist; and the word-
and byte-LM gradients, shared cache):

* ``ring``: every partial sum is re-quantised at each of the n - 1 hops;
* ``butterfly``: a rotated binary tree per chunk, so a coordinate is
  re-quantised log2 n times (the paper's bandwidth-optimal schedule: same
  bytes as the ring, lower error);
* ``hierarchical`` on a (slow, fast) mesh, (2, 4) and (4, 2): exact float32
  inside the fast axis, the codec across the slow one only, so its error is
  that of a ring over ``slow`` ranks of partial sums;
* ``moshpit`` on a virtual grid, (2, 4) and (2, 2, 2), every rank present: one
  compressed group all-reduce per grid axis (``dq.Moshpit``), the codec's bits in
  every round, so each rank sends more bytes than on the ring (``bytes_vs_ring``).

Prints one row per codec and schedule with the authors' value where the
reference has one and the butterfly / ring ratio; writes
``docs/results/schedules.json``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from dynamiq_jax.bench import common

from dynamiq_jax.bench.vnmse import N, lm_gradients, measure

__all__ = ["main", "SCHEDULES", "TINY_SCHEDULES"]

SCHEDULES = (("ring", None), ("butterfly", None), ("hierarchical", (2, 4)),
             ("hierarchical", (4, 2)), ("moshpit", (2, 4)), ("moshpit", (2, 2, 2)))
"""``(schedule, shape)``: the (slow, fast) mesh of the hierarchy, the grid of Moshpit."""
TINY_SCHEDULES = (("ring", None), ("butterfly", None), ("hierarchical", (2, 4)),
                  ("moshpit", (2, 4)))
"""--tiny's: both flat ones (their ratio is printed), one mesh of two axes, one grid."""


def _label(schedule, shape):
  return schedule if shape is None else f"{schedule} {'x'.join(map(str, shape))}"


def _run_as(schedule, shape):
  """``(schedule, mesh_shape)`` as ``dq.simulate`` takes them."""
  if schedule == "moshpit":
    import dynamiq_jax as dq
    return dq.Moshpit(grid=shape), None
  return schedule, shape


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.schedules",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--d", type=int, default=1 << 20, help="synthetic coordinates per worker")
  p.add_argument("--seeds", type=int, default=2, help="rounding seeds per stateless point")
  p.add_argument("--rounds", type=int, default=12, help="steps for stateful codecs")
  common.add_data_flags(p)
  return p


def _parse(argv):
  return build_parser().parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import dynamiq_jax as dq
  from dynamiq_jax.bench.reference import REFERENCE, paper_model_gradients
  from dynamiq_jax.codecs import DynamiQ, MX
  from tqdm.auto import tqdm

  if args.tiny:
    args.d, args.seeds, args.rounds = 1 << 14, 1, 2
  codecs = [("DynamiQ 5b", DynamiQ(bits=5.0), "DynamiQ-5b hier+corr"),
            ("MXFP8", MX(element="e4m3"), "MXFP8")]
  data = {"iid": paper_model_gradients("iid", N, args.d, 0)}
  if not args.tiny:
    data["heavy"] = paper_model_gradients("heavy", N, args.d, 0)
  info = {}
  if not args.no_real:
    grads, info, steps = lm_gradients(args.cache, args.tiny)
    for (tag, s), g in grads.items():
      if s == steps[-1]:
        g = g[:N]
        if args.tiny:  # the synthetic data's shape: its compiled code is reused (smoke test only)
          g = np.pad(g[:, :args.d], ((0, 0), (0, max(0, args.d - g.shape[1]))))
        data[f"{tag}@{s}"] = g

  rows = []
  jobs = [(c, ds, sch) for c in codecs for ds in data
          for sch in (TINY_SCHEDULES if args.tiny else SCHEDULES)]
  for (name, codec, ref_name), ds, (schedule, shape) in tqdm(jobs, desc="vNMSE by schedule"):
    g = data[ds]
    row = {"codec": name, "dataset": ds, "schedule": _label(schedule, shape),
           "n": int(g.shape[0]), "d": int(g.shape[1])}
    run_as, mesh_shape = _run_as(schedule, shape)
    try:
      v = measure(codec, g, schedule=run_as, seeds=args.seeds, rounds=args.rounds,
                  mesh_shape=mesh_shape)
    except ValueError as e:  # e.g. a stateful codec on the hierarchical schedule: say why
      rows.append(dict(row, vnmse=None, reason=str(e)[:300]))
      continue
    authors = None
    if ds in ("iid", "heavy") and mesh_shape is None and args.d == 1 << 20:
      ref = REFERENCE.get((ds, N, f"{ref_name} ({schedule})"))
      authors = None if ref is None else ref[0]
    stats = dq.wire_stats(g[0], codec=codec, n=N, schedule=run_as) if mesh_shape is None \
        else None
    ring = dq.wire_stats(g[0], codec=codec, n=N)
    rows.append(dict(row, vnmse=v, authors=authors,
                     compressed_axis="slow" if mesh_shape else "data",
                     bits_per_coord=stats.bits_per_coord if stats else None,
                     bytes_vs_ring=stats.bytes_per_rank / ring.bytes_per_rank if stats else None))

  _print(rows, list(data))
  out = common.results_dir(args.out)
  path = os.path.join(out, f"schedules{'_tiny' if args.tiny else ''}.json")
  common.write_json(path, {"command": common.command_line(), "machine": common.machine(),
                           "n": N, "d": args.d, "rounding_seeds": args.seeds,
                           "stateful_rounds": args.rounds, "lm": info, "rows": rows},
                    strict=args.strict)
  print(f"wrote {path}")
  return rows


def _print(rows, datasets):
  print(f"\nvNMSE by schedule, n = {N} workers (authors' simulator in [])")
  print(f"  {'codec':<11} {'schedule':<17}" + "".join(f"{d:>22}" for d in datasets))
  for codec in dict.fromkeys(r["codec"] for r in rows):
    for label in dict.fromkeys(r["schedule"] for r in rows):
      cells = []
      for ds in datasets:
        (r,) = [r for r in rows if (r["codec"], r["schedule"], r["dataset"]) == (codec, label, ds)]
        if r["vnmse"] is None:
          cells.append("-")
          continue
        ref = f" [{r['authors']:.2e}]" if r.get("authors") else ""
        cells.append(f"{r['vnmse']:.3e}{ref}")
      print(f"  {codec:<11} {label:<17}" + "".join(f"{c:>22}" for c in cells))
      reasons = {r["reason"] for r in rows if (r["codec"], r["schedule"]) == (codec, label)
                 and r["vnmse"] is None}
      for why in reasons:
        print(f"  {'':<11} {'':<17} not run: {why.split(';')[0]}")
    ratios = []
    for ds in datasets:
      get = lambda s: next(r["vnmse"] for r in rows
                           if (r["codec"], r["schedule"], r["dataset"]) == (codec, s, ds))
      ratios.append(f"{get('butterfly') / get('ring'):.2f}x")
    print(f"  {codec:<11} {'butterfly / ring':<17}" + "".join(f"{c:>22}" for c in ratios))


if __name__ == "__main__":
  main()
