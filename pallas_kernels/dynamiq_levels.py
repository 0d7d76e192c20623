"""DynamiQ's levels: the symmetric MEE levels of each code width and their tables.

:func:`level_table` (the levels of one width, rounded to bfloat16 once),
:class:`LevelTables` (every width of a ``width_set``: the encode's levels, the
rounding's constants and the signed decode table the kernels gather from),
:func:`level_tables` (cached by :func:`level_key`), and the lattice levels
(:data:`LATTICE`, :func:`lattice_table`). :mod:`pallas_kernels.dynamiq_block`
rounds to them; its module docstring gives the format.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from ml_dtypes import bfloat16

__all__ = ["GUESS_OFFSET", "level_table", "eps_for", "LevelTables", "level_key", "level_tables",
           "LATTICE", "LATTICE_Y0", "ROUND_Y0", "lattice_table"]

GUESS_OFFSET = 0.5
"""Levels subtracted from the first guess of :func:`~pallas_kernels.dynamiq_block.round_levels`."""


@functools.lru_cache(maxsize=None)
def level_table(bits: int, eps: float) -> np.ndarray:
  """MEE level magnitudes ``lam[0..R]`` of a ``bits``-wide code, as bf16-exact float32."""
  r = 2 ** (bits - 1) - 1
  idx = np.arange(r + 1, dtype=np.float64)
  if r == 1:
    lam = idx / r
  else:
    q = 1.0 + 2.0 * eps * eps
    lam = (q**idx - 1.0) / (q**r - 1.0)
  lam = lam.astype(np.float32).astype(bfloat16).astype(np.float32)
  if not np.all(np.diff(lam) > 0):
    raise ValueError(
        f"eps={eps} gives {bits}-bit MEE levels that coincide at bfloat16 "
        "precision; use a larger eps")
  lam.setflags(write=False)
  return lam


def eps_for(width: int, eps: dict[int, float]) -> float:
  """MEE eps of a width: given, or interpolated linearly between given widths
  (0.23 below the smallest given width)."""
  if width in eps:
    return float(eps[width])
  ws = sorted(eps)
  lo = max([w for w in ws if w < width], default=None)
  hi = min([w for w in ws if w > width], default=None)
  if lo is None or hi is None:
    return float(eps[lo if hi is None else hi]) if (lo or hi) else 0.23
  return float(eps[lo] + (eps[hi] - eps[lo]) * (width - lo) / (hi - lo))


class LevelTables:
  """Concatenated level tables and per-width rounding constants of a width set (static).

  Attributes:
    widths: the sorted width set.
    table: float32, every width's ``lam[0..R]`` in turn, from ``base``.
    pairs: int32, ``lam_l`` (bf16 bits, low half) and ``lam_(l+1)`` (high
      half), ``lam_(R+1) = lam_R``, from ``pbase``; entry ``pbase - 1`` is ``(0,
      lam_0)``, so that a guess of -1 needs no clamp.
    lev: float32 ``lam_l`` for ``l`` in [-1, R + 1] from ``lbase - 1``
      (``lam_(-1) = 0``, read by a guess of -1 and never used; ``lam_(R+1) =
      lam_R``).
    dec: float32, the signed level of each code: ``-lam_(R-c)`` for ``c <= R``,
      ``lam_(c-R-1)`` above, from ``dbase`` (lattice, sign-magnitude codes: ``-lam_c``
      for ``c <= R``; every width 2..8 from ``2^w - 4``, whatever the set).
    r, c1, c2, k, c1k: per width ``R``, ``(1 + 2 eps^2)^R - 1``, ``1 /
      log2(1 + 2 eps^2)``, ``2^(-GUESS_OFFSET / c2)`` and ``c1 k`` (the first
      guess of :func:`round_levels`; ternary widths: 1; empty for the lattice).
  """

  def __init__(self, eps, widths):
    tabs, base, r, c1, c2 = [], [], [], [], []
    off = 0
    self.widths = tuple(sorted(widths))
    self.lattice = eps == LATTICE
    for w in self.widths:
      rr = 2 ** (w - 1) - 1
      t = lattice_table(w)[0] if self.lattice else level_table(w, eps_for(w, eps))
      tabs.append(t)
      base.append(off)
      off += t.size
      r.append(rr)
      if self.lattice:  # no first guess: the MEE constants stay empty
        continue
      if rr == 1:  # ternary: j = 0 whatever the guess (clipped to r - 1 = 0)
        c1.append(1.0)
        c2.append(1.0)
      else:
        qq = 1.0 + 2.0 * eps_for(w, eps)**2
        c1.append(np.float32(qq**rr - 1.0))
        c2.append(np.float32(1.0 / np.log2(qq)))
    self.table = np.concatenate(tabs).astype(np.float32)
    bits = [(t.view(np.uint32) >> 16) for t in tabs]
    self.pairs = np.concatenate([np.concatenate([[0], b | (np.append(b[1:], b[-1]) << 16)])
                                 for b in bits]).astype(np.uint32).view(np.int32)
    self.pbase = np.array(base, np.int32) + 1 + np.arange(len(tabs), dtype=np.int32)
    self.lev = np.concatenate([np.concatenate([[0.0], t, t[-1:]]) for t in tabs]).astype(np.float32)
    self.lbase = np.array(base, np.int32) + 1 + 2 * np.arange(len(tabs), dtype=np.int32)
    # the signed level of each code: MEE -lam_(R-c) for c <= R, lam_(c-R-1) above;
    # lattice (sign-magnitude) -lam_c for c <= R, lam_(c-R-1) above
    if self.lattice:  # every width 2..8 at 2^w - 4 (lattice_dbase), whatever the set
      dec = [np.concatenate([-t, t]).astype(np.float32)
             for t in (lattice_table(w)[0] for w in range(2, 9))]
      self.dbase = np.array([(1 << w) - 4 for w in self.widths], np.int32)
    else:
      dec = [np.concatenate([-t[::-1], t]).astype(np.float32) for t in tabs]
      self.dbase = np.cumsum([0] + [d.size for d in dec[:-1]]).astype(np.int32)
    self.dec = np.concatenate(dec)
    self.base = np.array(base, np.int32)
    self.r = np.array(r, np.int32)
    self.c1 = np.array(c1, np.float32)
    self.c2 = np.array(c2, np.float32)
    self.k = np.exp2(-GUESS_OFFSET / self.c2.astype(np.float64)).astype(np.float32)
    self.c1k = (self.c1.astype(np.float64) * self.k).astype(np.float32)

  def row(self, widths):
    """int32 per super-group: the row of :meth:`dec_rows` its codes index (the width;
    for a width outside the set the one whose table :attr:`dbase` would give it)."""
    if self.lattice:
      return jnp.clip(widths, 2, 8).astype(jnp.int32)
    return self.select(widths, np.array(self.widths, np.int32))

  def dec_rows(self) -> np.ndarray:
    """float32 [9 * 256]: :attr:`dec` with each width's table at ``256 w`` (zeros between),
    so that a code and its row make the index ``code | row << 8``."""
    rows = np.zeros((9, 256), np.float32)
    for w in range(9):
      if (self.lattice and w >= 2) or w in self.widths:
        b = (1 << w) - 4 if self.lattice else self.dbase[self.widths.index(w)]
        rows[w, :1 << w] = self.dec[b:b + (1 << w)]
    return rows.reshape(-1)

  def select(self, widths, values):
    """Per-super-group constant ``values[index of width]`` (the smallest width's for a
    width outside the set): a select chain over the static width set, not a
    gather, so that the same code runs in a kernel."""
    out = jnp.full(widths.shape, values[0], values.dtype)
    for i, w in enumerate(self.widths[1:], start=1):
      out = jnp.where(widths == w, values[i], out)
    return out


def level_key(eps):
  """The level set as a hashable static argument: :data:`LATTICE`, or MEE's ``eps`` (a dict
  or ``(width, eps)`` pairs) as sorted ``(width, eps)`` pairs."""
  if isinstance(eps, str):
    if eps != LATTICE:
      raise ValueError(f"levels {eps!r}: the level set is {LATTICE!r} or MEE eps pairs")
    return eps
  return tuple(sorted((int(w), float(e)) for w, e in dict(eps).items()))


def level_tables(eps, widths) -> LevelTables:
  """:class:`LevelTables` of ``eps`` (a dict or ``(width, eps)`` pairs: MEE levels; or
  :data:`LATTICE`) and ``widths``."""
  return LevelTables(LATTICE if eps == LATTICE else dict(eps), widths)


# ----------------------------------------------------------------------------
# Lattice levels.

LATTICE = "lattice"
"""The level set whose rounding is a float addition (:func:`lattice_table`)."""

LATTICE_Y0 = 1.25
"""Where every width's lattice starts (:func:`lattice_table`)."""

ROUND_Y0 = np.float32(LATTICE_Y0 / 2)
"""Where :func:`round_lattice` adds ``t / 2``: the rounding runs at half scale, ``y / 2 =
Y0 / 2 + t / 2`` (the same fraction bits as ``Y0 + t``), so that ``t / 2 <= lam_R / 2 < 1``
and one saturating product (``mul.rn.sat.f32``) both keeps it in range and maps a NaN
to 0."""


def _lattice_point(l, m: int) -> float:
  return 2.0 ** (l >> m) * (1 + (l & ((1 << m) - 1)) / 2**m)


@functools.lru_cache(maxsize=None)
def lattice_table(bits: int):
  """The lattice levels of a ``bits``-wide code -> (``lam[0..R]`` float32, ``Y0``, ``F``).

  The float32 numbers with ``M = max(w - 1, 2)`` fraction bits form a lattice whose
  step doubles at every power of two; its ``R + 1`` points from ``Y0`` =
  :data:`LATTICE_Y0` less ``Y0`` are the levels, ``lam_l = y_(l0+l) - Y0`` (at most
  ``w`` significant bits each; the top ``lam_R = 5/4 - 2^(2-w)``, at most 7): about
  three quarters of the steps below 2, the rest twice as wide. A value ``t`` in [0,
  lam_R] is rounded stochastically to its neighbours by adding ``F = 23 - M``
  random bits to the float32 bits of ``Y0 + t`` and keeping the bits above them:
  consecutive points differ by ``2^F`` in their bits, so the level is ``(bits(Y0
  + t) + u - bits(Y0)) >> F`` and the rounding is unbiased (:func:`round_lattice`).
  """
  m = max(bits - 1, 2)
  l0 = int((LATTICE_Y0 - 1) * 2**m)
  r = 2 ** (bits - 1) - 1
  y = np.array([_lattice_point(l, m) for l in range(l0, l0 + r + 1)], np.float64)
  lam = (y - y[0]).astype(np.float32)
  if not np.array_equal(lam.astype(np.float64), y - y[0]):
    raise AssertionError(f"lattice levels of {bits} bits are not float32-exact")
  lam.setflags(write=False)
  return lam, np.float32(y[0]), 23 - m
