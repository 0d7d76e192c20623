"""Static SASS of the Mosaic GPU kernels beside the Triton ones, per kernel (deviceless H100).

    python tools/mosaic_sass.py --ptxas PTXAS [--nvdisasm NVDISASM] [--json docs/results/mosaic_sass.json]

jax >= 0.11 (the CUDA plugin's Mosaic GPU pipeline lowers the kernels deviceless). One
child compiles the four Mosaic GPU kernels of the default codec (lattice levels, width set
2-8, bf16 local values, 37 super-groups, ``strata=8``) for one H100 with
``MOSAIC_GPU_DUMP_PTX=1`` and ``MOSAIC_GPU_DUMP_PTXAS=1``: the pipeline prints each
kernel's PTX and its own ``ptxas -v`` report (registers). The PTX is version 9.0, which
the ``ptxas`` of the ``gpu-compile`` extra (CUDA 12) does not read: ``--ptxas`` names a
CUDA 13 one (``pip install --target DIR "nvidia-cuda-nvcc>=13"``; it is
``DIR/nvidia/cu13/bin/ptxas``). It assembles the PTX for ``sm_90a`` and the cubin's code
is counted as ``tools/sass_count.py`` counts the Triton kernels', which a second child
compiles on the same jax (:func:`sass_count.measure`, the ``default`` configuration).
With ``--nvdisasm`` (``pip download nvidia-cuda-nvdisasm``) the disassembly also gives
each kernel's memory instructions by kind and width, and its instruction mix.

Per coordinate: a Mosaic GPU program is one warpgroup (128 threads) on 8 super-groups
(64 rows of the WGMMA layout, 16 values per thread); a Triton program 4 warps on 16
(32 values per thread). Occupancy is the register limit: programs of 128 threads per
SM from 65,536 registers (allocated per warp in units of 256), at most 16; Mosaic's
dynamic shared memory (the staged operands) is not in the cubin and may limit it more.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile

from dynamiq_jax.bench import gpu_compile as G

TOOLS = pathlib.Path(__file__).resolve().parent
ROOT = TOOLS.parent
OPS = ("compress", "decompress", "decompress_accumulate", "decompress_accumulate_recompress")
COORDS_PER_THREAD = {"mosaic": 8 * 256 // 128, "triton": 16 * 256 // 128}
ENV = {"MOSAIC_GPU_DUMP_PTX": "1", "MOSAIC_GPU_DUMP_PTXAS": "1"}
_MEMORY = re.compile(r"^(LDG|STG|LDS|STS|LDSM|STSM|LDC|ULDC|UTMALDG|UTMASTG|UBLKCP|"
                     r"LDGSTS|SHFL|RED|ATOM|SYNCS)")


def compile_mosaic() -> list:
  """The default codec's four Mosaic GPU kernels compiled alone for one H100 (in the child)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import dynamiq_mosaic as M
  from pallas_kernels import dynamiq_reference as R

  [device] = G.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  s, units = 37, 150
  geo = dict(eps="lattice", plane_bits=1, width_set=R.WIDTH_SET)
  enc = dict(geo, keys=tuple(np.uint32(v) for v in (1, 2, 3, 4)), strata=8,
             scale_rounding="stochastic")
  x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16, sharding=sharding)
  w = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=sharding)
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units),), jnp.uint8, sharding=sharding)
  fns = [(lambda x, w: M.compress_mosaic(x, w, units, **enc), (x, w)),
         (lambda p, w: M.decompress_mosaic(p, w, units, **geo), (p, w)),
         (lambda p, x, w: M.decompress_accumulate_mosaic(p, x, w, units, **geo), (p, x, w)),
         (lambda p, x, w: M.decompress_accumulate_recompress_mosaic(p, x, w, units, **enc),
          (p, x, w))]
  out = []
  for f, args in fns:
    with G.gpu_target(device):
      out.append(jax.jit(f).trace(*args).lower().compile())
  return out


def split_ptx(stdout: str) -> dict[str, str]:
  """``{kernel: PTX module}`` from the pipeline's standard output."""
  lines = stdout.splitlines()
  starts = [i for i, line in enumerate(lines) if line.startswith(".version")]
  out = {}
  for n, start in enumerate(starts):
    first = start
    while first and lines[first - 1].startswith("//"):
      first -= 1
    body = lines[first:starts[n + 1] if n + 1 < len(starts) else len(lines)]
    last = max(i for i, line in enumerate(body) if line.strip() == "}")
    text = "\n".join(body[:last + 1]) + "\n"
    out[re.search(r"\.entry (\w+)\(", text).group(1)] = text
  return out


def _op(kernel: str) -> str:
  return next(op for op in sorted(OPS, key=len, reverse=True) if op in kernel)


def _mix(sass: str) -> dict:
  """Instruction mix of a disassembly: total per opcode, memory instructions by opcode with
  their width suffixes, and branches."""
  ops = collections.Counter()
  for line in sass.splitlines():
    m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
    if m:
      ops[m.group(1)] += 1
  memory = {k: v for k, v in ops.items() if _MEMORY.match(k)}
  base = collections.Counter()
  for k, v in ops.items():
    base[k.split(".")[0]] += v
  return {"memory": dict(sorted(memory.items())), "top": dict(base.most_common(12)),
          "branches": base.get("BRA", 0)}


def _occupancy(registers: int) -> int:
  """Programs of 128 threads per SM allowed by the registers (256-register warp units)."""
  per_warp = -(-registers * 32 // 256) * 256
  return min(16, 65536 // (per_warp * 4))


def measure_mosaic(ptxas: str, nvdisasm: str | None) -> dict:
  import os
  saved = {k: os.environ.get(k) for k in ENV}
  os.environ.update(ENV)  # the child's environment is this process's
  try:
    with G.compile_in_child(f"{__file__}:compile_mosaic", path=(ROOT, TOOLS), cwd=ROOT,
                            ptx=True, strict_warnings=False) as build:
      modules = split_ptx(build.mosaic_ptxas)
      pipeline = G.mosaic_ptxas_report(build.mosaic_ptxas)
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k)
      else:
        os.environ[k] = v
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, text in modules.items():
      ptx, cubin = pathlib.Path(tmp) / f"{name}.ptx", pathlib.Path(tmp) / f"{name}.cubin"
      ptx.write_text(text)
      res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(cubin)],
                           capture_output=True, text=True, check=True)
      regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
      n = G.sass_instructions(cubin)[name]
      row = {"instructions": n, "per_coord": round(n / COORDS_PER_THREAD["mosaic"], 1),
             "registers": pipeline.get(name, {}).get("registers", regs),
             "registers_ptxas13": regs,
             "spill_bytes": pipeline.get(name, {}).get("spill_bytes")}
      if nvdisasm:
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        row.update(_mix(sass))
      row["programs_per_sm"] = _occupancy(row["registers"])
      out[_op(name)] = row
  return out


def measure_triton(nvdisasm: str | None) -> dict:
  import sass_count  # tools/, beside this script
  out = {}
  for name, r in sass_count.measure("default").items():
    if not name.endswith("_p1"):
      continue
    row = {"instructions": r["instructions"],
           "per_coord": round(r["instructions"] / COORDS_PER_THREAD["triton"], 1),
           "registers": r["registers"], "spill_bytes": r["spill_bytes"],
           "programs_per_sm": _occupancy(r["registers"])}
    out[_op(name)] = row
  if nvdisasm:
    for op, mix in _triton_mix(nvdisasm).items():
      out[op].update(mix)
  return out


def _triton_mix(nvdisasm: str) -> dict:
  import sass_count
  out = {}
  with G.compile_in_child(f"{sass_count.__file__}:compile_units",
                          kwargs={"config": "default", "launch": None}, path=(ROOT,),
                          cwd=ROOT, ptx=True, strict_warnings=False) as build, \
      tempfile.TemporaryDirectory() as tmp:
    for path in build.ptx:
      names = re.findall(r"\.entry (dynamiq_\w+_p1)\(", path.read_text())
      if not names:
        continue
      cubin = pathlib.Path(tmp) / (path.stem + ".cubin")
      subprocess.run([G.ptxas(), "--gpu-name=sm_90a", str(path), "-o", str(cubin)],
                     check=True, capture_output=True)
      sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                            check=True).stdout
      out[_op(names[0])] = _mix(sass)
  return out


def format_table(report: dict) -> str:
  lines = ["| kernel | backend | SASS instr | per coord | registers | programs/SM | memory "
           "instructions |", "|---|---|---:|---:|---:|---:|---|"]
  for op in OPS:
    for backend in ("triton", "mosaic"):
      r = report[backend][op]
      mem = ", ".join(f"{k} {v}" for k, v in r.get("memory", {}).items())
      lines.append(f"| {op} | {backend} | {r['instructions']} | {r['per_coord']} | "
                   f"{r['registers']} | {r['programs_per_sm']} | {mem} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python tools/mosaic_sass.py",
                              description=__doc__.split("\n")[0])
  p.add_argument("--ptxas", required=True, help="a CUDA 13 ptxas (reads PTX 9.0)")
  p.add_argument("--nvdisasm", default=None, help="nvdisasm: instruction mix and memory")
  p.add_argument("--json", default=None, help="also write the report here")
  args = p.parse_args(argv)
  import jax
  if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 11):
    sys.exit(f"jax {jax.__version__}: the Mosaic GPU kernels lower from jax 0.11 on")
  why = G.missing()
  if why:
    sys.exit(why)
  report = {"triton": measure_triton(args.nvdisasm),
            "mosaic": measure_mosaic(args.ptxas, args.nvdisasm), "jax": jax.__version__}
  print(f"Deviceless H100 (sm_90a), jax {jax.__version__}, the default codec's kernels")
  print(format_table(report))
  if args.json:
    from dynamiq_jax.bench import common
    common.write_tool_json(args.json, "tools/mosaic_sass.py", argv or None, report)
  return report


if __name__ == "__main__":
  main()
