"""Codec cost of one step on one GPU, set against the wire time it saves.

    python -m dynamiq_jax.bench.codec_cost           # 2^28 and 2^30 coordinates, 8 ranks
    python -m dynamiq_jax.bench.codec_cost --tiny    # anywhere, a smoke test (CI)

The all-reduce of one gradient of ``N`` coordinates (``--log2-coords``, default
2^28 and 2^30: about 1 B) over ``--ranks`` ranks (8) is simulated on one device
with :func:`dynamiq_jax.simulate` (ring schedule, default bucketing): the
gradients, random normal with a different scale on each rank, are stacked
``[ranks, N]`` and reduced by ``jax.jit(lambda g, key: dq.simulate(g, codec=codec,
key=key))``. For every size and codec (``--codecs``: DynamiQ's default and MXFP8;
bf16 always, as the reference) it records the lower + compile seconds, runs one
warm-up call, then ``--repeats`` timed calls, each with a new rounding key and
synchronised before the host clock is read, and keeps the median.

On one device the ranks run one after another and the simulated wire is a
device copy, so the codec seconds per rank per step are the median over
``ranks``; the bf16 row (uncompressed bf16 partial sums through the same
schedule) shows what that data movement itself costs, and "net of bf16" is
``(t_codec - t_bf16) / ranks``.

Wire: the bits per coordinate are the library's own accounting
(:func:`dynamiq_jax.wire_stats`: payloads, metadata and padding, and any bucket
a codec declines sent as bf16; 16 for bf16), and each rank of the ring sends
``2 (n - 1) / n * N * bits / 8`` bytes, ``bytes * 8 / (R * 1e9)`` seconds at
``R`` Gbit/s per GPU (``--rates``: 100, 400, 800). The bf16 baseline's step is
its wire time alone (its adds are not counted). For every size, codec and rate
the table gives the codec's step communication time "serial" (codec + wire:
nothing overlaps) and "overlapped" (max of the two: encoding one bucket while
another is on the wire), each with its speedup over bf16, and the break-even
link rate below which compression pays: serial, the rate where codec + wire =
bf16's wire, ``(bytes_bf16 - bytes_codec) * 8 / codec_s / 1e9`` Gbit/s;
overlapped, ``bytes_bf16 * 8 / codec_s / 1e9``; "always" where the codec costs
nothing (net of bf16 at or below zero) and "never" where it sends no fewer
bytes than bf16.

It runs anywhere; off GPU (and with ``--tiny``, 2^14 coordinates on 4 ranks)
the numbers only show that the benchmark runs. It prints the device kind, the
jax version and the command, and writes ``docs/results/codec_cost.json``
(``codec_cost_tiny.json`` with ``--tiny``; ``--out`` elsewhere), rewritten
after every size and codec (``"complete": false`` until the run ends), so that
a run cut short keeps its rows. A size or codec that fails (out of memory, a
kernel that does not lower) is recorded in its row (``error``), printed, and
the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

__all__ = ["main", "build_parser", "CODECS", "break_even"]

CODECS = ("bf16", "dynamiq", "mxfp8")
"""Codec names ``--codecs`` accepts (bf16 is timed in every run, as the reference)."""

NOTE = ("on one device the ranks run one after another and the simulated wire is a device "
        "copy: codec s per rank = step time / ranks; the bf16 row is that copy's own cost, and "
        "'net' subtracts it")


def _codec(name: str):
  """The codec object called ``name``: DynamiQ's default, MXFP8 (E4M3, the paper's
  multi-hop adaptation, 8.5 bits/coordinate) or the bf16 reference."""
  from dynamiq_jax import codecs
  return {"bf16": codecs.Bf16, "dynamiq": codecs.DynamiQ, "mxfp8": codecs.mxfp8}[name]()


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.codec_cost",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--log2-coords", default="28,30",
                 help="comma-separated log2 of the gradient's coordinates, run smallest first")
  p.add_argument("--ranks", type=int, default=8, help="ranks of the simulated all-reduce")
  p.add_argument("--codecs", default="dynamiq,mxfp8",
                 help=f"comma-separated codecs timed beside bf16, from {', '.join(CODECS)}")
  p.add_argument("--rates", default="100,400,800",
                 help="comma-separated link rates per GPU, Gbit/s")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                 help="dtype of the gradient")
  p.add_argument("--repeats", type=int, default=3, help="timed calls; the median is kept")
  p.add_argument("--tiny", action="store_true",
                 help="smoke test (CI): 2^14 coordinates, 4 ranks, 1 repeat")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  p.add_argument("--summarize", default=None, metavar="JSON",
                 help="print the table of a run written earlier (complete or cut short); "
                      "times nothing")
  from dynamiq_jax.bench import common
  common.add_load_flags(p)
  return p


def _parse(argv):
  """The flags, checked: (args, sizes smallest first, codec names with bf16 first, rates)."""
  p = build_parser()
  args = p.parse_args(argv)
  if args.tiny:
    args.log2_coords, args.ranks, args.repeats = "14", 4, 1
  try:
    logs = sorted({int(v) for v in args.log2_coords.split(",") if v.strip()})
  except ValueError:
    p.error(f"--log2-coords {args.log2_coords!r}: give comma-separated integers, e.g. 28,30")
  if not logs or not all(1 <= v <= 40 for v in logs):
    p.error(f"--log2-coords {args.log2_coords!r}: give integers from 1 to 40")
  names = [v.strip() for v in args.codecs.split(",") if v.strip()]
  for name in names:
    if name not in CODECS:
      p.error(f"--codecs: {name!r} is not one of {', '.join(CODECS)}")
  names = ["bf16"] + [v for v in dict.fromkeys(names) if v != "bf16"]
  try:
    rates = [float(v) for v in args.rates.split(",") if v.strip()]
  except ValueError:
    p.error(f"--rates {args.rates!r}: give comma-separated Gbit/s, e.g. 100,400,800")
  if not rates or min(rates) <= 0:
    p.error(f"--rates {args.rates!r}: every rate must be > 0 Gbit/s")
  if args.ranks < 2:
    p.error(f"--ranks={args.ranks} must be at least 2")
  if args.repeats < 1:
    p.error(f"--repeats={args.repeats} must be at least 1")
  return args, logs, names, rates


def break_even(bytes_codec: float, bytes_bf16: float, codec_s: float | None,
               *, overlapped: bool = False):
  """Link rate (Gbit/s per GPU) below which the codec's step beats bf16's wire time:
  serial, ``codec_s + wire_codec < wire_bf16`` up to ``(bytes_bf16 - bytes_codec) * 8 /
  codec_s / 1e9``; overlapped, ``max(codec_s, wire_codec) < wire_bf16`` up to
  ``bytes_bf16 * 8 / codec_s / 1e9``. "never" where the codec sends no fewer bytes,
  "always" where it costs no time (``codec_s <= 0``), None without a time."""
  if codec_s is None:
    return None
  if bytes_codec >= bytes_bf16:
    return "never"
  if codec_s <= 0:
    return "always"
  return (bytes_bf16 if overlapped else bytes_bf16 - bytes_codec) * 8 / codec_s / 1e9


def _time_codec(codec, g, repeats: int) -> dict:
  """Lower + compile seconds, then one warm-up and ``repeats`` timed calls of the
  simulated all-reduce of ``g`` (a new key each), synchronised; seconds of each."""
  import jax

  import dynamiq_jax as dq

  step = jax.jit(lambda g, key: dq.simulate(g, codec=codec, key=key))
  start = time.perf_counter()
  compiled = step.lower(g, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - start
  jax.block_until_ready(compiled(g, jax.random.key(0)))  # warm-up; the result is dropped
  seconds = []
  for i in range(repeats):
    key = jax.block_until_ready(jax.random.key(i + 1))
    start = time.perf_counter()
    jax.block_until_ready(compiled(g, key))
    seconds.append(time.perf_counter() - start)
  return {"compile_s": compile_s, "seconds": seconds, "median_s": statistics.median(seconds)}


def _gradients(n: int, ranks: int, dtype):
  """``[ranks, n]`` random normal gradients made on the device, rank r scaled by 2^(r/2)."""
  import jax
  import jax.numpy as jnp

  @jax.jit
  def make(key):
    scale = jnp.exp2(jnp.arange(ranks, dtype=jnp.float32) / 2)[:, None]
    return (jax.random.normal(key, (ranks, n), jnp.float32) * scale).astype(dtype)

  return jax.block_until_ready(make(jax.random.key(1234)))


def _wire(codec, n: int, ranks: int, dtype) -> dict:
  """The library's wire accounting of the all-reduce (:func:`dynamiq_jax.wire_stats`)."""
  import jax

  import dynamiq_jax as dq
  st = dq.wire_stats(jax.ShapeDtypeStruct((n,), dtype), codec=codec, n=ranks)
  return {"bits_per_coord": float(st.bits_per_coord), "bytes_per_rank": float(st.bytes_per_rank),
          "uncompressed_coords": int(st.uncompressed)}


def _table(runs: list[dict], rates: list[float]) -> list[dict]:
  """Per size, compressed codec and rate: codec and wire seconds, serial and overlapped
  step communication time, bf16's wire time, speedups and break-even rates."""
  rows = []
  for run in runs:
    if run["codec"] == "bf16" or "bytes_per_rank" not in run:
      continue
    ref = next((r for r in runs if r["codec"] == "bf16" and r["coords"] == run["coords"]), None)
    if ref is None or "bytes_per_rank" not in ref:
      continue
    codec_s, net_s = run.get("codec_s_per_rank"), run.get("codec_s_per_rank_net")
    for rate in rates:
      wire_s = run["bytes_per_rank"] * 8 / (rate * 1e9)
      bf16_s = ref["bytes_per_rank"] * 8 / (rate * 1e9)
      row = {"log2_coords": run["log2_coords"], "coords": run["coords"], "codec": run["codec"],
             "rate_gbps": rate, "bits_per_coord": run["bits_per_coord"],
             "codec_s_per_rank": codec_s, "codec_s_per_rank_net": net_s,
             "wire_s": wire_s, "bf16_wire_s": bf16_s}
      if codec_s is not None:
        serial, overlapped = codec_s + wire_s, max(codec_s, wire_s)
        row.update(serial_s=serial, overlapped_s=overlapped, speedup_serial=bf16_s / serial,
                   speedup_overlapped=bf16_s / overlapped)
      for k in ("break_even_gbps_serial", "break_even_gbps_overlapped",
                "break_even_gbps_serial_net"):
        row[k] = run.get(k)
      rows.append(row)
  return rows


def _fmt_be(v) -> str:
  """A break-even rate as printed: Gbit/s, "always", "never" or "-"."""
  return "-" if v is None else v if isinstance(v, str) else f"{v:.4g}"


def _print_table(runs: list[dict], table: list[dict]):
  """The bf16 reference per size, then the codec/wire table, then the break-even rates."""
  for ref in (r for r in runs if r["codec"] == "bf16"):
    what = (f"{ref['codec_s_per_rank'] * 1e3:.4g} ms per rank per step" if "median_s" in ref
            else ref.get("error", "not run"))
    print(f"2^{ref['log2_coords']} coords, bf16 (the simulation's own data movement): {what}")
  print("\nms per rank per step; serial = codec + wire, overlapped = max(codec, wire); "
        "x = bf16 wire / that")
  print(f"{'coords':>6} {'codec':<8} {'bits':>6} {'Gbit/s':>6} {'codec':>10} {'net bf16':>10} "
        f"{'wire':>10} {'bf16 wire':>10} {'serial':>10} {'overlap':>10} {'x serial':>8} "
        f"{'x overl':>8}")

  def ms(v):
    return f"{'-':>10}" if v is None else f"{v * 1e3:>10.4g}"

  for r in table:
    print(f"{'2^' + str(r['log2_coords']):>6} {r['codec']:<8} {r['bits_per_coord']:>6.3f} "
          f"{r['rate_gbps']:>6g} {ms(r['codec_s_per_rank'])} {ms(r['codec_s_per_rank_net'])} "
          f"{ms(r['wire_s'])} {ms(r['bf16_wire_s'])} {ms(r.get('serial_s'))} "
          f"{ms(r.get('overlapped_s'))} {r.get('speedup_serial', float('nan')):>8.3f} "
          f"{r.get('speedup_overlapped', float('nan')):>8.3f}")
  print("\nbreak-even link rate (Gbit/s per GPU) below which compression pays:")
  for r in runs:
    if r["codec"] == "bf16":
      continue
    head = f"  2^{r['log2_coords']} {r['codec']:<8}"
    if "error" in r:
      print(f"{head} {r['error']}")
      continue
    print(f"{head} serial {_fmt_be(r.get('break_even_gbps_serial'))} (net of bf16: "
          f"{_fmt_be(r.get('break_even_gbps_serial_net'))}), overlapped "
          f"{_fmt_be(r.get('break_even_gbps_overlapped'))}")


def summarize(path: str) -> dict:
  """The table of a JSON written earlier (a run cut short too), printed; returns it."""
  with open(path) as f:
    payload = json.load(f)
  payload["table"] = _table(payload["runs"], payload["rates_gbps"])
  print(f"codec cost on {payload['device_kind']} (jax {payload['jax']}), "
        f"{payload['ranks']} ranks, {payload['dtype']} gradient; "
        f"{'complete' if payload['complete'] else 'cut short'}: {payload['command']}")
  _print_table(payload["runs"], payload["table"])
  return payload


def main(argv=None) -> dict:
  args, logs, names, rates = _parse(argv)
  if args.summarize:
    return summarize(args.summarize)
  import jax
  import jax.numpy as jnp

  from dynamiq_jax.bench import common

  device = jax.devices()[0]
  kind = getattr(device, "device_kind", device.platform)
  dtype = jnp.dtype(args.dtype)
  path = os.path.join(common.results_dir(args.out),
                      "codec_cost_tiny.json" if args.tiny else "codec_cost.json")
  print(f"codec cost on {kind} ({jax.default_backend()}, jax {jax.__version__}); "
        f"{args.ranks} ranks, {args.dtype} gradient; command: {common.command_line()}",
        flush=True)
  print(NOTE, flush=True)
  if jax.default_backend() != "gpu" or args.tiny:
    print("not a GPU-sized run: these numbers only show that the benchmark runs", flush=True)
  runs: list[dict] = []

  def save(complete: bool) -> dict:
    """The JSON so far (rewritten after every size and codec: a run cut short keeps its rows)."""
    payload = {
        "command": common.command_line(), "machine": common.machine(), "device_kind": kind,
        "backend": jax.default_backend(), "jax": jax.__version__, "ranks": args.ranks,
        "dtype": args.dtype, "repeats": args.repeats, "rates_gbps": rates,
        "schedule": "ring", "note": NOTE, "complete": complete, "runs": runs,
        "table": _table(runs, rates)}
    common.write_json(path, payload, strict=args.strict)
    return payload

  for log2 in logs:
    n = 1 << log2
    g, failed = None, None
    try:
      g = _gradients(n, args.ranks, dtype)
    except Exception as e:  # recorded for every codec of this size; the next size still runs
      failed = f"gradients: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    for name in names:
      codec = _codec(name)
      run = {"log2_coords": log2, "coords": n, "codec": name, "codec_repr": repr(codec)}
      try:
        run.update(_wire(codec, n, args.ranks, dtype))
        if g is None:
          run["error"] = failed
        else:
          with common.load_watch(f"2^{log2} {name}"):  # in the JSON's "load" record
            run.update(_time_codec(codec, g, args.repeats))
      except Exception as e:  # recorded, so that the other codecs and sizes still run
        run["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
      if "error" in run:
        print(f"2^{log2} {name}: {run['error']}", file=sys.stderr, flush=True)
      if "median_s" in run:
        run["codec_s_per_rank"] = run["median_s"] / args.ranks
        print(f"2^{log2} {name}: {run['median_s'] * 1e3:.4g} ms per step "
              f"(compile {run['compile_s']:.1f} s), {run['bits_per_coord']:.3f} bits/coord",
              file=sys.stderr, flush=True)  # progress, in case the run is cut short
      ref = next((r for r in runs if r["codec"] == "bf16" and r["coords"] == n), None)
      if name != "bf16" and "codec_s_per_rank" in run:
        net = (run["median_s"] - ref["median_s"]) / args.ranks if ref and "median_s" in ref \
            else None
        run["codec_s_per_rank_net"] = net
        if ref and "bytes_per_rank" in ref:
          b, b16 = run["bytes_per_rank"], ref["bytes_per_rank"]
          run["break_even_gbps_serial"] = break_even(b, b16, run["codec_s_per_rank"])
          run["break_even_gbps_overlapped"] = break_even(b, b16, run["codec_s_per_rank"],
                                                         overlapped=True)
          run["break_even_gbps_serial_net"] = break_even(b, b16, net)
      runs.append(run)
      save(complete=False)
    del g  # the next size's gradients need the memory
  payload = save(complete=True)
  print()
  _print_table(runs, payload["table"])
  print(f"\nwrote {path}\ncommand: {payload['command']}")
  return payload


if __name__ == "__main__":
  main()
