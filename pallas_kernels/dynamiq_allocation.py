"""DynamiQ's allocation (which slot each super-group takes) as one Pallas Triton kernel.

:func:`plan` is what a bucket calls: from the global super-group norms ``gnorm`` float32
``[total]`` and the static :class:`~pallas_kernels.allocation_reference.Rule`, each
super-group's slot ``dest``, the inverse permutation in chunk order (``order_t`` ``[n,
positions]``: chunk c's position j holds super-group ``order_t[c, j]``), the width of
each position, and the positions per width. One launch of :func:`plan_pallas` in a GPU
lowering, the jnp reference :func:`~pallas_kernels.allocation_reference.plan_reference`
elsewhere (the product path on CPU), by :func:`pallas_kernels.dispatch.dispatch`.

Algorithm (the rule itself: :mod:`dynamiq_jax.codecs.allocation`), the same steps in
kernel and reference, sharing their arithmetic
(:func:`~pallas_kernels.allocation_reference.statistic`,
:func:`~pallas_kernels.allocation_reference.multiplier`,
:func:`~pallas_kernels.allocation_reference.fix_up`,
:func:`~pallas_kernels.allocation_reference.class_counts`), so that the two agree bit
for bit:

1. F, each super-group's statistic: the norm scaled by the largest one's
   power of two, rounded to bf16 and squared;
2. the least multiplier ``lam`` whose widths fit the budget: 31 bisection
   steps over its float32 bit patterns, each counting ``#{F >= lam t_b}``
   for every hull boundary b; then the fix-up of what the budget has left;
3. each boundary's key, the ``want_b``-th largest F of the block (32
   bisection steps over its bit patterns), and how many of its ties are in;
4. one exclusive prefix count of the keys above each boundary's key and of
   its ties: a super-group's class and its rank in its class, hence its slot.

Memory layout of the kernel: ``blocks`` programs (1 for an all-reduce, n for
a reduce-scatter, whose chunk c ranks its own ``positions`` super-groups);
every operand stays in global memory (``memory_space=ANY``) and each program
loops (``lax.fori_loop``) over tiles of :data:`TILE` super-groups, loading
the norms at computed offsets and recomputing F from them on every pass
(nothing but the norms is read: ~70 passes over 4 bytes a super-group).
Steps 1 and 2 read all ``total`` norms in every program (they are global),
steps 3 and 4 the program's own block. The prefix count of step 4 is
``cumsum`` within a tile plus a running count carried across tiles (one
``cumsum`` per boundary: its two counts, above and tied, packed 16 bits each). Program
k writes ``dest`` and ``order_t`` of its block (``order_t`` by a scatter
store: a slot's position), and program 0 the position widths and counts.

Compiled for sm_90a from a CPU host, both variants (all-reduce and reduce-scatter)
compile without spills (tests/test_allocation_kernel.py). Its run time on a GPU
is not measured yet (no GPU here): a single program per block that makes
~70 dependent passes over the norms is latency-bound: an estimate (not a
measurement) puts it at milliseconds at 2^25 coordinates, not microseconds;
``test_kernel_on_gpu_equals_reference`` records it where a GPU runs the tests.
A radix select (a few histogram passes instead of the 63 bisection passes)
is the next step if it matters.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import allocation_reference as AR
from pallas_kernels import dispatch as D
from pallas_kernels.allocation_reference import Rule, allocate_reference, multiplier
from pallas_kernels.allocation_reference import plan_reference, statistic
from pallas_kernels import triton_ops as tt

__all__ = [
    "TILE",
    "NUM_WARPS",
    "Rule",
    "statistic",
    "multiplier",
    "allocate_reference",
    "plan_reference",
    "plan_pallas",
    "plan",
]

TILE = 1024
"""Super-groups per tile of the kernel's loops: 4 per thread with :data:`NUM_WARPS` warps."""

NUM_WARPS = 8
"""Warps per program. A thread's code in a loop body grows with its super-groups per
tile, and LLVM's SLP vectorizer, which takes most of the kernel's compile time, grows
faster than that code: 8 warps halve each thread's share of 4 warps' (fewer registers,
less compile, ``tools/kernel_compile_cpu.py``); 16 spill in the reduce-scatter's
variant (``tests/test_allocation_kernel.py``)."""


# ----------------------------------------------------------------------------
# The kernel.


def _store(ref, size: int, offsets, values, ok):
  """Stores ``values`` at ``offsets`` of the flat ``ref`` of ``size`` entries where ``ok``.
  Lanes not ``ok`` point past the end: a GPU skips them, and interpret mode's masked
  store (a read-modify-write scatter) drops them instead of racing a lane that stores."""
  tt.store(ref, jnp.where(ok, offsets, size), values, ok)


def _plan_kernel(g_ref, dest_ref, order_ref, widths_ref, counts_ref, *ptab_ref, rule: Rule,
                 real: int, tile: int, planes: tuple[int, int] | None = None,
                 stride: int = 1, column: int = 0):
  """Program k: the allocation of block k (module docstring); with ``planes``, program 0
  also stores the hops' plane table
  (:func:`~pallas_kernels.allocation_reference.plane_table`). The norm of super-group i
  is entry ``i stride + column`` of ``g_ref`` (a column of the statistics, read in
  place)."""
  k = pl.program_id(0)
  total, per, n, positions = rule.total, rule.per, rule.n, rule.positions
  bounds = len(rule.t)
  lanes = jnp.arange(tile, dtype=jnp.int32)

  def norms(idx, ok):  # masked norms at global indices idx (ok: in range)
    g = tt.load(g_ref, jnp.where(ok, idx, 0) * stride + column, ok)
    return AR.masked_norms(g, idx < real)

  def over(count: int, body, init):
    return jax.lax.fori_loop(0, pl.cdiv(count, tile), body, init)

  def top_of(i, m):
    idx = i * tile + lanes
    ok = idx < total
    return jnp.maximum(m, jnp.max(jnp.where(ok, norms(idx, ok), -jnp.inf)))

  base = k * per
  if rule.one_class:
    want, above_v, need = (), (), ()
    top = jnp.float32(0)
  else:
    top = over(total, top_of, jnp.float32(-jnp.inf))

    def f_at(idx, ok):
      return AR.scaled_statistic(norms(idx, ok), top)

    def at_least(lam):  # positions beyond each boundary, over all super-groups
      def body(i, acc):
        idx = i * tile + lanes
        ok = idx < total
        f = f_at(idx, ok)
        return tuple(a + jnp.sum(((f >= lam * np.float32(t)) & ok).astype(jnp.int32))
                     for a, t in zip(acc, rule.t))

      counts = over(total, body, (jnp.int32(0),) * bounds)
      return [AR.udiv(c + (n - 1), n) for c in counts]

    def bisect(_, lohi):
      lo, hi = lohi
      mid = lo + (hi - lo) // 2
      cost = sum(c * st for c, st in zip(at_least(multiplier(mid)), rule.step))
      ok = cost <= rule.limit
      return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 31, bisect, (jnp.uint32(0), jnp.uint32(0x7F800000)))
    c = AR.fix_up(at_least(multiplier(hi)), at_least(multiplier(lo)), rule)
    counts_list = AR.class_counts(c, rule)
    want = [ci * (n if rule.blocks == 1 else 1) for ci in c]

    def keys_at(j):  # this block's j-th tile: keys, in the block, global indices
      local = j * tile + lanes
      ok = local < per
      idx = base + local
      return jax.lax.bitcast_convert_type(f_at(idx, ok), jnp.uint32), ok, local, idx

    def bit(i, v):
      shift = jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32))
      cand = tuple(vb | shift for vb in v)

      def body(j, acc):
        key, ok, _, _ = keys_at(j)
        return tuple(a + jnp.sum(((key >= cb) & ok).astype(jnp.int32))
                     for a, cb in zip(acc, cand))

      cnt = over(per, body, (jnp.int32(0),) * bounds)
      return tuple(jnp.where(cn >= w, cb, vb) for cn, w, cb, vb in zip(cnt, want, cand, v))

    above_v = jax.lax.fori_loop(0, 32, bit, (jnp.uint32(0),) * bounds)

    def above_count(j, acc):
      key, ok, _, _ = keys_at(j)
      return tuple(a + jnp.sum(((key > v) & ok).astype(jnp.int32)) for a, v in zip(acc, above_v))

    n_above = over(per, above_count, (jnp.int32(0),) * bounds)
    need = [w - a for w, a in zip(want, n_above)]

  if rule.one_class:
    counts_list = [jnp.int32(positions if x == rule.top_width else 0) for x in rule.widths]

  def slots(j, carry):
    if rule.one_class:
      local = j * tile + lanes
      ok = local < per
      idx = base + local
      slot = local
    else:
      key, ok, local, idx = keys_at(j)
      above_before, tie_before = carry
      cls = jnp.zeros((tile,), jnp.int32)
      prefix = []
      new_a, new_t = [], []
      for b in range(bounds):
        a = ((key > above_v[b]) & ok).astype(jnp.int32)
        t = ((key == above_v[b]) & ok).astype(jnp.int32)
        # both counts in one scan: a in the low 16 bits, t in the high ones (a count
        # within a tile is at most tile <= 2^14: no field carries into the next): the
        # scans are most of the kernel's compile time (tools/kernel_compile_cpu.py)
        both = a | (t << 16)
        before = jnp.cumsum(both) - both
        a_before = above_before[b] + (before & 0xFFFF)
        t_before = tie_before[b] + (before >> 16)
        prefix.append(a_before + jnp.minimum(t_before, need[b]))
        cls = cls + (a | (t & (t_before < need[b]).astype(jnp.int32)))
        new_a.append(above_before[b] + jnp.sum(a))
        new_t.append(tie_before[b] + jnp.sum(t))
      carry = (tuple(new_a), tuple(new_t))
      p = [local] + prefix + [jnp.zeros_like(local)]
      slots_above = list(want) + [0]
      slot = jnp.zeros_like(local)
      for cl in range(bounds + 1):
        slot = jnp.where(cls == cl, slots_above[cl] + p[cl] - p[cl + 1], slot)
    if rule.blocks == 1:
      dest = slot
      where = AR.udiv(slot, n) + (slot - AR.udiv(slot, n) * n) * positions  # chunk c, position j
    else:
      dest = slot * n + k
      where = k * positions + slot
    _store(dest_ref, total, idx, dest, ok)
    _store(order_ref, total, where, idx, ok)
    return carry

  zeros = (jnp.int32(0),) * bounds
  over(per, slots, (zeros, zeros))

  first = k == 0
  ws = sorted(rule.widths, reverse=True)

  def widths_tile(j, _):
    pos = j * tile + lanes
    out = jnp.full((tile,), ws[-1], jnp.int32)
    end = jnp.int32(0)
    for i, w in zip(range(len(ws) - 1, -1, -1), ws):  # widest first
      start, end = end, end + counts_list[i]
      out = jnp.where((pos >= start) & (pos < end), w, out)
    ok = (pos < positions) & first
    _store(widths_ref, positions, pos, out, ok)
    return _

  over(positions, widths_tile, jnp.int32(0))
  slot_i = jnp.arange(AR.COUNTS, dtype=jnp.int32)
  vec = jnp.zeros((AR.COUNTS,), jnp.int32)
  for i, cnt in enumerate(counts_list):
    vec = jnp.where(slot_i == i, cnt, vec)
  ok = (slot_i < len(rule.widths)) & first
  _store(counts_ref, AR.COUNTS, slot_i, vec, ok)
  if planes is not None:
    _store(ptab_ref[0], AR.COUNTS, slot_i, AR.plane_table(counts_list, rule, planes),
           (slot_i < AR.COUNTS) & first)  # every entry, by program 0


@functools.partial(jax.jit, static_argnames=("real", "rule", "tile", "interpret", "planes",
                                             "column"))
def _launch(gnorm, *, real: int, rule: Rule, tile: int, interpret: bool, planes=None,
            column=None):
  total, positions = rule.total, rule.positions
  out_shape = [jax.ShapeDtypeStruct((total,), jnp.int32),
               jax.ShapeDtypeStruct((total,), jnp.int32),
               jax.ShapeDtypeStruct((positions,), jnp.int32),
               jax.ShapeDtypeStruct((AR.COUNTS,), jnp.int32)]
  if planes is not None:
    out_shape.append(jax.ShapeDtypeStruct((AR.COUNTS,), jnp.int32))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltr
    params = pltr.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
  dest, order, widths, counts, *ptab = pl.pallas_call(
      functools.partial(_plan_kernel, rule=rule, real=real, tile=tile, planes=planes,
                        stride=1 if column is None else gnorm.shape[1], column=column or 0),
      out_shape=[D.typed_like(s, [gnorm]) for s in out_shape], grid=(rule.blocks,),
      in_specs=[anywhere], out_specs=[anywhere] * len(out_shape), compiler_params=params,
      interpret=interpret, name=f"dynamiq_allocate_b{rule.blocks}")(gnorm.reshape(-1))
  return (dest, order.reshape(rule.n, positions), widths, counts[:len(rule.widths)], *ptab)


def plan_pallas(gnorm, *, real: int, rule: Rule, tile: int | None = None,
                interpret: bool = False, planes: tuple[int, int] | None = None,
                column: int | None = None):
  """``(dest, order_t, widths, counts[, ptab])`` of :func:`plan` in one Pallas Triton launch
  of ``rule.blocks`` programs, mapped over a ``vmap`` batch."""
  AR.check(gnorm, real, rule, column)
  tile = TILE if tile is None else int(tile)
  if tile < 32 or tile > 2**14 or tile & (tile - 1):
    raise ValueError(f"tile={tile} must be a power of two in [32, 2^14] (the slots' counts "
                     "of a tile share one 32-bit scan, 16 bits each)")
  if len(rule.widths) > AR.COUNTS:
    raise NotImplementedError(f"{len(rule.widths)} widths (the kernel counts {AR.COUNTS})")
  if not interpret:
    from pallas_kernels import dynamiq_triton  # pylint: disable=import-outside-toplevel
    warnings.filterwarnings("ignore", message=dynamiq_triton.TRITON_DEPRECATION,
                            category=DeprecationWarning)
  launch = functools.partial(_launch, real=int(real), rule=rule, tile=tile,
                             interpret=bool(interpret), planes=_planes(planes), column=column)
  g = jnp.asarray(gnorm)
  if g.dtype not in (jnp.float32, jnp.bfloat16):  # (read as they are: no copy converts them)
    g = g.astype(jnp.float32)
  return D.map_over_batch(launch, g)


def _planes(planes):
  """``planes`` checked: None, or ``(plane_bits, units)`` as two ints."""
  if planes is None:
    return None
  plane_bits, units = (int(v) for v in planes)
  if plane_bits not in (1, 2) or units < 0:
    raise ValueError(f"planes={planes}: give (plane_bits in (1, 2), units >= 0)")
  return plane_bits, units


def plan(gnorm, *, real: int, rule: Rule, planes: tuple[int, int] | None = None,
         column: int | None = None, implementation: D.Implementation = None,
         interpret: bool | None = None):
  """Each super-group's slot, the chunks' super-groups, and the widths of the positions.

  Args:
    gnorm: float32 or bfloat16 ``[rule.total]``: the global super-group norms (>= 0);
      with ``column``, ``[rule.total, k]`` statistics whose column ``column`` holds them
      (read in place: no slice of them is made).
    real: super-groups that are not padding (the first ``real``; static).
    rule: the static :class:`Rule`.
    planes: ``(plane_bits, units)`` of the chunks' payloads, or None: with them, the
      hops' plane table (int32 [16],
      :func:`~pallas_kernels.dynamiq_reference.plane_table_of_counts` of the counts)
      comes fifth, made by the same launch.
    implementation: None (the Triton kernel in a GPU lowering, else the reference),
      ``"pallas"`` or ``"xla"`` (:func:`pallas_kernels.dispatch.dispatch`); ``"mosaic"``
      (the hops' Mosaic GPU kernels) is None here.
    interpret: overrides the kernel's interpret mode.

  Returns:
    ``(dest, order_t, widths, counts)``: int32 ``[total]``, the slot of each
    super-group (slot ``j n + c``: chunk c, position j); int32 ``[n, positions]``,
    the super-group at chunk c's position j; int32 ``[positions]``, the width of each
    position (widest first); int32 ``[len(rule.widths)]``, positions per width
    (ascending widths); with ``planes``, the plane table.
  """
  if implementation == "mosaic":  # no Mosaic GPU kernel of its own: Triton's where it is
    implementation = None
  return D.dispatch("allocate", D.Kernels(plan_pallas), plan_reference, implementation,
                    interpret, gnorm, real=int(real), rule=rule, planes=_planes(planes),
                    column=None if column is None else int(column))
