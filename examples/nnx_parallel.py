"""The examples' glue around :class:`dynamiq_jax.training.nnx.DataParallel`.

The package's helper holds the model and its ``nnx.Optimizer`` as one state
pytree on a data-parallel mesh and builds the ``jax.shard_map`` step; this
module adds what only the examples need: :func:`train_loop` (the examples'
loop with evaluation, checkpoints and metrics history).
"""

from __future__ import annotations

from dynamiq_jax.training.nnx import DataParallel
from . import flags
from . import loop


def train_loop(dp: DataParallel, config: flags.ExampleConfig, loss_fn, *, batch_fn, eval_fn,
               desc: str):
  """:func:`examples.loop.train_loop` from ``dp.state`` with ``dp.train_step(loss_fn)``.

  Checkpoints hold the state as ``dp.checkpoint_tree`` gives it.

  Args:
    dp: the model and optimizer on the mesh.
    config: the run's settings (steps, eval and checkpoint cadence, workdir).
    loss_fn: ``loss_fn(model, batch) -> mean loss`` over one rank's part.
    batch_fn: ``batch_fn(position) -> batch``, split over the data axis.
    eval_fn: ``eval_fn(state) -> {name: float}``.
    desc: progress bar label.

  Returns:
    ``(state, history, start)``, as :func:`examples.loop.train_loop`.
  """
  return loop.train_loop(
      config, state=dp.state, step_fn=dp.train_step(loss_fn), batch_fn=batch_fn,
      eval_fn=eval_fn, to_checkpoint=dp.checkpoint_tree,
      from_checkpoint=dp.from_checkpoint_tree, desc=desc)
