"""The four unit-packed chunk kernels compile for an H100 (sm_90a) without register spills.

Compile-only, as :mod:`test_gpu_compile` (whose machinery this reuses): a
child process describes one H100 with ``jax.experimental.topologies``,
compiles each kernel of :mod:`pallas_kernels.dynamiq_triton` alone
(``plane_bits`` 1 with the width set (2, 3, 4, 5, 6, 8), and 2 with (2, 4,
8); bf16 inputs, a chunk of 37 super-groups) with
``XLA_FLAGS=--xla_dump_to=...``, and this test runs ``ptxas -v
--gpu-name=sm_90a`` on the dumped PTX: every kernel must be there and spill
0 bytes. Run it as a script to print registers and spills per kernel:
``python tests/test_gpu_compile_units.py``.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest

import test_gpu_compile as G

KERNELS = [f"dynamiq_units_{op}_p{pb}" for pb in (1, 2)
           for op in ("compress", "decompress", "decompress_accumulate",
                      "decompress_accumulate_recompress")]


def _compile_kernels(dump: str, block: int | None) -> None:
  """Compiles each unit kernel alone for one H100 (the child)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import topologies

  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_triton as T

  if block is not None:
    T.BLOCK = block  # read when the kernels are traced, below

  topology = topologies.get_topology_desc(
      topology_name="h100", platform="cuda", target_config=G.TARGET_CONFIG.read_text(),
      topology="1x1x1")
  sharding = jax.sharding.SingleDeviceSharding(topology.devices[0])
  eps = {2: 0.23, 4: 0.18, 8: 0.10}
  keys = tuple(np.uint32(v) for v in (1, 2, 3, 4))
  s, units = 37, 150
  for pb, ws in ((1, (2, 3, 4, 5, 6, 8)), (2, (2, 4, 8))):
    geo = dict(eps=eps, plane_bits=pb, width_set=ws)
    x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=sharding)
    p = jax.ShapeDtypeStruct((R.payload_bytes(s, units, pb),), jnp.uint8, sharding=sharding)
    fns = [(lambda x, w: T.compress_pallas(x, w, units, keys=keys, strata=8, **geo),
            (x, w)),
           (lambda p, w: T.decompress_pallas(p, w, units, **geo), (p, w)),
           (lambda p, x, w: T.decompress_accumulate_pallas(p, x, w, units, **geo),
            (p, x, w)),
           (lambda p, x, w: T.decompress_accumulate_recompress_pallas(
               p, x, w, units, keys=keys, strata=8, **geo), (p, x, w))]
    for f, args in fns:
      jax.jit(f).trace(*args).lower().compile()


def _ptxas_report(ptx_files, ptxas: str) -> dict[str, dict[str, int]]:
  """{kernel: {"registers": n, "spill_bytes": stores + loads}} from ``ptxas -v``."""
  out = {}
  for path in ptx_files:
    res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(path), "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    for name, stores, loads, regs in re.findall(
        r"Function properties for (\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores,"
        r" (\d+) bytes spill loads\s*\n[^\n]*Used (\d+) registers", res.stderr):
      prev = out.get(name, {"registers": 0, "spill_bytes": 0})
      if not name.startswith("dynamiq_units_"):
        continue  # XLA's own fusions
      out[name] = {"registers": max(prev["registers"], int(regs)),
                   "spill_bytes": max(prev["spill_bytes"], int(stores) + int(loads))}
  return out


def check(block: int | None = None) -> dict:
  """Compiles the unit kernels in a child process; raises AssertionError on spills.

  Args:
    block: super-groups per kernel program (None: the kernels' own).
  """
  with tempfile.TemporaryDirectory() as dump:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(G.ROOT)] + env.get("PYTHONPATH", "").split(os.pathsep))
    env["JAX_PLATFORMS"] = "cpu"  # no driver here; the topology API uses the plugin's compiler
    args = [sys.executable, __file__, "--child", dump] + ([str(block)] if block else [])
    res = subprocess.run(args, env=env,
                         capture_output=True, text=True, cwd=G.ROOT)
    if res.returncode:
      raise AssertionError(f"the H100 compile failed:\n{res.stderr[-4000:]}")
    report = _ptxas_report(sorted(pathlib.Path(dump).glob("*.ptx")), G._ptxas())
  problems = [f"kernel {k} not found in the dumped PTX" for k in KERNELS if k not in report]
  problems += [f"kernel {k} spills {v['spill_bytes']} bytes (ptxas -v, sm_90a)"
               for k, v in report.items() if v["spill_bytes"]]
  if problems:
    raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report)}")
  return report


@pytest.mark.skipif(G._missing() is not None, reason=str(G._missing()))
def test_unit_kernels_compile_for_h100_without_spills(record_property):
  report = check()
  record_property("gpu_compile_units", json.dumps(report))  # printed by tests/conftest.py
  assert set(KERNELS) <= set(report)


@pytest.mark.skipif(G._missing() is not None, reason=str(G._missing()))
@pytest.mark.slow  # .ci/run-slow; tests/test_gpu_compile.py keeps a negative control
def test_an_oversized_block_fails_the_check():
  """Negative control: the same check fails when the kernels spill registers."""
  with pytest.raises(AssertionError, match=r"spills \d+ bytes") as err:
    check(block=G.OVERSIZED_BLOCK)
  assert "not found in the dumped PTX" not in str(err.value)


if __name__ == "__main__":
  if len(sys.argv) >= 3 and sys.argv[1] == "--child":
    _compile_kernels(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
  else:
    if G._missing():
      sys.exit(f"cannot run: {G._missing()}")
    print(json.dumps(check(), indent=1))
