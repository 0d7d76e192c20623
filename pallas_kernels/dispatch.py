"""Dispatch of the Pallas kernels: by the platform being lowered for, with a fallback.

Every kernel of this package is called through :func:`dispatch`, which
knows no kernel: it gets an operation's GPU kernels (:class:`Kernels`: the
Triton kernel, and the Mosaic GPU kernel where one exists, each with an
``interpret=`` argument) and its pure-jnp reference, and chooses among them
by the platform being *lowered for*, not the host's backend
(``jax.lax.platform_dependent``):

* ``implementation=None``: in a lowering for ``cuda``, the Triton kernel
  where this jax has the backend and the kernel compiles
  (:func:`_kernel_compiles`), else the Mosaic GPU kernel where it lowers for
  the target GPU (:func:`_mosaic_lowers`), else the XLA reference: Triton
  first because it is the faster, measured on an H100
  (:data:`MOSAIC_FIRST`, which puts Mosaic GPU first, is off). In a lowering
  for ``rocm``, the Triton kernel, else the reference; on every other
  platform the reference (on CPU without interpret mode).
* ``"pallas"`` forces the Triton kernel (``interpret=True`` off GPU, which
  is how CPU tests run it); ``"xla"`` forces the reference. ``"mosaic"``
  forces the Mosaic GPU kernel in a GPU lowering; off GPU it is the
  reference unless ``interpret=True`` asks for Mosaic GPU's interpret mode.
  A forced path is never probed.
* A kernel raises ``NotImplementedError`` for input it does not support
  (``plane_bits=2`` for the Mosaic GPU kernels), and dispatch falls back to
  the next backend under ``None`` (the reference last), logging the reason
  once.
* **The Mosaic GPU probe** (``None``, ``cuda``). Without an NVIDIA GPU to
  lower for (none in the abstract mesh in context, none on this process:
  every program traces the ``cuda`` branch, a CPU one too) Mosaic GPU is
  not used and nothing is probed. A target GPU older than
  Hopper (compute capability under 9.0, when jax can tell) does not get
  Mosaic GPU, by design, with a log line. Otherwise a small instance of the same kernel
  configuration (:attr:`Kernels.mosaic_probe`) is lowered by itself for the
  target GPU, once per (operation, configuration, GPU kind, jax version): on
  a process whose GPU is the target, lowered and compiled; else (a
  deviceless or AOT lowering) lowered for ``cuda`` in the caller's context.
  Mosaic GPU refuses some kernels at lowering, not at trace (jax 0.10.2:
  copies under 128 bytes), which is why the probe lowers. If it fails, one
  :class:`KernelFallbackWarning` names the kernel, the GPU, the jax version,
  the error and the ways to force a path, and the next backend follows.
* **The Triton probe** (``None``, a process with a GPU): the Triton kernel is
  compiled alone first (once per kernel, static arguments and operand
  types); if that fails (a new jax, a new GPU) one
  :class:`KernelFallbackWarning` names it, and the program uses the next
  backend (for ``cuda`` the Mosaic GPU kernel where it lowers, else the
  reference): the same bits.

jax >= 0.11 deprecates the Triton backend and warns at every Triton
lowering; the Triton kernels' entry points filter that DeprecationWarning,
and only it (:mod:`pallas_kernels.dynamiq_triton`), so nothing here does. jax >= 0.11 also compiles a Pallas GPU kernel for the
GPU of the abstract mesh in context, so the compile probe steps aside when
the program is lowered for a GPU of another kind than the local one
(:func:`_targets_another_gpu`).

Also here, for every kernel wrapper: :func:`typed_like` (a ``pallas_call``'s
output type inside ``shard_map(check_vma=True)``) and :func:`map_over_batch`
(``vmap`` as a map over the batch).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import warnings
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GPU_PLATFORMS",
    "Implementation",
    "KernelFallbackWarning",
    "Kernels",
    "mesh_platform",
    "MIN_MOSAIC_CAPABILITY",
    "MOSAIC_FIRST",
    "dispatch",
    "target_gpu",
    "traced_once",
    "triton_backend",
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

    out = jax.lax.map(one, batched)
    return out, jax.tree.map(lambda _: True, out)

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
  """A kernel did not compile on this GPU (the XLA reference runs instead), or a Mosaic GPU
  kernel did not lower for it (Triton's path runs instead)."""


_probed: dict = {}  # (op, static args, operand types, GPU) -> error text, or None if it compiled
_mosaic_probed: dict = {}  # (op, static args, operand types, GPU, jax) -> why not, or None

MIN_MOSAIC_CAPABILITY = 90
"""Compute capability (x 10) the Mosaic GPU kernels need: TMA copies and the WGMMA
register layout (Hopper)."""

MOSAIC_FIRST = False
"""Whether ``implementation=None`` tries the Mosaic GPU kernels before Triton's in a
``cuda`` lowering. Off: Triton first, Mosaic GPU where Triton's kernel is not there
or does not compile (:func:`_gpu_path`), the reference last. Off because Triton's
kernels are the faster ones, measured: on an H100 (jax 0.11.2,
``python -m dynamiq_jax.bench.kernels --gpu``; docs/results.md, "Kernels on a GPU") the
Mosaic GPU kernels took 7 to 39 times as long as Triton's (1.5 times for the smallest
decompress), and on an H200 (jax 0.11.2, the same section) 12 to 22 times at 2^24
coordinates; and in the deviceless 8 x H100 step they place fewer backward GEMMs inside
collective windows than ``pmean`` (``tools/mosaic_overlap.py``). Tests turn it on to
check the mechanism."""


class Kernels(NamedTuple):
  """One operation's GPU kernels, each called as ``kernel(*args, **kwargs, interpret=...)``.

  Attributes:
    triton: the Pallas Triton kernel.
    mosaic: the Pallas Mosaic GPU kernel (None: the operation has none).
    mosaic_probe: ``() -> (args, kwargs)``: a small instance of the call's
      configuration (the same static arguments and dtypes, arrays as
      ``jax.ShapeDtypeStruct``), which :func:`_mosaic_lowers` lowers alone.
  """

  triton: Callable
  mosaic: Callable | None = None
  mosaic_probe: Callable | None = None


def _check_implementation(implementation: Implementation):
  if implementation not in (None, "pallas", "mosaic", "xla"):
    raise ValueError(f"implementation={implementation!r} must be None, 'pallas' (Triton), "
                     "'mosaic' (Mosaic GPU) or 'xla'")


def _fallback(op: str, err: NotImplementedError, instead: str = "the XLA reference"):
  key = (op, str(err), instead)
  if key not in _warned:
    _warned.add(key)
    _log.warning("dynamiq_jax: Pallas %s does not support %s; using %s.", op, err, instead)


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


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def _split(args, kwargs):
  """(operands, rebuild): the arrays among a call's arguments, and ``rebuild(operands)``.

  Everything else (the format, ``strata``, Python scalars) stays as given.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, v in enumerate(leaves) if isinstance(v, _ARRAYS)]

  def rebuild(operands):
    full = list(leaves)
    for i, v in zip(where, operands):
      full[i] = v
    return jax.tree.unflatten(tree, full)

  return [leaves[i] for i in where], rebuild


@functools.lru_cache(maxsize=1024)
def _jitted(fn, tree, static: tuple, where: tuple):
  def call(*operands):
    leaves = [v for _, v in static]
    for i, v in zip(where, operands):
      leaves[i] = v
    args, kwargs = jax.tree.unflatten(tree, leaves)
    return fn(*args, **kwargs)

  return jax.jit(call)


def traced_once(fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` as a call of a jitted function of the array arguments, the
  others static: jax traces and lowers it once for every call with the same static
  arguments and operand types (a bucket's hops, every bucket of one shape), and XLA
  inlines it as if called directly. For a pure function of its arguments only (the
  references): what it traces must not depend on anything else. Falls back to a plain
  call where a static argument is not hashable."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = tuple(i for i, v in enumerate(leaves) if isinstance(v, _ARRAYS))
  static = tuple((type(v), None if i in where else v) for i, v in enumerate(leaves))
  try:
    hash(static)
  except TypeError:
    return fn(*args, **kwargs)
  return _jitted(fn, tree, static, where)(*[leaves[i] for i in where])


def _alone(kernel, args, kwargs, device=None):
  """``(jitted, structs)``: ``kernel(*args, **kwargs, interpret=False)`` by itself, as a
  jitted function of the call's operands, and those operands as ``jax.ShapeDtypeStruct``
  (placed on ``device`` when given)."""
  operands, rebuild = _split(args, kwargs)
  sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
  structs = [jax.ShapeDtypeStruct(np.shape(v), _dtype(v), sharding=sharding) for v in operands]

  def alone(*operands):
    a, kw = rebuild(operands)
    return kernel(*a, **kw, interpret=False)

  return jax.jit(alone), structs


def _signature(args, kwargs) -> tuple:
  """``(static, types)`` of a call, which key a probe's result: the non-array arguments
  (their repr: the format, strata, ...) and the operands' dtypes and shapes."""
  operands, _ = _split(args, kwargs)
  static = tuple(repr(v) for v in jax.tree.leaves((args, kwargs)) if not isinstance(v, _ARRAYS))
  return static, _types(operands)


def _compile_alone(kernel, device, args, kwargs):
  """Compiles ``kernel(*args, **kwargs)`` by itself for ``device``; raises what XLA raises."""
  jitted, structs = _alone(kernel, args, kwargs, device)
  with warnings.catch_warnings():
    jitted.lower(*structs).compile()


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
  static, types = _signature(args, kwargs)
  key = (op, static, types, gpus[0].device_kind)
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
          "Using the next backend instead (in a cuda lowering the Mosaic GPU kernel where "
          "it lowers, else the XLA reference): the same results. "
          "implementation='xla' chooses the reference without this check; "
          "implementation='pallas' uses the kernel regardless (and raises its error).",
          KernelFallbackWarning, stacklevel=2)
  return _probed[key] is None


def _dtype(v):
  return v.dtype if isinstance(v, jax.ShapeDtypeStruct) else jnp.result_type(v)


def _types(operands) -> tuple:
  return tuple(f"{_dtype(v)}{list(np.shape(v))}" for v in operands)


def target_gpu():
  """``(device_kind, compute capability x 10 or None)`` of the GPU a lowering is for:
  the abstract mesh's GPU in context, else this process's first GPU; ``(None, None)``
  when neither says (jax 0.10.2 lowering for ``cuda`` on a CPU host)."""
  target = jax.sharding.get_abstract_mesh().abstract_device
  if target is not None and target.platform in ("gpu", *GPU_PLATFORMS):
    kind = target.device_kind
  else:
    gpus = _local_gpus()
    kind = gpus[0].device_kind if gpus else None
  return kind, _capability(kind)


def _capability(kind) -> int | None:
  """Compute capability x 10 of the GPU ``kind`` (a local GPU's own, else jax's table of
  known kinds), or None where neither knows it (jax 0.10.2 has no such table)."""
  if kind is None:
    return None
  for gpu in _local_gpus():
    cc = getattr(gpu, "compute_capability", None)
    if gpu.device_kind == kind and isinstance(cc, str) and cc.replace(".", "").isdigit():
      return int(cc.replace(".", ""))
  try:  # jax >= 0.11: the table Pallas itself reads for a GPU of the abstract mesh
    from jax._src.pallas.triton import gpu_info  # pylint: disable=import-outside-toplevel
    version = gpu_info.gpu_version_from_device_kind(kind)
    return None if version is None else gpu_info.get_gpu_info_from_version(version) \
        .compute_capability
  except (ImportError, AttributeError, ValueError):
    return None


def _first_line(err: BaseException) -> str:
  text = str(err).strip().splitlines()
  return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def _mosaic_lowers(op, kernels: Kernels) -> bool:
  """Whether ``op``'s Mosaic GPU kernel is used for the GPU being lowered for.

  False without a Mosaic GPU kernel; without an
  NVIDIA GPU in context (the
  abstract mesh's) or on this process (the branch is traced for programs of
  every platform: a CPU program must not lower a GPU kernel); and for a GPU
  older than Hopper (:data:`MIN_MOSAIC_CAPABILITY`; logged once). Else the small instance
  :attr:`Kernels.mosaic_probe` is traced, then lowered by itself, once per
  (op, static arguments, operand types, GPU kind, jax version): compiled too
  when this process's GPU is the target. ``NotImplementedError`` at trace
  (input the kernel does not support) is logged; any failure after it (jax
  0.10.2 refuses these kernels at lowering) warns once
  (:class:`KernelFallbackWarning`). Either way the next backend follows.
  """
  if kernels.mosaic is None or kernels.mosaic_probe is None:
    return False
  kind, capability = target_gpu()
  if kind is None or kind.startswith("gfx"):
    # No NVIDIA GPU in context or on this process: ``platform_dependent`` traces this
    # branch for every program (one for the CPU or ROCm too), so there is nothing to probe
    # for; Triton, as before (a deviceless lowering for cuda names its GPU, gpu_target).
    return False
  if capability is not None and capability < MIN_MOSAIC_CAPABILITY:
    _fallback(f"{op} (Mosaic GPU)", NotImplementedError(
        f"{kind} (compute capability {capability / 10:.1f}; the kernels need "
        f"{MIN_MOSAIC_CAPABILITY / 10:.1f})"), "the next backend")
    return False
  args, kwargs = kernels.mosaic_probe()
  key = (op, *_signature(args, kwargs), kind, jax.__version__)
  if key in _mosaic_probed:
    return _mosaic_probed[key] is None
  gpus = _local_gpus()
  local = gpus[0] if gpus and gpus[0].device_kind == kind else None
  jitted, structs = _alone(kernels.mosaic, args, kwargs, local)

  with warnings.catch_warnings():
    try:
      traced = jitted.trace(*structs)
    except NotImplementedError as err:
      _mosaic_probed[key] = _first_line(err)
      _fallback(f"{op} (Mosaic GPU)", err, "the next backend")
      return False
    try:
      lowered = traced.lower(lowering_platforms=("cuda",))
      if local is not None:
        lowered.compile()
      _mosaic_probed[key] = None
    except Exception as err:  # noqa: BLE001 - whatever Mosaic GPU raised, do not use it
      _mosaic_probed[key] = _first_line(err)
  if _mosaic_probed[key] is not None:
    warnings.warn(
        f"dynamiq_jax: the Mosaic GPU kernel {op!r} does not "
        f"{'compile' if local is not None else 'lower'} for {kind or 'cuda'} "
        f"(jax {jax.__version__}): {_mosaic_probed[key]}\n"
        "Using the next backend instead (Triton's kernel where it compiles, else the XLA "
        "reference): the same results. implementation='pallas' chooses Triton and "
        "implementation='xla' the reference without this check; implementation='mosaic' "
        "uses Mosaic GPU regardless (and raises its error).", KernelFallbackWarning,
        stacklevel=3)
  return _mosaic_probed[key] is None


def _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs):
  try:
    return kernel(*args, **kwargs, interpret=interpret)
  except NotImplementedError as err:
    _fallback(op, err)
    return reference(*args, **kwargs)


def triton_backend() -> bool:
  """Whether this jax has the Pallas Triton backend (deprecated in jax 0.11; the day it
  is removed, ``implementation=None`` goes on with Mosaic GPU, then the reference)."""
  return importlib.util.find_spec("jax.experimental.pallas.triton") is not None


def _triton_usable(op, kernel, interpret, args, kwargs) -> bool:
  """Whether Triton's kernel is there and compiles for this process's GPU
  (:func:`_kernel_compiles`; interpret mode needs no GPU)."""
  if kernel is None or not triton_backend():
    return False
  return bool(interpret) or _kernel_compiles(op, kernel, args, kwargs)


def _gpu_path(op, kernels: Kernels, reference, interpret, args, kwargs):
  """The program for a GPU lowering under ``implementation=None``: Triton's kernel
  where it is usable (:func:`_triton_usable`), else the Mosaic GPU kernel where it lowers
  (:func:`_mosaic_lowers`), else the reference; Mosaic GPU first while
  :data:`MOSAIC_FIRST` is on. Never Mosaic GPU in interpret mode, whose ordered effects
  ``platform_dependent`` cannot mix with the GPU branch."""

  def mosaic():
    if interpret or not _mosaic_lowers(op, kernels):
      return None
    try:
      return kernels.mosaic(*args, **kwargs, interpret=False)
    except NotImplementedError as err:
      _fallback(f"{op} (Mosaic GPU)", err, "the next backend")
      return None

  if MOSAIC_FIRST and (out := mosaic()) is not None:
    return out
  if _triton_usable(op, kernels.triton, interpret, args, kwargs):
    try:
      return kernels.triton(*args, **kwargs, interpret=interpret)
    except NotImplementedError as err:
      _fallback(op, err, "the next backend")
  if not MOSAIC_FIRST and (out := mosaic()) is not None:
    return out
  return reference(*args, **kwargs)


def dispatch(op, kernels, reference, implementation, interpret, *args, **kwargs):
  """Runs ``op`` (its name, for messages) by the platform being lowered for, not the
  host's backend: one of ``kernels`` (:class:`Kernels`) as
  ``kernel(*args, **kwargs, interpret=...)``, or ``reference(*args, **kwargs)``.

  ``implementation=None``: in a lowering for ``cuda`` the Triton kernel (unless
  this jax lacks the backend or the kernel fails to compile on this process's
  GPU, see :func:`_kernel_compiles`), else the Mosaic GPU kernel where it lowers
  for the target GPU (:func:`_mosaic_lowers`), else the reference (Mosaic GPU
  before Triton while :data:`MOSAIC_FIRST` is on); for ``rocm`` Triton's path;
  the reference for every other platform. ``"pallas"``: the Triton kernel
  everywhere, interpreted off GPU. ``"mosaic"``: the Mosaic GPU kernel on GPU
  (the reference off GPU unless ``interpret=True``). ``"xla"``: the
  reference. ``interpret``, when given, overrides the interpret mode of the
  kernel wherever the kernel runs. Inside a mesh (:func:`mesh_platform`) only
  its platform's branches are traced; elsewhere every branch is, and
  ``jax.lax.platform_dependent`` keeps only the one for the lowering
  platform (a deviceless compile for GPUs from a CPU host included), and
  an eager call runs only the branch of the default device.
  """
  _check_implementation(implementation)
  if implementation == "xla":
    return reference(*args, **kwargs)
  if implementation in ("pallas", "mosaic"):
    kernel = kernels.mosaic if implementation == "mosaic" else kernels.triton
    if implementation == "pallas" and not triton_backend():
      raise ValueError(f"implementation='pallas': jax {jax.__version__} has no Pallas Triton "
                       "backend; use None (Mosaic GPU where it lowers, else the reference), "
                       "'mosaic' or 'xla'")
    if kernel is None:
      raise ValueError(f"implementation='mosaic': {op!r} has no Mosaic GPU kernel; use "
                       "None, 'pallas' (Triton) or 'xla'")
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

  def cuda():
    return _gpu_path(op, kernels, reference, bool(interpret), args, kwargs)

  def rocm():  # Triton's kernel, else the reference: no Mosaic GPU on AMD GPUs
    return _gpu_path(op, kernels._replace(mosaic=None), reference, bool(interpret), args,
                     kwargs)

  def other():  # traced once per configuration and operand types (:func:`traced_once`)
    return traced_once(reference, *args, **kwargs)

  # Inside a mesh whose devices name the platform (a shard_map, a compile-only topology's
  # mesh), only that platform's branches are traced: tracing the others (the kernels on a
  # CPU mesh, the reference on a GPU one) was half of a bucket program's trace time.
  platform = mesh_platform()
  if platform in ("gpu", *GPU_PLATFORMS):
    return jax.lax.platform_dependent(cuda=cuda, rocm=rocm)
  if platform is not None:
    return other()
  return jax.lax.platform_dependent(cuda=cuda, rocm=rocm, default=other)


def mesh_platform() -> str | None:
  """The device platform of the abstract mesh in context (``"gpu"``, ``"cpu"``, ...: a
  ``shard_map``'s, or a compile-only topology's mesh), or None outside any mesh (``vmap``,
  ``pmap``, a plain ``jit``), where :func:`dispatch` traces every platform's branch."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return None if device is None else device.platform
