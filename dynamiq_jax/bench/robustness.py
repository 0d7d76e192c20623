"""DynamiQ on gradients unlike the paper's model, and against model size.

    python -m dynamiq_jax.bench.robustness            # families + LM snapshots + size sweep
    python -m dynamiq_jax.bench.robustness --tiny     # smoke test (CI)

Table 1, n = 8 workers, ring, 5 bits all-in: vNMSE of

* ``default``: the default codec (widths 2..8 chosen every round from the
  global statistics);
* ``widths 2/4/8``: the same with the paper's widths;
* ``MXFP8`` (8.5 bits) for scale,

on the four families of :mod:`dynamiq_jax.bench.families` and on the word-
and byte-LM gradient snapshots of :mod:`dynamiq_jax.bench.vnmse` (cached).
(``docs/results/robustness.json`` also holds, from an earlier run, the
static-capacity codec this replaced.)

Table 2 and ``robustness_size.png``: the default codec's vNMSE and bits per
coordinate against the bucket size d (64 ... 2^20) at n = 8 on two
families. A bucket too small to compress within 1/4 code bit of a large
bucket (:meth:`DynamiQ.compresses`) goes as bf16 (``uncompressed``); the
ratio between neighbouring *compressed* sizes is printed.

Writes ``docs/results/robustness.json`` (``robustness_tiny.json`` with
``--tiny``) and the plot.
"""

from __future__ import annotations

import argparse
import os
import time

from dynamiq_jax.bench import common

__all__ = ["main", "SIZES"]

SIZES = tuple([64, 256, 1024, 1100, 1101, 2048, 2049, 3020, 3021, 4096, 4097, 8192, 1 << 14,
               1 << 15, 1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20])
"""Bucket sizes of the size sweep: powers of two and the old cliffs' edges."""


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.robustness",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--d", type=int, default=1 << 18, help="coordinates per worker, table 1")
  p.add_argument("--n", type=int, default=8, help="workers")
  p.add_argument("--bits", type=float, default=5.0, help="DynamiQ's all-in budget")
  p.add_argument("--seeds", type=int, default=2, help="rounding seeds per point")
  p.add_argument("--size-families", default="dense,paper",
                 help="comma-separated families of the size sweep")
  common.add_data_flags(p, real="the LM gradient snapshots")
  return p


def _parse(argv):
  return build_parser().parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import numpy as np

  from dynamiq_jax.bench.families import FAMILIES, family
  from dynamiq_jax.bench.vnmse import lm_gradients, measure
  from dynamiq_jax.codecs import DynamiQ, mxfp8

  n, bits = args.n, args.bits
  d = 1 << 14 if args.tiny else args.d
  sizes = (64, 2049, 8192) if args.tiny else SIZES
  size_families = ["dense"] if args.tiny else args.size_families.split(",")
  seeds = 1 if args.tiny else args.seeds
  default = DynamiQ(bits=bits)

  data = {(f, 0): family(f, n, d, 0) for f in FAMILIES}
  if not args.no_real:
    lm, _, steps = lm_gradients(args.cache or None, tiny=args.tiny)
    if args.tiny:  # the families' shape: their compiled code is reused (smoke test only)
      lm = {k: np.pad(v[:n, :d], ((0, 0), (0, max(0, d - v.shape[1])))) for k, v in lm.items()}
    data.update({k: v[:n] for k, v in lm.items()})

  rows = []
  t0 = time.time()
  for (name, step), g in data.items():
    row = {"data": name if name in FAMILIES else f"{name}@{step}", "d": int(g.shape[1])}
    codecs = {"default": default, "widths 2/4/8": DynamiQ(bits=bits, widths=(2, 4, 8)),
              "mxfp8": mxfp8()}
    for label, codec in codecs.items():
      try:
        row[label] = measure(codec, g, seeds=seeds)
      except ValueError as e:
        row[label], row[f"{label} error"] = None, str(e)
    rows.append(row)
    print(_row(row), flush=True)
  table_seconds = time.time() - t0

  sweep = []
  import dynamiq_jax as dq
  for fam in size_families:
    prev = None
    for size in sizes:
      g = family(fam, n, size, 0)
      v = measure(default, g, seeds=seeds)
      compressed = default.compresses(size, n)
      wire = dq.wire_stats(g[0], codec=default, n=n)
      point = {"family": fam, "d": size, "vnmse": v, "compressed": compressed,
               "bits_per_coord": float(wire.bits_per_coord),
               "step": (v / prev if compressed and prev else None)}
      sweep.append(point)
      prev = v if compressed else prev
      print(f"size {fam:>6} d={size:>8}: {v:.3e} at {point['bits_per_coord']:.2f} bits"
            + ("" if compressed else " (uncompressed: bf16)")
            + (f"  x{point['step']:.2f} the previous compressed size" if point["step"] else ""),
            flush=True)

  report = {"machine": common.machine(), "command": common.command_line(),
            "n": n, "bits": bits, "d": d, "seeds": seeds, "table": rows, "sizes": sweep,
            "table_seconds": table_seconds}
  out_dir = common.results_dir(args.out)
  stem = "robustness_tiny" if args.tiny else "robustness"
  common.write_json(os.path.join(out_dir, stem + ".json"), report, strict=args.strict)
  _plot(sweep, os.path.join(out_dir, stem + "_size.png"), n, bits)
  worst = max((p["step"] for p in sweep if p["step"]), default=None)
  print(f"\nlargest step between neighbouring compressed sizes: x{worst:.2f}" if worst else "")
  return rows, sweep


def _fmt(v):
  return "-" if v is None else f"{v:.3e}"


def _row(r):
  return (f"{r['data']:>14}  default {_fmt(r['default'])}  "
          f"widths 2/4/8 {_fmt(r['widths 2/4/8'])}  MXFP8 {_fmt(r['mxfp8'])}")


def _plot(sweep, path, n, bits):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for fam in sorted({p["family"] for p in sweep}):
    pts = [(p["d"], p["vnmse"]) for p in sweep if p["family"] == fam and p["compressed"]]
    raw = [(p["d"], p["vnmse"]) for p in sweep if p["family"] == fam and not p["compressed"]]
    color = None
    if pts:
      color = ax.loglog(*zip(*pts), "-o", ms=3, label=f"{fam}, compressed")[0].get_color()
    if raw:
      ax.loglog(*zip(*raw), "x", color=color, label=f"{fam}, sent as bf16")
  ax.set_xlabel("coordinates in the bucket (d)")
  ax.set_ylabel("vNMSE")
  ax.set_title(f"DynamiQ {bits:g} bits, ring, n = {n}: error against model size")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
