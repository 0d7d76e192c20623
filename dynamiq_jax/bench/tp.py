"""Tensor-parallel inference over rate-limited links: ``dq.tp_psum`` against ``psum``.

    sudo python -m dynamiq_jax.bench.tp                    # 2 and 4 processes, three link rates
    sudo python -m dynamiq_jax.bench.tp --workers 4 --rates 1000
    python -m dynamiq_jax.bench.tp --tiny                  # smoke test (CI)

A byte-level transformer LM (rotary positions, pre-norm blocks) is first
trained for ``--train-steps`` on one device, on the Python standard
library's source text (:func:`dynamiq_jax.bench.lm.stdlib_corpus`, the first
90%). It is then served with Megatron-style tensor parallelism over
``--workers`` JAX processes (one CPU device each, gloo over TCP), each in its
own network namespace behind a ``tc``-shaped link
(:mod:`dynamiq_jax.bench.netns`): the attention heads and the MLP's hidden
units split over the ``model`` axis, every block ending its attention and its
MLP in an all-reduce of activations, done by each method:

* ``psum-f32`` (exact: the reference of every error) and ``psum-bf16``
  (``jax.lax.psum`` of bf16 activations, gloo's all-reduce: the baseline);
* ``<codec>/<schedule>``: :func:`dynamiq_jax.tp_psum` with ``int8``, ``int4``
  (Flash Communication's groups of 128), ``dynamiq`` (5 bits) or ``mxfp8``,
  on ``two_step`` or ``ring``.

Accuracy, once per method (unshaped): the prefill logits' relative error
against ``psum-f32``'s, greedy-token agreement over the generated tokens (the
fraction of positions where a method's free-running greedy decode picks the
exact model's token, and where it first differs), and the perplexity change
on held-out windows (the last 10% of the corpus). Time, per link rate, side by
side: prefill of one ``--prompt``-token prompt (time to first token) and
greedy decode of ``--generate`` tokens (tokens/s), the slowest process's time
from a common barrier, median over ``--repeats``.

Writes ``docs/results/tp.json``. Every namespace, link and process this
creates is removed at the end, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from dynamiq_jax.bench import common
from dynamiq_jax.bench.netns import driver_commands, shaping, worker_job

__all__ = ["main", "init_params", "forward", "train", "param_specs", "parse_method"]

MODEL = dict(vocab=256, d_model=256, heads=8, layers=4, mlp=4)
TINY_MODEL = dict(vocab=256, d_model=64, heads=4, layers=1, mlp=2)
EXACT = "psum-f32"
BASELINE = "psum-bf16"
METHODS = ("psum-f32", "psum-bf16", "int8/two_step", "int8/ring", "int4/two_step", "int4/ring",
           "dynamiq/two_step", "dynamiq/ring")


def parse_method(name: str):
  """``"psum-f32"`` / ``"psum-bf16"`` -> (``"psum"``, dtype name, None); ``"<codec>/<schedule>"``
  -> (``"tp"``, codec name, schedule), names checked."""
  from dynamiq_jax.registry import TP_CODECS
  from dynamiq_jax.api.tp import TP_SCHEDULES
  if name in ("psum-f32", "psum-bf16"):
    return "psum", {"psum-f32": "float32", "psum-bf16": "bfloat16"}[name], None
  codec, _, schedule = name.partition("/")
  if codec not in TP_CODECS or codec == "none" or schedule not in TP_SCHEDULES:
    raise ValueError(f"method {name!r}: psum-f32, psum-bf16 or <codec>/<schedule> with codec "
                     f"in {TP_CODECS[1:]} and schedule in {TP_SCHEDULES}")
  return "tp", codec, schedule


# -- the model: one forward for training (one device) and serving (per model rank) --------

def init_params(cfg: dict, seed: int) -> dict:
  """float32 numpy parameters; ``wqkv``'s columns head-major (head, q|k|v, unit)."""
  rng = np.random.default_rng(seed)
  d, f, v = cfg["d_model"], cfg["mlp"] * cfg["d_model"], cfg["vocab"]
  normal = lambda *shape, fan: (rng.standard_normal(shape) / np.sqrt(fan)).astype(np.float32)
  layers = []
  for _ in range(cfg["layers"]):
    layers.append({
        "ln1": np.ones(d, np.float32), "ln2": np.ones(d, np.float32),
        "wqkv": normal(d, 3 * d, fan=d), "wo": normal(d, d, fan=d * cfg["layers"]),
        "w_up": normal(d, f, fan=d), "b_up": np.zeros(f, np.float32),
        "w_down": normal(f, d, fan=f * cfg["layers"]), "b_down": np.zeros(d, np.float32)})
  return {"embed": normal(v, d, fan=d), "ln": np.ones(d, np.float32),
          "head": normal(d, v, fan=d), "layers": layers}


def param_specs(params: dict):
  """Each parameter's ``PartitionSpec`` over the ``model`` axis: heads and hidden units
  split (column-parallel ``wqkv``, ``w_up``; row-parallel ``wo``, ``w_down``), the rest
  replicated."""
  from jax.sharding import PartitionSpec as P
  split = {"wqkv": P(None, "model"), "w_up": P(None, "model"), "b_up": P("model"),
           "wo": P("model", None), "w_down": P("model", None)}
  return {"embed": P(), "ln": P(), "head": P(),
          "layers": [{k: split.get(k, P()) for k in lp} for lp in params["layers"]]}


def _norm(x, scale):
  import jax
  x = x - x.mean(-1, keepdims=True)
  return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale


def _rope(x, pos):
  """Rotary positions on ``x`` [..., T, heads, hd] at positions ``pos`` [T]."""
  import jax.numpy as jnp
  hd = x.shape[-1]
  freq = 10000.0 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  ang = pos.astype(jnp.float32)[:, None] * freq  # [T, hd/2]
  cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
  a, b = x[..., 0::2], x[..., 1::2]
  return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


def forward(params, tokens, *, cfg: dict, reduce, start=0, cache=None):
  """Logits of ``tokens`` [B, T] at positions ``start..start+T`` -> (logits, cache).

  ``params`` hold this rank's shards (whole on one device); ``reduce`` sums a
  row-parallel projection's partial sums over the model ranks (the identity on one
  device). ``cache``: per layer (k, v) [B, T_max, heads here, hd], written at ``start``
  (None: attend within ``tokens`` only, causally)."""
  import jax
  import jax.numpy as jnp
  hd = cfg["d_model"] // cfg["heads"]
  b, t = tokens.shape
  pos = start + jnp.arange(t)
  x = params["embed"][tokens]
  new_cache = []
  for i, lp in enumerate(params["layers"]):
    qkv = _norm(x, lp["ln1"]) @ lp["wqkv"]
    qkv = qkv.reshape(b, t, -1, 3, hd)
    q, k, v = _rope(qkv[..., 0, :], pos), _rope(qkv[..., 1, :], pos), qkv[..., 2, :]
    k_pos = pos
    if cache is not None:
      ck, cv = cache[i]
      k = jax.lax.dynamic_update_slice_in_dim(ck, k, start, axis=1)
      v = jax.lax.dynamic_update_slice_in_dim(cv, v, start, axis=1)
      new_cache.append((k, v))
      k_pos = jnp.arange(k.shape[1])
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(hd))
    s = jnp.where(k_pos[None, None, None, :] <= pos[None, None, :, None], s, -1e30)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, -1)
    x = x + reduce(a @ lp["wo"])
    h = jax.nn.gelu(_norm(x, lp["ln2"]) @ lp["w_up"] + lp["b_up"])
    x = x + reduce(h @ lp["w_down"]) + lp["b_down"]
  return _norm(x, params["ln"]) @ params["head"], (new_cache if cache is not None else None)


def _nll(logits, targets):
  import optax
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def train(cfg: dict, corpus: np.ndarray, *, steps: int, batch: int, seq: int, seed: int):
  """Adam on one device -> (numpy parameters, training losses)."""
  import jax
  import optax
  params = jax.tree.map(np.asarray, init_params(cfg, seed))
  tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 10, 1),
                                                     max(steps, 2)))
  opt = tx.init(params)

  @jax.jit
  def step(p, o, x, y):
    loss, g = jax.value_and_grad(lambda p: _nll(forward(p, x, cfg=cfg, reduce=lambda a: a)[0],
                                                y).mean())(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  rng = np.random.default_rng(seed)
  losses = []
  for _ in range(steps):
    starts = rng.integers(0, corpus.size - seq - 1, batch)
    w = np.stack([corpus[s:s + seq + 1] for s in starts]).astype(np.int32)
    params, opt, loss = step(params, opt, w[:, :-1], w[:, 1:])
    losses.append(float(loss))
  return jax.tree.map(np.asarray, params), losses


# -- the gather step's width (no processes) ----------------------------------------------

WIDTHS = ((8, 8), (6, 6), (4, 4), (4, 6), (4, 8))


def gather_widths(n: int, d: int, families=("iid", "heavy"), seed: int = 0) -> list:
  """The two-step all-reduce's relative error with IntGroup at ``(reduce bits, gather bits)``
  (:data:`WIDTHS`) on ``n`` ranks' synthetic data of ``d`` values, and the mean bits per
  value on the wire: the "INT6" variant (wider gather than reduce) measured."""
  import jax
  import jax.numpy as jnp

  import dynamiq_jax as dq
  from dynamiq_jax.bench.reference import paper_model_gradients
  from dynamiq_jax.codecs.base import Keys

  keys = Keys.from_key(jax.random.key(seed), bucket=0, rank=0).at(0, 0)
  trip = lambda c, x: np.asarray(c.decode(c.encode(jnp.asarray(x), None, keys), None))
  rows = []
  for family in families:
    g = np.asarray(paper_model_gradients(family, n, d, seed), np.float32)
    exact = g.astype(np.float64).sum(0)
    for b_reduce, b_gather in WIDTHS:
      reduce, gather = dq.codecs.IntGroup(bits=b_reduce), dq.codecs.IntGroup(bits=b_gather)
      total = sum(trip(reduce, g[r].reshape(-1, reduce.group)) for r in range(n))
      out = trip(gather, total.astype(np.float32)).reshape(-1)
      bits = (reduce.wire_bits(d, n) + gather.wire_bits(d, n)) / (2 * d)
      rows.append({"family": family, "reduce_bits": b_reduce, "gather_bits": b_gather,
                   "wire_bits": bits,
                   "rel_error": float(np.linalg.norm(out - exact) / np.linalg.norm(exact))})
  return rows


# -- a worker process -----------------------------------------------------------------

def _worker(cfg: dict, rank: int, coordinator: str) -> None:
  from dynamiq_jax.training import multiprocess
  multiprocess.initialize(coordinator, num_processes=cfg["workers"], process_id=rank,
                          heartbeat_timeout_seconds=cfg["heartbeat_s"])
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import dynamiq_jax as dq

  mcfg, n = cfg["model"], jax.device_count()
  mesh = jax.make_mesh((n,), ("model",), devices=jax.devices())
  say = lambda tag, obj: print(f"{tag} {json.dumps(obj)}", flush=True)
  with np.load(cfg["params"], allow_pickle=False) as z:
    flat = {k: z[k] for k in z.files}
  host = {"embed": flat["embed"], "ln": flat["ln"], "head": flat["head"],
          "layers": [{k.split("/")[1]: v for k, v in flat.items() if k.startswith(f"{i}/")}
                     for i in range(mcfg["layers"])]}
  specs = param_specs(host)
  put = lambda x, s: jax.make_array_from_callback(x.shape, NamedSharding(mesh, s),
                                                  lambda idx: x[idx])
  params = jax.tree.map(put, host, specs, is_leaf=lambda x: isinstance(x, np.ndarray))
  hd = mcfg["d_model"] // mcfg["heads"]
  cache_spec = P(None, None, "model")

  def reducer(method):
    kind, what, schedule = parse_method(method)
    if kind == "psum":
      return lambda a: jax.lax.psum(a.astype(what), "model").astype(jnp.float32)
    codec = dq.tp_codec_from_name(what)
    return lambda a: dq.tp_psum(a, "model", codec=codec, schedule=schedule)

  def programs(method):
    reduce = reducer(method)
    layers_spec = [(cache_spec, cache_spec)] * mcfg["layers"]

    def prefill_body(p, tokens, cache):
      logits, cache = forward(p, tokens, cfg=mcfg, reduce=reduce, start=0, cache=cache)
      return logits, cache

    def decode_body(p, token, pos, cache):
      logits, cache = forward(p, token, cfg=mcfg, reduce=reduce, start=pos, cache=cache)
      return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None], cache

    def score_body(p, tokens):
      return forward(p, tokens, cfg=mcfg, reduce=reduce)[0]

    prefill = jax.jit(jax.shard_map(prefill_body, mesh=mesh, in_specs=(specs, P(), layers_spec),
                                    out_specs=(P(), layers_spec)), donate_argnums=2)
    decode = jax.jit(jax.shard_map(decode_body, mesh=mesh,
                                   in_specs=(specs, P(), P(), layers_spec),
                                   out_specs=(P(), layers_spec)), donate_argnums=3)
    score = jax.jit(jax.shard_map(score_body, mesh=mesh, in_specs=(specs, P()), out_specs=P()))
    return prefill, decode, score

  total = cfg["prompt"] + cfg["generate"]

  def empty_cache():
    shape = (1, total, mcfg["heads"], hd)
    zeros = np.zeros(shape, np.float32)
    return [(put(zeros, cache_spec), put(zeros, cache_spec)) for _ in range(mcfg["layers"])]

  replicated = lambda x: put(np.asarray(x), P())
  prompt = replicated(np.asarray(cfg["prompt_tokens"], np.int32)[None])
  windows = replicated(np.asarray(cfg["eval_windows"], np.int32))
  barrier_fn = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "model"), mesh=mesh,
                                     in_specs=P("model"), out_specs=P()))
  ones = put(np.ones((n,), np.float32), P("model"))

  def barrier():
    jax.block_until_ready(barrier_fn(ones))

  def generate(prefill, decode):
    logits, cache = prefill(params, prompt, empty_cache())
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    out = [token]
    for i in range(cfg["generate"] - 1):
      token, cache = decode(params, token, np.int32(cfg["prompt"] + i), cache)
      out.append(token)
    return logits, jnp.concatenate(out, axis=1)

  compiled, accuracy, exact = {}, {}, None
  w = np.asarray(windows.addressable_data(0))
  for method in sorted(cfg["methods"], key=lambda m: m != EXACT):  # the reference first
    prefill, decode, score = programs(method)
    logits, tokens = generate(prefill, decode)  # compiles and warms up (links unshaped)
    logits = np.asarray(logits.addressable_data(0), np.float64)
    tokens = np.asarray(tokens.addressable_data(0))[0]
    nll = float(np.mean(np.asarray(_nll(score(params, windows).addressable_data(0)[:, :-1],
                                        w[:, 1:]))))
    if exact is None:
      exact = (logits, tokens, nll)
    same = tokens == exact[1]
    accuracy[method] = {
        "prompt_logits_digest": hashlib.sha256(logits.tobytes()).hexdigest()[:16],
        "logits_rel_error": float(np.linalg.norm(logits - exact[0])
                                  / np.linalg.norm(exact[0])),
        "greedy_agreement": float(same.mean()),
        "first_divergence": int(np.argmin(same)) if not same.all() else int(same.size),
        "eval_ppl": float(np.exp(nll)),
        "ppl_change_pct": float(100 * (np.exp(nll - exact[2]) - 1))}
    compiled[method] = (prefill, decode)
  say("READY", {"rank": rank, "accuracy": accuracy})

  for _ in driver_commands("measure"):
    times = {}
    for method, (prefill, decode) in compiled.items():
      pre, dec = [], []
      for _ in range(cfg["repeats"]):
        cache = empty_cache()
        barrier()
        t0 = time.perf_counter()
        logits, cache = prefill(params, prompt, cache)
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        for i in range(cfg["generate"] - 1):
          token, cache = decode(params, token, np.int32(cfg["prompt"] + i), cache)
        jax.block_until_ready(token)
        pre.append(t1 - t0)
        dec.append(time.perf_counter() - t1)
      times[method] = {"prefill": pre, "decode": dec}
    say("RESULT", {"rank": rank, "times": times})


# -- the driver -------------------------------------------------------------------------

def accuracy_rows(ready: list, methods) -> dict:
  """Per method (as rank 0 measured it against ``psum-f32``): logits error, greedy
  agreement, perplexity change; raises if the ranks' prefill logits differ."""
  acc = ready[0]["accuracy"]
  for m in methods:
    differ = [r for r, msg in enumerate(ready) if msg["accuracy"][m]["prompt_logits_digest"]
              != acc[m]["prompt_logits_digest"]]
    if differ:
      raise RuntimeError(f"{m}: ranks {differ} hold different logits than rank 0; a "
                         f"tensor-parallel all-reduce must be bit-identical on every rank")
  return {m: {k: v for k, v in acc[m].items() if k != "prompt_logits_digest"}
          for m in methods}


def time_rows(per_rank: list, methods, generate: int) -> dict:
  """Per method: the slowest rank's median prefill seconds and decode tokens/s."""
  rows = {}
  for m in methods:
    pre = statistics.median(max(r["times"][m]["prefill"][i] for r in per_rank)
                            for i in range(len(per_rank[0]["times"][m]["prefill"])))
    dec = statistics.median(max(r["times"][m]["decode"][i] for r in per_rank)
                            for i in range(len(per_rank[0]["times"][m]["decode"])))
    rows[m] = {"prefill_s": pre, "decode_tokens_per_s": (generate - 1) / dec}
  base = rows.get(BASELINE)
  for m, row in rows.items():
    if base:
      row["ttft_speedup_vs_bf16"] = base["prefill_s"] / row["prefill_s"]
      row["decode_speedup_vs_bf16"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
  return rows


def wire_bytes(method: str, tokens: int, d_model: int, n: int) -> float:
  """Bytes each rank sends per row-parallel all-reduce of ``tokens`` x ``d_model``."""
  import dynamiq_jax as dq
  from dynamiq_jax.engine.buckets import report
  kind, what, _ = parse_method(method)
  d = tokens * d_model
  if kind == "psum":
    return 2 * (n - 1) / n * d * np.dtype(what).itemsize
  codec = dq.tp_codec_from_name(what)
  padded = -(-d // codec.granularity) * codec.granularity
  return float(report([padded], codec, n).bytes_per_rank)


def build_parser(tiny: bool = False) -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.tp",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--workers", type=int, nargs="+", default=[2, 4],
                 help="tensor-parallel sizes: one job of that many processes each")
  p.add_argument("--rates", type=float, nargs="+", default=[1000, 10000, 25000],
                 help="link rates in Mbit/s (0: unshaped)")
  p.add_argument("--methods", nargs="+", default=list(METHODS),
                 help="psum-f32, psum-bf16 or <codec>/<schedule> (codec: int8, int4, dynamiq, "
                      "mxfp8; schedule: two_step, ring, butterfly)")
  p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (prefill)")
  p.add_argument("--generate", type=int, default=256, help="greedily generated tokens")
  p.add_argument("--repeats", type=int, default=3, help="timed prefill + decode runs per rate")
  p.add_argument("--train-steps", type=int, default=300, help="training steps of the LM")
  p.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
  p.add_argument("--train-seq", type=int, default=256, help="training sequence length")
  p.add_argument("--eval-windows", type=int, default=8,
                 help="held-out windows of --train-seq tokens for the perplexity")
  p.add_argument("--seed", type=int, default=0, help="initialisation and data order")
  p.add_argument("--phases", nargs="+", choices=["widths", "serve"], default=["widths", "serve"],
                 help="widths: the gather step's width measured on synthetic data (no "
                      "processes); serve: the tensor-parallel serving over the network")
  common.add_process_flags(p, heartbeat_s=30, timeout=3600,
                           timeout_help="seconds any one phase may take before the job is "
                                        "stopped")
  p.add_argument("--tiny", action="store_true", help="smoke test: small model, 2 workers")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  if tiny:
    p.set_defaults(workers=[2], rates=[1000.0], prompt=32, generate=8, repeats=1,
                   train_steps=3, train_batch=2, train_seq=32, eval_windows=2,
                   methods=["psum-f32", "psum-bf16", "int8/two_step", "int4/ring"])
  return p


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  args = build_parser(tiny="--tiny" in argv).parse_args(argv)
  if common.run_worker(args, _worker):
    return None
  for m in args.methods:
    parse_method(m)  # fail early on a bad name
  if EXACT not in args.methods:
    raise SystemExit(f"--methods must include {EXACT}, the reference of every error")
  if any(w < 2 for w in args.workers):
    raise SystemExit(f"--workers {args.workers}: tensor parallelism needs at least 2")
  model = TINY_MODEL if args.tiny else MODEL
  if any(model["heads"] % w for w in args.workers):
    raise SystemExit(f"--workers {args.workers}: each must divide the {model['heads']} heads")
  payload = {"benchmark": "tp", "command": common.command_line(), "machine": common.machine()}
  if "widths" in args.phases:
    n = max(args.workers)
    payload["gather_widths"] = {"n": n, "rows": gather_widths(n, 1 << (12 if args.tiny else 16))}
    print(f"== the two-step all-reduce over {n} ranks, IntGroup: reduce and gather widths ==")
    for row in payload["gather_widths"]["rows"]:
      print(f"{row['family']:6s} reduce INT{row['reduce_bits']} gather INT{row['gather_bits']}: "
            f"{row['wire_bits']:.3f} bits per value, relative error {row['rel_error']:.4f}")
  if "serve" in args.phases:
    payload.update(_serve(args, model))
  name = "tp_tiny.json" if args.tiny else "tp.json" if set(args.phases) == {"widths", "serve"} \
      else f"tp_{'_'.join(args.phases)}.json"
  path = common.write_json(os.path.join(common.results_dir(args.out), name), payload,
                           strict=args.strict)
  print(f"\nwrote {path}\ncommand: {payload['command']}")
  return payload


def _serve(args, model) -> dict:
  """Trains the LM, then serves it over ``args.workers`` processes: the payload's part."""
  from dynamiq_jax.bench.lm import stdlib_corpus
  corpus = stdlib_corpus()
  split = int(0.9 * corpus.size)
  t0 = time.perf_counter()
  params, losses = train(model, corpus[:split], steps=args.train_steps,
                         batch=args.train_batch, seq=args.train_seq, seed=args.seed)
  print(f"trained the LM for {args.train_steps} steps in {time.perf_counter() - t0:.0f} s: "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} nats/byte", flush=True)
  rng = np.random.default_rng(args.seed + 1)
  held = corpus[split:]
  starts = rng.integers(0, held.size - args.train_seq - 1, args.eval_windows)
  windows = np.stack([held[s:s + args.train_seq + 1] for s in starts]).astype(np.int32)
  prompt = held[:args.prompt].astype(np.int32)
  shaped = shaping(args.no_shaping)
  rates = args.rates if shaped else [0.0]
  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "params.npz")
    flat = {"embed": params["embed"], "ln": params["ln"], "head": params["head"]}
    for i, lp in enumerate(params["layers"]):
      flat.update({f"{i}/{k}": v for k, v in lp.items()})
    np.savez(path, **flat)
    for workers in args.workers:
      cfg = {"workers": workers, "model": model, "params": path, "methods": args.methods,
             "prompt": args.prompt, "generate": args.generate, "repeats": args.repeats,
             "prompt_tokens": prompt.tolist(), "eval_windows": windows.tolist(),
             "heartbeat_s": args.heartbeat_s}
      cfg_path = os.path.join(tmp, f"cfg{workers}.json")
      with open(cfg_path, "w") as f:
        json.dump(cfg, f)
      runs.append(_drive(args, cfg, cfg_path, shaped, rates))
  return {
      "shaped": shaped, "model": model, "train_steps": args.train_steps,
      "train_loss": [losses[0], losses[-1]], "prompt": args.prompt, "generate": args.generate,
      "link_model": ("each worker's veth into a bridge namespace rate limited with tc tbf in "
                     "both directions" if shaped else "plain loopback, no shaping"),
      "runs": runs,
  }


def _drive(args, cfg, cfg_path, shaped, rates):
  workers, d = cfg["workers"], cfg["model"]["d_model"]
  with worker_job("dynamiq_jax.bench.tp", workers, cfg_path, shaped=shaped) as (job, net):
    ready = [json.loads(s) for s in job.wait_lines("READY ", timeout=args.timeout)]
    acc = accuracy_rows(ready, args.methods)
    print(f"\n== {workers} processes: accuracy against {EXACT} ==")
    print(f"{'method':<18} {'logits rel err':>14} {'greedy agree':>12} {'1st diff':>8} "
          f"{'ppl':>7} {'ppl change':>10} {'KB/rank/prefill':>15}")
    for m, row in acc.items():
      kb = 2 * cfg["model"]["layers"] * wire_bytes(m, args.prompt, d, workers) / 1024
      row["prefill_kb_per_rank"] = kb
      print(f"{m:<18} {row['logits_rel_error']:14.2e} {row['greedy_agreement']:12.3f} "
            f"{row['first_divergence']:8d} {row['eval_ppl']:7.3f} "
            f"{row['ppl_change_pct']:+9.2f}% {kb:15.1f}", flush=True)
    timed = []
    for rate in rates:
      if net:
        net.set_rate(rate or None)
      job.send("measure")
      per_rank = [json.loads(s) for s in job.wait_lines("RESULT ", timeout=args.timeout)]
      rows = time_rows(per_rank, args.methods, args.generate)
      timed.append({"rate_mbit": rate, "rows": rows})
      label = f"{rate:.0f} Mbit/s" if rate else "unshaped"
      print(f"\n-- {workers} processes, {label}: prefill of {args.prompt} tokens, decode of "
            f"{args.generate} --")
      print(f"{'method':<18} {'TTFT s':>8} {'vs bf16':>8} {'decode tok/s':>12} {'vs bf16':>8}")
      for m, row in rows.items():
        print(f"{m:<18} {row['prefill_s']:8.3f} {row.get('ttft_speedup_vs_bf16', 1):7.2f}x "
              f"{row['decode_tokens_per_s']:12.1f} {row.get('decode_speedup_vs_bf16', 1):7.2f}x",
              flush=True)
    job.send("quit")
    job.wait(timeout=120)
  return {"workers": workers, "accuracy": acc, "timing": timed}


if __name__ == "__main__":
  try:
    main()
  except (RuntimeError, TimeoutError) as e:
    raise SystemExit(f"bench.tp stopped, nothing was written: {e}") from None
