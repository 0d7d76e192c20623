"""The README's default training step compiles for 8 x H100, with the fused kernels in it.

Compile-only: no GPU is needed. A child process (:mod:`gpu_compile_tools`)
describes an 8 x H100 host with ``jax.experimental.topologies``, builds the
README's step (``optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))``,
its gradients taken in ``jax.shard_map(check_vma=True)`` as
``dq.data_parallel_step`` does) over that topology's mesh, and compiles it,
asking XLA for the kernels' PTX and the Mosaic GPU pipeline for its ``ptxas -v``
output. This test then checks

* the optimized HLO carries the Pallas kernels of the backend
  ``implementation`` picks (:func:`expected_backend`: for None Triton, while
  Mosaic-first dispatch is off; ``"mosaic"`` in the slow Mosaic GPU step) and
  no other, in every computation that sends
  a payload hop, and at least as many kernel launches per step as payload
  hops, of which a ring over 8 devices makes at least 7 (counted per step
  from the call graph and the loops' trip counts, however XLA peels or
  unrolls the hop loop);
* ``ptxas -v`` (sm_90a) reports every kernel's registers and spills, and 0
  spill bytes for every kernel, Triton's and Mosaic GPU's (the Mosaic GPU
  kernels' level lookups are select chains: docs/design.md, "Mosaic GPU");
* no DeprecationWarning escapes the build (the child runs with
  ``-W error::DeprecationWarning``);
* the negative controls: the same check fails when the Triton kernels' block
  is made 8x too large (register spills), and when the Mosaic GPU kernels'
  block is (a copy over the TMA unit's 256 rows: the build fails).

It needs the ``gpu-compile`` extra (``pip install -e '.[gpu-compile]'``:
the CUDA PJRT plugin, which carries XLA's GPU compiler, and ``ptxas``) and
is skipped, saying so, where that is not installed. Run it as a script to
print the report: ``python tests/test_gpu_compile.py [--block N]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import jax
import pytest

import gpu_compile_tools as T

DEVICES = 8
OVERSIZED_BLOCK = 128  # super-groups per program, 8x the unit kernels' BLOCK: spills on sm_90a
OVERSIZED_MOSAIC_BLOCK = 64  # 8x the Mosaic GPU kernels' BLOCK: 512-row copies, over TMA's 256


# ----------------------------------------------------------------------------
# The child: compile the step for the compile-only topology.


def compile_step(block: int | None = None, implementation: str | None = None,
                 mosaic_block: int | None = None):
  """The README's step for 8 x H100, compiled (runs in the child); ``implementation`` is
  ``dq.compressed_psum``'s (tools/mosaic_compile.py compiles it with "mosaic"); ``block``
  and ``mosaic_block``: super-groups per program of the Triton and the Mosaic GPU kernels
  (None: their own)."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from pallas_kernels import dynamiq_triton, mosaic_rows

  if block is not None:  # read when the kernels are traced, below
    dynamiq_triton.BLOCK = block
  if mosaic_block is not None:  # the rows of a program's [rows, 32] block follow it
    mosaic_rows.BLOCK = mosaic_block
    mosaic_rows.ROWS = mosaic_block * 8
  mesh = T.h100_mesh((DEVICES,), ("data",))
  tx = optax.chain(dq.compressed_psum("data", implementation=implementation),
                   optax.adamw(1e-3))

  def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)

  # dq.data_parallel_step's body; that helper wants a mesh of real devices.
  def local(params, opt_state, batch):
    grads = jax.grad(loss_fn)(dq.as_varying(params, "data"), batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def spec(shape, dtype, *axes):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))

  params = {"w": spec((512, 256), jnp.float32)}
  opt_state = jax.tree.map(lambda s: spec(s.shape, s.dtype), jax.eval_shape(tx.init, params))
  batch = (spec((64, 512), jnp.float32, "data"), spec((64, 256), jnp.float32, "data"))
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P()), check_vma=True))
  return step.trace(params, opt_state, batch).lower().compile()


# ----------------------------------------------------------------------------
# The checks, on the child's build.


def report_of(hlo: str, spills: dict[str, dict[str, int]]) -> dict:
  """Kernel custom calls (by backend), launches and payload hops per step, registers and
  spill bytes per kernel."""
  comps = T.parse_hlo(hlo)
  runs, unknown = T.executions(comps)
  calls = [i for c in comps.values() for i in c.instructions if T.kernel_name(i)]
  kernels = collections.Counter(T.kernel_name(i) for i in calls)
  return {
      "kernel_custom_calls": sum(kernels.values()),
      "by_backend": dict(sorted(collections.Counter(
          "triton" if T.TRITON in i.attributes else "mosaic_gpu" for i in calls).items())),
      "by_kernel": dict(sorted(kernels.items())),
      "kernel_launches_per_step": T.per_step(comps, lambda i: T.kernel_name(i) is not None),
      "payload_hops_per_step": T.per_step(comps, T.is_payload_hop),
      "while_loops": sum(i.opcode == "while" for c in comps.values() for i in c.instructions),
      "unknown_trip_counts": len(unknown),
      "registers": {k: spills[k]["registers"] if k in spills else None for k in sorted(kernels)},
      "spill_bytes": {k: spills[k]["spill_bytes"] if k in spills else None
                      for k in sorted(kernels)},
      "hop_computations_without_kernel": sorted(
          name for name, c in comps.items()
          if any(T.is_payload_hop(i) for i in c.instructions)
          and not any(T.kernel_name(i) for i in c.instructions)),
  }


def expected_backend(implementation: str | None = None) -> str:
  """The backend of the step's kernels: ``implementation=None`` picks Mosaic GPU where it
  lowers for the H100 when Mosaic-first dispatch is on
  (``pallas_kernels.dispatch.MOSAIC_FIRST``, off today), which on the jax versions CI
  tests is jax >= 0.12 (0.10.2 refuses the kernels at lowering)."""
  from pallas_kernels import dispatch
  if implementation == "mosaic":
    return "mosaic_gpu"
  if implementation is None and dispatch.MOSAIC_FIRST and jax.__version_info__ >= (0, 12):
    return "mosaic_gpu"
  return "triton"


def check(block: int | None = None, implementation: str | None = None,
          mosaic_block: int | None = None) -> dict:
  """Compiles the step in a child process and checks it; raises AssertionError.

  Args:
    block: super-groups per Triton kernel program (None: the kernels' own).
    implementation: ``dq.compressed_psum``'s (None: the default dispatch).
    mosaic_block: super-groups per Mosaic GPU kernel program (None: the kernels' own).

  Returns:
    The report: custom-call counts, launches and hops per step, registers and spill bytes
    per kernel (``ptxas -v``: on XLA's PTX for Triton, the Mosaic GPU pipeline's own for
    Mosaic GPU), seconds taken.
  """
  try:
    build = T.compile_in_child("test_gpu_compile:compile_step",
                               kwargs={"block": block, "implementation": implementation,
                                       "mosaic_block": mosaic_block})
  except RuntimeError as err:  # the step did not build: its error, last line first
    errors = [line for line in str(err).splitlines() if re.match(r"\w*(Error|Exception)\b", line)]
    raise AssertionError(f"the step does not build for 8 x H100: "
                         f"{errors[-1] if errors else ''}\n{err}") from None
  with build:
    spills = {**T.ptxas_report(build.ptx), **T.mosaic_ptxas_report(build.mosaic_ptxas)}
    report = report_of(build.hlo[0], spills)
    report["seconds"] = build.seconds
    fallback = [line for line in build.stderr.splitlines() if "KernelFallbackWarning" in line]
  problems = []
  kernels = report["by_kernel"]
  backend = expected_backend(implementation)
  if not kernels:
    problems.append("no Pallas kernel (Triton or Mosaic GPU custom call) in the optimized "
                    "GPU HLO")
  if "?" in kernels:
    problems.append("a kernel custom call that is not a dynamiq kernel")
  others = sorted(set(report["by_backend"]) - {backend})
  if others:
    problems.append(f"{others} kernels in the step where {implementation=} picks {backend} "
                    f"kernels only on jax {'>=' if backend == 'mosaic_gpu' else '<'} 0.12"
                    + "".join(f"; {line.strip()}" for line in fallback))
  for name in report["hop_computations_without_kernel"]:
    problems.append(f"computation {name} sends payload hops without a kernel")
  if report["unknown_trip_counts"]:
    problems.append(f"{report['unknown_trip_counts']} loop(s) of unknown trip count: "
                    "launches and hops per step are lower bounds")
  if report["payload_hops_per_step"] < DEVICES - 1:
    problems.append(f"{report['payload_hops_per_step']} payload hops per step; a ring over "
                    f"{DEVICES} devices makes {DEVICES - 1}")
  if report["kernel_launches_per_step"] < report["payload_hops_per_step"]:
    problems.append("fewer kernel launches than ring hops")
  for name, spilled in report["spill_bytes"].items():
    if spilled is None:
      problems.append(f"kernel {name} not found in the ptxas -v output")
    elif spilled:
      problems.append(f"kernel {name} spills {spilled} bytes (ptxas -v, sm_90a)")
  if problems:
    raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report)}")
  return report


# ----------------------------------------------------------------------------
# Tests.

needs_compiler = pytest.mark.skipif(T.missing() is not None, reason=str(T.missing()))


@needs_compiler
def test_default_step_compiles_for_8_h100_with_kernels(record_property):
  report = check()
  record_property("gpu_compile", json.dumps(report))  # printed by tests/conftest.py
  assert report["kernel_custom_calls"] >= 3  # compress, the ring hop, decompress at least
  assert set(report["by_backend"]) == {expected_backend()}
  assert all(r is not None and r > 0 for r in report["registers"].values())


@needs_compiler
@pytest.mark.slow  # 50 s; test_mosaic_gpu lowers each kernel, the negative control below
@pytest.mark.skipif(jax.__version_info__ < (0, 12),
                    reason="jax < 0.12: Mosaic GPU does not lower the kernels")
def test_mosaic_step_compiles_for_8_h100_with_registers_reported(record_property):
  """``implementation="mosaic"``: Mosaic GPU kernels only, in every hop computation, with
  registers read from the Mosaic GPU pipeline's ptxas output and no spills."""
  report = check(implementation="mosaic")
  record_property("gpu_compile_mosaic", json.dumps(report))
  assert set(report["by_backend"]) == {"mosaic_gpu"} and report["kernel_custom_calls"] >= 3
  assert all(r is not None and r > 0 for r in report["registers"].values())


@needs_compiler
def test_an_oversized_block_fails_the_check(record_property):
  """Negative control: the same check fails when the Triton kernels spill registers."""
  with pytest.raises(AssertionError, match=r"spills \d+ bytes") as err:
    check(block=OVERSIZED_BLOCK, implementation="pallas")
  assert "not found in the" not in str(err.value)
  record_property("gpu_compile_negative_control",
                  f"BLOCK={OVERSIZED_BLOCK} fails: {str(err.value).splitlines()[0]}")


@needs_compiler
@pytest.mark.skipif(jax.__version_info__ < (0, 12),
                    reason="jax < 0.12: Mosaic GPU does not lower the kernels at any size")
def test_an_oversized_mosaic_block_fails_the_check(record_property):
  """Negative control for Mosaic GPU: a program of 64 super-groups would copy 512-row
  blocks, over what one TMA copy moves (256 per dimension); the build fails, saying so."""
  with pytest.raises(AssertionError, match=r"does not build.*256 elements") as err:
    check(implementation="mosaic", mosaic_block=OVERSIZED_MOSAIC_BLOCK)
  record_property("gpu_compile_mosaic_negative_control",
                  f"BLOCK={OVERSIZED_MOSAIC_BLOCK} fails: {str(err.value).splitlines()[0]}")


def _main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--block", type=int, default=None,
                      help="super-groups per Triton kernel program (default: the kernels' own)")
  parser.add_argument("--mosaic-block", type=int, default=None,
                      help="super-groups per Mosaic GPU kernel program (default: their own)")
  parser.add_argument("--implementation", default=None, choices=("pallas", "mosaic", "xla"),
                      help="dq.compressed_psum's (default: None, the dispatch's choice)")
  args = parser.parse_args()
  if T.missing():
    sys.exit(f"cannot run: {T.missing()}")
  print(json.dumps(check(args.block, args.implementation, args.mosaic_block), indent=1))


if __name__ == "__main__":
  _main()
