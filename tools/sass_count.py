"""Static SASS cost of DynamiQ's Pallas kernels on an H100 (sm_90a), without a GPU.

    python tools/sass_count.py                    # table on stdout
    python tools/sass_count.py --json docs/results/kernels_sass.json --before OLD.json  # and a before / after table

For each configuration (``plane_bits`` and width set) a child process
compiles the four kernels of :mod:`pallas_kernels.dynamiq_triton`
alone for one H100 (the recipe of ``tests/test_gpu_compile_units.py``: a
compile-only topology (:mod:`dynamiq_jax.bench.gpu_compile`), bf16 (``default-f32``: float32) local
values, a chunk of 37 super-groups (``--supergroups``), ``strata=8`` as on an 8-rank ring,
``XLA_FLAGS=--xla_dump_to ... --xla_dump_emitter_re=ptx``, which XLA 0.12
needs to write the PTX; lowered inside the abstract mesh of that device,
which jax >= 0.11 reads the GPU from). This script then assembles each dumped PTX
file with ``ptxas -v --gpu-name=sm_90a -o x.cubin`` (registers and spill
bytes from its report) and reads the cubin's ELF with pyelftools: the
kernel's code is the section ``.text.<kernel>``, and every sm_90 SASS
instruction is 16 bytes. The trailing padding (the ``BRA`` to itself after
the last ``EXIT`` and the ``NOP`` s that align the section to 128 bytes) is
not counted: it is recognised by the opcode field, bits 0-11 of the
instruction (``0x918`` NOP, ``0x947`` BRA), the Volta-and-later encoding,
so no disassembler is needed. (To see the instructions themselves,
``pip download nvidia-cuda-nvdisasm`` (CUDA 13, reads sm_90 cubins) and
``nvdisasm -c x.cubin``; the Triton IR after each pass is dumped with
``XLA_FLAGS=--xla_dump_emitter_re=.*`` next to ``--xla_dump_to``.)

Per coordinate: the kernels are straight-line code (Triton unrolls the whole
block; this script checks that the PTX has no backward branch), so every
thread runs each static instruction once (predicated-off ones still issue),
for ``BLOCK * 256 / (32 num_warps)`` coordinates (4096 / 128 = 32 with
``BLOCK = 16`` and 4 warps). Thread-instructions per coordinate are then
``static / 32``; the bound uses the same unit (3.3e13 thread-instructions/s:
132 SMs x 4 schedulers x 32 lanes x 1.98 GHz, one warp instruction per
scheduler per clock).

The compile-only H100, the child process and ``ptxas`` are those of
:mod:`dynamiq_jax.bench.gpu_compile`, as in ``tests/test_gpu_compile.py``
(the ``gpu-compile`` extra).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys

from dynamiq_jax.bench import gpu_compile as G
from dynamiq_jax.codecs.dynamiq import DEFAULT_EPS

ROOT = pathlib.Path(__file__).resolve().parent.parent

OPS = ("compress", "decompress", "decompress_accumulate", "decompress_accumulate_recompress")
SHORT = {"compress": "compress", "decompress": "decompress",
         "decompress_accumulate": "decompress_accumulate",
         "decompress_accumulate_recompress": "dar"}
MEE = dict(DEFAULT_EPS)  # level_set="mee" with the codec's default eps
CONFIGS = {  # name: (plane_bits, width set, level set[, local values' dtype: bf16])
    "default": (1, (2, 3, 4, 5, 6, 8), "lattice"),  # the per-round codec's
    "default-f32": (1, (2, 3, 4, 5, 6, 8), "lattice", "float32"),  # float32 gradients
    "default-mee": (1, (2, 3, 4, 5, 6, 8), MEE),  # the same with level_set="mee"
    "w4": (1, (4,), "lattice"),
    "w5": (1, (5,), "lattice"),
    "p2": (2, (2, 4, 8), "lattice"),  # the 2-bit-plane layout (the paper's width set)
}
# Throughput model (the issue's): thread-instructions per second of an H100 SXM.
SMS, SCHEDULERS, LANES, CLOCK_HZ = 132, 4, 32, 1.98e9
INSTR_PER_S = SMS * SCHEDULERS * LANES * CLOCK_HZ
HBM_BYTES_PER_S = 3.35e12  # H100 SXM HBM3


SUPERGROUPS = 37
"""The chunk's super-groups by default: odd, so the plane words of a group pair are two
16-bit accesses (``--supergroups 36``: one 32-bit access, as in a step's large buckets)."""


def compile_units(config: str, launch=None, supergroups: int = SUPERGROUPS) -> list:
  """Compiles the four unit kernels of ``config`` alone for one H100 (in the child), at
  ``launch`` (``(block, num_warps)``; None: the kernels' default), for a chunk of
  ``supergroups``."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_triton as T

  [device] = G.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  keys = tuple(np.uint32(v) for v in (1, 2, 3, 4))
  s = supergroups
  pb, ws, levels, *dtype = CONFIGS[config]
  units = s * max(ws) // pb // 2  # about half the widest: every plane is live somewhere
  geo = dict(eps=levels, plane_bits=pb, width_set=ws,
             launch=None if launch is None else tuple(launch))
  x = jax.ShapeDtypeStruct((s, 256), jnp.dtype(dtype[0] if dtype else "bfloat16"),
                           sharding=sharding)
  w = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=sharding)
  p = jax.ShapeDtypeStruct((R.payload_bytes(s, units, pb),), jnp.uint8, sharding=sharding)
  fns = [(lambda x, w: T.compress_pallas(x, w, units, keys=keys, strata=8, **geo), (x, w)),
         (lambda p, w: T.decompress_pallas(p, w, units, **geo), (p, w)),
         (lambda p, x, w: T.decompress_accumulate_pallas(p, x, w, units, **geo), (p, x, w)),
         (lambda p, x, w: T.decompress_accumulate_recompress_pallas(
             p, x, w, units, keys=keys, strata=8, **geo), (p, x, w))]
  out = []
  for f, args in fns:
    with G.gpu_target(device):  # jax >= 0.11 compiles a Pallas kernel for the mesh's GPU
      out.append(jax.jit(f).trace(*args).lower().compile())
  return out


def _has_backward_branch(ptx: str, kernel: str) -> bool:
  """Whether ``kernel``'s PTX branches to a label defined before the branch (a loop)."""
  body = ptx[ptx.index(f".entry {kernel}("):]
  end = re.search(r"\n\}\n", body)
  body = body[:end.start()] if end else body
  seen = set()
  for line in body.splitlines():
    label = re.match(r"\s*(\$?\w+):", line)
    if label:
      seen.add(label.group(1))
    target = re.search(r"\bbra(?:\.uni)?\s+(\$?\w+);", line)
    if target and target.group(1) in seen:
      return True
  return False


def measure(config: str, launch=None, supergroups: int = SUPERGROUPS) -> dict[str, dict]:
  """Compiles ``config``'s kernels (at ``launch``) in a child and returns ``{kernel: report}``
  (:func:`dynamiq_jax.bench.gpu_compile.ptxas_report` with instructions, and whether
  the PTX loops)."""
  with G.compile_in_child(f"{__file__}:compile_units",
                          kwargs={"config": config, "launch": launch, "supergroups": supergroups},
                          path=(ROOT,), cwd=ROOT, ptx=True, strict_warnings=False) as build:
    out = {}
    for path in build.ptx:
      ptx = path.read_text()
      report = G.ptxas_report([path], prefix="dynamiq_", instructions=True)
      for name in re.findall(r"\.entry (dynamiq_\w+)\(", ptx):
        out[name] = dict(report[name], loops=_has_backward_branch(ptx, name))
  return out


def _dar_bytes_per_coord(width: int, local_bytes: int = 2) -> float:
  """DAR's HBM traffic per coordinate at one width, from the kernel's operands:
  the payload read and written (``width`` code bits plus the 18-byte scale
  record per 256 coordinates), the local values read (bf16: 2 bytes) and the
  int32 width per super-group (4 / 256 bytes); the level and plane-offset
  tables are a few hundred bytes per launch (not counted)."""
  payload = (32 * width + 18) / 256
  return 2 * payload + local_bytes + 4 / 256


def table(configs=None, launch=None, supergroups: int = SUPERGROUPS) -> dict:
  """Measures every configuration (at ``launch``: ``(block, num_warps)``, None: the
  default); returns the JSON-able report."""
  from pallas_kernels import dynamiq_triton as T

  configs = configs or list(CONFIGS)
  block, warps = launch or (T.BLOCK, T.NUM_WARPS)
  cpt = block * 256 // (32 * warps)  # coordinates per thread
  rows = []
  for config in configs:
    for name, r in sorted(measure(config, launch, supergroups).items()):
      per = r["instructions"] / cpt
      row = {"config": config, "kernel": name, **r, "coords_per_thread": cpt,
             "instructions_per_coord": round(per, 2),
             "static_bound_coords_per_s": INSTR_PER_S / per}
      if "recompress" in name:
        width = {"w5": 5}.get(config, 4)
        bpc = _dar_bytes_per_coord(width, 4 if config.endswith("f32") else 2)
        roof = HBM_BYTES_PER_S / bpc
        row.update(bytes_per_coord=round(bpc, 4), roofline_coords_per_s=roof,
                   fraction_of_roofline=round(INSTR_PER_S / per / roof, 3))
      rows.append(row)
  rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                       capture_output=True, text=True).stdout.strip()
  return {"command": "python tools/sass_count.py " + " ".join(sys.argv[1:]), "source": rev,
          "supergroups": supergroups,
          "block_supergroups": block, "num_warps": warps, "coords_per_thread": cpt,
          "model": {"thread_instructions_per_s": INSTR_PER_S,
                    "terms": f"{SMS} SMs x {SCHEDULERS} schedulers x {LANES} lanes x "
                             f"{CLOCK_HZ / 1e9} GHz", "hbm_bytes_per_s": HBM_BYTES_PER_S},
          "rows": rows}


def format_table(report: dict) -> str:
  lines = ["| config | kernel | SASS instr | instr/coord | registers | spill bytes | "
           "bound (coords/s) | of HBM roofline |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in report["rows"]:
    frac = f"{r['fraction_of_roofline']:.0%}" if "fraction_of_roofline" in r else ""
    lines.append(f"| {r['config']} | {r['kernel']} | {r['instructions']} | "
                 f"{r['instructions_per_coord']:.1f} | {r['registers']} | {r['spill_bytes']} | "
                 f"{r['static_bound_coords_per_s']:.2e} | {frac} |")
  return "\n".join(lines)


def compare_table(before: dict, after: dict) -> str:
  """Markdown: per configuration and kernel, before and after (bound and roofline
  fraction recomputed from the instruction counts with this file's model)."""
  old = {(r["config"], r["kernel"]): r for r in before["rows"]}
  lines = ["| config | kernel | instr/coord before | after | registers before | after | "
           "spills before | after | DAR bound before (coords/s, of roofline) | after |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in after["rows"]:
    b = old.get((r["config"], r["kernel"]))
    if b is None:
      continue
    bound = ""
    if "roofline_coords_per_s" in r:
      roof = r["roofline_coords_per_s"]
      fb, fa = (INSTR_PER_S / x["instructions_per_coord"] for x in (b, r))
      bound = f"{fb:.2e} ({fb / roof:.0%}) | {fa:.2e} ({fa / roof:.0%})"
    else:
      bound = " | "
    lines.append(f"| {r['config']} | {r['kernel'].replace('dynamiq_', '')} | "
                 f"{b['instructions_per_coord']:.1f} | {r['instructions_per_coord']:.1f} | "
                 f"{b['registers']} | {r['registers']} | {b['spill_bytes']} | "
                 f"{r['spill_bytes']} | {bound} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", default=None,
                 help=f"comma-separated, of {sorted(CONFIGS)} (default: all)")
  p.add_argument("--json", default=None, help="write the report here")
  p.add_argument("--launch", default=None,
                 help="(block)x(num_warps) of the kernels, e.g. 32x8 (default: theirs)")
  p.add_argument("--supergroups", type=int, default=SUPERGROUPS,
                 help="the chunk's super-groups: odd (the default) or even, where the plane "
                      "words of a group pair are one 32-bit access")
  p.add_argument("--before", default=None,
                 help="a report written earlier: print a before / after table against it")
  args = p.parse_args(argv)
  missing = G.missing()
  if missing:
    sys.exit(f"cannot run: {missing}")
  launch = [int(v) for v in args.launch.split("x")] if args.launch else None
  report = table(args.configs.split(",") if args.configs else None, launch, args.supergroups)
  if any(r["loops"] for r in report["rows"]):
    print("warning: a kernel has a loop; its static count is not its per-coordinate cost")
  print(format_table(report))
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
  if args.before:
    print(compare_table(json.loads(pathlib.Path(args.before).read_text()), report))


if __name__ == "__main__":
  main()
