"""Shared plumbing for the benchmarks: machine description, JSON output."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

__all__ = ["machine", "command_line", "write_json", "write_tool_json", "write_results",
           "results_dir", "add_data_flags", "add_process_flags", "add_load_flags", "load_watch",
           "load_record", "BUSY_CORES", "xla_flags_less"]


def xla_flags_less(env, *prefixes: str) -> list[str]:
  """The flags of ``env["XLA_FLAGS"]`` (a process environment) but those starting with
  one of ``prefixes``: what a child process inherits of its caller's XLA settings."""
  return [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(prefixes)]


def add_data_flags(parser, *, real: str = "the LM gradients"):
  """The flags every data-driven benchmark shares: --cache, --no-real, --tiny, --out."""
  parser.add_argument("--cache",
                      default=os.path.join(os.path.expanduser("~"), ".cache", "dynamiq_jax"),
                      help="where captured LM gradients are kept ('' to disable)")
  parser.add_argument("--no-real", action="store_true", help=f"skip {real}")
  parser.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  parser.add_argument("--out", default=None, help="results directory; unset: docs/results")
  add_load_flags(parser)


def add_process_flags(parser, *, heartbeat_s: int, timeout: float, timeout_help: str):
  """The flags of the benchmarks that run worker processes over emulated links
  (:mod:`dynamiq_jax.bench.netns`): --no-shaping, --heartbeat-s, --timeout, and the
  hidden ones a worker process is started with."""
  import argparse

  parser.add_argument("--no-shaping", action="store_true", help="plain loopback, even as root")
  parser.add_argument("--heartbeat-s", type=int, default=heartbeat_s,
                      help="seconds without a heartbeat after which a worker counts as dead")
  parser.add_argument("--timeout", type=float, default=timeout, help=timeout_help)
  parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
  add_load_flags(parser)


def run_worker(args, worker) -> bool:
  """A networked benchmark started as a worker process (``--worker r --coordinator
  host:port --config path``, see :func:`add_process_flags`): runs ``worker(cfg, r,
  coordinator)`` with the driver's JSON configuration and returns True; False for the
  driver itself."""
  if args.worker is None:
    return False
  with open(args.config) as f:
    cfg = json.load(f)
  worker(cfg, args.worker, args.coordinator)
  return True


def results_dir(path: str | None = None) -> str:
  out = path or os.path.join(os.getcwd(), "docs", "results")
  os.makedirs(out, exist_ok=True)
  return out


def machine() -> dict:
  """What the numbers were measured on."""
  import jax

  info = {
      "platform": platform.platform(),
      "python": sys.version.split()[0],
      "cpu_count": os.cpu_count(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()[:4]] + (["..."] if jax.device_count() > 4 else []),
      "device_count": jax.device_count(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  try:
    info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, check=True,
                                        cwd=os.path.dirname(__file__)).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return info


def command_line() -> str:
  return "python -m " + " ".join(shlex.quote(a) for a in
                                 [sys.modules["__main__"].__spec__.name if getattr(
                                     sys.modules["__main__"], "__spec__", None) else sys.argv[0]]
                                 + sys.argv[1:])


def write_json(path: str, payload: dict, *, strict: bool = False) -> str:
  """Writes ``payload`` to ``path`` as JSON; returns the path.

  Results measured by this process (a payload whose ``"machine"`` :func:`machine` made
  after this process started: not a stored report re-summarized) first get
  ``payload["load"] =`` :func:`load_record`; when it says the machine was busy, a warning
  goes to stderr, or, with ``strict`` (the benchmark's ``--strict``), nothing is written and
  SystemExit says why.
  """
  if _measured_here(payload):
    load = payload["load"] = load_record()
    if load["busy"]:
      why = _busy_reason(load)
      if strict:
        raise SystemExit(f"--strict: not writing {path}: the machine was busy ({why})")
      print(f"WARNING: {path}: measured on a busy machine ({why}); see its \"load\" record",
            file=sys.stderr, flush=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=False)
    f.write("\n")
  return path


def write_tool_json(path: str, script: str, argv, report: dict) -> str:
  """Writes a tool's ``report`` (:func:`write_json`) with the command that made it
  (``python <script> <argv>``; ``argv`` None: this process's arguments) and the machine;
  prints and returns the path."""
  command = " ".join([f"python {script}", *(sys.argv[1:] if argv is None else argv)])
  path = write_json(path, {"command": command, "machine": machine(), **report})
  print(f"wrote {path}")
  return path


def _measured_here(payload: dict) -> bool:
  try:
    return datetime.datetime.fromisoformat(payload["machine"]["date"]) >= _START_DATE
  except (KeyError, TypeError, ValueError):
    return False


def write_results(stem: str, args, payload: dict) -> str:
  """Writes ``payload`` as ``<stem>_tiny.json`` (``args.tiny``), ``<stem>_<args.label>.json``
  or ``<stem>.json`` under ``args.out`` (unset: docs/results) and prints where, with the
  command that produced it; returns the path. ``args.strict`` (:func:`add_load_flags`):
  refuse to write results measured on a busy machine (see :func:`write_json`)."""
  name = (f"{stem}_tiny.json" if args.tiny else
          f"{stem}_{args.label}.json" if args.label else f"{stem}.json")
  path = write_json(os.path.join(results_dir(args.out), name), payload,
                    strict=getattr(args, "strict", False))
  print(f"\nwrote {path}\ncommand: {payload['command']}")
  return path


# ---------------------------------------------------------------------------
# the machine's load while a benchmark measured

BUSY_CORES = 0.25
"""Other processes using more than this many cores on average (CPU seconds per wall
second) during a timed phase make it *busy*: a quarter of a core is well above what an
idle machine's daemons use, and enough to skew a timing on a machine with few cores.
(Two clock ticks, 0.02 s, of other CPU time are allowed on top: /proc/stat's resolution.)"""

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PHASES: list[dict] = []  # every load_watch(name) of this process, in order


def _busy_jiffies() -> int | None:
  """Jiffies every CPU spent busy since boot (/proc/stat: all but idle and iowait;
  guest time is already inside user), or None without /proc."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()
  except OSError:
    return None
  user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
  return user + nice + system + irq + softirq + steal


def _proc_stat(pid: int) -> tuple[int, int] | None:
  """(parent pid, jiffies of the process and its reaped children) from /proc/<pid>/stat."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      rest = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)", comm may hold spaces
  except (OSError, IndexError):
    return None
  return int(rest[1]), sum(int(x) for x in rest[11:15])  # ppid; utime stime cutime cstime


def _own_cpu_s() -> float:
  """CPU seconds of this process, its reaped children and every live descendant (a
  benchmark's worker processes count as its own load, not as the machine's)."""
  t = os.times()
  own = t.user + t.system + t.children_user + t.children_system
  try:
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
  except OSError:
    return own
  stats = {pid: s for pid in pids if (s := _proc_stat(pid)) is not None}
  children: dict[int, list[int]] = {}
  for pid, (ppid, _) in stats.items():
    children.setdefault(ppid, []).append(pid)
  todo, jiffies = list(children.get(os.getpid(), [])), 0
  while todo:
    pid = todo.pop()
    jiffies += stats[pid][1]
    todo += children.get(pid, [])
  return own + jiffies / _TICK


def _sample() -> dict:
  busy = _busy_jiffies()
  return {"t": time.monotonic(), "own_s": _own_cpu_s(),
          "all_s": None if busy is None else busy / _TICK}


def _loadavg() -> list[float] | None:
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def _between(before: dict, after: dict) -> dict:
  wall = after["t"] - before["t"]
  own = after["own_s"] - before["own_s"]
  if before["all_s"] is None or after["all_s"] is None:
    other = None
  else:  # jiffies are coarse: a short phase can come out a tick below zero
    other = max(0.0, after["all_s"] - before["all_s"] - own)
  return {"wall_s": round(wall, 3), "own_cpu_s": round(own, 3),
          "other_cpu_s": None if other is None else round(other, 3),
          "other_cores": None if other is None or wall <= 0 else round(other / wall, 3),
          # /proc/stat counts in ticks per CPU: two ticks of slack keep an instant phase calm
          "busy": bool(other is not None and other > BUSY_CORES * wall + 2 / _TICK)}


_START = _sample()  # when a benchmark imports this module: close to its start
_START_DATE = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


class LoadWatch:
  """What :func:`load_watch` measured: ``record`` (a dict, filled when the phase ends)
  and ``busy``."""

  def __init__(self, name: str | None):
    self.name = name
    self.record: dict = {}

  @property
  def busy(self) -> bool:
    return bool(self.record.get("busy"))


@contextlib.contextmanager
def load_watch(name: str | None = None):
  """Measures the machine's load over a timed phase: ``with load_watch("measure 100") as w:``.

  ``w.record`` then holds ``loadavg_before``/``loadavg_after`` (1, 5 and 15 minute load
  averages), ``wall_s``, ``own_cpu_s`` (this process and its descendants, the benchmark's
  worker processes included), ``other_cpu_s`` (every other process: /proc/stat's busy time
  minus our own; None without /proc), ``other_cores`` (``other_cpu_s / wall_s``) and
  ``busy`` (``other_cores > BUSY_CORES``). A busy phase prints a warning on stderr. A
  ``name``d phase is kept for :func:`load_record`, i.e. for every JSON written afterwards.
  """
  watch = LoadWatch(name)
  before, avg = _sample(), _loadavg()
  try:
    yield watch
  finally:
    watch.record = {"loadavg_before": avg, "loadavg_after": _loadavg(),
                    **_between(before, _sample())}
    if name is not None:
      _PHASES.append({"phase": name, **watch.record})
    if watch.busy:
      print(f"WARNING: the machine was busy during {name or 'a timed phase'}: other processes "
            f"used {watch.record['other_cores']} cores on average (> {BUSY_CORES}); its "
            f"timings are suspect", file=sys.stderr, flush=True)


def load_record() -> dict:
  """The machine's load over this run, for a results JSON: ``loadavg`` now, ``run`` (from
  when the benchmark started, as :func:`load_watch` measures a phase), ``phases`` (every
  named :func:`load_watch`) and ``busy`` (the run or any phase was)."""
  run = _between(_START, _sample())
  phases = [dict(p) for p in _PHASES]
  return {"loadavg": _loadavg(), "busy_cores": BUSY_CORES, "run": run, "phases": phases,
          "busy": run["busy"] or any(p["busy"] for p in phases)}


def add_load_flags(parser) -> None:
  """--strict: refuse to write results measured on a busy machine (see :func:`load_record`)."""
  parser.add_argument("--strict", action="store_true",
                      help=f"exit non-zero, writing nothing, if other processes used more than "
                      f"{BUSY_CORES} of a core on average during the run or a timed phase")


def _busy_reason(load: dict) -> str:
  parts = []
  if load["run"]["busy"]:
    parts.append(f"other processes used {load['run']['other_cores']} cores over the run")
  parts += [f"{p['other_cores']} cores during {p['phase']!r}" for p in load["phases"] if p["busy"]]
  return "; ".join(parts) + f"; the limit is {BUSY_CORES}"
