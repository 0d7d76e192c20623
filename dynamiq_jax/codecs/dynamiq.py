"""DynamiQ (Han, Vargaftik, Mitzenmacher, Ben Basat; SIGCOMM 2026).

One all-reduce of a flat bucket ``x`` (this rank's gradient, pre-divided by
n when averaging), as in the paper's §3:

1. Per super-group of 256 coordinates: the local mean and the L2 norm of
   the centred residual. Both go through one small all-reduce in two
   collectives (2 bf16 values per super-group: 0.125 bit/coordinate;
   :func:`~dynamiq_jax.schedules.executor.two_step`): means add (rounded to
   bf16 stochastically, so the sum stays unbiased), norms combine as the
   root of their summed squares, so that the result is ``sqrt(F)`` with
   ``F`` the sum of local squared norms (the paper's statistic, kept in
   range for any float32 input).
2. Each rank subtracts its *own* mean (the authors' artifact; the paper
   subtracts the global mean). Both give the same final sum, but with local
   centring every partial sum along the path is exactly zero-mean, and no rank
   has to wait for the statistics before centring.
3. The widths are chosen this round from the global F (identical on every
   rank), within the chunk's fixed byte budget: each width takes a multiple of
   n super-groups, the largest F first, dealt to the chunks in turn, so
   position j of every chunk has one width, widest first
   (:func:`~dynamiq_jax.codecs.allocation.allocate`: no sort).
4. Each chunk travels as one payload of static size (:mod:`pallas_kernels.dynamiq_reference`:
   scale records, then code units), reduced on the schedule with the per-hop
   decompress-accumulate-recompress of :mod:`pallas_kernels.dynamiq`.
5. The decoded chunks are put back in rank order and the reduced means added.

Bits: every byte on the wire is counted, padding included: 0.125
(statistics) + 0.5625 (uint8 group scales and bf16 super-group scales) +
the code units the budget pays for.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs import allocation
from dynamiq_jax.codecs._exact import row_norm
from dynamiq_jax.codecs.base import Codec, Metadata, Plan, ceil_div, pad_to, partial_sum_energy
from dynamiq_jax.codecs.supergroup_stats import STATS_BITS, DynamiQKeyTables, SupergroupStats
from dynamiq_jax.codecs.supergroup_stats import hop_words
from pallas_kernels import dynamiq as kernels
from pallas_kernels import dynamiq_block as block
from pallas_kernels import dynamiq_reference as payload_lib
from pallas_kernels import dynamiq_stats as stats_kernels
from pallas_kernels import rng

__all__ = ["DynamiQ", "DynamiQLayout"]

SUPERGROUP = block.SUPERGROUP
_NO_SCALE = 1 << 10  # a guard exponent that scales no float32 (metadata of a guarded bucket)

DEFAULT_EPS = ((2, 0.23), (4, 0.18), (8, 0.10))
"""MEE eps of the authors' kernel; widths between are interpolated linearly."""

LEVEL_SETS = ("lattice", "mee")
"""DynamiQ's level sets (``level_set=``), the default first."""

DEFAULT_WIDTHS = (2, 3, 4, 5, 6, 8)
"""Default code widths (the paper's prototype uses 2, 4, 8)."""

SMALL_BUCKET_SLACK = 0.25
"""Code bits per coordinate a bucket may lack against a large bucket and still be
compressed: 4^0.25 = 1.41x the error, at most."""

_REMOVED = ("allocation", "variable_width", "levels", "hierarchical", "group_size", "profile",
            "fractions")


def _as_pairs(v, name):
  items = v.items() if isinstance(v, Mapping) else v
  try:
    pairs = tuple(sorted((int(k), float(x)) for k, x in items))
  except (TypeError, ValueError):
    raise TypeError(f"{name}={v!r} must map widths to numbers") from None
  return pairs


class DynamiQLayout(NamedTuple):
  """Static layout of one bucket: sizes are per all-reduce, not per rank."""

  d: int
  n: int
  supergroups: int  # real super-groups, ceil(d / 256)
  padded_supergroups: int  # a multiple of n
  stats_bits: int
  payload_bits: int
  units: int  # code units per chunk
  plane_bits: int  # bits per code plane (a unit holds one plane of one super-group)

  @property
  def wire_bits(self) -> int:
    return self.stats_bits + self.payload_bits

  @property
  def bits_per_coord(self) -> float:
    return self.wire_bits / self.d


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamiQ(Codec):
  """DynamiQ's compressed multi-hop all-reduce codec.

  Defaults are the paper's configuration with its widths chosen every round
  from a finer set and cheaper levels: lattice levels (the paper's MEE levels
  with ``level_set="mee"``), hierarchical 16/256 scales, correlated rounding, a
  5-bit budget counting all metadata.

  Args:
    bits: all-in budget in bits per coordinate (payload, scales, statistics
      and padding). Never exceeded; ``ValueError`` at trace time if the
      format cannot meet it for a bucket.
    widths: allowed code widths, a non-empty subset of 2..8 (default
      :data:`DEFAULT_WIDTHS`; the paper's are (2, 4, 8)).
    level_set: ``"lattice"`` (default): levels on a float lattice, rounded by one
      integer addition to a float's bits (``pallas_kernels.dynamiq_block.lattice_table``);
      ``"mee"``: the paper's MEE levels of ``eps``, rounded by a bracket search.
    eps: ``{width: eps}`` of the MEE levels (the authors' kernel values
      0.23/0.18/0.10 by default); other widths are interpolated. Used by
      ``level_set="mee"`` only.
    correlated: stratified rounding across ranks (shared seed); otherwise
      independent rounding. Every single quantisation is unbiased either
      way, and with independent rounding so is the whole all-reduce. With
      correlated rounding the draws of successive hops of a coordinate are
      stratified while each hop's input depends on the earlier roundings, so
      the all-reduce carries a small bias, far below the variance it
      removes (docs/design.md, *How it works*, has the figures). Use ``correlated=False``
      where exact unbiasedness matters more than variance.
    centre: subtract each super-group's mean before quantising and add the
      all-reduced means back (the paper's step 2). ``False`` quantises the
      raw values: exact zeros then stay exactly zero (zero is a level),
      which the centred codec does not guarantee when a super-group mixes
      zeros with non-zeros (embedding rows of absent tokens).
    scale_rounding: ``"up"`` (deterministic, the authors' kernel) or
      ``"stochastic"`` (the paper's text); both unbiased.

  Examples:
    >>> import dynamiq_jax as dq
    >>> codec = dq.codecs.DynamiQ(bits=5)
    >>> round(codec.layout(1 << 20, 8).bits_per_coord, 3) <= 5.0
    True

  References:
    W. Han, S. Vargaftik, M. Mitzenmacher, R. Ben Basat. "DynamiQ:
    Accelerating Gradient Synchronization using Compressed Multi-hop
    All-reduce", SIGCOMM 2026 (arXiv 2602.08923).
  """

  supports_scatter = True  # with bucket.scatter each chunk ranks its own super-groups

  bits: float = 5.0
  widths: tuple[int, ...] = DEFAULT_WIDTHS
  level_set: Literal["lattice", "mee"] = "lattice"
  eps: tuple[tuple[int, float], ...] = DEFAULT_EPS
  correlated: bool = True
  centre: bool = True
  scale_rounding: Literal["up", "stochastic"] = "up"

  def __new__(cls, *args, **kwargs):
    removed = sorted(set(kwargs) & set(_REMOVED))
    if removed:
      raise TypeError(
          f"DynamiQ takes no {', '.join(f'{k}=' for k in removed)}: the static-capacity "
          "variant and its options were removed; DynamiQ chooses its widths every round "
          "from the global statistics. Fix: drop the argument (widths= sets the allowed "
          "widths)")
    return super().__new__(cls)

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    if not (isinstance(self.bits, (int, float)) and np.isfinite(self.bits) and self.bits > 0):
      raise ValueError(f"bits={self.bits!r} must be a positive number of bits per coordinate")
    given = np.asarray(self.widths, dtype=object)
    if isinstance(self.widths, str) or given.ndim != 1 or not all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in given):
      raise TypeError(f"widths={self.widths!r} must be a sequence of int code widths, "
                      f"e.g. (2, 4, 8)")
    widths = tuple(sorted(set(int(w) for w in self.widths)))
    if not widths or any(not 2 <= w <= 8 for w in widths):
      raise ValueError(f"widths={self.widths!r} must be a non-empty subset of 2..8")
    if self.scale_rounding not in ("up", "stochastic"):
      raise ValueError(f"scale_rounding={self.scale_rounding!r} must be 'up' or 'stochastic'")
    if self.level_set not in LEVEL_SETS:
      raise ValueError(f"level_set={self.level_set!r} must be 'lattice' or 'mee'")
    eps = _as_pairs(self.eps, "eps")
    if not eps or any(not 0.0 < e < 1.0 for _, e in eps):
      raise ValueError(f"eps={self.eps!r} must give each width an eps in (0, 1)")
    if self.level_set == "lattice" and eps != _as_pairs(DEFAULT_EPS, "eps"):
      raise ValueError(f"eps={self.eps!r} sets the MEE levels, which level_set='lattice' "
                       "does not use: pass level_set='mee' with it, or drop eps")
    set_("widths", widths)
    set_("eps", eps)

  # -- static description ------------------------------------------------------

  granularity = SUPERGROUP
  """Buckets must hold whole super-groups."""

  def width_errors(self) -> dict[int, float]:
    """``{width: relative MSE of one quantisation}`` for this configuration."""
    if self.level_set == "lattice":
      return {w: allocation.lattice_error(w) for w in self.widths}
    eps = dict(self.eps)
    return {w: allocation.level_error(w, block.eps_for(w, eps)) for w in self.widths}

  @property
  def level_spec(self):
    """The kernels' level set: :data:`pallas_kernels.dynamiq_block.LATTICE` or MEE's eps
    pairs."""
    return block.LATTICE if self.level_set == "lattice" else self.eps

  def layout(self, d: int, n: int) -> DynamiQLayout:
    """Static sizes for a bucket of ``d`` coordinates over ``n`` ranks.

    Raises:
      ValueError: if no layout fits the bit budget.
    """
    return _layout(self, int(d), int(n))

  def wire_bits(self, d: int, n: int) -> int:
    """Exact bits of one all-reduce (all chunk payloads + statistics)."""
    return self.layout(d, n).wire_bits

  def metadata_bits(self, d: int, n: int) -> int:
    """The statistics' bits (:meth:`wire_bits` less the chunk payloads)."""
    return self.layout(d, n).stats_bits

  def compresses(self, d: int, n: int) -> bool:
    """Whether this bucket is compressed; ``allreduce`` sends the others as bf16.

    Padding to whole super-groups per chunk, and the statistics and scales of
    every padded super-group, cost a small bucket more per coordinate, so it
    has fewer code bits left than a large one. Each code bit lowers the error
    about 4x, so a bucket is compressed only where its code bits per
    coordinate are within :data:`SMALL_BUCKET_SLACK` of a large bucket's. So
    no bucket gets an error much above a large bucket's: a model one
    coordinate larger is compressed about as well, or sent uncompressed. If
    the budget cannot be met even for a large bucket (``bits`` too low for
    the format), this raises that error.
    """
    large = self.layout(max(d, n * SUPERGROUP * 4096), n)  # raises if no bucket meets it
    try:
      lay = self.layout(d, n)
    except ValueError:
      return False
    return _code_bits(lay, self.widths[0]) >= _code_bits(large, self.widths[0]) - SMALL_BUCKET_SLACK

  # -- the all-reduce ------------------------------------------------------------

  def _rows(self, x, bucket, mean=None):
    """x -> (local means, centred residuals [padded super-groups, 256]); ``mean``: the
    local means if already made (the statistics' pass keeps them: :meth:`guard_statistics`)."""
    lay = self.layout(bucket.d, bucket.n)
    total = lay.padded_supergroups
    xs = pad_to(x.astype(jnp.float32), total * SUPERGROUP).reshape(total, SUPERGROUP)
    if not self.centre:
      return jnp.zeros((total,), jnp.float32), xs
    if mean is None:  # a kernel in a GPU lowering: the statistics' pairwise tree, one launch
      mean = stats_kernels.row_mean(xs, implementation=bucket.implementation)
    return mean, xs - mean[:, None]

  def metadata(self, x, bucket, state, keys=None):
    """Per super-group: the local mean and the norm of the centred residual.

    Summed over ranks on the schedule by :class:`SupergroupStats` (means add,
    norms combine as ``hypot``): 32 bits per super-group. With ``keys``, one
    pass of :func:`pallas_kernels.dynamiq_stats.guard_stats` (a kernel in a GPU
    lowering) gives them already encoded for the first step
    (:meth:`_first_keys`); ``x`` is guarded, so its rows need no scaling.
    """
    del state
    n = bucket.n
    with jax.named_scope("dynamiq/stats"):
      if keys is None or not self.centre:
        mean, resid = self._rows(x, bucket)
        stats = jnp.stack([mean, row_norm(resid)], axis=-1)
        return Metadata(stats.reshape(n, -1, 2),
                        combine=SupergroupStats(implementation=bucket.implementation),
                        kept=mean if self.centre else None)
      votes, finish = self._statistics_pass(x, bucket, keys, safe_exponent=_NO_SCALE)
      return finish(jnp.float32(1))  # (_NO_SCALE scales nothing)

  def guard_statistics(self, x, bucket, keys, *, safe_exponent: int):
    """The guard's votes and the local statistics in one pass over the bucket (the hook of
    :func:`dynamiq_jax.engine.guard_metadata`).

    Returns ``(votes, finish)``: ``votes`` float32 ``[2, P]``, this rank's largest
    finite magnitude and non-finite flag (1.0) of P parts of the bucket, to be combined
    by a maximum over P and over the ranks; ``finish(scale)`` with the guard's factor
    (:func:`dynamiq_jax.guard.guarded`'s, from the ranks' largest magnitude) gives
    :meth:`metadata` of the guarded bucket (its rows scaled as the guard scales
    them: :mod:`pallas_kernels.dynamiq_stats` says where that is exact). None with
    ``centre=False`` (whose statistics are those of the raw values): the engine's guard.
    """
    if not self.centre:
      return None
    return self._statistics_pass(x, bucket, keys, safe_exponent=safe_exponent)

  def _statistics_pass(self, x, bucket, keys, *, safe_exponent: int):
    """:meth:`guard_statistics`' pass (also :meth:`metadata`'s, whatever a subclass's
    hook does)."""
    n = bucket.n
    lay = self.layout(bucket.d, n)
    total = lay.padded_supergroups
    with jax.named_scope("dynamiq/stats"):
      xs = pad_to(x.astype(jnp.float32), total * SUPERGROUP).reshape(total, SUPERGROUP)
      k0, k1, hop, stride = self._first_keys(keys, n)
      found = stats_kernels.guard_stats(
          xs, k0, k1, hop, s=total // n, safe_exponent=safe_exponent, stride=stride,
          implementation=bucket.implementation)
    votes = found.votes

    def finish(scale):
      with jax.named_scope("dynamiq/stats"):
        stats, centre = stats_kernels.rescale(found, safe_exponent=safe_exponent, scale=scale)
      return Metadata(stats.reshape(n, -1, 2),
                      combine=SupergroupStats(implementation=bucket.implementation),
                      kept=centre)

    return votes, finish

  @staticmethod
  def _first_keys(keys, n: int):
    """``(k0, k1, hop, stride)``: the flat key tables of the statistics' first encode, chunk
    c's at entry ``c stride + hop``, as :func:`~dynamiq_jax.schedules.executor.two_step`
    keys it (chunk c, step = this rank; step 1 when n = 1) and
    :meth:`SupergroupStats.encode` derives it."""
    hop = keys.rank if n > 1 else jnp.int32(1)
    tables = keys.tables
    if isinstance(tables, DynamiQKeyTables):  # [n, n + 1] each: (chunk, step)
      k0, k1 = (t.reshape(-1) for t in tables.stats)
      return k0, k1, hop, n + 1
    k0, k1 = keys.derive(jnp.arange(n, dtype=jnp.uint32), hop, rng.Stream.DYNAMIQ_STATS)
    return k0, k1, jnp.int32(0), 1

  def plan(self, x, meta, bucket, state, keys, kept=None):
    """Widths chosen this round from the global statistics (identical on every rank).

    The equal-marginal-gain rule of :func:`~dynamiq_jax.codecs.allocation.allocate`,
    with each width's measured error, within the chunk's fixed code budget: a
    width takes a multiple of n super-groups, the largest by the global norm
    (ties by index), and hands them to the chunks in turn (slot ``j n + c``:
    chunk c, position j), so position j of every chunk has the same width,
    widest first. With ``bucket.scatter``, chunk c takes its own super-groups,
    ranked among themselves. ``kept``: the local centring means of
    :meth:`guard_statistics`' pass (None: computed here, one more pass over ``x``).
    """
    del state
    n = bucket.n
    lay = self.layout(bucket.d, n)
    total, s = lay.padded_supergroups, lay.padded_supergroups // n
    stats = meta.reshape(total, 2)  # as gathered (bfloat16), read in place by the kernels
    _, resid = self._rows(x, bucket, kept)
    with jax.named_scope("dynamiq/allocate"):
      unit_bits = payload_lib.unit_bytes(lay.plane_bits) * 8
      # one Pallas kernel in a GPU lowering: slots, chunk order (slot j n + c: chunk c's
      # position j), position widths and the hops' plane offsets from the counts per
      # width, so that no kernel sums them over every position (XLA makes that sum one to
      # three launches) and no launch of its own makes them
      # (the norms read in place from the statistics as gathered: no slice of them)
      dest, order_t, widths, _, ptab = allocation.plan(
          stats, lay.supergroups, self.width_errors(), s,
          {w: n * SUPERGROUP * w for w in self.widths}, n * lay.units * unit_bits, n,
          blocks=n if bucket.scatter else 1, planes=(lay.plane_bits, lay.units), column=1,
          implementation=bucket.implementation)
      chunks = payload_lib.take_in_range(resid, order_t)  # [n, s, 256]
    # every chunk's shared stratum key, and its rounding key at every hop (hop <= n: the
    # schedules' steps, and the two-step reduction's), derived once for all hops. The
    # engine's (keys.tables) are already stored, derived outside every bucket, so the hops
    # read them in place; derived here, they are stored (a barrier): XLA would otherwise
    # recompute them inside every hop's key fusion. (They pass the barrier as they are:
    # one array of them, sliced after it, made XLA:CPU's compile of the simulator's
    # hierarchical and Moshpit programs 10-100x slower.)
    if keys.tables is not None:
      chunk_keys = keys.tables.chunk
    else:
      chunk_keys = jax.lax.optimization_barrier(self.key_tables(keys, n).chunk)
    return Plan(chunks, DynamiQAux(dest, stats, widths, lay, bucket.implementation,
                                   chunk_keys, ptab))

  def key_tables(self, keys, n: int) -> "DynamiQKeyTables":
    """Every chunk's rounding key at every hop and its shared stratum key, and the
    statistics' keys of every chunk at every hop (hop <= n: the schedules' steps and
    the two-step reduction's), from the bucket's prefix ``keys.state``."""
    prefix = keys.prefix(0, jnp.arange(n, dtype=jnp.uint32)).state
    strata = rng.finish_key(rng.absorb(prefix, rng.Stream.DYNAMIQ_PERMUTATION))
    hops = jnp.arange(n + 1, dtype=jnp.uint32)[None, :]
    rounding = rng.finish_key(rng.absorb(tuple(v[:, None] for v in prefix), hops,
                                         rng.Stream.DYNAMIQ_ROUND))
    stats = keys.derive(jnp.arange(n, dtype=jnp.uint32)[:, None], hops,
                        rng.Stream.DYNAMIQ_STATS)
    return DynamiQKeyTables((jnp.stack(rounding, axis=-1), jnp.stack(strata, axis=-1)), stats)

  def _geometry(self, aux, decode=False):
    args = dict(eps=self.level_spec, plane_bits=aux.layout.plane_bits, width_set=self.widths,
                implementation=aux.implementation, ptab=aux.ptab)
    if not decode:
      args.update(strata=aux.layout.n if self.correlated else 1,
                  scale_rounding=self.scale_rounding)
    return args

  def _keys(self, keys, aux):
    """(k0, k1, s0, s1): the rounding key of this hop and the shared stratum key (from the
    plan's tables: one uint32 [4] of two slices).

    (The leading word 0 stood for the code width in the keys of an earlier
    format; it stays so that the draws stay as they are.)"""
    if aux.chunk_keys is None:
      k0, k1 = keys.derive(0, keys.chunk, keys.hop, rng.Stream.DYNAMIQ_ROUND)
      s0, s1 = keys.derive(0, keys.chunk, rng.Stream.DYNAMIQ_PERMUTATION)
      return (k0, k1, s0, s1)
    return hop_words(aux.chunk_keys, keys.chunk, keys.hop)  # the plan's, uint32 [4]

  def encode(self, chunk, aux, keys):
    return kernels.compress(chunk, aux.widths, aux.layout.units, keys=self._keys(keys, aux),
                            rank=keys.rank, **self._geometry(aux))

  def decode(self, payload, aux):
    return kernels.decompress(payload, aux.widths, aux.layout.units,
                              **self._geometry(aux, decode=True))

  def decode_add(self, payload, chunk, aux):
    return kernels.decompress_accumulate(payload, chunk, aux.widths, aux.layout.units,
                                         **self._geometry(aux, decode=True))

  def decode_add_encode(self, payload, chunk, aux, keys):
    return kernels.decompress_accumulate_recompress(
        payload, chunk, aux.widths, aux.layout.units, keys=self._keys(keys, aux), rank=keys.rank,
        **self._geometry(aux))

  def decode_many(self, payloads, aux):
    """Every gathered payload decoded by one kernel launch
    (:func:`pallas_kernels.dynamiq.decompress_many`): the same bits as :meth:`decode`
    of each."""
    return kernels.decompress_many(payloads, aux.widths, aux.layout.units,
                                   **self._geometry(aux, decode=True))

  def decode_sum(self, payloads, aux):
    """The n payloads' decodes summed in rank order by one kernel launch
    (:func:`pallas_kernels.dynamiq.decompress_sum`, the sum kept in registers): the bits
    of the contract's default (:meth:`decode`, then :meth:`decode_add` of each)."""
    return kernels.decompress_sum(payloads, aux.widths, aux.layout.units,
                                  **self._geometry(aux, decode=True))

  def decode_finish(self, payloads, aux, bucket, state, rotate: int = 0, dtype=None,
                    partials=None):
    """:meth:`finish` of the decoded payloads, in one kernel launch
    (:func:`pallas_kernels.dynamiq.decompress_rows`): each super-group decoded from
    its slot ``aux.dest`` straight into its place, its reduced mean added, and stored
    rounded to ``dtype`` (None: float32). The same bits as :meth:`finish` of
    :meth:`decode_many`, then rounded. With ``partials``, the same launch sums the error
    estimate's terms (:class:`RowError`) of the float32 rows (padding included, one per
    row), so that nothing reads the result again."""
    del state
    term = None if partials is None else self._row_error(bucket.n, partials)
    found = kernels.decompress_rows(payloads, aux.widths, aux.layout.units, aux.dest,
                                    aux.stats, rotate=rotate, dtype=dtype or jnp.float32,
                                    row_sum=term, **self._geometry(aux, decode=True))
    out, err = found if term is not None else (found, None)
    # stored on XLA:CPU, as in finish
    return payload_lib.materialize(out.reshape(-1)[:bucket.d]), None, err

  def finish(self, decoded, aux, bucket, state):
    del state
    dec = decoded.transpose(1, 0, 2).reshape(-1, SUPERGROUP)  # chunk c: ranks c, c + n, ...
    out = payload_lib.take_in_range(dec, aux.dest) + aux.gmean[:, None]
    # stored: otherwise XLA:CPU fuses every bucket's decode and gather into the one
    # loop that concatenates the buckets (and casts), which it cannot vectorise
    return payload_lib.materialize(out.reshape(-1)[:bucket.d]), None

  def error_estimate(self, out, aux, bucket, partials):
    """Each super-group's quantisation error at its width, summed over the partials.

    ``c_w * sum_k E ||P_k||^2`` per super-group (:meth:`width_errors` for
    ``c_w``; :func:`~dynamiq_jax.codecs.base.partial_sum_energy` for the
    partial sums, from the reduced residual and the global statistic ``F``,
    the sum of the ranks' squared residual norms). This is the error of
    independent rounding; correlated rounding (the default) stratifies the
    draws of a coordinate's successive hops and adds less, so for it the
    estimate is an upper one. The bf16 rounding of the means is not counted
    (about ``2^-18`` relative per hop).
    """
    total = aux.layout.padded_supergroups
    rows = pad_to(out.astype(jnp.float32), total * SUPERGROUP).reshape(total, SUPERGROUP)
    # (the finish kernel's terms, by the reference, for the rows of slots aux.dest)
    return payload_lib.row_terms(rows, aux.stats, aux.widths, aux.dest, bucket.n,
                                 self._row_error(bucket.n, partials))

  def _row_error(self, n: int, partials) -> "RowError":
    return RowError(n, tuple(int(k) for k in partials),
                    tuple(sorted((int(w), float(e)) for w, e in self.width_errors().items())))


@dataclasses.dataclass(frozen=True)
class RowError:
  """One super-group's term of :meth:`DynamiQ.error_estimate`: ``c_w sum_k E ||P_k||^2``
  from its reduced residual's squares ``sq``, its residual norm ``norm`` (the ranks'
  ``sqrt(F)``) and its width. Static and hashable: the finish kernel computes it per row
  (:func:`pallas_kernels.dynamiq.decompress_rows`'s ``row_sum``), as the reference does."""

  n: int
  partials: tuple[int, ...]
  errors: tuple[tuple[int, float], ...]  # (width, c_w)

  def __call__(self, sq, norm, width):
    energy = partial_sum_energy(sq, norm * norm, self.n, self.partials)
    c = jnp.zeros_like(energy)
    for w, e in self.errors:  # the table by selects: a kernel cannot gather from a constant
      c = jnp.where(width == w, np.float32(e), c)
    return c * energy


class DynamiQAux(NamedTuple):
  """One bucket's allocation: each super-group's slot in the chunks, its reduced
  statistics (``[super-groups, 2]``: mean, residual norm; bfloat16 as gathered), the
  width of each chunk position (widest first), static layout; each chunk's random-key
  prefix, derived once for all its hops."""

  dest: jax.Array
  stats: jax.Array
  widths: jax.Array
  layout: "DynamiQLayout"
  implementation: str | None = None
  chunk_keys: tuple | None = None  # uint32: rounding keys [n, n + 1, 2], stratum keys [n, 2]
  ptab: jax.Array | None = None  # int32 [16]: the widths' plane offsets (the allocation's)

  @property
  def gmean(self):
    """float32 [super-groups]: the reduced means."""
    return self.stats[:, 0].astype(jnp.float32)

  @property
  def gnorm(self):
    """float32 [super-groups]: the reduced residual norms."""
    return self.stats[:, 1].astype(jnp.float32)


@functools.lru_cache(maxsize=4096)
def _layout(codec: DynamiQ, d: int, n: int) -> DynamiQLayout:
  """Each chunk is S scale records and a fixed number of code units (one plane of
  one super-group each), as many as the budget pays for."""
  if d < 1 or n < 1:
    raise ValueError(f"need d >= 1 and n >= 1, got {d=}, {n=}")
  m = ceil_div(d, SUPERGROUP)
  s = ceil_div(m, n)
  stats_bits = STATS_BITS * s * n
  plane_bits = 2 if all(w % 2 == 0 for w in codec.widths) else 1
  unit = payload_lib.unit_bytes(plane_bits)
  chunk_bytes = int((codec.bits * d - stats_bits) // (8 * n))
  code_units = (chunk_bytes - payload_lib.SCALE_BYTES * s) // unit
  least = s * codec.widths[0] // plane_bits
  if code_units < least:
    need = (stats_bits + 8 * n * (payload_lib.SCALE_BYTES * s + least * unit)) / d
    raise ValueError(
        f"DynamiQ(bits={codec.bits}) cannot meet its budget for a bucket of {d} "
        f"coordinates over n={n} ranks: the smallest layout ({s * n} super-groups at "
        f"{codec.widths[0]} bits, padding and statistics included) needs {need:.3f} "
        f"bits/coordinate. Fix: raise bits to at least {np.ceil(need * 100) / 100:.2f}, "
        f"all-reduce a larger bucket (more parameters per call), or send small models "
        f"with codecs.Bf16().")
  code_units = min(code_units, s * codec.widths[-1] // plane_bits)
  payload_bits = 8 * n * payload_lib.payload_bytes(s, code_units, plane_bits)
  return DynamiQLayout(d, n, m, s * n, stats_bits, payload_bits, code_units, plane_bits)


def _code_bits(lay: DynamiQLayout, narrowest: int) -> float:
  """Code bits per real coordinate of a layout, less what its padding super-groups
  take (they rank last, at the narrowest width)."""
  total = lay.n * lay.units * payload_lib.unit_bytes(lay.plane_bits) * 8
  padding = (lay.padded_supergroups - lay.supergroups) * narrowest * SUPERGROUP
  return (total - padding) / lay.d

