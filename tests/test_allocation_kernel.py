"""The allocation kernel (pallas_kernels.dynamiq_allocation): bit for bit the jnp
reference in interpret mode, the reference the codec's own allocation, and the
kernel compiled for an H100 from a CPU host without register spills.

Statistics: random (heavy-tailed), tied (runs of equal norms across a
boundary), zeros (most super-groups 0), padded (the last super-groups not
real), the one-class budgets; both ``blocks`` (all-reduce: 1, reduce-scatter:
n); tiles of 32 so that every size spans several tiles and ends in a partial
one.
"""

from __future__ import annotations

import functools
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gpu_compile_tools as T
import test_gpu_compile as G
from dynamiq_jax.codecs import allocation
from pallas_kernels import dynamiq_allocation as K

ERRORS = {2: 0.2, 4: 0.02, 8: 0.0001}
SIX = {2: 0.25, 3: 0.1, 4: 0.04, 5: 0.012, 6: 0.004, 8: 0.0003}


def _norms(kind, total, rng):
  if kind == "random":
    return np.exp(3.0 * rng.standard_normal(total)).astype(np.float32)
  if kind == "tied":  # few distinct values: boundaries fall inside runs of ties
    return rng.choice(np.float32([0.0, 0.5, 1.0, 2.0]), total)
  if kind == "zeros":
    g = np.exp(rng.standard_normal(total)).astype(np.float32)
    g[rng.random(total) < 0.85] = 0.0
    return g
  if kind == "all_zero":
    return np.zeros(total, np.float32)
  raise ValueError(kind)


def _rule(errors, n, positions, bits, blocks):
  cost = {w: n * 256 * w for w in errors}
  return allocation.rule(errors, positions, cost, positions * n * 256 * bits, n, blocks)


@functools.lru_cache(maxsize=None)
def _reference(real, rule, planes=None):
  """The reference, jitted once per (real, rule, planes): the statistics (kind) are data,
  so the cases that differ only in them (or in the kernel's tile) share one compile."""
  return jax.jit(lambda g: K.plan_reference(g, real=real, rule=rule, planes=planes))


@functools.lru_cache(maxsize=None)
def _kernel(real, rule, tile, planes=None):
  """The interpreted kernel, jitted once per (real, rule, tile, planes)."""
  return jax.jit(lambda g: K.plan_pallas(g, real=real, rule=rule, tile=tile, interpret=True,
                                         planes=planes))


def _both(g, real, rule, tile=32, planes=None):
  ref, ker = _reference(real, rule, planes), _kernel(real, rule, tile, planes)
  return [np.asarray(a) for a in ref(g)], [np.asarray(a) for a in ker(g)]


def _hops_plane_table(widths, planes):
  """The plane table the hop kernels make of the widths themselves."""
  from pallas_kernels import triton_chunk  # pylint: disable=import-outside-toplevel
  return np.asarray(triton_chunk.plane_table_of_widths(jnp.asarray(widths), *planes))


@pytest.mark.parametrize("kind", ["random", "tied", "zeros", "all_zero"])
@pytest.mark.parametrize("blocks", ["one", "n"])
@pytest.mark.parametrize("padded", [False, True])
def test_kernel_equals_reference(kind, blocks, padded):
  # a seed per case that every run draws alike (hash() of a str differs between processes)
  rng = np.random.default_rng(zlib.crc32(repr((kind, blocks, padded)).encode()))
  n, positions = 4, 45  # 180 super-groups: 6 tiles of 32, the last partial
  rule = _rule(ERRORS, n, positions, 3.3, 1 if blocks == "one" else n)
  g = _norms(kind, rule.total, rng)
  real = rule.total - 23 if padded else rule.total
  # plane table of 1-bit planes, every plane's units below the payload's 200
  planes = (1, 200)
  ref, ker = _both(g, real, rule, planes=planes)
  for name, a, b in zip(("dest", "order_t", "widths", "counts", "ptab"), ref, ker):
    np.testing.assert_array_equal(a, b, err_msg=name)
  dest, order_t, widths, counts, ptab = ref
  # the plane table of the counts is the hops' own of the widths
  np.testing.assert_array_equal(ptab, _hops_plane_table(widths, planes))
  # a permutation, its inverse in chunk order, and widths as counted
  assert sorted(dest.tolist()) == list(range(rule.total))
  np.testing.assert_array_equal(order_t.T.reshape(-1)[dest], np.arange(rule.total))
  assert counts.sum() == positions
  np.testing.assert_array_equal(
      np.bincount(widths, minlength=9)[list(rule.widths)], counts)


def test_norms_read_in_place_from_bfloat16_statistics():
  """``column``: the norms are column 1 of ``[total, 2]`` statistics (DynamiQ's, bfloat16 as
  gathered), read in place: the allocation of that column as float32, kernel and
  reference."""
  rng = np.random.default_rng(3)
  rule = _rule(ERRORS, 4, 45, 3.3, 1)
  g = jnp.asarray(_norms("random", rule.total, rng)).astype(jnp.bfloat16)
  stats = jnp.stack([-g, g], axis=-1)  # (mean, norm)
  want = _reference(rule.total - 7, rule)(g.astype(jnp.float32))
  for impl in ("xla", "pallas"):
    got = jax.jit(lambda s, impl=impl: K.plan(s, real=rule.total - 7, rule=rule, column=1,
                                              implementation=impl, interpret=True))(stats)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=impl)
  with pytest.raises(ValueError, match=r"gnorm.shape=\(180, 2\) with column=2: give \(180, k\)"):
    K.plan(stats, real=rule.total, rule=rule, column=2)


@pytest.mark.parametrize("blocks", [1, 8])
def test_six_widths_and_sizes_not_multiples_of_the_tile(blocks):
  rng = np.random.default_rng(7)
  n, positions = 8, 37
  rule = _rule(SIX, n, positions, 4.1, blocks)
  assert len(rule.t) >= 3  # several boundaries
  g = _norms("random", rule.total, rng)
  g[::5] = g[3]  # ties across classes
  # one tile per case (the same code at another size): 296 super-groups, 9.25 tiles of 32
  # (blocks of 37 positions) or 4.6 of 64
  # 2-bit planes (even widths only in a payload; the table's integers need none), and
  # fewer units than the planes take: the clamp
  planes = (2, 40)
  ref, ker = _both(g, rule.total - 5, rule, tile=32 if blocks == 8 else 64, planes=planes)
  assert len(ref) == len(ker) == 5
  for a, b in zip(ref, ker):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(ref[4], _hops_plane_table(ref[2], planes))
  assert ref[4][-1] == 40  # clamped to the units


def test_full_tiles_with_hundreds_of_ties_at_a_boundary():
  """Tiles of 1,024 super-groups (the kernel's own) in which the keys above a boundary and
  its ties each count past 2^8: the two counts share one 32-bit scan, 16 bits each."""
  n, positions = 4, 300  # 1,200 super-groups: a full tile and a partial one
  rule = _rule(SIX, n, positions, 3.8, 1)  # (3.8 bits: the 2 | 3 boundary splits the ties)
  rng = np.random.default_rng(11)
  g = np.ones(rule.total, np.float32)  # 700 ties
  g[rng.choice(rule.total, 500, replace=False)] = rng.uniform(2, 9, 500)
  ref, ker = _both(g, rule.total, rule, tile=1024)
  for a, b in zip(ref, ker):
    np.testing.assert_array_equal(a, b)
  dest, _, widths, _ = ref
  tied_widths = widths[dest[g == 1] // n]
  assert len(set(tied_widths.tolist())) > 1  # a boundary's key is the ties' own
  first = g[:1024]
  assert (first > 1).sum() > 256 and (first == 1).sum() > 256  # both counts past 2^8


@pytest.mark.parametrize("errors, bits", [(ERRORS, 8.0), ({4: 0.02}, 4.0)])
def test_one_class(errors, bits):
  """Every position at one width (the budget pays for the widest, or one width only):
  slots in index order."""
  rule = _rule(errors, 4, 40, bits, 4)
  assert rule.one_class
  ref, ker = _both(_norms("random", rule.total, np.random.default_rng(1)), 150, rule)
  for a, b in zip(ref, ker):
    np.testing.assert_array_equal(a, b)
  assert ref[3].tolist() == [40 if w == rule.top_width else 0 for w in rule.widths]


def test_reference_is_the_codecs_allocation():
  """plan's dest and counts are allocation.allocate's (the rule itself: its tests)."""
  rng = np.random.default_rng(3)
  n, positions = 8, 64
  cost = {w: n * 256 * w for w in ERRORS}
  budget = positions * n * 256 * 3.5
  g = _norms("zeros", n * positions, rng)
  for blocks in (1, n):  # each under jit: one compile, not an eager dispatch per operation
    dest, _, _, counts = jax.jit(lambda g, blocks=blocks: allocation.plan(
        g, 500, ERRORS, positions, cost, budget, n, blocks, implementation="xla"))(g)
    want = jax.jit(lambda g, blocks=blocks: allocation.allocate(
        g, jnp.arange(n * positions) < 500, ERRORS, positions, cost, budget, n, blocks))(g)
    np.testing.assert_array_equal(dest, want[0])
    np.testing.assert_array_equal(counts, want[1])


def test_dispatch_and_vmap():
  """implementation=None is the reference on CPU, 'pallas' the kernel (interpreted off
  GPU); both under vmap, each element its own allocation."""
  rule = _rule(ERRORS, 4, 45, 3.3, 1)
  rng = np.random.default_rng(5)
  g = np.stack([_norms("random", rule.total, rng) for _ in range(2)])
  outs = {impl: jax.jit(jax.vmap(lambda x, impl=impl: K.plan(
      x, real=rule.total, rule=rule, implementation=impl)))(g) for impl in (None, "pallas")}
  for a, b in zip(outs[None], outs["pallas"]):
    np.testing.assert_array_equal(a, b)
  # element 1 is the reference's allocation of g[1] alone (test_kernel_equals_reference's
  # compiled reference: the same real and rule)
  one = _reference(rule.total, rule)(g[1])
  for a, b in zip(outs[None], one):
    np.testing.assert_array_equal(a[1], b)


def test_bad_input_names_the_value():
  rule = _rule(ERRORS, 4, 45, 3.3, 1)
  with pytest.raises(ValueError, match=r"gnorm.shape=\(10,\) must be \(180,\)"):
    K.plan(jnp.zeros(10), real=10, rule=rule)
  with pytest.raises(ValueError, match="real=181 must be in"):
    K.plan(jnp.zeros(180), real=181, rule=rule)
  with pytest.raises(ValueError, match="tile=48 must be a power of two"):
    K.plan_pallas(jnp.zeros(180), real=180, rule=rule, tile=48, interpret=True)
  with pytest.raises(ValueError, match=r"tile=32768 must be a power of two in \[32, 2\^14\]"):
    K.plan_pallas(jnp.zeros(180), real=180, rule=rule, tile=2**15, interpret=True)
  with pytest.raises(ValueError, match=r"planes=\(3, 10\): give \(plane_bits in \(1, 2\)"):
    K.plan(jnp.zeros(180), real=180, rule=rule, planes=(3, 10))
  with pytest.raises(ValueError, match="blocks=3 must be 1 or n=4"):
    _rule(ERRORS, 4, 45, 3.3, 3)


KERNELS = ("dynamiq_allocate_b1", "dynamiq_allocate_b8")


def compile_kernels():
  """The allocation kernel compiled alone for one H100 (runs in the child): an
  all-reduce's and a reduce-scatter's, 2^25 coordinates over 8 ranks."""
  from pallas_kernels import dynamiq_allocation as K  # pylint: disable=redefined-outer-name
  from dynamiq_jax.codecs import allocation as A  # pylint: disable=redefined-outer-name

  [device] = T.h100_devices(1)
  sharding = jax.sharding.SingleDeviceSharding(device)
  n, positions = 8, (1 << 25) // 256 // 8
  out = []
  for blocks in (1, n):
    cost = {w: n * 256 * w for w in (2, 4, 8)}
    rule = A.rule({2: 0.2, 4: 0.02, 8: 0.0001}, positions, cost, positions * n * 256 * 4.2, n,
                  blocks)
    g = jax.ShapeDtypeStruct((rule.total,), jnp.float32, sharding=sharding)
    with T.gpu_target(device):
      # (as DynamiQ launches it: with the hops' plane table)
      out.append(jax.jit(lambda x, rule=rule: K.plan(x, real=rule.total - 3, rule=rule,
                                                     planes=(1, positions * 8)))
                 .trace(g).lower().compile())
  return out


@G.needs_compiler
def test_kernel_compiles_for_h100_without_spills(record_property):
  with T.compile_in_child("test_allocation_kernel:compile_kernels") as build:
    # (XLA writes an empty PTX file for a module with no kernel of its own)
    report = T.ptxas_report([p for p in build.ptx if p.stat().st_size],
                            prefix="dynamiq_allocate_")
  record_property("gpu_compile_allocation", json.dumps(report))
  assert set(KERNELS) <= set(report), report
  for name, v in report.items():
    assert v["spill_bytes"] == 0, (name, v)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")
@pytest.mark.parametrize("blocks", [1, 8])
def test_kernel_on_gpu_equals_reference(blocks, record_property):
  """On a GPU: the compiled kernel against XLA's reference, bit for bit, at 2^25
  coordinates over 8 ranks; both times recorded (JAX_PLATFORMS=cuda,cpu pytest -n 0)."""
  import time
  n, positions = 8, (1 << 25) // 256 // 8
  rule = _rule(ERRORS, n, positions, 4.2, blocks)
  g = jnp.asarray(_norms("random", rule.total, np.random.default_rng(11)))
  times = {}
  outs = {}
  for impl in ("pallas", "xla"):
    f = jax.jit(lambda x, impl=impl: K.plan(x, real=rule.total - 3, rule=rule,
                                            planes=(1, positions * 8), implementation=impl))
    outs[impl] = jax.block_until_ready(f(g))
    t0 = time.perf_counter()
    for _ in range(5):
      jax.block_until_ready(f(g))
    times[impl] = (time.perf_counter() - t0) / 5
  record_property("allocation_gpu_seconds", json.dumps(times))
  for a, b in zip(outs["pallas"], outs["xla"]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
