"""Where a GPU's kernel outputs differ from the CPU reference, byte by byte.

For each chunk case of ``tests/test_kernels_on_gpu.py`` (NaN in super-group 3, -Inf
in 4, added after the payload is made) and each hop op, runs the XLA reference on
the CPU and the XLA reference, Triton and Mosaic GPU on the GPU, prints how many
output bytes differ from the CPU's (and the first offsets), and saves every output
to ``$OUT/<case>.npz`` (rewritten after each op, so a run cut short keeps what it
did). On a GPU machine, from the repository root::

    JAX_PLATFORMS=cuda,cpu OUT=/tmp/bits python tools/gpu_bits.py w234568-S13-bf16

A failing backend prints ``ERROR`` and its message; the others still run.
"""

import os
import pathlib
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
import test_kernels_on_gpu as t  # noqa: E402  (the cases and ops the hardware tests use)


def main(cases):
  out = os.environ.get("OUT", ".")
  cpu, gpu = jax.devices("cpu")[0], jax.devices("cuda")[0]
  for case in cases:
    x, widths, units, payload, geo = t._inputs(case, nonfinite=True)
    saved = {"x": np.asarray(x.astype(np.float32)), "widths": widths,
             "payload": np.asarray(payload)}
    for op in t.OPS:
      operands = t._operands(op, x, payload)
      res = {"cpu": np.asarray(t._run(op, "xla", widths, units, geo, operands, cpu))}
      for impl in ("xla", "pallas", "mosaic"):
        if impl == "mosaic" and geo["plane_bits"] == 2:
          continue
        start = time.time()
        try:
          res[impl] = np.asarray(t._run(op, impl, widths, units, geo, operands, gpu))
        except Exception as e:  # noqa: BLE001 - printed; the other backends still run
          print(case, op, impl, "ERROR", type(e).__name__, str(e)[:300], flush=True)
          continue
        a, b = res[impl].view(np.uint8).reshape(-1), res["cpu"].view(np.uint8).reshape(-1)
        differ = np.flatnonzero(a != b)
        print(f"{case} {op} {impl}: {differ.size} bytes differ from cpu "
              f"(first {differ[:6]}) {time.time() - start:.1f}s", flush=True)
      saved.update({f"{op}.{k}": v for k, v in res.items()})
      np.savez_compressed(os.path.join(out, f"{case}.npz"), **saved)


if __name__ == "__main__":
  main(sys.argv[1:] or list(t.CASES))
