"""Trains a byte-level transformer LM on a 2-D mesh: model sharded, gradient compressed.

    python -m examples.nnx_sharded_lm.main --layout tensor --model_axis 2   # 4 data x 2 model
    python -m examples.nnx_sharded_lm.main --layout hsdp --model_axis 4     # 2 hosts x 4 local
    python -m examples.nnx_sharded_lm.main --layout tensor --model_axis 4 --tp-codec int8

On one machine it simulates ``--devices`` CPU devices (default 8). As one process of
a multi-process job (one per host, e.g. two: ``--num_processes 2 --process_id 0|1
--coordinator host0:12355 --local_devices 4``) the first mesh axis spans the
processes, so only the compressed reduction crosses them. It prints each step's
loss; ``python -m dynamiq_jax.bench.sharded`` runs the hsdp layout over emulated
network links and compares it with the one-process run bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses

PROG = "python -m examples.nnx_sharded_lm.main"


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module docstring as written, and every flag's default (argparse adds it)."""


def dq_tp_codecs() -> tuple:
  """``--tp_codec``'s choices: ``dq.TP_CODECS``."""
  import dynamiq_jax as dq  # noqa: PLC0415
  return dq.TP_CODECS


def build_parser() -> argparse.ArgumentParser:
  """The example's flags (every field of ``train.Config``, and the process layout)."""
  from . import train  # noqa: PLC0415 (jax starts only after the flags are read)

  p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=_HelpFormatter)
  for field in dataclasses.fields(train.Config):
    kind = type(field.default)
    names = dict.fromkeys([f"--{field.name}", f"--{field.name.replace('_', '-')}"])
    p.add_argument(*names, type=kind, default=field.default,
                   choices={"layout": train.LAYOUTS, "axis_types": ("auto", "explicit"),
                            "tp_codec": dq_tp_codecs()}.get(field.name),
                   help=f"train.Config.{field.name}")
  p.add_argument("--devices", type=int, default=8,
                 help="simulated CPU devices in one process")
  p.add_argument("--num_processes", type=int, default=1,
                 help="processes in a multi-process job")
  p.add_argument("--process_id", type=int, default=0, help="this process's rank")
  p.add_argument("--coordinator", default=None, help="host:port of process 0")
  p.add_argument("--local_devices", type=int, default=4,
                 help="CPU devices per process in a multi-process job")
  return p


def main(argv=None) -> list:
  """Runs the example as ``argv`` says; returns the per-step losses."""
  args = build_parser().parse_args(argv)
  import dynamiq_jax as dq  # noqa: PLC0415
  if args.num_processes > 1:
    if args.coordinator is None:
      raise SystemExit("--num_processes > 1 needs --coordinator host:port (process 0's)")
    dq.multiprocess.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, local_devices=args.local_devices)
  else:
    import jax  # noqa: PLC0415
    jax.config.update("jax_num_cpu_devices", args.devices)
  import jax  # noqa: PLC0415

  from examples import datasets  # noqa: PLC0415
  from . import train  # noqa: PLC0415

  config = train.Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(train.Config)})
  text = datasets.python_source_corpus(2_000_000).train
  mesh, _ = train.make_mesh(config, jax.devices())
  print(f"{config.layout}: mesh {dict(mesh.shape)} over {jax.device_count()} devices in "
        f"{jax.process_count()} process(es); codec {config.codec}; tensor-parallel "
        f"all-reduce {config.tp_codec}", flush=True)
  losses, _ = train.train(config, jax.devices(), text,
                          on_step=lambda i, loss: print(f"step {i:4d}  loss {float(loss):.6f}",
                                                        flush=True))
  return losses


if __name__ == "__main__":
  main()
