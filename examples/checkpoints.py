"""Orbax checkpoints of an example's whole training state and its metrics history."""

from __future__ import annotations

import os

import jax
import numpy as np

from .flags import ExampleConfig


def _abstract(x):
  if isinstance(x, jax.Array):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  return np.asarray(x)  # host arrays come back as numpy arrays


class Checkpoints:
  """Orbax checkpoints of a training-state pytree and a JSON metrics history.

  Saves are synchronous, so the next step may donate the saved buffers.

  Args:
    directory: where the numbered checkpoint folders go.
    max_to_keep: how many recent checkpoints to keep.
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3):
    import orbax.checkpoint as ocp  # only examples that checkpoint need orbax

    self._ocp = ocp
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    """The step of the newest checkpoint, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state, history: dict) -> None:
    """Saves ``state`` (any pytree of arrays) and ``history`` (JSON) as ``step``."""
    args = self._ocp.args
    self._manager.save(step, args=args.Composite(
        state=args.StandardSave(state), history=args.JsonSave(history)))
    self._manager.wait_until_finished()

  def restore(self, like, step: int | None = None):
    """Restores ``(state, history)``; ``like`` gives the tree, dtypes and shardings."""
    args = self._ocp.args
    step = self.latest_step() if step is None else step
    out = self._manager.restore(step, args=args.Composite(
        state=args.StandardRestore(jax.tree.map(_abstract, like)),
        history=args.JsonRestore()))
    return out.state, out.history

  def close(self) -> None:
    self._manager.close()


def checkpoints_for(config: ExampleConfig) -> Checkpoints | None:
  """The run's checkpoints in ``<workdir>/checkpoints``, if it saves or has any."""
  if config.workdir is None:
    return None
  directory = os.path.join(config.workdir, "checkpoints")
  if config.checkpoint_every == 0 and not os.path.isdir(directory):
    return None
  return Checkpoints(directory)


def should_checkpoint(config: ExampleConfig, step: int) -> bool:
  """Whether to save after ``step`` (1-based count of steps done)."""
  every = config.checkpoint_every
  return every > 0 and (step % every == 0 or step == config.steps)
