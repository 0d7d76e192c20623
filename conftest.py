"""Test-session set-up shared by tests/ and the doctests in the packages.

JAX must see 8 simulated CPU devices before it initialises its backends,
so this runs at collection start, before any test module imports jax code.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The tests' XLA programs are compiled with LLVM at -O1 rather than XLA's default -O3:
# compiling dominates the suite's time on CPU, and -O1 takes about 40% less CPU time for
# the same outputs, bit for bit (tests/test_digests.py compares the all-reduces with digests
# recorded at the default level). Set in the environment so the tests' subprocesses (the
# multi-process runs, examples, benchmarks) inherit it; the README's blocks run without it,
# as pasted, and tests/gpu_compile_tools.py puts the default back for the H100 builds it
# measures. A level already in XLA_FLAGS is kept.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
