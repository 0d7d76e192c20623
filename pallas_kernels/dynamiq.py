"""Pallas kernels for DynamiQ's per-hop operations, and their dispatch.

Four operations on one width class of the wire format
(:mod:`pallas_kernels.dynamiq_format`), each one launch that reads every
input byte once and writes every output byte once:

=====================================  ==============================================
``compress(x)``                        leaf / sender: values -> records
``decompress(p)``                      all-gather receivers: records -> float32
``decompress_accumulate(p, x)``        butterfly internal node: ``decode(p) + x``
``decompress_accumulate_recompress``   ring hop: ``encode(decode(p) + x)``; the sum
                                       stays in registers
=====================================  ==============================================

Algorithm: the block arithmetic is *the same Python function* as the
reference (:func:`~pallas_kernels.dynamiq_format.encode_block`,
:func:`~pallas_kernels.dynamiq_format.decode_block`), so on the same inputs
the kernel equals the reference bit for bit: the RNG is the counter hash of
:mod:`pallas_kernels.rng` keyed by the element index, and every product that
feeds an addition is exact, so FMA contraction cannot change a result.

Memory layout: one program handles ``BLOCK`` super-groups (2048
coordinates). Dense operands (``x``, decoded output) are viewed as
``[S, G, CB, P]`` (G scale groups, CB code bytes per group, P codes per byte;
every extent a power of two, as Triton requires) and moved with BlockSpecs;
the last block may be partial and is masked. Records are ``32 b + 18`` bytes,
not a power of two, so payloads stay flat uint8 in global memory
(``memory_space=ANY``) and each program gathers / scatters its records with
computed offsets: code bytes ``[BLOCK, G, CB]``, one scale byte per group, two
unit bytes. The level table (``2**(b-1)`` floats) is a small input gathered
by level index.

GPU backend: Triton-lowered ``pallas_call`` (``triton.CompilerParams``), the
default, because it is the only Pallas GPU backend that lowers these kernels.
Mosaic GPU (what a ``pallas_call`` without compiler params lowers to for
``cuda`` on jax 0.10.2, which deprecates that route in favour of
``plgpu.kernel``; from jax 0.11 ``pallas_call`` has no Mosaic GPU lowering)
fails on jax 0.10.2, checked on a CPU machine by lowering for the ``cuda``
platform: first, ``NotImplementedError: Only copies transferring a number of
bytes divisible by the warpgroup size are supported. Got bytes=32 but
warpgroup size is 128`` (the 8-word key block, the level table); for
``decompress`` with the table padded to 128 bytes, ``Failed to infer the
output layout of the iota`` (the record offsets). Behind those lies the real
obstacle: records are ``32 b + 18`` bytes, so each program gathers and
scatters bytes of global memory at computed offsets with masks
(``triton.load`` / ``triton.store``), for which we found no Mosaic GPU
counterpart on jax 0.10.2 (its Pallas lowering moves global memory in block
copies); the level-table lookups (``lam_ref[j]``, recorded earlier as
``int_indexer_shape non-empty``) are gathers too (a select tree over the
constant levels would avoid those). Mosaic GPU therefore needs a new record
layout (e.g. codes, scales and units in separate 128-byte-aligned planes), not
a port. jax >= 0.11 deprecates the Triton backend and warns at every Triton
lowering; that DeprecationWarning, and only it, is filtered by the kernels'
entry points whenever they build a Triton (not interpreted) kernel
(:func:`_triton_entry`). jax >= 0.11 also compiles a Triton kernel for the
GPU of the abstract mesh in context, or else of the default device, and no
longer assumes one: lowering for a GPU from a CPU host takes an abstract
GPU device (docs/guide.md). ``python -m
dynamiq_jax.bench.kernels`` measures the Triton kernels against the unfused
XLA reference and the device's copy bandwidth
(``docs/results/kernels_<device>.json``).

Dispatch is by the platform being *lowered for*, not the host's backend
(``jax.lax.platform_dependent``): ``implementation=None`` puts the kernels
into every lowering for ``cuda`` / ``rocm`` (a deviceless or AOT compile for
GPUs from a CPU host included) and the XLA reference into every other
(on CPU without interpret mode; the reference's XLA:CPU workaround,
:func:`~pallas_kernels.dynamiq_format.materialize`, is itself CPU-only).
``"pallas"`` forces the kernels (``interpret=True`` off GPU, which is how CPU
tests run them); ``"xla"`` forces the reference. A kernel raises
``NotImplementedError`` for input it does not support and dispatch falls
back to the reference, logging the reason once. On a process with a GPU,
``implementation=None`` first compiles each kernel alone (once per kernel,
format and operand types); if that fails (a new jax, a new GPU) it warns
once (:class:`KernelFallbackWarning`, naming the kernel, the error and both
ways to force a path) and the program uses the reference: the same bits,
slower.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import bf16
from pallas_kernels import dynamiq_format as F

__all__ = [
    "BLOCK",
    "Implementation",
    "compress",
    "decompress",
    "decompress_accumulate",
    "decompress_accumulate_recompress",
    "compress_pallas",
    "decompress_pallas",
    "decompress_accumulate_pallas",
    "decompress_accumulate_recompress_pallas",
    "KernelFallbackWarning",
]

Implementation = Literal["pallas", "xla"] | None

BLOCK = 8
"""Super-groups per program."""

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_log = logging.getLogger("dynamiq_jax")
_warned: set = set()


# ----------------------------------------------------------------------------
# Kernel bodies.


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def _offsets(fmt: F.Format, s_count: int):
  """Byte offsets (int32) of this program's records, with their validity masks.

  Returns a dict: ``codes`` [BLOCK, G, CB] (code bytes), ``groups``
  [BLOCK, G] (first byte after a group's codes: its scale byte(s)),
  ``unit`` [BLOCK] (the unit's first byte, hierarchical), and the masks
  ``codes_ok``, ``groups_ok``, ``unit_ok``.
  """
  _, g, cb, _ = F.block_shape(fmt, BLOCK)
  step = cb + (1 if fmt.hierarchical else 2)  # code bytes + scale byte(s) per group
  base = pl.program_id(0) * BLOCK
  shape3, shape2 = (BLOCK, g, cb), (BLOCK, g)
  sg3 = base + _iota(shape3, 0)
  sg2 = base + _iota(shape2, 0)
  sg1 = base + _iota((BLOCK,), 0)
  return {
      "codes": sg3 * fmt.record_bytes + _iota(shape3, 1) * step + _iota(shape3, 2),
      "codes_ok": sg3 < s_count,
      "groups": sg2 * fmt.record_bytes + _iota(shape2, 1) * step + cb,
      "groups_ok": sg2 < s_count,
      "unit": sg1 * fmt.record_bytes + g * step,
      "unit_ok": sg1 < s_count,
  }


def _load_bytes(ref, offsets, mask):
  from jax.experimental.pallas import triton as pltr
  return pltr.load(ref.at[offsets], mask=mask, other=0)


def _store_bytes(ref, offsets, values, mask):
  from jax.experimental.pallas import triton as pltr
  pltr.store(ref.at[offsets], values, mask=mask)


def _read_records(pay_ref, lam_ref, fmt: F.Format, s_count: int):
  """Gathers this program's records and decodes them: float32 [BLOCK, G, CB, P]."""
  o = _offsets(fmt, s_count)
  packed = _load_bytes(pay_ref, o["codes"], o["codes_ok"])
  if fmt.hierarchical:
    k = _load_bytes(pay_ref, o["groups"], o["groups_ok"])
    unit = bf16.from_bytes(_load_bytes(pay_ref, o["unit"], o["unit_ok"]),
                      _load_bytes(pay_ref, o["unit"] + 1, o["unit_ok"]))
    scale = F.hier_scale(k, unit)
  else:
    scale = bf16.from_bytes(_load_bytes(pay_ref, o["groups"], o["groups_ok"]),
                       _load_bytes(pay_ref, o["groups"] + 1, o["groups_ok"]))
  return F.decode_block(packed, scale, fmt, lookup=lambda j: lam_ref[j])


def _write_records(out_ref, x, keys_ref, lam_ref, fmt: F.Format, s_count: int, strata: int):
  """Encodes float32 [BLOCK, G, CB, P] and scatters its records."""
  o = _offsets(fmt, s_count)
  shape = x.shape
  idx = ((pl.program_id(0) * BLOCK + _iota(shape, 0)) * F.SUPERGROUP
         + _iota(shape, 1) * (shape[2] * shape[3]) + _iota(shape, 2) * shape[3]
         + _iota(shape, 3)).astype(jnp.uint32)
  keys = (keys_ref[0], keys_ref[1], keys_ref[2], keys_ref[3])
  rank = keys_ref[4].astype(jnp.int32)
  packed, k, scale = F.encode_block(x, fmt, lookup=lambda j: lam_ref[j], idx=idx, keys=keys,
                                    rank=rank, strata=strata)
  _store_bytes(out_ref, o["codes"], packed, o["codes_ok"])
  bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) >> 16
  lo, hi = (bits & 0xFF).astype(jnp.uint8), (bits >> 8).astype(jnp.uint8)
  if fmt.hierarchical:
    _store_bytes(out_ref, o["groups"], k, o["groups_ok"])
    _store_bytes(out_ref, o["unit"], lo, o["unit_ok"])
    _store_bytes(out_ref, o["unit"] + 1, hi, o["unit_ok"])
  else:
    _store_bytes(out_ref, o["groups"], lo, o["groups_ok"])
    _store_bytes(out_ref, o["groups"] + 1, hi, o["groups_ok"])


def _compress_kernel(keys_ref, lam_ref, x_ref, out_ref, *, fmt, s_count, strata):
  x = x_ref[...].astype(jnp.float32)
  _write_records(out_ref, x, keys_ref, lam_ref, fmt, s_count, strata)


def _decompress_kernel(lam_ref, pay_ref, out_ref, *, fmt, s_count):
  out_ref[...] = _read_records(pay_ref, lam_ref, fmt, s_count)


def _decompress_accumulate_kernel(lam_ref, pay_ref, x_ref, out_ref, *, fmt, s_count):
  out_ref[...] = _read_records(pay_ref, lam_ref, fmt, s_count) + x_ref[...].astype(jnp.float32)


def _dar_kernel(keys_ref, lam_ref, pay_ref, x_ref, out_ref, *, fmt, s_count, strata):
  acc = _read_records(pay_ref, lam_ref, fmt, s_count) + x_ref[...].astype(jnp.float32)
  _write_records(out_ref, acc, keys_ref, lam_ref, fmt, s_count, strata)


# ----------------------------------------------------------------------------
# pallas_call wrappers (one launch each).


def _check(x=None, payload=None, fmt=None):
  if x is not None:
    if x.ndim != 2 or x.shape[1] != F.SUPERGROUP:
      raise ValueError(f"x.shape={x.shape} must be [supergroups, {F.SUPERGROUP}]")
    if x.dtype not in _SUPPORTED_DTYPES:
      raise NotImplementedError(f"x dtype {x.dtype} (kernels take float32, bfloat16, float16)")
  if payload is not None:
    if payload.ndim != 2 or payload.shape[1] != fmt.record_bytes or payload.dtype != jnp.uint8:
      raise ValueError(f"payload {payload.dtype}{list(payload.shape)} must be uint8 "
                       f"[supergroups, {fmt.record_bytes}]")
  s_count = (x if x is not None else payload).shape[0]
  if s_count == 0:
    raise NotImplementedError("an empty chunk (no super-groups)")
  return s_count


def _keys_array(keys, rank):
  k = [jnp.asarray(v).astype(jnp.uint32) for v in keys]
  r = jnp.asarray(rank).astype(jnp.uint32)
  return jnp.stack(k + [r, jnp.uint32(0), jnp.uint32(0), jnp.uint32(0)])


def _compiler_params(interpret):
  if interpret:
    return None
  from jax.experimental.pallas import triton as pltr
  return pltr.CompilerParams(num_warps=4, num_stages=1)


def _dense_spec(fmt):
  shape = F.block_shape(fmt, BLOCK)
  return pl.BlockSpec(shape, lambda i: (i, 0, 0, 0))


def _whole(n):
  return pl.BlockSpec((n,), lambda i: (0,))


def _typed_like(out_shape, args):
  """``out_shape`` varying over every mesh axis that one of ``args`` varies over.

  Inside ``jax.shard_map(check_vma=True)`` (``dq.data_parallel_step``) a
  ``pallas_call`` must be told how its output varies across the mesh.
  """
  avals = [jax.typeof(a) for a in args]
  mat = getattr(avals[0], "manual_axis_type", None)
  if mat is None:  # no per-axis types to declare
    return out_shape
  varying = frozenset().union(*(a.manual_axis_type.varying for a in avals))
  return jax.ShapeDtypeStruct(out_shape.shape, out_shape.dtype,
                              manual_axis_type=mat.update(varying=varying))


def _call(kernel, fmt, s_count, in_specs, out_shape, out_spec, interpret, name, *args,
          block=None):
  """One launch over ``cdiv(s_count, block)`` programs (``block``: super-groups per
  program, :data:`BLOCK` when None)."""
  out_shape = _typed_like(out_shape, args)
  return pl.pallas_call(
      kernel, out_shape=out_shape, grid=(pl.cdiv(s_count, block or BLOCK),), in_specs=in_specs,
      out_specs=out_spec, compiler_params=_compiler_params(interpret), interpret=interpret,
      name=name)(*args)


def _payload_out(fmt, s_count):
  return jax.ShapeDtypeStruct((s_count * fmt.record_bytes,), jnp.uint8)


def _dense_out(fmt, s_count):
  return jax.ShapeDtypeStruct(F.block_shape(fmt, s_count), jnp.float32)


_ANY = pl.BlockSpec(memory_space=pl.ANY)


@functools.partial(jax.jit, static_argnames=("fmt", "strata", "interpret"))
def _compress_call(x, keys, lam, *, fmt, strata, interpret):
  s_count = x.shape[0]
  kernel = functools.partial(_compress_kernel, fmt=fmt, s_count=s_count, strata=strata)
  out = _call(kernel, fmt, s_count, [_whole(8), _whole(lam.shape[0]), _dense_spec(fmt)],
              _payload_out(fmt, s_count), _ANY, interpret, f"dynamiq_compress_b{fmt.bits}",
              keys, lam, x.reshape(F.block_shape(fmt, s_count)))
  return out.reshape(s_count, fmt.record_bytes)


@functools.partial(jax.jit, static_argnames=("fmt", "interpret"))
def _decompress_call(payload, lam, *, fmt, interpret):
  s_count = payload.shape[0]
  kernel = functools.partial(_decompress_kernel, fmt=fmt, s_count=s_count)
  out = _call(kernel, fmt, s_count, [_whole(lam.shape[0]), _ANY], _dense_out(fmt, s_count),
              _dense_spec(fmt), interpret, f"dynamiq_decompress_b{fmt.bits}",
              lam, payload.reshape(-1))
  return out.reshape(s_count, F.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("fmt", "interpret"))
def _decompress_accumulate_call(payload, x, lam, *, fmt, interpret):
  s_count = payload.shape[0]
  kernel = functools.partial(_decompress_accumulate_kernel, fmt=fmt, s_count=s_count)
  out = _call(kernel, fmt, s_count, [_whole(lam.shape[0]), _ANY, _dense_spec(fmt)],
              _dense_out(fmt, s_count), _dense_spec(fmt), interpret,
              f"dynamiq_decompress_accumulate_b{fmt.bits}",
              lam, payload.reshape(-1), x.reshape(F.block_shape(fmt, s_count)))
  return out.reshape(s_count, F.SUPERGROUP)


@functools.partial(jax.jit, static_argnames=("fmt", "strata", "interpret"))
def _dar_call(payload, x, keys, lam, *, fmt, strata, interpret):
  s_count = payload.shape[0]
  kernel = functools.partial(_dar_kernel, fmt=fmt, s_count=s_count, strata=strata)
  out = _call(kernel, fmt, s_count,
              [_whole(8), _whole(lam.shape[0]), _ANY, _dense_spec(fmt)],
              _payload_out(fmt, s_count), _ANY, interpret,
              f"dynamiq_decompress_accumulate_recompress_b{fmt.bits}",
              keys, lam, payload.reshape(-1), x.reshape(F.block_shape(fmt, s_count)))
  return out.reshape(s_count, fmt.record_bytes)


def _triton_entry(kernel):
  """Decorates a kernel's entry point: a call that builds the Triton kernel
  (``interpret=False``) quiets jax's Triton deprecation
  (:func:`_quiet_triton_deprecation`). The entry point runs on every trace of
  the caller's program, unlike the jitted launch below it, whose trace jax
  caches."""

  @functools.wraps(kernel)
  def entry(*args, interpret=False, **kwargs):
    if not interpret:
      _quiet_triton_deprecation()
    return kernel(*args, interpret=interpret, **kwargs)

  return entry


# ----------------------------------------------------------------------------
# vmap: pallas_call's own batching would add a grid axis under our flat
# record offsets, so batching is defined here. Decoding merges the batch into
# the super-group axis (no RNG); encoding maps over the batch, because keys and
# rank may differ per batch element.


def _merge_batch_rule(fn, n_dense_out):

  def rule(axis_size, in_batched, *args):
    args = [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
            for a, b in zip(args, in_batched)]
    flat = [a.reshape((-1,) + a.shape[2:]) for a in args]
    out = fn(*flat)
    return out.reshape((axis_size, -1) + out.shape[1:]), True

  del n_dense_out
  return rule


def _map_batch_rule(fn):

  def rule(axis_size, in_batched, *args):
    del axis_size
    batched = [a for a, b in zip(args, in_batched) if b]

    def one(items):
      it = iter(items)
      return fn(*[next(it) if b else a for a, b in zip(args, in_batched)])

    return jax.lax.map(one, batched), True

  return rule


@_triton_entry
def compress_pallas(x, fmt: F.Format, *, keys, rank=0, strata: int = 1, interpret=False):
  """Kernel version of :func:`~pallas_kernels.dynamiq_format.compress_reference`."""
  _check(x=x)

  @jax.custom_batching.custom_vmap
  def op(x, karr):
    return _compress_call(x, karr, jnp.asarray(fmt.table()), fmt=fmt, strata=strata,
                          interpret=interpret)

  op.def_vmap(_map_batch_rule(op))
  return op(x, _keys_array(keys, rank))


@_triton_entry
def decompress_pallas(payload, fmt: F.Format, *, interpret=False):
  """Kernel version of :func:`~pallas_kernels.dynamiq_format.decompress_reference`."""
  _check(payload=payload, fmt=fmt)

  @jax.custom_batching.custom_vmap
  def op(payload):
    return _decompress_call(payload, jnp.asarray(fmt.table()), fmt=fmt, interpret=interpret)

  op.def_vmap(_merge_batch_rule(op, 1))
  return op(payload)


@_triton_entry
def decompress_accumulate_pallas(payload, x, fmt: F.Format, *, interpret=False):
  """Kernel version of ``decompress_reference(payload) + x``."""
  _check(x=x, payload=payload, fmt=fmt)

  @jax.custom_batching.custom_vmap
  def op(payload, x):
    return _decompress_accumulate_call(payload, x, jnp.asarray(fmt.table()), fmt=fmt,
                                       interpret=interpret)

  op.def_vmap(_merge_batch_rule(op, 1))
  return op(payload, x)


@_triton_entry
def decompress_accumulate_recompress_pallas(payload, x, fmt: F.Format, *, keys, rank=0,
                                            strata: int = 1, interpret=False):
  """Kernel version of the fused ring hop."""
  _check(x=x, payload=payload, fmt=fmt)

  @jax.custom_batching.custom_vmap
  def op(payload, x, karr):
    return _dar_call(payload, x, karr, jnp.asarray(fmt.table()), fmt=fmt, strata=strata,
                     interpret=interpret)

  op.def_vmap(_map_batch_rule(op))
  return op(payload, x, _keys_array(keys, rank))


# ----------------------------------------------------------------------------
# Dispatch.


GPU_PLATFORMS = ("cuda", "rocm")
"""Lowering platforms that get the kernels under ``implementation=None``."""

TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"
"""Start of the DeprecationWarning that jax >= 0.11 raises at each Triton lowering."""


class KernelFallbackWarning(RuntimeWarning):
  """A kernel did not compile on this GPU; the XLA reference runs instead."""


_probed: dict = {}  # (op, fmt, strata, operand types) -> error text, or None if it compiled


def _check_implementation(implementation: Implementation):
  if implementation not in (None, "pallas", "xla"):
    raise ValueError(f"implementation={implementation!r} must be None, 'pallas' or 'xla'")


def _quiet_triton_deprecation():
  """Ignores jax's Triton-deprecation DeprecationWarning, and only it.

  jax >= 0.11 warns at every lowering of a Triton ``pallas_call`` that the
  backend "will be removed". The kernels are Triton on purpose (Mosaic GPU
  cannot lower them yet, see the module docstring). The warning is raised
  when the caller's program is lowered, outside any frame of this package,
  so the filter goes in at the last frame of ours before that: by the
  warning's exact start and category, never other warnings. Installed again
  on each use because ``warnings.catch_warnings`` (pytest, user code)
  restores filters on exit; a program traced inside one such block and
  lowered after it can still show the warning.
  """
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


def _fallback(op: str, err: NotImplementedError):
  key = (op, str(err))
  if key not in _warned:
    _warned.add(key)
    _log.warning("dynamiq_jax: Pallas %s does not support %s; using the XLA reference.",
                 op, err)


def _local_gpus():
  """This process's GPU devices ([] when it has none, e.g. a compile-only host)."""
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


def _targets_another_gpu(gpu) -> bool:
  """Whether the program is being lowered for a GPU of another kind than ``gpu``.

  jax >= 0.11 compiles a Pallas GPU kernel for the GPU of the abstract mesh
  in context (``jax.sharding.use_abstract_mesh``, or a ``shard_map`` over a
  mesh of GPUs) and reads a kind that differs from the local device's as a
  deliberate ahead-of-time target; compiling the kernel on ``gpu`` would then
  say nothing about the target.
  """
  target = jax.sharding.get_abstract_mesh().abstract_device
  return (target is not None and target.platform in ("gpu", *GPU_PLATFORMS)
          and target.device_kind != gpu.device_kind)


def _split(args, kwargs):
  """(operands, rebuild): the arrays among a call's arguments, and ``rebuild(operands)``.

  Everything else (the format, ``strata``, Python scalars) stays as given.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, v in enumerate(leaves) if isinstance(v, (jax.Array, np.ndarray, np.generic))]

  def rebuild(operands):
    full = list(leaves)
    for i, v in zip(where, operands):
      full[i] = v
    return jax.tree.unflatten(tree, full)

  return [leaves[i] for i in where], rebuild


def _compile_alone(kernel, device, args, kwargs):
  """Compiles ``kernel(*args, **kwargs)`` by itself for ``device``; raises what XLA raises."""
  operands, rebuild = _split(args, kwargs)
  sharding = jax.sharding.SingleDeviceSharding(device)
  structs = [jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v), sharding=sharding)
             for v in operands]

  def alone(*operands):
    a, kw = rebuild(operands)
    return kernel(*a, **kw, interpret=False)

  with warnings.catch_warnings():
    jax.jit(alone).lower(*structs).compile()


def _kernel_compiles(op, kernel, args, kwargs) -> bool:
  """Whether ``op``'s kernel compiles for this process's GPU (True when it has none).

  Checked once per (op, static arguments (format, strata, ...), operand
  shapes and dtypes) by
  compiling the kernel alone, in the caller's context (the abstract mesh that
  the caller's lowering will read too); on failure one
  :class:`KernelFallbackWarning` names the kernel, the error and how to force
  either path. Without a local GPU (a deviceless or AOT compile from a CPU
  host), or when the program is lowered for a GPU of another kind
  (:func:`_targets_another_gpu`), there is nothing to compile against, and
  the kernels stay in the program.
  """
  gpus = _local_gpus()
  if not gpus or _targets_another_gpu(gpus[0]):
    return True
  operands, _ = _split(args, kwargs)
  types = tuple(f"{jnp.result_type(v)}{list(np.shape(v))}" for v in operands)
  fmts = tuple(v for v in args if isinstance(v, F.Format))
  static = tuple(repr(v) for v in jax.tree.leaves((args, kwargs))
                 if not isinstance(v, (jax.Array, np.ndarray, np.generic)))
  key = (op, static, types, gpus[0].device_kind)  # static: the format, strata, ...
  if key not in _probed:
    try:
      _compile_alone(kernel, gpus[0], args, kwargs)
      _probed[key] = None
    except NotImplementedError:
      _probed[key] = None  # unsupported input: _kernel_or_fallback says so and falls back
    except Exception as err:  # noqa: BLE001 - whatever the compiler raised, do not use it
      _probed[key] = f"{type(err).__name__}: {err}"
      warnings.warn(
          f"dynamiq_jax: the Pallas kernel {op!r} failed to compile on "
          f"{gpus[0].device_kind} (jax {jax.__version__}; {fmts[0] if fmts else ''}, "
          f"operands {', '.join(types)}): {_probed[key]}\n"
          "Using the XLA reference instead: the same results, only slower. "
          "implementation='xla' chooses the reference without this check; "
          "implementation='pallas' uses the kernel regardless (and raises its error).",
          KernelFallbackWarning, stacklevel=2)
  return _probed[key] is None


def _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs):
  try:
    return kernel(*args, **kwargs, interpret=interpret)
  except NotImplementedError as err:
    _fallback(op, err)
    return reference(*args, **kwargs)


def _gpu_path(op, kernel, reference, interpret, args, kwargs):
  """The program for a GPU lowering under ``implementation=None``."""
  if interpret or _kernel_compiles(op, kernel, args, kwargs):
    return _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs)
  return reference(*args, **kwargs)


def _dispatch(op, kernel, reference, implementation, interpret, *args, **kwargs):
  """Runs ``op`` by the platform being lowered for, not the host's backend.

  ``implementation=None``: the kernel in a lowering for a GPU
  (:data:`GPU_PLATFORMS`; unless it fails to compile on this process's GPU,
  see :func:`_kernel_compiles`), the XLA reference for every other platform.
  ``"pallas"``: the kernel everywhere, interpreted off GPU. ``"xla"``: the
  reference. ``interpret``, when given, overrides the interpret mode of the
  kernel wherever the kernel runs. Both branches are traced;
  ``jax.lax.platform_dependent`` keeps only the one for the lowering
  platform (a deviceless compile for GPUs from a CPU host included), and
  an eager call runs only the branch of the default device.
  """
  _check_implementation(implementation)
  if implementation == "xla":
    return reference(*args, **kwargs)
  if implementation == "pallas":
    if interpret is not None:
      return _kernel_or_fallback(op, kernel, reference, interpret, args, kwargs)

    def on_gpu():
      return _kernel_or_fallback(op, kernel, reference, False, args, kwargs)

    def off_gpu():
      return _kernel_or_fallback(op, kernel, reference, True, args, kwargs)

    return jax.lax.platform_dependent(**{p: on_gpu for p in GPU_PLATFORMS}, default=off_gpu)

  def gpu():
    return _gpu_path(op, kernel, reference, bool(interpret), args, kwargs)

  def other():
    return reference(*args, **kwargs)

  return jax.lax.platform_dependent(**{p: gpu for p in GPU_PLATFORMS}, default=other)


def compress(x, fmt: F.Format, *, keys, rank=0, strata: int = 1,
             implementation: Implementation = None, interpret: bool | None = None):
  """Quantises super-groups [S, 256] into records [S, 32b+18] (see module doc)."""
  return _dispatch("compress", compress_pallas, F.compress_reference, implementation,
                   interpret, x, fmt, keys=keys, rank=rank, strata=strata)


def decompress(payload, fmt: F.Format, *, implementation: Implementation = None,
               interpret: bool | None = None):
  """Decodes records [S, 32b+18] to float32 [S, 256]."""
  return _dispatch("decompress", decompress_pallas, F.decompress_reference, implementation,
                   interpret, payload, fmt)


def decompress_accumulate(payload, x, fmt: F.Format, *, implementation: Implementation = None,
                          interpret: bool | None = None):
  """``decompress(payload) + x`` in float32."""
  return _dispatch("decompress_accumulate", decompress_accumulate_pallas,
                   F.decompress_accumulate_reference, implementation, interpret,
                   payload, x, fmt)


def decompress_accumulate_recompress(payload, x, fmt: F.Format, *, keys, rank=0,
                                     strata: int = 1, implementation: Implementation = None,
                                     interpret: bool | None = None):
  """``compress(decompress(payload) + x)`` in one pass; the sum is never stored."""
  return _dispatch("decompress_accumulate_recompress", decompress_accumulate_recompress_pallas,
                   F.decompress_accumulate_recompress_reference, implementation, interpret,
                   payload, x, fmt, keys=keys, rank=rank, strata=strata)
