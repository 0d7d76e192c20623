"""The four unit-packed chunk kernels compile for an H100 (sm_90a) without register spills.

Compile-only, as :mod:`test_gpu_compile`, with the same machinery
(:mod:`gpu_compile_tools`): a child process takes one compile-only H100 of
``jax.experimental.topologies``, compiles each kernel of
:mod:`pallas_kernels.dynamiq_triton` alone for it (``plane_bits`` 1
with the width set (2, 3, 4, 5, 6, 8), and 2 with (2, 4, 8); bf16 inputs, a
chunk of 37 super-groups) inside :func:`gpu_compile_tools.gpu_target` (a
program on no mesh; jax >= 0.11 reads the GPU from the abstract mesh),
asking XLA for the PTX, and this test runs ``ptxas -v --gpu-name=sm_90a``
on it: every kernel must be there and spill 0 bytes. Run it as a script to
print registers and spills per kernel: ``python tests/test_gpu_compile_units.py``.
"""

from __future__ import annotations

import json
import sys

import pytest

from dynamiq_jax.codecs.dynamiq import DEFAULT_EPS

import gpu_compile_tools as T
import test_gpu_compile as G

KERNELS = [f"dynamiq_units_{op}_p{pb}" for pb in (1, 2)
           for op in ("compress", "decompress", "decompress_accumulate",
                      "decompress_accumulate_recompress")]


MEE = dict(DEFAULT_EPS)  # level_set="mee" with the codec's default eps


def compile_kernels(block: int | None = None, levels="lattice", supergroups: int = 37,
                    plane_bits=(1, 2)):
  """Each unit kernel compiled alone for one H100 (runs in the child), with the lattice
  levels (the default) or ``levels`` (MEE eps: ``{width: eps}`` with str keys, JSON), for
  a chunk of ``supergroups`` (odd: a group pair's plane words are two 16-bit accesses;
  even: one 32-bit access)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_triton as K

  if block is not None:
    K.BLOCK = block  # read when the kernels are traced, below

  [device] = T.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  keys = tuple(np.uint32(v) for v in (1, 2, 3, 4))
  s, units = supergroups, 150
  out = []
  eps = levels if isinstance(levels, str) else {int(w): e for w, e in levels.items()}
  for pb, ws in ((1, (2, 3, 4, 5, 6, 8)), (2, (2, 4, 8))):
    if pb not in plane_bits:
      continue
    geo = dict(eps=eps, plane_bits=pb, width_set=ws)
    x = jax.ShapeDtypeStruct((s, 256), jnp.bfloat16, sharding=sharding)
    w = jax.ShapeDtypeStruct((s,), jnp.int32, sharding=sharding)
    p = jax.ShapeDtypeStruct((R.payload_bytes(s, units, pb),), jnp.uint8, sharding=sharding)
    fns = [(lambda x, w: K.compress_pallas(x, w, units, keys=keys, strata=8, **geo),
            (x, w)),
           (lambda p, w: K.decompress_pallas(p, w, units, **geo), (p, w)),
           (lambda p, x, w: K.decompress_accumulate_pallas(p, x, w, units, **geo),
            (p, x, w)),
           (lambda p, x, w: K.decompress_accumulate_recompress_pallas(
               p, x, w, units, keys=keys, strata=8, **geo), (p, x, w))]
    for f, args in fns:
      with T.gpu_target(device):
        out.append(jax.jit(f).trace(*args).lower().compile())
  return out


def check(block: int | None = None, levels="lattice", supergroups: int = 37,
          plane_bits=(1, 2)) -> dict:
  """Compiles the unit kernels in a child process -> ``{kernel: {"registers",
  "spill_bytes", "instructions"}}`` (static SASS, sm_90a); raises AssertionError on spills.

  Args:
    block: super-groups per kernel program (None: the kernels' own).
    levels: ``"lattice"`` or MEE's ``{width: eps}``.
    supergroups: the chunk's size.
    plane_bits: the layouts compiled.
  """
  with T.compile_in_child("test_gpu_compile_units:compile_kernels",
                          kwargs={"block": block, "levels": levels, "supergroups": supergroups,
                                  "plane_bits": list(plane_bits)}) as build:
    report = T.ptxas_report(build.ptx, prefix="dynamiq_units_", instructions=True)
  problems = [f"kernel {k} not found in the PTX XLA wrote" for k in KERNELS
              if k not in report and int(k[-1]) in plane_bits]
  problems += [f"kernel {k} spills {v['spill_bytes']} bytes (ptxas -v, sm_90a)"
               for k, v in report.items() if v["spill_bytes"]]
  if problems:
    raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report)}")
  return report


@pytest.fixture(scope="module")
def units_report():
  return check()


@pytest.fixture(scope="module")
def units_report_mee():
  return check(levels=MEE)


@pytest.fixture(scope="module")
def units_report_even():
  return check(supergroups=36, plane_bits=(1,))


@G.needs_compiler
def test_unit_kernels_compile_for_h100_without_spills(units_report, record_property):
  record_property("gpu_compile_units", json.dumps(units_report))  # printed by tests/conftest.py
  assert set(KERNELS) <= set(units_report)


SASS_PER_COORDINATE = {
    "dynamiq_units_compress_p1": 27.5,
    "dynamiq_units_decompress_accumulate_recompress_p1": 37.0,
    "dynamiq_units_decompress_p1": 12.5,
    "dynamiq_units_decompress_accumulate_p1": 14.0,
}
"""The most static SASS instructions per coordinate each kernel of the default codec
(lattice levels, plane_bits 1, widths 2-8) may take at the kernels' default launch on
an H100: today's counts, the larger of the two jax versions CI runs, rounded up
(``python tools/sass_count.py``; jax 0.10.2: 26.0, 35.4, 11.5, 12.7; jax 0.12: 26.9,
36.6, 12.0, 13.5), so that they cannot grow back unnoticed (the ring hop's bound is
also its budget: 37). The kernels are
straight-line code, so each thread issues every static instruction once for its
``BLOCK * 256 / (32 * NUM_WARPS)`` coordinates."""

SASS_PER_COORDINATE_MEE = dict(SASS_PER_COORDINATE, **{
    "dynamiq_units_compress_p1": 52.5,
    "dynamiq_units_decompress_accumulate_recompress_p1": 63.0})
"""The same with ``level_set="mee"`` (jax 0.10.2: 52.2, 62.6; jax 0.12: 51.6, 62.7; the
decodes are the lattice's)."""

SASS_PER_COORDINATE_EVEN = {
    "dynamiq_units_compress_p1": 26.0,
    "dynamiq_units_decompress_accumulate_recompress_p1": 34.5,
    "dynamiq_units_decompress_p1": 10.95,
    "dynamiq_units_decompress_accumulate_p1": 13.0,
}
"""The same at an even chunk size (36 super-groups), where a group pair's plane words are
one 32-bit access, as in a step's large buckets (``python tools/sass_count.py
--supergroups 36``; jax 0.10.2: 24.9, 33.6, 10.4, 11.7; jax 0.12: 25.5, 34.3, 10.9,
12.5; with two 16-bit accesses instead, jax 0.10.2: 25.1, 34.9, 11.0, 12.2): if Triton
lost the alignment it proves, the pairs would be split over two threads and these would
grow."""


def _over_budget(report, budget):
  from pallas_kernels import dynamiq_triton as K

  per_thread = K.BLOCK * 256 // (32 * K.NUM_WARPS)  # coordinates (no TUNED entry: H100)
  per = {k: report[k]["instructions"] / per_thread for k in budget}
  return {k: round(v, 2) for k, v in per.items() if not 0 < v <= budget[k]}


@G.needs_compiler
def test_unit_kernels_stay_within_their_instruction_budget(units_report):
  over = _over_budget(units_report, SASS_PER_COORDINATE)
  assert not over, f"static SASS per coordinate over the budget {SASS_PER_COORDINATE}: {over}"


@G.needs_compiler
def test_mee_kernels_stay_within_their_instruction_budget(units_report_mee):
  over = _over_budget(units_report_mee, SASS_PER_COORDINATE_MEE)
  assert not over, f"MEE kernels over the budget {SASS_PER_COORDINATE_MEE}: {over}"


@G.needs_compiler
def test_paired_accesses_stay_within_their_instruction_budget(units_report_even):
  over = _over_budget(units_report_even, SASS_PER_COORDINATE_EVEN)
  assert not over, f"even-chunk kernels over the budget {SASS_PER_COORDINATE_EVEN}: {over}"


@G.needs_compiler
@pytest.mark.slow  # .ci/run-slow; tests/test_gpu_compile.py keeps a negative control
def test_an_oversized_block_fails_the_check():
  """Negative control: the same check fails when the kernels spill registers."""
  with pytest.raises(AssertionError, match=r"spills \d+ bytes") as err:
    check(block=G.OVERSIZED_BLOCK)
  assert "not found in the PTX" not in str(err.value)


if __name__ == "__main__":
  if T.missing():
    sys.exit(f"cannot run: {T.missing()}")
  print(json.dumps(check(), indent=1))
