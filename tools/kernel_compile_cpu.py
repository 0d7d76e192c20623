"""CPU seconds to compile each of the default DynamiQ bucket's kernels alone, for an H100.

    python tools/kernel_compile_cpu.py                 # a bucket of 2^25 over 8 ranks
    python tools/kernel_compile_cpu.py --d 1048576

A child process (:func:`dynamiq_jax.bench.gpu_compile.compile_in_child`, the
``gpu-compile`` extra; no GPU needed) compiles, each alone for one
compile-only H100, the Triton kernels one bucket of the default codec
launches (the guard and statistics pass, the statistics' sum and encode, the
allocation, the first encode, the ring hop, the finish's batched decode),
and beside them a program of one multiply: the CPU seconds (this process's
threads) of each trace and lowering and of each ``compile()``, one each (the
process's compile cache makes a second one free). A step lowers and compiles
each distinct kernel once whatever its bucket count, so their sums are what
the codec adds to a step whose buckets are one program run in loops
(``stacked=``). Prints the machine, the configuration and the seconds as JSON.
"""

from __future__ import annotations

import argparse
import json
import time


def child(d: int, n: int) -> dict:
  """Compiles the kernels (runs in the child)."""
  import jax
  import jax.numpy as jnp

  from dynamiq_jax.bench import gpu_compile as G
  from dynamiq_jax.codecs import allocation
  from dynamiq_jax.codecs.dynamiq import DynamiQ, DynamiQAux
  from dynamiq_jax.schedules import ring_plan
  from pallas_kernels import dynamiq as K
  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_stats as S

  [device] = G.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  st = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  codec = DynamiQ()
  lay = codec.layout(d, n)
  total, s, units = lay.padded_supergroups, lay.padded_supergroups // n, lay.units
  aux = DynamiQAux(None, None, None, lay, None)
  enc, dec = codec._geometry(aux), codec._geometry(aux, decode=True)  # pylint: disable=protected-access
  for geo in (enc, dec):
    geo["implementation"] = "pallas"
  key = st((), jnp.uint32)
  payload = R.payload_bytes(s, units, lay.plane_bits)
  cases = {
      "one multiply (no kernel)": (lambda x: x * 2, (st((s, 256), jnp.float32),)),
      "guard_stats": (
          lambda x, k0, k1: S.guard_stats(x, k0, k1, 0, s=s, safe_exponent=100, stride=n + 1,
                                          implementation="pallas"),
          (st((total, 256), jnp.float32), st((n * (n + 1),), jnp.uint32),
           st((n * (n + 1),), jnp.uint32))),
      "stats_sum_encode": (
          lambda p, k0, k1, c: S.stats_sum_encode(p, k0, k1, c, stride=n + 1, step=1,
                                                  implementation="pallas"),
          (st((n, s, 2), jnp.bfloat16), st((n, n + 1), jnp.uint32),
           st((n, n + 1), jnp.uint32), key)),
      "allocate": (  # (as DynamiQ.plan launches it: on the gathered statistics)
          lambda g: allocation.plan(
              g, lay.supergroups, codec.width_errors(), s,
              {w: n * 256 * w for w in codec.widths},
              n * units * R.unit_bytes(lay.plane_bits) * 8, n,
              planes=(lay.plane_bits, units), column=1, implementation="pallas"),
          (st((total, 2), jnp.bfloat16),)),
      "compress": (
          lambda x, w, a, b, c, e: K.compress(x, w, units, keys=(a, b, c, e), rank=0, **enc),
          (st((s, 256), jnp.float32), st((s,), jnp.int32), key, key, key, key)),
      "decompress_accumulate_recompress": (
          lambda p, x, w, a, b, c, e: K.decompress_accumulate_recompress(
              p, x, w, units, keys=(a, b, c, e), rank=0, **enc),
          (st((payload,), jnp.uint8), st((s, 256), jnp.float32), st((s,), jnp.int32),
           key, key, key, key)),
      "decompress_rows": (
          lambda p, w, slots, m: K.decompress_rows(
              p, w, units, slots, m, dtype=jnp.bfloat16,
              row_sum=codec._row_error(n, ring_plan(n).partials()), **dec),  # pylint: disable=protected-access
          (st((n, payload), jnp.uint8), st((s,), jnp.int32), st((total,), jnp.int32),
           st((total, 2), jnp.bfloat16))),
  }
  seconds = {"lower_cpu_s": {}, "compile_cpu_s": {}}
  for name, (f, args) in cases.items():
    with G.gpu_target(device):
      c0 = time.process_time()
      lowered = jax.jit(f).trace(*args).lower()
      c1 = time.process_time()
      lowered.compile()
      c2 = time.process_time()
    seconds["lower_cpu_s"][name] = round(c1 - c0, 2)
    seconds["compile_cpu_s"][name] = round(c2 - c1, 2)
  sums = {f"kernels_{k}": round(sum(t for name, t in v.items() if "no kernel" not in name), 2)
          for k, v in seconds.items()}
  return {"compiled": [], "info": {**seconds, **sums, "jax": jax.__version__}}


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python tools/kernel_compile_cpu.py",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--d", type=int, default=1 << 25, help="coordinates per bucket")
  p.add_argument("--n", type=int, default=8, help="ranks")
  args = p.parse_args(argv)
  from dynamiq_jax.bench import common, gpu_compile

  missing = gpu_compile.missing(need_ptxas=False)
  if missing:
    raise SystemExit(f"cannot run: {missing}")
  with gpu_compile.compile_in_child(f"{__file__}:child", kwargs={"d": args.d, "n": args.n},
                                    ptx=False, strict_warnings=False) as build:
    out = {"machine": common.machine(), "d": args.d, "n": args.n, **build.info}
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main()
