"""Shared plumbing for the benchmarks: machine description, JSON output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

__all__ = ["machine", "command_line", "write_json", "results_dir", "add_data_flags",
           "add_process_flags"]


def add_data_flags(parser, *, real: str = "the LM gradients"):
  """The flags every data-driven benchmark shares: --cache, --no-real, --tiny, --out."""
  parser.add_argument("--cache",
                      default=os.path.join(os.path.expanduser("~"), ".cache", "dynamiq_jax"),
                      help="where captured LM gradients are kept ('' to disable)")
  parser.add_argument("--no-real", action="store_true", help=f"skip {real}")
  parser.add_argument("--tiny", action="store_true", help="smoke-test size (CI)")
  parser.add_argument("--out", default=None, help="results directory; unset: docs/results")


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


def write_json(path: str, payload: dict) -> str:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=False)
    f.write("\n")
  return path


def write_results(stem: str, args, payload: dict) -> str:
  """Writes ``payload`` as ``<stem>_tiny.json`` (``args.tiny``), ``<stem>_<args.label>.json``
  or ``<stem>.json`` under ``args.out`` (unset: docs/results) and prints where, with the
  command that produced it; returns the path."""
  name = (f"{stem}_tiny.json" if args.tiny else
          f"{stem}_{args.label}.json" if args.label else f"{stem}.json")
  path = write_json(os.path.join(results_dir(args.out), name), payload)
  print(f"\nwrote {path}\ncommand: {payload['command']}")
  return path
