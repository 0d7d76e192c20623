"""Readers of XLA's optimized HLO text, and which collectives it runs over which mesh axes.

* :func:`parse_hlo` (computations and their instructions, from the text of
  jax 0.10.2 and 0.12: ``%`` before names or not, jax 0.12's nested tuple
  shapes of asynchronous starts), :func:`executions` (how many times each
  computation runs per step, from the call graph and the while loops' known
  trip counts, so a count does not depend on how XLA peels or unrolls a
  loop), :func:`per_step`, :func:`kernel_name`, :func:`is_payload_hop`,
  :func:`is_gemm` and :func:`async_windows` (what the schedule places
  between an asynchronous start and its done).
* :func:`collectives` reads the text (``jax.jit(f).lower(...).compile()
  .as_text()``) and
names, for every all-reduce, all-gather, reduce-scatter, all-to-all and
collective-permute, the mesh axes its device groups span: the check that a
data-parallel reduction on a sharded model talks over the data axis only.
XLA prints device groups in several forms, all handled here:
explicit lists (``{{0,2},{1,3}}``), iota tiles (``[4,2]<=[8]``,
``[2,4]<=[4,2]T(1,0)``), named meshes (``mesh['axis_0'=4,'axis_1'=2]
{'axis_1'}``, optionally with ``device_ids=(...)``) and permutation pairs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import numpy as np

__all__ = ["TRITON", "MOSAIC", "Instruction", "Computation", "parse_hlo", "executions",
           "per_step", "kernel_name", "is_payload_hop", "is_gemm", "Window", "async_windows",
           "Collective", "collectives", "axes_of_groups", "summary"]

TRITON = "__gpu$xla.gpu.triton"
"""custom_call_target of a Pallas Triton kernel in GPU HLO."""
MOSAIC = "mosaic_gpu"
"""custom_call_target prefix of a Pallas Mosaic GPU kernel in GPU HLO (``mosaic_gpu_v2``)."""


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction: ``name = shape opcode(operands), attributes``."""
  name: str
  shape: str
  opcode: str
  operands: str
  attributes: str
  line: str



@dataclasses.dataclass(frozen=True)
class Computation:
  """A computation: its name (``"ENTRY"`` for the entry) and instructions in text
  order (the schedule order, in a scheduled module)."""
  name: str
  instructions: tuple[Instruction, ...]


_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


def _balanced(text: str, i: int) -> int:
  """Index just past the bracket group that opens at ``text[i]``."""
  depth = 0
  for j in range(i, len(text)):
    if text[j] in "([{":
      depth += 1
    elif text[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j + 1
  raise ValueError(f"unbalanced brackets in {text[:200]!r}")


def _instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  i = m.end()
  end = _balanced(line, i) if line[i] == "(" else line.index(" ", i)
  shape, rest = line[i:end], line[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  return Instruction(name=m.group(1), shape=shape, opcode=op.group(1),
                     operands=rest[op.end():close - 1], attributes=rest[close:], line=line)


def parse_hlo(text: str) -> dict[str, Computation]:
  """HLO module text -> ``{computation name: Computation}``; the entry is ``"ENTRY"``.

  Reads the text ``Compiled.as_text()`` prints on jax 0.10.2 and 0.12 (the
  latter's file and stack-frame tables are skipped).
  """
  comps, name, body = {}, None, []
  for line in text.splitlines():
    if name is None:
      head = _HEADER.match(line)
      if head:
        name, body = ("ENTRY" if head.group(1) else head.group(2)), []
    elif line == "}":
      comps[name] = Computation(name, tuple(body))
      name = None
    else:
      ins = _instruction(line)
      if ins is not None:
        body.append(ins)
  return comps


def _trip_count(ins: Instruction) -> int | None:
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attributes)
  return int(m.group(1)) if m else None


def _callees(ins: Instruction) -> list[tuple[str, int | None]]:
  """(computation, runs per run of ``ins``) for each computation ``ins`` calls;
  None: a while loop's unknown trip count."""
  out = []
  for key, names in re.findall(r"\b(body|condition|to_apply|calls|branch_computations|"
                               r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)",
                               ins.attributes):
    for callee in re.findall(r"%?([\w.\-]+)", names):
      trips = _trip_count(ins)
      if key == "body":
        out.append((callee, trips))
      elif key == "condition":
        out.append((callee, 1 if trips is None else trips + 1))
      else:  # a call, fusion, async wrapper, reduction, or a conditional's branch
        out.append((callee, 1))
  return out


def executions(comps: dict[str, Computation]) -> tuple[dict[str, int], list[str]]:
  """How many times each computation runs per run of the entry.

  From the call graph: a while body runs its loop's known trip count per
  run of the loop, a condition one more, anything else called (fusions,
  calls, async wrappers, reducers) once per call, and each branch of a
  conditional as often as the conditional (an upper bound). Counts summed
  over every call site, so a loop that XLA peeled (one iteration before the
  loop, the rest inside) or unrolled (k copies per iteration, n / k trips)
  counts the same per step as the loop it was.

  Returns:
    ``({computation: runs}, [while bodies whose trip count is unknown])``;
    an unknown trip count is counted as 1.
  """
  calls = {name: [] for name in comps}
  unknown = []
  for name, comp in comps.items():
    for ins in comp.instructions:
      for callee, times in _callees(ins):
        if callee in comps:
          if times is None:
            unknown.append(callee)
          calls[callee].append((name, 1 if times is None else times))
  memo = {"ENTRY": 1}

  def runs(name, seen=()):
    if name not in memo:
      if name in seen:
        raise ValueError(f"recursive call graph at {name}")
      memo[name] = sum(runs(caller, seen + (name,)) * t for caller, t in calls[name])
    return memo[name]

  return {name: runs(name) for name in comps}, sorted(set(unknown))


def per_step(comps: dict[str, Computation], predicate) -> int:
  """Runs per step of the instructions for which ``predicate(instruction)`` holds."""
  runs, _ = executions(comps)
  return sum(runs[name] for name, comp in comps.items()
             for ins in comp.instructions if predicate(ins))


def kernel_name(ins: Instruction) -> str | None:
  """The Pallas kernel a Triton or Mosaic GPU custom call launches (``"?"`` if unnamed),
  else None. A Mosaic GPU kernel is named by the ``kernel_name`` given to ``plgpu.kernel``
  (``dynamiq_mosaic_*``), which its op name carries."""
  if ins.opcode != "custom-call":
    return None
  if TRITON in ins.attributes:
    m = re.search(r'/(dynamiq_\w+)/pallas_call', ins.attributes)
  elif f'custom_call_target="{MOSAIC}' in ins.attributes:
    m = re.search(r'op_name="[^"]*/(dynamiq_mosaic_\w+)/', ins.attributes)
  else:
    return None
  return m.group(1) if m else "?"


def is_payload_hop(ins: Instruction) -> bool:
  """A collective permute (or its async start) of a uint8 payload: one ring hop."""
  return (ins.opcode in ("collective-permute", "collective-permute-start")
          and "u8[" in ins.shape)


def is_gemm(ins: Instruction, comps: dict[str, Computation]) -> bool:
  """A matrix multiply as XLA:GPU emits one: a cuBLAS / cuBLASLt custom call, or a
  fusion (``gemm_fusion_*``, ``kind=kCustom``, or any other) whose computation holds a
  ``dot``."""
  if ins.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]*)"', ins.attributes)
    cublas = r"__cublas\$(lt\$)?(gemm|matmul)"
    return target is not None and re.match(cublas, target.group(1)) is not None
  if ins.opcode not in ("fusion", "fusion-start"):
    return False
  called = re.search(r"\bcalls=%?([\w.\-]+)", ins.attributes)
  comp = comps.get(called.group(1)) if called else None
  return comp is not None and any(i.opcode == "dot" for i in comp.instructions)


@dataclasses.dataclass(frozen=True)
class Window:
  """An asynchronous op's window: its start, its done, and what the schedule
  runs between them (in one computation)."""
  start: Instruction
  done: Instruction
  between: tuple[Instruction, ...]


def async_windows(comp: Computation, opcode: str | None = None) -> list[Window]:
  """The ``*-start`` / ``*-done`` pairs of ``comp`` and the instructions between them.

  Args:
    comp: a computation of a scheduled module (text order is schedule order).
    opcode: e.g. ``"collective-permute"``, ``"all-reduce"``, ``"all-gather"``
      (None: every asynchronous op).
  """
  index = {ins.name: i for i, ins in enumerate(comp.instructions)}
  out = []
  for i, done in enumerate(comp.instructions):
    if not done.opcode.endswith("-done"):
      continue
    if opcode is not None and done.opcode != f"{opcode}-done":
      continue
    first = re.match(r"\s*%?([\w.\-]+)", done.operands)
    j = index.get(first.group(1)) if first else None
    if j is not None and comp.instructions[j].opcode.endswith("-start"):
      out.append(Window(comp.instructions[j], done, comp.instructions[j + 1:i]))
  return out


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
