"""Deviceless H100 compile of the Mosaic GPU hop kernels, beside Triton's, from a CPU host.

    python tools/mosaic_compile.py                # table on stdout
    python tools/mosaic_compile.py --json docs/results/mosaic_compile.json

A child process (:func:`dynamiq_jax.bench.gpu_compile.compile_in_child`, the
``gpu-compile`` extra) compiles, each alone for one compile-only H100 (the
recipe of ``tests/test_gpu_compile_units.py``: 37 super-groups, 150 units,
bf16 local values, width set (2, 3, 4, 5, 6, 8), 1-bit planes, ``strata=8``,
stochastic scales), the four hop kernels of both backends
(:mod:`pallas_kernels.dynamiq_mosaic` on the planar payload,
:mod:`pallas_kernels.dynamiq_triton` on the record payload), and reports per
kernel the custom calls in the optimized HLO (``mosaic_gpu*`` or
``__gpu$xla.gpu.triton``), its registers and spill bytes (``ptxas -v``,
sm_90a: for Triton on the PTX XLA writes, for Mosaic GPU the output of the
CUDA plugin's own Mosaic GPU pipeline, which runs in the deviceless compile:
:func:`dynamiq_jax.bench.gpu_compile.mosaic_ptxas_report`) and the seconds of
its lower + compile (with those dumps).

``--step`` also compiles the README's training step for 8 compile-only
H100s (``tests/test_gpu_compile.py``'s ``compile_step``: a 512 x 256 weight,
``dq.compressed_psum`` in ``shard_map(check_vma=True)``) with
``implementation=None`` (what the dispatch picks: Triton while
:data:`pallas_kernels.dispatch.MOSAIC_FIRST` is off; with it on, Mosaic GPU on
jax >= 0.12 and Triton on 0.10.2), ``"mosaic"`` and ``"pallas"`` (Triton), and counts per
step (from the call graph and the loops' trip counts,
:func:`~dynamiq_jax.bench.hlo.per_step`) each backend's kernel
launches, by the op that launched them, the payload hops, and each kernel's
registers and spill bytes.

The Triton kernels' static instruction counts are ``tools/sass_count.py``'s.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

__all__ = ["kernel_calls", "compile_kernels", "main"]

_S, _UNITS = 37, 150
_EPS = {2: 0.23, 4: 0.18, 8: 0.10}
_TESTS = str(pathlib.Path(__file__).resolve().parents[1] / "tests")


def kernel_calls(mod, suffix: str, device, *, width_set=None, dtype="bfloat16",
                 strata: int = 8, scale_rounding: str = "stochastic") -> dict:
  """``{op: (f, args)}``: the four hop kernels of ``mod`` (its ``<op>_<suffix>``
  functions) on one instance (``_S`` super-groups, ``_UNITS`` units, ``plane_bits=1``),
  their arguments as ``jax.ShapeDtypeStruct`` on ``device``; the keyword arguments are the
  knobs (``tools/mosaic_regs.py`` varies them; ``width_set=None``: the default codec's)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import dynamiq_reference as R

  sharding = jax.sharding.SingleDeviceSharding(device)
  geo = dict(eps=_EPS, plane_bits=1, width_set=tuple(width_set or R.WIDTH_SET))
  x = jax.ShapeDtypeStruct((_S, 256), jnp.dtype(dtype), sharding=sharding)
  w = jax.ShapeDtypeStruct((_S,), jnp.int32, sharding=sharding)
  p = jax.ShapeDtypeStruct((R.payload_bytes(_S, _UNITS),), jnp.uint8, sharding=sharding)
  enc = dict(geo, keys=tuple(np.uint32(v) for v in (1, 2, 3, 4)), strata=strata,
             scale_rounding=scale_rounding)
  op = lambda o: getattr(mod, f"{o}_{suffix}")
  return {
      "compress": (lambda x, w, f=op("compress"): f(x, w, _UNITS, **enc), (x, w)),
      "decompress": (lambda p, w, f=op("decompress"): f(p, w, _UNITS, **geo), (p, w)),
      "decompress_accumulate": (
          lambda p, x, w, f=op("decompress_accumulate"): f(p, x, w, _UNITS, **geo), (p, x, w)),
      "decompress_accumulate_recompress": (
          lambda p, x, w, f=op("decompress_accumulate_recompress"): f(p, x, w, _UNITS, **enc),
          (p, x, w)),
  }


def compile_kernels() -> dict:
  """Each decode kernel of both backends compiled alone for one H100 (runs in the child)."""
  import warnings

  import jax

  from dynamiq_jax.bench import gpu_compile as G
  from pallas_kernels import dynamiq_mosaic as M
  from pallas_kernels import dynamiq_triton as T

  [device] = G.h100_devices(1)
  fns = {f"{name}/{op}": call
         for name, mod, sfx in (("mosaic", M, "planar"), ("triton", T, "pallas"))
         for op, call in kernel_calls(mod, sfx, device).items()}
  compiled, info = [], {}
  for name, (f, args) in fns.items():
    start = time.perf_counter()
    with warnings.catch_warnings(), G.gpu_target(device):
      warnings.filterwarnings("ignore", T.TRITON_DEPRECATION, DeprecationWarning)
      compiled.append(jax.jit(f).trace(*args).lower().compile())
    info[name] = {"seconds": round(time.perf_counter() - start, 2)}
  return {"compiled": compiled, "info": {"names": list(fns), "kernels": info,
                                         "jax": jax.__version__}}


def _launcher(line: str) -> str:
  """The op that launched a kernel, from its metadata (the jitted wrapper's name)."""
  name = re.search(r'op_name="([^"]+)"', line)
  found = re.findall(r"jit\((_\w+)\)|(dynamiq_units_\w+)", name.group(1) if name else "")
  return "".join(found[-1]) if found else "?"


def _ptxas(build) -> dict:
  """Registers and spill bytes per kernel of a build, both backends."""
  from dynamiq_jax.bench import gpu_compile as G
  return {**G.ptxas_report(build.ptx, prefix="dynamiq_"),
          **G.mosaic_ptxas_report(build.mosaic_ptxas)}


def measure_step() -> dict:
  """Per implementation: kernel launches per step by launcher, payload hops, registers and
  spill bytes per kernel, seconds."""
  import collections

  from dynamiq_jax.bench import gpu_compile as G
  from dynamiq_jax.bench import hlo as H
  out = {}
  for impl in (None, "mosaic", "pallas"):
    with G.compile_in_child(f"{_TESTS}/test_gpu_compile.py:compile_step",
                            kwargs={"implementation": impl}, path=[_TESTS], ptx=True,
                            xla_flags=G.DEVICELESS_XLA_FLAGS) as build:
      comps = H.parse_hlo(build.hlo[0])
      runs, _ = H.executions(comps)
      launches = collections.Counter()
      for name, comp in comps.items():
        for ins in comp.instructions:
          if ins.opcode == "custom-call" and ("mosaic_gpu" in ins.line or H.TRITON in ins.line):
            backend = "mosaic_gpu" if "mosaic_gpu" in ins.line else "triton"
            launches[f"{backend}:{_launcher(ins.line)}"] += runs.get(name, 1)
      out[str(impl)] = {"launches_per_step": dict(sorted(launches.items())),
                        "payload_hops_per_step": H.per_step(comps, H.is_payload_hop),
                        "ptxas": dict(sorted(_ptxas(build).items())),
                        "seconds": build.seconds}
  return out


def measure() -> dict:
  """The report: per kernel its custom calls, registers, spill bytes and compile seconds."""
  from dynamiq_jax.bench import gpu_compile as G
  from dynamiq_jax.bench import hlo as H
  with G.compile_in_child(f"{__file__}:compile_kernels", ptx=True) as build:
    info = build.info
    ptxas = _ptxas(build)
    for name, hlo in zip(info["names"], build.hlo):
      targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
      info["kernels"][name]["custom_calls"] = {
          t: targets.count(t) for t in sorted(set(targets))
          if t.startswith("mosaic_gpu") or t == H.TRITON}
      backend, op = name.split("/")
      entry = f"dynamiq_mosaic_{op}" if backend == "mosaic" else f"dynamiq_units_{op}_p1"
      info["kernels"][name].update(ptxas.get(entry, {"registers": None, "spill_bytes": None}))
    info["child_seconds"] = build.seconds
  return info


def main(argv=None):
  p = argparse.ArgumentParser(prog="python tools/mosaic_compile.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--json", default=None, help="also write the report here (with the command)")
  p.add_argument("--step", action="store_true",
                 help="also compile the README's step for 8 x H100 with both backends")
  args = p.parse_args(argv)
  from dynamiq_jax.bench import common
  from dynamiq_jax.bench import gpu_compile as G
  why = G.missing()
  if why:
    sys.exit(why)
  report = measure()
  print(f"Deviceless compile for one H100 (jax {report['jax']}), S={_S}, units={_UNITS}, bf16")
  print(f"{'kernel':<42} {'seconds':>8} {'registers':>9} {'spill B':>7}  custom calls")
  for name in report["names"]:
    k = report["kernels"][name]
    print(f"{name:<42} {k['seconds']:>8.2f} {k['registers']!s:>9} {k['spill_bytes']!s:>7}  "
          f"{k['custom_calls']}")
  if args.step:
    report["step_8xh100"] = measure_step()
    for impl, r in report["step_8xh100"].items():
      print(f"8 x H100 step, implementation={impl}: {r['payload_hops_per_step']} payload hops, "
            f"launches {r['launches_per_step']}, {r['seconds']} s")
      for kernel, k in r["ptxas"].items():
        print(f"  {kernel:<52} {k['registers']:>4} registers, {k['spill_bytes']:>5} spill bytes")
  if args.json:
    common.write_tool_json(args.json, "tools/mosaic_compile.py", argv or None, report)
  return report


if __name__ == "__main__":
  main()
