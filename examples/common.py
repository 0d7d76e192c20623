"""Pieces the examples share: flags, devices, the gradient reduction, checkpoints, metrics.

Every example is ``config.py`` (a dataclass of defaults), ``train.py``
(``train_and_evaluate(config) -> metrics``) and a short ``main.py`` that
turns flags into a config (:func:`run_example`). ``train_and_evaluate``
trains, evaluates and, with ``config.workdir``, writes ``metrics.json`` and
checkpoints; a run whose workdir holds a checkpoint continues from it, bit
for bit as if it had not been interrupted (:func:`train_loop`). This module
holds what the examples have in common:

* :class:`ExampleConfig`, :class:`TrainConfig` and :func:`parse_flags`: the
  flags every example takes (``--codec``, ``--bits``, ``--schedule``,
  ``--devices``, ``--steps``, ``--seed``, ``--workdir``, ..., and the
  optimizer's ``--batch_size``, ``--learning_rate``, ...), generated from
  the dataclass fields.
* :func:`setup` and :func:`select_devices`: the checks every run starts
  with, and the devices: every local GPU when there are several, otherwise
  8 simulated CPU devices (or ``--devices``).
* :func:`make_reducer`, :func:`make_optimizer` and :func:`wire_report`: the
  gradient all-reduce named by ``--codec``, looked up in
  ``dynamiq_jax.REDUCERS``, the AdamW chain that starts with it, and what
  it puts on the wire.
* :class:`Checkpoints`: orbax checkpoints of the whole training state
  (parameters, optimizer state including ``compressed_psum``'s step counter
  and key, the data position) plus the metrics history, so a restored run
  continues bit for bit.
* :class:`History` and :func:`write_metrics`: per-step losses and times,
  evaluations, and the metrics JSON in ``--workdir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dynamiq_jax as dq

SCHEDULES = ("ring", "butterfly")
DEFAULT_CPU_DEVICES = 8


def flag(default, help: str, choices: Callable[[], Sequence[Any]] | Sequence[Any] | None = None):
  """A config field that :func:`parse_flags` turns into ``--name``.

  A subclass gives such a field another default by declaring it again with
  a bare value (``steps: int = 400``); the flag keeps this help text.
  """
  return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class ExampleConfig:
  """Settings every example takes; each example's ``config.py`` extends it."""

  codec: str = flag("dynamiq", "gradient all-reduce: any name in dynamiq_jax.REDUCERS "
                    "('psum-bf16' is the uncompressed BF16 baseline)", lambda: dq.REDUCERS)
  bits: float | None = flag(None, "bits per coordinate, passed as bits= to codecs that take "
                            "a budget (default: the codec's own, 5 for DynamiQ); others ignore it")
  schedule: str = flag("ring", "all-reduce schedule of the compressed codecs", SCHEDULES)
  devices: int | None = flag(None, "data-parallel ranks (default: every local GPU when there "
                             "are several, otherwise 8 simulated CPU devices)")
  steps: int = flag(300, "training steps")
  seed: int = flag(0, "seeds the initialisation, the data order and the rounding")
  workdir: str | None = flag(None, "where metrics.json and checkpoints/ go (nothing is "
                             "written when unset); a run resumes from the latest checkpoint")
  eval_every: int = flag(100, "evaluate every this many steps (0: only at the end)")
  checkpoint_every: int = flag(0, "checkpoint every this many steps and at the end "
                               "(0: no checkpoints)")
  progress: bool = flag(True, "show a progress bar")
  calibrate: bool = flag(False, "DynamiQ only, for comparisons: static class capacities "
                         "(allocation='static') fitted to this run's first-batch gradients, "
                         "instead of the default per-round allocation; other codecs ignore it")
  # Set by calibrate(), not a flag: the fitted ``profile=`` option of the codec.
  calibrated_profile: tuple | None = dataclasses.field(default=None,
                                                       metadata={"flag": False})


@dataclasses.dataclass(frozen=True)
class TrainConfig(ExampleConfig):
  """:class:`ExampleConfig` plus the batch size and the :func:`make_optimizer` settings.

  An example's ``Config`` extends it and sets its own defaults by declaring
  a field again, e.g. ``warmup_steps: int = 40``.
  """

  batch_size: int = flag(256, "global batch size (split over the devices)")
  learning_rate: float = flag(3e-3, "peak AdamW learning rate")
  warmup_steps: int = flag(20, "linear warm-up steps before the cosine decay")
  weight_decay: float = flag(1e-4, "AdamW weight decay")


# -- flags -----------------------------------------------------------------------


def _parser_for(type_name: str):
  base = type_name.replace(" | None", "").strip()
  parse = {"int": int, "float": float, "str": str}[base]
  if "None" not in type_name:
    return parse
  return lambda text: None if text.lower() in ("none", "") else parse(text)


def _flag_metadata(cls: type, name: str) -> dict:
  """Help and choices of field ``name``: from the nearest class declaring it with :func:`flag`."""
  for klass in cls.__mro__:
    field = getattr(klass, "__dataclass_fields__", {}).get(name)
    if field is not None and "help" in field.metadata:
      return field.metadata
  return {}


def build_parser(default: ExampleConfig, *, prog: str | None = None,
                 description: str | None = None,
                 required: Sequence[str] = ()) -> argparse.ArgumentParser:
  """The command-line flags of a config, one ``--name`` per config field.

  ``--help`` shows each flag's meaning and default.

  Args:
    default: the defaults (an :class:`ExampleConfig` subclass instance).
    prog: program name for ``--help``.
    description: text for ``--help``.
    required: fields that must be given on the command line.
  """
  parser = argparse.ArgumentParser(prog=prog, description=description,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  for field in dataclasses.fields(default):
    if field.metadata.get("flag") is False:
      continue  # derived during the run (e.g. calibrated_profile), not set by hand
    value = getattr(default, field.name)
    names = [f"--{field.name}"]
    if "_" in field.name:
      names.append(f"--{field.name.replace('_', '-')}")
    help_text = _flag_metadata(type(default), field.name).get("help", "")
    if field.type == "bool":
      parser.add_argument(*names, dest=field.name, default=value, help=help_text,
                          action=argparse.BooleanOptionalAction)
      continue
    choices = _flag_metadata(type(default), field.name).get("choices")
    choices = choices() if callable(choices) else choices
    is_required = field.name in required
    parser.add_argument(*names, dest=field.name, type=_parser_for(field.type),
                        default=argparse.SUPPRESS if is_required else value,
                        required=is_required, choices=tuple(choices) if choices else None,
                        help=help_text)
  return parser


def parse_flags(default: ExampleConfig, argv: Sequence[str] | None = None, *,
                prog: str | None = None, description: str | None = None,
                required: Sequence[str] = ()) -> ExampleConfig:
  """Builds a config from command-line flags (:func:`build_parser`).

  Args:
    default: the defaults (an :class:`ExampleConfig` subclass instance).
    argv: the arguments (default ``sys.argv[1:]``).
    prog: program name for ``--help``.
    description: text for ``--help``.
    required: fields that must be given on the command line.

  Returns:
    ``default`` with the given flags replaced.
  """
  parser = build_parser(default, prog=prog, description=description, required=required)
  return dataclasses.replace(default, **vars(parser.parse_args(argv)))


def validate(config: ExampleConfig) -> None:
  """Checks the settings every example shares.

  Raises:
    ValueError: naming the setting and the values it can take.
  """
  if config.codec not in dq.REDUCERS:
    raise ValueError(
        f"codec={config.codec!r} is not one of dynamiq_jax.REDUCERS={list(dq.REDUCERS)}")
  if config.schedule not in SCHEDULES:
    raise ValueError(f"schedule={config.schedule!r} must be one of {SCHEDULES}")
  if config.steps < 1:
    raise ValueError(f"steps={config.steps} must be >= 1")
  if config.devices is not None and config.devices < 1:
    raise ValueError(f"devices={config.devices} must be >= 1 (or None for the default)")
  for name in ("eval_every", "checkpoint_every"):
    if getattr(config, name) < 0:
      raise ValueError(f"{name}={getattr(config, name)} must be >= 0")


def example_parser(get_config: Callable[[], ExampleConfig], *, prog: str,
                   doc: str) -> argparse.ArgumentParser:
  """The flags of an example's ``main.py``: its config's fields, ``--workdir`` required.

  Args:
    get_config: the example's ``config.get_config`` (the flags' defaults).
    prog: program name for ``--help``.
    doc: the ``main.py`` docstring; its first line describes the program in ``--help``.
  """
  return build_parser(get_config(), prog=prog, description=doc.split("\n")[0],
                      required=("workdir",))


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
  args = example_parser(get_config, prog=prog, doc=doc).parse_args(argv)
  metrics = train_and_evaluate(dataclasses.replace(get_config(), **vars(args)))
  print_summary(metrics)
  return metrics


# -- devices ---------------------------------------------------------------------


def select_devices(count: int | None = None) -> list:
  """The devices to train on: several GPUs if present, else simulated CPU devices.

  Call it before anything else touches JAX devices: it asks JAX for ``count``
  (default 8) CPU devices, which only works before the backends start. When
  they already started (e.g. under pytest, whose conftest asks for 8), it
  uses the CPU devices that exist.

  Args:
    count: how many ranks; ``None`` means every local accelerator when there
      are at least two, otherwise 8 simulated CPU devices.

  Returns:
    A list of ``count`` devices (all accelerators for ``count=None``).

  Raises:
    RuntimeError: if fewer devices than asked for exist.
  """
  cpu_count = DEFAULT_CPU_DEVICES if count is None else count
  try:
    jax.config.update("jax_num_cpu_devices", cpu_count)
  except RuntimeError:
    pass  # backends already initialised; use the CPU devices that exist
  accelerators = [d for d in jax.local_devices() if d.platform != "cpu"]
  if count is None and len(accelerators) > 1:
    return accelerators
  if count is not None and accelerators and len(accelerators) >= count:
    return accelerators[:count]
  cpus = jax.local_devices(backend="cpu")
  if len(cpus) < cpu_count:
    raise RuntimeError(
        f"asked for {cpu_count} CPU devices but JAX started with {len(cpus)}: the device "
        f"count must be set before JAX initialises, so run the example in a fresh process "
        f"(python -m examples.<name>.main --devices {cpu_count}) or pass --devices {len(cpus)}")
  return cpus[:cpu_count]


def make_mesh(devices, axis_name: str = "data"):
  """A 1-D mesh over ``devices`` with the data-parallel axis ``axis_name``."""
  return jax.make_mesh((len(devices),), (axis_name,), devices=devices)


def setup(config: TrainConfig, axis_name: str = "data"):
  """What every ``train_and_evaluate`` starts with: check the config, pick the devices.

  Args:
    config: the run's settings.
    axis_name: the data-parallel axis of the mesh.

  Returns:
    ``(devices, n, mesh)``: the devices (:func:`select_devices`), how many
    there are, and a 1-D mesh over them (:func:`make_mesh`).

  Raises:
    ValueError: for a setting :func:`validate` rejects, or a batch size that
      does not split evenly over the devices.
  """
  validate(config)
  devices = select_devices(config.devices)
  n = len(devices)
  if config.batch_size % n:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of the {n} devices")
  return devices, n, make_mesh(devices, axis_name)


def device_summary(devices) -> dict:
  """What the run ran on, for the metrics."""
  return {"count": len(devices), "platform": devices[0].platform,
          "kind": devices[0].device_kind}


def shard_batch(mesh, tree, axis_name: str = "data"):
  """Puts every leaf of a host batch on ``mesh``, split along its leading axis."""
  return jax.device_put(tree, NamedSharding(mesh, P(axis_name)))


def pad_to_multiple(arrays: Sequence[np.ndarray], n: int):
  """Pads arrays along axis 0 to a multiple of ``n``; returns (padded, weights)."""
  size = len(arrays[0])
  extra = -size % n
  padded = [np.concatenate([a, np.zeros((extra,) + a.shape[1:], a.dtype)]) for a in arrays]
  weights = np.concatenate([np.ones(size, np.float32), np.zeros(extra, np.float32)])
  return padded, weights


def weighted_mean(values, weights: np.ndarray) -> float:
  """Mean of ``values`` (flattened) with ``weights``, e.g. over a padded evaluation set."""
  values = np.asarray(values).reshape(-1)
  return float(np.sum(values * weights) / weights.sum())


def param_shapes(params):
  """``params`` as ``jax.ShapeDtypeStruct`` leaves: their sizes, without their values."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


# -- the gradient reduction ----------------------------------------------------


def _bits_field(codec_name: str):
  """The ``bits`` init field of the codec named ``codec_name``, or None."""
  try:
    codec = dq.codec_from_name(codec_name)
  except ValueError:
    return None  # the psum-* reducers have no codec and no options
  if dataclasses.is_dataclass(codec):
    return next((f for f in dataclasses.fields(codec) if f.init and f.name == "bits"), None)
  return inspect.signature(type(codec)).parameters.get("bits")


def reducer_options(config: ExampleConfig) -> dict:
  """Codec options from the flags: ``bits=`` for codecs that take a budget.

  Codecs without a ``bits`` setting (and the ``psum-*`` reducers) ignore
  ``config.bits``; the metrics record the options actually used.

  Raises:
    ValueError: if the codec takes whole bits and ``config.bits`` is not whole.
  """
  options = {}
  if config.calibrated_profile is not None:
    options["allocation"] = "static"
    options["widths"] = STATIC_WIDTHS
    options["profile"] = tuple(float(v) for v in config.calibrated_profile)
  if config.bits is None:
    return options
  field = _bits_field(config.codec)
  if field is None:
    return options
  kind = str(getattr(field, "type", getattr(field, "annotation", "")))
  if "int" in kind and "float" not in kind:
    if not float(config.bits).is_integer():
      raise ValueError(f"codec {config.codec!r} takes whole bits; got bits={config.bits}")
    return {"bits": int(config.bits), **options}
  return {"bits": config.bits, **options}


STATIC_WIDTHS = (2, 4, 8)


def calibrate(config: ExampleConfig, grad_fn: Callable[[Any], Any], batch, n: int):
  """``config`` with static DynamiQ capacities fitted to the first batch's per-rank gradients.

  For comparisons only: the default DynamiQ chooses its widths from every
  round's statistics and needs no calibration. With ``allocation='static'``
  each width class gets a fixed share of the super-groups, and
  ``DynamiQ.calibrate`` records the shares of these gradients (a profile of
  super-group norms). This runs before training, on the initial
  parameters and the run's first batch split as the ranks will split it, so
  a run restored from a checkpoint gets the same capacities again.

  Args:
    config: the run's settings; nothing happens unless ``config.calibrate``
      is set and the codec has a ``calibrate`` method (DynamiQ).
    grad_fn: ``grad_fn(rank_batch) -> gradient pytree`` at the initial
      parameters.
    batch: the first global batch (pytree of arrays whose leading axis is
      the global batch; device arrays are fetched to the host).
    n: the number of ranks.

  Returns:
    ``dataclasses.replace(config, calibrated_profile=...)``, or ``config``
    unchanged when there is nothing to calibrate.
  """
  if not config.calibrate or config.calibrated_profile is not None:
    return config
  try:
    codec = dq.codec_from_name(config.codec, **reducer_options(config))
  except ValueError:
    return config  # the psum-* reducers have no codec
  if not isinstance(codec, dq.codecs.DynamiQ):
    return config
  codec = dataclasses.replace(codec, allocation="static", widths=STATIC_WIDTHS)
  host = jax.device_get(batch)
  size = len(jax.tree.leaves(host)[0])
  if size % n:
    raise ValueError(f"the first batch has {size} examples, not a multiple of the {n} ranks")
  per_rank = []
  for r in range(n):
    shard = jax.tree.map(lambda a: a[r * size // n:(r + 1) * size // n], host)
    per_rank.append(np.concatenate([np.asarray(g, np.float32).ravel()
                                    for g in jax.tree.leaves(grad_fn(shard))]))
  fitted = codec.calibrate(np.stack(per_rank))
  return dataclasses.replace(config, calibrated_profile=fitted.profile)


def make_reducer(config: ExampleConfig, axis_name: str = "data"):
  """The optax transform that all-reduces gradients as ``config.codec`` says.

  Goes through :func:`dynamiq_jax.reducer`, so every name in
  ``dynamiq_jax.REDUCERS`` works, including ones added after this example.
  """
  return dq.reducer(config.codec, axis_name, schedule=config.schedule, seed=config.seed,
                    **reducer_options(config))


def make_optimizer(config: TrainConfig, axis_name: str = "data", *,
                   final_lr_fraction: float = 0.0, **adamw) -> optax.GradientTransformation:
  """The gradient all-reduce named by ``config.codec``, then AdamW with warm-up + cosine.

  The learning rate rises linearly from 0 to ``config.learning_rate`` over
  ``config.warmup_steps`` (at most ``steps - 1``), then follows a cosine
  down to ``final_lr_fraction * config.learning_rate`` at ``config.steps``.

  Args:
    config: the run's settings.
    axis_name: the data-parallel axis the all-reduce runs over.
    final_lr_fraction: the learning rate at the end, as a share of the peak.
    **adamw: more ``optax.adamw`` options (e.g. ``b2``).
  """
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, min(config.warmup_steps, config.steps - 1), config.steps,
      end_value=final_lr_fraction * config.learning_rate)
  return optax.chain(make_reducer(config, axis_name),
                     optax.adamw(schedule, weight_decay=config.weight_decay, **adamw))


def codec_description(config: ExampleConfig) -> str | None:
  """``repr`` of the codec the run uses (None for the ``psum-*`` reducers)."""
  try:
    return repr(dq.codec_from_name(config.codec, **reducer_options(config)))
  except ValueError:
    return None


_PSUM_BITS = {"bf16": 16, "f16": 16, "fp16": 16, "f32": 32, "fp32": 32}


def wire_report(config: ExampleConfig, params, n: int) -> dict:
  """Bits per coordinate and bytes each rank sends per all-reduce of ``params``.

  Compressed codecs are measured with :func:`dynamiq_jax.wire_stats`; an
  XLA ``psum-<dtype>`` is taken as a ring all-reduce of that dtype, which
  sends ``2 (n-1)/n`` of the payload per rank. Unknown psum names give
  ``None``.
  """
  coords = int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))
  bf16_bytes = 2.0 * coords * 2 * (n - 1) / n
  try:
    codec = dq.codec_from_name(config.codec, **reducer_options(config))
  except ValueError:
    codec = None
  if codec is not None:
    stats = dq.wire_stats(params, codec=codec, n=n)
    bits, sent = float(stats.bits_per_coord), float(stats.bytes_per_rank)
  else:
    bits = _PSUM_BITS.get(config.codec.split("-", 1)[-1])
    sent = None if bits is None else bits / 8 * coords * 2 * (n - 1) / n
  return {"coords": coords, "bits_per_coord": bits, "bytes_per_rank_per_step": sent,
          "vs_bf16": None if sent is None or n == 1 else sent / bf16_bytes}


# -- checkpoints ------------------------------------------------------------------


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


def should_evaluate(config: ExampleConfig, step: int) -> bool:
  """Whether to evaluate after ``step`` (always after the last one)."""
  every = config.eval_every
  return step == config.steps or (every > 0 and step % every == 0)


# -- the training loop -------------------------------------------------------------


def train_loop(config: ExampleConfig, *, state, step_fn, batch_fn, eval_fn,
               to_checkpoint=lambda s: s, from_checkpoint=lambda t: t, desc: str = "train"):
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

  bar = progress_bar(config, start, desc)
  try:
    for step in bar:
      batch = batch_fn(position)
      position += 1
      with Stopwatch() as watch:
        state, loss = step_fn(state, batch)
        # Fetching the loss waits for the step, so at most one step is in
        # flight: XLA's CPU collectives can deadlock when many steps are
        # queued (docs/guide.md, Troubleshooting). The steps wait on CPU too
        # (sync_every); this also makes step_time_s the step's own time.
        loss = float(np.asarray(loss).reshape(-1)[0])
      history.record_step(loss, watch.seconds)
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
  metrics = {
      "example": example,
      "config": dict(vars(config)),
      "devices": device_summary(devices),
      "reducer": {"name": config.codec, "options": reducer_options(config),
                  "schedule": config.schedule, "codec": codec_description(config)},
      "params": int(sum(np.size(x) for x in jax.tree.leaves(params))),
      "wire": wire_report(config, params, len(devices)),
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


# -- metrics ----------------------------------------------------------------------


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
  """SHA-256 of every leaf's dtype, shape and bytes: equal digests, bit-identical trees."""
  digest = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
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


def progress_bar(config: ExampleConfig, start: int, desc: str):
  """A tqdm bar over steps ``start..config.steps-1``."""
  from tqdm.auto import tqdm

  return tqdm(range(start, config.steps), initial=start, total=config.steps, desc=desc,
              disable=not config.progress, dynamic_ncols=True, mininterval=0.5)


class Stopwatch:
  """Wall time of a block: ``with Stopwatch() as t: ...; t.seconds``."""

  def __enter__(self):
    self._t0 = time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self._t0


def print_summary(metrics: dict) -> None:
  """Prints the headline numbers of a run's metrics."""
  final = metrics["final"]
  wire = metrics["wire"]
  parts = [f"{k}={v:.4f}" for k, v in final.items() if isinstance(v, float)]
  bits = wire["bits_per_coord"]
  reducer = metrics["reducer"]
  options = "".join(
      f" {k}=" + (f"<{len(v)} log2 F quantiles> (calibrated)" if k == "profile" else str(v))
      for k, v in reducer["options"].items())
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
