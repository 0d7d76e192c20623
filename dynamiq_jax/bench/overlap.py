"""What of a data-parallel step overlaps with the backward pass, compiled for 8 x H100.

    python -m dynamiq_jax.bench.overlap                  # pmean vs DynamiQ, bucket-size sweep
    python -m dynamiq_jax.bench.overlap --tiny           # smoke test (CI)
    python -m dynamiq_jax.bench.overlap --library PATH   # the same against another checkout

No GPU is needed. Each configuration is compiled in a child process (XLA
flags are read once per process) for a compile-only 8 x H100 topology
(:mod:`dynamiq_jax.bench.gpu_compile`: ``jax.experimental.topologies`` with
XLA's H100 SXM spec), as the
data-parallel step of an MLP of ``--layers`` square ``--width`` float32
layers (tanh) on a global batch of ``--batch`` rows: ``jax.grad`` inside
``jax.shard_map(check_vma=True)`` on a per-rank copy of the parameters, then
the all-reduce, then SGD. The reductions compared:

* ``pmean``: ``jax.lax.psum`` of the bf16 gradients (:func:`dynamiq_jax.baseline_psum`);
* ``dynamiq``: ``compressed_psum()``, the defaults; ``dynamiq@S`` with
  ``bucket_size=S``; two ablations of the default: its hops in ``while``
  loops (``UNROLL_MAX_STEPS = 0``) and its buckets not tied one after
  another (``unordered``).

In the scheduled GPU program (the entry computation of the optimized HLO)
it counts the backward GEMMs (GEMM fusions and cuBLAS calls whose source is
``transpose(jvp(...))``) that run inside the asynchronous window of a
collective: between an ``*-start`` and its ``*-done``, the GEMM runs while
data is on the wire. It also counts the codec's kernels of one bucket that
run inside the windows of another bucket's collectives, the collectives by
kind (asynchronous or not: XLA 0.12 turns a collective that overlaps nothing
back into a synchronous op), and the lowering and compile seconds (wall) of
the step.

The second table models the step time of stated training jobs against the
bucket size (:func:`model_step`): what each bucket adds in hops of fixed
latency against how much of the all-reduce hides behind the backward pass.
It is a model, labelled as such.

``--library PATH`` compiles against the ``dynamiq_jax`` at ``PATH`` (e.g. a
worktree of an older commit), to compare before and after; options the
older library lacks are not passed to it. The deviceless compile needs the
``gpu-compile`` extra (``pip install -e '.[gpu-compile]'``); it runs with
:data:`~dynamiq_jax.bench.gpu_compile.DEVICELESS_XLA_FLAGS` (DynamiQ's step
sorts).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

from dynamiq_jax.bench import gpu_compile
from dynamiq_jax.bench.hlo import Instruction, async_windows, is_gemm, parse_hlo

__all__ = ["main", "schedule_counts", "model_step", "model_job", "compile_step"]

DEVICES = 8


# ----------------------------------------------------------------------------
# The child: one configuration compiled for the compile-only topology.


def step_in_child(spec: dict) -> dict:
  """Compiles the step of ``spec`` (in the child) -> ``{"compiled", "info": timings}``."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq

  if "unroll_max_steps" in spec:  # the executor's threshold, for the unroll comparison
    from dynamiq_jax.schedules import executor
    executor.UNROLL_MAX_STEPS = spec["unroll_max_steps"]
  if spec.get("unordered"):  # ablation: buckets not tied one after another
    from dynamiq_jax.engine import programs as engine
    def unordered(xs, reduce_one):
      return [reduce_one(b, x, None) for b, x in enumerate(xs)]

    engine.one_after_another = unordered
  mesh = topologies.make_mesh(gpu_compile.h100_topology(DEVICES), (DEVICES,), ("data",))
  if spec["method"] == "pmean":
    reduction = dq.baseline_psum("data")
  else:
    reduction = dq.compressed_psum("data", **spec.get("options", {}))
  tx = optax.chain(reduction, optax.sgd(1e-3))
  layers, width, batch = spec["layers"], spec["width"], spec["batch"]

  def loss_fn(params, data):
    x, y = data
    for i in range(layers):
      x = jnp.tanh(x @ params[f"w{i}"])
    return jnp.mean((x - y) ** 2)

  def local(params, opt_state, data):
    grads = jax.grad(loss_fn)(dq.as_varying(params, "data"), data)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def sds(shape, *axes, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

  params = {f"w{i}": sds((width, width)) for i in range(layers)}
  opt_state = jax.tree.map(lambda s: sds(s.shape, dtype=s.dtype),
                           jax.eval_shape(tx.init, params))
  data = (sds((batch, width), "data"), sds((batch, width), "data"))
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P()), check_vma=True))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    t0 = time.perf_counter()
    lowered = step.trace(params, opt_state, data).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
  return {"compiled": compiled, "info": {
      "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "jax": jax.__version__}}


def compile_step(spec: dict, library: str | None = None) -> tuple[str, dict]:
  """Compiles ``spec`` in a child process -> (optimized HLO text, timings).

  Args:
    spec: ``{"method": "pmean" | "dynamiq", "options": {...compressed_psum kwargs},
      "layers": L, "width": W, "batch": B}``, optionally ``"unroll_max_steps"`` (the
      schedule executor's :data:`~dynamiq_jax.schedules.executor.UNROLL_MAX_STEPS`) and
      ``"unordered": True`` (buckets not tied one after another: the ablation of
      ``allreduce``'s ordering).
    library: a directory holding the ``dynamiq_jax`` to compile against
      (None: this one).
  """
  # This file, loaded by path: with ``library`` the child's dynamiq_jax is that one.
  with gpu_compile.compile_in_child(
      f"{__file__}:step_in_child", kwargs={"spec": spec},
      xla_flags=gpu_compile.DEVICELESS_XLA_FLAGS, path=[library] if library else [],
      cwd=library, ptx=False, strict_warnings=False) as build:
    return build.hlo[0], build.info


# ----------------------------------------------------------------------------
# Reading the schedule.


_BUCKET = re.compile(r"allreduce/bucket(\d+)/")
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-broadcast",
               "collective-permute", "reduce-scatter")


def _bucket(ins: Instruction) -> int | None:
  scope = _BUCKET.search(ins.attributes)
  return int(scope.group(1)) if scope else None


def _collectives(ins: Instruction, comps) -> list[str]:
  """The collectives ``ins`` runs: itself (``-start`` or synchronous), or those of the
  computations it calls (XLA 0.12 wraps some in an asynchronous ``fusion-start``)."""
  kind = ins.opcode.removesuffix("-start")
  if kind in COLLECTIVES:
    return [kind]
  called = re.findall(r"\bcalls=%?([\w.\-]+)", ins.attributes)
  return [k for name in called if name in comps
          for i in comps[name].instructions for k in _collectives(i, comps)]


def schedule_counts(hlo: str) -> dict:
  """Counts what runs inside asynchronous collective windows in the scheduled entry.

  Args:
    hlo: the optimized HLO module text (``compiled.as_text()``), whose entry
      computation is in schedule order.

  Returns:
    ``{"gemms", "backward_gemms", "backward_gemms_in_windows",
    "codec_ops_in_other_buckets_windows", "codec_ops", "buckets",
    "collectives": {kind: count}}``: a GEMM is one of
    :func:`~dynamiq_jax.bench.hlo.is_gemm`; a backward GEMM is one
    whose source (``op_name``) is ``transpose(jvp(...))``; a window is that of
    an asynchronous start and its done
    (:func:`~dynamiq_jax.bench.hlo.async_windows`) that runs a
    collective; a codec op is a fusion or custom call of scope
    ``allreduce/bucket<b>``; a collective is one of :data:`COLLECTIVES`,
    asynchronous (counted at its start) or not, on its own or inside a fusion
    the entry calls.

  Raises:
    ValueError: the text has no entry computation.
  """
  comps = parse_hlo(hlo)
  if "ENTRY" not in comps:
    raise ValueError("no ENTRY computation in the HLO text")
  entry = comps["ENTRY"]
  inside = collections.defaultdict(list)  # instruction name -> buckets of its windows
  for window in async_windows(entry):
    if not _collectives(window.start, comps):
      continue  # e.g. XLA 0.12's asynchronous dynamic-slice fusions
    for ins in window.between:
      inside[ins.name].append(_bucket(window.start))
  counts = collections.Counter()
  kinds = collections.Counter()
  buckets = set()
  for ins in entry.instructions:
    if ins.opcode.endswith("-done"):
      continue
    collectives = _collectives(ins, comps)
    if collectives:
      kinds.update(collectives)
    elif is_gemm(ins, comps):
      counts["gemms"] += 1
      if "transpose(jvp" in ins.attributes:
        counts["backward_gemms"] += 1
        counts["backward_gemms_in_windows"] += ins.name in inside
    elif _bucket(ins) is not None and ins.opcode in ("fusion", "custom-call"):
      bucket = _bucket(ins)
      buckets.add(bucket)
      counts["codec_ops"] += 1
      others = [b for b in inside.get(ins.name, ()) if b is not None and b != bucket]
      counts["codec_ops_in_other_buckets_windows"] += bool(others)
  return {
      "gemms": counts["gemms"], "backward_gemms": counts["backward_gemms"],
      "backward_gemms_in_windows": counts["backward_gemms_in_windows"],
      "codec_ops": counts["codec_ops"],
      "codec_ops_in_other_buckets_windows": counts["codec_ops_in_other_buckets_windows"],
      "buckets": len(buckets), "collectives": dict(sorted(kinds.items())),
  }


# ----------------------------------------------------------------------------
# The step-time model.


def model_step(*, coords: int, bucket_size: int, max_buckets: int | None, n: int,
               backward_s: float, link_gbps: float, hop_latency_s: float, bits: float,
               codec_s_per_coord: float) -> dict:
  """Modelled time of one step's backward pass + bucketed all-reduce.

  The gradient is one leaf of ``coords`` coordinates, bucketed as
  :func:`dynamiq_jax.bucket_layout` does (DynamiQ's 256-coordinate blocks);
  the backward pass produces it at an even rate over ``backward_s``, in
  bucket order, and bucket b is ready when its last coordinate is. Buckets
  are reduced one after another (as :func:`dynamiq_jax.allreduce` orders
  them): bucket b starts when it is ready and bucket b-1 is done, and takes
  its fixed latency (``n + 3`` latency-bound steps: the guard, the
  statistics' all-to-all and all-gather, the payload ring's ``n - 1`` hops
  and its gather, each ``hop_latency_s``), its bytes on the link (``2 (n-1)/n`` of ``bits`` per
  coordinate) and its codec kernels (``codec_s_per_coord``, counted as
  serial time, not overlapped with the wire).

  Returns:
    ``{"buckets", "fixed_latency_hops", "step_s", "exposed_s"}``: the end
    of the last bucket's all-reduce (at least ``backward_s``), and how much
    of it comes after the backward pass.
  """
  import jax

  from dynamiq_jax._sizes import round_up
  from dynamiq_jax.engine.buckets import bucket_layout
  from dynamiq_jax.schedules.plan import ring_bytes_per_rank

  layout = bucket_layout(jax.ShapeDtypeStruct((coords,), "float32"),
                         bucket_size=round_up(bucket_size, 256), max_buckets=max_buckets)
  sizes = [b[0].stop - b[0].start for b in layout]
  hops = n + 3
  rate = link_gbps * 1e9 / 8
  end, produced = 0.0, 0
  for d in sizes:
    produced += d
    ready = backward_s * produced / coords
    wire_s = ring_bytes_per_rank(d * bits / 8, n) / rate
    work = hops * hop_latency_s + wire_s + d * codec_s_per_coord
    end = max(end, ready) + work
  return {"buckets": len(sizes), "fixed_latency_hops": hops * len(sizes),
          "step_s": max(end, backward_s), "exposed_s": max(end - backward_s, 0.0)}


# ----------------------------------------------------------------------------
# The benchmark.


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.overlap",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--layers", type=int, default=12, help="MLP layers")
  p.add_argument("--width", type=int, default=2048, help="MLP width (square float32 layers)")
  p.add_argument("--batch", type=int, default=2048, help="global batch (rows)")
  p.add_argument("--bucket-sizes", default="4194304,8388608,16777216,67108864",
                 help="comma-separated bucket sizes (coordinates) to compile DynamiQ with, "
                      "besides the library's default")
  p.add_argument("--library", default=None,
                 help="compile against the dynamiq_jax at this directory (e.g. a worktree of "
                      "an older commit) instead of this one")
  p.add_argument("--label", default=None,
                 help="writes overlap_<label>.json instead of overlap.json (e.g. 'before')")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  return p


def model_job(params: float) -> dict:
  """The modelled job: a transformer of ``params`` parameters, 8 data-parallel hosts (one
  rank each on the slow network), 8192 tokens per rank per step."""
  return {"coords": int(params), "n": 8, "backward_s": 4 * params * 8192 / 400e12,
          "bits": 5.0, "codec_s_per_coord": 2 * 3.4 / 1.6e12}


MODEL_NOTE = (
    "a transformer of P parameters, n = 8 ranks; backward = 4 x P x 8192 tokens FLOPs at "
    "400 TFLOP/s; DynamiQ at 5.0 bits/coord; codec kernels 2 x 3.4 bytes/coord at 1.6 TB/s "
    "(half of H100's HBM); link rate and per-hop latency as in each row; 'vs best' against "
    "the best power-of-two bucket size without a bucket limit")


MODEL_PARAMS = (125e6, 350e6, 1.3e9, 7e9)
MODEL_LINKS = ((100, 20e-6), (25, 20e-6), (100, 50e-6))


def _model_table(bucket_sizes, max_buckets):
  """Modelled step time for each job size, link and bucket size, against the best."""
  rows = []
  for params in MODEL_PARAMS:
    job = model_job(params)
    for gbps, latency in MODEL_LINKS:
      net = dict(link_gbps=gbps, hop_latency_s=latency, **job)
      best = min(model_step(bucket_size=1 << k, max_buckets=None, **net)["step_s"]
                 for k in range(16, 35))
      for size in bucket_sizes:
        for cap in (None, max_buckets):
          m = model_step(bucket_size=size, max_buckets=cap, **net)
          m.update(params=params, bucket_size=size, max_buckets=cap, link_gbps=gbps,
                   hop_latency_us=latency * 1e6, best_step_s=best,
                   vs_best=m["step_s"] / best)
          rows.append(m)
  return rows


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  missing = gpu_compile.missing(need_ptxas=False)
  if missing:
    sys.exit(f"cannot run: {missing}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads the machine
  from dynamiq_jax.bench.common import command_line, machine, write_results

  if args.tiny:  # two layers of 65536 coordinates in two buckets (each a quarter of 2^18)
    args.layers, args.width, args.batch = 2, 256, 256
    args.bucket_sizes = str(1 << 18)
  shape = {"layers": args.layers, "width": args.width, "batch": args.batch}
  sizes = [int(s) for s in args.bucket_sizes.split(",") if s]
  specs = [("pmean", {"method": "pmean"})]
  if not args.tiny:
    specs.append(("dynamiq", {"method": "dynamiq"}))
  if not (args.library or args.tiny):  # ablations of the default: what each part buys
    specs.append(("dynamiq, hops in loops", {"method": "dynamiq", "unroll_max_steps": 0}))
    specs.append(("dynamiq, unordered", {"method": "dynamiq", "unordered": True}))
  specs += [(f"dynamiq@{s}", {"method": "dynamiq", "options": {"bucket_size": s}})
            for s in sizes]
  runs = {}
  print(f"{'reduction':<24} {'bwd GEMMs in windows':>21} {'other-bucket codec ops':>23} "
        f"{'collectives':>12} {'compile s':>10} {'lower s':>8}")
  for label, spec in specs:
    hlo, times = compile_step({**spec, **shape}, library=args.library)
    counts = schedule_counts(hlo)
    runs[label] = {**counts, **times, "options": spec.get("options", {}),
                   "load_avg_1min": round(os.getloadavg()[0], 2)}  # a shared machine's noise
    print(f"{label:<24} {counts['backward_gemms_in_windows']:>10} of {counts['backward_gemms']:<8}"
          f" {counts['codec_ops_in_other_buckets_windows']:>10} of {counts['codec_ops']:<10}"
          f" {sum(counts['collectives'].values()):>12} {times['compile_s']:>10.1f}"
          f" {times['lower_s']:>8.1f}", flush=True)

  from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE, DEFAULT_MAX_BUCKETS
  model = _model_table(sorted(set(sizes) | {DEFAULT_BUCKET_SIZE}), DEFAULT_MAX_BUCKETS)
  print(f"\nModelled step time (not measured): {MODEL_NOTE}")
  print(f"{'params':>8} {'link':>9} {'latency':>8} {'bucket':>10} {'max':>5} {'buckets':>8}"
        f" {'step s':>8} {'vs best':>8}")
  for r in model:
    print(f"{r['params']:>8.2g} {r['link_gbps']:>4} Gb/s {r['hop_latency_us']:>5.0f} us "
          f"{r['bucket_size']:>10} {str(r['max_buckets']):>5} {r['buckets']:>8} "
          f"{r['step_s']:>8.4f} {r['vs_best']:>8.3f}")
  payload = {
      "benchmark": "overlap", "command": command_line(), "machine": machine(),
      "library": args.library or "this checkout", "shape": shape,
      "default_bucket_size": DEFAULT_BUCKET_SIZE if not args.library else None,
      "runs": runs, "model": {"note": MODEL_NOTE, "rows": model},
  }
  write_results("overlap", args, payload)
  return payload


if __name__ == "__main__":
  main()
