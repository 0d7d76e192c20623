"""Why the Mosaic GPU step overlaps less of the backward pass than Triton's.

    python tools/mosaic_overlap.py            # Triton, Mosaic GPU, Mosaic GPU with a planar wire
    python tools/mosaic_overlap.py --only mosaic

Compiles the step of ``tests/test_overlap.py`` (:mod:`dynamiq_jax.bench.overlap`:
12 layers of 2048 x 2048, batch 2048, deviceless 8 x H100, jax's compile-only
topology, no GPU needed) with ``compressed_psum(implementation=...)`` and
prints, beside the bench's own count (backward GEMMs inside collective
windows), what the payload ring hops look like in the scheduled entry:

* how many of the payload hops (``collective-permute`` of scope
  ``allreduce/bucket<b>/reduce/hop``) stayed asynchronous (XLA 0.12 turns a
  start/done pair with nothing between back into a synchronous op);
* the ops each hop puts between a payload hop's done and the next hop's
  start (the kernel and whatever XLA runs around it), as counts per kind;
* the backward GEMMs scheduled in those gaps, beside the kernels rather than
  inside a window.

The configurations: ``pallas`` (Triton), ``mosaic`` (the Mosaic GPU kernels
on record payloads: :mod:`pallas_kernels.dynamiq_mosaic`'s ``*_mosaic`` convert
record <-> planar around each launch), and ``mosaic-planar-wire``, a
diagnostic only: the same with the conversions removed in the child process,
so that the planar payload goes on the wire. Its program computes the same
sums only because every codec op of the step is then a Mosaic GPU kernel
(``implementation="mosaic"``); the library cannot do this by itself, since
dispatch picks each op's kernel separately and the record layout is what they
share.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dynamiq_jax.bench import gpu_compile  # noqa: E402
from dynamiq_jax.bench.hlo import is_gemm, parse_hlo  # noqa: E402
from dynamiq_jax.bench import overlap  # noqa: E402

MODEL = {"layers": 12, "width": 2048, "batch": 2048}
CONFIGS = ("pallas", "mosaic", "mosaic-planar-wire")
_HOP = re.compile(r"allreduce/bucket(\d+)/reduce/hop/ppermute")
_PLAIN = ("bitcast", "get-tuple-element", "parameter", "constant", "tuple")


def child(spec: dict, planar_wire: bool = False) -> dict:
  """In the child: :func:`dynamiq_jax.bench.overlap.step_in_child`, with the record entry
  points of the Mosaic GPU kernels passing planar payloads through if ``planar_wire``."""
  if planar_wire:
    from pallas_kernels import dynamiq_mosaic as M

    M.compress_mosaic = lambda x, w, u, *, plane_bits=1, **kw: M.compress_planar(
        x, w, u, plane_bits=plane_bits, **kw)
    M.decompress_mosaic = lambda p, w, u, *, plane_bits=1, **kw: M.decompress_planar(
        p, w, u, plane_bits=plane_bits, **kw)
    M.decompress_accumulate_mosaic = (
        lambda p, x, w, u, *, plane_bits=1, **kw: M.decompress_accumulate_planar(
            p, x, w, u, plane_bits=plane_bits, **kw))
    M.decompress_accumulate_recompress_mosaic = (
        lambda p, x, w, u, *, plane_bits=1, **kw: M.decompress_accumulate_recompress_planar(
            p, x, w, u, plane_bits=plane_bits, **kw))
  return overlap.step_in_child(spec)


def compile_config(config: str) -> str:
  """Optimized HLO text of the step for ``config`` (one of :data:`CONFIGS`)."""
  impl = "pallas" if config == "pallas" else "mosaic"
  spec = {"method": "dynamiq", "options": {"implementation": impl}, **MODEL}
  with gpu_compile.compile_in_child(
      f"{os.path.abspath(__file__)}:child",
      kwargs={"spec": spec, "planar_wire": config == "mosaic-planar-wire"},
      xla_flags=gpu_compile.DEVICELESS_XLA_FLAGS, ptx=False, strict_warnings=False) as build:
    return build.hlo[0]


def hops(hlo: str) -> dict:
  """The payload ring hops of the scheduled entry of ``hlo``.

  Returns:
    ``{"hops", "async_hops", "gap_ops": {kind: count}, "gap_backward_gemms",
    "gap_other_ops"}``: the ops between a payload hop's done (or its synchronous op) and
    the next payload hop's start of the same bucket, bitcasts and tuple plumbing left
    out: the codec's (scope ``compressed_psum/``, and XLA's ``dynamic_slice_fusion``
    around a Mosaic GPU kernel, which has no scope) by kind (the opcode, with a fusion's
    kind and a custom call's target), the backward GEMMs, and the rest.
  """
  comps = parse_hlo(hlo)
  entry = comps["ENTRY"].instructions
  counts = collections.Counter()
  gap = collections.Counter()
  last_end = {}  # bucket -> index after its last payload hop's done
  for i, ins in enumerate(entry):
    hop = _HOP.search(ins.attributes)
    if hop is None or not ins.opcode.startswith("collective-permute"):
      continue
    bucket = int(hop.group(1))
    if ins.opcode.endswith("-done"):
      last_end[bucket] = i + 1
      continue
    counts["hops"] += 1
    counts["async_hops"] += ins.opcode.endswith("-start")
    if bucket in last_end:
      for op in entry[last_end[bucket]:i]:
        if op.opcode in _PLAIN:
          continue
        if is_gemm(op, comps):
          counts["gap_backward_gemms"] += "transpose(jvp" in op.attributes
          continue
        if "compressed_psum/" not in op.attributes and "dynamic_slice_fusion" not in op.name:
          counts["gap_other_ops"] += 1  # e.g. the backward pass's elementwise fusions
          continue
        kind = re.search(r"kind=(k\w+)", op.attributes)
        target = re.search(r'custom_call_target="([^"]+)"', op.attributes)
        gap[op.opcode + (f":{kind.group(1)}" if kind else "") +
            (f":{target.group(1)}" if target else "")] += 1
    if not ins.opcode.endswith("-start"):
      last_end[bucket] = i + 1
  return {"hops": counts["hops"], "async_hops": counts["async_hops"],
          "gap_ops": dict(sorted(gap.items())),
          "gap_backward_gemms": counts["gap_backward_gemms"],
          "gap_other_ops": counts["gap_other_ops"]}


def main(argv=None) -> dict:
  """Compiles each configuration and prints its counts.

  Returns:
    ``{config: {"backward_gemms_in_windows", "backward_gemms", **hops(...)}}``.
  """
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", choices=CONFIGS, action="append", help="these configurations only")
  p.add_argument("--hlo-dir", default=None, help="write each optimized HLO text here")
  args = p.parse_args(argv)
  missing = gpu_compile.missing(need_ptxas=False)
  if missing:
    sys.exit(f"cannot run: {missing}")
  out = {}
  for config in args.only or CONFIGS:
    hlo = compile_config(config)
    if args.hlo_dir:
      with open(os.path.join(args.hlo_dir, f"{config}.hlo"), "w", encoding="utf-8") as f:
        f.write(hlo)
    counts = overlap.schedule_counts(hlo)
    out[config] = {"backward_gemms_in_windows": counts["backward_gemms_in_windows"],
                   "backward_gemms": counts["backward_gemms"], **hops(hlo)}
    r = out[config]
    print(f"{config}: backward GEMMs in windows {r['backward_gemms_in_windows']} of "
          f"{r['backward_gemms']}; payload hops asynchronous {r['async_hops']} of {r['hops']}; "
          f"in the done->start gaps: backward GEMMs {r['gap_backward_gemms']}, other "
          f"non-codec ops {r['gap_other_ops']}, codec ops {r['gap_ops']}", flush=True)
  return out


if __name__ == "__main__":
  main()
