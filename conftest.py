"""Test-session set-up shared by tests/ and the doctests in the packages.

JAX must see 8 simulated CPU devices before it initialises its backends,
so this runs at collection start, before any test module imports jax code.
"""

import os

import jaxlib.version

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests compile for CPU with LLVM unoptimised (and, on jaxlib < 0.11, XLA's older CPU
# loop emitters): a DynamiQ step compiles 2.5x faster, and the suite runs 30% faster on jaxlib
# 0.10 and 0.12. The flags change how XLA's CPU code rounds some operations (training steps;
# on jaxlib 0.12 THC's recorded digest), so every process of a test run must compile with
# them: they stay in XLA_FLAGS, which the processes a test starts (gloo ranks, benchmark
# workers) inherit, and DYNAMIQ_TEST_XLA_FLAGS names them, so that tests/test_digests.py
# checks the recorded digests in a process that compiles as a user's job does. A deviceless
# GPU compile (dynamiq_jax.bench.gpu_compile.compile_in_child), which checks registers and
# spills, drops the optimisation level and compiles as a user's job does too.
_TEST_XLA_FLAGS = ["--xla_backend_optimization_level=0"]
if tuple(int(v) for v in jaxlib.version.__version__.split(".")[:2]) < (0, 11):
  _TEST_XLA_FLAGS.append("--xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_TEST_XLA_FLAGS]).strip()
os.environ["DYNAMIQ_TEST_XLA_FLAGS"] = " ".join(_TEST_XLA_FLAGS)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backends now, with those 8: a benchmark run in-process by a test asks for its own
# device count (examples.devices.select_devices), which would otherwise win when its test is
# the first of a process to start JAX, and leave every later test with that count.
jax.devices()
