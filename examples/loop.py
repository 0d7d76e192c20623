"""The examples' training loop (evaluation, checkpoints, resume) and ``main.py`` routine."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from . import flags
from .checkpoints import checkpoints_for
from .checkpoints import should_checkpoint
from .flags import ExampleConfig
from .metrics import History
from .metrics import print_summary


def run_example(get_config: Callable[[], ExampleConfig],
                train_and_evaluate: Callable[[ExampleConfig], dict],
                argv: Sequence[str] | None = None, *, prog: str, doc: str) -> dict:
  """What every ``main.py`` does: flags to config, train and evaluate, print a summary.

  Args:
    get_config: the example's ``config.get_config`` (the flags' defaults).
    train_and_evaluate: the example's ``train.train_and_evaluate``.
    argv: the arguments (default ``sys.argv[1:]``); ``--workdir`` is required.
    prog: program name for ``--help``.
    doc: the ``main.py`` docstring; its first line describes the program in ``--help``.

  Returns:
    The run's metrics.
  """
  args = flags.example_parser(get_config, prog=prog, doc=doc).parse_args(argv)
  metrics = train_and_evaluate(dataclasses.replace(get_config(), **vars(args)))
  print_summary(metrics)
  return metrics


def should_evaluate(config: ExampleConfig, step: int) -> bool:
  """Whether to evaluate after ``step`` (always after the last one)."""
  every = config.eval_every
  return step == config.steps or (every > 0 and step % every == 0)


def train_loop(config: ExampleConfig, *, state, step_fn, batch_fn, eval_fn, to_checkpoint,
               from_checkpoint, desc: str):
  """Runs ``config.steps`` steps with evaluation, checkpoints and a progress bar.

  If ``<workdir>/checkpoints`` holds a checkpoint, the loop first restores
  the state, the data position and the history from the newest one and
  continues from there; because batches are a pure function of the data
  position and every step is deterministic, the result is bit-identical
  to an uninterrupted run.

  Args:
    config: the run's settings (steps, eval and checkpoint cadence, workdir).
    state: the initial training state (a pytree).
    step_fn: ``step_fn(state, batch) -> (state, loss)``.
    batch_fn: ``batch_fn(position) -> batch``, the ``position``-th batch
      (0-based count of batches drawn); a pure function of ``position``.
    eval_fn: ``eval_fn(state) -> {name: float}``.
    to_checkpoint: ``state`` -> the pytree of arrays to save.
    from_checkpoint: the inverse of ``to_checkpoint``.
    desc: progress bar label.

  Returns:
    ``(state, history, start)``: the final state, the :class:`History`
    (restored part included) and the step this process started from.
  """
  history, start, position = History(), 0, 0
  checkpoints = checkpoints_for(config)
  if checkpoints is not None and checkpoints.latest_step() is not None:
    start = checkpoints.latest_step()
    tree, saved = checkpoints.restore(
        {"state": to_checkpoint(state), "data_position": np.zeros((), np.int64)})
    state = from_checkpoint(tree["state"])
    position = int(tree["data_position"])
    history = History(saved)
  history.restarts.append(start)

  bar = tqdm(range(start, config.steps), initial=start, total=config.steps, desc=desc,
             disable=not config.progress, dynamic_ncols=True, mininterval=0.5)
  try:
    for step in bar:
      batch = batch_fn(position)
      position += 1
      t0 = time.perf_counter()
      state, loss = step_fn(state, batch)
      # Fetching the loss waits for the step, so at most one step is in
      # flight: XLA's CPU collectives can deadlock when many steps are
      # queued (docs/guide.md, Troubleshooting). The steps wait on CPU too
      # (sync_every); this also makes step_time_s the step's own time.
      loss = float(np.asarray(loss).reshape(-1)[0])
      history.record_step(loss, time.perf_counter() - t0)
      bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
      done = step + 1
      if should_evaluate(config, done):
        history.record_eval(done, **eval_fn(state))
      if checkpoints is not None and should_checkpoint(config, done):
        checkpoints.save(done, {"state": to_checkpoint(state),
                                "data_position": np.asarray(position, np.int64)},
                         history.as_dict())
  finally:
    bar.close()
    if checkpoints is not None:
      checkpoints.close()
  if not history.evals or history.evals[-1]["step"] != config.steps:
    history.record_eval(config.steps, **eval_fn(state))
  return state, history, start
