"""The deviceless GPU compile of the tests: :mod:`dynamiq_jax.bench.gpu_compile`, run from here.

Everything of :mod:`dynamiq_jax.bench.gpu_compile` (the compile-only H100
topology, the child process) and :mod:`dynamiq_jax.bench.hlo` (the HLO
readers), with :func:`compile_in_child` set up for the tests: the child imports from ``tests/`` and the repository
root, runs in the root with ``-W error::DeprecationWarning``, and dumps the
PTX XLA makes.
"""

from __future__ import annotations

import pathlib

from dynamiq_jax.bench import gpu_compile
from dynamiq_jax.bench.gpu_compile import *  # noqa: F401,F403  (the tests' namespace)
from dynamiq_jax.bench.gpu_compile import __all__ as _SHARED
from dynamiq_jax.bench.hlo import *  # noqa: F401,F403
from dynamiq_jax.bench.hlo import __all__ as _HLO

__all__ = ["ROOT", *_SHARED, *_HLO]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def compile_in_child(target: str, *, kwargs: dict | None = None, xla_flags=(),
                     timeout: float = 600) -> gpu_compile.Build:
  """:func:`dynamiq_jax.bench.gpu_compile.compile_in_child` of ``target``
  (``"test_module:function"``), ``tests/`` and the repository root first on the
  child's path, with PTX and warnings as errors."""
  return gpu_compile.compile_in_child(target, kwargs=kwargs, xla_flags=xla_flags,
                                      path=(ROOT / "tests", ROOT), cwd=ROOT, ptx=True,
                                      strict_warnings=True, timeout=timeout)
