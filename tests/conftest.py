"""Shared fixtures: 8 simulated CPU devices (set in the root conftest)."""

import jax
import pytest

N_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  assert jax.device_count() >= N_DEVICES, "conftest must set 8 CPU devices"
  return jax.make_mesh((N_DEVICES,), ("data",))


def pytest_configure(config):
  """On jax < 0.12 (0.10.2 in CI) Mosaic GPU refuses the hop kernels at lowering, so with
  Mosaic-first dispatch on (pallas_kernels.dispatch.MOSAIC_FIRST) every
  ``implementation=None`` lowering for an NVIDIA GPU warns once that Triton runs instead:
  expected there, and not an error for the tests that lower
  for cuda. ``tests/test_kernel_dispatch.py::TestMosaicFirst`` checks the warning itself
  (``pytest.warns`` records it whatever the filters say). On jax 0.12 it stays an error."""
  if jax.__version_info__ < (0, 12):
    config.addinivalue_line(
        "filterwarnings",
        r"ignore:dynamiq_jax. the Mosaic GPU kernel:pallas_kernels.dispatch.KernelFallbackWarning")


def pytest_terminal_summary(terminalreporter):
  """Prints what the 8 x H100 compile check measured (tests/test_gpu_compile.py), if it ran."""
  for report in terminalreporter.stats.get("passed", []):
    for name, value in getattr(report, "user_properties", ()):
      if name.startswith("gpu_compile"):
        terminalreporter.write_line(f"{name}: {value}")


# Test files by their time on 2 cores, longest first (from --durations). With
# --dist=loadfile and --no-loadscope-reorder (pyproject), pytest-xdist hands out
# whole files in this order: the long ones start first and the short ones fill in
# at the end, so no worker is left running a long file alone.
LONGEST_FIRST = (
    "test_dynamiq.py", "test_bench.py", "test_overlap.py", "test_tta.py", "test_dropcompute.py",
    "test_kernels.py", "test_collectives.py", "test_transform.py", "test_examples.py",
    "test_baselines.py", "test_multiprocess.py", "test_sharded.py", "test_mosaic_gpu.py",
    "test_hierarchical.py", "test_moshpit.py",
    "test_net.py",
    "test_gpu_compile_units.py", "test_allocation_rounds.py", "test_bucketing.py",
    "test_gpu_compile.py", "test_bucket_cost.py", "test_codec_contract.py", "test_notebook.py", "test_docs.py",
    "test_checkpoint.py", "test_error_estimate.py", "test_demo.py",
    "test_exact.py",
)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
