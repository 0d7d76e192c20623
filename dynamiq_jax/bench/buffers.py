"""What a compiled program's memory holds at its peak, by category, from XLA's own
buffer assignment.

``compiled.memory_analysis()`` says how large the argument buffers and the
scratch ("temp") allocation are, not what the scratch holds. :func:`breakdown`
compiles a lowered program with XLA's dump switched on for that compile
only (``compiler_options={"xla_dump_to": ...}``, in a temporary
directory), and reads three files XLA writes for the optimized module:

* ``*after_optimizations.txt``, the HLO: each instruction's ``op_name``
  metadata (JAX's name stack: ``jvp(...)`` for the forward pass,
  ``transpose(jvp(...))`` for the backward pass, ``jax.named_scope`` labels);
* ``*buffer-assignment.txt``: each value's allocation (an entry parameter,
  the scratch allocation, a constant, ...), its size and its offset;
* ``*live-range.txt``: each value's live range in the scheduled program.

Every value is given a category by ``categorize(op_name, is_argument)``.
The scratch bytes live at an instant are those of the distinct
``(offset, size)`` slots of the live scratch values (values that share a
buffer, such as a while loop's state, are counted once); the *peak* is the
instant with the most. :func:`breakdown` returns, per category, the scratch
bytes live at that peak, the argument bytes (live all the time), and the
category's own maximum over the program; the scratch allocation
``memory_analysis()`` reports is the peak plus what XLA's heap layout loses
between buffers (the remainder, reported as ``packing``).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import Callable

__all__ = ["breakdown", "parse_dump", "read_dump"]

_VALUE = re.compile(r'^ value: <\d+ ([\w.\-]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> '
                    r'\(size=(\d+),offset=(\d+)\)', re.M)
_RANGE = re.compile(r'^\s+([\w.\-]+)\{([\d,]*)\}:(\d+)-(\d+)$', re.M)


def _one(directory: str, suffix: str) -> str:
  found = sorted(glob.glob(os.path.join(directory, f"*{suffix}")))
  if len(found) != 1:
    raise RuntimeError(f"expected one XLA dump file *{suffix} in {directory}, found "
                       f"{len(found)}: {found[:4]} (did XLA dump one module?)")
  with open(found[0]) as f:
    return f.read()


def read_dump(directory: str) -> tuple[str, str, str]:
  """The optimized HLO, buffer assignment and live ranges XLA dumped into
  ``directory`` for one module."""
  return (_one(directory, "after_optimizations.txt"),
          _one(directory, "after_optimizations-buffer-assignment.txt"),
          _one(directory, "after_optimizations-live-range.txt"))


def _op_names(hlo: str) -> tuple[dict, set]:
  """(instruction name -> its ``op_name`` metadata, "" where it has none; the names of
  the entry computation's parameters)."""
  out, entry, in_entry = {}, set(), False
  for line in hlo.splitlines():
    if line.startswith("ENTRY "):
      in_entry = True
    elif line.startswith("}"):
      in_entry = False
    m = re.match(r'\s*(?:ROOT )?%?([\w.\-]+) = ', line)
    if m:
      name = re.search(r'op_name="((?:[^"\\]|\\.)*)"', line)
      out[m.group(1)] = name.group(1).replace("\\'", "'") if name else ""
      if in_entry and re.search(r" parameter\(\d+\)", line):
        entry.add(m.group(1))
  return out, entry


def _values(assignment: str) -> dict:
  """``name{index}`` -> (allocation kind, size, offset) for every value of the assignment."""
  out = {}
  kind = None
  for line in assignment.splitlines():
    if line.startswith("allocation "):
      if "preallocated-temp" in line:
        kind = "temp"
      elif ", parameter " in line:
        kind = "argument"
      elif "constant" in line:
        kind = "constant"
      elif "thread-local" in line:
        kind = "thread-local"
      else:
        kind = "other"  # e.g. an output allocation that aliases no argument
      continue
    if line.startswith("Used values") or line.startswith("BufferAssignment stats"):
      kind = None
      continue
    m = _VALUE.match(line)
    if m and kind is not None:
      name, index, size, offset = m.group(1), m.group(2) or "{}", int(m.group(3)), int(m.group(4))
      out[name + index] = (kind, size, offset)
  return out


def parse_dump(hlo: str, assignment: str, live_range: str,
               categorize: Callable[[str, bool], str], groups: dict | None = None) -> dict:
  """The per-category breakdown of one dumped module (see the module docstring).

  Args:
    hlo: the optimized HLO text (``*after_optimizations.txt``).
    assignment: ``*after_optimizations-buffer-assignment.txt``.
    live_range: ``*after_optimizations-live-range.txt``.
    categorize: ``categorize(op_name, is_argument) -> category`` for a value
      defined by an instruction whose ``op_name`` metadata is ``op_name``
      (entry parameters carry their argument's path, e.g. ``state[0]...``).
    groups: optional ``{name: categories}``: ``own_max[name]`` is then the most
      scratch bytes of those categories together live at once.

  Returns:
    A dict: ``peak_time`` (the instruction index of the scratch peak),
    ``temp_live_at_peak`` (bytes), ``at_peak`` (category -> scratch bytes live
    at the peak), ``arguments`` (category -> argument bytes), ``own_max``
    (category, or group, -> the most scratch bytes of it live at once, at
    any instant), ``own_max_time`` (category or group -> the instruction index
    where that most is first reached), ``last_defined`` (category -> the index of
    the last instruction defining a scratch value of it; for the backward pass,
    where it ends), ``program_length`` (instructions in the schedule), ``xla_peak`` (the peak XLA's live-range file reports,
    arguments included, its values counted as it counts them) and
    ``xla_peak_recounted`` (that sum recomputed here from the parsed ranges:
    equal when this parser reads the files as XLA wrote them).
  """
  names, entry = _op_names(hlo)
  values = _values(assignment)
  ranges = [(m.group(1), "{" + m.group(2) + "}", int(m.group(3)), int(m.group(4)))
            for m in _RANGE.finditer(live_range.split("Live ranges at")[0])]
  if not ranges:
    raise ValueError("no live ranges found in the live-range dump (has XLA's format changed?)")
  peak = re.search(r"Live ranges at (\d+) \(peak\):", live_range)
  xla_peak = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", live_range)

  temp_events = collections.defaultdict(list)  # time -> [(+1/-1, slot, category)]
  arguments = collections.Counter()
  seen_args = set()
  recount = 0
  missing = 0
  for name, index, start, end in ranges:
    key = name + (index if index != "{}" or name + "{}" in values else "{}")
    hit = values.get(key) or values.get(name + "{}")
    if hit is None:
      missing += 1
      continue
    kind, size, offset = hit
    if peak and start <= int(peak.group(1)) <= end:
      recount += size
    op = names.get(name, "")
    if kind == "argument":
      if key not in seen_args and name in entry:
        seen_args.add(key)
        arguments[categorize(op, True)] += size
      continue
    if kind != "temp":
      continue
    cat = categorize(op, False)
    temp_events[start].append((1, (offset, size), cat))
    temp_events[end + 1].append((-1, (offset, size), cat))

  # sweep: bytes of distinct live slots, in all and per category
  slots = collections.Counter()  # slot -> live values using it
  owner = {}  # slot -> category of its first live value
  by_cat = collections.Counter()
  own_max = collections.Counter()
  own_max_time, last_defined = {}, {}
  live = best = 0
  best_time, best_split = 0, {}
  for t in sorted(temp_events):
    for sign, slot, cat in sorted(temp_events[t], key=lambda e: e[0]):  # ends first
      if sign > 0:
        if slots[slot] == 0:
          owner[slot] = cat
          live += slot[1]
          by_cat[cat] += slot[1]
          if by_cat[cat] > own_max[cat]:
            own_max[cat], own_max_time[cat] = by_cat[cat], t
          last_defined[cat] = t
          for group, members in (groups or {}).items():
            total = sum(by_cat[c] for c in members)
            if cat in members and total > own_max[group]:
              own_max[group], own_max_time[group] = total, t
        slots[slot] += 1
      else:
        slots[slot] -= 1
        if slots[slot] == 0:
          live -= slot[1]
          by_cat[owner.pop(slot)] -= slot[1]
    if live > best:
      best, best_time, best_split = live, t, {k: v for k, v in by_cat.items() if v}
  return {"peak_time": best_time, "temp_live_at_peak": best, "at_peak": best_split,
          "arguments": dict(arguments), "own_max": dict(own_max),
          "own_max_time": own_max_time, "last_defined": last_defined,
          "program_length": max(end for _, _, _, end in ranges) + 1,
          "xla_peak": int(xla_peak.group(1).replace(" ", "")) if xla_peak else None,
          "xla_peak_recounted": recount if peak else None, "unmatched_values": missing}


def breakdown(lowered, categorize: Callable[[str, bool], str], groups: dict | None = None
              ) -> tuple[dict, object]:
  """Compiles ``lowered`` (a ``jax.stages.Lowered``) with XLA's dump on and returns
  ``(parse_dump(...) plus memory_analysis() fields and packing, compiled)``.

  ``packing`` is ``temp_bytes - temp_live_at_peak``: scratch that XLA's heap
  layout reserves beyond the bytes live at the peak.
  """
  with tempfile.TemporaryDirectory(prefix="xla_dump_") as directory:
    compiled = lowered.compile(compiler_options={"xla_dump_to": directory})
    out = parse_dump(*read_dump(directory), categorize, groups)
  mem = compiled.memory_analysis()
  out.update(argument_bytes=int(mem.argument_size_in_bytes),
             output_bytes=int(mem.output_size_in_bytes),
             alias_bytes=int(mem.alias_size_in_bytes), temp_bytes=int(mem.temp_size_in_bytes))
  out["packing"] = out["temp_bytes"] - out["temp_live_at_peak"]
  return out, compiled
