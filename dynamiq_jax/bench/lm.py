"""A small byte-level transformer LM on an offline corpus, and real gradients from it.

The corpus is the Python standard library's own source text (every ``.py``
file under ``sysconfig.get_paths()["stdlib"]``, sorted, concatenated up to a
byte budget): real text that every Python installation ships, so nothing is
downloaded. :func:`capture_gradients` trains the model for a while and, at
chosen steps, records the gradient each of ``n`` workers would compute on its
own micro-batch at the same parameters: per-worker gradient snapshots
``[n, d]`` of a real model on real data, for the vNMSE benchmark.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
import sysconfig

import numpy as np

__all__ = ["LMConfig", "stdlib_corpus", "tokens", "CharTransformer", "lm_loss",
           "capture_gradients", "cached_gradients"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
  """Model and tokenisation.

  ``vocab=256`` is byte-level; a larger ``vocab`` tokenises into words and
  punctuation, keeping the ``vocab - 1`` most frequent tokens of the corpus
  (plus one "unknown" id), like the large-vocabulary LLMs of the paper, whose
  embedding and output rows for tokens absent from a micro-batch get tiny or
  zero gradients.
  """

  vocab: int = 256
  seq_len: int = 128
  d_model: int = 128
  heads: int = 4
  layers: int = 3
  mlp: int = 4


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 4 << 20) -> np.ndarray:
  """uint8 bytes of the standard library's .py sources (sorted paths, deterministic)."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
    paths.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  chunks, total = [], 0
  for p in sorted(paths):
    try:
      with open(p, "rb") as f:
        data = f.read()
    except OSError:
      continue
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  if total < 1 << 16:
    raise RuntimeError(f"found only {total} bytes of Python source under {root}")
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


_TOKEN = re.compile(rb"[A-Za-z_][A-Za-z_0-9]*|[0-9]+|\S")


@functools.lru_cache(maxsize=4)
def tokens(vocab: int) -> np.ndarray:
  """The corpus as int32 token ids (bytes if ``vocab == 256``, else words)."""
  corpus = stdlib_corpus()
  if vocab == 256:
    return corpus.astype(np.int32)
  words = _TOKEN.findall(corpus.tobytes())
  counts = collections.Counter(words)
  keep = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:vocab - 1]]
  ids = {w: i + 1 for i, w in enumerate(keep)}  # 0 = unknown
  return np.fromiter((ids.get(w, 0) for w in words), dtype=np.int32, count=len(words))


def _model_class():
  from flax import nnx
  import jax.numpy as jnp

  class Block(nnx.Module):

    def __init__(self, cfg: LMConfig, rngs):
      self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(num_heads=cfg.heads, in_features=cfg.d_model,
                                         decode=False, rngs=rngs)
      self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
      self.up = nnx.Linear(cfg.d_model, cfg.mlp * cfg.d_model, rngs=rngs)
      self.down = nnx.Linear(cfg.mlp * cfg.d_model, cfg.d_model, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.attn(self.ln1(x), mask=mask)
      return x + self.down(nnx.gelu(self.up(self.ln2(x))))

  class CharTransformer(nnx.Module):
    """Decoder-only transformer over bytes."""

    def __init__(self, cfg: LMConfig, rngs):
      self.cfg = cfg
      self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
      self.pos = nnx.Param(0.02 * jnp.ones((cfg.seq_len, cfg.d_model)) *
                           nnx.initializers.normal(1.0)(rngs.params(), (cfg.seq_len, cfg.d_model)))
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
      self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
      self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
      t = tokens.shape[-1]
      x = self.embed(tokens) + self.pos[:t]
      mask = nnx.make_causal_mask(tokens)
      for blk in self.blocks:
        x = blk(x, mask)
      return self.head(self.ln(x))

  return CharTransformer


def CharTransformer(cfg: LMConfig, seed: int = 0):  # noqa: N802 (a factory)
  """A :class:`LMConfig` model (Flax NNX), initialised from ``seed``."""
  from flax import nnx
  return _model_class()(cfg, nnx.Rngs(seed))


def lm_loss(logits, targets):
  import optax
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _batches(corpus, cfg: LMConfig, rng: np.random.Generator, batch: int):
  starts = rng.integers(0, corpus.size - cfg.seq_len - 1, batch)
  window = np.stack([corpus[s:s + cfg.seq_len + 1] for s in starts]).astype(np.int32)
  return window[:, :-1], window[:, 1:]


def cached_gradients(cache_dir: str | None, tag: str, n, steps, cfg: LMConfig, **kw):
  """:func:`capture_gradients`, stored as ``.npz`` under ``cache_dir`` (None: no cache)."""
  import json
  path = None
  if cache_dir:
    os.makedirs(cache_dir, exist_ok=True)
    key = json.dumps([tag, n if isinstance(n, int) else sorted(n.items()), list(steps),
                      dataclasses.asdict(cfg), sorted(kw.items())], sort_keys=True)
    path = os.path.join(cache_dir, f"grads_{tag}_{abs(hash_str(key)):x}.npz")
    if os.path.exists(path):
      with np.load(path, allow_pickle=False) as z:
        grads = {int(k[5:]): z[k] for k in z.files if k.startswith("step_")}
        info = json.loads(str(z["info"]))
      return grads, info
  grads, info = capture_gradients(n, steps, cfg=cfg, **kw)
  if path:
    np.savez(path, info=json.dumps(info), **{f"step_{k}": v for k, v in grads.items()})
  return grads, info


def hash_str(s: str) -> int:
  """A stable 64-bit hash (Python's hash() is salted per process)."""
  import hashlib
  return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "little")


def capture_gradients(n, steps: tuple[int, ...] = (0, 100, 300), *, cfg: LMConfig = LMConfig(),
                      micro_batch: int = 4, train_batch: int = 32, lr: float = 1e-3,
                      seed: int = 0, bf16: bool = True):
  """Per-worker gradients ``{step: float32 [n, d]}`` of the LM at the given steps.

  ``n`` is the number of workers, or a ``{step: workers}`` dict.

  Trains on one device with Adam (``train_batch`` sequences per step); at each
  requested step, worker ``i`` computes the gradient of the mean loss on its
  own ``micro_batch`` random sequences at the current parameters. With
  ``bf16`` the gradients are rounded to bfloat16, as the paper's models are.

  Returns:
    ``(grads, info)``: the snapshots and a dict with the parameter count and
    the training losses.
  """
  import jax
  import optax
  from flax import nnx
  from ml_dtypes import bfloat16

  corpus = tokens(cfg.vocab)
  model = CharTransformer(cfg, seed)
  graphdef, params = nnx.split(model, nnx.Param)
  tx = optax.adam(lr)
  opt = tx.init(params)

  def loss_fn(p, x, y):
    return lm_loss(nnx.merge(graphdef, p)(x), y)

  grad_fn = jax.jit(jax.grad(loss_fn))

  @jax.jit
  def train_step(p, o, x, y):
    loss, g = jax.value_and_grad(loss_fn)(p, x, y)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  rng = np.random.default_rng(seed)
  out, losses = {}, []
  for step in range(max(steps) + 1):
    if step in steps:
      per = []
      for _ in range(n[step] if isinstance(n, dict) else n):
        x, y = _batches(corpus, cfg, rng, micro_batch)
        g = grad_fn(params, x, y)
        per.append(np.concatenate([np.asarray(v, np.float32).ravel()
                                   for v in jax.tree.leaves(g)]))
      snap = np.stack(per)
      out[step] = snap.astype(bfloat16).astype(np.float32) if bf16 else snap
    if step < max(steps):
      x, y = _batches(corpus, cfg, rng, train_batch)
      params, opt, loss = train_step(params, opt, x, y)
      losses.append(float(loss))
  d = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
  return out, {"params": d, "train_losses": losses, "config": dataclasses.asdict(cfg)}
