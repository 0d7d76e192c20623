"""Multi-process (multi-host) operation: one JAX process per worker.

On GPUs ``jax.distributed.initialize`` is all it takes (NCCL carries the
collectives). On CPU the cross-process collectives need gloo over TCP, which
:func:`initialize` selects. Then a mesh over ``jax.devices()`` (every
process's devices) and :func:`dynamiq_jax.allreduce` / ``compressed_psum``
inside ``jax.shard_map`` work as on one host; each process feeds its own
shard with :func:`global_batch`.

Launch example (two processes on one machine; on a cluster use the first
host's address and one process per host)::

    python -m dynamiq_jax.training.multiprocess --check --num-processes 2   # spawns both

or, per process::

    import dynamiq_jax as dq
    dq.multiprocess.initialize("10.0.0.1:12355", num_processes=4, process_id=RANK)

The ``--check`` entry point all-reduces the paper's synthetic gradients in
every process and compares the result with :func:`dynamiq_jax.simulate` on
the same data, bit for bit.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import subprocess
import sys
import tempfile
import time

__all__ = ["initialize", "global_batch", "free_port", "launch", "Job"]


def initialize(coordinator_address: str, *, num_processes: int, process_id: int,
               local_devices: int = 1, heartbeat_timeout_seconds: int = 20,
               initialization_timeout: int = 120) -> None:
  """Joins this process to a multi-process JAX job.

  Call before anything touches JAX devices. On CPU it asks for
  ``local_devices`` devices per process and gloo collectives.

  Args:
    coordinator_address: ``host:port`` of process 0's coordinator.
    num_processes: how many processes the job has.
    process_id: this process's rank, in ``[0, num_processes)``.
    local_devices: CPU devices per process (ignored on GPU).
    heartbeat_timeout_seconds: a process that stops answering for this long
      makes the others fail with an error instead of hanging.
    initialization_timeout: how long to wait for every process to join.

  Raises:
    ValueError: for a rank outside ``[0, num_processes)``.
  """
  import jax

  if not 0 <= process_id < num_processes:
    raise ValueError(f"process_id={process_id} is not in [0, num_processes={num_processes}): "
                     f"give each process a distinct rank 0 .. {num_processes - 1}")
  if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") or "cpu" in os.environ.get(
      "JAX_PLATFORMS", ""):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", local_devices)
  jax.distributed.initialize(coordinator_address, num_processes=num_processes,
                             process_id=process_id,
                             heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                             initialization_timeout=initialization_timeout)


def global_batch(mesh, local, axis_name="data"):
  """The global array sharded over ``axis_name`` from each process's ``local`` rows.

  ``local`` holds this process's rows (leading axis = its devices' shards,
  concatenated). Works with any pytree.
  """
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  sharding = NamedSharding(mesh, P(axis_name))
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(sharding, x), local)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Job:
  """Processes of one multi-process job, with their output in temporary files.

  Files, not pipes: a chatty rank can never block on a full pipe buffer.
  With ``stdin=True`` each process reads commands from a pipe
  (:meth:`send`). Use it as a context manager: every process still running
  at exit is killed, and the log files are closed.
  """

  def __init__(self, argv_per_rank, *, env=None, prefix_per_rank=None, stdin: bool = False):
    self.procs, self.logs, self._seen = [], [], []
    try:
      for r, argv in enumerate(argv_per_rank):
        cmd = (list(prefix_per_rank[r]) if prefix_per_rank else []) + list(argv)
        out, err = _log_file(), _log_file()
        self.logs.append((out, err))
        self._seen.append(0)
        self.procs.append(subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, text=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL))
    except BaseException:
      self.close()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def check(self) -> list:
    """Exit codes (None: running); raises if a rank failed, after stopping the others."""
    codes = [p.poll() for p in self.procs]
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    if failed:
      r = failed[0]
      self.stop()
      raise RuntimeError(f"rank {r} exited with code {codes[r]}; the other ranks were "
                         f"stopped. Its stderr ends:\n{self.stderr(r)[-3000:]}")
    return codes

  def send(self, line: str) -> None:
    """Writes ``line`` to every rank's stdin."""
    for r, p in enumerate(self.procs):
      try:
        p.stdin.write(line.rstrip("\n") + "\n")
        p.stdin.flush()
      except BrokenPipeError:
        self.check()
        raise RuntimeError(f"rank {r} closed its input") from None

  def wait_lines(self, prefix: str, *, timeout: float) -> list:
    """The next stdout line of each rank starting with ``prefix`` (prefix removed)."""
    got = [None] * len(self.procs)

    def step(codes):
      for r in range(len(self.procs)):
        if got[r] is None:
          got[r] = self._next_line(r, prefix)
      if all(g is not None for g in got):
        return got
      if any(c == 0 for r, c in enumerate(codes) if got[r] is None):
        self.stop()
        raise RuntimeError(f"a rank exited before printing {prefix!r}")
      return None

    return self._poll(step, timeout, lambda codes: (
        f"no {prefix!r} line within {timeout:.0f} s from ranks "
        f"{[r for r, g in enumerate(got) if g is None]}"))

  def _next_line(self, r, prefix):
    f = self.logs[r][0]
    f.seek(self._seen[r])
    while True:
      line = f.readline()
      if not line.endswith("\n"):
        return None  # nothing complete yet
      self._seen[r] = f.tell()
      if line.startswith(prefix):
        return line[len(prefix):].rstrip("\n")

  def wait(self, *, timeout: float) -> list:
    """Waits until every rank exits 0; returns their stdout texts."""
    return self._poll(
        lambda codes: ([self.stdout(r) for r in range(len(self.procs))]
                       if all(c == 0 for c in codes) else None),
        timeout, lambda codes: (
            f"the {len(self.procs)}-process job ran past {timeout:.0f} s; still running: "
            f"{[r for r, c in enumerate(codes) if c is None]}"))

  def _poll(self, step, timeout: float, late):
    """Calls ``step(exit codes)`` until it returns non-None; a failed rank or the
    deadline stops every process (``late(codes)`` says what was still awaited)."""
    deadline = time.monotonic() + timeout
    while True:
      codes = self.check()
      result = step(codes)
      if result is not None:
        return result
      if time.monotonic() > deadline:
        self.stop()
        raise TimeoutError(f"{late(codes)}; the job was stopped")
      time.sleep(0.05)

  def stdout(self, r) -> str:
    return _read(self.logs[r][0])

  def stderr(self, r) -> str:
    return _read(self.logs[r][1])

  def stop(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        p.kill()
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass

  def close(self) -> None:
    self.stop()
    for p in self.procs:
      if p.stdin:
        try:
          p.stdin.close()
        except OSError:
          pass
    for out, err in self.logs:
      out.close()
      err.close()


def launch(argv_per_rank, *, timeout: float, env=None, prefix_per_rank=None):
  """Runs one process per rank and waits for all; kills all on error or timeout.

  Args:
    argv_per_rank: the command of each rank (a list of argument lists).
    timeout: seconds until every process is killed and ``TimeoutError`` raised.
    env: environment of the processes (default: this one's).
    prefix_per_rank: optional command prefix per rank (e.g. ``ip netns exec``).

  Returns:
    The stdout text of each rank.

  Raises:
    RuntimeError: naming the rank that failed first, with its stderr tail,
      after the others were stopped.
    TimeoutError: when the job ran past ``timeout``.
  """
  with Job(argv_per_rank, env=env, prefix_per_rank=prefix_per_rank) as job:
    return job.wait(timeout=timeout)


def _log_file():
  """A temporary file a child writes in append mode, so our reads may seek freely."""
  f = tempfile.TemporaryFile("w+")
  fcntl.fcntl(f.fileno(), fcntl.F_SETFL, fcntl.fcntl(f.fileno(), fcntl.F_GETFL) | os.O_APPEND)
  return f


def _read(f) -> str:
  f.seek(0)
  return f.read()


def _check(args) -> None:
  """One rank of ``--check``: all-reduce synthetic gradients, compare with simulate."""
  initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
             local_devices=args.local_devices,
             heartbeat_timeout_seconds=args.heartbeat_timeout)
  import jax
  import numpy as np
  from jax.sharding import PartitionSpec as P

  from dynamiq_jax.api.allreduce import allreduce
  from dynamiq_jax.api.simulate import simulate
  from dynamiq_jax.codec_names import codec_from_name
  from dynamiq_jax.synthetic import paper_model_gradients

  n = jax.device_count()
  codec = codec_from_name(args.codec)
  grads = paper_model_gradients("iid", n, args.d, args.data_seed).astype(np.float32)
  mesh = jax.make_mesh((n,), ("data",), devices=jax.devices())
  per = args.local_devices
  local = grads[jax.process_index() * per:(jax.process_index() + 1) * per]
  x = global_batch(mesh, local)

  @jax.jit
  def run(x):
    def body(g):
      out, stats = allreduce(g[0], axis_name="data", codec=codec, schedule=args.schedule,
                             key=jax.random.key(args.seed))
      return out[None]
    return jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)

  if os.environ.get("DYNAMIQ_JAX_FAULT_RANK") == str(jax.process_index()):
    os._exit(17)  # fault injection for tests: this worker dies before the all-reduce
  out = run(x)
  mine = np.concatenate([np.asarray(s.data) for s in out.addressable_shards])
  if args.compare:
    expected = np.asarray(simulate(grads, codec=codec, schedule=args.schedule, seed=args.seed))
    expected = expected[jax.process_index() * per:(jax.process_index() + 1) * per]
    same = bool(np.array_equal(mine.view(np.uint32), expected.view(np.uint32)))
    print(f"rank {jax.process_index()}: {n} workers, {args.codec} {args.schedule}: "
          f"{'bit-identical to simulate' if same else 'DIFFERS from simulate'}", flush=True)
    if not same:
      sys.exit(3)
  print(f"digest {int(mine.view(np.uint32).astype(np.uint64).sum())}", flush=True)


def build_parser() -> argparse.ArgumentParser:
  """The ``--check`` entry point's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.training.multiprocess",
                              description="Checks a multi-process all-reduce against simulate.",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--check", action="store_true",
                 help="all-reduce synthetic gradients and compare with simulate")
  p.add_argument("--num-processes", type=int, default=2, help="processes (workers) in the job")
  p.add_argument("--process-id", type=int, default=None,
                 help="this process's rank; unset: spawn every rank locally")
  p.add_argument("--coordinator", default=None,
                 help="host:port of process 0; unset: a free port on 127.0.0.1")
  p.add_argument("--local-devices", type=int, default=1, help="CPU devices per process")
  p.add_argument("--codec", default="dynamiq", help="codec name (dynamiq_jax.REDUCERS)")
  p.add_argument("--schedule", default="ring", help="all-reduce schedule: ring or butterfly")
  p.add_argument("--d", type=int, default=1 << 16, help="synthetic coordinates per worker")
  p.add_argument("--seed", type=int, default=0, help="seed of the rounding streams")
  p.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic gradients")
  p.add_argument("--no-compare", dest="compare", action="store_false",
                 help="skip the bit-for-bit comparison with simulate")
  p.add_argument("--timeout", type=float, default=300,
                 help="seconds the spawned job may take before it is stopped")
  p.add_argument("--heartbeat-timeout", type=int, default=20,
                 help="seconds a silent process may take before the others fail with an "
                      "error (initialize's heartbeat_timeout_seconds)")
  return p


def _parse(argv):
  return build_parser().parse_args(argv)


def main(argv=None):
  args = _parse(argv)
  if not args.check:
    raise SystemExit("nothing to do: pass --check (see --help)")
  if args.heartbeat_timeout < 1:
    raise SystemExit(f"--heartbeat-timeout {args.heartbeat_timeout}: give at least 1 second")
  if args.process_id is not None:
    if args.coordinator is None:
      raise SystemExit("--process-id needs --coordinator host:port (process 0's address)")
    _check(args)
    return
  coordinator = args.coordinator or f"127.0.0.1:{free_port()}"
  base = [sys.executable, "-m", "dynamiq_jax.training.multiprocess", "--check",
          "--coordinator", coordinator, "--num-processes", str(args.num_processes),
          "--local-devices", str(args.local_devices), "--codec", args.codec,
          "--schedule", args.schedule, "--d", str(args.d), "--seed", str(args.seed),
          "--data-seed", str(args.data_seed), "--heartbeat-timeout",
          str(args.heartbeat_timeout)] + ([] if args.compare else ["--no-compare"])
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  outs = launch([base + ["--process-id", str(r)] for r in range(args.num_processes)],
                timeout=args.timeout, env=env)
  for text in outs:
    print(text.strip())


if __name__ == "__main__":
  main()
