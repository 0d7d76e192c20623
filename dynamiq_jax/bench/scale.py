"""What the data-parallel step of a transformer costs to compile and to hold, against pmean's.

    python -m dynamiq_jax.bench.scale                    # ~125 M, ~350 M, ~1.3 B, 1.3 B scanned
    python -m dynamiq_jax.bench.scale --sizes 1.3b       # one size
    python -m dynamiq_jax.bench.scale --tiny             # smoke test (CI)
    python -m dynamiq_jax.bench.scale --sizes 1.3b --bucket-size 134217728   # 11 buckets

No GPU is needed. Each step is compiled in a child process
(:func:`~dynamiq_jax.bench.gpu_compile.compile_in_child`) by XLA's GPU
pipeline for a compile-only 8 x H100 host, as a user's data-parallel step
would be: a decoder-only transformer (pre-norm, causal attention with
128-wide heads, GELU MLP, untied float32 embedding and output matrices),
``jax.grad`` inside ``jax.shard_map(check_vma=True)`` on a per-rank copy of
the parameters, the gradient reduction, SGD. Its layers are unrolled (one
pytree entry per layer, as most Flax models) or, with ``scan``, stacked under
``jax.lax.scan`` (as MaxText and Levanter write them). Two reductions of the
same step, side by side:

* ``pmean``: ``jax.lax.psum`` of the bf16 gradients (:func:`dynamiq_jax.baseline_psum`);
* ``default``: ``dynamiq_jax.compressed_psum()`` with its defaults;
* ``stacked`` (scanned layers only): ``compressed_psum(stacked="layers")``, the
  stacked gradient reduced in loops (:mod:`dynamiq_jax.engine.stacked`).

For each: the child's CPU seconds (``time.process_time``, every thread) to
trace and lower the step and to compile it, the device temporaries
(``compiled.memory_analysis().temp_size_in_bytes``), the optimized HLO's
instructions and collectives, the backward GEMMs that run inside a
collective's asynchronous window (:func:`dynamiq_jax.bench.overlap.schedule_counts`),
and for ``default`` the instructions of one bucket by the named scope that
made them (:func:`bucket_scopes`). One compile's CPU seconds vary by 10-20% even
on an idle machine: ``--repeat k`` compiles each step k times in turns and
takes the ratios of the medians (every run's seconds are in the JSON).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

from dynamiq_jax.bench import gpu_compile
from dynamiq_jax.bench.hlo import parse_hlo

__all__ = ["SIZES", "model_shapes", "loss_fn", "step_in_child", "compile_step", "median_run",
           "instructions", "bucket_scopes", "main"]

DEVICES = 8

SIZES = {
    "23m": {"layers": 6, "d": 512, "f": 2048, "vocab": 4096},
    "125m": {"layers": 12, "d": 768, "f": 3072, "vocab": 32000},
    "350m": {"layers": 24, "d": 1024, "f": 4096, "vocab": 32000},
    "1.3b": {"layers": 24, "d": 2048, "f": 8192, "vocab": 32000},
}
"""Transformer shapes (attention heads of 128): 23 M (a small model: few buckets, where the
bucket size decides the overlap), 134 M, 367 M and 1.34 B parameters."""

TINY = {"layers": 4, "d": 512, "f": 2048, "vocab": 4096}
"""The smoke test's model (16.8 M parameters), on sequences of :data:`TINY_SEQ` tokens,
with buckets of :data:`TINY_BUCKET` coordinates (20 buckets): many buckets and few
activations, where what the buckets hold and how they are ordered shows."""

TINY_SEQ, TINY_BUCKET = 32, 1 << 20

BATCH, SEQ = 16, 512
"""Global batch: 16 sequences of 512 tokens (2 per device)."""


def model_shapes(layers: int, d: int, f: int, vocab: int, scan: bool = False):
  """The parameters as ``jax.ShapeDtypeStruct`` (float32): 8 leaves per layer, 3 more."""
  import jax

  def sds(*shape):
    return jax.ShapeDtypeStruct(shape, "float32")

  layer = {"attn_norm": sds(d), "q": sds(d, d), "k": sds(d, d), "v": sds(d, d),
           "o": sds(d, d), "mlp_norm": sds(d), "up": sds(d, f), "down": sds(f, d)}
  stack = ({k: sds(layers, *v.shape) for k, v in layer.items()} if scan
           else [dict(layer) for _ in range(layers)])
  return {"embed": sds(vocab, d), "layers": stack,
          "out": {"norm": sds(d), "unembed": sds(d, vocab)}}


def loss_fn(params, tokens, *, scan: bool = False, compute: str = "float32",
            remat: bool = False):
  """Next-token cross-entropy of the transformer on int32 ``tokens`` [batch, seq + 1].

  ``compute``: the dtype the parameters are cast to for the forward pass (``"bfloat16"``:
  float32 parameters, bf16 compute, as mixed-precision training writes it); the
  log-softmax is taken in float32. ``remat``: each layer under ``jax.checkpoint`` (its
  activations recomputed in the backward pass), so that the step's peak memory is the
  gradient's, not the activations'."""
  import jax
  import jax.numpy as jnp

  params = jax.tree.map(lambda p: p.astype(compute), params)

  def norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

  def block(x, p):
    b, t, d = x.shape
    heads = d // 128
    h = norm(x, p["attn_norm"])
    q, k, v = (jnp.einsum("btd,de->bte", h, p[n]).reshape(b, t, heads, d // heads)
               for n in "qkv")
    s = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(jnp.float32(d // heads))
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    a = jnp.einsum("bhts,bshk->bthk", jax.nn.softmax(s, -1), v).reshape(b, t, d)
    x = x + a @ p["o"]
    return x + jax.nn.gelu(norm(x, p["mlp_norm"]) @ p["up"]) @ p["down"]

  if remat:
    block = jax.checkpoint(block)
  x = params["embed"][tokens[:, :-1]]
  if scan:
    x, _ = jax.lax.scan(lambda x, p: (block(x, p), None), x, params["layers"])
  else:
    for p in params["layers"]:
      x = block(x, p)
  logits = norm(x, params["out"]["norm"]) @ params["out"]["unembed"]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


def step_in_child(spec: dict) -> dict:
  """Lowers and compiles the step of ``spec`` (in the child) -> ``{"compiled", "info"}``.

  ``spec``: ``{"method": "pmean" | "default" | "stacked", "model": {...}, "scan": bool,
  "options": {...compressed_psum kwargs}, "batch", "seq"}``; ``"unchained": True``
  is the ablation of :func:`dynamiq_jax.engine.one_after_another` (buckets not tied
  one after another).
  """
  import jax
  import jax.numpy as jnp
  import optax
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq

  if spec.get("unchained"):  # ablation: the buckets' collectives not tied one after another
    from dynamiq_jax.engine import programs as engine
    engine.one_after_another = lambda xs, reduce_one: [reduce_one(b, x, None)
                                                       for b, x in enumerate(xs)]
  mesh = topologies.make_mesh(gpu_compile.h100_topology(DEVICES), (DEVICES,), ("data",))
  if spec["method"] == "pmean":
    reduction = dq.baseline_psum("data")
  elif spec["method"] == "stacked":
    reduction = dq.compressed_psum("data", stacked="layers", **spec.get("options", {}))
  else:
    reduction = dq.compressed_psum("data", **spec.get("options", {}))
  tx = optax.chain(reduction, optax.sgd(1e-3))
  scan = spec.get("scan", False)

  def local(params, opt_state, tokens):
    grads = jax.grad(loss_fn)(dq.as_varying(params, "data"), tokens, scan=scan,
                              compute=spec.get("compute", "float32"),
                              remat=spec.get("remat", False))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def put(s, *axes):
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P(*axes)))

  shapes = model_shapes(scan=scan, **spec["model"])
  params = jax.tree.map(put, shapes)
  opt_state = jax.tree.map(put, jax.eval_shape(tx.init, shapes))
  tokens = jax.ShapeDtypeStruct((spec.get("batch", BATCH), spec.get("seq", SEQ) + 1), jnp.int32,
                                sharding=NamedSharding(mesh, P("data")))
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P()), check_vma=True))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = step.trace(params, opt_state, tokens).lower()
    c1, t1 = time.process_time(), time.perf_counter()
    if spec.get("memory"):  # compiled with XLA's dump on: its CPU time includes the dump
      from dynamiq_jax.bench import buffers
      memory, compiled = buffers.breakdown(lowered, categorize)
    else:
      memory, compiled = None, lowered.compile()
    c2, t2 = time.process_time(), time.perf_counter()
  extra = {} if memory is None else {"memory": {
      k: memory[k] for k in ("at_peak", "own_max", "temp_live_at_peak", "packing",
                             "peak_time", "program_length")}}
  return {"compiled": compiled, "info": {**extra,
      "lower_cpu_s": round(c1 - c0, 2), "compile_cpu_s": round(c2 - c1, 2),
      "lower_wall_s": round(t1 - t0, 2), "compile_wall_s": round(t2 - t1, 2),
      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
      "params": sum(int(s.size) for s in jax.tree.leaves(shapes)),
      "leaves": len(jax.tree.leaves(shapes)), "jax": jax.__version__}}


def categorize(op_name: str, is_argument: bool) -> str:
  """A scratch value's category by the ``op_name`` of the instruction that made it: the
  bucket phase (:data:`SCOPES`, ``bucket/other`` for the rest of a bucket), ``backward``,
  ``forward`` or ``other`` (the optimizer, conversions)."""
  if is_argument:
    return "argument"
  m = _SCOPE.search(f'op_name="{op_name}"')
  if m:
    return "bucket/" + next((label for label, key in SCOPES if key in m.group(2)), "other")
  if "transpose(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "forward"
  return "other"


def instructions(hlo: str) -> int:
  """HLO instructions in the module text (every computation's, fusions' included)."""
  return sum(1 for line in hlo.splitlines() if re.match(r"\s*(ROOT )?%?[\w.\-]+ = ", line))


_SCOPE = re.compile(r'op_name="[^"]*?allreduce/bucket(\d+)/(?:jit\(run_program\)/)?([^"]*)"')
SCOPES = (("metadata", "metadata"), ("allocation", "dynamiq/allocate"),
          ("statistics", "dynamiq/stats"), ("guard", "guard"), ("hops", "reduce/"),
          ("gather", "gather"))
"""Named scopes of a bucket, by what they do (the first that matches an op's name)."""


def bucket_scopes(hlo: str) -> dict:
  """Instructions per bucket by what made them: ``{"buckets", "per_bucket": {scope: n},
  "top_level": n}``.

  Every instruction of the module whose ``op_name`` lies under
  ``allreduce/bucket<b>/`` is counted under the first of :data:`SCOPES` its
  name contains, else ``"other"`` (finish, error estimate, conversions);
  the counts are averages over the buckets. ``top_level``: the median bucket's
  top-level operations (launches, collectives: :func:`bucket_cost.top_level
  <dynamiq_jax.bench.bucket_cost.top_level>`).
  """
  from dynamiq_jax.bench import bucket_cost  # pylint: disable=import-outside-toplevel

  launches = collections.Counter(
      m.group(1) for m in (_SCOPE.search(ins.line)
                           for ins in bucket_cost.top_level(parse_hlo(hlo))) if m)
  counts = collections.Counter()
  buckets = set()
  for line in hlo.splitlines():
    m = _SCOPE.search(line)
    if not m or not re.match(r"\s*(ROOT )?%?[\w.\-]+ = ", line):
      continue
    buckets.add(m.group(1))
    scope = next((label for label, key in SCOPES if key in m.group(2)), "other")
    counts[scope] += 1
  n = max(len(buckets), 1)
  ordered = sorted(launches.values())
  return {"buckets": len(buckets),
          "per_bucket": {k: round(v / n) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
          "top_level": ordered[len(ordered) // 2] if ordered else 0}


def compile_step(spec: dict, library: str | None = None,
                 kernel_cache: str | None = None) -> dict:
  """Compiles ``spec`` (:func:`step_in_child`) in a child process -> its figures (this file
  is loaded by path there: with ``library`` the child's dynamiq_jax is that one).
  ``kernel_cache``: XLA's GPU kernel cache file (:func:`gpu_compile.compile_in_child`):
  the same HLO, but CPU seconds without the kernels an earlier compile left there."""
  from dynamiq_jax.bench.overlap import schedule_counts

  with gpu_compile.compile_in_child(
      f"{__file__}:step_in_child", kwargs={"spec": spec},
      xla_flags=gpu_compile.DEVICELESS_XLA_FLAGS, path=[library] if library else [],
      cwd=library, ptx=False, strict_warnings=False, timeout=3600,
      kernel_cache=kernel_cache) as build:
    hlo, info = build.hlo[0], dict(build.info)
  counts = schedule_counts(hlo)
  info.update(instructions=instructions(hlo), collectives=counts["collectives"],
              backward_gemms=counts["backward_gemms"],
              backward_gemms_in_windows=counts["backward_gemms_in_windows"])
  if spec["method"] == "default":
    info["scopes"] = bucket_scopes(hlo)
  return info


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.scale",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--sizes", default="125m,350m,1.3b,1.3b-scan",
                 help=f"comma-separated, of {', '.join(SIZES)} (unrolled layers) and the same "
                      f"with -scan (layers under jax.lax.scan)")
  p.add_argument("--methods", default="pmean,default,stacked",
                 help="comma-separated, of pmean, default and stacked (scanned layers only); "
                      "pmean is always compiled (every ratio is against it)")
  p.add_argument("--library", default=None,
                 help="compile against the dynamiq_jax at this directory (e.g. a worktree of "
                      "an older commit) instead of this one")
  p.add_argument("--bucket-size", type=int, default=None,
                 help="the compressed steps' bucket_size (coordinates; unset: the library's "
                      "default): fewer, larger buckets trade compile time for overlap")
  p.add_argument("--compute", default="float32", choices=["float32", "bfloat16"],
                 help="the forward pass's dtype (parameters stay float32)")
  p.add_argument("--remat", action="store_true",
                 help="each layer under jax.checkpoint: the peak is then the gradient's")
  p.add_argument("--memory", action="store_true",
                 help="also report what the scratch memory holds at its peak, by category "
                      "(XLA's buffer assignment; the compile then includes XLA's dump)")
  p.add_argument("--repeat", type=int, default=1,
                 help="compiles of each step, taken in turns (pmean, default, ..., pmean, "
                      "...): the ratios are of the medians, since one compile's CPU seconds "
                      "vary by 10-20%% on a shared machine")
  p.add_argument("--label", default=None, help="writes scale_<label>.json instead of scale.json")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  p.add_argument("--kernel-cache", default=None,
                 help="XLA's GPU kernel cache file, shared by the compiles (kept): a kernel "
                      "already there is not compiled again, so the CPU seconds and their "
                      "ratios leave it out; the HLO figures are the same. Unset: none")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  return p


def _row(name, method, r, base=None):
  ratio = ""
  if base is not None:
    ratio = (f" {r['total_cpu_s'] / base['total_cpu_s']:>6.1f}x"
             f" {r['temp_bytes'] / base['temp_bytes']:>6.2f}x")
  buckets = r["scopes"]["buckets"] if "scopes" in r else ""
  return (f"{name:<10} {method:<8} {r['params'] / 1e6:>7.0f} {r['lower_cpu_s']:>8.1f} "
          f"{r['compile_cpu_s']:>9.1f} {r['temp_bytes'] / 2**30:>8.2f} {r['instructions']:>9} "
          f"{r['backward_gemms_in_windows']:>5}/{r['backward_gemms']:<5}{ratio} {buckets:>7}")


def median_run(runs: list) -> dict:
  """The run of median total CPU seconds (the lower middle of an even count), with every
  run's seconds beside it."""
  r = dict(sorted(runs, key=lambda r: r["total_cpu_s"])[(len(runs) - 1) // 2])
  r["total_cpu_s_runs"] = [x["total_cpu_s"] for x in runs]
  return r


def main(argv=None) -> dict:
  args = build_parser().parse_args(argv)
  missing = gpu_compile.missing(need_ptxas=False)
  if missing:
    sys.exit(f"cannot run: {missing}")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads the machine
  from dynamiq_jax.bench.common import command_line, machine, write_results

  options = {}
  if args.bucket_size is not None:  # the library's own check, before minutes of compiling
    import dynamiq_jax as dq
    try:
      dq.bucket_layout([], codec=dq.codecs.DynamiQ(), bucket_size=args.bucket_size)
    except ValueError as e:
      sys.exit(f"--bucket-size {args.bucket_size}: {e}")
    options["bucket_size"] = args.bucket_size
  if args.tiny:
    cases = {"tiny": (TINY, False, {"bucket_size": TINY_BUCKET, **options})}
  else:
    cases = {}
    for name in [s.strip() for s in args.sizes.split(",") if s.strip()]:
      base = name.removesuffix("-scan")
      if base not in SIZES:
        sys.exit(f"--sizes: unknown size {name!r}; choose from {', '.join(SIZES)} "
                 f"(optionally with -scan)")
      cases[name] = (SIZES[base], name.endswith("-scan"), dict(options))
  methods = {m.strip() for m in args.methods.split(",") if m.strip()}
  if methods - {"pmean", "default", "stacked"}:
    sys.exit(f"--methods: unknown {sorted(methods - {'pmean', 'default', 'stacked'})}; choose "
             f"from pmean, default, stacked")
  if args.repeat < 1:
    sys.exit(f"--repeat {args.repeat}: give at least 1 compile of each step")
  if args.kernel_cache:
    print(f"(the compiles share the kernel cache {args.kernel_cache}: their CPU seconds leave "
          f"out the kernels already there)")
  print(f"{'model':<10} {'method':<8} {'M par':>7} {'lower s':>8} {'compile s':>9} "
        f"{'temp GiB':>8} {'HLO instr':>9} {'bwd GEMMs':>11} {'CPU s':>7} {'temp':>7} "
        f"{'buckets':>7}")
  runs = {}
  for name, (model, scan, options) in cases.items():
    chosen = [m for m in ("pmean", "default", "stacked")
              if m == "pmean" or (m in methods and (scan or m != "stacked"))]
    found = collections.defaultdict(list)
    for _ in range(args.repeat):
      for method in chosen:
        spec = {"method": method, "model": model, "scan": scan, "compute": args.compute,
                "remat": args.remat, "memory": args.memory,
                "options": options if method != "pmean" else {}}
        if args.tiny:
          spec["seq"] = TINY_SEQ
        r = compile_step(spec, library=args.library, kernel_cache=args.kernel_cache)
        r["total_cpu_s"] = round(r["lower_cpu_s"] + r["compile_cpu_s"], 2)
        found[method].append(r)
        print(_row(name, method, r, found["pmean"][-1] if method != "pmean" else None),
              flush=True)
        if "memory" in r:
          print("    at the peak (GiB): " + ", ".join(
              f"{k} {v / 2**30:.2f}" for k, v in sorted(r["memory"]["at_peak"].items(),
                                                        key=lambda kv: -kv[1])), flush=True)
    rows = {m: median_run(rs) for m, rs in found.items()}
    if args.repeat > 1:
      for method in chosen:
        print(_row(name, "median", rows[method],
                   rows["pmean"] if method != "pmean" else None) + f"  ({method})", flush=True)
    p = rows["pmean"]
    ratios = {m: {"cpu_s": round(d["total_cpu_s"] / p["total_cpu_s"], 2),
                  "temp_bytes": round(d["temp_bytes"] / p["temp_bytes"], 3),
                  "instructions": round(d["instructions"] / p["instructions"], 2),
                  "backward_gemms_in_windows": [d["backward_gemms_in_windows"],
                                                p["backward_gemms_in_windows"]]}
              for m, d in rows.items() if m != "pmean"}
    if "default" in ratios:
      rows["ratios"] = ratios["default"]
    if "stacked" in ratios:
      rows["ratios_stacked"] = ratios["stacked"]
    runs[name] = {"model": model, "scan": scan, "options": options, **rows}
  payload = {"benchmark": "scale", "command": command_line(), "machine": machine(),
             "target": f"{DEVICES} x H100 (compile-only)", "library": args.library or
             "this checkout", "compute": args.compute, "remat": args.remat,
             "batch": [BATCH, TINY_SEQ if args.tiny else SEQ],
             "kernel_cache": args.kernel_cache, "runs": runs}
  write_results("scale", args, payload)
  return payload


if __name__ == "__main__":
  main()
