"""The examples' devices: which ones, the mesh over them, and batches placed on it."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import flags


DEFAULT_CPU_DEVICES = 8


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


def setup(config: flags.TrainConfig, axis_name: str = "data"):
  """What every ``train_and_evaluate`` starts with: check the config, pick the devices.

  Args:
    config: the run's settings.
    axis_name: the data-parallel axis of the mesh.

  Returns:
    ``(devices, n, mesh)``: the devices (:func:`select_devices`), how many
    there are, and a 1-D mesh over them with the axis ``axis_name``.

  Raises:
    ValueError: for a setting :func:`validate` rejects, or a batch size that
      does not split evenly over the devices.
  """
  flags.validate(config)
  devices = select_devices(config.devices)
  n = len(devices)
  if config.batch_size % n:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of the {n} devices")
  return devices, n, jax.make_mesh((n,), (axis_name,), devices=devices)


def shard_batch(mesh, tree):
  """Puts every leaf of a host batch on ``mesh``, split along its leading axis over ``data``."""
  return jax.device_put(tree, NamedSharding(mesh, P("data")))


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
