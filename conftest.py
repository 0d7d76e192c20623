"""Test-session set-up shared by tests/ and the doctests in the packages.

JAX must see 8 simulated CPU devices before it initialises its backends,
so this runs at collection start, before any test module imports jax code.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
