"""The LM training runs the benchmarks share: the codec table, the model, the training
loop and the steps to a target.

:mod:`~dynamiq_jax.bench.tta` times them over links;
:mod:`~dynamiq_jax.bench.sparse`, :mod:`~dynamiq_jax.bench.arctopk`,
:mod:`~dynamiq_jax.bench.lossy` and :mod:`~dynamiq_jax.bench.dropcompute` train
the same model. A run is a :class:`Trainer` (model, data and one codec's step on
a mesh) driven by :func:`train_run`; :func:`training_args` and
:func:`training_config` give the training flags and the configuration a run
records.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from dynamiq_jax.bench.train import smooth

__all__ = ["CODECS", "BASELINE", "MODEL", "TINY_MODEL", "TRAINING_KEYS", "TINY_TRAINING",
           "Trainer", "train_run", "wire", "codec_row", "target_of", "steps_to_target",
           "add_training_flags", "check_training_args", "training_args", "training_config"]

# (label, reducer name, reducer options)
CODECS = (
    ("BF16 psum", "psum-bf16", {}),
    ("bf16 ring", "bf16-ring", {}),
    ("DynamiQ 5b", "dynamiq", {"bits": 5.0}),
    ("DynamiQ 4b", "dynamiq", {"bits": 4.0}),
    ("MXFP8", "mxfp8", {}),
    ("MXFP6", "mxfp6", {}),
    ("MXFP4", "mxfp4", {}),
    ("THC", "thc", {}),
    ("OmniReduce", "omnireduce", {}),
    ("ARC-Top-K 0.1", "arc-topk", {"ratio": 0.1, "values": "bf16"}),
    ("ARC-Top-K 0.2", "arc-topk", {"ratio": 0.2, "values": "bf16"}),
    ("Moshpit 5b", "moshpit", {"bits": 5.0}),
    ("Moshpit 5b 10% absent", "moshpit", {"bits": 5.0, "dropout": 0.1}),
    ("Moshpit 5b 10% absent + replicas", "moshpit",
     {"bits": 5.0, "dropout": 0.1, "average_replicas": 1}),
    ("Rand-K 0.2", "randk", {"ratio": 0.2, "row": 256}),
    ("Top-K 0.1 (all-gather)", "topk-allgather", {"ratio": 0.1}),
)
BASELINE = "BF16 psum"
MODEL = dict(vocab=8192, seq_len=64, d_model=128, heads=4, layers=3, mlp=4)
TINY_MODEL = dict(vocab=512, seq_len=16, d_model=32, heads=2, layers=1, mlp=2)
# what must match for a kept phase to belong to this run
TRAINING_KEYS = ("model", "workers", "batch", "steps", "eval_every", "eval_windows", "lr",
                 "warmup")


# ---------------------------------------------------------------------------
# the training run every phase shares


class Trainer:
  """Model, data and one codec's training step on ``mesh`` (any process layout).

  Every batch is built from ``(seed, step)`` alone and every process builds
  the whole global batch, keeping the rows of its own devices, so simulated
  devices and processes see the same data.
  """

  def __init__(self, cfg: dict, mesh, label: str, extra: tuple = ()):
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    import dynamiq_jax as dq
    from dynamiq_jax.bench import baselines, lm

    self.cfg, self.mesh, self.label = cfg, mesh, label
    self.lcfg = lm.LMConfig(**cfg["model"])
    toks = lm.tokens(self.lcfg.vocab)
    cut = int(toks.size * 0.95)
    self.train_tokens, held_out = toks[:cut], toks[cut:]
    length = self.lcfg.seq_len + 1
    starts = np.linspace(0, held_out.size - length, cfg["eval_windows"]).astype(np.int64)
    window = held_out[starts[:, None] + np.arange(length)]
    self.eval_batch = (window[:, :-1], window[:, 1:])
    self.graphdef = nnx.graphdef(lm.CharTransformer(self.lcfg, seed=0))
    self.n = mesh.shape["data"]
    self.data = NamedSharding(mesh, P("data"))
    self.repl = NamedSharding(mesh, P())
    _, name, options = codec_row(label, extra)
    options, every = _replicas(options)
    seed_opt = {} if name.startswith("psum-") else {"seed": 0}
    make = baselines.reducer if name in baselines.REDUCERS else dq.reducer  # the baselines
    # a Moshpit row with average_replicas: the replicas averaged in the same rounds, last
    last = [_average_replicas(options, every)] if every else []
    self.tx = optax.chain(
        make(name, "data", **seed_opt, **options),
        optax.adamw(optax.warmup_cosine_decay_schedule(
            0.0, cfg["lr"], cfg["warmup"], max(cfg["steps"], cfg["warmup"] + 1),
            end_value=cfg["lr"] / 10), weight_decay=0.01), *last)
    # Moshpit averaging leaves each rank its own result: each rank keeps its own parameters
    self.per_rank = name == "moshpit"
    self.step = dq.data_parallel_step(self.loss, self.tx, mesh=mesh, donate=False,
                                      per_rank=self.per_rank)
    self.eval_fn = jax.jit(self.loss)

  def loss(self, params, batch):
    from flax import nnx

    from dynamiq_jax.bench import lm
    return lm.lm_loss(nnx.merge(self.graphdef, nnx.State(params))(batch[0]), batch[1])

  def init(self, seed: int):
    """Replicated parameters and optimizer state of ``seed``'s initialisation."""
    import jax
    from flax import nnx

    from dynamiq_jax.bench import lm
    from dynamiq_jax.training.train import is_per_rank
    _, state = nnx.split(lm.CharTransformer(self.lcfg, seed=seed), nnx.Param)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    opt = jax.tree.map(np.asarray, self.tx.init(params))

    # rows along the leading axis repeated for every rank, split over the data axis
    split = lambda t: jax.tree.map(lambda a: self._put(np.repeat(a, self.n, axis=0), self.data),
                                   t)
    if self.per_rank:  # every leaf: one copy per rank
      return split(jax.tree.map(lambda a: np.asarray(a)[None], (params, opt)))

    def put(x):  # per-rank state (error feedback): one slice per rank
      return split(x) if is_per_rank(x) else self._put(x, self.repl)

    return self._put(params, self.repl), jax.tree.map(put, opt, is_leaf=is_per_rank)

  def _put(self, tree, sharding):
    import jax
    return jax.tree.map(lambda a: jax.make_array_from_callback(
        np.shape(a), sharding, lambda idx, a=np.asarray(a): a[idx]), tree)

  def batch(self, seed: int, step: int):
    """The global batch of ``step`` (``n x batch`` windows), split over the data axis."""
    rng = np.random.default_rng([seed, step])
    length = self.lcfg.seq_len + 1
    starts = rng.integers(0, self.train_tokens.size - length, self.n * self.cfg["batch"])
    window = self.train_tokens[starts[:, None] + np.arange(length)]
    return self._put((window[:, :-1], window[:, 1:]), self.data)

  def evaluate(self, params) -> tuple[float, str]:
    """(held-out loss, parameter digest), from this process's (first) copy of the
    parameters."""
    import jax
    local = jax.tree.map(lambda a: a.addressable_data(0), params)
    if self.per_rank:
      local = jax.tree.map(lambda a: a[0], local)
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(local):
      h.update(np.asarray(leaf).tobytes())
    return float(self.eval_fn(local, self.eval_batch)), h.hexdigest()[:16]

  def spread(self, params) -> float | None:
    """With per-rank parameters: the largest distance of this process's copies from their
    mean, relative to the mean's norm (0: identical replicas); else None."""
    import jax
    if not self.per_rank:
      return None
    rows = []
    for leaf in jax.tree.leaves(params):
      shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
      rows.append(np.concatenate([np.asarray(s.data, np.float64).reshape(s.data.shape[0], -1)
                                  for s in shards]))
    flat = np.concatenate(rows, axis=1)
    mean = flat.mean(0)
    return float(np.max(np.linalg.norm(flat - mean, axis=1)) / np.linalg.norm(mean))


def wire(cfg: dict, label: str, extra: tuple = ()) -> dict:
  """Bits per coordinate and bytes each rank sends per step, for ``label`` (a row of
  :data:`CODECS` or ``extra``) on ``cfg``'s model."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import dynamiq_jax as dq
  from dynamiq_jax.bench import baselines, lm
  from dynamiq_jax.registry import moshpit_options
  from dynamiq_jax.schedules import ring_bytes_per_rank

  model = nnx.eval_shape(lambda: lm.CharTransformer(lm.LMConfig(**cfg["model"]), seed=0))
  d = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
  n = cfg["workers"]
  _, name, options = codec_row(label, extra)
  if name in baselines.REDUCERS:  # the baselines: Top-K's all-gather, Rand-K
    return {"params": d, **baselines.wire(name, d, n, **options)}
  if name.startswith("psum-"):  # XLA's all-reduce, taken as a ring of the dtype
    bits = 8 * jnp.dtype(jnp.bfloat16 if name == "psum-bf16" else jnp.float32).itemsize
    return {"params": d, "bits_per_coord": float(bits),
            "bytes_per_rank": ring_bytes_per_rank(bits / 8 * d, n)}
  schedule = "ring"
  options, every = _replicas(options)
  for feedback in ("error_feedback", "ef21m_momentum"):  # dq.reducer's, not the codec's
    options.pop(feedback, None)
  if name == "moshpit":
    schedule, name, options = moshpit_options(options)
  st = dq.wire_stats(jax.ShapeDtypeStruct((d,), jnp.float32),
                     codec=dq.codec_from_name(name, **options), n=n, schedule=schedule)
  extra = 0.0  # the replicas' averaging: f32 parameters to the group mates, per round
  if every:
    from dynamiq_jax.engine.moshpit import replica_bytes_per_rank
    extra = replica_bytes_per_rank(jax.ShapeDtypeStruct((d,), jnp.float32),
                                   schedule.plan(n)) / every
  return {"params": d, "bits_per_coord": float(st.bits_per_coord),
          "bytes_per_rank": float(st.bytes_per_rank) + extra}


def _replicas(options: dict):
  """A row's options without ``average_replicas`` (Moshpit rows: average the replicas
  every this many steps, ``dq.average_replicas`` last in the chain), and that count (0)."""
  options = dict(options)
  return options, int(options.pop("average_replicas", 0))


def _average_replicas(options: dict, every: int):
  from dynamiq_jax.engine.moshpit import average_replicas
  from dynamiq_jax.registry import moshpit_options
  schedule, _, _ = moshpit_options(options)
  return average_replicas("data", schedule=schedule, seed=0, every=every)


def _scalar(x) -> float:
  return float(np.asarray(x.addressable_data(0)))


def train_run(trainer: Trainer, seed: int, steps: int, *, sync=None, progress=None) -> dict:
  """Trains ``steps`` steps of ``seed`` and evaluates every ``eval_every``.

  ``sync``: called before each step (a barrier across processes, so the
  clock of every process covers the same step). The clock runs over the
  steps only, not the evaluations.

  Returns:
    ``{"train_loss": [...], "step_s": [...], "evals": [{"step", "eval_loss",
    "wall_s", "digest"}]}`` (``evals`` includes step 0).
  """
  import jax
  params, opt = trainer.init(seed)
  every = trainer.cfg["eval_every"]
  loss0, digest0 = trainer.evaluate(params)
  first = {"step": 0, "eval_loss": loss0, "wall_s": 0.0, "digest": digest0}
  if trainer.per_rank:
    first["replica_spread"] = trainer.spread(params)
  out = {"train_loss": [], "step_s": [], "evals": [first]}
  wall = 0.0
  for s in range(steps):
    batch = trainer.batch(seed, s)
    if sync:
      sync()
    t0 = time.perf_counter()
    params, opt, loss = trainer.step(params, opt, batch)
    jax.block_until_ready((params, opt, loss))
    dt = time.perf_counter() - t0
    wall += dt
    out["step_s"].append(dt)
    out["train_loss"].append(_scalar(loss))
    if (s + 1) % every == 0 or s + 1 == steps:
      value, digest = trainer.evaluate(params)
      out["evals"].append({"step": s + 1, "eval_loss": value, "wall_s": wall, "digest": digest})
      if trainer.per_rank:
        out["evals"][-1]["replica_spread"] = trainer.spread(params)
    if progress:
      progress()
  return out


def codec_row(label: str, extra: tuple = ()) -> tuple:
  """``(label, reducer name, reducer options)`` of ``label``, from :data:`CODECS` and ``extra``
  (rows a benchmark adds for its own runs)."""
  for c in CODECS + tuple(extra):
    if c[0] == label:
      return c
  raise ValueError(f"codec {label!r} is not one of {[c[0] for c in CODECS + tuple(extra)]}")


# ---------------------------------------------------------------------------
# target and steps to target


def _eval_curve(run: dict, window: int):
  steps = np.array([e["step"] for e in run["evals"]])
  return steps, smooth([e["eval_loss"] for e in run["evals"]], window)


def target_of(bf16_run: dict, target_at: float, window: int) -> float:
  """BF16's smoothed eval loss at (the last evaluation at or before) ``target_at`` of its run."""
  steps, curve = _eval_curve(bf16_run, window)
  at = target_at * steps[-1]
  return float(curve[np.nonzero(steps <= at + 1e-9)[0][-1]])


def steps_to_target(run: dict, target: float, window: int) -> int | None:
  """First evaluated step whose smoothed eval loss is <= ``target`` (None: never)."""
  steps, curve = _eval_curve(run, window)
  hit = np.nonzero((curve <= target) & (steps > 0))[0]
  return int(steps[hit[0]]) if hit.size else None


# ---------------------------------------------------------------------------
# the training flags


TINY_TRAINING = dict(seeds="0", workers=2, steps=6, batch=2, warmup=2, eval_every=2,
                     eval_windows=4, smooth=1)
"""The training flags' defaults under ``--tiny`` (a smoke test)."""


def add_training_flags(p: argparse.ArgumentParser) -> None:
  """The flags of a training run: seeds, workers, steps, batch, learning rate and warm-up,
  evaluations, and the target."""
  p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
  p.add_argument("--workers", type=int, default=4, help="data-parallel ranks")
  p.add_argument("--steps", type=int, default=200, help="training steps per run")
  p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
  p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
  p.add_argument("--warmup", type=int, default=20, help="warm-up steps (then cosine to lr/10)")
  p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
  p.add_argument("--eval-windows", type=int, default=64, help="held-out sequences evaluated")
  p.add_argument("--smooth", type=int, default=3, help="evaluations in the moving average")
  p.add_argument("--target-at", type=float, default=0.8,
                 help="target = BF16's smoothed eval loss at this fraction of its run")
  p.add_argument("--tiny", action="store_true",
                 help="smoke test: 2 workers, a tiny LM, a few steps")


def check_training_args(p: argparse.ArgumentParser, args) -> None:
  """Turns ``--seeds`` into a list of ints; ``p.error`` on a bad training flag."""
  if isinstance(args.seeds, str):
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
  if args.workers < 2:
    p.error(f"--workers={args.workers}: an all-reduce needs at least 2")
  if not 0 < args.target_at <= 1:
    p.error(f"--target-at must be in (0, 1]; got {args.target_at}")
  if args.steps < args.eval_every:
    p.error(f"--steps={args.steps} must be at least --eval-every={args.eval_every}")


def training_args(argv=(), prog: str = "training") -> argparse.Namespace:
  """The training flags of ``argv`` alone (``--tiny`` sets :data:`TINY_TRAINING`), checked."""
  argv = list(argv)
  p = argparse.ArgumentParser(prog=prog)
  add_training_flags(p)
  if "--tiny" in argv:
    p.set_defaults(**TINY_TRAINING)
  args = p.parse_args(argv)
  check_training_args(p, args)
  return args


def training_config(args) -> dict:
  """What a run records of its training flags (:data:`TRAINING_KEYS` and the model)."""
  return {"model": dict(TINY_MODEL if args.tiny else MODEL), "workers": args.workers,
          "batch": args.batch, "steps": args.steps, "eval_every": args.eval_every,
          "eval_windows": args.eval_windows, "lr": args.lr, "warmup": args.warmup}
