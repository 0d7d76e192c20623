"""Run the DynamiQ authors' own simulator on our captured real gradients.

A cross-check, not part of the library or of CI: it needs PyTorch and a
checkout of the authors' artifact (https://github.com/CharlesHan24/DynamiQ,
commit 737b184), neither of which dynamiq_jax depends on. It answers one
question: where our DynamiQ loses to a baseline on real gradients
(``bench.vnmse``), does the authors' code lose there too? If it does, the loss
is a property of the data, not of our implementation.

How it drives the artifact, the way ``REFERENCE_VNMSE.md`` ran it on the
synthetic data:

* ``simulations_llm/new_comm_hooks`` is copied to a temporary directory with
  one textual change, ``device="cuda"`` -> ``device="cpu"``; nothing else is
  edited. The correlated random pools come from the artifact's own
  ``gen_correlated_rand.generate_correlated_random_vectors``.
* n gloo processes (n = the snapshot's workers, 8) call the artifact's
  ``wrapper_hook`` exactly as its DDP training scripts do, with the parameters
  its launcher passes (``normalized_chunk_size=1024``, ``max_chunk_size=32``,
  ``agg_chunk_size=16``, ``quantization_levels=120``, ``seed=63``), on one
  bucket holding the whole flat gradient, cast to bf16 as their models are.
* Rounds 0 and 1 are the artifact's uncompressed warm-up and round 2 its
  first compressed round. We report the mean of: DynamiQ (with correlated
  rounding, or ``dynamiq-independent`` without), rounds 3-5 (round
  2 sends everything at 8 bits while it searches its offset u); MXFP8,
  rounds 2-3; OmniReduce, rounds 18-21 (its k settles over about 15).
* vNMSE = ||mean_hat - mean||^2 / ||mean||^2 against the float64 mean of the
  bf16-cast inputs. Every rank's result is checked to be the same.

Usage (a venv with torch and numpy; the gradients are the ``.npz`` files that
``python -m dynamiq_jax.bench.vnmse`` caches under ~/.cache/dynamiq_jax)::

    python tools/authors_crosscheck.py --artifact /path/to/DynamiQ \\
        --grads ~/.cache/dynamiq_jax/grads_lm-byte_*.npz --tag lm-byte \\
        --out docs/results/authors_crosscheck.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile

import numpy as np

METHODS = {
    "dynamiq": "dynamiQ_mee_5bit_dynamic_bitrate_hierarchical_correlated",
    "dynamiq-independent": "dynamiQ_mee_5bit_dynamic_bitrate_hierarchical",
    "mxfp8": "MXfp8",
    "omnireduce": "omnireduce",
}


class _Bucket:
  """The three methods of torch's GradBucket that the hooks call."""

  def __init__(self, t):
    self._t = t

  def buffer(self):
    return self._t

  def index(self):
    return 0

  def is_last(self):
    return True


def _worker(rank, n, hooks_root, path, method, rounds, port, out):
  import torch
  import torch.distributed as dist
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("gloo", rank=rank, world_size=n)
  sys.path.insert(0, hooks_root)
  from new_comm_hooks.comm_hooks import wrapper_hook

  g = np.load(path)
  x = torch.tensor(g[rank]).to(torch.bfloat16)
  exact = torch.tensor(g).to(torch.bfloat16).double().mean(0)
  args = argparse.Namespace(
      aggregation_method=method, nclients=n, seed=63, measure_comm_error=False,
      quantization_levels=120, normalized=1, normalized_chunk_size=1024, max_chunk_size=32,
      smaller_max_chunk_size=32, agg_chunk_size=16, ef=False, rotation="True",
      overflow_frequency=1024, sparsity="None")
  params = dict(
      args=args, nclients=n, seed=63, table_dir="compression/new_tables", measure_comm_error=False,
      d={}, size={}, keys=[], measure_points={}, max_norm={}, smaller_max_norm={}, norm={},
      agg_chunk_size=16, overflow_prob=8, max_chunk_size=32, smaller_max_chunk_size=32,
      heuristic="bitrate" if "bitrate" in method.lower() else "chunk_size", lr_adjust_param=1,
      MAX_BUCKET_SIZE=1 << 28, ef=False, rotation=True, quantization_levels=120,
      overflow_frequency=1024, normalized=1, chunk_size=1024, supergroup=16, device="cpu",
      is_correlated="correlated" in method, txt_log_file=open(os.devnull, "w"))
  state = {"batch_idx": -1, "params": params, "start_idx": {}, "partition_len": {},
           "ret_tensor": {}, "start_interm_idx": {}, "interm_reduce_tensor": {}, "args": args}
  res = []
  for r in range(rounds):
    state["batch_idx"] += 1
    fut = wrapper_hook(state, _Bucket(x.clone()))
    fut.wait()
    y = fut.value()
    y = (y[0] if isinstance(y, list) else y).double()
    lo, hi = torch.tensor([float(y.sum())]), torch.tensor([float(y.sum())])
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    res.append(dict(round=r, vnmse=float(((y - exact) ** 2).sum() / (exact ** 2).sum()),
                    ranks_agree=bool(lo.item() == hi.item()),
                    payload_bits=params.get("dynamic_bitrate_last_avg_bits")))
  if rank == 0:
    with open(out, "w") as f:
      json.dump(res, f)
  dist.destroy_process_group()


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _prepare(artifact, workdir, n, d):
  """Copies the hooks with the cpu edit; writes the artifact's correlated pools."""
  src = os.path.join(artifact, "simulations_llm")
  if not os.path.isdir(os.path.join(src, "new_comm_hooks")):
    raise SystemExit(f"--artifact {artifact!r} holds no simulations_llm/new_comm_hooks: "
                     "give a checkout of github.com/CharlesHan24/DynamiQ")
  root = os.path.join(workdir, "simulations_llm")
  shutil.copytree(os.path.join(src, "new_comm_hooks"), os.path.join(root, "new_comm_hooks"))
  for name in os.listdir(os.path.join(root, "new_comm_hooks")):
    p = os.path.join(root, "new_comm_hooks", name)
    if p.endswith(".py"):
      with open(p) as f:
        text = f.read()
      with open(p, "w") as f:
        f.write(text.replace('device="cuda"', 'device="cpu"'))
  sys.path.insert(0, src)
  from pathlib import Path
  import gen_correlated_rand  # the artifact's generator, unchanged
  np.random.seed(0)
  gen_correlated_rand.generate_correlated_random_vectors(
      num_values=4 * d // n + (1 << 16), nranks=n,
      output_dir=Path(root) / "models" / "correlated_rand", chunk_values=1 << 20)
  return root


def _commit(path):
  try:
    return subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return None


def main(argv=None):
  import torch
  import torch.multiprocessing as mp
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--artifact", required=True, help="checkout of CharlesHan24/DynamiQ")
  p.add_argument("--grads", required=True,
                 help="a gradient cache .npz of bench.vnmse, or one [n, d] .npy (step 0)")
  p.add_argument("--tag", required=True, help="name of these gradients in the output")
  p.add_argument("--steps", type=int, nargs="*", help="steps to run (default: all in the file)")
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--methods", nargs="+", default=["dynamiq", "mxfp8"], choices=sorted(METHODS))
  p.add_argument("--out", required=True, help="JSON file; new results are merged into it")
  a = p.parse_args(argv)

  path = os.path.expanduser(a.grads)
  if path.endswith(".npy"):  # one [n, d] array, e.g. from the spec's paper_model_data.py
    snaps = {0: np.load(path)[:a.workers].astype(np.float32)}
    steps = [0]
  else:
    with np.load(path) as z:
      steps = sorted(int(k[5:]) for k in z.files if k.startswith("step_"))
      steps = [s for s in steps if a.steps is None or s in a.steps]
      if not steps:
        raise SystemExit(f"--steps {a.steps} not in {a.grads}")
      snaps = {s: z[f"step_{s}"][:a.workers].astype(np.float32) for s in steps}
  n, d = next(iter(snaps.values())).shape
  if n < a.workers:
    raise SystemExit(f"{a.grads} holds {n} workers, fewer than --workers {a.workers}")

  command = "python " + " ".join([os.path.relpath(__file__)] + sys.argv[1:])
  results = []
  if os.path.exists(a.out):
    with open(a.out) as f:
      results = json.load(f)["results"]
  with tempfile.TemporaryDirectory() as tmp:
    root = _prepare(a.artifact, tmp, n, d)
    for s in steps:
      path = os.path.join(tmp, f"step_{s}.npy")
      np.save(path, snaps[s])
      for m in a.methods:
        rounds = {"mxfp8": 4, "omnireduce": 22}.get(m, 6)
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(n, root, path, METHODS[m], rounds, _free_port(), out), nprocs=n)
        with open(out) as f:
          rows = json.load(f)
        keep = rows[{"mxfp8": 2, "omnireduce": -4}.get(m, 3):]
        row = dict(tag=a.tag, step=s, method=m, aggregation_method=METHODS[m], workers=n, d=d,
                   vnmse=float(np.mean([r["vnmse"] for r in keep])),
                   rounds=[r["vnmse"] for r in rows],
                   payload_bits=keep[-1]["payload_bits"],
                   ranks_agree=all(r["ranks_agree"] for r in rows), command=command)
        print(json.dumps(row), flush=True)
        results = [r for r in results if (r["tag"], r["step"], r["method"]) != (a.tag, s, m)]
        results.append(row)
  meta = dict(artifact_commit=_commit(a.artifact), torch=torch.__version__,
              machine=f"{platform.node()} ({os.cpu_count()} cpus, {platform.processor() or platform.machine()})",
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(dict(meta=meta, results=sorted(results, key=lambda r: (r["tag"], r["step"], r["method"]))),
              f, indent=1)


if __name__ == "__main__":
  main()
