"""Helpers shared by the tests (importable as ``_helpers``; see pythonpath in pyproject)."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def per_rank(mesh, fn, stacked, *, check_vma=False):
  """Runs ``fn(local_tree) -> tree`` on every rank of ``mesh``'s 'data' axis.

  ``stacked`` has leaves [n, ...]; rank r sees leaf[r]. Returns the per-rank
  outputs stacked on axis 0 (outputs are taken as varying, so every rank's
  value comes back and can be compared).
  """

  def body(tree):
    local = jax.tree.map(lambda a: a[0], tree)
    out = fn(local)
    return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

  # check_vma=False unless asked: the outputs are gathered per rank on purpose.
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                            check_vma=check_vma))
  stacked = jax.device_put(stacked, NamedSharding(mesh, P("data")))
  return f(stacked)


def xla_defaults() -> dict:
  """``jax.jit(compiler_options=...)`` that give one program XLA's own settings back
  in place of the speed flags the root conftest.py sets for every compile
  (``DYNAMIQ_TEST_XLA_FLAGS``): for a test whose time goes into running its program
  many times rather than into compiling it."""
  defaults = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
  names = [f.split("=")[0].lstrip("-") for f in os.environ["DYNAMIQ_TEST_XLA_FLAGS"].split()]
  assert set(names) <= set(defaults), f"no default known for {names}"
  return {name: defaults[name] for name in names}


def rows_identical(stacked) -> bool:
  """All rows of every leaf bit-identical (NaN payloads compared as bits)."""
  for a in jax.tree.leaves(stacked):
    a = np.asarray(a)
    bits = a.view(np.uint8).reshape(a.shape[0], -1)
    if not (bits == bits[:1]).all():
      return False
  return True


def lower_for(platform: str, jitted, *args) -> str:
  """``jitted`` traced with ``args`` and lowered for ``platform``, as StableHLO text.

  For ``"cuda"`` the lowering is for an abstract H100 (``gpu_compile_tools.gpu_target``):
  jax >= 0.11 compiles Pallas GPU kernels for the abstract mesh's GPU and has none on a
  CPU host.
  """
  import gpu_compile_tools as T
  if platform != "cuda":
    return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()
  with T.gpu_target():
    return jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()


@functools.lru_cache(maxsize=None)
def model_data(dataset, n, d, seed):
  from dynamiq_jax.bench.reference import paper_model_gradients
  return paper_model_gradients(dataset, n, d, seed)


def _is_array(a) -> bool:
  if isinstance(a, tuple):
    return bool(a) and all(_is_array(x) for x in a)
  return isinstance(a, (jax.Array, np.ndarray, np.generic))


class Jitted:
  """A module's functions, each call under ``jax.jit``: array arguments (and tuples of
  them) traced, every other argument bound as it is (one jit per function and values of
  those, so each shape compiles once). A jnp reference run eagerly compiles each of its
  operations apart, hundreds of small compiles per call; under jit it is one program, as
  inside the all-reduce. ``Jitted(R).decompress_reference(p, widths, units, **geo)``."""

  def __init__(self, module):
    self._module = module
    self._jits = {}

  def __getattr__(self, name):
    fn = getattr(self._module, name)

    def call(*args, **kwargs):
      pos = tuple(i for i, a in enumerate(args) if _is_array(a))
      kws = tuple(sorted(k for k, v in kwargs.items() if _is_array(v)))
      fixed = {i: a for i, a in enumerate(args) if i not in pos}
      fixed_kw = {k: v for k, v in kwargs.items() if k not in kws}
      key = (name, len(args), pos, kws, repr(sorted(fixed.items())),
             repr(sorted(fixed_kw.items())))
      if key not in self._jits:
        def run(dyn, dyn_kw, fixed=fixed, fixed_kw=fixed_kw, n=len(args)):
          it = iter(dyn)
          full = [fixed[i] if i in fixed else next(it) for i in range(n)]
          return fn(*full, **fixed_kw, **dyn_kw)
        self._jits[key] = jax.jit(run)
      return self._jits[key]([args[i] for i in pos], {k: kwargs[k] for k in kws})

    return call
