"""Digests of every codec x schedule x implementation on fixed data.

A refactoring that must not change what the library computes records the
digests before the change and compares after it::

    python tests/digests.py record tests/data/digests.json   # at the starting commit
    python tests/digests.py compare tests/data/digests.json  # after the change

``tests/test_digests.py`` runs the comparison (for the fast cases; ``--all``
includes the Pallas interpret-mode runs). A change that is *meant* to alter
outputs re-records the file and says in its commit which digests changed.
(``add`` records only the cases the file lacks.)

Each case runs :func:`dynamiq_jax.simulate` (the distributed code under
``vmap``) for two rounds, carrying the codec state, on a pytree of mixed
shapes and dtypes, and hashes the bytes of every output leaf and of the state;
error feedback is covered by two steps of ``compressed_psum`` under ``vmap``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

N = 8


def _data(seed=0):
  import numpy as np
  rng = np.random.default_rng(seed)
  # scales over decades and some all-zero rows, sizes not multiples of 256
  layers = {
      "emb": rng.standard_normal((N, 64, 40)) * (rng.random((1, 64, 1)) < 0.6),
      "dense": rng.standard_normal((N, 97, 61)) * 1e-2,
      "bias": rng.standard_normal((N, 61)) * 3.0,
      "out": rng.standard_normal((N, 1500)) * 1e-4 + 1e-4,
      "temp": rng.standard_normal((N,)),
  }
  return {k: v.astype(np.float32) for k, v in layers.items()}


def _codecs():
  from dynamiq_jax import codecs as C
  return {
      # (the "_per_round" names are those recorded when DynamiQ had a second variant, with
      # the MEE levels that were then its only ones)
      "dynamiq5_per_round": C.DynamiQ(bits=5, level_set="mee"),
      "dynamiq4_per_round": C.DynamiQ(bits=4, level_set="mee"),
      "dynamiq6_per_round_indep_stoch": C.DynamiQ(bits=6, correlated=False,
                                                  scale_rounding="stochastic", level_set="mee"),
      "dynamiq5_per_round_248": C.DynamiQ(bits=5, widths=(2, 4, 8), level_set="mee"),
      # the lattice levels (the default level set)
      "dynamiq5_lattice": C.DynamiQ(bits=5),
      "dynamiq6_lattice_indep_stoch_248": C.DynamiQ(bits=6, correlated=False,
                                                    scale_rounding="stochastic",
                                                    widths=(2, 4, 8)),
      "bf16": C.Bf16(),
      "f32": C.F32(),
      "mxfp8": C.MX(element="e4m3"),
      "mxfp6": C.MX(element="e3m2"),
      "mxfp4": C.MX(element="e2m1"),
      "mxfp8_ocp": C.MX(element="e4m3", scale="e8m0"),
      "thc16": C.THC(levels=16),
      "thc120": C.THC(levels=120, rht_block=1 << 12),
      "omnireduce": C.OmniReduce(),
      "globalqsgd": C.GlobalQSGD(bits=8),
  }


def _digest(tree) -> str:
  import jax
  import numpy as np
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    a = np.ascontiguousarray(np.asarray(leaf))
    h.update(str(a.dtype).encode() + str(a.shape).encode())
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def cases(include_pallas: bool):
  """(name, thunk) for every case; the thunk returns the outputs to hash."""
  import jax
  import jax.numpy as jnp

  import dynamiq_jax as dq

  data = _data()
  tree = dict(data, emb=jnp.asarray(data["emb"], jnp.bfloat16))
  out = []
  for name, codec in _codecs().items():
    stateful = codec.stateful
    for schedule in ("ring", "butterfly", "hierarchical"):
      if schedule == "hierarchical" and stateful:
        continue
      impls = ["xla"] + (["pallas"] if include_pallas and name.startswith("dynamiq") else [])
      for impl in impls:

        def run(codec=codec, schedule=schedule, impl=impl):
          kw = dict(codec=codec, schedule=schedule, implementation=impl)
          if schedule == "hierarchical":
            kw["mesh_shape"] = (2, N // 2)
          results, state = [], None
          for t in range(2):
            key = jax.random.fold_in(jax.random.key(7), t)
            res, state = dq.simulate(tree, key=key, codec_state=state, return_state=True, **kw)
            results.append(res)
          return results, state

        out.append((f"{name}/{schedule}/{impl}", run))

  for name in ("mxfp4", "thc16", "omnireduce"):

    def run_ef(name=name):
      tx = dq.compressed_psum("i", codec=_codecs()[name], error_feedback=True, seed=3)
      one = {k: v[0] for k, v in data.items()}

      def two_steps(g):
        state = tx.init(jax.tree.map(jnp.zeros_like, one))
        state = state._replace(residual=jax.tree.map(lambda r: r, state.residual))
        u1, state = tx.update(g, state)
        u2, state = tx.update(jax.tree.map(lambda x: x * 0.5, g), state)
        return u1, u2, state

      return jax.vmap(two_steps, axis_name="i")(data)

    out.append((f"{name}/error_feedback/xla", run_ef))
  return out


def compute(include_pallas: bool, only=None):
  got = {}
  for name, run in cases(include_pallas):
    if only is not None and name not in only:
      continue
    got[name] = _digest(run())
  return got


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("mode", choices=["record", "add", "compare"],
                 help="write every digest, add the cases the file lacks, or check them")
  p.add_argument("path", help="JSON file of digests")
  p.add_argument("--all", action="store_true", help="include the Pallas interpret-mode cases")
  p.add_argument("--only", default=None,
                 help="compare: these cases only (comma-separated names, as the file's keys)")
  args = p.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import subprocess

  import jax
  jax.config.update("jax_num_cpu_devices", N)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  if args.mode in ("record", "add"):
    old = {"digests": {}, "added": {}}
    if args.mode == "add":
      with open(args.path) as f:
        old = json.load(f)
    names = {name for name, _ in cases(include_pallas=True)} - set(old["digests"])
    got = compute(include_pallas=True, only=names if args.mode == "add" else None)
    if args.mode == "record":
      record = {"commit": commit, "jax": jax.__version__, "digests": got, "added": {}}
    else:
      record = dict(old, digests=dict(old["digests"], **got),
                    added=dict(old.get("added", {}), **{k: commit for k in got}))
    with open(args.path, "w") as f:
      json.dump(record, f, indent=1, sort_keys=True)
    print(f"{args.mode}: {len(got)} digests at {commit} into {args.path}")
    return 0
  with open(args.path) as f:
    want = json.load(f)
  only = None if args.only is None else set(args.only.split(","))
  got = compute(include_pallas=args.all or any("pallas" in k for k in only or ()), only=only)
  if only is not None and set(got) != only:
    p.error(f"--only: no case named {sorted(only - set(got))}")
  bad = [k for k in got if want["digests"].get(k) != got[k]]
  for k in sorted(got):
    print(f"{'DIFFERS' if k in bad else 'same   '} {k} {got[k]} (recorded {want['digests'].get(k)})")
  print(f"{len(got) - len(bad)} of {len(got)} digests equal those recorded at {want['commit']}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
