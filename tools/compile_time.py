"""Trace, lower and compile time of one all-reduce under ``vmap``, against n.

A one-off measurement of how compile time grows with n: the default DynamiQ
(widths chosen every round) against MXFP8, at n = 8 and 64 simulated ranks
and d = 2^20 coordinates per rank, one bucket::

    python tools/compile_time.py [--d 1048576] [--ns 8,64]

Prints the machine and each time in seconds (one measurement each: compile
times on a shared machine vary by tens of percent).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

import dynamiq_jax as dq
from dynamiq_jax.bench import common


def main(argv=None):
  p = argparse.ArgumentParser(prog="python tools/compile_time.py", description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--d", type=int, default=1 << 20, help="coordinates per rank")
  p.add_argument("--ns", default="8,64", help="comma-separated numbers of ranks")
  args = p.parse_args(argv)
  print(json.dumps(common.machine()))
  codecs = {"DynamiQ 5b": dq.codecs.DynamiQ(bits=5),
            "MXFP8": dq.codecs.mxfp8()}
  for n in map(int, args.ns.split(",")):
    x = jax.ShapeDtypeStruct((n, args.d), jnp.float32)
    for name, codec in codecs.items():
      f = jax.jit(jax.vmap(lambda v, c=codec: dq.allreduce(v, axis_name="i", codec=c,
                                                           key=jax.random.key(0))[0],
                           axis_name="i"))
      t0 = time.perf_counter()
      lowered = f.lower(x)
      t1 = time.perf_counter()
      lowered.compile()
      t2 = time.perf_counter()
      print(f"n = {n:3d}  {name:<18} trace + lower {t1 - t0:5.1f} s   compile {t2 - t1:5.1f} s   "
            f"total {t2 - t0:5.1f} s", flush=True)


if __name__ == "__main__":
  main()
