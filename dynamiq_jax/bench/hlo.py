"""Which collectives a compiled program runs, and over which mesh axes.

:func:`collectives` reads XLA's optimized HLO text (``jax.jit(f).lower(...).compile()
.as_text()``, parsed by :func:`dynamiq_jax.bench.gpu_compile.parse_hlo`) and
names, for every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute, the mesh axes its device groups span: the check that a
data-parallel reduction on a sharded model talks over the data axis only.
XLA prints device groups in several forms, all handled here:
explicit lists (``{{0,2},{1,3}}``), iota tiles (``[4,2]<=[8]``,
``[2,4]<=[4,2]T(1,0)``), named meshes (``mesh['axis_0'=4,'axis_1'=2]
{'axis_1'}``, optionally with ``device_ids=(...)``) and permutation pairs.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from dynamiq_jax.bench.gpu_compile import parse_hlo

__all__ = ["Collective", "collectives", "axes_of_groups", "summary"]

_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class Collective(NamedTuple):
  """One collective of a compiled program.

  Attributes:
    op: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
      ``"collective-permute"``.
    shape: the result type as XLA prints it.
    axes: the mesh axes its device groups span (sorted), () for a no-op.
    line: the HLO instruction.
  """

  op: str
  shape: str
  axes: tuple
  line: str


def _ints(text: str) -> list[int]:
  return [int(v) for v in text.split(",") if v.strip()]


def _tile(dims: list[int], reshape: list[int] | None, perm: list[int] | None) -> np.ndarray:
  a = np.arange(int(np.prod(reshape or dims))).reshape(reshape or dims)
  if perm:
    a = a.transpose(perm)
  return a.reshape(dims)


def _groups(line: str) -> list[list[int]] | None:
  """The device groups of one collective instruction (None: none printed)."""
  m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  if m:
    return [_ints(p) for p in re.findall(r"\{([\d,]+)", m.group(1) + "}")]
  m = re.search(r"replica_groups=\{\{(.*?)\}\}", line)
  if m:
    return [_ints(g) for g in m.group(1).split("},{")]
  if re.search(r"replica_groups=\{\}", line):
    return None
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    dims, reshape = _ints(m.group(1)), _ints(m.group(2))
    perm = _ints(m.group(3)) if m.group(3) else None
    return _tile(dims, reshape, perm).tolist()
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]((?:, device_ids=\([^)]*\)\))?)?\s*"
                r"(\{[^}]*\})?", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(int(np.prod(sizes)))
    if m.group(2):
      t = re.search(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", m.group(2))
      dims = _ints(t.group(1))
      ids = _tile(dims, _ints(t.group(2)) if t.group(2) else None,
                  _ints(t.group(3)) if t.group(3) else None)
    ids = np.asarray(ids).reshape(sizes)
    chosen = re.findall(r"'([^']+)'", m.group(3) or "") or names
    keep = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in keep]
    moved = ids.transpose(rest + keep)
    return moved.reshape(-1, int(np.prod([sizes[i] for i in keep]))).tolist()
  return None


def axes_of_groups(groups, mesh) -> tuple:
  """The mesh axes along which the members of any group differ (sorted by mesh order).

  Partition ``i`` of the program is ``mesh.devices.flat[i]``'s position in the mesh.
  """
  shape = tuple(mesh.devices.shape)
  names = tuple(mesh.axis_names)
  varying = set()
  for g in groups or ():
    coords = np.array([np.unravel_index(i, shape) for i in g])
    for k in range(len(shape)):
      if len(set(coords[:, k].tolist())) > 1:
        varying.add(k)
  return tuple(names[k] for k in sorted(varying))


def collectives(hlo_text: str, mesh) -> list[Collective]:
  """Every collective in ``hlo_text`` (the ``-done`` halves of async pairs left out)."""
  out = []
  for comp in parse_hlo(hlo_text).values():
    for ins in comp.instructions:
      op = ins.opcode.removesuffix("-start")
      if op not in _OPS:
        continue
      groups = _groups(ins.attributes)
      if groups is None:  # no groups printed: all partitions
        groups = [list(range(int(np.prod(mesh.devices.shape))))]
      out.append(Collective(op, ins.shape, axes_of_groups(groups, mesh), ins.line.strip()))
  return out


def summary(found: list[Collective]) -> dict:
  """``{"op over axes": count}``, e.g. ``{"all-gather over data": 3}``."""
  counts: dict = {}
  for c in found:
    key = f"{c.op} over {','.join(c.axes) or 'nothing'}"
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))
