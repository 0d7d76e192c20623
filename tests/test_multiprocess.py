"""Real multi-process JAX (gloo over TCP on CPU): equals simulate bit for bit; faults stop."""

import os
import subprocess
import sys
import time

import pytest

from dynamiq_jax.training import multiprocess
def _check(num_processes, *extra, env=None, timeout=400):
  coordinator = f"127.0.0.1:{multiprocess.free_port()}"  # one for all ranks
  return multiprocess.launch(
      [[sys.executable, "-m", "dynamiq_jax.training.multiprocess", "--check", "--coordinator",
        coordinator, "--num-processes", str(num_processes),
        "--process-id", str(r), "--d", str(1 << 14), *extra] for r in range(num_processes)],
      timeout=timeout, env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))


@pytest.mark.parametrize("num_processes,extra", [
    (2, ("--codec", "dynamiq", "--schedule", "ring")),
    # 4 processes compiling at once on 2 cores: minutes; the butterfly's parity with
    # simulate is checked in one process by tests/test_digests.py and test_hierarchical.py.
    pytest.param(4, ("--codec", "dynamiq", "--schedule", "butterfly", "--seed", "3"),
                 marks=pytest.mark.slow),
])
def test_multi_process_equals_simulate_bitwise(num_processes, extra):
  outs = _check(num_processes, *extra)
  assert len(outs) == num_processes
  for text in outs:
    assert "bit-identical to simulate" in text, text
  digests = {line for text in outs for line in text.splitlines() if line.startswith("digest")}
  assert len(digests) == 1  # every process holds the same result


def test_a_dead_worker_stops_the_others_with_an_error():
  """Rank 1 dies before the all-reduce: rank 0 must fail, not hang (within the heartbeat
  timeout, here 5 s instead of the default 20)."""
  coordinator = f"127.0.0.1:{multiprocess.free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu", DYNAMIQ_JAX_FAULT_RANK="1")
  start = time.monotonic()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "dynamiq_jax.training.multiprocess", "--check", "--coordinator",
       coordinator, "--num-processes", "2", "--process-id", str(r), "--d", str(1 << 12),
       "--heartbeat-timeout", "5"],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
  try:
    _, err0 = procs[0].communicate(timeout=180)
    procs[1].communicate(timeout=30)
  finally:
    for p in procs:
      p.kill()
      p.communicate()  # reap it and close its pipes
  assert procs[1].returncode == 17  # the injected fault
  assert procs[0].returncode != 0, "the surviving worker reported success"
  assert "unhealthy" in err0 or "heartbeat" in err0 or "died" in err0, err0[-2000:]
  assert time.monotonic() - start < 180


def test_launcher_names_the_failed_rank():
  with pytest.raises(RuntimeError, match="rank 1 exited with code 17"):
    _check(2, env={"DYNAMIQ_JAX_FAULT_RANK": "1"}, timeout=180)


def test_bad_rank_is_refused():
  with pytest.raises(ValueError, match="process_id=2 is not in"):
    multiprocess.initialize("127.0.0.1:1", num_processes=2, process_id=2)


def test_a_heartbeat_timeout_under_a_second_is_refused():
  with pytest.raises(SystemExit, match="--heartbeat-timeout 0: give at least 1 second"):
    multiprocess.main(["--check", "--heartbeat-timeout", "0"])
