"""What an example measures: its history, the metrics JSON in ``--workdir``, the summary."""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from . import reduction
from .flags import ExampleConfig


class History:
  """Per-step training loss and wall time, and the evaluations, of one run.

  ``step_time_s[i]`` is the wall time of step ``i + 1`` from dispatch until
  its loss reached the host (the first step of a process includes
  compilation). A run restored from a checkpoint continues its history.
  """

  def __init__(self, saved: dict | None = None):
    saved = saved or {}
    self.train_loss: list[float] = list(saved.get("train_loss", []))
    self.step_time_s: list[float] = list(saved.get("step_time_s", []))
    self.evals: list[dict] = list(saved.get("evals", []))
    self.restarts: list[int] = list(saved.get("restarts", []))

  def record_step(self, loss: float, seconds: float) -> None:
    self.train_loss.append(float(loss))
    self.step_time_s.append(float(seconds))

  def record_eval(self, step: int, **values) -> None:
    self.evals.append({"step": int(step), **{k: float(v) for k, v in values.items()}})

  def as_dict(self) -> dict:
    return {"train_loss": self.train_loss, "step_time_s": self.step_time_s,
            "evals": self.evals, "restarts": self.restarts}


def timing_summary(history: History, first_step_of_process: int) -> dict:
  """Median step time, excluding the first step of each process (compilation)."""
  times = np.asarray(history.step_time_s)
  skip = set(history.restarts) | {0}
  steady = [t for i, t in enumerate(times) if i not in skip]
  return {
      "median_step_time_s": float(np.median(steady)) if steady else None,
      "first_step_time_s": float(times[first_step_of_process])
                           if len(times) > first_step_of_process else None,
      "train_time_s": float(times[first_step_of_process:].sum()),
  }


def tree_digest(tree) -> str:
  """SHA-256 of every leaf's dtype, shape and bytes: equal digests, bit-identical trees.

  A typed PRNG key (an NNX RNG stream's, a dropout key) is hashed as its raw
  ``uint32`` data (:func:`jax.random.key_data`): NumPy has no key dtype.
  """
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    a = np.asarray(jax.device_get(leaf))
    digest.update(f"{a.dtype.str}{a.shape}".encode())
    digest.update(np.ascontiguousarray(a).tobytes())
  return digest.hexdigest()


def write_metrics(workdir: str | None, metrics: dict) -> str | None:
  """Writes ``metrics`` to ``<workdir>/metrics.json``; returns the path."""
  if workdir is None:
    return None
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "metrics.json")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(metrics, f, indent=1)
  os.replace(tmp, path)
  return path


def run_metrics(example: str, config: ExampleConfig, *, devices, params, history: History,
                start: int, state, final: dict, extra: dict | None = None) -> dict:
  """The metrics every example reports (and writes to ``<workdir>/metrics.json``).

  Args:
    example: the example's name.
    config: its settings.
    devices: the devices it ran on.
    params: the parameters (arrays or ``jax.ShapeDtypeStruct``), for sizes.
    history: the run's :class:`History`.
    start: the step this process started from.
    state: the final state to digest (``state_sha256``).
    final: the final evaluation numbers.
    extra: more top-level entries.
  """
  codec = reduction.make_codec(config)
  metrics = {
      "example": example,
      "config": dict(vars(config)),
      "devices": {"count": len(devices), "platform": devices[0].platform,
                  "kind": devices[0].device_kind},
      "reducer": {"name": config.codec, "options": reduction.reducer_options(config),
                  "schedule": config.schedule, "codec": None if codec is None else repr(codec)},
      "params": int(sum(np.size(x) for x in jax.tree.leaves(params))),
      "wire": reduction.wire_report(config, params, len(devices)),
      "steps": config.steps,
      "resumed_from": start or None,
      **history.as_dict(),
      "final": {**final, "train_loss_last10": float(np.mean(history.train_loss[-10:]))},
      "timing": timing_summary(history, start),
      "state_sha256": tree_digest(state),
      **(extra or {}),
  }
  metrics["metrics_path"] = write_metrics(config.workdir, metrics)
  return metrics


def print_summary(metrics: dict) -> None:
  """Prints the headline numbers of a run's metrics."""
  final = metrics["final"]
  wire = metrics["wire"]
  parts = [f"{k}={v:.4f}" for k, v in final.items() if isinstance(v, float)]
  bits = wire["bits_per_coord"]
  reducer = metrics["reducer"]
  options = "".join(f" {k}={v}" for k, v in reducer["options"].items())
  print(f"{metrics['example']}: {reducer['name']}{options} ({reducer['schedule']}) on "
        f"{metrics['devices']['count']} {metrics['devices']['platform']} devices, "
        f"{metrics['steps']} steps")
  print("  final: " + ", ".join(parts))
  if bits is not None:
    print(f"  wire: {bits:.3f} bits/coord, {wire['bytes_per_rank_per_step']:,.0f} bytes/rank/step"
          + (f" ({wire['vs_bf16']:.1%} of BF16)" if wire["vs_bf16"] is not None else ""))
  t = metrics["timing"]
  if t["median_step_time_s"] is not None:
    print(f"  time: {t['median_step_time_s'] * 1e3:.1f} ms/step (median), first step "
          f"{t['first_step_time_s']:.1f} s (compilation)")
  if metrics.get("metrics_path"):
    print(f"  metrics: {metrics['metrics_path']}")
