"""Shared fixtures: 8 simulated CPU devices (set in the root conftest)."""

import jax
import pytest

N_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  assert jax.device_count() >= N_DEVICES, "conftest must set 8 CPU devices"
  return jax.make_mesh((N_DEVICES,), ("data",))


def pytest_terminal_summary(terminalreporter):
  """Prints what the 8 x H100 compile check measured (tests/test_gpu_compile.py), if it ran."""
  for report in terminalreporter.stats.get("passed", []):
    for name, value in getattr(report, "user_properties", ()):
      if name.startswith("gpu_compile"):
        terminalreporter.write_line(f"{name}: {value}")
