"""Is the sharded step's gradient whole because the buckets are chained one after another?

    JAX_PLATFORMS=cpu python tools/sharded_grad_schedule.py [--bucket-size 262144]

Compiles (nothing runs) the ``zero`` layout's training step of the byte LM of
``examples/nnx_sharded_lm`` (dim 256, 4 layers, DynamiQ, 8 CPU devices) twice:
as the library builds it, and with the buckets not tied one after another
(``engine.one_after_another`` replaced by a plain loop, the ablation
``bench.overlap`` also runs), and prints, from XLA's buffer assignment
(:mod:`dynamiq_jax.bench.buffers`), the most gradient bytes live at once
(backward values + the reduction's buffers), where in the schedule that is and
where the backward pass ends (fractions of the scheduled instructions). If the
most comes at or after the backward pass's end in both, the chain is not what
keeps the reductions out of the backward pass.
"""

import argparse
import importlib
import pathlib
import sys

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the examples


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--bucket-size", type=int, default=262144)
  args = p.parse_args(argv)
  jax.config.update("jax_num_cpu_devices", 8)
  import numpy as np
  from dynamiq_jax.bench import buffers
  from dynamiq_jax.bench import sharded
  text = np.frombuffer(bytes(range(256)) * 64, np.uint8)
  model = dict(dim=256, heads=4, layers=4, context=64, batch_size=32)
  print(f"{'buckets':<10}{'gradient MB':>12}{'whole MB':>10}{'at':>6}{'bwd end':>9}{'temp MB':>9}")
  for label in ("chained", "unchained"):
    if label == "unchained":
      def unchained(xs, reduce_one):
        return [reduce_one(b, x, None) for b, x in enumerate(xs)]
      importlib.import_module("dynamiq_jax.engine.programs").one_after_another = unchained
    config = sharded._config("zero", False, bucket_size=args.bucket_size, **model)  # noqa: SLF001
    lowered, dp = sharded._lowered(config, jax.devices(), text)  # noqa: SLF001
    r, _ = buffers.breakdown(lowered, sharded.categorize, {"gradient": sharded.GRADIENT})
    whole = sum(x.nbytes for x in jax.tree.leaves(dp.state[0]))
    length = r["program_length"]
    print(f"{label:<10}{r['own_max']['gradient'] / 1e6:>12.1f}{whole / 1e6:>10.1f}"
          f"{r['own_max_time']['gradient'] / length:>6.2f}"
          f"{r['last_defined']['backward'] / length:>9.2f}{r['temp_bytes'] / 1e6:>9.1f}")


if __name__ == "__main__":
  main()
