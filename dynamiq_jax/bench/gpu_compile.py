"""Compile-only builds for NVIDIA H100s from a CPU host, and readers of what XLA made.

The machinery of the deviceless GPU compiles, shared by
:mod:`dynamiq_jax.bench.overlap`, ``tools/sass_count.py`` and the tests
(``tests/test_gpu_compile*.py``, through ``tests/gpu_compile_tools.py``),
the same on jax 0.10.2 and 0.12:

* **A child process.** XLA reads its flags once per process (and a test
  session's jax is pinned to 8 CPU devices), so each compile runs in a fresh
  interpreter: :func:`compile_in_child` runs ``module:function`` (or
  ``path/to/file.py:function``) there, with ``JAX_PLATFORMS=cpu`` (the CUDA
  plugin's start-up check would fail without a driver; the topology API uses
  the plugin's compiler all the same), optionally ``-W
  error::DeprecationWarning`` (what a user with warnings as errors sees), and
  returns the optimized HLO of the executables the function returns.
* **A compile-only H100 topology** (:func:`h100_devices`, :func:`h100_mesh`,
  called in the child): ``jax.experimental.topologies`` with XLA's own H100
  SXM target config, :data:`TARGET_CONFIG` (package data of
  ``dynamiq_jax.bench``).
* **The GPU a lowering is for.** jax >= 0.11 compiles a Pallas GPU kernel
  for the GPU of the abstract mesh in context, or else of the default
  device, and raises on a CPU host without one; jax 0.10.2 assumed compute
  capability 9.0 there. A program over a mesh of GPUs (:func:`h100_mesh`,
  :func:`abstract_h100_mesh`) carries its GPU; a program on no mesh is
  lowered inside :func:`gpu_target`. Neither needs the ``gpu-compile``
  extra to *lower* (only to compile).
* **The kernels' machine code, asked for by flag**: ``--xla_dump_to`` with
  ``--xla_dump_emitter_re=ptx`` (:data:`PTX_FLAGS`). XLA 0.10.2 dumped PTX
  whenever dumping was on; XLA 0.12 dumps it only when asked for this way.
  :func:`ptxas_report` runs ``ptxas -v --gpu-name=sm_90a`` on it: registers
  and spill bytes per kernel. A Mosaic GPU kernel is compiled by the CUDA
  plugin's own Mosaic GPU pipeline, which XLA's deviceless compile runs too
  (jax 0.12); its PTX is version 9.0, newer than the ``ptxas`` of the
  ``nvidia-cuda-nvcc-cu12`` wheel reads, so the pipeline's own ``ptxas -v``
  output is read instead (:data:`MOSAIC_DUMP_ENV`,
  :func:`mosaic_ptxas_report`). ``MOSAIC_GPU_DUMP_TO`` is not used: it turns
  on every dump (MLIR after each pass, layout constraint systems: about a
  minute more for the 8 x H100 step), and writes nothing into a directory
  that does not exist.

The readers of the optimized HLO these compiles make are in
:mod:`dynamiq_jax.bench.hlo`.

Run as a script it is the child of :func:`compile_in_child` (``--child``); nothing else.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

from dynamiq_jax.bench.hlo import MOSAIC, TRITON

__all__ = [
    "TARGET_CONFIG", "TRITON", "MOSAIC", "MOSAIC_DUMP_ENV", "PTX_FLAGS", "DEVICELESS_XLA_FLAGS", "H100_KIND",
    "missing", "ptxas",
    "h100", "gpu_target", "abstract_h100_mesh", "h100_topology", "h100_devices", "h100_mesh",
    "Build", "compile_in_child", "build_parser", "ptxas_report", "mosaic_ptxas_report",
    "sass_instructions",
]

TARGET_CONFIG = pathlib.Path(__file__).resolve().parent / "h100_sxm.txtpb"
"""XLA's H100 SXM GPU spec: the target of the compile-only topology."""
MOSAIC_DUMP_ENV = {"MOSAIC_GPU_DUMP_PTXAS": "1"}
"""Environment of the CUDA plugin's Mosaic GPU pipeline: it prints the ``ptxas -v`` output of
each kernel it compiles on standard output."""
PTX_FLAGS = ("--xla_dump_emitter_re=ptx",)
"""With ``--xla_dump_to``: XLA writes each module's PTX (``*.ptx``) there."""
DEVICELESS_XLA_FLAGS = ("--xla_gpu_enable_cub_radix_sort=false",)
"""For a program that sorts: XLA sizes CUB's sort scratch with the CUDA runtime, which a
host without a GPU lacks (the sort kernel is the only difference)."""
H100_KIND = "NVIDIA H100 80GB HBM3"
"""``device_kind`` of the H100 SXM that :data:`TARGET_CONFIG` describes."""


# ----------------------------------------------------------------------------
# What the checks need installed.


def ptxas() -> str | None:
  """Path of ``ptxas`` (the ``nvidia-cuda-nvcc-cu12`` wheel's, else on PATH), or None."""
  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  if spec is not None and spec.submodule_search_locations:
    for base in spec.submodule_search_locations:
      path = pathlib.Path(base, "bin", "ptxas")
      if path.exists():
        return str(path)
  return shutil.which("ptxas")


def missing(need_ptxas: bool = True) -> str | None:
  """Why a deviceless GPU compile cannot run here (None: it can).

  Args:
    need_ptxas: whether the caller also assembles PTX (:func:`ptxas_report`).
  """
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    return ("the CUDA plugin (XLA's GPU compiler) is not installed: "
            "pip install -e '.[gpu-compile]'")
  if need_ptxas and ptxas() is None:
    return "ptxas not found: pip install -e '.[gpu-compile]' (nvidia-cuda-nvcc-cu12)"
  return None


# ----------------------------------------------------------------------------
# The GPU a lowering is for.


def h100():
  """An abstract H100 (``jax.sharding.AbstractDevice``), as the topology's devices describe
  themselves."""
  import jax
  return jax.sharding.AbstractDevice(device_kind=H100_KIND, num_cores=132, platform="gpu")


def gpu_target(device=None):
  """A context in which a program on no mesh is lowered for ``device``.

  Args:
    device: a ``jax.sharding.AbstractDevice`` or a ``jax.Device`` (None: :func:`h100`).

  Returns:
    ``jax.sharding.use_abstract_mesh`` of a one-device abstract mesh (Auto axis).
  """
  import jax
  import numpy as np
  auto = (jax.sharding.AxisType.Auto,)
  device = h100() if device is None else device
  if isinstance(device, jax.sharding.AbstractDevice):
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=auto, abstract_device=device)
  else:
    mesh = jax.sharding.Mesh(np.array([device]), ("gpu",), axis_types=auto).abstract_mesh
  return jax.sharding.use_abstract_mesh(mesh)


def abstract_h100_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]):
  """A ``jax.sharding.AbstractMesh`` of H100s (Explicit axes): ``shard_map`` over it lowers
  for cuda on any host, without the ``gpu-compile`` extra."""
  import jax
  return jax.sharding.AbstractMesh(shape, axis_names,
                                   axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                                   abstract_device=h100())


# ----------------------------------------------------------------------------
# In the child: the compile-only topology.


def h100_topology(n: int):
  """A compile-only topology of ``n`` H100 SXM devices on one host
  (``jax.experimental.topologies``; ``topologies.make_mesh`` takes it)."""
  from jax.experimental import topologies
  return topologies.get_topology_desc(
      topology_name="h100", platform="cuda", target_config=TARGET_CONFIG.read_text(),
      topology=f"1x1x{n}")


def h100_devices(n: int):
  """``n`` compile-only H100 SXM devices (:func:`h100_topology`), one host."""
  return h100_topology(n).devices


def h100_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]):
  """A ``jax.sharding.Mesh`` of compile-only H100s (Explicit axes, as ``jax.make_mesh``)."""
  import math

  import jax
  import numpy as np
  devices = np.array(h100_devices(math.prod(shape))).reshape(shape)
  return jax.sharding.Mesh(devices, axis_names,
                           axis_types=(jax.sharding.AxisType.Explicit,) * len(shape))


# ----------------------------------------------------------------------------
# In the parent: run the child, collect what it compiled.


@dataclasses.dataclass
class Build:
  """What :func:`compile_in_child` brings back.

  Attributes:
    hlo: the optimized (scheduled) HLO text of each executable the child's
      function returned, in order.
    info: the JSON-able ``"info"`` the function returned beside its
      executables (``{}`` if none).
    ptx: PTX files XLA wrote (kept until ``cleanup()``; none unless ``ptx``).
    mosaic_ptxas: the child's standard output, where the Mosaic GPU pipeline prints
      the ``ptxas -v`` output of each kernel it compiles when ``ptx`` is asked for
      (none on jax 0.10.2, whose Mosaic GPU does not lower the kernels).
    seconds: wall time of the child.
    stderr: the child's standard error.
  """
  hlo: list[str]
  info: dict
  ptx: list[pathlib.Path]
  seconds: float
  stderr: str
  mosaic_ptxas: str = ""
  _tmp: tempfile.TemporaryDirectory | None = None

  def cleanup(self):
    if self._tmp is not None:
      self._tmp.cleanup()
      self._tmp = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.cleanup()


def compile_in_child(target: str, *, kwargs: dict | None = None, xla_flags=(), path=(),
                     cwd: str | os.PathLike | None = None, ptx: bool = True,
                     strict_warnings: bool = True, timeout: float = 600,
                     kernel_cache: str | os.PathLike | None = None) -> Build:
  """Runs ``target`` in a fresh process and collects its build.

  The function is imported (``path`` first on ``sys.path``), called with
  ``**kwargs`` (JSON-able), and must return a ``jax.stages.Compiled`` or a
  list of them (compiled for :func:`h100_devices`), or a dict ``{"compiled":
  those, "info": JSON-able}``. The child runs with ``JAX_PLATFORMS=cpu`` and
  ``XLA_FLAGS`` = the caller's environment's (less an
  ``--xla_backend_optimization_level``: registers and spills are those of XLA's
  default) and ``xla_flags`` (a program that sorts needs
  :data:`DEVICELESS_XLA_FLAGS` there); in it,
  ``dynamiq_jax.bench.gpu_compile`` is this module even where ``path`` puts
  another ``dynamiq_jax`` first.

  Args:
    target: ``"module:function"`` (e.g. ``"test_gpu_compile:compile_step"``) or
      ``"path/to/file.py:function"`` (the file is loaded as it is, whatever
      ``dynamiq_jax`` ``path`` selects).
    kwargs: keyword arguments for the function.
    xla_flags: more XLA flags (strings).
    path: directories put first on the child's ``sys.path`` (``PYTHONPATH``).
    cwd: the child's working directory (None: this process's).
    ptx: dump the PTX XLA makes (``--xla_dump_to`` and :data:`PTX_FLAGS`)
      into :attr:`Build.ptx`, and keep the Mosaic GPU pipeline's ``ptxas -v``
      (:data:`MOSAIC_DUMP_ENV`) in :attr:`Build.mosaic_ptxas`.
    strict_warnings: run the child with ``-W error::DeprecationWarning``.
    timeout: seconds before the child is stopped.
    kernel_cache: a file for XLA's GPU kernel cache (``--xla_gpu_kernel_cache_file``),
      read and extended by the child: a kernel compiled by an earlier build that shared
      the file is taken from it instead of being compiled again. The optimized HLO is the
      same; the child's CPU seconds are less, and such a kernel leaves no PTX, so it
      needs ``ptx=False``.

  Returns:
    A :class:`Build`; use it as a context manager (or call ``cleanup()``) to
    delete the dumped files.

  Raises:
    RuntimeError: the child failed (its standard error's end is in the message).
    ValueError: ``kernel_cache`` with ``ptx=True``.
  """
  from dynamiq_jax.bench.common import xla_flags_less  # pylint: disable=import-outside-toplevel

  if kernel_cache is not None and ptx:
    raise ValueError(f"kernel_cache={str(kernel_cache)!r} with ptx=True: a kernel taken from "
                     "the cache makes no PTX, so the PTX dump would miss it; pass ptx=False "
                     "(or no kernel_cache)")
  start = time.perf_counter()
  tmp = tempfile.TemporaryDirectory()
  out = pathlib.Path(tmp.name)
  dump = out / "xla"
  env = dict(os.environ)
  # the caller's optimisation level stays with the caller: the build is a user's job's
  flags = xla_flags_less(env, "--xla_backend_optimization_level") + list(xla_flags)
  if kernel_cache is not None:
    flags.append(f"--xla_gpu_kernel_cache_file={os.fspath(kernel_cache)}")
  if ptx:
    flags += [f"--xla_dump_to={dump}", *PTX_FLAGS]
    env.update(MOSAIC_DUMP_ENV)
  env["XLA_FLAGS"] = " ".join(f for f in flags if f)
  env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] +
                                      [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env["JAX_PLATFORMS"] = "cpu"
  args = [sys.executable, *(["-W", "error::DeprecationWarning"] if strict_warnings else []),
          __file__, "--child", str(out), target, json.dumps(kwargs or {})]
  res = subprocess.run(args, env=env, capture_output=True, text=True, cwd=cwd, timeout=timeout)
  if res.returncode:
    tmp.cleanup()
    raise RuntimeError(f"the compile-only build {target} failed:\n{res.stderr[-4000:]}")
  hlo = [p.read_text() for p in sorted(out.glob("compiled_*.hlo"),
                                       key=lambda p: int(p.stem.split("_")[1]))]
  return Build(hlo=hlo, info=json.loads((out / "info.json").read_text()),
               ptx=sorted(dump.glob("*.ptx")), seconds=round(time.perf_counter() - start, 1),
               stderr=res.stderr, mosaic_ptxas=res.stdout if ptx else "", _tmp=tmp)


def _load(target: str):
  """The function ``target`` names (``module:function`` or ``file.py:function``)."""
  module, function = target.rsplit(":", 1)
  if module.endswith(".py"):
    name = f"_gpu_compile_target_{pathlib.Path(module).stem}"
    spec = importlib.util.spec_from_file_location(name, module)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
  else:
    loaded = importlib.import_module(module)
  return getattr(loaded, function)


def _child(out: str, target: str, kwargs: str) -> None:
  result = _load(target)(**json.loads(kwargs))
  compiled, info = ((result["compiled"], result.get("info", {})) if isinstance(result, dict)
                    else (result, {}))
  for i, c in enumerate(compiled if isinstance(compiled, (list, tuple)) else [compiled]):
    pathlib.Path(out, f"compiled_{i}.hlo").write_text(c.as_text())
  pathlib.Path(out, "info.json").write_text(json.dumps(info))


# ----------------------------------------------------------------------------
# ptxas.


SM90_INSTRUCTION_BYTES = 16
_OP_NOP, _OP_BRA = 0x918, 0x947  # opcode field (bits 0-11) of the Volta-and-later encoding


def sass_instructions(cubin) -> dict[str, int]:
  """``{kernel: static SASS instructions}`` of an sm_90 cubin, read from its
  ``.text.<kernel>`` sections with pyelftools (the ``gpu-compile`` extra): every
  instruction is 16 bytes; the trailing padding (the ``BRA`` to itself after the last
  ``EXIT`` and the ``NOP`` s that align the section) is not counted. It is recognised by
  the opcode field, so no disassembler is needed."""
  from elftools.elf.elffile import ELFFile

  out = {}
  with open(cubin, "rb") as fh:
    for sec in ELFFile(fh).iter_sections():
      if not sec.name.startswith(".text."):
        continue
      data = sec.data()
      words = [int.from_bytes(data[i:i + SM90_INSTRUCTION_BYTES], "little")
               for i in range(0, len(data), SM90_INSTRUCTION_BYTES)]
      n = len(words)
      while n and words[n - 1] & 0xFFF == _OP_NOP:
        n -= 1
      if n and words[n - 1] & 0xFFF == _OP_BRA:
        n -= 1
      out[sec.name[len(".text."):]] = n
  return out


def ptxas_report(ptx_files, prefix: str = "", instructions: bool = False
                 ) -> dict[str, dict[str, int]]:
  """``{kernel: {"registers": n, "spill_bytes": stores + loads}}`` from ``ptxas -v``,
  and with ``instructions`` each kernel's static SASS instructions
  (:func:`sass_instructions` of the cubin ptxas makes) as ``"instructions"``.

  Every ``.entry`` of every file is compiled for sm_90a; a kernel name seen
  in several files (other shapes) keeps its largest figures.

  Args:
    ptx_files: paths of PTX files.
    prefix: keep only kernels whose name starts with it.
    instructions: also count each kernel's instructions (pyelftools, the
      ``gpu-compile`` extra).
  """
  out = {}
  with tempfile.TemporaryDirectory(prefix="dynamiq_ptxas_") as tmp:
    for i, path in enumerate(ptx_files):
      cubin = pathlib.Path(tmp) / f"{i}.cubin" if instructions else os.devnull
      res = subprocess.run([ptxas(), "-v", "--gpu-name=sm_90a", str(path), "-o", str(cubin)],
                           capture_output=True, text=True, check=True)
      found = {}
      _read_ptxas(res.stderr, found, prefix)
      counts = sass_instructions(cubin) if instructions else {}
      for name, rep in found.items():
        if instructions:
          rep["instructions"] = counts.get(name, 0)
        prev = out.get(name, dict.fromkeys(rep, 0))
        out[name] = {k: max(prev[k], v) for k, v in rep.items()}
  return out


def mosaic_ptxas_report(text: str) -> dict[str, dict[str, int]]:
  """``{kernel: {"registers": n, "spill_bytes": stores + loads}}`` from the Mosaic GPU
  pipeline's own ``ptxas -v`` output (:attr:`Build.mosaic_ptxas`), by kernel name (the
  ``kernel_name`` given to ``plgpu.kernel``; the PTX entry adds ``_mosaic_gpu_kernel``);
  a kernel compiled in several shapes keeps its largest figures."""
  out = {}
  _read_ptxas(text, out, "", strip="_mosaic_gpu_kernel")
  return out


def _read_ptxas(text: str, out: dict, prefix: str, strip: str = "") -> None:
  for name, stores, loads, regs in re.findall(
      r"Function properties for (\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores,"
      r" (\d+) bytes spill loads\s*\n[^\n]*Used (\d+) registers", text):
    if not name.startswith(prefix):
      continue
    if strip and name.endswith(strip):
      name = name[:-len(strip)]
    prev = out.get(name, {"registers": 0, "spill_bytes": 0})
    out[name] = {"registers": max(prev["registers"], int(regs)),
                 "spill_bytes": max(prev["spill_bytes"], int(stores) + int(loads))}


def build_parser() -> argparse.ArgumentParser:
  """The child's command line (internal: :func:`compile_in_child` writes it)."""
  p = argparse.ArgumentParser(
      prog="python dynamiq_jax/bench/gpu_compile.py",
      description="The child process of gpu_compile.compile_in_child (internal): calls the "
                  "target and writes the optimized HLO of what it compiled into OUT_DIR.",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--child", nargs=3, required=True, metavar=("OUT_DIR", "TARGET", "KWARGS"),
                 help="the output directory, module:function or file.py:function, and its "
                      "keyword arguments as a JSON object")
  return p


if __name__ == "__main__":
  child_args = build_parser().parse_args().child
  # Run as a file, this directory is first on sys.path: its modules (common, net, ...)
  # must not shadow others. And the target's `dynamiq_jax.bench.gpu_compile` is this
  # module, not a second copy (nor an older checkout's, where --library selects one).
  if sys.path and pathlib.Path(sys.path[0]).resolve() == pathlib.Path(__file__).resolve().parent:
    del sys.path[0]
  sys.modules.setdefault("dynamiq_jax.bench.gpu_compile", sys.modules[__name__])
  _child(*child_args)
