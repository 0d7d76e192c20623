"""Test-session set-up shared by tests/ and the doctests in the packages.

JAX must see 8 simulated CPU devices before it initialises its backends,
so this runs at collection start, before any test module imports jax code.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# Start the backends now, with those 8: a benchmark run in-process by a test asks for its own
# device count (examples.devices.select_devices), which would otherwise win when its test is
# the first of a process to start JAX, and leave every later test with that count.
jax.devices()
