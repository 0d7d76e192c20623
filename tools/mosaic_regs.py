"""Registers and spill bytes of the Mosaic GPU hop kernels against their knobs (deviceless H100).

    python tools/mosaic_regs.py                  # table on stdout
    python tools/mosaic_regs.py --json docs/results/mosaic_regs.json

One child process (:func:`dynamiq_jax.bench.gpu_compile.compile_in_child`,
the ``gpu-compile`` extra) compiles the four kernels of
:mod:`pallas_kernels.dynamiq_mosaic` once per configuration of
:data:`CONFIGS` (the base is ``tools/mosaic_compile.py``'s: 37 super-groups,
150 units, bf16 values, width set (2, 3, 4, 5, 6, 8), ``strata=8``,
stochastic scales; each other row changes one knob), each under its own
kernel name prefix so that the Mosaic GPU pipeline's ``ptxas -v`` output
(:func:`~dynamiq_jax.bench.gpu_compile.mosaic_ptxas_report`) tells them
apart. ``None``: the operation does not depend on that row's knob (the
decode kernels on the value dtype, scale rounding or strata), so jax reuses
the kernel of an earlier row and compiles nothing. The super-groups per program (:data:`~pallas_kernels.dynamiq_mosaic.BLOCK`
= 8, 64 rows) and the warpgroup per program are not knobs: the kernels use
the WGMMA register layout, whose tile is 64 rows for one warpgroup of 128
threads (16 values of a ``[64, 32]`` array per thread).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

__all__ = ["CONFIGS", "compile_configs", "main"]

_TOOLS = str(pathlib.Path(__file__).resolve().parent)
_BASE = dict(width_set=(2, 3, 4, 5, 6, 8), dtype="bfloat16", strata=8,
             scale_rounding="stochastic")
CONFIGS = {
    "base": {},
    "widths (8,)": dict(width_set=(8,)),
    "widths (4,)": dict(width_set=(4,)),
    "widths (2,)": dict(width_set=(2,)),
    "widths (2, 3, 4)": dict(width_set=(2, 3, 4)),
    "widths (5,)": dict(width_set=(5,)),
    "widths (6,)": dict(width_set=(6,)),
    "float32 x": dict(dtype="float32"),
    "strata 1": dict(strata=1),
    "scales up": dict(scale_rounding="up"),
}
"""Name -> the knobs that differ from the base configuration."""

_OPS = ("compress", "decompress", "decompress_accumulate", "decompress_accumulate_recompress")


def compile_configs(names) -> dict:
  """Each kernel of each named configuration compiled alone for one H100 (runs in the child)."""
  import time

  import jax

  from dynamiq_jax.bench import gpu_compile as G
  from mosaic_compile import kernel_calls  # tools/, on the child's path (measure)
  from pallas_kernels import dynamiq_mosaic as M

  [device] = G.h100_devices(1)
  compiled, info = [], {}
  for i, name in enumerate(names):
    fns = kernel_calls(M, "planar", device, **{**_BASE, **CONFIGS[name]})
    M.KERNEL_PREFIX = f"cfg{i}_"
    for op, (f, args) in fns.items():
      start = time.perf_counter()
      with G.gpu_target(device):
        compiled.append(jax.jit(f).trace(*args).lower().compile())
      info[f"{name}/{op}"] = round(time.perf_counter() - start, 2)
  return {"compiled": compiled, "info": {"seconds": info, "jax": jax.__version__}}


def measure(names) -> dict:
  """``{config: {op: {"registers", "spill_bytes", "seconds"}}}``."""
  from dynamiq_jax.bench import gpu_compile as G
  with G.compile_in_child(f"{__file__}:compile_configs", kwargs={"names": list(names)},
                          path=[_TOOLS], ptx=True) as build:
    report = G.mosaic_ptxas_report(build.mosaic_ptxas)
    out = {}
    for i, name in enumerate(names):
      out[name] = {"knobs": {**_BASE, **CONFIGS[name]}}
      for op in _OPS:
        out[name][op] = {**report.get(f"cfg{i}_{op}", {"registers": None, "spill_bytes": None}),
                         "seconds": build.info["seconds"][f"{name}/{op}"]}
    return {"configs": out, "jax": build.info["jax"], "child_seconds": build.seconds}


def main(argv=None):
  p = argparse.ArgumentParser(prog="python tools/mosaic_regs.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--json", default=None, help="also write the report here (with the command)")
  p.add_argument("--only", nargs="*", default=None, help="configurations to compile")
  args = p.parse_args(argv)
  from dynamiq_jax.bench import common
  from dynamiq_jax.bench import gpu_compile as G
  why = G.missing()
  if why:
    sys.exit(why)
  report = measure(args.only or list(CONFIGS))
  from mosaic_compile import _S, _UNITS  # tools/: this script's directory, on sys.path
  print(f"Deviceless compile for one H100 (jax {report['jax']}), S={_S}, units={_UNITS}; "
        "registers / spill bytes")
  print(f"{'configuration':<18} " + " ".join(f"{op[:24]:>26}" for op in _OPS))
  for name, r in report["configs"].items():
    print(f"{name:<18} " + " ".join(
        f"{r[op]['registers']!s:>18} / {r[op]['spill_bytes']!s:>5}" for op in _OPS))
  if args.json:
    common.write_tool_json(args.json, "tools/mosaic_regs.py", argv or None, report)
  return report


if __name__ == "__main__":
  main()
