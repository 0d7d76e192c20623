"""Data that needs no download: scikit-learn's digits, and Python's own source code.

Every batch is a pure function of ``(seed, position)``, where ``position``
counts the batches drawn so far. A checkpoint stores the position, so a
restored run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig

import numpy as np


@dataclasses.dataclass(frozen=True)
class Digits:
  """scikit-learn's 8x8 digits, split into train and test.

  Attributes:
    x_train: float32[n_train, 8, 8, 1] in [0, 1].
    y_train: int32[n_train] class labels 0..9.
    x_test: float32[n_test, 8, 8, 1].
    y_test: int32[n_test].
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits(test_fraction: float = 0.25, split_seed: int = 0) -> Digits:
  """The 1,797 digits of ``sklearn.datasets.load_digits``, stratified split.

  The split depends only on ``split_seed``, not on the training seed, so
  runs with different seeds are evaluated on the same test set.
  """
  from sklearn.datasets import load_digits as sk_load_digits
  from sklearn.model_selection import train_test_split

  digits = sk_load_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction,
                                            random_state=split_seed, stratify=y)
  return Digits(x_tr, y_tr, x_te, y_te)


class EpochBatches:
  """Shuffled mini-batches of indices into ``size`` examples, epoch after epoch.

  Epoch ``e`` is a permutation drawn from ``(seed, e)``; the last partial
  batch of an epoch is dropped.
  """

  def __init__(self, size: int, batch_size: int, seed: int):
    if batch_size > size:
      raise ValueError(f"batch_size={batch_size} exceeds the {size} training examples")
    self.size, self.batch_size, self.seed = size, batch_size, seed
    self._per_epoch = size // batch_size
    self._epoch, self._perm = None, None

  def indices(self, position: int) -> np.ndarray:
    """int64[batch_size] indices of batch number ``position`` (0-based)."""
    epoch, i = divmod(position, self._per_epoch)
    if epoch != self._epoch:
      self._epoch = epoch
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
    return self._perm[i * self.batch_size:(i + 1) * self.batch_size]


# -- Python source code ---------------------------------------------------------

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Bytes of Python source, split by file into train and held-out text.

  Attributes:
    train: uint8[n_train] the training text.
    held_out: uint8[n_held_out] the held-out text (other files).
    files: number of source files read.
    sha256: digest of both texts (it changes with the Python version).
    root: the directory read.
  """

  train: np.ndarray
  held_out: np.ndarray
  files: int
  sha256: str
  root: str


def python_source_corpus(max_bytes: int = 4_000_000, held_out_every: int = 10,
                         root: str | None = None) -> Corpus:
  """The standard library's own ``.py`` files as a byte-level text corpus.

  Deterministic and offline: files (test suites and installed packages
  excluded) are ordered by the SHA-1 of their relative path, which mixes
  modules from every package, and read until ``max_bytes``; every
  ``held_out_every``-th file goes to the held-out text. Files are
  separated by a blank line and a NUL byte.

  Args:
    max_bytes: stop reading once this many bytes were read.
    held_out_every: hold out one file in this many.
    root: directory to read (default: ``sysconfig.get_paths()["stdlib"]``).

  Returns:
    The :class:`Corpus`.
  """
  root = root or sysconfig.get_paths()["stdlib"]
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    for name in filenames:
      if name.endswith(".py"):
        rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
        paths.append(rel)
  if not paths:
    raise FileNotFoundError(f"no .py files under {root!r}")
  paths.sort(key=lambda rel: hashlib.sha1(rel.encode()).hexdigest())
  train, held_out, total, files = [], [], 0, 0
  for i, rel in enumerate(paths):
    if total >= max_bytes:
      break
    with open(os.path.join(root, rel), "rb") as f:
      text = f.read() + b"\n\n\0"
    (held_out if i % held_out_every == 0 else train).append(text)
    total += len(text)
    files += 1
  train_bytes, held_bytes = b"".join(train), b"".join(held_out)
  digest = hashlib.sha256(train_bytes + b"\1" + held_bytes).hexdigest()
  return Corpus(np.frombuffer(train_bytes, np.uint8), np.frombuffer(held_bytes, np.uint8),
                files, digest, root)


def random_windows(text: np.ndarray, batch_size: int, length: int, seed: int,
                   position: int) -> tuple[np.ndarray, np.ndarray]:
  """``batch_size`` random windows of ``text``: inputs and next-byte targets.

  Returns:
    ``(inputs, targets)``, both int32[batch_size, length], drawn from
    ``(seed, position)``.
  """
  rng = np.random.default_rng([seed, position])
  starts = rng.integers(0, len(text) - length - 1, batch_size)
  return _windows(text, starts, length)


def even_windows(text: np.ndarray, count: int, length: int) -> tuple[np.ndarray, np.ndarray]:
  """``count`` evenly spaced windows covering ``text``: the fixed evaluation set."""
  count = max(1, min(count, (len(text) - 1) // length))
  starts = np.linspace(0, len(text) - length - 1, count).astype(np.int64)
  return _windows(text, starts, length)


def _windows(text, starts, length):
  view = np.lib.stride_tricks.sliding_window_view(text, length + 1)
  chunk = view[starts].astype(np.int32)
  return chunk[:, :-1], chunk[:, 1:]
