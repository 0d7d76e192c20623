"""DynamiQ's two level sets side by side: vNMSE of ``level_set="lattice"`` (the default)
against ``level_set="mee"`` (the paper's) on ``bench.vnmse``'s families.

    python tools/level_sets.py [--seeds 4] [--cache DIR] [--json docs/results/level_sets.json]

The paper's synthetic gradients (``iid``, ``heavy``: n = 8, 2^20 coordinates, data seeds
0 and 1) and the two small LMs' captured gradients (``lm-word``, ``lm-byte`` at steps 0,
100 and 300, 8 workers; :func:`dynamiq_jax.bench.vnmse.lm_gradients`, captured once into
``--cache``), each through ``dq.simulate`` on a ring of 8 with DynamiQ 5b, the mean over
``--seeds`` rounding seeds (:func:`dynamiq_jax.bench.vnmse.measure`). Prints each
family's two figures and their ratio; ``--json`` writes them with the machine and the
command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def main(argv=None) -> list[dict]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", type=int, default=4, help="rounding seeds per family")
  p.add_argument("--cache", default=os.path.expanduser("~/.cache/dynamiq_jax"),
                 help="where the LMs' captured gradients are kept")
  p.add_argument("--json", default=None, help="write the results here")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (iid only, 2^14 "
                 "coordinates, one small LM, one seed): the tests")
  args = p.parse_args(argv)

  import jax
  import numpy as np

  from dynamiq_jax.bench import vnmse as V
  from dynamiq_jax.bench.reference import paper_model_gradients
  from dynamiq_jax.codecs import DynamiQ

  codecs = {s: DynamiQ(bits=5, level_set=s) for s in ("mee", "lattice")}
  d, seeds, kinds = ((1 << 14, (0,), ("iid",)) if args.tiny else
                     (1 << 20, (0, 1), ("iid", "heavy")))
  families = [(f"{ds}/seed{seed}", lambda ds=ds, seed=seed: paper_model_gradients(
      ds, 8, d, seed)) for ds in kinds for seed in seeds]
  grads, _, _ = V.lm_gradients(args.cache or None, tiny=args.tiny)
  families += [(f"{tag}@{step}", lambda g=g: np.asarray(g)[:8])
               for (tag, step), g in sorted(grads.items())]
  rows = []
  start = time.time()
  for name, data in families:
    g = data()
    v = {s: V.measure(c, g, seeds=1 if args.tiny else args.seeds) for s, c in codecs.items()}
    rows.append(dict(family=name, mee=v["mee"], lattice=v["lattice"],
                     ratio=v["lattice"] / v["mee"]))
    print(f"{name:14s} mee {v['mee']:.4e}  lattice {v['lattice']:.4e}  "
          f"lattice / mee {v['lattice'] / v['mee']:.3f}", flush=True)
  info = dict(command="python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:]),
              machine=f"{platform.machine()}, {os.cpu_count()} CPUs", jax=jax.__version__,
              seconds=round(time.time() - start), date=time.strftime("%Y-%m-%d"))
  print(json.dumps(info))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(info, rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  import jax
  jax.config.update("jax_num_cpu_devices", 8)  # the simulated ring of 8
  main()
