"""Kernel benchmark: DynamiQ's hop kernels, Pallas vs the unfused XLA reference.

    python -m dynamiq_jax.bench.kernels --gpu     # GPU only: docs/results/kernels_gpu.json
    python -m dynamiq_jax.bench.kernels --tiny    # anywhere (CPU: interpret mode), a smoke test

Times the kernels of the default codec (:mod:`pallas_kernels.dynamiq`:
compress, decompress and the ring hop decompress-accumulate-recompress,
"DAR"; width set (2, 3, 4, 5, 6, 8), 1-bit planes, ``strata=8``), each on a
chunk whose super-groups all have one width (``--widths``, default 4 and 5),
against the XLA reference of the same operation and against a plain copy;
it reports GB/s of minimal traffic and coordinates per second, names the
device (``jax.devices()[0].device_kind``) and writes
``docs/results/kernels_gpu.json`` (``kernels_interpret.json`` off GPU),
rewritten after every chunk (``"complete": false`` until the run ends), so that
a run cut short keeps what it measured.
With ``--gpu`` and no GPU it exits with status 1 and a message that says so.

For every size, width and operation it times the Pallas kernel and the jnp
reference compiled by XLA, each after a warm-up, as the median over repeats
of ``reps`` back-to-back launches inside one jitted loop (the loop index is
tied to the inputs with an optimisation barrier so that XLA cannot hoist the
work), synchronised before the host clock is read. Achieved GB/s count the
*minimal* bytes of each operation — payload in + local values in + payload
out (decoded float32 out for decompress) — and are set against the device's
copy bandwidth measured in the same run (read + write of a large float32
array).

On a GPU it also times the Mosaic GPU kernels
(:mod:`pallas_kernels.dynamiq_mosaic`, ``impl`` "mosaic") beside Triton's,
for every op, on the same payloads in the planar layout (converted once,
outside the timed loop). Compress and the ring hop include the XLA placement
of the plane units that follows their launch. ``impl`` "mosaic_record" times
the same kernels on the record payload through dispatch
(``implementation="mosaic"``), the record <-> planar conversions included:
the cost the training step pays while the wire carries records. A failure
(a kernel that does not lower on this GPU or jax) is recorded in its row
(``error``) and printed, and the other rows still run.
Off GPU the Mosaic GPU kernels are not timed: GPU interpret mode is a
simulator, and ``tests/test_mosaic_gpu.py`` checks their bits.

It also records which Pallas GPU backends can lower a level-table gather
(the capability that decided Triton over Mosaic GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from dynamiq_jax.codecs.dynamiq import LEVEL_SETS

__all__ = ["main"]

OPS = ("compress", "decompress_accumulate_recompress", "decompress")
IMPLS = ("pallas", "xla", "mosaic", "mosaic_record")
SWEEP = ((4, 2), (8, 4), (16, 8), (8, 2), (16, 4), (32, 8), (32, 4))
"""(block, num_warps) launches of the Triton kernels that ``--sweep`` times: 1, 2 and
4 scale groups per thread (``16 block / (32 num_warps)``), programs of 64 to 256
threads; a thread's code depends only on its groups (``tools/sass_count.py
--launch``: about the same instructions per coordinate at every launch)."""


def build_parser() -> argparse.ArgumentParser:
  """The benchmark's flags (``--help`` shows each with its default)."""
  p = argparse.ArgumentParser(prog="python -m dynamiq_jax.bench.kernels",
                              description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--log2-sizes", default="20,22,24,26,28",
                 help="comma-separated log2 of coordinates per call")
  p.add_argument("--widths", default="4,5",
                 help="code widths of the chunks timed ('': none, e.g. for --sweep alone)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                 help="dtype of the local values")
  p.add_argument("--reps", type=int, default=20, help="launches per timed loop")
  p.add_argument("--repeats", type=int, default=5, help="timed loops; the median is kept")
  p.add_argument("--tiny", action="store_true", help="smoke-test sizes (CI)")
  p.add_argument("--out", default=None, help="results directory; unset: docs/results")
  p.add_argument("--gpu", action="store_true", help="fail unless a GPU runs the kernels")
  p.add_argument("--level-set", default=LEVEL_SETS[0], choices=LEVEL_SETS,
                 help="DynamiQ's levels (the codec's level_set; default: the codec's)")
  p.add_argument("--impls", default=",".join(IMPLS),
                 help="comma-separated implementations timed (mosaic ones on a GPU only)")
  p.add_argument("--sweep", action="store_true",
                 help="also time the Triton kernels at every launch of --launches")
  p.add_argument("--launches", default=",".join(f"{b}x{w}" for b, w in SWEEP),
                 help="the sweep's (block)x(num_warps) launches")
  p.add_argument("--sweep-log2-sizes", default="24,28", help="the sweep's sizes (log2)")
  p.add_argument("--sweep-widths", default="4", help="the sweep's code widths")
  p.add_argument("--sweep-ops", default="compress,decompress_accumulate_recompress",
                 help="the operations the sweep times")
  from dynamiq_jax.bench import common
  common.add_load_flags(p)
  return p


def _setup(args):
  """(sizes, dtype, device kind, timer, copy GB/s): what every run of this benchmark
  needs; ``--tiny`` also shrinks the repetitions. The copy is a read + write of
  the largest float32 buffer used."""
  import jax
  import jax.numpy as jnp
  if args.tiny:
    sizes = [1 << 12]
    args.reps, args.repeats = 2, 1
  else:
    sizes = [1 << int(v) for v in args.log2_sizes.split(",")]
  device = jax.devices()[0]
  timed = _timer(args.reps, args.repeats)
  big = jnp.zeros((max(sizes),), jnp.float32)
  copy_s = timed(lambda i, a: a + jnp.asarray(i, jnp.float32), big)
  return (sizes, jnp.dtype(args.dtype), getattr(device, "device_kind", device.platform), timed,
          2 * big.nbytes / copy_s / 1e9)


def _parse(argv):
  return build_parser().parse_args(argv)


H100 = ("NVIDIA H100 80GB HBM3", 132)
"""(device_kind, cores) of the abstract GPU that :func:`backend_check` lowers for without one."""


def backend_check() -> tuple[str, dict]:
  """Whether each Pallas GPU backend lowers a level-table gather (cuda target).

  Lowered for this process's first GPU, or else for an abstract H100: jax >=
  0.11 compiles a Pallas GPU kernel for the GPU of the abstract mesh in
  context and assumes none on a CPU host (jax 0.10.2 assumed compute
  capability 9.0). Mosaic GPU is asked for through ``pallas_call`` with its
  compiler params, jax 0.10.2's route (deprecated there in favour of
  ``plgpu.kernel``); from jax 0.11 ``pallas_call`` has no Mosaic GPU
  lowering, and the error it raises is what is recorded. Each backend's own
  deprecation warning is ignored here, where it is tried on purpose.

  Returns:
    (the device kind lowered for, {backend: "lowers" or the error}).
  """
  import warnings

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.pallas import triton as pltr

  from pallas_kernels.dynamiq_triton import TRITON_DEPRECATION

  def kernel(tab_ref, idx_ref, o_ref):
    o_ref[...] = tab_ref[idx_ref[...]]

  def call(tab, idx, params):
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(idx.shape, jnp.float32), grid=(1,),
        in_specs=[pl.BlockSpec(tab.shape, lambda i: (0,)), pl.BlockSpec(idx.shape, lambda i: (0, 0))],
        out_specs=pl.BlockSpec(idx.shape, lambda i: (0, 0)), compiler_params=params)(tab, idx)

  auto = (jax.sharding.AxisType.Auto,)
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices("gpu")[:1]), ("gpu",),
                             axis_types=auto).abstract_mesh
  except RuntimeError:  # no GPU backend
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), axis_types=auto,
                                     abstract_device=jax.sharding.AbstractDevice(
                                         device_kind=H100[0], num_cores=H100[1],
                                         platform="gpu"))
  tab = jax.ShapeDtypeStruct((128,), jnp.float32)
  idx = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  out = {}
  for name, params in (("triton", pltr.CompilerParams(num_warps=4, num_stages=1)),
                       ("mosaic_gpu", plgpu.CompilerParams())):
    try:
      with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.filterwarnings("ignore", TRITON_DEPRECATION, DeprecationWarning)
        warnings.filterwarnings("ignore", "Using ``pl.pallas_call`` for Mosaic GPU",
                                DeprecationWarning)
        jax.jit(lambda t, i: call(t, i, params)).trace(tab, idx).lower(
            lowering_platforms=("cuda",))
      out[name] = "lowers"
    except Exception as e:  # report whatever the lowering says
      first = (str(e).splitlines() or [""])[0][:200]
      out[name] = f"{type(e).__name__}: {first}" if first else type(e).__name__
  return mesh.abstract_device.device_kind, out


def _timer(reps: int, repeats: int):
  """``timed(fn, *operands)``: median seconds per launch of ``fn(i, *operands)``
  over ``repeats`` jitted loops of ``reps`` launches."""
  import jax
  import jax.numpy as jnp

  def timed(fn, *operands):
    shape = jax.eval_shape(fn, jnp.int32(0), *operands)

    @jax.jit
    def loop(*ops):
      # The whole output is the loop carry, so XLA must produce all of it (a
      # reduction to one element would let it compute only that part).
      def body(i, carry):
        del carry
        tied = jax.lax.optimization_barrier((i, ops))[1]
        return fn(i, *tied)
      return jax.lax.fori_loop(0, reps, body, jnp.zeros(shape.shape, shape.dtype))

    jax.block_until_ready(loop(*operands))  # compile + warm-up
    jax.block_until_ready(loop(*operands))
    runs = []
    for _ in range(repeats):
      t = time.perf_counter()
      jax.block_until_ready(loop(*operands))
      runs.append((time.perf_counter() - t) / reps)
    return statistics.median(runs)

  return timed


def _copy_bandwidth(timed):
  """``copy_gbs(nbytes)``: GB/s of a device copy (read + write of a float32 array)
  that moves ``nbytes`` in all, timed once per byte count: the roofline of a
  kernel that must move as many bytes, measured rather than quoted."""
  import jax.numpy as jnp
  seen = {}

  def copy_gbs(nbytes: int) -> float:
    n = max(1, nbytes // 8)
    if n not in seen:
      a = jnp.zeros((n,), jnp.float32) + 1.0
      seen[n] = 8 * n / timed(lambda i, a: a + jnp.asarray(i, jnp.float32), a) / 1e9
    return seen[n]

  return copy_gbs


def _parse_launches(text: str):
  try:
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",") if item]
  except ValueError:
    raise SystemExit(f"--launches {text!r}: give (block)x(num_warps) pairs, e.g. 16x4,32x8")


def _timed_row(timed, f, operands, *, coords, minimal_bytes, copy_gbs, **row):
  """One result row: ``f`` timed on ``operands``, set against the device copy of as
  many bytes (``copy_gbs(minimal_bytes)``). A failure (a kernel that does not
  lower on this GPU or jax) is recorded in the row's ``error`` and printed, so that
  the other rows still run."""
  row.update(coords=coords, minimal_bytes=minimal_bytes)
  try:
    sec = timed(f, *operands)
  except Exception as e:  # recorded, so that the Triton and XLA rows still come back
    row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    print(row, file=sys.stderr, flush=True)
    return row
  copy = copy_gbs(minimal_bytes)
  row.update(seconds=sec, gbs=minimal_bytes / sec / 1e9, coords_per_s=coords / sec,
             copy_gbs=copy, fraction_of_copy=minimal_bytes / sec / 1e9 / copy)
  print(f"  {row['op']} {row['impl']}{row.get('launch', '')} w{row['width']} {coords}: "
        f"{sec * 1e3:.3f} ms, {row['fraction_of_copy']:.0%} of copy",
        file=sys.stderr, flush=True)  # progress, in case the run is cut short
  return row


def main(argv=None):
  args = _parse(argv)
  import jax
  import jax.numpy as jnp

  from dynamiq_jax.bench import common
  from dynamiq_jax.codecs.dynamiq import DynamiQ
  from pallas_kernels import dynamiq as K
  from pallas_kernels import dynamiq_mosaic as M
  from pallas_kernels import dynamiq_planar as P
  from pallas_kernels import dynamiq_reference as R
  from pallas_kernels import dynamiq_triton as T
  from pallas_kernels import rng

  on_gpu = jax.default_backend() == "gpu"
  if args.gpu and not on_gpu:
    sys.exit(f"no GPU: jax's default backend is {jax.default_backend()!r} "
             f"(devices: {jax.devices()}); run --gpu on a machine with a CUDA GPU, or "
             "without --gpu for an interpret-mode run (--tiny: a smoke test)")
  sizes, dtype, kind, timed, copy_gbs = _setup(args)
  print(f"{kind}: copy bandwidth {copy_gbs:.1f} GB/s", file=sys.stderr, flush=True)
  levels = DynamiQ(level_set=args.level_set).level_spec
  geo = dict(eps=levels, plane_bits=R.PLANE_BITS, width_set=R.WIDTH_SET)
  interpret = None if on_gpu else True

  def keys_of(i):
    a, b = rng.derive_key(i, 7)
    return (a, b, b, a)

  name = "kernels_gpu" if on_gpu else "kernels_interpret"
  path = os.path.join(common.results_dir(args.out), f"{name}{'_tiny' if args.tiny else ''}.json")

  def save(rows, complete: bool, **more):
    """The JSON so far (rewritten after every chunk: a run cut short keeps its rows)."""
    return common.write_json(path, {
        "command": common.command_line(), "machine": common.machine(), "device_kind": kind,
        "backend": jax.default_backend(), "interpret": not on_gpu, "local_dtype": args.dtype,
        "width_set": list(R.WIDTH_SET), "plane_bits": R.PLANE_BITS, "strata": 8,
        "level_set": args.level_set,
        "copy_gbs": copy_gbs, "reps": args.reps, "repeats": args.repeats,
        "complete": complete, **more, "results": rows}, strict=args.strict)

  impls = [v for v in args.impls.split(",") if v]
  if set(impls) - set(IMPLS):
    raise SystemExit(f"--impls {args.impls!r}: choose from {', '.join(IMPLS)}")
  if not on_gpu:  # Mosaic GPU is not timed in interpret mode (a simulator)
    impls = [v for v in impls if not v.startswith("mosaic")]
  launches = _parse_launches(args.launches) if args.sweep else []
  if set(v for v in args.sweep_ops.split(",") if v) - set(OPS):
    raise SystemExit(f"--sweep-ops {args.sweep_ops!r}: choose from {', '.join(OPS)}")
  for launch in launches:
    T.launch_config("compress", launch)  # ValueError names a bad launch before any timing
  copy_at = _copy_bandwidth(timed)

  def chunk(width, size):
    """(widths, units, local values, their payload, minimal bytes per op) of a chunk
    of one code width."""
    s_count = size // 256
    units = s_count * width // R.PLANE_BITS
    widths = jnp.full((s_count,), width, jnp.int32)
    x = jax.random.normal(jax.random.key(0), (s_count, 256), jnp.float32).astype(dtype)
    payload = R.compress_reference(x, widths, units, keys=keys_of(0), strata=8, **geo)
    pay_b, x_b = payload.size, x.size * dtype.itemsize
    minimal = {"compress": x_b + pay_b, "decompress": pay_b + size * 4,
               "decompress_accumulate_recompress": 2 * pay_b + x_b, "copy": 2 * x_b}
    return widths, units, x, payload, minimal

  def calls(widths, units, x, payload, **kw):
    """op: (f(i, *operands), operands) through ``pallas_kernels.dynamiq`` (or, with
    ``launch`` in ``kw``, the Triton entry points)."""
    mod = T if "launch" in kw else K
    suffix = "_pallas" if "launch" in kw else ""
    get = lambda op: getattr(mod, op + suffix)
    return {
        "compress": (lambda i, x: get("compress")(x, widths, units, keys=keys_of(i),
                                                  strata=8, **kw), (x,)),
        "decompress": (lambda i, p: get("decompress")(p, widths, units, **kw), (payload,)),
        "decompress_accumulate_recompress": (
            lambda i, p, x: get("decompress_accumulate_recompress")(
                p, x, widths, units, keys=keys_of(i), strata=8, **kw), (payload, x)),
    }

  rows = []
  for width in [int(w) for w in args.widths.split(",") if w]:
    for size in sizes:
      with common.load_watch(f"w{width} 2^{size.bit_length() - 1}"):  # in the JSON's "load"
        widths, units, x, payload, minimal = chunk(width, size)
        # A plain copy of the local values (read + write), as a kernel would see it.
        sec = timed(lambda i, x: x + jnp.asarray(i, x.dtype), x)
        rows.append({"width": width, "coords": size, "op": "copy", "impl": "xla", "seconds": sec,
                     "minimal_bytes": minimal["copy"], "gbs": minimal["copy"] / sec / 1e9,
                     "coords_per_s": size / sec})
        for impl in [v for v in impls if v != "mosaic"]:
          # "mosaic_record": the Mosaic GPU kernel on the record payload, as the
          # training step calls it today (record <-> planar conversions included).
          ops = calls(widths, units, x, payload,
                      implementation="mosaic" if impl == "mosaic_record" else impl,
                      interpret=interpret if impl == "pallas" else None, **geo)
          for op in OPS:
            f, operands = ops[op]
            rows.append(_timed_row(timed, f, operands, width=width, coords=size, op=op,
                                   impl=impl, minimal_bytes=minimal[op], copy_gbs=copy_at))
        if "mosaic" in impls:  # Mosaic GPU's kernels, on planar payloads
          s_count = widths.shape[0]
          planar = P.to_planar(payload, s_count, units, R.PLANE_BITS)
          mgeo = dict(eps=levels, width_set=R.WIDTH_SET)
          mosaic = {
              "compress": (lambda i, x: M.compress_planar(x, widths, units, keys=keys_of(i),
                                                          strata=8, **mgeo), (x,)),
              "decompress_accumulate_recompress": (
                  lambda i, p, x: M.decompress_accumulate_recompress_planar(
                      p, x, widths, units, keys=keys_of(i), strata=8, **mgeo), (planar, x)),
              "decompress": (lambda i, p: M.decompress_planar(p, widths, units, **mgeo),
                             (planar,)),
          }
          for op in OPS:
            f, operands = mosaic[op]
            rows.append(_timed_row(timed, f, operands, width=width, coords=size, op=op,
                                   impl="mosaic", minimal_bytes=minimal[op], copy_gbs=copy_at))
      save(rows, complete=False)
  sweep = []
  if launches:
    sweep_sizes = [1 << 12] if args.tiny else [1 << int(v)
                                                for v in args.sweep_log2_sizes.split(",")]
    for width in [int(w) for w in args.sweep_widths.split(",")]:
      for size in sweep_sizes:
        with common.load_watch(f"sweep w{width} 2^{size.bit_length() - 1}"):
          widths, units, x, payload, minimal = chunk(width, size)
          for launch in launches:
            ops = calls(widths, units, x, payload, launch=launch, interpret=not on_gpu, **geo)
            for op in [v for v in args.sweep_ops.split(",") if v]:
              f, operands = ops[op]
              sweep.append(_timed_row(timed, f, operands, width=width, coords=size, op=op,
                                      impl="pallas", launch=list(launch),
                                      minimal_bytes=minimal[op], copy_gbs=copy_at))
        save(rows, complete=False, sweep=sweep)
  target, backends = backend_check()
  print(f"\nDynamiQ kernels on {kind} ({jax.default_backend()}, "
        f"jax {jax.__version__}); local values {args.dtype}; copy bandwidth {copy_gbs:.1f} GB/s")
  if not on_gpu:
    print("no GPU: Pallas runs in interpret mode; these numbers only show that the benchmark runs")
  head = (f"{'w':>2} {'coords':>10} {'op':<34} {'impl':<13} {'ms':>9} {'GB/s':>8} "
          f"{'of copy':>7} {'coords/s':>10}")
  print(head)
  for r in rows + sweep:
    impl = r["impl"] + (" {}x{}".format(*r["launch"]) if "launch" in r else "")
    if "error" in r:
      print(f"{r['width']:>2} {r['coords']:>10} {r['op']:<34} {impl:<13} {r['error']}")
      continue
    frac = f"{r['fraction_of_copy']:>7.0%}" if "fraction_of_copy" in r else f"{'':>7}"
    print(f"{r['width']:>2} {r['coords']:>10} {r['op']:<34} {impl:<13} "
          f"{r['seconds'] * 1e3:>9.3f} {r['gbs']:>8.1f} {frac} {r['coords_per_s']:>10.3e}")
  if sweep:
    print("fastest launch per op and size (block x num_warps):")
    for key in sorted({(r["op"], r["width"], r["coords"]) for r in sweep}):
      ok = [r for r in sweep if (r["op"], r["width"], r["coords"]) == key and "seconds" in r]
      if ok:
        best = min(ok, key=lambda r: r["seconds"])
        print(f"  {key[0]} w{key[1]} {key[2]}: {best['launch'][0]}x{best['launch'][1]} "
              f"{best['seconds'] * 1e3:.3f} ms ({best['fraction_of_copy']:.0%} of copy)")
  print(f"Pallas GPU backends, level-table gather lowering for cuda ({target}):",
        ", ".join(f"{k}: {v}" for k, v in backends.items()))
  print(f"wrote {save(rows, complete=True, sweep=sweep, backend_lowering=backends, backend_lowering_target=target)}")
  return rows + sweep


if __name__ == "__main__":
  main()
