"""What one more bucket adds to a compiled step: HLO instructions and top-level operations.

    python -m dynamiq_jax.bench.bucket_cost                  # buckets of 2^20, ring of 8
    python -m dynamiq_jax.bench.bucket_cost --size 8388608   # buckets of 2^23
    python -m dynamiq_jax.bench.bucket_cost --tiny           # smoke test (CI)
    python -m dynamiq_jax.bench.bucket_cost --estimate       # with the error estimate kept

No GPU is needed. The default compressed all-reduce of ``k`` equal leaves
(one bucket each: ``bucket_size`` is four times a leaf, so that the layout cuts
``k <= 8`` buckets of a leaf each, :func:`dynamiq_jax.bucket_layout`) is compiled
in a child process (:func:`~dynamiq_jax.bench.gpu_compile.compile_in_child`)
by XLA's GPU pipeline for a compile-only 8 x H100 host, for ``k = 3`` and
``k = 4``; the difference is what one bucket costs. The bare all-reduce's
error estimate is unused, so XLA drops it; ``--estimate`` keeps it (returns
``AllReduceStats.error_estimate``), as :func:`~dynamiq_jax.compressed_psum`
does in its state:

* **HLO instructions** of the optimized module (every computation's, fusion
  bodies included): XLA's passes visit each one, and a bucket's are visited
  again for every bucket (its kernels are compiled once per shape);
* **top-level operations**: the entry computation's instructions less
  parameters, constants, tuples, their elements, bitcasts and the ``-done``
  halves of asynchronous pairs: each is a kernel launch, a collective or a
  loop at run time;
* **kernels**: the distinct fusions and custom calls among them (XLA compiles
  identical ones once): a bucket of a shape already compiled should bring none;

and, for one bucket in the middle, both by the named scope that made them
(guard, statistics, metadata, allocation, hops, gather, other): its own
top-level operations are their sum (the difference above also counts what
changes at the end of the step: each leaf's output, the last bucket's result
unfused). Counts are deterministic (no timing); the CPU seconds of each compile
are printed beside them, a shared machine's (the second compile reuses the first's
kernels through XLA's kernel cache).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import sys
import tempfile

from dynamiq_jax.bench import gpu_compile
from dynamiq_jax.bench.hlo import parse_hlo

__all__ = ["step_in_child", "top_level", "kernels", "by_scope", "measure", "main"]

DEVICES = 8
TRIVIAL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})
"""Entry-computation opcodes that launch nothing."""
_SCOPE = re.compile(r'op_name="[^"]*?allreduce/bucket(\d+)/([^"]*)"')
PHASES = (("guard", "guard"), ("statistics", "dynamiq/stats"), ("metadata", "metadata"),
          ("allocation", "dynamiq/allocate"), ("hops", "reduce/"), ("gather", "gather"))
"""A bucket's phases, by the named scope its instructions carry (first match)."""


def step_in_child(buckets: int, size: int, schedule: str = "ring", estimate: bool = False) -> dict:
  """Compiles (in the child) the all-reduce of ``buckets`` leaves of ``size`` coordinates
  (``estimate``: and its error estimate)."""
  import time

  import jax
  import jax.numpy as jnp
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from dynamiq_jax.engine.buckets import SMALLEST_BUCKET_FRACTION

  mesh = topologies.make_mesh(gpu_compile.h100_topology(DEVICES), (DEVICES,), ("data",))
  tree = [jax.ShapeDtypeStruct((size * DEVICES,), jnp.float32,
                               sharding=NamedSharding(mesh, P("data"))) for _ in range(buckets)]

  def local(xs):
    out, stats = dq.allreduce(xs, axis_name="data", codec=dq.codecs.DynamiQ(),
                              schedule=schedule, key=jax.random.key(0),
                              bucket_size=size * SMALLEST_BUCKET_FRACTION)
    return (out, stats.error_estimate) if estimate else out

  out_specs = (P("data"), P()) if estimate else P("data")
  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),), out_specs=out_specs))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    c0 = time.process_time()
    compiled = f.trace(tree).lower().compile()
    c1 = time.process_time()
  return {"compiled": compiled, "info": {"cpu_s": round(c1 - c0, 2)}}


def _instructions(comps):
  return [(name, ins) for name, comp in comps.items() for ins in comp.instructions]


def top_level(comps) -> list:
  """The entry computation's operations that run something (see the module docstring)."""
  return [ins for ins in comps["ENTRY"].instructions
          if ins.opcode not in TRIVIAL and not ins.opcode.endswith("-done")]


_NAME = re.compile(r"%([\w.\-]+)")
_METADATA = re.compile(r"metadata=\{[^{}]*\}|, scheduling_name=\"[^\"]*\"")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
"""A called computation: a fusion's body, a reduction's combiner (each bucket has copies of
its own, identical but for their names)."""


def _fingerprint(comps, ins, memo) -> str:
  """What identifies the kernel of a fusion or custom call ``ins``: its shape, and the
  called computations' instructions with names replaced by positions (recursively), or
  the custom call's configuration; metadata dropped."""
  text = f"{ins.shape} {ins.opcode} " + _METADATA.sub("", ins.attributes)
  called = _CALLED.findall(ins.attributes)
  for name in called:
    if name not in memo:
      comp = comps[name]
      index = {i.name: str(k) for k, i in enumerate(comp.instructions)}
      memo[name] = "\n".join(
          _fingerprint(comps, i, memo) if _CALLED.search(i.attributes) else
          f"{i.shape} {i.opcode}(" + _NAME.sub(lambda m: index.get(m.group(1), "?"), i.operands)
          + ") " + _METADATA.sub("", i.attributes) for i in comp.instructions)
    text = text.replace(name, memo[name])
  return text


def kernels(comps) -> int:
  """The distinct kernels the top-level operations launch: fusions and custom calls that
  differ in more than their names (XLA compiles an identical one once)."""
  memo = {}
  return len({_fingerprint(comps, ins, memo) for ins in top_level(comps)
              if ins.opcode in ("fusion", "custom-call")})


def _phase(scope: str) -> str:
  return next((label for label, key in PHASES if key in scope), "other")


def by_scope(comps, bucket: int) -> dict:
  """``{phase: [instructions, top-level operations]}`` of bucket ``bucket``."""
  out = collections.defaultdict(lambda: [0, 0])
  entry = {id(ins) for ins in top_level(comps)}
  for _, ins in _instructions(comps):
    m = _SCOPE.search(ins.line)
    if m and int(m.group(1)) == bucket:
      row = out[_phase(m.group(2))]
      row[0] += 1
      row[1] += id(ins) in entry
  return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def measure(size: int, schedule: str = "ring", estimate: bool = False,
            kernel_cache: str | os.PathLike | None = None) -> dict:
  """One bucket's cost: the compiles of 3 and 4 buckets, their difference, and bucket 2's
  instructions by phase.

  The compiles share XLA's kernel cache (``--xla_gpu_kernel_cache_file``): the second
  takes the first's compiled kernels instead of compiling them again, which changes
  no HLO, only its CPU seconds. ``kernel_cache``: the cache file (e.g. one for several
  calls); None: a temporary one for this call's two compiles.
  """
  with contextlib.ExitStack() as stack:
    if kernel_cache is None:
      kernel_cache = os.path.join(stack.enter_context(tempfile.TemporaryDirectory()),
                                  "kernels.bin")
    runs = {}
    for k in (3, 4):
      with gpu_compile.compile_in_child(
          "dynamiq_jax.bench.bucket_cost:step_in_child",
          kwargs={"buckets": k, "size": size, "schedule": schedule, "estimate": estimate},
          xla_flags=gpu_compile.DEVICELESS_XLA_FLAGS, ptx=False, strict_warnings=False,
          kernel_cache=kernel_cache) as build:
        comps = parse_hlo(build.hlo[0])
        runs[k] = {"instructions": len(_instructions(comps)), "top_level": len(top_level(comps)),
                   "kernels": kernels(comps),
                   "sorts": sum(ins.opcode == "sort" for _, ins in _instructions(comps)),
                   "cpu_s": build.info["cpu_s"], "phases": by_scope(comps, 2)}
  return {"size": size, "schedule": schedule, "devices": DEVICES, "estimate": estimate,
          "per_bucket": {key: runs[4][key] - runs[3][key]
                         for key in ("instructions", "top_level", "kernels", "sorts")},
          "middle_top_level": sum(top for _, top in runs[4]["phases"].values()),
          "phases": runs[4]["phases"], "runs": {str(k): v for k, v in runs.items()}}


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.bucket_cost",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--size", type=int, default=1 << 20,
                 help="coordinates per bucket (a multiple of 256)")
  p.add_argument("--schedule", default="ring", help="the all-reduce's schedule")
  p.add_argument("--label", default=None,
                 help="writes bucket_cost_<label>.json instead of bucket_cost.json")
  p.add_argument("--estimate", action="store_true",
                 help="keep the error estimate (as compressed_psum does)")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI): buckets of 2^16")
  p.add_argument("--kernel-cache", default=None,
                 help="XLA's kernel cache file for the compiles (kept; e.g. shared by "
                      "several runs); unset: a temporary one")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  return p


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  missing = gpu_compile.missing(need_ptxas=False)
  if missing:
    sys.exit(f"cannot run: {missing}")
  size = 1 << 16 if args.tiny else args.size
  if size < 256 or size % 256:
    sys.exit(f"--size {size} must be a positive multiple of 256 (DynamiQ's super-group)")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads the machine
  from dynamiq_jax.bench.common import command_line, machine, write_results

  r = measure(size, args.schedule, args.estimate, args.kernel_cache)
  print(f"one bucket of {size} coordinates, {args.schedule} of {DEVICES} (8 x H100, compile-only)"
        + (", error estimate kept" if args.estimate else ""))
  print(f"  HLO instructions {r['per_bucket']['instructions']:>6}   top-level operations "
        f"{r['per_bucket']['top_level']:>4}   kernels {r['per_bucket']['kernels']}   "
        f"sorts {r['per_bucket']['sorts']}   "
        f"(compile CPU s: 3 buckets "
        f"{r['runs']['3']['cpu_s']}, 4 buckets {r['runs']['4']['cpu_s']} with the 3's kernels)")
  print(f"  a middle bucket's own top-level operations {r['middle_top_level']}, by phase:")
  print(f"  {'phase':<12} {'instructions':>12} {'top-level':>9}")
  for phase, (ins, top) in r["phases"].items():
    print(f"  {phase:<12} {ins:>12} {top:>9}")
  payload = {"benchmark": "bucket_cost", "command": command_line(), "machine": machine(),
             "target": f"{DEVICES} x H100 (compile-only)", **r}
  write_results("bucket_cost", args, payload)
  return payload


if __name__ == "__main__":
  main()
