"""Sparsification: ARC-Top-K against the Top-K and Rand-K baselines it replaces.

    python -m dynamiq_jax.bench.sparse                      # every part
    python -m dynamiq_jax.bench.sparse --parts synthetic    # the authors' synthetic experiment
    python -m dynamiq_jax.bench.sparse --parts training     # EF21-M's momentum, row width
    python -m dynamiq_jax.bench.sparse --tiny               # smoke test (CI)

The baselines live in :mod:`~dynamiq_jax.bench.baselines` (benchmarks only; the
library ships ARC-Top-K).

Parts:

1. ``rows``: which rows to select. The authors' DDP hook takes the rows of
   each 2-D leaf (1-D leaves: each coordinate a row, sketched by itself);
   :class:`~dynamiq_jax.codecs.ARCTopK` takes fixed-width rows of the flat
   bucket (the hook's rule is measured along both the first and the last
   axis of a leaf: PyTorch's linear kernels are Flax's transposed). On the
   word LM's real per-rank gradients (:mod:`dynamiq_jax.bench.lm`,
   4 ranks, at three training steps), for ratio 0.1 and 0.2: the fraction of
   the reduced gradient's energy in the rows each rule sends, with the exact
   selection and with a rank-4 Gaussian sketch (mean of 8 sketches), and each
   rule's bits per coordinate (bf16 values, float32 sketch).
2. ``synthetic``: the authors' synthetic experiment (``RobustShiftedObjective``
   of ``synthetic_release/main.py`` in the public repository
   ``Aris-ma/AllreduceTopK``: 10 nodes, 2000 coordinates as 200 rows of 10,
   5% of the rows sent, EF21-M with momentum 0.5, 1000 steps), every
   compressor run through the library's optax transform on 10 simulated
   ranks (``jax.vmap`` over the data axis): no compression, Rand-K, local
   Top-K (all-gather), ARC-Top-K exact and with a rank-2 sketch. Writes the
   distance to the optimum and the loss per step, and the curves.
3. ``training``: ARC-Top-K 0.2 trained on :mod:`dynamiq_jax.bench.harness`'s word
   LM (AdamW after the reduction; its simulated phase, seed 0) with EF21-M
   at eta 0.1, 0.5 and 1 (EF21), with EF14, and with rows of 64 and 1024.

Writes ``docs/results/sparse.json`` and ``sparse_synthetic.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dynamiq_jax.bench import common
from dynamiq_jax.bench import harness
from dynamiq_jax.bench.baselines import RandK, topk_allgather

__all__ = ["rows_part", "synthetic_part", "training_part", "RobustShiftedObjective",
           "build_parser", "main"]


# ---------------------------------------------------------------------------
# part 1: which rows


def _leaf_shapes(cfg):
  from flax import nnx

  from dynamiq_jax.bench import lm
  model = nnx.eval_shape(lambda: lm.CharTransformer(cfg, seed=0))
  return [tuple(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _leaf_rows(mean, shapes, last: bool = False):
  """The mean cut into the hook's rows, leaf by leaf: ``[(rows [h, m], sketched)]`` (1-D
  leaves: each coordinate a row, its sketch the coordinate itself). Rows along the first
  axis (the hook's ``tensor.shape[0]``), or with ``last`` along the last one: PyTorch
  stores a linear layer's kernel as (out, in), Flax as (in, out), so the hook's rows of
  a PyTorch model are a Flax kernel's columns."""
  out, offset = [], 0
  for shape in shapes:
    size = int(np.prod(shape))
    leaf = mean[offset:offset + size]
    offset += size
    if len(shape) == 1:
      out.append((leaf.reshape(-1, 1), False))
    elif last:
      out.append((leaf.reshape(-1, shape[-1]).T, True))
    else:
      out.append((leaf.reshape(shape[0], -1), True))
  return out


def _fixed_rows(mean, shapes, row):
  """The leaves end to end in backward order (as the bucket layout lays them), as rows."""
  starts = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
  flat = np.concatenate([mean[starts[i]:starts[i + 1]] for i in reversed(range(len(shapes)))])
  h = -(-flat.size // row)
  return [(np.pad(flat, (0, h * row - flat.size)).reshape(h, row), True)]


def _capture(groups, ratio, rank, rng_, sketches):
  """(energy fraction in the rows sent, sketch bits, payload coordinates) of a rule, the
  selection per group of rows exact (``rank=None``) or by a Gaussian sketch (mean over
  ``sketches`` draws)."""
  total = sum(float(np.sum(r.astype(np.float64) ** 2)) for r, _ in groups)
  fractions, sketch_bits, coords = [], 0, 0
  for draw in range(1 if rank is None else sketches):
    kept = 0.0
    for rows, sketched in groups:
      h, m = rows.shape
      k = max(1, int(math.floor(ratio * h)))
      norms = np.sum(rows.astype(np.float64) ** 2, axis=-1)
      if rank is None or not sketched or m <= rank:
        scores = norms
        width = m
      else:
        v = rng_.standard_normal((m, rank))
        scores = np.sum((rows @ v) ** 2, axis=-1)
        width = rank
      top = np.argpartition(-scores, k - 1)[:k]
      kept += float(norms[top].sum())
      if draw == 0:
        sketch_bits += 32 * h * width
        coords += k * m
    fractions.append(kept / total)
  return float(np.mean(fractions)), sketch_bits, coords


def rows_part(args) -> list[dict]:
  from dynamiq_jax.bench import lm
  cfg = lm.LMConfig(**(harness.TINY_MODEL if args.tiny else harness.MODEL))
  steps = (0, 20) if args.tiny else (0, 100, 300)
  n = 4
  grads, info = lm.cached_gradients(args.cache or None, "sparse-rows", n, steps, cfg,
                                    micro_batch=8)
  shapes = _leaf_shapes(cfg)
  d = info["params"]
  rules = [("leaf rows, first axis", lambda m: _leaf_rows(m, shapes)),
           ("leaf rows, last axis", lambda m: _leaf_rows(m, shapes, last=True))]
  rules += [(f"fixed rows of {w}", lambda m, w=w: _fixed_rows(m, shapes, w))
            for w in ((32, 128) if args.tiny else (32, 64, 128, 256, 1024))]
  out = []
  for step, g in sorted(grads.items()):
    mean = g.astype(np.float64).mean(0)
    for ratio in (0.1, 0.2):
      for label, cut in rules:
        groups = cut(mean)
        exact, _, coords = _capture(groups, ratio, None, None, 1)
        sketch, bits, _ = _capture(groups, ratio, 4, np.random.default_rng(step), args.sketches)
        out.append({"step": step, "ratio": ratio, "rule": label, "energy_exact": exact,
                    "energy_sketch4": sketch, "sketch_bits_per_coord": bits / d,
                    "payload_bits_per_coord": 16 * coords / d,
                    "bits_per_coord": (bits + 16 * coords) / d})
        r = out[-1]
        print(f"step {step:4d} ratio {ratio:.1f} {label:<24} energy sent: exact "
              f"{r['energy_exact']:.3f}, sketch {r['energy_sketch4']:.3f}; bits/coord "
              f"{r['bits_per_coord']:.2f} (sketch {r['sketch_bits_per_coord']:.2f})", flush=True)
  return out


# ---------------------------------------------------------------------------
# part 2: the authors' synthetic experiment


class RobustShiftedObjective:
  """The authors' synthetic objective (``synthetic_release/main.py``): ``blocks`` rows of
  ``block`` coordinates; rows ``[0, noise_blocks)`` are noise rows whose targets differ
  between the two halves of the nodes (``+/- noise_scale``) and move with the signal
  row (``+/- gamma w_s``); row ``noise_blocks`` is the signal row (target
  ``signal_scale``). Local Top-K sends the noise rows, large on every node and
  cancelling in the mean; the mean's top rows hold the signal."""

  def __init__(self, nodes=10, blocks=200, block=10, noise_blocks=150, noise_scale=100.0,
               signal_scale=1.0, gamma=5.0):
    self.nodes, self.block, self.noise_blocks = nodes, block, noise_blocks
    self.dim = blocks * block
    self.signal = slice(noise_blocks * block, (noise_blocks + 1) * block)
    self.noise_scale, self.signal_scale, self.gamma = noise_scale, signal_scale, gamma
    half = nodes // 2
    sign = np.where(np.arange(nodes) < half, 1.0, -1.0)[:, None]
    self.shift = sign * noise_scale  # per node, the same on every noise coordinate
    self.gam = sign * gamma
    self.scale = 1.0 / max(1, noise_blocks)
    mean_gam_xi = float(np.mean(self.gam * self.shift))
    mean_gam_sq = float(np.mean(self.gam ** 2))
    w_s = (signal_scale - mean_gam_xi) / (1.0 + mean_gam_sq)
    w_n = float(np.mean(self.shift)) + float(np.mean(self.gam)) * w_s
    self.w_star = np.zeros(self.dim)
    self.w_star[self.signal] = w_s
    self.w_star[:noise_blocks * block] = w_n

  def grads(self, w, rng_, noise_std=0.001):
    """Every node's gradient ``[nodes, dim]`` at ``w``, plus Gaussian noise."""
    nb, b = self.noise_blocks, self.block
    w_s = w[self.signal]
    noise = w[:nb * b].reshape(nb, b)
    residual = noise[None] - (self.shift[:, :, None] + self.gam[:, :, None] * w_s)
    g = np.zeros((self.nodes, self.dim))
    g[:, :nb * b] = (residual * self.scale).reshape(self.nodes, -1)
    cross = np.sum(residual * -self.gam[:, :, None], axis=1) * self.scale
    g[:, self.signal] = (w_s - self.signal_scale)[None] + cross
    if noise_std > 0:
      g = g + rng_.normal(0.0, noise_std, g.shape)
    return g

  def loss(self, w):
    nb, b = self.noise_blocks, self.block
    w_s = w[self.signal]
    target = self.shift[:, :, None] + self.gam[:, :, None] * w_s
    diff = w[:nb * b].reshape(nb, b)[None] - target
    return float(0.5 * np.sum((w_s - self.signal_scale) ** 2)
                 + self.scale * 0.5 * np.mean(np.sum(diff ** 2, axis=(1, 2))))

  def distance(self, w):
    return float(np.linalg.norm(w - self.w_star))


SYNTHETIC = dict(nodes=10, steps=1000, ratio=0.05, row=10, beta=0.5, lr=0.001, sketch=2,
                 noise_std=0.001, seed=42)


def _synthetic_compressors(cfg):
  import dynamiq_jax as dq
  from dynamiq_jax import codecs
  eta = 1.0 - cfg["beta"]
  arc = dict(ratio=cfg["ratio"], row=cfg["row"], values="f32")

  def psum(codec):
    return dq.compressed_psum("nodes", codec=codec, seed=cfg["seed"], error_feedback="ef21m",
                              ef21m_momentum=eta, bucket_size=cfg["row"] * 1000)

  return {
      "No compressor": psum(codecs.F32()),
      "Rand-K": psum(RandK(**arc)),
      "Local Top-K (all-gather)": topk_allgather("nodes", **arc, ef21m_momentum=eta),
      "ARC-Top-K exact": psum(codecs.ARCTopK(rank=None, **arc)),
      f"ARC-Top-K sketch r={cfg['sketch']}": psum(codecs.ARCTopK(rank=cfg["sketch"], **arc)),
  }


def synthetic_part(args) -> dict:
  """The authors' experiment; their update ``v <- beta v + g`` is EF21-M's with ``eta = 1 -
  beta`` and the learning rate divided by ``eta`` (every compressor here commutes with
  scaling), so ``optax.sgd(lr / eta)`` after ``ef21m_momentum=eta``."""
  cfg = dict(SYNTHETIC, steps=60 if args.tiny else SYNTHETIC["steps"])
  obj = RobustShiftedObjective(nodes=cfg["nodes"])
  eta = 1.0 - cfg["beta"]
  curves = {}
  for label, reduce in _synthetic_compressors(cfg).items():
    tx = optax.chain(reduce, optax.sgd(cfg["lr"] / eta))
    w = np.zeros(obj.dim, np.float32)
    state = jax.tree.map(lambda a: jnp.stack([a] * cfg["nodes"]), tx.init(jnp.asarray(w)))
    step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s), axis_name="nodes"))
    rng_ = np.random.default_rng(cfg["seed"])
    dist, loss = [], []
    for _ in range(cfg["steps"]):
      g = obj.grads(w.astype(np.float64), rng_, cfg["noise_std"]).astype(np.float32)
      upd, state = step(jnp.asarray(g), state)
      upd = np.asarray(upd)
      if not (upd == upd[:1]).all():
        raise RuntimeError(f"{label}: the ranks' updates differ")
      w = w + upd[0]
      dist.append(obj.distance(w.astype(np.float64)))
      loss.append(obj.loss(w.astype(np.float64)))
    curves[label] = {"distance": dist, "loss": loss}
    print(f"{label:<28} distance to w*: {dist[0]:.4g} -> {dist[-1]:.4g}; loss - loss(w*): "
          f"{loss[-1] - obj.loss(obj.w_star):.4g}", flush=True)
  return {"config": cfg, "w_star_distance_at_0": obj.distance(np.zeros(obj.dim)),
          "optimum_loss": obj.loss(obj.w_star), "curves": curves}


def _plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(11, 4))
  for label, c in result["curves"].items():
    axes[0].plot(c["distance"], label=label)
    axes[1].plot(np.asarray(c["loss"]) - result["optimum_loss"], label=label)
  for ax, name in zip(axes, ("distance to w*", "loss - loss(w*)")):
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=8)
  cfg = result["config"]
  fig.suptitle(f"RobustShiftedObjective, {cfg['nodes']} nodes, {cfg['ratio']:g} of the rows, "
               f"EF21-M (beta {cfg['beta']:g})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


TRAINING = (  # (EF21-M's eta or None, the feedback rule, row width)
    (0.1, "ef21m", 256), (0.5, "ef21m", 256), (1.0, "ef21m", 256), (None, "ef14", 256),
    (0.5, "ef21m", 64), (0.5, "ef21m", 1024))


def training_part(args, devices) -> list[dict]:
  """ARC-Top-K 0.2 on bench.harness's word LM (AdamW after the reduction, one seed, its
  simulated phase's training): EF21-M at several momenta, EF14, and other row widths."""
  labels = []
  for eta, rule, row in TRAINING[:1] if args.tiny else TRAINING:  # --tiny: one, for CI's time
    options = {"ratio": 0.2, "row": row, "values": "bf16", "error_feedback": rule}
    if eta is not None:
      options["ef21m_momentum"] = eta
    labels.append((f"ARC-Top-K 0.2 rows {row} {rule}" + (f" eta {eta:g}" if eta else ""),
                   "arc-topk", options))
  cfg = harness.training_config(harness.training_args(["--tiny"] if args.tiny else []))
  mesh = jax.make_mesh((cfg["workers"],), ("data",), devices=devices[:cfg["workers"]])
  out = []
  for label, _, options in labels:
    run = harness.train_run(harness.Trainer(cfg, mesh, label, extra=labels), 0, cfg["steps"])
    final = run["evals"][-1]["eval_loss"]
    out.append({"label": label, "options": options, "evals": run["evals"],
                "final_eval_loss": final})
    print(f"{label:<42} final eval loss {final:.4f}", flush=True)
  return out


PARTS = ("rows", "synthetic", "training")


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.sparse",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
  p.add_argument("--sketches", type=int, default=8, help="sketch draws averaged (part rows)")
  common.add_data_flags(p)
  return p


def main(argv=None):
  p = build_parser()
  args = p.parse_args(argv)
  parts = [s.strip() for s in args.parts.split(",") if s.strip()]
  for part in parts:
    if part not in PARTS:
      p.error(f"--parts: unknown part {part!r}; choose from {', '.join(PARTS)}")
  devices = None
  if "training" in parts:  # bench.tta's simulated devices, before anything starts JAX
    from dynamiq_jax.examples import devices as ex_devices
    devices = ex_devices.select_devices(2 if args.tiny else 4)
  out_dir = common.results_dir(args.out)
  suffix = "_tiny" if args.tiny else ""
  path = os.path.join(out_dir, f"sparse{suffix}.json")
  report = {}
  if os.path.exists(path):  # the parts not run now are kept, each with its own command
    with open(path) as f:
      report = json.load(f)
  stamp = {"command": common.command_line(), "machine": common.machine()}
  report.update(stamp)
  if "rows" in parts:
    report["rows"] = {"rows": rows_part(args), **stamp}
  if "training" in parts:
    report["training"] = {"runs": training_part(args, devices), **stamp}
  if "synthetic" in parts:
    report["synthetic"] = {**synthetic_part(args), **stamp}
    png = os.path.join(out_dir, f"sparse_synthetic{suffix}.png")
    _plot(report["synthetic"], png)
    print(f"wrote {png}")
  common.write_json(path, report, strict=args.strict)
  print(f"wrote {path}\nmachine: {report['machine']['platform']}; reproduce: {report['command']}")
  return report


if __name__ == "__main__":
  main()
