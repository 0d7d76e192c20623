"""Dispatch of the Pallas kernels: by the platform being lowered for, with a fallback.

Every kernel of this package is called through :func:`dispatch`, which
knows no kernel: it gets the kernel (one GPU backend's function, with an
``interpret=`` argument) and its pure-jnp reference, and chooses between
them by the platform being *lowered for*, not the host's backend
(``jax.lax.platform_dependent``):

* ``implementation=None`` puts the kernel into every lowering for ``cuda`` /
  ``rocm`` (:data:`GPU_PLATFORMS`; a deviceless or AOT compile for GPUs from
  a CPU host included) and the reference into every other (on CPU without
  interpret mode).
* ``"pallas"`` forces the kernel (``interpret=True`` off GPU, which is how
  CPU tests run it); ``"xla"`` forces the reference. ``"mosaic"`` is
  ``"pallas"`` for the Mosaic GPU kernel that the caller passes instead of
  the Triton one (:mod:`pallas_kernels.dynamiq`), except off GPU, where it is
  the reference unless ``interpret=True`` asks for Mosaic GPU's interpret
  mode; ``None`` never picks it.
* A kernel raises ``NotImplementedError`` for input it does not support, and
  dispatch falls back to the reference, logging the reason once.
* On a process with a GPU, ``implementation=None`` first compiles each
  kernel alone (once per kernel, static arguments and operand types); if
  that fails (a new jax, a new GPU) it warns once
  (:class:`KernelFallbackWarning`, naming the kernel, the error and both ways
  to force a path) and the program uses the reference: the same bits,
  slower.

jax >= 0.11 deprecates the Triton backend and warns at every Triton
lowering; the Triton kernels' entry points filter that DeprecationWarning,
and only it (:mod:`pallas_kernels.dynamiq_triton`), so nothing here does. jax >= 0.11 also compiles a Pallas GPU kernel for the
GPU of the abstract mesh in context, so the compile probe steps aside when
the program is lowered for a GPU of another kind than the local one
(:func:`_targets_another_gpu`).

Also here, for every kernel wrapper: :func:`typed_like` (a ``pallas_call``'s
output type inside ``shard_map(check_vma=True)``) and :func:`map_over_batch`
(``vmap`` as a map over the batch).

It takes one kernel per operation (the Triton backend's); a second GPU
backend would give it one kernel per backend to choose among.
"""

from __future__ import annotations

import logging
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GPU_PLATFORMS",
    "Implementation",
    "KernelFallbackWarning",
    "dispatch",
    "map_batch_rule",
    "map_over_batch",
    "typed_like",
]

Implementation = Literal["pallas", "mosaic", "xla"] | None

_log = logging.getLogger("dynamiq_jax")
_warned: set = set()


def typed_like(out_shape, args):
  """``out_shape`` varying over every mesh axis that one of ``args`` varies over.

  Inside ``jax.shard_map(check_vma=True)`` (``dq.data_parallel_step``) a
  ``pallas_call`` must be told how its output varies across the mesh.
  """
  avals = [jax.typeof(a) for a in args]
  mat = getattr(avals[0], "manual_axis_type", None)
  if mat is None:  # no per-axis types to declare
    return out_shape
  varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
  return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype,
                              manual_axis_type=mat.update(varying=varying))


def map_batch_rule(fn):
  """A ``custom_vmap`` rule that maps ``fn`` over the batch (``jax.lax.map``), the
  unbatched operands passed whole to every element: ``pallas_call``'s own
  batching would add a grid axis under a kernel's computed offsets, and keys
  and widths may differ per batch element."""

  def rule(axis_size, in_batched, *args):
    del axis_size
    batched = [a for a, b in zip(args, in_batched) if b]

    def one(items):
      it = iter(items)
      return fn(*[next(it) if b else a for a, b in zip(args, in_batched)])

    return jax.lax.map(one, batched), True

  return rule


def map_over_batch(fn, *operands):
  """``fn(*operands)``, and under ``vmap`` ``fn`` mapped over the batch
  (:func:`map_batch_rule`); None operands are passed as None."""
  where = [i for i, a in enumerate(operands) if a is not None]

  def on_arrays(*arrays):
    full = list(operands)
    for i, a in zip(where, arrays):
      full[i] = a
    return fn(*full)

  call = jax.custom_batching.custom_vmap(on_arrays)
  call.def_vmap(map_batch_rule(call))
  return call(*[operands[i] for i in where])


# ----------------------------------------------------------------------------
# Dispatch.


GPU_PLATFORMS = ("cuda", "rocm")
"""Lowering platforms that get the kernels under ``implementation=None``."""

class KernelFallbackWarning(RuntimeWarning):
  """A kernel did not compile on this GPU; the XLA reference runs instead."""


_probed: dict = {}  # (op, static args, operand types, GPU) -> error text, or None if it compiled


def _check_implementation(implementation: Implementation):
  if implementation not in (None, "pallas", "mosaic", "xla"):
    raise ValueError(f"implementation={implementation!r} must be None, 'pallas' (Triton), "
                     "'mosaic' (Mosaic GPU) or 'xla'")


def _fallback(op: str, err: NotImplementedError):
  key = (op, str(err))
  if key not in _warned:
    _warned.add(key)
    _log.warning("dynamiq_jax: Pallas %s does not support %s; using the XLA reference.",
                 op, err)


def _local_gpus():
  """This process's GPU devices ([] when it has none, e.g. a compile-only host)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def _targets_another_gpu(gpu) -> bool:
  """Whether the program is being lowered for a GPU of another kind than ``gpu``.

  jax >= 0.11 compiles a Pallas GPU kernel for the GPU of the abstract mesh
  in context (``jax.sharding.use_abstract_mesh``, or a ``shard_map`` over a
  mesh of GPUs) and reads a kind that differs from the local device's as a
  deliberate ahead-of-time target; compiling the kernel on ``gpu`` would then
  say nothing about the target.
  """
  target = jax.sharding.get_abstract_mesh().abstract_device
  return (target is not None and target.platform in ("gpu", *GPU_PLATFORMS)
          and target.device_kind != gpu.device_kind)


def _split(args, kwargs):
  """(operands, rebuild): the arrays among a call's arguments, and ``rebuild(operands)``.

  Everything else (the format, ``strata``, Python scalars) stays as given.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, v in enumerate(leaves) if isinstance(v, (jax.Array, np.ndarray, np.generic))]

  def rebuild(operands):
    full = list(leaves)
    for i, v in zip(where, operands):
      full[i] = v
    return jax.tree.unflatten(tree, full)

  return [leaves[i] for i in where], rebuild


def _compile_alone(kernel, device, args, kwargs):
  """Compiles ``kernel(*args, **kwargs)`` by itself for ``device``; raises what XLA raises."""
  operands, rebuild = _split(args, kwargs)
  sharding = jax.sharding.SingleDeviceSharding(device)
  structs = [jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v), sharding=sharding)
             for v in operands]

  def alone(*operands):
    a, kw = rebuild(operands)
    return kernel(*a, **kw, interpret=False)

  with warnings.catch_warnings():
    jax.jit(alone).lower(*structs).compile()


def _kernel_compiles(op, kernel, args, kwargs) -> bool:
  """Whether ``op``'s kernel compiles for this process's GPU (True when it has none).

  Checked once per (op, static arguments (format, strata, ...), operand
  shapes and dtypes) by
  compiling the kernel alone, in the caller's context (the abstract mesh that
  the caller's lowering will read too); on failure one
  :class:`KernelFallbackWarning` names the kernel, the error and how to force
  either path. Without a local GPU (a deviceless or AOT compile from a CPU
  host), or when the program is lowered for a GPU of another kind
  (:func:`_targets_another_gpu`), there is nothing to compile against, and
  the kernels stay in the program.
  """
  gpus = _local_gpus()
  if not gpus or _targets_another_gpu(gpus[0]):
    return True
  operands, _ = _split(args, kwargs)
  types = tuple(f"{jnp.result_type(v)}{list(np.shape(v))}" for v in operands)
  static = tuple(repr(v) for v in jax.tree.leaves((args, kwargs))
                 if not isinstance(v, (jax.Array, np.ndarray, np.generic)))
  key = (op, static, types, gpus[0].device_kind)  # static: the format, strata, ...
  if key not in _probed:
    try:
      _compile_alone(kernel, gpus[0], args, kwargs)
      _probed[key] = None
    except NotImplementedError:
      _probed[key] = None  # unsupported input: _kernel_or_fallback says so and falls back
    except Exception as err:  # noqa: BLE001 - whatever the compiler raised, do not use it
      _probed[key] = f"{type(err).__name__}: {err}"
      warnings.warn(
          f"dynamiq_jax: the Pallas kernel {op!r} failed to compile on "
          f"{gpus[0].device_kind} (jax {jax.__version__}; operands {', '.join(types)}): "
          f"{_probed[key]}\n"
          "Using the XLA reference instead: the same results, only slower. "
          "implementation='xla' chooses the reference without this check; "
          "implementation='pallas' uses the kernel regardless (and raises its error).",
          KernelFallbackWarning, stacklevel=2)
  return _probed[key] is None


def _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs):
  try:
    return kernel(*args, **kwargs, interpret=interpret)
  except NotImplementedError as err:
    _fallback(op, err)
    return reference(*args, **kwargs)


def _gpu_path(op, kernel, reference, interpret, args, kwargs):
  """The program for a GPU lowering under ``implementation=None``."""
  if interpret or _kernel_compiles(op, kernel, args, kwargs):
    return _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs)
  return reference(*args, **kwargs)


def dispatch(op, kernel, reference, implementation, interpret, *args, **kwargs):
  """Runs ``op`` (its name, for messages) by the platform being lowered for, not the
  host's backend: ``kernel(*args, **kwargs, interpret=...)`` or
  ``reference(*args, **kwargs)``.

  ``implementation=None``: the kernel in a lowering for a GPU
  (:data:`GPU_PLATFORMS`; unless it fails to compile on this process's GPU,
  see :func:`_kernel_compiles`), the XLA reference for every other platform.
  ``"pallas"``: the kernel everywhere, interpreted off GPU. ``"xla"``: the
  reference. ``interpret``, when given, overrides the interpret mode of the
  kernel wherever the kernel runs. Both branches are traced;
  ``jax.lax.platform_dependent`` keeps only the one for the lowering
  platform (a deviceless compile for GPUs from a CPU host included), and
  an eager call runs only the branch of the default device.
  """
  _check_implementation(implementation)
  if implementation == "xla":
    return reference(*args, **kwargs)
  if implementation in ("pallas", "mosaic"):
    if interpret is not None:
      return _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs)

    def on_gpu():
      return _kernel_or_fallback(op, kernel, reference, False, args, kwargs)

    def off_gpu():
      if implementation == "mosaic":  # Mosaic GPU's interpret mode has ordered effects,
        # which platform_dependent cannot mix with the GPU branch: interpret=True asks for it
        return reference(*args, **kwargs)
      return _kernel_or_fallback(op, kernel, reference, True, args, kwargs)

    return jax.lax.platform_dependent(**{p: on_gpu for p in GPU_PLATFORMS}, default=off_gpu)

  def gpu():
    return _gpu_path(op, kernel, reference, bool(interpret), args, kwargs)

  def other():
    return reference(*args, **kwargs)

  return jax.lax.platform_dependent(**{p: gpu for p in GPU_PLATFORMS}, default=other)
