"""DynamiQ (Han, Vargaftik, Mitzenmacher, Ben Basat; SIGCOMM 2026).

One all-reduce of a flat bucket ``x`` (this rank's gradient, pre-divided by
n when averaging), as in the paper's §3:

1. Per super-group of 256 coordinates: the local mean and the L2 norm of
   the centred residual. Both go through one small all-reduce on the same
   schedule (2 bf16 values per super-group: 0.125 bit/coordinate): means
   add (rounded to bf16 stochastically, so the sum stays unbiased), norms
   combine as ``hypot`` so that the result is ``sqrt(F)`` with ``F`` the sum
   of local squared norms (the paper's statistic, kept in range for any
   float32 input).
2. Each rank subtracts its *own* mean (the authors' artifact; the paper
   subtracts the global mean). Both give the same final sum, but with local
   centring every partial sum along the path is exactly zero-mean, and no rank
   has to wait for the statistics before centring.
3. Super-groups are ranked by the global F (identical on every rank) and
   fill the width classes in order, widest first; class capacities are static
   (:mod:`dynamiq_jax.codecs.allocation`).
4. Each class is cut into n chunks and reduced on the schedule with the
   per-hop decompress-accumulate-recompress of
   :mod:`pallas_kernels.dynamiq_format`; all classes travel in one payload
   per hop.
5. The decoded classes are scattered back and the reduced means added.

Bits: every byte on the wire is counted, padding included. At a 5-bit
budget: 0.125 (statistics) + 0.5625 (uint8 group scales and bf16 units) +
4.3125 average code bits.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynamiq_jax.codecs import allocation
from dynamiq_jax.codecs._exact import hypot
from dynamiq_jax.codecs._exact import row_norm
from dynamiq_jax.codecs._exact import stochastic_bf16
from dynamiq_jax.codecs._exact import tree_sum
from dynamiq_jax.codecs.base import Codec, Metadata, Plan, ceil_div, pad_to, partial_sum_energy
from pallas_kernels import dynamiq as kernels
from pallas_kernels import dynamiq_units as units_lib
from pallas_kernels import dynamiq_units_kernels as unit_kernels
from pallas_kernels import dynamiq_format as fmt_lib
from pallas_kernels import rng

__all__ = ["DynamiQ", "DynamiQLayout"]

SUPERGROUP = fmt_lib.SUPERGROUP
_STATS_BITS = 32  # two bf16 values per super-group

DEFAULT_EPS = ((2, 0.23), (4, 0.18), (8, 0.10))
"""MEE eps of the authors' kernel; widths between are interpolated linearly."""

SMALL_BUCKET_SLACK = 0.25
"""Code bits per coordinate a bucket may lack against a large bucket and still be
compressed (per-round allocation): 4^0.25 = 1.41x the error, at most."""

PER_ROUND_WIDTHS = (2, 3, 4, 5, 6, 8)
"""Default widths of per-round allocation (the paper's prototype uses 2, 4, 8)."""


def _as_pairs(v, name):
  if v is None:
    return None
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
  capacities: tuple[tuple[int, int], ...]  # (width, super-groups), widest first; () per round
  stats_bits: int
  payload_bits: int
  units: int = 0  # allocation="per_round": code units per chunk
  plane_bits: int = 0  # allocation="per_round": bits per code plane (a unit holds one plane)

  @property
  def wire_bits(self) -> int:
    return self.stats_bits + self.payload_bits

  @property
  def bits_per_coord(self) -> float:
    return self.wire_bits / self.d


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamiQ(Codec):
  """DynamiQ's compressed multi-hop all-reduce codec.

  Defaults are the paper's full configuration: widths {2, 4, 8} chosen per
  super-group, MEE levels, hierarchical 16/256 scales, correlated rounding,
  a 5-bit budget counting all metadata.

  Args:
    bits: all-in budget in bits per coordinate (payload, scales, statistics
      and padding). Never exceeded; ``ValueError`` at trace time if the
      format cannot meet it for a bucket.
    widths: allowed code widths, a subset of {2, 4, 8}.
    variable_width: choose widths per super-group; if False, every
      super-group uses the widest width in ``widths`` that fits the budget.
    levels: ``"mee"`` (non-uniform, the paper's) or ``"uniform"``.
    eps: ``{width: eps}`` of the MEE levels (the authors' kernel values
      0.23/0.18/0.10 by default).
    hierarchical: uint8 group scales under a bf16 unit per 256 coordinates;
      otherwise a bf16 scale per ``group_size`` coordinates.
    group_size: group length when ``hierarchical=False`` (the paper's
      ablation uses 32).
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
    profile: the gradients' super-group statistics, ``log2 F`` at evenly
      spaced quantiles, from which the class capacities of every bucket
      size are chosen (the whole-unit split of least expected error within
      the budget, :func:`dynamiq_jax.codecs.allocation.best_capacities`);
      default: the paper's fitted gradient model
      (:func:`~dynamiq_jax.codecs.allocation.mixture_profile`). Fit it to
      your own gradients with :meth:`calibrate`.
    fractions: ``{width: fraction}`` of super-groups per class, rounded to
      whole units for each bucket; overrides ``profile`` (give one of the two).

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

  bits: float = 5.0
  widths: tuple[int, ...] | None = None
  variable_width: bool = True
  levels: Literal["mee", "uniform"] = "mee"
  eps: tuple[tuple[int, float], ...] = DEFAULT_EPS
  hierarchical: bool = True
  group_size: int = 32
  correlated: bool = True
  centre: bool = True
  scale_rounding: Literal["up", "stochastic"] = "up"
  profile: tuple[float, ...] | None = None
  fractions: tuple[tuple[int, float], ...] | None = None
  allocation: Literal["per_round", "static"] = "per_round"

  def __post_init__(self):
    set_ = functools.partial(object.__setattr__, self)
    if not (isinstance(self.bits, (int, float)) and np.isfinite(self.bits) and self.bits > 0):
      raise ValueError(f"bits={self.bits!r} must be a positive number of bits per coordinate")
    if self.allocation not in ("static", "per_round"):
      raise ValueError(f"allocation={self.allocation!r} must be 'per_round' or 'static'")
    if self.widths is None:
      set_("widths", PER_ROUND_WIDTHS if self.allocation == "per_round" else (2, 4, 8))
    widths = tuple(sorted(set(int(w) for w in self.widths)))
    if self.allocation == "per_round":
      if not widths or any(not 2 <= w <= 8 for w in widths):
        raise ValueError(f"widths={self.widths!r} must be a non-empty subset of 2..8 "
                         f"with allocation='per_round'")
      if (self.levels, self.hierarchical, self.variable_width) != ("mee", True, True) or (
          self.profile is not None or self.fractions is not None):
        raise ValueError(
            "allocation='per_round' chooses the widths every round with MEE levels and "
            "hierarchical scales; it takes no levels='uniform', hierarchical=False, "
            "variable_width=False, profile= or fractions= (use allocation='static' for those)")
      set_("widths", widths)
      set_("eps", _as_pairs(self.eps, "eps"))
      return
    if not widths or any(w not in (2, 4, 8) for w in widths):
      raise ValueError(f"widths={self.widths!r} must be a non-empty subset of (2, 4, 8) "
                       f"with allocation='static' (any of 2..8 with allocation='per_round')")
    set_("widths", widths)
    set_("eps", _as_pairs(self.eps, "eps"))
    eps = dict(self.eps)
    missing = [w for w in widths if w not in eps and w != 2]
    if self.levels == "mee" and missing:
      raise ValueError(f"eps={self.eps!r} lacks widths {missing}")
    fr = _as_pairs(self.fractions, "fractions")
    if fr is not None:
      if any(w not in widths for w, _ in fr) or any(f < 0 for _, f in fr):
        raise ValueError(f"fractions={self.fractions!r} must map widths in {widths} to >= 0")
      total = sum(f for _, f in fr)
      if not np.isclose(total, 1.0, atol=1e-6):
        raise ValueError(f"fractions={self.fractions!r} sum to {total}, not 1")
    set_("fractions", fr)
    if self.profile is not None:
      if fr is not None:
        raise ValueError("give DynamiQ either profile= or fractions=, not both")
      set_("profile", tuple(float(v) for v in allocation.check_profile(self.profile)))
    for w in widths:  # validates levels / eps / group_size / scale_rounding
      self.format(w)

  def __repr__(self):
    parts = []
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.name == "profile" and v is not None:  # 256 numbers: say what they are
        v = f"<{len(v)} log2 F quantiles, {v[0]:g}..{v[-1]:g}>"
      else:
        v = repr(v)
      parts.append(f"{f.name}={v}")
    return f"DynamiQ({', '.join(parts)})"

  # -- static description ------------------------------------------------------

  granularity = SUPERGROUP
  """Buckets must hold whole super-groups."""

  def format(self, width: int) -> fmt_lib.Format:
    """The wire format of one width class."""
    return fmt_lib.Format(
        bits=width, levels=self.levels, eps=dict(self.eps).get(width, 0.23),
        hierarchical=self.hierarchical, group_size=self.group_size,
        scale_rounding=self.scale_rounding)

  def width_errors(self) -> dict[int, float]:
    """``{width: relative MSE of one quantisation}`` for this configuration."""
    if self.allocation == "per_round":
      eps = dict(self.eps)
      return {w: allocation.level_error(w, units_lib.eps_for(w, eps)) for w in self.widths}
    return {w: allocation.expected_error(self.format(w)) for w in self.widths}

  def _payload_bits(self) -> float:
    """Average code bits per coordinate left once statistics and scales are paid."""
    scale_bits = self.format(self.widths[0]).record_bytes * 8 / SUPERGROUP - self.widths[0]
    return self.bits - _STATS_BITS / SUPERGROUP - scale_bits

  def default_fractions(self) -> dict[int, float]:
    """Class fractions of an unbounded bucket (the threshold rule; ``fractions`` if given).

    Small buckets and large ``n`` get the best whole-unit split instead:
    ``layout(d, n).capacities``.
    """
    if self.fractions is not None:
      return dict(self.fractions)
    w = self.widths
    if len(w) == 1:
      return {w[0]: 1.0}
    if self.profile is not None:
      return allocation.fractions_from_profile(self.profile, self._payload_bits(),
                                               self.width_errors())
    return allocation.fractions_for_budget(self._payload_bits(), self.width_errors())

  def calibrate(self, grads) -> "DynamiQ":
    """This codec with class capacities fitted to representative gradients.

    Records the profile of the super-group statistics of ``grads`` (see
    :mod:`~dynamiq_jax.codecs.allocation`) — offline, once: capacities are
    static, so the calibrated codec compiles once more and then stays fixed.

    Args:
      grads: per-worker gradients stacked on axis 0 (a pytree of ``[n, ...]``
        arrays, e.g. what :func:`dynamiq_jax.simulate` takes) or one worker's
        gradient pytree (``stacked=False`` semantics: treated as n = 1).

    Returns:
      ``dataclasses.replace(self, profile=..., fractions=None)``.
    """
    if self.allocation == "per_round":
      raise ValueError(
          "calibrate() fits the static class capacities of allocation='static'; this codec "
          "(allocation='per_round') chooses its widths from every round's statistics and "
          "needs no calibration. Fix: drop the calibrate() call, or use "
          "DynamiQ(allocation='static', ...).calibrate(grads)")
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
    if not leaves:
      raise ValueError("grads holds no arrays")
    lead = {x.shape[0] if x.ndim else 1 for x in leaves}
    n = lead.pop() if len(lead) == 1 and all(x.ndim > 1 for x in leaves) else 1
    flat = np.concatenate([x.reshape(n, -1) for x in leaves], axis=1)
    m = ceil_div(flat.shape[1], SUPERGROUP)
    flat = np.pad(flat, ((0, 0), (0, m * SUPERGROUP - flat.shape[1]))).reshape(n, m, -1)
    centred = flat - flat.mean(-1, keepdims=True)
    norms = np.sqrt(np.sum(centred**2, axis=(0, 2)))
    return dataclasses.replace(self, profile=allocation.profile_from_norms(norms),
                               fractions=None)

  def layout(self, d: int, n: int) -> DynamiQLayout:
    """Static sizes for a bucket of ``d`` coordinates over ``n`` ranks.

    Raises:
      ValueError: if no layout fits the bit budget.
    """
    return _layout(self, int(d), int(n))

  def wire_bits(self, d: int, n: int) -> int:
    """Exact bits of one all-reduce (all chunk payloads + statistics)."""
    return self.layout(d, n).wire_bits

  def compresses(self, d: int, n: int) -> bool:
    """Whether this bucket is compressed; ``allreduce`` sends the others as bf16.

    Padding to whole super-groups per chunk, and the statistics and scales of
    every padded super-group, cost a small bucket more per coordinate, so it
    has fewer code bits left than a large one. Each code bit lowers the error
    about 4x, so a bucket is compressed only where its code bits per
    coordinate are within :data:`SMALL_BUCKET_SLACK` of a large bucket's
    (static capacities: wherever the layout meets the budget). So no bucket
    gets an error much above a large bucket's: a model one coordinate larger
    is compressed about as well, or sent uncompressed. If the budget cannot
    be met even for a large bucket (``bits`` too low for the format), this
    raises that error.
    """
    large = self.layout(max(d, n * SUPERGROUP * 4096), n)  # raises if no bucket meets it
    try:
      lay = self.layout(d, n)
    except ValueError:
      return False
    if self.allocation == "static":
      return True
    return _code_bits(lay, self.widths[0]) >= _code_bits(large, self.widths[0]) - SMALL_BUCKET_SLACK

  # -- the all-reduce ------------------------------------------------------------

  def _rows(self, x, bucket):
    """x -> ([padded super-groups, 256] values, local means, centred residuals)."""
    lay = self.layout(bucket.d, bucket.n)
    total = lay.padded_supergroups
    xs = pad_to(x.astype(jnp.float32), total * SUPERGROUP).reshape(total, SUPERGROUP)
    mean = tree_sum(xs) / SUPERGROUP if self.centre else jnp.zeros((total,), jnp.float32)
    return mean, xs - mean[:, None]

  def metadata(self, x, bucket, state):
    """Per super-group: the local mean and the norm of the centred residual.

    Summed over ranks on the schedule by :class:`SupergroupStats` (means add,
    norms combine as ``hypot``): 32 bits per super-group.
    """
    del state
    n = bucket.n
    with jax.named_scope("dynamiq/stats"):
      mean, resid = self._rows(x, bucket)
      stats = jnp.stack([mean, row_norm(resid)], axis=-1)
    return Metadata(stats.reshape(n, -1, 2), combine=SupergroupStats())

  def plan(self, x, meta, bucket, state, keys):
    """Ranks super-groups by the global norm and fills the width classes, widest first."""
    if self.allocation == "per_round":
      return self._plan_per_round(x, meta, bucket)
    del state, keys
    n = bucket.n
    lay = self.layout(bucket.d, n)
    total = lay.padded_supergroups
    stats = meta.reshape(total, 2)
    gmean, gnorm = stats[:, 0], stats[:, 1]
    _, resid = self._rows(x, bucket)
    with jax.named_scope("dynamiq/allocate"):
      order = allocation.descending_order(gnorm, jnp.arange(total) < lay.supergroups)
      rows = fmt_lib.take_in_range(resid, order)
      chunks, offset = [], 0
      for _, cap in lay.capacities:
        chunks.append(rows[offset:offset + cap].reshape(n, cap // n, SUPERGROUP))
        offset += cap
    return Plan(tuple(chunks), DynamiQAux(order, gmean, gnorm, lay, bucket.implementation))

  def _plan_per_round(self, x, meta, bucket):
    """Widths chosen this round from the global statistics (identical on every rank).

    Super-groups are ranked by the global norm; chunk c takes ranks c, c + n,
    c + 2n, ..., so position j of every chunk holds ranks jn .. jn + n - 1
    (one *unit*) and every chunk gets the same widths, widest first: the
    equal-marginal-gain rule of :func:`~dynamiq_jax.codecs.allocation.capacities_threshold`
    with each width's measured error, within the chunk's fixed code budget.
    """
    n = bucket.n
    lay = self.layout(bucket.d, n)
    total, s = lay.padded_supergroups, lay.padded_supergroups // n
    stats = meta.reshape(total, 2)
    gmean, gnorm = stats[:, 0], stats[:, 1]
    _, resid = self._rows(x, bucket)
    with jax.named_scope("dynamiq/allocate"):
      valid = jnp.arange(total) < lay.supergroups
      order = allocation.descending_order(gnorm, valid)
      chunks = fmt_lib.take_in_range(resid, order.reshape(s, n).T)  # [n, s, 256]: one gather
      unit_bits = units_lib.unit_bytes(lay.plane_bits) * 8
      counts = allocation.capacities_threshold(
          gnorm, valid, self.width_errors(), s, {w: n * SUPERGROUP * w for w in self.widths},
          n * lay.units * unit_bits, n, order=order)
      widths = units_lib.position_widths_general(counts, self.widths, s)
    return Plan(chunks, PerRoundAux(order, gmean, gnorm, widths, lay, bucket.implementation))

  def _unit_args(self, aux, decode=False):
    args = dict(eps=self.eps, plane_bits=aux.layout.plane_bits, width_set=self.widths,
                implementation=aux.implementation)
    if not decode:
      args.update(strata=self._strata(aux.layout), scale_rounding=self.scale_rounding)
    return args

  def _classes(self, lay):
    return [(w, self.format(w), cap // lay.n) for w, cap in lay.capacities]

  def _keys(self, keys, width):
    """(k0, k1, s0, s1): the rounding key of this hop and the shared stratum key."""
    k0, k1 = keys.derive(width, keys.chunk, keys.hop, rng.Stream.DYNAMIQ_ROUND)
    s0, s1 = keys.derive(width, keys.chunk, rng.Stream.DYNAMIQ_PERMUTATION)
    return (k0, k1, s0, s1)

  def _strata(self, lay):
    return lay.n if self.correlated else 1

  def _split(self, payload, lay):
    out, off = [], 0
    for _, f, s in self._classes(lay):
      size = s * f.record_bytes
      out.append(payload[off:off + size].reshape(s, f.record_bytes))
      off += size
    return out

  def encode(self, chunk, aux, keys):
    if isinstance(aux, PerRoundAux):
      return unit_kernels.compress_units(chunk, aux.widths, aux.layout.units,
                                         keys=self._keys(keys, 0), rank=keys.rank,
                                         **self._unit_args(aux))
    lay = aux.layout
    return jnp.concatenate([
        kernels.compress(x, f, keys=self._keys(keys, w), rank=keys.rank,
                         strata=self._strata(lay), implementation=aux.implementation).reshape(-1)
        for (w, f, _), x in zip(self._classes(lay), chunk)])

  def decode(self, payload, aux):
    if isinstance(aux, PerRoundAux):
      return unit_kernels.decompress_units(payload, aux.widths, aux.layout.units,
                                           **self._unit_args(aux, decode=True))
    return tuple(kernels.decompress(p, f, implementation=aux.implementation)
                 for (_, f, _), p in zip(self._classes(aux.layout), self._split(payload, aux.layout)))

  def decode_add(self, payload, chunk, aux):
    if isinstance(aux, PerRoundAux):
      return unit_kernels.decompress_accumulate_units(payload, chunk, aux.widths,
                                                      aux.layout.units,
                                                      **self._unit_args(aux, decode=True))
    lay = aux.layout
    return tuple(kernels.decompress_accumulate(p, x, f, implementation=aux.implementation)
                 for (_, f, _), p, x in zip(self._classes(lay), self._split(payload, lay), chunk))

  def decode_add_encode(self, payload, chunk, aux, keys):
    if isinstance(aux, PerRoundAux):
      return unit_kernels.decompress_accumulate_recompress_units(
          payload, chunk, aux.widths, aux.layout.units, keys=self._keys(keys, 0),
          rank=keys.rank, **self._unit_args(aux))
    lay = aux.layout
    return jnp.concatenate([
        kernels.decompress_accumulate_recompress(
            p, x, f, keys=self._keys(keys, w), rank=keys.rank, strata=self._strata(lay),
            implementation=aux.implementation).reshape(-1)
        for (w, f, _), p, x in zip(self._classes(lay), self._split(payload, lay), chunk)])

  def finish(self, decoded, aux, bucket, state):
    del state
    if isinstance(aux, PerRoundAux):  # chunk c holds ranks c, c + n, ...: back to rank order
      dec = decoded.transpose(1, 0, 2).reshape(-1, SUPERGROUP)
    else:
      dec = jnp.concatenate([c.reshape(-1, SUPERGROUP) for c in decoded], axis=0)
    out = fmt_lib.take_in_range(dec, _inverse(aux.order)) + aux.gmean[:, None]
    # stored: otherwise XLA:CPU fuses every bucket's decode and gather into the one
    # loop that concatenates the buckets (and casts), which it cannot vectorise
    return fmt_lib.materialize(out.reshape(-1)[:bucket.d]), None


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
    lay, n = aux.layout, bucket.n
    total = lay.padded_supergroups
    resid = pad_to(out, total * SUPERGROUP).reshape(total, SUPERGROUP) - aux.gmean[:, None]
    energy = partial_sum_energy(jnp.sum(resid * resid, axis=-1), aux.gnorm * aux.gnorm, n,
                                partials)
    errors = self.width_errors()
    table = jnp.asarray([errors.get(w, 0.0) for w in range(max(errors) + 1)], jnp.float32)
    if isinstance(aux, PerRoundAux):  # rank i of the order sits at chunk position i // n
      by_rank = jnp.repeat(aux.widths, n, total_repeat_length=total)
    else:
      by_rank = jnp.concatenate([jnp.full((cap,), w, jnp.int32) for w, cap in lay.capacities])
      by_rank = jnp.pad(by_rank, (0, total - by_rank.shape[0]))  # padding super-groups: 0
    return jnp.sum(table[by_rank] * energy[aux.order])


class PerRoundAux(NamedTuple):
  """One bucket's per-round allocation: super-groups in rank order, reduced means
  and residual norms, the width of each chunk position (widest first), static
  layout."""

  order: jax.Array
  gmean: jax.Array
  gnorm: jax.Array
  widths: jax.Array
  layout: "DynamiQLayout"
  implementation: str | None = None


class DynamiQAux(NamedTuple):
  """One bucket's allocation: super-groups in class order, reduced means and
  residual norms, static layout."""

  order: jax.Array
  gmean: jax.Array
  gnorm: jax.Array
  layout: "DynamiQLayout"
  implementation: str | None = None


@dataclasses.dataclass(frozen=True)
class SupergroupStats(Codec):
  """The statistics all-reduce: lane 0 sums means, lane 1 combines norms.

  Means are rounded to bf16 *stochastically* at every hop, so the mean that
  is added back is an unbiased estimate of the exact sum of local means and
  the whole all-reduce stays unbiased (round-to-nearest would leave a fixed
  error of up to 2^-9 of every super-group mean). Norms only rank
  super-groups; they are combined with an exact-by-construction hypot, so the
  result is ``sqrt(F)`` with ``F`` the sum of local squared norms.
  """

  def wire_bits(self, d: int, n: int) -> int:
    return _STATS_BITS * d

  def plan(self, x, meta, bucket, state, keys):
    raise NotImplementedError("SupergroupStats only combines metadata")

  def finish(self, decoded, aux, bucket, state):
    raise NotImplementedError("SupergroupStats only combines metadata")

  def encode(self, chunk, aux, keys):
    del aux
    k0, k1 = keys.derive(keys.chunk, keys.hop, rng.Stream.DYNAMIQ_STATS)
    mean = stochastic_bf16(chunk[..., 0], rng.hash_index(k0, k1, _element_index(chunk[..., 0])))
    return jnp.stack([mean, chunk[..., 1].astype(jnp.bfloat16)], axis=-1)

  def decode(self, payload, aux):
    del aux
    return payload.astype(jnp.float32)

  def decode_add(self, payload, chunk, aux):
    p = self.decode(payload, aux)
    return jnp.stack([p[..., 0] + chunk[..., 0], hypot(p[..., 1], chunk[..., 1])], axis=-1)


def _element_index(v):
  return jnp.arange(v.size, dtype=jnp.uint32).reshape(v.shape)


@functools.lru_cache(maxsize=4096)
def _layout(codec: DynamiQ, d: int, n: int) -> DynamiQLayout:
  if d < 1 or n < 1:
    raise ValueError(f"need d >= 1 and n >= 1, got {d=}, {n=}")
  if codec.allocation == "per_round":
    return _unit_layout(codec, d, n)
  m = ceil_div(d, SUPERGROUP)
  units = ceil_div(m, n)
  stats_bits = _STATS_BITS * units * n
  rec_bits = {w: codec.format(w).record_bytes * 8 for w in codec.widths}
  cost = {w: n * rec_bits[w] for w in codec.widths}
  budget = codec.bits * d - stats_bits
  cheapest = stats_bits + units * cost[codec.widths[0]]
  if cheapest > codec.bits * d:
    need = cheapest / d
    raise ValueError(
        f"DynamiQ(bits={codec.bits}) cannot meet its budget for a bucket of {d} "
        f"coordinates over n={n} ranks: the smallest layout ({units * n} "
        f"super-groups at {codec.widths[0]} bits, padding and statistics included) "
        f"needs {need:.3f} bits/coordinate. Fix: raise bits to at least "
        f"{np.ceil(need * 100) / 100:.2f}, all-reduce a larger bucket (more "
        f"parameters per call), or send small models with codecs.Bf16().")
  if codec.variable_width and codec.fractions is not None:
    caps = allocation.round_capacities(dict(codec.fractions), units, cost, budget)
  elif codec.variable_width:
    profile = codec.profile if codec.profile is not None else _paper_profile()
    caps = allocation.best_capacities(profile, codec.width_errors(), units, cost, budget)
  else:
    fits = [w for w in codec.widths if units * cost[w] <= budget]
    caps = {w: (units if w == max(fits) else 0) for w in codec.widths}
  capacities = tuple((w, caps[w] * n) for w in sorted(caps, reverse=True) if caps[w])
  payload_bits = sum(c * rec_bits[w] for w, c in capacities)
  return DynamiQLayout(d, n, m, units * n, capacities, stats_bits, payload_bits)


@functools.lru_cache(maxsize=1)
def _paper_profile():
  return allocation.mixture_profile()


def _unit_layout(codec: DynamiQ, d: int, n: int) -> DynamiQLayout:
  """Per-round allocation: each chunk is S scale records and a fixed number of code
  units (one plane of one super-group each), as many as the budget pays for."""
  m = ceil_div(d, SUPERGROUP)
  s = ceil_div(m, n)
  stats_bits = _STATS_BITS * s * n
  plane_bits = 2 if all(w % 2 == 0 for w in codec.widths) else 1
  unit = units_lib.unit_bytes(plane_bits)
  chunk_bytes = int((codec.bits * d - stats_bits) // (8 * n))
  code_units = (chunk_bytes - units_lib.SCALE_BYTES * s) // unit
  least = s * codec.widths[0] // plane_bits
  if code_units < least:
    need = (stats_bits + 8 * n * (units_lib.SCALE_BYTES * s + least * unit)) / d
    raise ValueError(
        f"DynamiQ(bits={codec.bits}) cannot meet its budget for a bucket of {d} "
        f"coordinates over n={n} ranks: the smallest layout ({s * n} super-groups at "
        f"{codec.widths[0]} bits, padding and statistics included) needs {need:.3f} "
        f"bits/coordinate. Fix: raise bits to at least {np.ceil(need * 100) / 100:.2f}, "
        f"all-reduce a larger bucket (more parameters per call), or send small models "
        f"with codecs.Bf16().")
  code_units = min(code_units, s * codec.widths[-1] // plane_bits)
  payload_bits = 8 * n * units_lib.payload_bytes(s, code_units, plane_bits)
  return DynamiQLayout(d, n, m, s * n, (), stats_bits, payload_bits, code_units, plane_bits)


def _code_bits(lay: DynamiQLayout, narrowest: int) -> float:
  """Code bits per real coordinate of a per-round layout, less what its padding
  super-groups take (they rank last, at the narrowest width)."""
  total = lay.n * lay.units * units_lib.unit_bytes(lay.plane_bits) * 8
  padding = (lay.padded_supergroups - lay.supergroups) * narrowest * SUPERGROUP
  return (total - padding) / lay.d


def _inverse(order):
  """The inverse of the permutation ``order`` (``argsort(order)``), by one scatter
  instead of a sort."""
  pos = jnp.arange(order.shape[0], dtype=order.dtype)
  return jnp.zeros_like(order).at[order.astype(jnp.uint32)].set(
      pos, mode="promise_in_bounds", unique_indices=True)
