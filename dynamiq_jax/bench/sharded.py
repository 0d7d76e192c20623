"""Sharded models: what the compressed reduction talks over, what it costs in memory, and
HSDP across processes over emulated links.

    sudo python -m dynamiq_jax.bench.sharded           # all four parts
    python -m dynamiq_jax.bench.sharded --tiny         # smoke test (no namespaces)

The model is the byte-level transformer LM of ``examples/nnx_sharded_lm`` on 8
devices, trained with ``dq.nnx.DataParallel`` and DynamiQ (5 bits):

1. ``hlo``: the compiled training step of the ``tensor`` layout (mesh 4 data x 2
   model, heads and MLP split over ``model``), with Auto and with Explicit axes:
   every collective and the mesh axes its device groups span
   (:mod:`dynamiq_jax.bench.hlo`). The reduction must talk over ``data`` only;
   the tensor-parallel all-reduces of activations run over ``model``.
2. ``memory``: ``compiled.memory_analysis()`` of the step, per device, for the
   replicated layout (``data``: parameters and Adam state on every device,
   ``compressed_psum``) against the sharded optimizer (``zero``: both split over
   the 8 devices, ``compressed_psum_scatter``) and ``hsdp`` (split over the 4
   devices of a host). Arguments are the parameters and the optimizer state;
   the scratch is split by what its buffers hold (gathered parameters,
   activations, backward values, the reduction's buckets and codec buffers,
   the optimizer's update) from XLA's own buffer assignment
   (:mod:`dynamiq_jax.bench.buffers`, :func:`categorize`), at the step's peak and
   as each category's own maximum over the step.
3. ``gradient``: the gradient's own memory in the sharded-optimizer step against
   the replicated one, on a model whose gradient dominates its memory (a tanh
   MLP, :data:`GRADIENT_MLP`, :func:`dynamiq_jax.data_parallel_step`), under
   each of XLA:CPU's two schedulers (:data:`SCHEDULERS`): how much of the local
   gradient is live at once depends on whether the schedule reduces each
   bucket as the backward pass produces it.
4. ``hsdp``: the ``hsdp`` layout (2 hosts x 4 devices) trained for ``--steps``
   steps twice: on 8 simulated devices in this process, and as 2 processes x 4
   CPU devices (:mod:`dynamiq_jax.training.multiprocess`, gloo), each process in its own
   network namespace (:mod:`dynamiq_jax.bench.netns`), so that the ``host`` axis
   is the only traffic on a process's link. Each process reads its link's byte
   and packet counters around every step; the bytes are compared with what
   ``dq.scatter_wire_stats`` says DynamiQ puts on the slow axis for the shards
   of the 4 devices, and the losses with the one-process run, bit for bit.

Writes ``docs/results/sharded.json`` and ``sharded.md`` (the printed report).
Without root (or with ``--tiny``, which runs everything smaller and never
creates namespaces) the processes talk over loopback and no bytes are
measured; the output says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench.sharded_report import CATEGORIES, GRADIENT, HEADER_BYTES, gradient_bytes
from dynamiq_jax.bench.sharded_report import gradient_floor, render, report_lines

__all__ = ["main", "collective_table", "memory_rows", "gradient_rows", "gradient_floor",
           "mlp_loss", "expected_slow_bytes", "categorize", "CATEGORIES", "gradient_bytes",
           "PARTS", "SCHEDULERS", "GRADIENT_PATHS"]

PARTS = ("hlo", "memory", "gradient", "hsdp")
"""The report's parts, in order (the module docstring)."""

MODEL = dict(dim=128, heads=4, layers=2, context=64, batch_size=32)
TINY_MODEL = dict(dim=32, heads=2, layers=1, context=16, batch_size=16)
MEMORY_MODEL = dict(dim=512, heads=8, layers=4, context=64, batch_size=32)


def _config(layout: str, tiny: bool, **kw):
  from dynamiq_jax.examples.nnx_sharded_lm import train
  sizes = TINY_MODEL if tiny else MODEL
  model_axis = {"tensor": 2, "hsdp": 4}.get(layout, 1)
  return train.Config(**dict(dict(sizes, layout=layout, model_axis=model_axis), **kw))


def _lowered(config, devices, text):
  """The training step of ``config`` lowered for ``devices`` (and its DataParallel)."""
  import jax  # noqa: F401
  from dynamiq_jax.examples.nnx_sharded_lm import train
  dp = train.build(config, devices)
  step = dp.train_step(train.loss_fn)
  return step.jitted.lower(dp.state, train.place_batch(dp, train.batch(config, text, 0))), dp


def collective_table(tiny: bool, text, codec: str = "dynamiq") -> list[dict]:
  """Part 1: the tensor layout's compiled step, Auto and Explicit axes (``tiny``: Auto
  only; tests/test_sharded.py compiles both): every collective by op and mesh axes, and
  those over ``model`` one by one (result type, JAX op name)."""
  import re
  import jax
  from dynamiq_jax.bench import hlo

  rows = []
  for kind in ("auto",) if tiny else ("auto", "explicit"):
    lowered, dp = _lowered(_config("tensor", tiny, axis_types=kind, codec=codec),
                           jax.devices(), text)
    found = hlo.collectives(lowered.compile().as_text(), dp.mesh)
    model = []
    for c in found:
      if "model" in c.axes:
        name = re.search(r'op_name="([^"]*)"', c.line)
        model.append({"op": c.op, "axes": list(c.axes), "shape": c.shape,
                      "op_name": name.group(1) if name else ""})
    rows.append({"axis_types": kind, "mesh": dict(dp.mesh.shape),
                 "collectives": hlo.summary(found), "over_model": model,
                 "all_gathers_over_model": sum(m["op"] == "all-gather" for m in model)})
  return rows


def categorize(op_name: str, is_argument: bool) -> str:
  """The category of a buffer of the training step, from the ``op_name`` of the
  instruction that defines it (:mod:`dynamiq_jax.bench.buffers`).

  Arguments: ``parameters`` (``state[0]``, the model), ``optimizer state``
  (``state[1]``), ``other`` (the batch). Scratch: ``reduction`` (the named scopes
  ``compressed_psum`` / ``compressed_psum_scatter`` / ``baseline_psum``: gradient
  buckets, codec buffers, the reduced gradient), ``gathered parameters``
  (``gather_params``: parameters all-gathered for the forward pass), ``backward``
  (``transpose(jvp(...))``: parameter gradients and the activations' cotangents),
  ``activations`` (``jvp(...)``: forward values, kept for the backward pass),
  ``optimizer update`` (the rest of the ``optimizer`` scope: Adam's arithmetic),
  ``other``.
  """
  if is_argument:
    return ("parameters" if op_name.startswith("state[0]") else
            "optimizer state" if op_name.startswith("state[1]") else "other")
  if "compressed_psum" in op_name or "baseline_psum" in op_name:
    return "reduction"
  if "gather_params" in op_name:
    return "gathered parameters"
  if "transpose(" in op_name:
    return "backward"
  if "jvp(" in op_name:
    return "activations"
  if "optimizer" in op_name:
    return "optimizer update"
  return "other"


def memory_rows(tiny: bool, text, codec: str = "dynamiq", bucket_sizes=(None,),
                layouts=("data", "zero", "hsdp")) -> list[dict]:
  """Part 2: ``memory_analysis()`` per device of the replicated, zero and hsdp steps, for
  each of ``bucket_sizes`` (None: the library's default), and what the step's scratch
  holds at its peak, by :func:`categorize` (:func:`dynamiq_jax.bench.buffers.breakdown`)."""
  import jax
  from dynamiq_jax.engine.buckets import DEFAULT_BUCKET_SIZE
  from dynamiq_jax.bench import buffers
  rows = []
  for layout, bucket_size in [(a, b) for b in bucket_sizes for a in layouts]:
    bucket_size = bucket_size or DEFAULT_BUCKET_SIZE
    config = _config(layout, tiny, codec=codec, bucket_size=bucket_size,
                     **({} if tiny else MEMORY_MODEL))
    lowered, dp = _lowered(config, jax.devices(), text)
    peak, _ = buffers.breakdown(lowered, categorize, {"gradient": GRADIENT})
    state = dp.state
    params, opt = state[0], state[1]

    full = int(sum(x.nbytes for x in jax.tree.leaves(params)))
    rows.append({
        "layout": layout, "mesh": dict(dp.mesh.shape), "bucket_size": bucket_size,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "param_bytes": full,
        "param_bytes_per_device": _bytes_per_device(params),
        "gathered_param_bytes": full - _bytes_per_device(params),
        "optimizer_bytes_per_device": _bytes_per_device(opt),
        "argument_bytes": peak["argument_bytes"],
        "output_bytes": peak["output_bytes"],
        "temp_bytes": peak["temp_bytes"],
        "alias_bytes": peak["alias_bytes"],
        "peak": {k: peak[k] for k in ("at_peak", "own_max", "arguments", "temp_live_at_peak",
                                      "packing", "peak_time", "xla_peak",
                                      "xla_peak_recounted", "own_max_time", "last_defined",
                                      "program_length")},
    })
  return rows


GRADIENT_MLP = dict(layers=32, dim=512, batch=256)
"""Part 4's model: ``layers`` float32 ``dim`` x ``dim`` weights of a tanh MLP (no biases),
``batch`` rows per device. Its gradient is most of its memory, as a large model's is with
small per-device batches, so the reduction's schedule decides the step's peak."""
TINY_GRADIENT_MLP = dict(layers=4, dim=128, batch=16)

SCHEDULERS = ("concurrency", "memory", "h100")
"""Where part 4 compiles its steps, each in a child process: XLA:CPU with each of its two
schedulers, by ``--xla_cpu_enable_concurrency_optimized_scheduler`` (true, its default,
orders the program breadth-first for its concurrent executor; false picks the
memory-minimizing schedule; XLA reads the flag once per process, and a compile's own
``compiler_options`` do not reach it), and XLA's GPU compiler for 8 compile-only H100s
(:mod:`dynamiq_jax.bench.gpu_compile`; skipped without the ``gpu-compile`` extra)."""

GRADIENT_PATHS = ("replicated", "zero", "xla pmean")
"""Part 4's steps: ``compressed_psum`` on replicated parameters, ``compressed_psum_scatter``
on parameters split over the 8 devices (:func:`dynamiq_jax.zero_shardings`), and XLA's own
float32 all-reduce (``baseline_psum``) on replicated parameters; Adam after each."""


def gradient_rows(tiny: bool, codec: str = "dynamiq", bucket_size: int | None = None,
                  timeout: float = 1500) -> list[dict]:
  """Part 4: the gradient's memory in the sharded-optimizer step against the replicated one,
  on a model whose gradient dominates (:data:`GRADIENT_MLP`), under each of XLA:CPU's
  schedulers (:data:`SCHEDULERS`, one child process each): ``memory_analysis()`` per device
  and, from XLA's buffer assignment, the most gradient bytes live at once (backward values +
  the reduction's buffers) and those live at the step's peak. ``bucket_size`` None: one
  layer's weights (``dim ** 2``)."""
  import subprocess
  import sys
  if bucket_size is None:
    bucket_size = (TINY_GRADIENT_MLP if tiny else GRADIENT_MLP)["dim"] ** 2
  from dynamiq_jax.bench import gpu_compile
  no_gpu_compile = gpu_compile.missing(need_ptxas=False)
  rows = []
  for scheduler in SCHEDULERS:
    if scheduler == "h100" and no_gpu_compile:
      print(f"gradient: no H100 rows: {no_gpu_compile}", flush=True)
      continue
    flag = ("--xla_cpu_enable_concurrency_optimized_scheduler="
            + ("false" if scheduler == "memory" else "true"))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip())
    with tempfile.TemporaryDirectory() as d:
      out = os.path.join(d, "rows.json")
      cmd = [sys.executable, "-m", "dynamiq_jax.bench.sharded", "--gradient-child", out,
             "--gradient-target", "h100" if scheduler == "h100" else "cpu",
             "--codec", codec, "--gradient-bucket-size", str(bucket_size)]
      subprocess.run(cmd + (["--tiny"] if tiny else []), env=env, check=True, timeout=timeout)
      with open(out) as f:
        rows += [dict(r, scheduler=scheduler) for r in json.load(f)]
  return rows


def mlp_loss(ws, x):
  """Part 4's loss: the mean square of ``tanh(... tanh(x @ ws[0]) ... @ ws[-1])``."""
  import jax.numpy as jnp
  h = x
  for w in ws:
    h = jnp.tanh(h @ w)
  return jnp.mean(h ** 2)


def _gradient_child(tiny: bool, codec: str, bucket_size: int, target: str, out: str) -> None:
  """In a child of :func:`gradient_rows`: compiles the three steps for ``target`` (``cpu``:
  8 CPU devices; ``h100``: 8 compile-only H100s, the arguments built on the CPU devices,
  then passed as ``jax.ShapeDtypeStruct`` of the same shardings), writes their rows."""
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import dynamiq_jax as dq
  from dynamiq_jax.bench import buffers, gpu_compile

  size = TINY_GRADIENT_MLP if tiny else GRADIENT_MLP
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  target_mesh = gpu_compile.h100_mesh((8,), ("data",)) if target == "h100" else mesh

  def on_target(tree):
    if target_mesh is mesh:
      return tree
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(target_mesh, a.sharding.spec)), tree)

  rng = np.random.default_rng(0)
  weights = [rng.normal(0, size["dim"] ** -0.5, (size["dim"],) * 2).astype(np.float32)
             for _ in range(size["layers"])]
  x = jax.device_put(rng.normal(size=(8 * size["batch"], size["dim"])).astype(np.float32),
                     NamedSharding(mesh, P("data")))

  kw = dict(codec=dq.codec_from_name(codec, **({"bits": 5.0} if codec == "dynamiq" else {})),
            bucket_size=bucket_size)
  reductions = {"replicated": dq.compressed_psum("data", **kw),
                "zero": dq.compressed_psum_scatter("data", **kw),
                "xla pmean": dq.baseline_psum("data", dtype=jnp.float32)}
  whole = sum(w.nbytes for w in weights)
  rows = []
  for path in GRADIENT_PATHS:
    tx = optax.chain(reductions[path], optax.adam(1e-3))
    shardings = (dq.zero_shardings(weights, mesh=mesh, min_size=0) if path == "zero" else
                 [NamedSharding(mesh, P())] * len(weights))
    params = jax.device_put(weights, shardings)
    state = dq.data_parallel_init(tx, params, mesh=mesh)
    lowered = dq.data_parallel_step(mlp_loss, tx, mesh=target_mesh).lower(
        *on_target((params, state, x)))
    peak, _ = buffers.breakdown(lowered, categorize, {"gradient": GRADIENT})
    rows.append({"path": path, "mlp": size, "bucket_size": bucket_size,
                 "local_gradient_bytes": whole,
                 "param_bytes_per_device": _bytes_per_device(params),
                 "optimizer_bytes_per_device": _bytes_per_device(state),
                 "argument_bytes": peak["argument_bytes"], "temp_bytes": peak["temp_bytes"],
                 "gradient_most_live": int(peak["own_max"].get("gradient", 0)),
                 "gradient_at_peak": gradient_bytes(peak["at_peak"]),
                 "temp_live_at_peak": peak["temp_live_at_peak"]})
  with open(out, "w") as f:
    json.dump(rows, f)


def _bytes_per_device(tree) -> int:
  """The bytes one device holds of the arrays of ``tree`` (its first shard of each)."""
  import jax
  return int(sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree)))


def expected_slow_bytes(config, local_devices: int, hosts: int) -> dict:
  """What DynamiQ sends over the slow axis per step, per device and per process."""
  import jax
  from flax import nnx
  from dynamiq_jax.examples.nnx_sharded_lm import train
  import dynamiq_jax as dq
  with nnx.use_eager_sharding(False):
    model = nnx.eval_shape(lambda: train.ByteLM(config, rngs=nnx.Rngs(0)))
  grads = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                       nnx.state(model, nnx.Param))
  codec = dq.codec_from_name(config.codec, **({"bits": config.bits}
                                              if config.codec == "dynamiq" else {}))
  stats = dq.scatter_wire_stats(grads, codec=codec, n=local_devices, schedule="hierarchical",
                                slow=hosts,
                                scatter_dimension=dq.scatter_dimensions(grads, n=local_devices))
  return {"per_device": stats.bytes_per_rank, "per_process": stats.bytes_per_rank * local_devices,
          "bits_per_coord": stats.bits_per_coord, "coords": stats.coords}


# ---------------------------------------------------------------------------
# part 3: the worker processes


def _counters():
  base = "/sys/class/net/eth0/statistics"
  try:
    with open(f"{base}/tx_bytes") as a, open(f"{base}/tx_packets") as b, \
         open(f"{base}/rx_bytes") as c, open(f"{base}/rx_packets") as d:
      return [int(a.read()), int(b.read()), int(c.read()), int(d.read())]
  except OSError:
    return None


def _worker(cfg: dict, rank: int, coordinator: str) -> None:
  from dynamiq_jax.training import multiprocess
  multiprocess.initialize(coordinator, num_processes=cfg["processes"], process_id=rank,
                          local_devices=cfg["local_devices"])
  import jax
  from dynamiq_jax.examples import datasets
  from dynamiq_jax.examples.nnx_sharded_lm import train

  config = train.Config(**cfg["config"])
  text = datasets.python_source_corpus(cfg["corpus_bytes"]).train
  steps = []
  before = [_counters()]

  def on_step(i, loss):
    after = _counters()
    steps.append({"step": i, "loss_bits": int(np.asarray(loss, np.float32).view(np.uint32)),
                  "counters": [before[0], after]})
    before[0] = after

  losses, _ = train.train(config, jax.devices(), text, on_step=on_step)
  print("RESULT " + json.dumps({"rank": rank, "steps": steps}), flush=True)


def _simulated(config, text) -> list[int]:
  import jax
  from dynamiq_jax.examples.nnx_sharded_lm import train
  losses, _ = train.train(config, jax.devices(), text)
  return [int(np.asarray(v, np.float32).view(np.uint32)) for v in losses]


def _link_rows(results) -> list[dict]:
  rows = []
  for res in sorted(results, key=lambda r: r["rank"]):
    per_step = []
    for s in res["steps"][1:]:  # step 0 also sets up gloo's connections
      a, b = s["counters"]
      if a is None or b is None:
        continue
      tx, txp, rx, rxp = (b[i] - a[i] for i in range(4))
      per_step.append({"tx_bytes": tx, "tx_packets": txp, "rx_bytes": rx, "rx_packets": rxp})
    if not per_step:
      rows.append({"rank": res["rank"], "measured": False})
      continue
    med = {k: statistics.median(p[k] for p in per_step) for k in per_step[0]}
    rows.append({"rank": res["rank"], "measured": True, "steps": len(per_step), **med,
                 "tx_payload_estimate": med["tx_bytes"] - HEADER_BYTES * med["tx_packets"],
                 "per_step": per_step})
  return rows


def hsdp_run(args, shaped: bool) -> dict:
  """Part 3 (see the module docstring)."""
  from dynamiq_jax.examples import datasets
  from dynamiq_jax.bench.netns import worker_job

  config = _config("hsdp", args.tiny, steps=args.steps, codec=args.codec)
  text = datasets.python_source_corpus(args.corpus_bytes).train
  print(f"hsdp: {config.steps} steps on 8 simulated devices in this process ...", flush=True)
  simulated = _simulated(config, text)
  cfg = {"processes": 2, "local_devices": 4, "config": dataclasses.asdict(config),
         "corpus_bytes": args.corpus_bytes}
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(cfg, f)
    path = f.name
  try:
    with worker_job("dynamiq_jax.bench.sharded", 2, path, shaped=shaped) as (job, net):
      if net:
        net.set_rate(None)
      results = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
      job.wait(timeout=120)
  finally:
    os.unlink(path)
  losses = [[s["loss_bits"] for s in r["steps"]] for r in sorted(results, key=lambda r: r["rank"])]
  same = all(lb == simulated for lb in losses)
  links = _link_rows(results) if shaped else [{"rank": r["rank"], "measured": False}
                                              for r in results]
  expected = expected_slow_bytes(config, 4, 2)
  return {"config": dataclasses.asdict(config), "namespaces": shaped,
          "losses_simulated": [float(np.uint32(b).view(np.float32)) for b in simulated],
          "loss_bits_simulated": simulated, "loss_bits_processes": losses,
          "bit_identical": same, "expected": expected, "links": links}


# ---------------------------------------------------------------------------
# the driver


def _keep_other_parts(payload: dict, path: str, parts) -> None:
  """The parts of an earlier ``path`` that this run did not measure, kept in ``payload``
  with the command and machine that did (``payload["kept"]``)."""
  if not os.path.exists(path):
    return
  with open(path) as f:
    earlier = json.load(f)
  for part in PARTS:
    if part not in parts and part in earlier:
      payload[part] = earlier[part]
      source = earlier.get("kept", {}).get(part) or {"command": earlier["command"],
                                                     "machine": earlier["machine"]}
      payload.setdefault("kept", {})[part] = source


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module docstring as written, and every flag's default."""


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.sharded", description=__doc__,
                              formatter_class=_HelpFormatter)
  p.add_argument("--parts", default="hlo,memory,gradient,hsdp",
                 help="comma-separated: hlo, memory, gradient, hsdp; the other parts of an "
                      "existing sharded.json in --out are kept (with the command that "
                      "measured them)")
  p.add_argument("--bucket-sizes", default="default,1048576",
                 help="memory: comma-separated bucket sizes in coordinates ('default': the "
                      "library's)")
  p.add_argument("--codec", default="dynamiq",
                 help="dynamiq (5 bits), or a name in dq.REDUCERS that can reduce-scatter")
  p.add_argument("--steps", type=int, default=8, help="hsdp training steps")
  p.add_argument("--corpus-bytes", type=int, default=1_000_000, help="training text bytes")
  p.add_argument("--tiny", action="store_true",
                 help="smoke-test sizes (CI); never creates network namespaces")
  p.add_argument("--no-shaping", action="store_true", help="loopback, no namespaces")
  p.add_argument("--timeout", type=float, default=1500, help="seconds the processes may take")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  p.add_argument("--render", default=None, metavar="JSON",
                 help="only rewrite sharded.md beside JSON from it (no measurement)")
  p.add_argument("--gradient-bucket-size", type=int, default=None,
                 help="gradient: the reduction's bucket size in coordinates; unset: one "
                      "layer's weights, so each bucket is one layer's gradient")
  p.add_argument("--gradient-child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--gradient-target", default="cpu", help=argparse.SUPPRESS)
  p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  p.add_argument("--config", default=None, help=argparse.SUPPRESS)
  return p


def main(argv=None):
  args = build_parser().parse_args(argv)
  if args.render:  # sharded.md again from a results file (e.g. after a format change)
    with open(args.render) as f:
      payload = json.load(f)
    with open(os.path.join(os.path.dirname(args.render), "sharded.md"), "w") as f:
      f.write(render(payload))
    return payload
  if args.gradient_child:
    _gradient_child(args.tiny, args.codec, args.gradient_bucket_size, args.gradient_target,
                    args.gradient_child)
    return None
  if common.run_worker(args, _worker):
    return None
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  from dynamiq_jax.examples import datasets
  from dynamiq_jax.bench.netns import shaping
  parts = [p.strip() for p in args.parts.split(",") if p.strip()]
  unknown = set(parts) - set(PARTS)
  if unknown:
    raise SystemExit(f"--parts: unknown {sorted(unknown)}; use {', '.join(PARTS)}")
  if args.tiny:
    args.steps = min(args.steps, 3)
    args.corpus_bytes = min(args.corpus_bytes, 200_000)
  text = datasets.python_source_corpus(args.corpus_bytes).train
  payload = {"benchmark": "sharded", "command": common.command_line(),
             "machine": common.machine(), "tiny": args.tiny}
  if "hlo" in parts:
    payload["hlo"] = collective_table(args.tiny, text, args.codec)
  if "memory" in parts:
    sizes = [None if b.strip() == "default" else int(b) for b in args.bucket_sizes.split(",")]
    payload["memory"] = memory_rows(args.tiny, text, args.codec, sizes)
  if "gradient" in parts:
    payload["gradient"] = gradient_rows(args.tiny, args.codec, args.gradient_bucket_size,
                                        args.timeout)
  if "hsdp" in parts:
    shaped = shaping(args.no_shaping or args.tiny)
    payload["hsdp"] = hsdp_run(args, shaped)
  out = common.results_dir(args.out)
  _keep_other_parts(payload, os.path.join(out, "sharded.json"), parts)
  print("\n".join(report_lines(payload)))
  path = common.write_json(os.path.join(out, "sharded.json"), payload)
  with open(os.path.join(out, "sharded.md"), "w") as f:
    f.write(render(payload))
  print(f"\nwrote {path} and sharded.md")
  if "hsdp" in parts and not payload["hsdp"]["bit_identical"]:
    raise SystemExit("the processes' losses differ from the one-process run")
  return payload


if __name__ == "__main__":
  main()
