"""Lossy links, simulated: which packets of a hop are lost, and what a receiver makes of
the rest.

XLA's collectives never lose data. Loss is simulated on the library's own hops:
after a collective has delivered a payload, the receiver discards the packets
that a seeded loss process (:class:`PacketLoss`) says were lost, and works with
what is left, exactly as it would with a transport that drops packets and never
retransmits them. The process is keyed by (the call's key, which folds in the
step; the bucket; the hop; the source; the destination), and every rank can
compute every other rank's view of every hop.

A packet carries a fixed number of consecutive coordinates of a chunk
(:meth:`PacketLoss.coords_per_packet`: ``packet_bytes`` at the codec's wire bits
per coordinate, cut at the codec's blocks so that a packet holds whole blocks
with their scales and decodes on its own). Nothing here knows a codec: callers
pass its bits per coordinate and block size.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

__all__ = ["PacketLoss", "LOSS_STREAM", "REDUCE_HOP", "BROADCAST_HOP", "loss_key"]

LOSS_STREAM = 0x6C6F7373
"""What a bucket's key is folded with before the loss process's draws (``"loss"``)."""

REDUCE_HOP = 0
"""The hop word of the reduce step (each rank's chunk payloads to their owners)."""

BROADCAST_HOP = 1
"""The hop word of the parameter broadcast (each owner's shard to every replica)."""


def loss_key(words):
  """The loss process's ``jax.random`` key from two uint32 words that are identical on
  every rank (a bucket's key prefix, or a step's key): threefry, whatever the default
  PRNG implementation."""
  data = jnp.stack([jnp.asarray(w, jnp.uint32) for w in words])
  return jax.random.fold_in(jax.random.wrap_key_data(data, impl="threefry2x32"), LOSS_STREAM)


@dataclasses.dataclass(frozen=True)
class PacketLoss:
  """``packet_loss=PacketLoss(p=0.1)``: each payload packet of a hop is lost with probability ``p``.

  Attributes:
    p: the loss rate, the probability that a packet is lost, in ``[0, 1)``.
    packet_bytes: payload bytes per packet (1450: an Ethernet MTU less the IP,
      UDP and transport headers).
    burst: None: packets are lost independently (Bernoulli). A number ``L >= 1``:
      losses come in bursts of mean length ``L`` packets (a Gilbert-Elliott
      channel: a good state that loses nothing and a bad state that loses
      everything, leaving the bad state with probability ``1 / L`` per packet and
      entering it with the probability that keeps the long-run loss rate at
      ``p``); the first packet of a stream draws its state from that long-run
      rate.

  Unbiased aggregation (:meth:`combine`): the owner of a chunk adds its own
  contribution, which never crosses a link, and ``n - 1`` times the mean of
  the other ranks' contributions that arrived, packet by packet, divided by
  the probability that any arrived (``1 - p^(n - 1)``: 0.999 at n = 4, p = 0.1);
  where none did, its own alone. Over the loss process its expectation is the
  exact sum, and with nothing lost it is the lossless sum, bit for bit.
  """

  p: float
  packet_bytes: int = 1450
  burst: float | None = None

  def __post_init__(self):
    if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not (
        0.0 <= float(self.p) < 1.0):
      raise ValueError(f"PacketLoss(p={self.p!r}): the loss rate must be a probability in "
                       f"[0, 1), e.g. p=0.01 for 1% of the packets lost")
    if isinstance(self.packet_bytes, bool) or not isinstance(self.packet_bytes, int) or (
        self.packet_bytes < 16):
      raise ValueError(f"PacketLoss(packet_bytes={self.packet_bytes!r}) must be an int >= 16 "
                       f"(1450: an Ethernet MTU's payload)")
    if self.burst is not None:
      if isinstance(self.burst, bool) or not isinstance(self.burst, (int, float)) or (
          float(self.burst) < 1.0):
        raise ValueError(f"PacketLoss(burst={self.burst!r}): the mean burst length is in "
                         f"packets, >= 1 (None: independent losses)")
      if self._enter() > 1.0:
        raise ValueError(
            f"PacketLoss(p={self.p}, burst={self.burst}): a burst of mean length "
            f"{self.burst} cannot lose {self.p:.0%} of the packets (the good state would "
            f"have to last less than one packet). Fix: burst >= p / (1 - p) = "
            f"{self.p / (1 - self.p):.3g}")
    object.__setattr__(self, "p", float(self.p))

  def _enter(self) -> float:
    """Gilbert-Elliott: the probability of entering the bad state from the good one."""
    leave = 1.0 / float(self.burst)
    return self.p * leave / (1.0 - self.p)

  def coords_per_packet(self, bits_per_coord: float, block: int = 1) -> int:
    """Coordinates in one packet: ``packet_bytes`` at ``bits_per_coord`` wire bits per
    coordinate, rounded down to whole ``block``-coordinate blocks (at least one)."""
    if bits_per_coord <= 0:
      raise ValueError(f"bits_per_coord={bits_per_coord} must be > 0")
    coords = int(self.packet_bytes * 8 // bits_per_coord)
    return max(block, coords // block * block)

  def lost(self, u):
    """Which packets are lost, from uniforms ``u`` on [0, 1) (bool, ``u``'s shape): the
    last axis is a stream of consecutive packets, earlier axes independent streams."""
    if self.burst is None:
      return u < self.p
    stay = 1.0 - 1.0 / float(self.burst)
    enter = self._enter()
    first = u[..., :1] < self.p  # the stream's first state, at the long-run rate
    # the state after packet j as a function of the state before it: (from good, from bad)
    step = (u[..., 1:] < enter, u[..., 1:] < stay)

    def compose(before, after):  # after(before(.)), for both starting states
      return (jnp.where(before[0], after[1], after[0]), jnp.where(before[1], after[1], after[0]))

    if u.shape[-1] == 1:
      return first
    good, bad = jax.lax.associative_scan(compose, step, axis=u.ndim - 1)
    return jnp.concatenate([first, jnp.where(first, bad, good)], axis=-1)

  def draw(self, key, hop: int, sources, destination, packets: int):
    """The loss of ``packets`` consecutive packets from each of ``sources`` (int32 array)
    to ``destination`` at ``hop``: bool ``[len(sources), packets]``. Every rank draws the
    same for the same arguments."""
    key = jax.random.fold_in(key, hop)

    def one(s):
      k = jax.random.fold_in(jax.random.fold_in(key, s), destination)
      return jax.random.uniform(k, (packets,), jnp.float32)

    return self.lost(jax.vmap(one)(jnp.asarray(sources, jnp.int32)))

  def lost_elements(self, key, hop: int, n: int, destination, elements: int, coords: int):
    """Which of ``elements`` consecutive values each of ``n`` ranks sends ``destination`` at
    ``hop`` were lost, ``coords`` to a packet (:meth:`draw`): bool ``[n, elements]``,
    never ``destination``'s own row (its own part crosses no link)."""
    lost = self.draw(key, hop, jnp.arange(n, dtype=jnp.int32), destination,
                     -(-elements // coords))
    rows = jnp.arange(n, dtype=jnp.int32)[:, None]
    return lost[:, jnp.arange(elements, dtype=jnp.int32) // coords] & (rows != destination)

  def combine(self, own, others, arrived, n: int, total):
    """What the owner of a chunk makes of one packet's contributions: ``own`` its own
    value, ``others`` the sum of the other ranks' values that arrived, ``arrived`` how
    many did (float32, 0 to n - 1), ``total`` the lossless sum (meaningful where all
    arrived) -> the estimate of the sum over all n ranks:
    ``own + (n - 1) / arrived * others / (1 - p^(n - 1))``, or ``own`` where none arrived.

    Given that at least one arrived, each other rank's value is in ``others`` with
    probability ``arrived / (n - 1)`` (the ranks' links are alike), so
    ``(n - 1) / arrived * others`` has the expectation of their sum; the last
    factor makes up for the packets that no other rank's copy reached (probability
    ``p^(n - 1)``, the sources' losses being independent), which leaves the estimate
    exactly unbiased over the loss process. Where all arrived it is computed as
    ``total + (1 / (1 - p^(n - 1)) - 1) * others``: ``total`` itself, bit for bit, at
    ``p = 0``.
    """
    reach = 1.0 - self.p ** (n - 1)
    scale = jnp.float32(n - 1) / (jnp.maximum(arrived, 1.0) * jnp.float32(reach))
    full = total + jnp.float32(1.0 / reach - 1.0) * others
    return jnp.where(arrived == n - 1, full, jnp.where(arrived > 0, own + scale * others, own))
