""":mod:`dynamiq_jax.bench.sharded`'s report: the text ``main`` prints and writes to
``sharded.md``, from a results file's payload alone (``--render``), and the gradient's
share of memory the report compares with.
"""

from __future__ import annotations

__all__ = ["HEADER_BYTES", "CATEGORIES", "GRADIENT", "gradient_bytes", "gradient_floor",
           "report_lines", "render"]

HEADER_BYTES = 66
"""Ethernet (14) + IPv4 (20) + TCP with timestamps (32) bytes per packet."""

CATEGORIES = ("gathered parameters", "activations", "backward", "reduction", "optimizer update",
              "other")
"""The scratch categories of :func:`~dynamiq_jax.bench.sharded.categorize`, in the order the
report prints them."""

GRADIENT = ("backward", "reduction")
"""The categories that together hold the gradient."""


def gradient_bytes(split: dict) -> int:
  """The gradient's bytes in a category split (:data:`GRADIENT`)."""
  return int(sum(split.get(c, 0) for c in GRADIENT))


def gradient_floor(layers: int, n: int = 8) -> float:
  """The least of its local gradient a sharded step over ``n`` devices can hold at once, as
  a fraction, for ``layers`` equal layers reduced one at a time: one layer's whole gradient
  and the ``1 / n`` shards of the others."""
  return 1 / layers + (1 - 1 / layers) / n


def report_lines(payload) -> list[str]:
  """The report of ``payload`` (what main prints and writes to sharded.md)."""
  out = []
  for row in payload.get("hlo", []):
    out.append(f"\n== compiled tensor-layout step, {row['axis_types']} axes, mesh "
               f"{row['mesh']} ==")
    for k, v in row["collectives"].items():
      out.append(f"  {v:3d} x {k}")
    out.append("  over model:")
    for m in row["over_model"]:
      out.append(f"    {m['op']:<20}{m['shape']:<40}{m['op_name'][-60:]}")
  if payload.get("memory"):
    out += _memory_lines(payload["memory"])
  if payload.get("gradient"):
    out += _gradient_lines(payload["gradient"])
  h = payload.get("hsdp")
  if h:
    how = "network namespaces" if h["namespaces"] else "loopback: bytes not measured"
    out.append(f"\n== hsdp over 2 processes x 4 devices ({how}) ==")
    out.append(f"losses bit-identical to the one-process run: {h['bit_identical']} "
               f"({len(h['loss_bits_simulated'])} steps; last {h['losses_simulated'][-1]:.6f})")
    e = h["expected"]
    out.append(f"DynamiQ on the slow axis per step: {e['per_device']:,.0f} B per device, "
               f"{e['per_process']:,.0f} B per process ({e['bits_per_coord']:.3f} bits/coord)")
    for link in h["links"]:
      if link.get("measured"):
        out.append(f"process {link['rank']}: link tx {link['tx_bytes']:,.0f} B/step "
                   f"({link['tx_packets']:.0f} packets; minus {HEADER_BYTES} B headers each: "
                   f"{link['tx_payload_estimate']:,.0f} B = "
                   f"{link['tx_payload_estimate'] / e['per_process']:.3f}x expected), "
                   f"rx {link['rx_bytes']:,.0f} B/step")
  return out


def _memory_lines(rows) -> list[str]:
  """The memory part of the report: memory_analysis() per layout, then the peak's split."""
  big = max(r["temp_bytes"] for r in rows) >= 1e7
  unit, scale = ("MB", 1e6) if big else ("kB", 1e3)
  mb = lambda b: f"{b / scale:.1f}"
  out = [f"\n== memory_analysis() per device, bytes (x: of the {rows[0]['layout']} "
         f"layout's at the same bucket size) ==",
         f"{'layout':<8}{'mesh':<26}{'bucket':>10}{'params':>12}{'Adam state':>20}"
         f"{'arguments':>13}{'temp':>20}"]
  base = {}
  for r in rows:
    size = r.get("bucket_size", 0)
    opt, temp = r["optimizer_bytes_per_device"], r["temp_bytes"]
    b = base.setdefault(size, (opt, temp))
    out.append(f"{r['layout']:<8}{str(r['mesh']):<26}{_pow2(size):>10}"
               f"{r['param_bytes_per_device']:>12,}{opt:>13,} {opt / b[0]:>5.3f}x"
               f"{r['argument_bytes']:>13,}{temp:>13,} {temp / b[1]:>5.3f}x")
  out.append("(arguments: parameters and optimizer state, every step. temp: XLA's scratch "
             "allocation for the step, split below)")
  split = [r for r in rows if "peak" in r]
  if not split:
    return out
  out.append(f"\n== the scratch at the step's peak, per device, {unit} (XLA's buffer "
             f"assignment, dynamiq_jax.bench.buffers) ==")
  head = (f"{'layout':<8}{'bucket':>7}" + "".join(f"{c.split()[0][:10]:>12}" for c in CATEGORIES)
          + f"{'live':>9}{'packing':>9}{'temp':>9}{'gradient':>10}{'x':>7}")
  out.append(head)
  base = {}
  for r in split:
    p = r["peak"]
    at = p["at_peak"]
    grad = gradient_bytes(at)
    b = base.setdefault(r["bucket_size"], grad)
    out.append(f"{r['layout']:<8}{_pow2(r['bucket_size']):>7}"
               + "".join(f"{mb(at.get(c, 0)):>12}" for c in CATEGORIES)
               + f"{mb(p['temp_live_at_peak']):>9}{mb(p['packing']):>9}{mb(r['temp_bytes']):>9}"
               f"{mb(grad):>10}{grad / max(b, 1):>6.3f}x")
  out.append(f"\n== the most bytes of each category live at once, at any point of the step, "
             f"per device, {unit} ==")
  out.append(f"{'layout':<8}{'bucket':>7}" + "".join(f"{c.split()[0][:10]:>12}" for c in CATEGORIES)
             + f"{'gradient':>10}{'x':>7}{'whole':>8}{'at':>7}{'bwd end':>9}")
  base = {}
  for r in split:
    most = r["peak"]["own_max"]
    grad = most.get("gradient", 0)
    b = base.setdefault(r["bucket_size"], grad)
    out.append(f"{r['layout']:<8}{_pow2(r['bucket_size']):>7}"
               + "".join(f"{mb(most.get(c, 0)):>12}" for c in CATEGORIES)
               + f"{mb(grad):>10}{grad / max(b, 1):>6.3f}x{mb(r['param_bytes']):>8}"
               + _when(r["peak"]))
  out.append("(categories by the op_name of the instruction defining each buffer: gathered: "
             "the gather_params scope; activations: jvp(...), the forward pass; backward: "
             "transpose(jvp(...)), parameter gradients and activation cotangents; reduction: "
             "the compressed_psum / compressed_psum_scatter scopes, gradient buckets, codec "
             "buffers, the reduced gradient; optimizer: the rest of the optimizer scope. "
             "gradient = backward + reduction; x: of the data layout's. at: where in the "
             "step's schedule the gradient is at its most, bwd end: where the backward pass "
             "defines its last buffer, both as fractions of the scheduled instructions. live: "
             "scratch bytes "
             "live at the peak (buffers sharing a slot counted once); packing: temp - live, "
             "what XLA's heap layout adds; whole: the model's parameter bytes)")
  return out


def _when(p) -> str:
  """Where the gradient is at its most and where the backward pass ends, as fractions of
  the schedule (blank for results written before these were recorded)."""
  if "own_max_time" not in p or "gradient" not in p["own_max_time"]:
    return ""
  length = max(p["program_length"], 1)
  end = p["last_defined"].get("backward")
  return (f"{p['own_max_time']['gradient'] / length:>7.2f}"
          + (f"{end / length:>9.2f}" if end is not None else f"{'-':>9}"))


def _pow2(size) -> str:
  """``2^k`` for a power of two, else the number."""
  size = int(size or 0)
  return f"2^{size.bit_length() - 1}" if size and size & (size - 1) == 0 else f"{size:,}"


def _gradient_lines(rows) -> list[str]:
  """Part 4 of the report: the gradient's memory, per scheduler and path."""
  first = rows[0]
  mlp, whole = first["mlp"], first["local_gradient_bytes"]
  unit, scale = ("MB", 1e6) if whole >= 1e7 else ("kB", 1e3)
  mb = lambda b: f"{b / scale:.1f}"
  out = [f"\n== the gradient in the sharded-optimizer step: a {mlp['layers']}-layer "
         f"{mlp['dim']} x {mlp['dim']} MLP ({mb(whole)} {unit} of float32 gradient per device, "
         f"{mlp['batch']} rows per device), buckets of {_pow2(first['bucket_size'])}, per "
         f"device, {unit} ==",
         f"{'scheduler':<13}{'path':<11}{'params':>8}{'Adam':>8}{'temp':>8}{'gradient most':>15}"
         f"{'x whole':>9}{'x repl.':>9}{'at peak':>9}"]
  base = {r["scheduler"]: r["gradient_most_live"] for r in rows if r["path"] == "replicated"}
  for r in rows:
    most = r["gradient_most_live"]
    out.append(f"{r['scheduler']:<13}{r['path']:<11}{mb(r['param_bytes_per_device']):>8}"
               f"{mb(r['optimizer_bytes_per_device']):>8}{mb(r['temp_bytes']):>8}"
               f"{mb(most):>15}{most / whole:>8.3f}x"
               f"{most / max(base.get(r['scheduler'], 0), 1):>8.3f}x"
               f"{mb(r['gradient_at_peak']):>9}")
  out.append(f"(scheduler: XLA:CPU's --xla_cpu_enable_concurrency_optimized_scheduler, true "
             f"(concurrency, its default) or false (memory); h100: XLA's GPU compiler for 8 "
             f"compile-only H100s (deviceless). params, Adam: argument bytes per "
             f"device; temp: memory_analysis()'s scratch. gradient most: the most backward "
             f"values + reduction buffers live at once; at peak: those live at the scratch's "
             f"peak. x whole: of the local gradient; x repl.: of the replicated step's under "
             f"the same scheduler. A sharded step holds at least, while it reduces the "
             f"last layer, that layer's local gradient and the other layers' 1/8 shards: "
             f"{gradient_floor(mlp['layers']):.3f}x whole)")
  return out


def render(payload) -> str:
  """``sharded.md``: the command, the machine and the report of ``payload``."""
  m = payload["machine"]
  head = [f"# Sharded models ({'tiny smoke run' if payload.get('tiny') else 'bench.sharded'})",
          "", "Written by `python -m dynamiq_jax.bench.sharded`; do not edit.", "",
          f"- command: `{payload['command']}`",
          f"- machine: {m['platform']}, {m['cpu_count']} CPUs, jax {m['jax']}, "
          f"{m['device_count']} {m['backend']} devices, commit {m.get('git_commit', '?')}, "
          f"{m['date']}"]
  for part, earlier in payload.get("kept", {}).items():
    e = earlier["machine"]
    head.append(f"- {part}: kept from `{earlier['command']}` (commit "
                f"{e.get('git_commit', '?')}, {e['date']})")
  head += ["", "```"]
  return "\n".join(head + [line.lstrip("\n") if i == 0 else line
                           for i, line in enumerate(report_lines(payload))] + ["```", ""])
