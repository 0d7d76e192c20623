"""Shared fixtures: 8 simulated CPU devices (set in the root conftest)."""

import os

import jax
import pytest

N_DEVICES = 8


@pytest.fixture(scope="session")
def mesh():
  assert jax.device_count() >= N_DEVICES, "conftest must set 8 CPU devices"
  return jax.make_mesh((N_DEVICES,), ("data",))


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
  """One XLA GPU kernel cache file for the deviceless compiles of this test process that
  read only the optimized HLO (``gpu_compile.compile_in_child(kernel_cache=)``): a kernel
  an earlier compile made is not compiled again, which changes no HLO. Compiles that
  check registers and spills read ptxas' output and take no cache."""
  return str(tmp_path_factory.mktemp("xla_gpu_kernels") / "kernels.bin")


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
  """Prints what the 8 x H100 compile check measured (tests/test_gpu_compile.py), if it ran,
  and with ``DYNAMIQ_COMPILES=1`` the XLA compiles of each test, most compile time first."""
  counted = []
  for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get(
      "failed", []):
    for name, value in getattr(report, "user_properties", ()):
      if name.startswith("gpu_compile"):
        terminalreporter.write_line(f"{name}: {value}")
      if name == "xla_compiles" and report.when == "call":
        counted.append((value[1], value[0], value[2], report.nodeid))
  if counted:
    terminalreporter.write_sep("=", "XLA compiles per test (count, compile s, trace s)")
    for seconds, count, trace, nodeid in sorted(counted, reverse=True):
      terminalreporter.write_line(f"{count:4d} {seconds:7.1f} {trace:7.1f} {nodeid}")


_COMPILES = {"count": 0, "compile": 0.0, "trace": 0.0}


def _count_compiles(event, duration, **_):
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES["count"] += 1
    _COMPILES["compile"] += duration
  elif event == "/jax/core/compile/jaxpr_trace_duration":
    _COMPILES["trace"] += duration


if os.environ.get("DYNAMIQ_COMPILES"):
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel

  monitoring.register_event_duration_secs_listener(_count_compiles)

  @pytest.hookimpl(wrapper=True)
  def pytest_runtest_call(item):
    """Records the XLA compiles of a test's call (``DYNAMIQ_COMPILES=1``)."""
    before = dict(_COMPILES)
    try:
      return (yield)
    finally:
      item.user_properties.append(("xla_compiles", (
          _COMPILES["count"] - before["count"],
          round(_COMPILES["compile"] - before["compile"], 1),
          round(_COMPILES["trace"] - before["trace"], 1))))


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
