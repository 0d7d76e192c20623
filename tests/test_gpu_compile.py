"""The README's default training step compiles for 8 x H100, with the fused kernels in it.

Compile-only: no GPU is needed. A child process (XLA flags are read once per
process, and the test session's jax is pinned to 8 CPU devices) describes an
8 x H100 host with ``jax.experimental.topologies`` (the target config is
XLA's own H100 SXM spec, ``tests/data/h100_sxm.txtpb``), builds the README's
step (``optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))``, its
gradients taken in ``jax.shard_map(check_vma=True)`` as
``dq.data_parallel_step`` does) over that topology's mesh, and compiles it
with ``XLA_FLAGS=--xla_dump_to=...``. This test then checks

* the optimized HLO carries the Pallas kernels as Triton custom calls, in
  the computation of every ring hop that sends a payload, and at least as
  many kernel launches per step as payload hops;
* ``ptxas -v --gpu-name=sm_90a`` reports 0 spill bytes for every kernel in
  the dumped PTX;
* the same check fails when the kernels' block is made 8x too large
  (register spills): the negative control.

It needs the ``gpu-compile`` extra (``pip install -e '.[gpu-compile]'``:
the CUDA PJRT plugin, which carries XLA's GPU compiler, and ``ptxas``) and
is skipped, saying so, where that is not installed. Run it as a script to
print the report: ``python tests/test_gpu_compile.py [--block N]``.
"""

from __future__ import annotations

import argparse
import collections
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

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET_CONFIG = pathlib.Path(__file__).resolve().parent / "data" / "h100_sxm.txtpb"
DEVICES = 8
OVERSIZED_BLOCK = 64  # super-groups per program, 4x the unit kernels' BLOCK: spills on sm_90a
TRITON = "__gpu$xla.gpu.triton"


# ----------------------------------------------------------------------------
# The child: compile the step for the compile-only topology.


def _compile_step(dump: str, block: int | None) -> None:
  """Compiles the README's step for 8 x H100; writes ``dump``/optimized.hlo."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.experimental import topologies
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dynamiq_jax as dq
  from pallas_kernels import dynamiq_triton

  if block is not None:  # read when the kernels are traced, below
    dynamiq_triton.BLOCK = block
  topology = topologies.get_topology_desc(
      topology_name="h100", platform="cuda", target_config=TARGET_CONFIG.read_text(),
      topology=f"1x1x{DEVICES}")
  mesh = topologies.make_mesh(topology, (DEVICES,), ("data",))
  tx = optax.chain(dq.compressed_psum("data"), optax.adamw(1e-3))

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
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    compiled = step.trace(params, opt_state, batch).lower().compile()
  pathlib.Path(dump, "optimized.hlo").write_text(compiled.as_text())


# ----------------------------------------------------------------------------
# The checks, on the child's output.


def _computations(hlo: str) -> dict[str, str]:
  """HLO module text -> {computation name: its text}; the entry is named ENTRY."""
  parts = re.split(r"\n(?=(?:ENTRY )?%\S+ .*\{\n)", hlo)
  out = {}
  for part in parts:
    head = re.match(r"(ENTRY )?%(\S+) ", part)
    if head:
      out["ENTRY" if head.group(1) else head.group(2)] = part
  return out


def _multipliers(comps: dict[str, str]) -> dict[str, int]:
  """How many times each while body runs per step (known trip counts; unknown: 1)."""
  mult = {"ENTRY": 1}
  todo = ["ENTRY"]
  while todo:
    name = todo.pop()
    for m in re.finditer(r" while\(.*?body=%([\w.\-]+).*", comps[name]):
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', m.group(0))
      # Unknown trip count (a data-dependent loop): counted once.
      mult[m.group(1)] = mult[name] * (int(trips.group(1)) if trips else 1)
      todo.append(m.group(1))
  return mult


def _kernel_calls(text: str) -> list[str]:
  """Names of the Pallas kernels called (Triton custom calls) in ``text``."""
  names = []
  for line in text.splitlines():
    if TRITON in line:
      m = re.search(r"/(dynamiq_\w+)/pallas_call", line)
      names.append(m.group(1) if m else "?")
  return names


def _payload_hops(text: str) -> int:
  """Collective permutes of uint8 payloads (one per ring hop) in ``text``."""
  return len(re.findall(r"= \(?u8\[[^\n]*collective-permute(?:-start)?\(", text))


def _spills(ptx_files, ptxas: str) -> dict[str, int]:
  """{kernel: spill bytes (stores + loads)} from ``ptxas -v`` on each PTX file."""
  out = {}
  for path in ptx_files:
    res = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", str(path), "-o", os.devnull],
                         capture_output=True, text=True, check=True)
    for name, stores, loads in re.findall(
        r"Function properties for (\w+)\s*\n\s*\d+ bytes stack frame, (\d+) bytes spill stores,"
        r" (\d+) bytes spill loads", res.stderr):
      out[name] = max(out.get(name, 0), int(stores) + int(loads))  # same name, other shapes
  return out


def _ptxas() -> str | None:
  spec = importlib.util.find_spec("nvidia.cuda_nvcc")
  if spec is not None and spec.submodule_search_locations:
    for base in spec.submodule_search_locations:
      path = pathlib.Path(base, "bin", "ptxas")
      if path.exists():
        return str(path)
  return shutil.which("ptxas")


def _missing() -> str | None:
  """Why the check cannot run here, or None."""
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    return ("the CUDA plugin (XLA's GPU compiler) is not installed: "
            "pip install -e '.[gpu-compile]'")
  if _ptxas() is None:
    return "ptxas not found: pip install -e '.[gpu-compile]' (nvidia-cuda-nvcc-cu12)"
  return None


def check(block: int | None = None) -> dict:
  """Compiles the step in a child process and checks it; raises AssertionError.

  Args:
    block: super-groups per kernel program (None: the kernels' own).

  Returns:
    The report: custom-call counts, launches and hops per step, spill bytes
    per kernel, seconds taken.
  """
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as dump:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + env.get("PYTHONPATH", "").split(os.pathsep))
    # No GPU backend: the CUDA plugin's start-up check would fail without a
    # driver; the topology API uses the plugin's compiler all the same.
    env["JAX_PLATFORMS"] = "cpu"
    args = [sys.executable, __file__, "--child", dump]
    if block is not None:
      args += ["--block", str(block)]
    res = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
      raise AssertionError(f"the 8 x H100 compile failed:\n{res.stderr[-4000:]}")
    hlo = pathlib.Path(dump, "optimized.hlo").read_text()
    spills = _spills(sorted(pathlib.Path(dump).glob("*.ptx")), _ptxas())

  comps = _computations(hlo)
  mult = _multipliers(comps)
  calls = {name: _kernel_calls(text) for name, text in comps.items()}
  hops = {name: _payload_hops(text) for name, text in comps.items()}
  kernels = collections.Counter(k for ks in calls.values() for k in ks)
  report = {
      "kernel_custom_calls": sum(kernels.values()),
      "by_kernel": dict(sorted(kernels.items())),
      "kernel_launches_per_step": sum(len(calls[c]) * mult.get(c, 1) for c in comps),
      "payload_hops_per_step": sum(hops[c] * mult.get(c, 1) for c in comps),
      "while_loops": len(mult) - 1,  # the reference's XLA:CPU workaround would add one per use
      "spill_bytes": {k: spills.get(k) for k in sorted(kernels)},
      "seconds": round(time.perf_counter() - start, 1),
  }
  problems = []
  if not kernels:
    problems.append("no Pallas kernel (Triton custom call) in the optimized GPU HLO")
  if "?" in kernels:
    problems.append("a Triton custom call that is not a dynamiq kernel")
  for name in comps:
    if hops[name] and not calls[name]:
      problems.append(f"computation {name} sends {hops[name]} payload hop(s) without a kernel")
  if report["payload_hops_per_step"] < DEVICES - 1:
    problems.append(f"{report['payload_hops_per_step']} payload hops per step; a ring over "
                    f"{DEVICES} devices makes {DEVICES - 1}")
  if report["kernel_launches_per_step"] < report["payload_hops_per_step"]:
    problems.append("fewer kernel launches than ring hops")
  for name, spilled in report["spill_bytes"].items():
    if spilled is None:
      problems.append(f"kernel {name} not found in the dumped PTX")
    elif spilled:
      problems.append(f"kernel {name} spills {spilled} bytes (ptxas -v, sm_90a)")
  if problems:
    raise AssertionError("; ".join(problems) + f"\nreport: {json.dumps(report)}")
  return report


# ----------------------------------------------------------------------------
# Tests.

needs_compiler = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@needs_compiler
def test_default_step_compiles_for_8_h100_with_kernels_and_no_spills(record_property):
  report = check()
  record_property("gpu_compile", json.dumps(report))  # printed by tests/conftest.py
  assert report["kernel_custom_calls"] >= 3  # compress, the ring hop, decompress at least


@needs_compiler
def test_an_oversized_block_fails_the_check(record_property):
  """Negative control: the same check fails when the kernels spill registers."""
  with pytest.raises(AssertionError, match=r"spills \d+ bytes") as err:
    check(block=OVERSIZED_BLOCK)
  assert "not found in the dumped PTX" not in str(err.value)
  record_property("gpu_compile_negative_control",
                  f"BLOCK={OVERSIZED_BLOCK} fails: {str(err.value).splitlines()[0]}")


def test_the_checks_see_hops_and_kernels():
  """The HLO readers on a hand-written module: a hop loop run 6 times, a kernel in it."""
  hlo = """HloModule m

%body (p: (s32[], u8[64])) -> (s32[], u8[64]) {
  %cp = (u8[64]{0}, u8[64]{0}) collective-permute-start(%x), source_target_pairs={{0,1}}
  %k = u8[64]{0} custom-call(%y), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jit(_dar_call)/dynamiq_decompress_accumulate_recompress_b4/pallas_call"}
}

ENTRY %main (a: u8[64]) -> u8[64] {
  %w = (s32[], u8[64]) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %cp2 = (u8[64]{0}, u8[64]{0}) collective-permute-start(%z), source_target_pairs={{0,1}}
}
"""
  comps = _computations(hlo)
  assert set(comps) == {"body", "ENTRY"}
  assert _multipliers(comps) == {"ENTRY": 1, "body": 6}
  assert _kernel_calls(comps["body"]) == ["dynamiq_decompress_accumulate_recompress_b4"]
  assert _kernel_calls(comps["ENTRY"]) == []
  assert _payload_hops(comps["body"]) == 1 and _payload_hops(comps["ENTRY"]) == 1


def _main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--child", metavar="DUMP_DIR", help=argparse.SUPPRESS)
  parser.add_argument("--block", type=int, default=None,
                      help="super-groups per kernel program (default: the kernels' own)")
  args = parser.parse_args()
  if args.child:
    _compile_step(args.child, args.block)
    return
  reason = _missing()
  if reason:
    sys.exit(f"cannot run: {reason}")
  print(json.dumps(check(args.block), indent=1))


if __name__ == "__main__":
  _main()
