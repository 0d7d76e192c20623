"""One launch of each hop kernel on a GPU, for Nsight Compute (``ncu``) to read.

Runs compress, the ring hop (DAR) and decompress once each on a chunk of 2^24
coordinates whose super-groups are all 4 bits wide (bf16 local values, the
default codec's geometry, ``strata=8``), for the Triton kernels at their
default launch and at each launch given, and for the Mosaic GPU kernels on a
planar payload. Every kernel is named ``dynamiq_*``, so that::

    ncu --clock-control none -k regex:dynamiq --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section SchedulerStats python tools/gpu_profile.py --launch 8x4

reports, per kernel, the achieved DRAM throughput against the card's peak, the
issue-slot use, occupancy and why warps stall: what limits it (memory,
instructions or latency). Inputs are made, and every kernel compiled and run
once, before the profiled launches (the launches ``ncu`` sees first are the
warm-ups: give it ``--launch-skip`` the printed count, or read the later ones).
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--log2-size", type=int, default=24)
  p.add_argument("--width", type=int, default=4)
  p.add_argument("--launch", action="append", default=[],
                 help="(block)x(num_warps) of the Triton kernels, besides their default")
  p.add_argument("--no-mosaic", action="store_true")
  args = p.parse_args(argv)
  import jax
  import jax.numpy as jnp
  import numpy as np

  from dynamiq_jax.codecs.dynamiq import DynamiQ
  from pallas_kernels import dynamiq_mosaic as M
  from pallas_kernels import dynamiq_planar as P
  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_triton as T

  if jax.default_backend() != "gpu":
    sys.exit(f"no GPU (jax's default backend is {jax.default_backend()!r})")
  s_count = (1 << args.log2_size) // 256
  units = s_count * args.width
  widths = jnp.full((s_count,), args.width, jnp.int32)
  x = jax.random.normal(jax.random.key(0), (s_count, 256), jnp.float32).astype(jnp.bfloat16)
  keys = tuple(np.uint32(v) for v in (1, 2, 3, 4))
  geo = dict(eps=DynamiQ().level_spec, plane_bits=R.PLANE_BITS, width_set=R.WIDTH_SET)
  payload = jax.block_until_ready(
      R.compress_reference(x, widths, units, keys=keys, strata=8, **geo))
  runs = []
  for launch in [None] + [tuple(int(v) for v in item.split("x")) for item in args.launch]:
    kw = dict(geo, launch=launch)
    runs += [
        (f"triton {launch or 'default'} compress",
         jax.jit(lambda x, kw=kw: T.compress_pallas(x, widths, units, keys=keys, strata=8, **kw)),
         (x,)),
        (f"triton {launch or 'default'} dar",
         jax.jit(lambda p, x, kw=kw: T.decompress_accumulate_recompress_pallas(
             p, x, widths, units, keys=keys, strata=8, **kw)), (payload, x)),
        (f"triton {launch or 'default'} decompress",
         jax.jit(lambda p, kw=kw: T.decompress_pallas(p, widths, units, **kw)), (payload,)),
    ]
  if not args.no_mosaic:
    planar = jax.block_until_ready(P.to_planar(payload, s_count, units, R.PLANE_BITS))
    mgeo = dict(eps=DynamiQ().level_spec, width_set=R.WIDTH_SET)
    runs += [
        ("mosaic compress", jax.jit(lambda x: M.compress_planar(
            x, widths, units, keys=keys, strata=8, **mgeo)), (x,)),
        ("mosaic dar", jax.jit(lambda p, x: M.decompress_accumulate_recompress_planar(
            p, x, widths, units, keys=keys, strata=8, **mgeo)), (planar, x)),
        ("mosaic decompress", jax.jit(lambda p: M.decompress_planar(p, widths, units, **mgeo)),
         (planar,)),
    ]
  for name, f, operands in runs:  # compile and warm up: the first launches
    jax.block_until_ready(f(*operands))
  print(f"warm-up launches: {len(runs)} (one per kernel, in this order)", flush=True)
  for name, f, operands in runs:
    print("profiled:", name, flush=True)
    jax.block_until_ready(f(*operands))


if __name__ == "__main__":
  main()
