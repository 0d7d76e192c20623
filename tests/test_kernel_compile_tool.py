"""``tools/kernel_compile_cpu.py`` compiles each kernel of the default bucket alone for an
H100 and reports its seconds: every kernel there and timed, their sums as given (not
the times themselves: those of a loaded machine)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from dynamiq_jax.bench import gpu_compile

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "kernel_compile_cpu.py"
_SPEC = importlib.util.spec_from_file_location("kernel_compile_cpu", _PATH)
tool = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tool)

KERNELS = {"guard_stats", "stats_sum_encode", "allocate", "compress",
           "decompress_accumulate_recompress", "decompress_rows"}


@pytest.mark.skipif(gpu_compile.missing(need_ptxas=False) is not None,
                    reason=str(gpu_compile.missing(need_ptxas=False)))
def test_every_kernel_is_compiled_and_timed(capsys):
  out = tool.main(["--d", str(1 << 16), "--n", "4"])
  assert '"kernels_compile_cpu_s"' in capsys.readouterr().out
  compile_s = out["compile_cpu_s"]
  assert set(compile_s) == KERNELS | {"one multiply (no kernel)"}
  assert all(compile_s[k] > 0 for k in KERNELS), compile_s
  assert out["kernels_compile_cpu_s"] == pytest.approx(sum(compile_s[k] for k in KERNELS),
                                                       abs=0.011)
  assert set(out["lower_cpu_s"]) == set(compile_s)
