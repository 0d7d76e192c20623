"""An emulated cluster network: one Linux network namespace per worker.

Each worker ``r`` lives in namespace ``<prefix>-w<r>`` with address
``10.77.0.<r+1>``; a veth pair joins it to a bridge in ``<prefix>-br``, the
switch. :meth:`Network.set_rate` puts a token-bucket (``tc tbf``) on both
ends of every veth, so each worker's link carries at most ``rate`` bit/s in
each direction, like a NIC into a non-blocking switch. Every namespace gets
its own ``/etc/netns/<ns>/hosts`` mapping this machine's host name to the
worker's address, because gloo connects to the address the host name
resolves to.

Everything created is removed by :meth:`Network.close` (the context manager
calls it, also on an exception or Ctrl-C; SIGTERM is turned into an
exception while the network is up). A driver killed with SIGKILL cannot clean
up, so :meth:`Network.open` first sweeps what such a run left
(:func:`sweep_stale`: the ``dqn<pid>-*`` namespaces and ``/etc/netns``
folders of pids that are no longer running). Needs root and ``ip``/``tc``;
:func:`can_shape` says whether that holds here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys

__all__ = ["Network", "can_shape", "NetworkError", "shaping", "worker_job", "join_job",
           "driver_commands", "sweep_stale"]

SUBNET = "10.77.0"
_DEFAULT_NS = re.compile(r"dqn(\d+)-(?:br|w\d+)")  # the names of Network(prefix=None)


class NetworkError(RuntimeError):
  """An ``ip``/``tc`` command failed (the message has the command and its error)."""


def can_shape() -> tuple[bool, str]:
  """(True, "") if namespaces and tc are usable here, else (False, the reason)."""
  if os.geteuid() != 0:
    return False, "not running as root (network namespaces and tc need root)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return False, f"the {tool!r} command is not installed (iproute2)"
  return True, ""


def shaping(no_shaping: bool = False) -> bool:
  """Whether the links will be shaped (root, tools, not ``no_shaping``); prints why not."""
  shaped, why = can_shape()
  if no_shaping:
    shaped, why = False, "--no-shaping was given"
  if not shaped:
    print(f"NOTE: no traffic shaping is applied ({why}); the workers talk over plain "
          f"loopback, so the link rates below are labels only.", flush=True)
  return shaped


@contextlib.contextmanager
def worker_job(module: str, workers: int, cfg_path: str, *, shaped: bool):
  """Runs ``python -m <module> --worker <r> --coordinator <host:port> --config <cfg_path>``
  for ``r < workers``: each in its own namespace of a :class:`Network` when
  ``shaped``, else on loopback. Yields ``(job, network or None)``
  (:class:`dynamiq_jax.training.multiprocess.Job` with stdin pipes); every process
  and namespace is gone on exit.
  """
  from dynamiq_jax.training import multiprocess
  from dynamiq_jax.bench.common import xla_flags_less

  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # one CPU device per worker: the caller's XLA_FLAGS less a host device count
  env["XLA_FLAGS"] = " ".join(xla_flags_less(env, "--xla_force_host_platform_device_count"))
  with contextlib.ExitStack() as stack:
    net = stack.enter_context(Network(workers)) if shaped else None
    host = net.address(0) if net else "127.0.0.1"
    port = multiprocess.free_port()
    argv = [[sys.executable, "-m", module, "--worker", str(r), "--coordinator", f"{host}:{port}",
             "--config", cfg_path] for r in range(workers)]
    prefix = [net.exec_prefix(r) for r in range(workers)] if net else None
    job = stack.enter_context(multiprocess.Job(argv, env=env, prefix_per_rank=prefix,
                                               stdin=True))
    print(f"{workers} workers {'in network namespaces' if net else 'on loopback'}: "
          f"compiling ...", flush=True)
    yield job, net


def join_job(cfg: dict, rank: int, coordinator: str, *, barrier: str):
  """A worker process's side of :func:`worker_job`: joins the process group
  (``cfg["workers"]`` processes, ``cfg["heartbeat_s"]``), and returns
  ``(mesh, say, sync)``: a mesh over every process's device with axis
  ``"data"``, ``say(tag, obj)`` printing ``tag`` and ``obj`` as JSON on one
  line for the driver, and ``sync()``, a barrier of every process named
  ``barrier``.
  """
  import json

  from dynamiq_jax.training import multiprocess
  multiprocess.initialize(coordinator, num_processes=cfg["workers"], process_id=rank,
                          heartbeat_timeout_seconds=cfg["heartbeat_s"])
  import jax
  from jax.experimental import multihost_utils

  mesh = jax.make_mesh((jax.device_count(),), ("data",), devices=jax.devices())
  say = lambda tag, obj: print(f"{tag} {json.dumps(obj)}", flush=True)
  sync = lambda: multihost_utils.sync_global_devices(barrier)
  return mesh, say, sync


def driver_commands(*allowed: str, usage: str = ""):
  """A worker's side of :meth:`dynamiq_jax.training.multiprocess.Job.send`: yields each command the
  driver sends on stdin as its words, until ``quit`` (or the end of stdin); a command
  not in ``allowed`` stops the worker with an error (``usage`` says the form)."""
  for line in sys.stdin:
    cmd = line.split()
    if not cmd:
      continue
    if cmd[0] == "quit":
      return
    if cmd[0] not in allowed:
      raise SystemExit(f"unknown command {line!r}" + (f"; expected {usage}" if usage else ""))
    yield cmd


def _run(*cmd: str) -> str:
  res = subprocess.run(cmd, capture_output=True, text=True)
  if res.returncode:
    raise NetworkError(f"`{' '.join(cmd)}` failed: {res.stderr.strip() or res.stdout.strip()}")
  return res.stdout


class Network:
  """``workers`` namespaces on a bridge, with rate-limited links (see module doc).

  Args:
    workers: number of worker namespaces.
    prefix: namespace name prefix (default: ``dqn<pid>``, unique per run).
  """

  def __init__(self, workers: int, prefix: str | None = None):
    if not 1 <= workers <= 250:
      raise ValueError(f"workers={workers} must be in [1, 250] (one /24 subnet)")
    ok, why = can_shape()
    if not ok:
      raise NetworkError(f"cannot build the emulated network: {why}")
    self.workers = workers
    self.prefix = prefix or f"dqn{os.getpid()}"
    self.bridge_ns = f"{self.prefix}-br"
    self.namespaces: list[str] = []
    self.rate_mbit: float | None = None
    self.delay_ms: float = 0.0
    self._old_sigterm = None

  # -- life cycle -----------------------------------------------------------

  def __enter__(self):
    self._old_sigterm = signal.signal(signal.SIGTERM, _raise_sigterm)
    try:
      self.open()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc):
    self.close()

  def open(self) -> None:
    sweep_stale()
    host = socket.gethostname()
    self._add_ns(self.bridge_ns)
    _run("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
    _run("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
    for r in range(self.workers):
      ns = self.worker_ns(r)
      self._add_ns(ns)
      _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"vb{r}",
           "netns", self.bridge_ns)
      _run("ip", "-n", self.bridge_ns, "link", "set", f"vb{r}", "master", "br0")
      _run("ip", "-n", self.bridge_ns, "link", "set", f"vb{r}", "up")
      _run("ip", "-n", ns, "addr", "add", f"{self.address(r)}/24", "dev", "eth0")
      _run("ip", "-n", ns, "link", "set", "eth0", "up")
      _run("ip", "-n", ns, "link", "set", "lo", "up")
      etc = os.path.join("/etc/netns", ns)
      os.makedirs(etc, exist_ok=True)
      with open(os.path.join(etc, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n{self.address(r)} {host}\n")

  def _add_ns(self, ns: str) -> None:
    _run("ip", "netns", "add", ns)
    self.namespaces.append(ns)

  def close(self) -> None:
    """Removes every namespace (their links go with them) and hosts file; idempotent."""
    errors = []
    for ns in reversed(self.namespaces):
      try:
        _run("ip", "netns", "del", ns)
      except NetworkError as e:
        errors.append(str(e))
      shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    self.namespaces = []
    if self._old_sigterm is not None:
      signal.signal(signal.SIGTERM, self._old_sigterm)
      self._old_sigterm = None
    if errors:
      raise NetworkError("cleanup failed: " + "; ".join(errors))

  # -- addressing -----------------------------------------------------------

  def worker_ns(self, r: int) -> str:
    return f"{self.prefix}-w{r}"

  def address(self, r: int) -> str:
    return f"{SUBNET}.{r + 1}"

  def exec_prefix(self, r: int) -> list[str]:
    """Command prefix that runs a program inside worker ``r``'s namespace."""
    return ["ip", "netns", "exec", self.worker_ns(r)]

  # -- shaping --------------------------------------------------------------

  def set_rate(self, rate_mbit: float | None, delay_ms: float = 0.0) -> None:
    """Limits every link to ``rate_mbit`` Mbit/s each way (None: unshaped).

    ``delay_ms`` adds one-way latency per link end with ``netem``; a kernel
    (or sandbox) without netem gets a :class:`NetworkError` saying so.
    """
    if rate_mbit is not None and not rate_mbit > 0:
      raise ValueError(f"rate_mbit={rate_mbit} must be positive (or None for no limit)")
    for r in range(self.workers):
      for ns, dev in ((self.worker_ns(r), "eth0"), (self.bridge_ns, f"vb{r}")):
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                       capture_output=True)  # absent the first time: fine
        if rate_mbit is None and not delay_ms:
          continue
        if delay_ms:
          cmd = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay",
                 f"{delay_ms}ms"]
          if rate_mbit is not None:
            cmd += ["rate", f"{rate_mbit}mbit"]
          try:
            _run(*cmd)
          except NetworkError as e:
            raise NetworkError(f"{e}. Link delay needs the netem qdisc, which this kernel "
                               f"lacks; run without --delay-ms") from None
        else:
          # burst: >= 2 ms of traffic (and 64 KiB) so the bucket never starves the rate
          burst = max(64 << 10, int(rate_mbit * 1e6 / 8 * 2e-3))
          _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
               f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")
    self.rate_mbit, self.delay_ms = rate_mbit, delay_ms

  def set_link(self, r: int, up: bool) -> None:
    """Takes worker ``r``'s link down or up (fault injection)."""
    _run("ip", "-n", self.bridge_ns, "link", "set", f"vb{r}", "up" if up else "down")


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # someone else's live process
    return True
  return True


def _listed_namespaces() -> list[str]:
  """Names from ``ip netns list`` (lines like ``dqn12-w0 (id: 3)``) and /etc/netns."""
  names = _netns_names()
  with contextlib.suppress(OSError):
    names += os.listdir("/etc/netns")
  return list(dict.fromkeys(names))


def sweep_stale() -> list[str]:
  """Removes the namespaces and ``/etc/netns/<ns>`` folders left by networks of runs that
  died without cleaning up (SIGKILL): names ``dqn<pid>-br`` / ``dqn<pid>-w<r>`` (the
  default prefix) whose ``pid`` is no longer a running process. Namespaces of live pids
  and every other name are left alone. (The veths and the bridge live inside those
  namespaces and go with them; nothing is created in the root namespace.) Returns the
  names removed; errors are printed, not raised: a sweep must not stop a benchmark.
  """
  swept = []
  for ns in _listed_namespaces():
    m = _DEFAULT_NS.fullmatch(ns)
    if not m or _pid_alive(int(m.group(1))):
      continue
    res = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
    gone = res.returncode == 0 or ns not in _netns_names()  # or only its folder was left
    shutil.rmtree(os.path.join("/etc/netns", ns), ignore_errors=True)
    if gone:
      swept.append(ns)
    else:
      print(f"NOTE: could not remove the stale namespace {ns}: {res.stderr.strip()}",
            file=sys.stderr, flush=True)
  if swept:
    print(f"removed {len(swept)} namespace(s) left by killed runs: {', '.join(swept)}",
          flush=True)
  return swept


def _netns_names() -> list[str]:
  res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
  return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _raise_sigterm(signum, frame):
  raise SystemExit(f"terminated by signal {signum}")
