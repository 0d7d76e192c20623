"""Shared fixtures: 8 simulated CPU devices (set in the root conftest)."""

import jax
import pytest

N_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  assert jax.device_count() >= N_DEVICES, "conftest must set 8 CPU devices"
  return jax.make_mesh((N_DEVICES,), ("data",))
