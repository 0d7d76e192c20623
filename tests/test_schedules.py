"""Static hop plans: structure and validation, without tracing."""

import pytest

from dynamiq_jax.schedules import plan as plan_lib


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 64])
def test_ring_plan(n):
  p = plan_lib.ring_plan(n)
  assert p.steps == n - 1 and p.root == n - 1
  assert p.depth() == n - 1
  # one loop body after the first step: compile time independent of n
  assert p.segments() == ([(0, 1)] + ([(1, n - 2)] if n > 2 else []) if n > 1 else [])


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64])
def test_butterfly_plan(n):
  p = plan_lib.butterfly_plan(n)
  assert p.steps == n - 1 and p.root == n - 1
  assert p.depth() == (n.bit_length() - 1)
  segs = p.segments()
  assert sum(length for _, length in segs) == p.steps
  assert len(segs) <= 2 * max(1, n.bit_length() - 1)  # O(log n) loop bodies
  if n == 8:  # spec §1.8: (0->1),(2->3),(4->5),(6->7),(1->3),(5->7),(3->7)
    assert p.edges == ((0, 1), (2, 3), (4, 5), (6, 7), (1, 3), (5, 7), (3, 7))


@pytest.mark.parametrize("n", [3, 6, 12])
def test_butterfly_needs_power_of_two(n):
  with pytest.raises(ValueError, match="power of two.*'ring'"):
    plan_lib.butterfly_plan(n)


@pytest.mark.parametrize("name,n", [("ring", n) for n in (2, 3, 4, 8, 16)]
                         + [("butterfly", n) for n in (2, 4, 8, 16)])
def test_every_chunk_reaches_every_rank_once(name, n):
  """Simulate the shifted trees: chunk c's sum collects each rank exactly once."""
  p = plan_lib.get_plan(name, n)
  held = {(r, c): {r} for r in range(n) for c in range(n)}  # ranks summed into r's copy of c
  for a, b in p.edges:
    moves = []
    for r in range(n):
      c = (r - a) % n  # rank r sends chunk r - a to r + (b - a)
      moves.append(((r + b - a) % n, c, held[(r, c)]))
    for dst, c, contrib in moves:
      assert (dst - b) % n == c  # the receiver expects exactly that chunk
      assert not (held[(dst, c)] & contrib)  # nothing is added twice
      held[(dst, c)] = held[(dst, c)] | contrib
  for c in range(n):
    assert held[((c + p.root) % n, c)] == set(range(n))


def test_invalid_plans_are_rejected():
  with pytest.raises(ValueError, match="sends twice"):
    plan_lib.TreePlan("x", 3, ((0, 2), (0, 1)), 2)
  with pytest.raises(ValueError, match="after sending"):
    plan_lib.TreePlan("x", 3, ((1, 2), (0, 1)), 2)
  with pytest.raises(ValueError, match="needs 2 edges"):
    plan_lib.TreePlan("x", 3, ((0, 2),), 2)
  with pytest.raises(ValueError, match="root must not send"):
    plan_lib.TreePlan("x", 3, ((0, 1), (2, 0)), 2)
  with pytest.raises(ValueError, match="schedule='tree'"):
    plan_lib.get_plan("tree", 4)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_chunk_index_is_the_nonnegative_modulo(n):
  """executor.chunk_index: ``(r - s) mod n`` as uint32 for every rank and offsets of either
  sign, given as an int (unrolled hops) or a traced int32 (hops in a loop)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from dynamiq_jax.schedules.executor import chunk_index

  offsets = list(range(-2 * n - 1, 2 * n + 2))
  traced = jax.jit(jax.vmap(jax.vmap(lambda r, s: chunk_index(r, s, n), (None, 0)), (0, None)))
  got = np.asarray(traced(jnp.arange(n, dtype=jnp.int32), jnp.asarray(offsets, jnp.int32)))
  want = np.array([[(r - s) % n for s in offsets] for r in range(n)])
  assert got.dtype == np.uint32
  np.testing.assert_array_equal(got, want)
  for r in range(n):
    for s in offsets:
      assert int(chunk_index(jnp.int32(r), s, n)) == (r - s) % n
