"""Static hop plans for bandwidth-optimal multi-hop all-reduce.

Both of the paper's schedules (its §4 and Fig. 13) are one shape: the data is cut into
``n`` chunks; chunk 0 is reduced along an in-tree over the ranks whose edges
``(child -> parent)`` run one per time step, and chunk ``c`` uses the same
tree with every rank id shifted by ``+c`` (mod n). At step ``j`` with edge
``(a -> b)`` every rank ``r`` therefore sends chunk ``r - a`` to rank
``r + (b - a)`` and receives chunk ``r - b``: one chunk out and one in per
rank per step, the volume of a ring. The root holds the full sum of its chunk
at the end, compresses it once more, and an all-gather forwards those final
payloads unchanged.

* ring: the path ``0 -> 1 -> ... -> n-1``; every received partial sum is
  re-encoded at the next step (fused decode-add-encode).
* butterfly: a binary tree by repeated pairing, depth ``log2 n``.

``two_step`` (:class:`TwoStepPlan`, Flash Communication's all-reduce) is not a
tree: one all-to-all gives each rank every rank's payload of its own chunk,
which it decodes, adds and encodes once more, and the gather phase forwards
those payloads: the ring's bytes, two encodes of every value whatever n.

Plans are plain Python data, validated without tracing.
"""

from __future__ import annotations

import dataclasses
import functools

from dynamiq_jax.schedules.names import FLAT_SCHEDULES, check_schedule

__all__ = ["TreePlan", "TwoStepPlan", "ring_plan", "butterfly_plan", "two_step_plan",
           "get_plan"]


@dataclasses.dataclass(frozen=True)
class TreePlan:
  """An ordered in-tree over ``n`` ranks (chunk 0's reduction tree).

  Attributes:
    name: schedule name.
    n: number of ranks.
    edges: ``(child, parent)`` pairs in execution order, one per step.
    root: the rank that ends with chunk 0's full sum.
  """

  name: str
  n: int
  edges: tuple[tuple[int, int], ...]
  root: int

  def __post_init__(self):
    self.validate()

  @property
  def steps(self) -> int:
    return len(self.edges)

  def shift(self, j: int) -> int:
    a, b = self.edges[j]
    return (b - a) % self.n

  def fused(self, j: int) -> bool:
    """Whether the chunk received at step j is the one sent at step j + 1.

    For the last step: whether it is received by the root (then the root's
    final encode fuses with it).
    """
    if j == self.steps - 1:
      return self.edges[j][1] == self.root
    return self.edges[j][1] == self.edges[j + 1][0]

  def before(self, j: int) -> str:
    """What step j does first with the chunk received at step j - 1.

    ``"none"`` (step 0), ``"fused"`` (it is this step's send: decode, add,
    encode in one pass) or ``"add"`` (decode-add it into the local copy, then
    encode this step's send from the local copy).
    """
    if j == 0:
      return "none"
    return "fused" if self.fused(j - 1) else "add"

  def segments(self) -> list[tuple[int, int]]:
    """Runs ``(start, length)`` of steps that one loop body can execute.

    Within a run every step has the same shift and the same ``before``, and
    the sent chunk offset ``a_j`` and the previously received ``b_{j-1}`` are
    affine in j. The ring is one run after its first step; the butterfly
    two runs per tree level; so compile time grows with log n at most.
    """
    runs = []
    j = 0
    while j < self.steps:
      k = j + 1
      while k < self.steps and self._continues(j, k):
        k += 1
      runs.append((j, k - j))
      j = k
    return runs

  def _continues(self, start: int, k: int) -> bool:
    if self.shift(k) != self.shift(start) or self.before(k) != self.before(start):
      return False
    if self.before(start) == "none":
      return False
    def affine(f):
      vals = [f(i) for i in range(start, k + 1)]
      return len(vals) < 3 or len({b - a for a, b in zip(vals[:-1], vals[1:])}) == 1
    return affine(lambda i: self.edges[i][0]) and affine(lambda i: self.edges[i - 1][1])

  def partials(self) -> tuple[int, ...]:
    """How many ranks' data each encode of one chunk carries, one entry per rank.

    Rank ``r`` encodes the sum over its subtree once (the root its full sum,
    ``n``): the ring's are ``1, 2, ..., n``; the butterfly's halve per level.
    A codec's error estimate sums one quantisation error per entry.
    """
    size = {r: 1 for r in range(self.n)}
    for a, b in self.edges:  # a child sends after all of its own receives
      size[b] += size[a]
    return tuple(size[r] for r in range(self.n))

  def depth(self) -> int:
    """Longest leaf-to-root path, in edges."""
    parent = dict(self.edges)
    best = 0
    for r in range(self.n):
      k, node = 0, r
      while node != self.root:
        node = parent[node]
        k += 1
      best = max(best, k)
    return best

  def validate(self):
    n = self.n
    if n < 1:
      raise ValueError(f"{n=} must be >= 1")
    if not 0 <= self.root < n:
      raise ValueError(f"root={self.root} out of range for {n=}")
    if len(self.edges) != n - 1:
      raise ValueError(f"a tree over {n} ranks needs {n - 1} edges, got {len(self.edges)}")
    parent = {}
    for a, b in self.edges:
      if not (0 <= a < n and 0 <= b < n) or a == b:
        raise ValueError(f"bad edge {(a, b)} for {n=}")
      if a in parent:
        raise ValueError(f"rank {a} sends twice")
      parent[a] = b
    if self.root in parent:
      raise ValueError("the root must not send")
    # Every rank reaches the root, and sends only after all of its receives.
    sent_at = {a: j for j, (a, _) in enumerate(self.edges)}
    for j, (a, b) in enumerate(self.edges):
      if b != self.root and sent_at[b] < j:
        raise ValueError(f"rank {b} receives at step {j} after sending at {sent_at[b]}")
    for r in range(n):
      node, hops = r, 0
      while node != self.root:
        node = parent[node]
        hops += 1
        if hops > n:
          raise ValueError("edges contain a cycle")
    # Shifting the tree by every c makes each step a permutation: one chunk
    # out and one chunk in per rank (true for any edge; checked for safety).
    for j in range(self.steps):
      a, b = self.edges[j]
      dests = {(r + b - a) % n for r in range(n)}
      assert len(dests) == n


@functools.lru_cache(maxsize=None)
def ring_plan(n: int) -> TreePlan:
  """The ring: chunk c travels c -> c+1 -> ... -> c-1 (n - 1 hops)."""
  return TreePlan("ring", n, tuple((s, s + 1) for s in range(n - 1)), n - 1)


@functools.lru_cache(maxsize=None)
def butterfly_plan(n: int) -> TreePlan:
  """The paper's "butterfly": a binary reduction tree by repeated pairing.

  Level 0 pairs (0->1), (2->3), ...; level 1 (1->3), (5->7), ...; the root is
  n - 1 and every chunk's aggregation depth is log2 n (the paper's Fig. 13).
  """
  if n < 1 or n & (n - 1):
    raise ValueError(
        f"axis_size={n} must be a power of two for schedule='butterfly'; use 'ring'")
  edges = []
  stride = 1
  while stride < n:
    for start in range(stride - 1, n, 2 * stride):
      edges.append((start, start + stride))
    stride *= 2
  return TreePlan("butterfly", n, tuple(edges), n - 1)


@dataclasses.dataclass(frozen=True)
class TwoStepPlan:
  """``schedule="two_step"``: one all-to-all, each rank decoding and adding every rank's
  payload of its own chunk, one re-encode, one all-gather
  (:func:`~dynamiq_jax.schedules.executor.two_step`): Flash Communication's all-reduce.
  As many bytes per rank as the ring, and every value encoded twice whatever n.

  Attributes:
    name: ``"two_step"``.
    n: number of ranks.
  """

  name: str
  n: int

  @property
  def root(self) -> int:
    """Rank r ends the first step with chunk ``r - root``'s sum: its own chunk."""
    return 0

  def partials(self) -> tuple[int, ...]:
    """Every rank's encode of each chunk carries one rank's data; each chunk's sum is
    encoded once more, carrying all n (see :meth:`TreePlan.partials`)."""
    return (1,) * self.n + (self.n,)


@functools.lru_cache(maxsize=None)
def two_step_plan(n: int) -> TwoStepPlan:
  """The two-step plan over ``n`` ranks."""
  if n < 1:
    raise ValueError(f"{n=} must be >= 1")
  return TwoStepPlan("two_step", n)


_PLANS = {"ring": ring_plan, "butterfly": butterfly_plan, "two_step": two_step_plan}


def get_plan(schedule: str, n: int) -> TreePlan | TwoStepPlan:
  """The plan for a schedule name."""
  check_schedule(schedule, FLAT_SCHEDULES, what="a flat plan (one axis)")
  return _PLANS[schedule](n)


def ring_bytes_per_rank(total_bytes, n: int):
  """Bytes each rank sends in one all-reduce of ``total_bytes`` over ``n`` ranks: a
  chunk of ``total_bytes / n`` per hop for the ``2 (n - 1)`` hops of a ring
  (reduce-scatter, then all-gather); the butterfly's tree plans send as many."""
  return total_bytes * 2 * (n - 1) / n
