"""ARC-Top-K's defaults, one factor at a time: where its gap to Top-K comes from.

    python -m dynamiq_jax.bench.arctopk                    # both parts
    python -m dynamiq_jax.bench.arctopk --parts factors    # small regressions, SGD and AdamW
    python -m dynamiq_jax.bench.arctopk --parts lm         # bench.tta's word LM, 3 seeds
    python -m dynamiq_jax.bench.arctopk --tiny             # smoke test (CI)

Parts:

1. ``factors``: two small regressions (a linear model and a tanh MLP fitting a
   random teacher MLP, 8 ranks simulated by ``jax.vmap`` over the data axis,
   each rank drawing its own mini-batches), trained with plain SGD and with
   AdamW after ``dq.compressed_psum(codec=ARCTopK(...))``. From a base
   configuration (``--base``, the codec's defaults unless given), one factor
   changes at a time: the error feedback (none, EF14, EF21-M at several
   momenta), the row width (rows of the flat bucket, across leaves), the
   sketch rank (``None``: the exact selection), the ratio of rows sent, and
   the rows' element codec at the same bits. Final held-out MSE, mean over
   ``--seeds`` (data, initialisation and the codec's key), relative to the
   uncompressed all-reduce (float32 ``pmean``) of the same seeds.
2. ``lm``: ARC-Top-K variants (``--lm-variants``) trained on
   :mod:`dynamiq_jax.bench.tta`'s word LM with its simulated phase's training
   (4 ranks, AdamW, 200 steps), every seed of ``--lm-seeds``; the final eval
   loss and the steps to target relative to BF16 ``psum``'s runs of the same
   seeds in ``docs/results/tta.json`` (run here when that file has none made
   with the same training configuration).

Writes ``docs/results/arctopk_factors.json`` (``_tiny`` with ``--tiny``); parts not
run are kept from an existing file, each with its own command and machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import numpy as np

from dynamiq_jax.bench import common

__all__ = ["Variant", "parse_variant", "factor_variants", "regression_run", "factors_part",
           "lm_part", "build_parser", "main"]

N = 8  # ranks of the regressions
MODELS = {  # (input, hidden widths, output); hidden () is a linear model
    "linear": (128, (), 64),
    "mlp": (64, (128, 128), 16),
}
OPTIMIZERS = {"sgd": 0.05, "adamw": 3e-3}  # learning rates
STEPS, BATCH, TRAIN, TEST, NOISE = 300, 16, 512, 2048, 0.1


MX_VALUES = {"mxfp8": "e4m3", "mxfp6": "e3m2", "mxfp4": "e2m1"}  # values=: OCP MX elements


class Variant(dict):
  """An ARC-Top-K configuration: codec options (``ratio``, ``rank``, ``row``, ``values``)
  and the feedback (``ef``: ``"none"``, ``"ef14"`` or ``"ef21m"``; ``eta``: EF21-M's
  momentum). ``Variant()`` is the library's defaults; the label names what differs."""

  def codec(self):
    from dynamiq_jax.codecs import MX, ARCTopK
    opts = {k: self[k] for k in ("ratio", "rank", "row") if k in self}
    values = self.get("values")
    if values in MX_VALUES:
      opts["values"] = MX(element=MX_VALUES[values], scale="e8m0")
    elif values is not None:
      opts["values"] = values
    return ARCTopK(**opts)

  def transform_options(self) -> dict:
    ef = self.get("ef")
    out = {}
    if ef is not None:
      out["error_feedback"] = {"none": False, "ef14": "ef14", "ef21m": "ef21m"}[ef]
    if "eta" in self:
      out["ef21m_momentum"] = float(self["eta"])
    return out

  def label(self) -> str:
    if not self:
      return "default"
    return " ".join(f"{k}={v}" for k, v in self.items())

  def bits(self, d: int, n: int) -> float:
    return self.codec().wire_bits(d, n) / d


def parse_variant(text: str) -> Variant:
  """``"ratio=0.2,row=64,ef=ef14"`` as a :class:`Variant` (``"default"``: no option)."""
  v = Variant()
  for part in filter(None, (s.strip() for s in text.split(","))):
    if part == "default":
      continue
    if "=" not in part:
      raise ValueError(f"variant option {part!r} must be key=value, e.g. ratio=0.2")
    key, value = (s.strip() for s in part.split("=", 1))
    if key in ("ratio", "eta"):
      v[key] = float(value)
    elif key in ("rank", "row"):
      v[key] = None if value == "None" else int(value)
    elif key in ("values", "ef"):
      if key == "ef" and value not in ("none", "ef14", "ef21m"):
        raise ValueError(f"ef={value!r} must be none, ef14 or ef21m")
      v[key] = value
    else:
      raise ValueError(f"variant option {key!r} is not one of ratio, rank, row, values, ef, "
                       f"eta")
  return v


FACTORS = {  # factor: the values tried, each alone on top of the base
    "feedback": [{"ef": "none"}, {"ef": "ef14"}] + [{"ef": "ef21m", "eta": e}
                                                   for e in (0.1, 0.25, 0.5, 0.75, 1.0)],
    "row": [{"row": w} for w in (32, 64, 256, 1024)],
    "rank": [{"rank": r} for r in (1, 4, None)],
    "ratio": [{"ratio": r} for r in (0.1, 0.2, 0.4)],
    "values": [{"values": "bf16", "ratio": 0.2}, {"values": "mxfp8", "ratio": 0.4},
               {"values": "mxfp4", "ratio": 0.8}],
}
TINY_FACTORS = {"feedback": [{"ef": "none"}, {}]}  # no feedback, the defaults


def factor_variants(base: Variant, factors: dict) -> list[tuple[str, Variant]]:
  """``(factor, variant)`` for every value of every factor, on top of ``base``."""
  out = []
  for factor, values in factors.items():
    for change in values:
      v = Variant(base)
      if "ef" in change and change["ef"] != "ef21m":
        v.pop("eta", None)
      v.update(change)
      out.append((factor, v))
  return out


# ---------------------------------------------------------------------------
# part 1: the regressions


def _init_mlp(key, sizes):
  import jax
  import jax.numpy as jnp
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, k = jax.random.split(key)
    params[f"w{i}"] = jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a)
    params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
  return params


def _apply(params, x):
  import jax.numpy as jnp
  layers = len(params) // 2
  for i in range(layers):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < layers - 1:
      x = jnp.tanh(x)
  return x


def regression_run(model: str, optimizer: str, reduce, seeds, *, steps: int = STEPS,
                   lr: float | None = None) -> np.ndarray:
  """Trains ``model`` with ``optimizer`` after the all-reduce ``reduce`` (an optax transform
  over the axis ``"data"``, or None: float32 ``pmean``) on :data:`N` ranks, for every seed.

  Each seed draws a teacher (a random MLP of ``model``'s shape plus Gaussian noise of
  std :data:`NOISE`), :data:`N` x :data:`TRAIN` training samples (rank ``r`` holds its own
  :data:`TRAIN`, inputs shifted by a rank-specific mean so the ranks' gradients differ),
  :data:`TEST` held-out samples and the student's initialisation; every step each rank
  takes a mini-batch of :data:`BATCH` of its samples.

  Returns:
    float64 ``[len(seeds), steps // 10 + 1]``: held-out MSE every 10 steps (step 0 first).
  """
  import jax
  import jax.numpy as jnp
  import optax

  d_in, hidden, d_out = MODELS[model]
  sizes = (d_in, *hidden, d_out)
  lr = OPTIMIZERS[optimizer] if lr is None else lr
  opt = optax.sgd(lr) if optimizer == "sgd" else optax.adamw(lr, weight_decay=1e-4)
  if reduce is None:
    reduce = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda g: jax.lax.pmean(g, "data"), u), s))
  tx = optax.chain(reduce, opt)

  def data(seed):
    key = jax.random.key(seed)
    kt, kx, ks, kp, ktest = jax.random.split(key, 5)
    teacher = _init_mlp(kt, (d_in, *(hidden or (d_in,)), d_out))
    shift = 0.5 * jax.random.normal(ks, (N, 1, d_in))
    x = jax.random.normal(kx, (N, TRAIN, d_in)) + shift
    kn, kxt = jax.random.split(ktest)
    y = _apply(teacher, x) + NOISE * jax.random.normal(kn, (N, TRAIN, d_out))
    xt = jax.random.normal(kxt, (TEST, d_in)) + jnp.mean(shift, 0)
    yt = _apply(teacher, xt)
    return x, y, xt, yt, _init_mlp(kp, sizes), key

  def loss(params, x, y):
    return jnp.mean((_apply(params, x) - y) ** 2)

  def train(seed):
    x, y, xt, yt, params, key = data(seed)
    state = jax.vmap(lambda _: tx.init(params))(jnp.arange(N))

    def rank_step(params, state, x, y, k):
      idx = jax.random.randint(k, (BATCH,), 0, TRAIN)
      g = jax.grad(loss)(params, x[idx], y[idx])
      upd, state = tx.update(g, state, params)
      return upd, state

    vstep = jax.vmap(rank_step, in_axes=(None, 0, 0, 0, 0), axis_name="data")

    def body(carry, i):
      params, state = carry
      keys = jax.random.split(jax.random.fold_in(key, i), N)
      upd, state = vstep(params, state, x, y, keys)
      params = optax.apply_updates(params, jax.tree.map(lambda u: u[0], upd))
      return (params, state), None

    def chunk(carry, _):
      carry, _ = jax.lax.scan(body, carry, jnp.arange(10) + 10 * _)
      return carry, loss(carry[0], xt, yt)

    (params, _), evals = jax.lax.scan(chunk, (params, state), jnp.arange(steps // 10))
    return jnp.concatenate([loss(data(seed)[4], xt, yt)[None], evals])

  run = jax.jit(jax.vmap(train))
  return np.asarray(run(jnp.asarray(np.asarray(seeds, np.int32))), np.float64)


def _reduce_of(variant: Variant, seed_codec: int = 0):
  import dynamiq_jax as dq
  return dq.compressed_psum("data", codec=variant.codec(), seed=seed_codec,
                            **variant.transform_options())


def _param_count(model: str) -> int:
  d_in, hidden, d_out = MODELS[model]
  sizes = (d_in, *hidden, d_out)
  return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:]))


def factors_part(args) -> dict:
  """Every factor's values on top of ``--base``, on both models under both optimizers."""
  base = parse_variant(args.base)
  factors = TINY_FACTORS if args.tiny else {f: FACTORS[f] for f in args.factors.split(",")}
  steps = 40 if args.tiny else args.steps
  seeds = list(range(2 if args.tiny else args.seeds))
  models = ["mlp"] if args.tiny else args.models.split(",")
  optimizers = {"adamw": OPTIMIZERS["adamw"]} if args.tiny else OPTIMIZERS
  rows = []
  reference = {}
  for model, optimizer in itertools.product(models, optimizers):
    ref = regression_run(model, optimizer, None, seeds, steps=steps)
    reference[f"{model} {optimizer}"] = ref[:, -1].tolist()
    print(f"{model:<6} {optimizer:<5} uncompressed (f32 pmean): final eval MSE "
          f"{ref[:, -1].mean():.4g} (seeds {np.round(ref[:, -1], 4).tolist()})", flush=True)
    done = {}
    for factor, variant in factor_variants(base, factors):
      key = json.dumps(variant, sort_keys=True)
      t0 = time.perf_counter()
      if key not in done:
        done[key] = regression_run(model, optimizer, _reduce_of(variant), seeds, steps=steps)
      curve = done[key]
      final = curve[:, -1]
      rel = final / ref[:, -1]
      d = _param_count(model)
      rows.append({"model": model, "optimizer": optimizer, "factor": factor,
                   "variant": dict(variant), "label": variant.label(),
                   "bits_per_coord": variant.bits(d, N), "final_eval_mse": final.tolist(),
                   "vs_uncompressed": rel.tolist(), "mean_vs_uncompressed": float(rel.mean()),
                   "curve_mean": curve.mean(0).tolist(), "wall_s": time.perf_counter() - t0})
      print(f"{model:<6} {optimizer:<5} {factor:<8} {variant.label():<44} "
            f"{rows[-1]['bits_per_coord']:5.2f} bits  final MSE {final.mean():.4g}  "
            f"x{rel.mean():.3f} of uncompressed", flush=True)
  return {"base": dict(base), "seeds": seeds, "steps": steps, "ranks": N,
          "models": {m: {"shape": MODELS[m], "params": _param_count(m)} for m in models},
          "optimizers": optimizers, "batch_per_rank": BATCH, "train_per_rank": TRAIN,
          "reference": reference, "rows": rows}


def print_factors(result: dict) -> None:
  """The factors' table: final MSE relative to uncompressed, per model and optimizer."""
  rows = result["rows"]
  cols = list(dict.fromkeys((r["model"], r["optimizer"]) for r in rows))
  print("\n| factor | variant | bits / coord | " +
        " | ".join(f"{m} {o}" for m, o in cols) + " |")
  print("|---|---|---|" + "---|" * len(cols))
  seen = list(dict.fromkeys((r["factor"], r["label"]) for r in rows))
  for factor, label in seen:
    cells, bits = [], None
    for m, o in cols:
      hit = [r for r in rows if (r["factor"], r["label"], r["model"], r["optimizer"])
             == (factor, label, m, o)]
      cells.append(f"{hit[0]['mean_vs_uncompressed']:.3f}" if hit else "-")
      bits = bits if bits is not None or not hit else hit[0]["bits_per_coord"]
    print(f"| {factor} | {label} | {bits:.2f} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------
# part 2: bench.tta's word LM


def lm_part(args, devices) -> dict:
  """The variants on bench.harness's LM, against BF16 psum's runs of the same seeds."""
  import jax

  from dynamiq_jax.bench import harness
  variants = [parse_variant(s) for s in args.lm_variants.split(";") if s.strip()]
  seeds = [int(s) for s in args.lm_seeds.split(",") if s.strip()]
  targv = ["--tiny"] if args.tiny else []
  if args.lm_steps:
    targv += ["--steps", str(args.lm_steps)]
  targs = harness.training_args(targv)
  cfg = harness.training_config(targs)
  mesh = jax.make_mesh((cfg["workers"],), ("data",), devices=devices[:cfg["workers"]])
  stored = os.path.join(common.results_dir(None), "tta.json")
  base_runs = {}
  if os.path.exists(stored) and not args.tiny:
    with open(stored) as f:
      report = json.load(f)
    if report.get("training") == cfg:
      base_runs = report["simulate"]["runs"].get(harness.BASELINE, {})
  labels = []
  for v in variants:
    options = {k: v[k] for k in ("ratio", "rank", "row") if k in v}
    if "values" in v:
      options["values"] = v.codec().values
    options.update(v.transform_options())
    labels.append((f"ARC-Top-K {v.label()}".replace(",", ";"), "arc-topk", options))
  runs = {}
  for label in [harness.BASELINE] + [c[0] for c in labels]:
    runs[label] = {}
    for seed in seeds:
      if label == harness.BASELINE and str(seed) in base_runs:
        runs[label][str(seed)] = base_runs[str(seed)]
        continue
      t0 = time.perf_counter()
      run = harness.train_run(harness.Trainer(cfg, mesh, label, extra=labels), seed, cfg["steps"])
      run.pop("step_s", None)
      runs[label][str(seed)] = run
      print(f"{label:<48} seed {seed}: final eval loss {run['evals'][-1]['eval_loss']:.4f} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
  table = []
  targets = {s: harness.target_of(runs[harness.BASELINE][str(s)], targs.target_at, targs.smooth)
             for s in seeds}
  base_final = np.mean([runs[harness.BASELINE][str(s)]["evals"][-1]["eval_loss"] for s in seeds])
  for label, per_seed in runs.items():
    finals = [per_seed[str(s)]["evals"][-1]["eval_loss"] for s in seeds]
    hits = [harness.steps_to_target(per_seed[str(s)], targets[s], targs.smooth) for s in seeds]
    options = dict(next((c[2] for c in labels if c[0] == label), {}))
    if "values" in options:
      options["values"] = repr(options["values"])
    bits = harness.wire(cfg, label, extra=labels)["bits_per_coord"]
    table.append({"label": label, "options": options, "bits_per_coord": bits,
                  "final_eval_loss": finals, "vs_bf16": float(np.mean(finals) / base_final - 1),
                  "steps_to_target": hits, "reached": sum(h is not None for h in hits)})
  return {"training": cfg, "seeds": seeds, "targets": targets, "runs": runs, "table": table,
          "baseline_from": "docs/results/tta.json" if base_runs else "this run"}


def print_lm(result: dict) -> None:
  print(f"\n| variant | bits / coord | final eval loss vs BF16 | steps to target (seeds "
        f"{result['seeds']}) |")
  print("|---|---|---|---|")
  for r in result["table"]:
    hits = ", ".join("-" if h is None else str(h) for h in r["steps_to_target"])
    print(f"| {r['label']} | {r['bits_per_coord']:.2f} | {100 * r['vs_bf16']:+.2f}% | {hits} "
          f"({r['reached']}/{len(r['steps_to_target'])}) |")


# ---------------------------------------------------------------------------

PARTS = ("factors", "lm")


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.arctopk",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
  p.add_argument("--base", default="default",
                 help="the factors' base configuration, e.g. 'ratio=0.2,row=256,ef=ef21m,eta=0.5' "
                 "('default': the library's defaults)")
  p.add_argument("--models", default=",".join(MODELS),
                 help="comma-separated regressions, of " + ", ".join(MODELS))
  p.add_argument("--factors", default=",".join(FACTORS),
                 help="comma-separated factors, of " + ", ".join(FACTORS))
  p.add_argument("--seeds", type=int, default=3, help="seeds of the regressions (0, 1, ...)")
  p.add_argument("--steps", type=int, default=STEPS, help="steps of the regressions")
  p.add_argument("--lm-variants", default="default",
                 help="';'-separated ARC-Top-K variants for the LM part, as --base")
  p.add_argument("--lm-seeds", default="0,1,2", help="comma-separated seeds of the LM part")
  p.add_argument("--lm-steps", type=int, default=None,
                 help="LM training steps (unset: bench.tta's)")
  p.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  common.add_load_flags(p)
  return p


def main(argv=None):
  p = build_parser()
  args = p.parse_args(argv)
  parts = [s.strip() for s in args.parts.split(",") if s.strip()]
  for part in parts:
    if part not in PARTS:
      p.error(f"--parts: unknown part {part!r}; choose from {', '.join(PARTS)}")
  for name, given, known in (("--models", args.models, MODELS),
                             ("--factors", args.factors, FACTORS)):
    for x in given.split(","):
      if x not in known:
        p.error(f"{name}: unknown {x!r}; choose from {', '.join(known)}")
  for text in [args.base] + args.lm_variants.split(";"):
    try:
      parse_variant(text)
    except ValueError as e:
      p.error(str(e))
  devices = None
  if "lm" in parts:  # bench.tta's simulated devices, before anything starts JAX
    from dynamiq_jax.examples import devices as ex_devices
    devices = ex_devices.select_devices(2 if args.tiny else 4)
  out_dir = common.results_dir(args.out)
  path = os.path.join(out_dir, f"arctopk_factors{'_tiny' if args.tiny else ''}.json")
  report = {}
  if os.path.exists(path):  # the parts not run now are kept, each with its own command
    with open(path) as f:
      report = json.load(f)
  stamp = {"command": common.command_line(), "machine": common.machine()}
  report.update(stamp)
  if "factors" in parts:
    with common.load_watch("factors"):
      report["factors"] = {**factors_part(args), **stamp}
    print_factors(report["factors"])
  if "lm" in parts:
    with common.load_watch("lm"):
      report["lm"] = {**lm_part(args, devices), **stamp}
    print_lm(report["lm"])
  common.write_json(path, report, strict=args.strict)
  print(f"\nwrote {path}\nmachine: {report['machine']['platform']}, "
        f"{report['machine']['cpu_count']} CPUs, jax {report['machine']['jax']}; "
        f"command: {report['command']}")
  return report


if __name__ == "__main__":
  main()
