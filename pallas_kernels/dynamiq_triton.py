"""DynamiQ's hop kernels on the Pallas Triton backend, and their wrappers.

Four operations on one chunk payload (its bytes:
:mod:`pallas_kernels.dynamiq_reference`), each one launch that reads every
input byte once and writes every output byte once: :func:`compress_pallas`
(values -> payload), :func:`decompress_pallas` (payload -> float32),
:func:`decompress_accumulate_pallas` (``decode(p) + x``) and the ring hop
:func:`decompress_accumulate_recompress_pallas` (``encode(decode(p) + x)``,
the sum kept in registers). Three more decode all ``n`` gathered payloads of
one bucket (the same per-position widths) in one launch whose grid covers every
payload's super-groups: :func:`decompress_many_pallas` (``[n, S, 256]``),
:func:`decompress_rows_pallas` (each output row from its slot ``j n + c``, plus
a mean: DynamiQ's finish, every super-group written straight to its place) and
:func:`decompress_sum_pallas` (the decodes summed in rank order, in registers:
a two-step reduction). Their programs read each row's bytes at its own
payload's offsets (:class:`~pallas_kernels.triton_chunk.Rows`).

Algorithm: the block arithmetic is the reference's own
(:func:`~pallas_kernels.dynamiq_block.encode_block`,
:func:`~pallas_kernels.dynamiq_block.decode_block`), so kernel and reference
agree bit for bit; only the byte movement and the instructions differ: off
GPU (``interpret=True``) the reference's
(:data:`~pallas_kernels.dynamiq_block.REFERENCE_OPS`), on a GPU
:data:`GPU_OPS`, one inlined PTX instruction each
(:mod:`pallas_kernels.triton_ops`) with the same codes
(:class:`~pallas_kernels.dynamiq_block.BlockOps` says why).

Memory layout: one program handles :data:`BLOCK` super-groups. Dense operands are viewed
as ``[S, G, CB, P]`` with ``P = 8 / plane_bits`` codes per plane byte and ``CB = 16 /
P`` plane bytes per scale group, so byte ``g CB + cb`` of a plane holds codes ``(g CB +
cb) P + [0, P)``: a plane byte is the plane's bits of the ``P`` codes along the last
axis, packed and unpacked without a reshape. With ``plane_bits=1`` the dense operands
are viewed as ``[S, G / 2, 2, CB, P]`` and the kernels load and store parts ``[:, :, h,
cb, piece]`` apart (:func:`~pallas_kernels.triton_chunk.part_keys`: two pieces of a half
for 32-bit values), so that one thread holds two whole neighbouring scale groups of one
super-group, and hold them joined as one array
(:func:`~pallas_kernels.triton_chunk.join_parts`: the part axes in each thread's
registers), so that the block arithmetic is one copy in the IR, not one per part:
Triton's coalescing pass walks the whole IR from every memory access, so a kernel's
compile time grows with the square of its size (``docs/results/kernels_sass.md``). The
payload stays flat in global memory (``memory_space=ANY``), as uint16 words there (every
``plane_bits=1`` store pairs two bytes at an even offset; uint8 for ``plane_bits=2``):
each program loads / stores with computed offsets and masks the ``k`` bytes and 2 scale
bytes of each scale record, and for each plane ``p`` (up to the widest of ``width_set``)
its plane bytes at unit ``off_p + s`` where that unit is below ``off_(p+1)``
(:func:`~pallas_kernels.triton_chunk.plane_offsets`). A plane byte's 8 codes and the
plane bytes are bit transposes of each other
(:func:`~pallas_kernels.plane_words.codes_to_plane_words`). The widths come in as
a ``[BLOCK]`` block, the plane offsets as a small int32 input (``off_p``, then the units
used, each at most ``units``). Compress also zeroes the unused units ``[used, units)``:
program ``i`` zeroes its own static share of them, so every payload byte is written
exactly once. The level tables (the decode table by rows, ``code | width << 8``, then
the encode's levels and the reciprocals, padded to a power of two) are a small input
gathered by index.

jax >= 0.11 deprecates the Triton backend and warns at every Triton
lowering; the four entry points filter that DeprecationWarning, and only it,
whenever they build a Triton kernel (:func:`_triton_entry`). jax >= 0.11
also compiles a Triton kernel for the GPU of the abstract mesh in context,
else of the default device: lowering for a GPU from a CPU host takes an
abstract GPU device (docs/guide.md).

``tests/test_gpu_compile_units.py`` compiles all eight kernels for sm_90a
from a CPU host and checks that ``ptxas`` spills nothing;
``tools/sass_count.py`` counts their SASS instructions.
:mod:`pallas_kernels.dynamiq` dispatches to these kernels or the reference.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import dispatch
from pallas_kernels import dynamiq_block as B
from pallas_kernels import dynamiq_reference as R
from pallas_kernels import rng
from pallas_kernels import triton_chunk as C
from pallas_kernels.triton_chunk import plane_table
from pallas_kernels import triton_ops as tt

__all__ = [
    "BLOCK",
    "GPU_OPS",
    "NUM_WARPS",
    "TUNED",
    "launch_config",
    "plane_table",
    "TRITON_DEPRECATION",
    "compress_pallas",
    "decompress_pallas",
    "decompress_accumulate_pallas",
    "decompress_accumulate_recompress_pallas",
    "decompress_many_pallas",
    "decompress_rows_pallas",
    "decompress_sum_pallas",
]

BLOCK = 16
"""Super-groups per program by default: 32 coordinates per thread with
:data:`NUM_WARPS` warps (``docs/results/kernels_sass.md`` weighs it against 8 and 32)."""

NUM_WARPS = 4
"""Warps per program by default."""

TUNED: dict[str, dict[str, tuple[int, int]]] = {
    # bench.kernels --sweep, docs/results/kernels_gpu_h200_sweep.json: at 2^28
    # coordinates 0.656 / 0.808 ms against 0.756 / 0.859 at (16, 4); one group per
    # thread, 64-thread programs (more programs resident per SM).
    "NVIDIA H200": {"compress": (4, 2), "decompress_accumulate_recompress": (4, 2)},
}
"""Per GPU (its ``device_kind``), per operation: ``(block, num_warps)`` chosen by
measurement (``python -m dynamiq_jax.bench.kernels --gpu --sweep``); a GPU or an
operation not listed gets ``(BLOCK, NUM_WARPS)``."""

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
UNROLL_SUM = 8  # payloads the decode-sum kernel adds unrolled; more in a loop

GPU_OPS = C.GPU_OPS
"""The block arithmetic's instructions on a GPU
(:data:`pallas_kernels.triton_chunk.GPU_OPS`)."""


# ----------------------------------------------------------------------------
# Kernel bodies.


def _compress_kernel(keys_ref, ptab_ref, tab_ref, w_ref, x_ref, out_ref, *, cfg, s_count, units,
                     strata, interpret):
  C.write_chunk(out_ref, C.load_dense(x_ref, cfg, interpret), w_ref[...], keys_ref, ptab_ref,
               tab_ref, cfg=cfg, s_count=s_count, units=units, strata=strata,
               interpret=interpret)


def _decompress_kernel(ptab_ref, tab_ref, w_ref, pay_ref, out_ref, *, cfg, s_count, interpret):
  C.store_dense(out_ref, C.read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, interpret=interpret), cfg)


def _decompress_accumulate_kernel(ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg,
                                  s_count, interpret):
  C.store_dense(out_ref, C.read_chunk(pay_ref, w_ref[...], ptab_ref, tab_ref, cfg=cfg,
                                    s_count=s_count, addend=C.load_dense(x_ref, cfg, interpret),
                                    interpret=interpret), cfg)


def _dar_kernel(keys_ref, ptab_ref, tab_ref, w_ref, pay_ref, x_ref, out_ref, *, cfg, s_count,
                units, strata, interpret):
  widths = w_ref[...]
  acc = C.read_chunk(pay_ref, widths, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                    addend=C.load_dense(x_ref, cfg, interpret), interpret=interpret)
  C.write_chunk(out_ref, acc, widths, keys_ref, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
               units=units, strata=strata, interpret=interpret)


def _decode_rows_kernel(ptab_ref, tab_ref, w_ref, *refs, cfg, s_count, n, count, slots, mean,
                        payload_bytes, interpret, rotate=0, row_sum=None):
  """Decodes ``count`` rows, each one super-group of one of the ``n`` payloads (all with
  the same per-position widths, ``w_ref`` read per row): row r is position ``r % S``
  of payload ``r // S``, or (``slots``) slot ``slot_ref[r]``, clamped to ``[0, n S)``:
  position ``slot // n`` of chunk ``slot % n``, which is payload ``(slot % n + rotate)
  % n``; plus ``mean_ref[r mean]`` (``mean``: the stride of the flat means, 0 without),
  by the same ``fma`` as :func:`_decompress_accumulate_kernel`. ``row_sum``: also each
  row's ``row_sum(sq, norm, width)`` (``sq`` the float32 row's squares less its mean,
  :func:`_row_sq`; ``norm`` the entry after its mean, or None; ``width`` its
  position's)."""
  refs = list(refs)
  slot_ref = refs.pop(0) if slots else None
  mean_ref = refs.pop(0) if mean else None
  pay_ref, out_ref = refs[:2]
  block = cfg.sg
  row = pl.program_id(0) * block + C.iota((block,), 0)
  ok = row < count
  if slots:
    slot = jnp.clip(jnp.where(ok, slot_ref[...], 0), 0, n * s_count - 1)
    c, j = jax.lax.rem(slot, np.int32(n)), jax.lax.div(slot, np.int32(n))
    if rotate:
      c = jax.lax.rem(c + np.int32(rotate), np.int32(n))
  else:
    r = jnp.where(ok, row, 0)
    c, j = jax.lax.div(r, np.int32(s_count)), jax.lax.rem(r, np.int32(s_count))
  rows = C.Rows(j, c * np.int32(payload_bytes), ok)
  addend = None
  at = jnp.where(ok, row, 0) * np.int32(mean)  # row r's entry in the flat means
  if mean:  # row r's mean: entry r * mean of the flat means (a column of statistics)
    m = tt.load(mean_ref, at, ok).astype(jnp.float32)
    shape = cfg.block(block)
    if cfg.split:
      shape = C.joined_shape(cfg)
    addend = jnp.broadcast_to(B.trailing(m, len(shape)), shape)
  width = tt.load(w_ref, j, ok)
  val = C.read_chunk(pay_ref, width, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                    interpret=interpret, addend=addend, rows=rows)
  C.store_dense(out_ref, val, cfg)
  if row_sum is not None:
    norm = None
    if mean >= 2:  # the statistics' next column: the row's norm
      norm = tt.load(mean_ref, at + 1, ok).astype(jnp.float32)
    refs[2][...] = row_sum(_row_sq(val, addend), norm, width)


def _row_sq(val, addend):
  """float32 [BLOCK]: each row's sum of ``(val - addend)^2`` over its 256 values (``val``,
  ``addend`` as :func:`~pallas_kernels.triton_chunk.read_chunk` takes and gives them;
  None: no addend), one axis at a
  time (a Triton reduction takes one): the compiler's order, so the last bits may differ
  from the reference's sum."""
  r = val if addend is None else val - addend
  return B.reduce_trailing(r * r, 1, B.sum_last)


def _decode_sum_kernel(ptab_ref, tab_ref, w_ref, pay_ref, out_ref, *, cfg, s_count, n,
                       payload_bytes, interpret):
  """The sum of the ``n`` payloads' decodes of this program's block of positions, in rank
  order: payload 0 decoded, then each next one decoded and added (``fma``, as
  :func:`_decompress_accumulate_kernel`), the sum kept in registers."""
  j = pl.program_id(0) * cfg.sg + C.iota((cfg.sg,), 0)
  ok = j < s_count
  widths = w_ref[...]

  def add(c, acc):
    rows = C.Rows(j, j * 0 + c * np.int32(payload_bytes), ok)
    return C.read_chunk(pay_ref, widths, ptab_ref, tab_ref, cfg=cfg, s_count=s_count,
                       interpret=interpret, addend=acc, rows=rows)

  acc = add(np.int32(0), None)
  if n <= UNROLL_SUM:
    for c in range(1, n):
      acc = add(np.int32(c), acc)
  else:
    acc = jax.lax.fori_loop(np.int32(1), np.int32(n), add, acc)
  C.store_dense(out_ref, acc, cfg)


# ----------------------------------------------------------------------------
# The launch: one pallas_call per operation.


def _compiler_params(cfg: C.Config, interpret):
  """Triton's (what makes a ``pallas_call`` lower with the Triton backend on GPU)."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltr
  return pltr.CompilerParams(num_warps=cfg.num_warps, num_stages=1)


_KERNELS = {  # op: (kernel body, reads a payload, reads x, writes a payload)
    "compress": (_compress_kernel, False, True, True),
    "decompress": (_decompress_kernel, True, False, False),
    "decompress_accumulate": (_decompress_accumulate_kernel, True, True, False),
    "decompress_accumulate_recompress": (_dar_kernel, True, True, True),
}


@functools.partial(jax.jit, static_argnames=("op", "cfg", "units", "strata", "interpret",
                                             "fill"))
def _launch(payload, x, widths, karr, ptab, *, op, cfg, units, strata, interpret, fill=None):
  """One launch of ``op`` over ``cdiv(S, BLOCK)`` programs. ``ptab``: the widths' plane
  table (:func:`~pallas_kernels.triton_chunk.plane_operand`). ``fill`` (tests only): the
  output payload buffer's
  initial byte (None: uninitialized), to check that every byte is written."""
  body, reads, dense, writes = _KERNELS[op]
  s_count = widths.shape[0]
  # (the dense output, when there is one, is float32)
  cfg = C.pieces_for(cfg, *([x.dtype] if dense else []), *([] if writes else [jnp.float32]))
  tab = jnp.asarray(cfg.table())
  static = dict(cfg=cfg, s_count=s_count, interpret=bool(interpret))
  if writes:
    static.update(units=units, strata=strata)
  args = ([karr] if writes else []) + [ptab, tab, widths]
  dense_spec = cfg.dense_spec()
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))
  in_specs = ([whole(8)] if writes else []) + [
      whole(C.PTAB), whole(tab.shape[0]), pl.BlockSpec((cfg.sg,), lambda i: (i,))]
  if reads:
    args.append(C.u16_payload(payload))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
  if dense:
    args.append(x.reshape(cfg.dense(s_count)))
    in_specs.append(dense_spec)
  kernel = functools.partial(body, **static)
  if writes:  # (split: written as uint16 words, C.write_chunk)
    size = R.payload_bytes(s_count, units, cfg.plane_bits)
    out_shape = (jax.ShapeDtypeStruct((size // 2,), jnp.uint16) if cfg.split else
                 jax.ShapeDtypeStruct((size,), jnp.uint8))
    out_spec = pl.BlockSpec(memory_space=pl.ANY)
  else:
    out_shape = jax.ShapeDtypeStruct(cfg.dense(s_count), jnp.float32)
    out_spec = dense_spec
  aliases = {}
  if writes and fill is not None:
    n = len(args)
    kernel = lambda *refs, k=kernel: k(*refs[:n], refs[-1])
    args.append(jnp.full(out_shape.shape, fill * (0x101 if cfg.split else 1), out_shape.dtype))
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    aliases = {n: 0}
  out = pl.pallas_call(
      kernel, out_shape=dispatch.typed_like(out_shape, args), grid=(pl.cdiv(s_count, cfg.sg),),
      in_specs=in_specs, out_specs=out_spec, input_output_aliases=aliases,
      compiler_params=_compiler_params(cfg, interpret), interpret=interpret,
      name=f"dynamiq_units_{op}_p{cfg.plane_bits}")(*args)
  if writes:
    return jax.lax.bitcast_convert_type(out, jnp.uint8).reshape(-1) if cfg.split else out
  return out.reshape(s_count, B.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret", "rotate", "dtype",
                                             "row_sum"))
def _launch_rows(payloads, widths, slots, mean, ptab, *, cfg, units, interpret, rotate=0,
                 dtype=jnp.float32, row_sum=None):
  """One launch decoding rows of all ``n`` payloads [n, bytes] (:func:`_decode_rows_kernel`)
  over ``cdiv(rows, BLOCK)`` programs: ``n S`` rows in chunk order, or one per slot
  (chunk c: payload ``(c + rotate) % n``). ``row_sum``: -> (rows, float32 [rows] each
  row's term)."""
  n, size = payloads.shape
  cfg = C.pieces_for(cfg, dtype)
  s_count = widths.shape[0]
  count = n * s_count if slots is None else slots.shape[0]
  tab = jnp.asarray(cfg.table())
  whole = lambda k: pl.BlockSpec((k,), lambda i: (0,))
  per_row = pl.BlockSpec((cfg.sg,), lambda i: (i,))
  anywhere = pl.BlockSpec(memory_space=pl.ANY)
  args = [ptab, tab, widths]
  in_specs = [whole(C.PTAB), whole(tab.shape[0]), anywhere]
  if slots is not None:
    args.append(slots.astype(jnp.int32))
    in_specs.append(per_row)
  if mean is not None:  # read where it lies: [rows] or column 0 of [rows, k] statistics
    if mean.dtype not in (jnp.float32, jnp.bfloat16):
      mean = mean.astype(jnp.float32)
    args.append(mean.reshape(-1))
    in_specs.append(anywhere)
  args.append(C.u16_payload(payloads.reshape(-1)))
  in_specs.append(anywhere)
  kernel = functools.partial(_decode_rows_kernel, cfg=cfg, s_count=s_count, n=n, count=count,
                             slots=slots is not None,
                             mean=0 if mean is None else math.prod(mean.shape[1:]),
                             payload_bytes=size, interpret=bool(interpret), rotate=rotate,
                             row_sum=row_sum)
  out_shape = [jax.ShapeDtypeStruct(cfg.dense(count), dtype)]
  out_specs = [cfg.dense_spec()]
  programs = pl.cdiv(count, cfg.sg)
  if row_sum is not None:  # one term per row
    out_shape.append(jax.ShapeDtypeStruct((count,), jnp.float32))
    out_specs.append(pl.BlockSpec((cfg.sg,), lambda i: (i,)))
  name = "decompress_rows" if slots is not None else "decompress_many"
  out = pl.pallas_call(
      kernel, out_shape=[dispatch.typed_like(o, args) for o in out_shape],
      grid=(programs,), in_specs=in_specs, out_specs=out_specs,
      compiler_params=_compiler_params(cfg, interpret), interpret=interpret,
      name=f"dynamiq_units_{name}_p{cfg.plane_bits}")(*args)
  rows = out[0].reshape(count, B.SUPERGROUP)
  return (rows, out[1]) if row_sum is not None else rows


@functools.partial(jax.jit, static_argnames=("cfg", "units", "interpret"))
def _launch_sum(payloads, widths, ptab, *, cfg, units, interpret):
  """One launch summing the decodes of all ``n`` payloads [n, bytes] in rank order
  (:func:`_decode_sum_kernel`) over ``cdiv(S, BLOCK)`` programs."""
  n, size = payloads.shape
  cfg = C.pieces_for(cfg, jnp.float32)
  s_count = widths.shape[0]
  tab = jnp.asarray(cfg.table())
  whole = lambda k: pl.BlockSpec((k,), lambda i: (0,))
  dense_spec = cfg.dense_spec()
  args = [ptab, tab, widths, C.u16_payload(payloads.reshape(-1))]
  in_specs = [whole(C.PTAB), whole(tab.shape[0]), pl.BlockSpec((cfg.sg,), lambda i: (i,)),
              pl.BlockSpec(memory_space=pl.ANY)]
  kernel = functools.partial(_decode_sum_kernel, cfg=cfg, s_count=s_count, n=n,
                             payload_bytes=size, interpret=bool(interpret))
  out_shape = jax.ShapeDtypeStruct(cfg.dense(s_count), jnp.float32)
  out = pl.pallas_call(
      kernel, out_shape=dispatch.typed_like(out_shape, args), grid=(pl.cdiv(s_count, cfg.sg),),
      in_specs=in_specs, out_specs=dense_spec, compiler_params=_compiler_params(cfg, interpret),
      interpret=interpret, name=f"dynamiq_units_decompress_sum_p{cfg.plane_bits}")(*args)
  return out.reshape(s_count, B.SUPERGROUP)


def launch_config(op: str, launch=None, *, interpret: bool = False) -> tuple[int, int]:
  """``(block, num_warps)`` of a launch of ``op``: ``launch`` if given (checked), else
  :data:`TUNED`'s entry for the GPU the program is lowered for (the abstract
  mesh's device in context, else the first GPU), else ``(BLOCK, NUM_WARPS)``.

  Raises:
    ValueError: a ``launch`` that is not two positive ints, a block that is not a
      power of two, or fewer scale groups (``16 block``) than threads (``32
      num_warps``): each thread holds at least one whole group.
  """
  if launch is None:
    kind = None if interpret else dispatch.target_gpu()[0]
    return TUNED.get(kind, {}).get(op, (BLOCK, NUM_WARPS))
  try:
    block, warps = (int(v) for v in launch)
  except (TypeError, ValueError):
    raise ValueError(f"launch={launch!r}: give (block, num_warps), two ints") from None
  if block < 1 or block & (block - 1) or warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"launch={launch!r}: block must be a power of two and num_warps one of "
                     "1, 2, 4, 8, 16")
  if C.GROUPS * block < 32 * warps:
    raise ValueError(f"launch={launch!r}: {C.GROUPS * block} scale groups for {32 * warps} "
                     f"threads; "
                     f"use block >= {2 * warps} with {warps} warps")
  return block, warps


def _run(op, payload, x, widths, units, keys, rank, *, eps, strata, scale_rounding, plane_bits,
         width_set, interpret, fill=None, launch=None, ptab=None):
  """Validates (ValueError; NotImplementedError for what the kernels do not support,
  so that dispatch falls back to the reference), then launches ``op``
  (:func:`launch_config`), mapped over a ``vmap`` batch: a chunk's units are
  plane-major over its own super-groups, so batches do not merge into one chunk."""
  widths = jnp.asarray(widths).astype(jnp.int32)
  R.check_chunk(widths, units, plane_bits=plane_bits, width_set=width_set,
                scale_rounding=scale_rounding, x=x, payload=payload)
  block, warps = launch_config(op, launch, interpret=bool(interpret))
  cfg = C.Config(eps=B.level_key(eps),
                width_set=tuple(sorted(int(w) for w in width_set)), plane_bits=plane_bits,
                scale_rounding=scale_rounding, sg=block, num_warps=warps)
  if x is not None and x.dtype not in SUPPORTED_DTYPES:
    raise NotImplementedError(f"x dtype {x.dtype} (kernels take float32, bfloat16, float16)")
  if widths.shape[0] == 0:
    raise NotImplementedError("an empty chunk (no super-groups)")
  if cfg.plane_bits == 2 and any(w % 2 for w in cfg.width_set):
    raise NotImplementedError(f"odd widths in width_set={cfg.width_set} with plane_bits=2")
  karr = rng.key_operand(keys, rank) if _KERNELS[op][3] else None
  launch = functools.partial(_launch, op=op, cfg=cfg, units=int(units), strata=strata,
                             interpret=interpret, fill=fill)
  return dispatch.map_over_batch(launch, payload, x, widths, karr,
                                 C.plane_operand(ptab, widths, cfg.plane_bits, int(units)))


def _run_rows(op, payloads, widths, units, slots, mean, *, eps, plane_bits, width_set,
              interpret, launch=None, rotate=0, dtype=jnp.float32, ptab=None, row_sum=None):
  """:func:`_run` for the decodes of all ``n`` payloads at once (:func:`_launch_rows`,
  or their sum: :func:`_launch_sum`)."""
  widths = jnp.asarray(widths).astype(jnp.int32)
  R.check_payloads(payloads, widths, units, plane_bits=plane_bits, width_set=width_set,
                   slots=slots, mean=mean, rotate=rotate)
  block, warps = launch_config(op, launch, interpret=bool(interpret))
  cfg = C.Config(eps=B.level_key(eps),
                width_set=tuple(sorted(int(w) for w in width_set)), plane_bits=plane_bits,
                scale_rounding="up", sg=block, num_warps=warps)
  if widths.shape[0] == 0 or payloads.shape[0] == 0 or (slots is not None
                                                        and slots.shape[0] == 0):
    raise NotImplementedError("an empty chunk (no super-groups, payloads or slots)")
  if payloads.size >= 2**31:
    raise NotImplementedError(f"{payloads.shape[0]} payloads of {payloads.shape[1]} bytes "
                              "(int32 byte offsets)")
  if cfg.plane_bits == 2 and any(w % 2 for w in cfg.width_set):
    raise NotImplementedError(f"odd widths in width_set={cfg.width_set} with plane_bits=2")
  ptab = C.plane_operand(ptab, widths, cfg.plane_bits, int(units))
  if op == "decompress_sum":
    call = functools.partial(_launch_sum, cfg=cfg, units=int(units), interpret=interpret)
    return dispatch.map_over_batch(call, payloads, widths, ptab)
  call = functools.partial(_launch_rows, cfg=cfg, units=int(units), interpret=interpret,
                           rotate=int(rotate), dtype=jnp.dtype(dtype), row_sum=row_sum)
  return dispatch.map_over_batch(call, payloads, widths, slots, mean, ptab)


TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
"""Start of the DeprecationWarning that jax >= 0.11 raises at each Triton lowering."""


def quiet_triton_deprecation():
  """Ignores jax's Triton-deprecation DeprecationWarning, and only it.

  jax >= 0.11 warns at every lowering of a Triton ``pallas_call`` that the
  backend "will be removed". The kernels are Triton on purpose (Mosaic GPU
  cannot lower them yet, ``docs/mosaic_gpu.md``). The warning is raised
  when the caller's program is lowered, outside any frame of this package,
  so the filter goes in at the last frame of ours before that: by the
  warning's exact start and category, never other warnings. Installed again
  on each use because ``warnings.catch_warnings`` (pytest, user code)
  restores filters on exit; a program traced inside one such block and
  lowered after it can still show the warning.
  """
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def _triton_entry(kernel):
  """Decorates a kernel's entry point: a call that builds the Triton kernel
  (``interpret=False``) quiets jax's Triton deprecation
  (:func:`quiet_triton_deprecation`). The entry point runs on every trace of
  the caller's program, unlike the jitted launch below it, whose trace jax
  caches."""

  @functools.wraps(kernel)
  def entry(*args, interpret=False, **kwargs):
    if not interpret:
      quiet_triton_deprecation()
    return kernel(*args, interpret=interpret, **kwargs)

  return entry


@_triton_entry
def compress_pallas(x, widths, units: int, *, eps, keys, rank=0, strata: int = 1,
                    scale_rounding="up", plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                    interpret=False, fill=None, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.compress_reference`
  (the same arguments; ``fill``: see :func:`_launch`; ``launch``: ``(block,
  num_warps)``, :func:`launch_config`; ``ptab``: the widths' :func:`plane_table`, or
  None: computed from them)."""
  return _run("compress", None, x, widths, units, keys, rank, eps=eps, strata=strata,
              scale_rounding=scale_rounding, plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, fill=fill, launch=launch, ptab=ptab)


@_triton_entry
def decompress_pallas(payload, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                      width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_reference`."""
  return _run("decompress", payload, None, widths, units, None, None, eps=eps, strata=1,
              scale_rounding="up", plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, launch=launch, ptab=ptab)


@_triton_entry
def decompress_accumulate_pallas(payload, x, widths, units: int, *, eps,
                                 plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                                 interpret=False, launch=None, ptab=None):
  """Kernel version of ``decompress_reference(payload) + x``."""
  return _run("decompress_accumulate", payload, x, widths, units, None, None, eps=eps, strata=1,
              scale_rounding="up", plane_bits=plane_bits, width_set=width_set,
              interpret=interpret, launch=launch, ptab=ptab)


@_triton_entry
def decompress_accumulate_recompress_pallas(payload, x, widths, units: int, *, eps, keys,
                                            rank=0, strata: int = 1, scale_rounding="up",
                                            plane_bits: int = R.PLANE_BITS,
                                            width_set=R.WIDTH_SET, interpret=False, fill=None,
                                            launch=None, ptab=None):
  """Kernel version of the fused ring hop
  (:func:`~pallas_kernels.dynamiq_reference.decompress_accumulate_recompress_reference`)."""
  return _run("decompress_accumulate_recompress", payload, x, widths, units, keys, rank,
              eps=eps, strata=strata, scale_rounding=scale_rounding, plane_bits=plane_bits,
              width_set=width_set, interpret=interpret, fill=fill, launch=launch, ptab=ptab)


@_triton_entry
def decompress_many_pallas(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                           width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_many_reference`:
  the ``n`` payloads [n, bytes] decoded by one launch, float32 [n, S, 256]."""
  out = _run_rows("decompress_many", payloads, widths, units, None, None, eps=eps,
                  plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                  launch=launch, ptab=ptab)
  return out.reshape(payloads.shape[0], -1, B.SUPERGROUP)


@_triton_entry
def decompress_rows_pallas(payloads, widths, units: int, slots, mean=None, *, eps,
                             plane_bits: int = R.PLANE_BITS, width_set=R.WIDTH_SET,
                             rotate: int = 0, dtype=jnp.float32, interpret=False, launch=None,
                             ptab=None, row_sum=None):
  """Kernel version of
  :func:`~pallas_kernels.dynamiq_reference.decompress_rows_reference`: each output
  row decoded from its slot of the ``n`` payloads (plus its mean) by one launch, stored
  as ``dtype``; with ``row_sum``, also a term per row (each row's squares summed in the
  compiler's order: the last bits may differ from the reference's)."""
  return _run_rows("decompress_rows", payloads, widths, units, slots, mean, eps=eps,
                   plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                   launch=launch, rotate=rotate, dtype=dtype, ptab=ptab, row_sum=row_sum)


@_triton_entry
def decompress_sum_pallas(payloads, widths, units: int, *, eps, plane_bits: int = R.PLANE_BITS,
                          width_set=R.WIDTH_SET, interpret=False, launch=None, ptab=None):
  """Kernel version of :func:`~pallas_kernels.dynamiq_reference.decompress_sum_reference`:
  the ``n`` payloads' decodes summed in rank order by one launch, float32 [S, 256]."""
  return _run_rows("decompress_sum", payloads, widths, units, None, None, eps=eps,
                   plane_bits=plane_bits, width_set=width_set, interpret=interpret,
                   launch=launch, ptab=ptab)
