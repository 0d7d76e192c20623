"""Wall-clock all-reduce and training-step times over rate-limited links.

    sudo python -m dynamiq_jax.bench.net                        # the full sweep
    sudo python -m dynamiq_jax.bench.net --workers 4 --sizes-mb 64 --rates 100
    python -m dynamiq_jax.bench.net --tiny                      # smoke test (CI)

Launches ``--workers`` JAX processes (one CPU device each, gloo over TCP),
each in its own network namespace whose veth link into a bridge namespace is
rate limited with ``tc`` (:mod:`dynamiq_jax.bench.netns`): an emulated
cluster of one-NIC hosts on a switch. Without root it falls back to plain
loopback and says that no shaping is applied.

Every process compiles every measured reduction once (on the unshaped
network), then for each link rate the driver re-shapes the links and the
processes time, side by side:

* ``psum-f32`` / ``psum-bf16``: ``jax.lax.psum`` (gloo's all-reduce);
* ``<codec>/<schedule>``: :func:`dynamiq_jax.allreduce` with each codec on
  each schedule, ``bf16-ring/ring`` being the uncompressed ring through the
  same code path.

A measurement is the slowest process's time from a common barrier to its
result (median over ``--repeats``). Speedup = the fastest uncompressed
method's time / the method's time; "ideal" is the same ratio of bytes each
rank sends (a ring's ``2 (n-1)/n`` of the payload). Each process's
compression throughput is measured too (the codec's arithmetic alone, all
processes at once, as in the real all-reduce), which sets the crossover link
rate below which compression no longer pays on this CPU. With ``--lm`` the
processes also time full training steps of a small transformer LM with each
reduction.

Writes ``docs/results/net.json`` and ``net_speedup.png``. Every namespace,
link and process this creates is removed at the end, also on error or
Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench.netns import driver_commands, shaping, worker_job

__all__ = ["main", "parse_method", "summarize"]

UNCOMPRESSED = ("psum-f32", "psum-bf16", "bf16-ring/ring")
LM_PARAMS = dict(vocab=256, seq_len=128, d_model=384, heads=6, layers=4, mlp=4)


def parse_method(name: str):
  """``"psum-f32"``, ``"psum-bf16"`` or ``"<codec>/<schedule>[@<tile MiB>]"``.

  Returns ``(kind, codec, schedule, tile_mb)``. ``<codec>`` is a registry
  name (``dynamiq``, ``mxfp8``, ...); ``dynamiq4`` etc. name DynamiQ at that
  many bits. ``@<tile MiB>`` overrides ``--tile-mb`` for this method
  (``@0``: the whole gradient in one bucket); ``tile_mb`` is None otherwise.
  """
  import dynamiq_jax as dq

  if name in ("psum-f32", "psum-bf16"):
    return "psum", name, None, None
  tile_mb = None
  if "@" in name:
    name, tile = name.rsplit("@", 1)
    try:
      tile_mb = float(tile)
    except ValueError:
      raise ValueError(f"method {name}@{tile}: tile {tile!r} is not a number of MiB") from None
    if tile_mb < 0:
      raise ValueError(f"method {name}@{tile}: the tile size must be >= 0 MiB (0: one bucket)")
  if "/" not in name:
    raise ValueError(f"method {name!r}: use 'psum-f32', 'psum-bf16' or '<codec>/<schedule>', "
                     f"e.g. 'dynamiq/ring' or 'mxfp8/butterfly'")
  codec_name, schedule = name.split("/", 1)
  if schedule not in ("ring", "butterfly"):
    raise ValueError(f"method {name!r}: schedule {schedule!r} is not 'ring' or 'butterfly'")
  if codec_name.startswith("dynamiq") and codec_name[7:]:
    try:
      bits = float(codec_name[7:])
    except ValueError:
      raise ValueError(f"method {name!r}: DynamiQ bits {codec_name[7:]!r} is not a number"
                       ) from None
    return "allreduce", dq.codecs.DynamiQ(bits=bits), schedule, tile_mb
  return "allreduce", dq.codec_from_name(codec_name), schedule, tile_mb


ONE_BUCKET = 1 << 40
"""A bucket size larger than any gradient here: the whole gradient in one bucket."""


def tile_coords(tile_mb: float) -> int:
  """Bucket size in coordinates for tiles of ``tile_mb`` MiB of bf16 (0: one bucket)."""
  if not tile_mb:
    return ONE_BUCKET
  return max(256, int(tile_mb * 2**20 / 2) // 256 * 256)


def _plan(method: str, cfg: dict, d: int, n: int):
  """``(kind, codec or psum dtype, schedule, bucket size, bytes each rank sends)`` of a method
  reducing ``d`` coordinates over ``n`` ranks."""
  import jax
  import jax.numpy as jnp

  import dynamiq_jax as dq
  from dynamiq_jax.schedules import ring_bytes_per_rank

  kind, codec, schedule, tile_mb = parse_method(method)
  tile = tile_coords(cfg["tile_mb"] if tile_mb is None else tile_mb)
  if kind == "psum":  # XLA's all-reduce, taken as a ring of the dtype
    dtype = jnp.float32 if codec == "psum-f32" else jnp.bfloat16
    return kind, dtype, schedule, tile, ring_bytes_per_rank(d * jnp.dtype(dtype).itemsize, n)
  wire = dq.wire_stats(jax.ShapeDtypeStruct((d,), jnp.float32), codec=codec, n=n,
                       bucket_size=tile).bytes_per_rank
  return kind, codec, schedule, tile, wire


# ---------------------------------------------------------------------------
# worker side


def _worker(cfg: dict, rank: int, coordinator: str) -> None:
  from dynamiq_jax.training import multiprocess
  multiprocess.initialize(coordinator, num_processes=cfg["workers"], process_id=rank,
                          heartbeat_timeout_seconds=cfg["heartbeat_s"])
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import dynamiq_jax as dq

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices())
  say = lambda tag, obj: print(f"{tag} {json.dumps(obj)}", flush=True)

  barrier_fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "data"), mesh=mesh,
                                     in_specs=P("data"), out_specs=P()))
  ones = multiprocess.global_batch(mesh, np.ones((1,), np.float32))

  def barrier():
    jax.block_until_ready(barrier_fn(ones))

  def reduction(method, d):
    kind, codec, schedule, tile, wire = _plan(method, cfg, d, n)

    def body(g):
      g = g[0]
      if kind == "psum":
        return jax.lax.psum(g.astype(codec), "data").astype(jnp.float32)[None]
      out, _ = dq.allreduce(g, axis_name="data", codec=codec, schedule=schedule,
                            key=jax.random.key(0), bucket_size=tile)
      return out[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    local = None
    if kind == "allreduce":
      # the codec's arithmetic alone: all n ranks' work under vmap, divided by n
      local = jax.jit(jax.vmap(lambda g: dq.allreduce(
          g, axis_name="v", codec=codec, schedule=schedule, key=jax.random.key(0),
          bucket_size=tile)[0], axis_name="v"))
    return fn, wire, local

  def timed(fn, *args):
    barrier()
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0

  rng = np.random.default_rng(1000 + rank)
  jobs = []  # (size_mb, method, fn, x, wire)
  compute, digests = {}, {}
  for size_mb in cfg["sizes_mb"]:
    d = int(size_mb * 2**20 / 2) // (256 * n) * (256 * n)  # bf16 gradient of size_mb MB
    scale = np.exp(rng.normal(-4.0, 1.5, d // 256)).repeat(256).astype(np.float32)
    g = (rng.standard_normal(d, dtype=np.float32) * scale).astype(jnp.bfloat16)
    x = multiprocess.global_batch(mesh, g[None])
    for method in cfg["methods"]:
      fn, wire, local = reduction(method, d)
      out = fn(x)  # compile and warm up (the links are not shaped yet)
      digests[f"{size_mb}|{method}"] = _digest(out)
      jobs.append((size_mb, method, fn, x, wire))
      # throughput barely depends on size: measure it at the smallest (memory: n copies)
      if local is not None and cfg["compute"] and size_mb == min(cfg["sizes_mb"]):
        xs = jnp.asarray(np.tile(np.asarray(g, np.float32)[None], (n, 1)))
        local(xs)
        times = [timed(local, xs) / n for _ in range(cfg["repeats"])]
        compute[f"{size_mb}|{method}"] = {"seconds": statistics.median(times), "coords": d}
  lm_steps = _lm_steps(cfg, mesh, rank, barrier) if cfg["lm"] else []
  say("READY", {"rank": rank, "compute": compute, "digests": digests,
                "wire": {f"{s}|{m}": w for s, m, _, _, w in jobs},
                "lm_wire": {m: w for m, _, w in lm_steps}})

  for _ in driver_commands("measure"):
    times = {}
    for size_mb, method, fn, x, _ in jobs:
      times[f"{size_mb}|{method}"] = [timed(fn, x) for _ in range(cfg["repeats"])]
    lm = {}
    for method, step, _ in lm_steps:
      lm[method] = [step() for _ in range(cfg["lm_steps"])]
    say("RESULT", {"rank": rank, "times": times, "lm": lm})


def _digest(out) -> str:
  """Hash of this process's shard of a result (ranks must agree bit for bit)."""
  import hashlib
  h = hashlib.sha256()
  for shard in out.addressable_shards:
    h.update(np.asarray(shard.data).tobytes())
  return h.hexdigest()[:16]


def _lm_steps(cfg, mesh, rank, barrier):
  """(method, timed step, wire bytes) for a small transformer LM per reduction."""
  import jax
  import optax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from dynamiq_jax.training import multiprocess
  from dynamiq_jax.bench import lm

  lcfg = lm.LMConfig(**cfg["lm_model"])
  graphdef, params = nnx.split(lm.CharTransformer(lcfg, seed=0), nnx.Param)
  params = nnx.to_pure_dict(params) if hasattr(nnx, "to_pure_dict") else params
  n = mesh.shape["data"]
  corpus = lm.tokens(lcfg.vocab)
  rng = np.random.default_rng(rank)
  starts = rng.integers(0, corpus.size - lcfg.seq_len - 1, cfg["lm_batch"])
  window = np.stack([corpus[s:s + lcfg.seq_len + 1] for s in starts])
  batch = multiprocess.global_batch(mesh, (window[:, :-1], window[:, 1:]))
  repl = NamedSharding(mesh, P())

  def replicate(tree):
    return jax.tree.map(lambda a: jax.make_array_from_callback(
        np.shape(a), repl, lambda idx, a=np.asarray(a): a[idx]), tree)

  def loss_fn(p, b):
    model = nnx.merge(graphdef, nnx.State(p) if isinstance(p, dict) else p)
    return lm.lm_loss(model(b[0]), b[1])

  d = sum(int(np.prod(np.shape(a))) for a in jax.tree.leaves(params))
  out = []
  for method in cfg["methods"]:
    kind, codec, schedule, tile, wire = _plan(method, cfg, d, n)
    if kind == "psum":
      red = dq.baseline_psum("data", dtype=codec)
    else:
      red = dq.compressed_psum("data", codec=codec, schedule=schedule, bucket_size=tile)
    tx = optax.chain(red, optax.adamw(1e-3))
    step = dq.data_parallel_step(loss_fn, tx, mesh=mesh, donate=False)
    p0, o0 = replicate(params), replicate(tx.init(params))
    jax.block_until_ready(step(p0, o0, batch))  # compile

    def run_one(step=step, p0=p0, o0=o0):
      barrier()
      t0 = time.perf_counter()
      jax.block_until_ready(step(p0, o0, batch))
      return time.perf_counter() - t0

    out.append((method, run_one, wire))
  return out


# ---------------------------------------------------------------------------
# driver side


def summarize(results: list, ready: list, cfg: dict) -> list:
  """One row per (rate, size, method) from the ranks' RESULT/READY messages."""
  rows = []
  wire = ready[0]["wire"]
  for rate, per_rank in results:
    keys = per_rank[0]["times"].keys()
    for key in keys:
      size_mb, method = key.split("|")
      reps = zip(*[r["times"][key] for r in per_rank])
      slowest = [max(rep) for rep in reps]  # the all-reduce ends when its last rank does
      rows.append({"rate_mbit": rate, "size_mb": float(size_mb), "method": method,
                   "seconds": statistics.median(slowest), "seconds_all": slowest,
                   "bytes_per_rank": wire[key]})
    for method in per_rank[0]["lm"]:
      steps = zip(*[r["lm"][method] for r in per_rank])
      slowest = [max(s) for s in steps]
      rows.append({"rate_mbit": rate, "size_mb": None, "method": method, "lm": True,
                   "seconds": statistics.median(slowest), "seconds_all": slowest,
                   "bytes_per_rank": ready[0]["lm_wire"][method]})
  groups = {}
  for row in rows:
    groups.setdefault((row["rate_mbit"], row["size_mb"], bool(row.get("lm"))), []).append(row)
  for group in groups.values():
    base = [r for r in group if r["method"].split("@")[0] in UNCOMPRESSED]
    if not base:
      continue
    fastest = min(base, key=lambda r: r["seconds"])
    for r in group:
      r["baseline"] = fastest["method"]
      r["speedup"] = fastest["seconds"] / r["seconds"]
      r["ideal"] = fastest["bytes_per_rank"] / r["bytes_per_rank"]
  return rows


def _print_table(rows, rate, shaped):
  label = f"{rate:g} Mbit/s" if shaped and rate else "unshaped loopback/veth"
  for lm_rows in (False, True):
    sel = [r for r in rows if r["rate_mbit"] == rate and bool(r.get("lm")) == lm_rows]
    if not sel:
      continue
    print(f"\n== {label}: {'LM training step' if lm_rows else 'all-reduce'} ==")
    print(f"{'size MB':>8} {'method':<22} {'seconds':>9} {'MB/rank':>9} {'speedup':>8} "
          f"{'ideal':>6}  vs")
    for r in sel:
      size = "LM" if lm_rows else f"{r['size_mb']:g}"
      print(f"{size:>8} {r['method']:<22} {r['seconds']:9.3f} {r['bytes_per_rank'] / 1e6:9.2f} "
            f"{r.get('speedup', math.nan):7.2f}x {r.get('ideal', math.nan):5.2f}x  "
            f"{r.get('baseline', '')}")


def _print_compute(ready, workers):
  print("\n== compression throughput per process (codec arithmetic alone; all "
        f"{workers} processes at once) ==")
  keys = ready[0]["compute"].keys()
  for key in keys:
    size_mb, method = key.split("|")
    secs = [r["compute"][key]["seconds"] for r in ready]
    coords = ready[0]["compute"][key]["coords"]
    slow = max(secs)
    print(f"{size_mb:>6} MB {method:<22} {slow:8.3f} s per all-reduce = "
          f"{coords / slow / 1e6:8.1f} M coords/s ({coords * 2 / slow / 1e6:7.1f} MB/s of bf16 "
          f"gradient) per process")


def crossover(compute: dict, wire: dict, key: str, base_key: str) -> float | None:
  """Link rate (Mbit/s) below which ``key`` beats ``base_key`` if compute does not overlap.

  Time = bytes / rate + compute: equal when rate = saved bits / extra compute.
  On slower links the saved bytes win; on faster ones the extra compute
  costs more than the wire time it saves. None: ``key`` saves no bytes;
  inf: it costs no extra compute.
  """
  extra = compute[key]["seconds"] - compute.get(base_key, {"seconds": 0.0})["seconds"]
  saved = wire[base_key] - wire[key]
  if saved <= 0:
    return None
  if extra <= 0:
    return math.inf
  return saved * 8 / extra / 1e6


def _plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  sizes = sorted({r["size_mb"] for r in rows if not r.get("lm")})
  panels = [(s, False) for s in sizes] + ([(None, True)] if any(r.get("lm") for r in rows)
                                         else [])
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  for ax, (size, lm_rows) in zip(axes[0], panels):
    sel = [r for r in rows if bool(r.get("lm")) == lm_rows and (lm_rows or r["size_mb"] == size)
           and r["rate_mbit"] and "speedup" in r]
    for method in dict.fromkeys(r["method"] for r in sel):
      pts = sorted((r["rate_mbit"], r["speedup"]) for r in sel if r["method"] == method)
      ax.plot(*zip(*pts), marker="o", label=method)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link rate (Mbit/s)")
    ax.set_ylabel("speedup vs fastest uncompressed")
    ax.set_title("LM training step" if lm_rows else f"all-reduce of {size:g} MB bf16")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default); ``tiny``: --tiny's defaults."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.net",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--workers", type=int, default=4, help="worker processes (one per rank)")
  p.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64, 256],
                 help="gradient sizes, in MB of bf16")
  p.add_argument("--rates", type=float, nargs="+", default=[50, 100, 200, 500, 1000],
                 help="link rates in Mbit/s (0: unshaped)")
  p.add_argument("--methods", nargs="+",
                 default=["psum-f32", "psum-bf16", "bf16-ring/ring", "dynamiq/ring",
                          "dynamiq/butterfly", "dynamiq4/ring", "mxfp8/ring", "mxfp4/ring",
                          "thc/ring", "omnireduce/ring"],
                 help="all-reduces to time: psum-<dtype>, or <codec>[<bits>]/<schedule>")
  p.add_argument("--repeats", type=int, default=3, help="timed all-reduces per point")
  p.add_argument("--tile-mb", type=float, default=8.0,
                 help="bucket (tile) size in MiB of bf16 gradient; 0: one bucket")
  p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link end")
  p.add_argument("--lm", action=argparse.BooleanOptionalAction, default=True,
                 help="also time training steps of a small transformer LM")
  p.add_argument("--lm-steps", type=int, default=3, help="timed LM training steps")
  p.add_argument("--lm-batch", type=int, default=8, help="sequences per worker per step")
  p.add_argument("--no-compute", dest="compute", action="store_false",
                 help="skip the compression-throughput measurement")
  common.add_process_flags(p, heartbeat_s=20, timeout=1800,
                           timeout_help="seconds any one phase may take before the job is "
                                        "stopped")
  p.add_argument("--inject-fault", choices=["kill", "link-down"], default=None,
                 help="testing: kill worker 1 or take its link down during the first rate")
  p.add_argument("--tiny", action="store_true",
                 help="smoke test: 2 workers, 1 MB, one rate, a few methods, tiny LM")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  if tiny:  # smaller defaults; flags given explicitly still win
    p.set_defaults(workers=2, sizes_mb=[1.0], rates=[200.0], repeats=1, lm_steps=1,
                   lm_batch=2, tile_mb=2.0,
                   methods=["psum-f32", "psum-bf16", "bf16-ring/ring", "dynamiq/ring"])
  return p


def _parse(argv):
  argv = sys.argv[1:] if argv is None else list(argv)
  return build_parser(tiny="--tiny" in argv).parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  if common.run_worker(args, _worker):
    return None
  for m in args.methods:
    kind, _, schedule, _ = parse_method(m)  # fail early on a bad name
    if schedule == "butterfly" and args.workers & (args.workers - 1):
      raise SystemExit(f"method {m!r} needs a power-of-two --workers, got {args.workers}")
  if args.workers < 2:
    raise SystemExit(f"--workers={args.workers}: an all-reduce needs at least 2")
  if any(r < 0 for r in args.rates):
    raise SystemExit(f"--rates {args.rates}: rates are Mbit/s >= 0 (0: unshaped)")
  shaped = shaping(args.no_shaping)
  if not shaped:
    args.rates = [0.0]
  cfg = {
      "workers": args.workers, "sizes_mb": args.sizes_mb, "methods": args.methods,
      "repeats": args.repeats, "compute": args.compute, "lm": args.lm,
      "lm_steps": args.lm_steps, "lm_batch": args.lm_batch,
      "lm_model": dict(LM_PARAMS, **({"d_model": 64, "layers": 1, "heads": 2} if args.tiny
                                     else {})),
      "tile_mb": args.tile_mb,
      "heartbeat_s": args.heartbeat_s,
  }
  import tempfile
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(cfg, f)
    cfg_path = f.name
  try:
    payload = _drive(args, cfg, cfg_path, shaped)
  finally:
    os.unlink(cfg_path)
  return payload


def _drive(args, cfg, cfg_path, shaped):
  results = []
  with worker_job("dynamiq_jax.bench.net", args.workers, cfg_path, shaped=shaped) as (job, net):
    print(f"({len(args.methods)} methods x {len(args.sizes_mb)} sizes)", flush=True)
    ready = [json.loads(s) for s in job.wait_lines("READY ", timeout=args.timeout)]
    for key, digest in ready[0]["digests"].items():
      differ = [r for r, msg in enumerate(ready) if msg["digests"][key] != digest]
      if differ:
        raise RuntimeError(f"{key.replace('|', ' MB ')}: ranks {differ} hold a different "
                           f"result than rank 0; an all-reduce must be bit-identical on "
                           f"every rank, so nothing is reported")
    if args.compute:
      _print_compute(ready, args.workers)
    for i, rate in enumerate(args.rates):
      if net:
        net.set_rate(rate or None, args.delay_ms)
      with common.load_watch(f"measure {rate:g} Mbit/s"):  # in the JSON's "load" record
        job.send("measure")
        if i == 0 and args.inject_fault == "kill":
          time.sleep(1.0)
          job.procs[1].kill()
        elif i == 0 and args.inject_fault == "link-down":
          time.sleep(1.0)
          net.set_link(1, False)
        per_rank = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
      results.append((rate, per_rank))
      rows = summarize(results, ready, cfg)
      _print_table(rows, rate, shaped)
    job.send("quit")
    job.wait(timeout=120)

  rows = summarize(results, ready, cfg)
  out_dir = common.results_dir(args.out)
  compute = {}
  for key in ready[0]["compute"]:
    compute[key] = {"seconds": max(r["compute"][key]["seconds"] for r in ready),
                    "coords": ready[0]["compute"][key]["coords"]}
  cross = {}
  for key in compute:
    size_mb, method = key.split("|")
    base = f"{size_mb}|bf16-ring/ring"
    if method != "bf16-ring/ring" and base in ready[0]["wire"]:
      c = crossover(compute, ready[0]["wire"], key, base)
      cross[key] = c
  if cross:
    print("\n== crossover: compression beats the Bf16 ring on links slower than this, if its "
          "compute does not overlap the wire (from the throughput above) ==")
    for key, c in cross.items():
      print(f"{key.replace('|', ' MB '):<32} "
            f"{'never' if c is None else f'{c:9.0f} Mbit/s'}")
  payload = {
      "benchmark": "net", "command": common.command_line(), "machine": common.machine(),
      "shaped": shaped, "workers": args.workers, "config": cfg,
      "link_model": ("each worker's veth into a bridge namespace rate limited with tc tbf in "
                     "both directions" if shaped else "plain loopback, no shaping"),
      "rows": rows, "compute": compute, "crossover_mbit_vs_bf16_ring": cross,
  }
  path = common.write_json(os.path.join(out_dir, "net.json"), payload, strict=args.strict)
  png = os.path.join(out_dir, "net_speedup.png")
  if shaped:
    _plot(rows, png)
  print(f"\nwrote {path}" + (f" and {png}" if shaped else ""))
  return payload


if __name__ == "__main__":
  try:
    main()
  except (RuntimeError, TimeoutError) as e:  # a failed run: no partial result is reported
    raise SystemExit(f"bench.net stopped, nothing was written: {e}") from None
