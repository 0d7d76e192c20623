"""``tools/mosaic_overlap.py`` reads the payload ring hops of a hand-written schedule.

No compile: the tool's reader (:func:`hops`) on a small scheduled entry, the way
XLA 0.12 prints one (docs/mosaic_gpu.md, "Dispatch", says what the tool found).
"""

from __future__ import annotations

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parent.parent / "tools" / "mosaic_overlap.py"
_SPEC = importlib.util.spec_from_file_location("mosaic_overlap", _PATH)
mosaic_overlap = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mosaic_overlap)

HOP = 'metadata={op_name="jit(f)/compressed_psum/allreduce/bucket0/reduce/hop/ppermute"}'
CODEC = 'metadata={op_name="jit(f)/compressed_psum/allreduce/bucket0/reduce/hop/slice"}'
BWD = 'metadata={op_name="jit(f)/transpose(jvp())/dot_general"}'


def test_hops_counts_async_hops_and_what_sits_between_them():
  """Two hops of one bucket: the first asynchronous with a GEMM inside its window, the
  second synchronous; between them a codec slice, XLA's kernel fusion (no scope), a
  backward GEMM and a backward elementwise fusion. A statistics hop (``metadata/``) and
  what follows the last hop are not counted."""
  hlo = f"""HloModule m

%gemm_computation (p: f32[8]) -> f32[8] {{
  ROOT %dot = f32[8]{{0}} dot(%p, %p), lhs_contracting_dims={{0}}, rhs_contracting_dims={{0}}
}}

ENTRY %main (a: u8[64]) -> u8[64] {{
  %st = u8[64]{{0}} collective-permute(%a), source_target_pairs={{{{0,1}}}}, metadata={{op_name="jit(f)/compressed_psum/allreduce/bucket0/metadata/reduce/hop/ppermute"}}
  %s = ((u8[64]{{0}}), u8[64]{{0}}) collective-permute-start(%a), source_target_pairs={{{{0,1}}}}, {HOP}
  %g1 = f32[8]{{0}} fusion(%x), kind=kCustom, calls=%gemm_computation, {BWD}
  %d = u8[64]{{0}} collective-permute-done(%s), {HOP}
  %sl = u8[8]{{0}} fusion(%d), kind=kLoop, calls=%fused_slice, {CODEC}
  %b = u8[64]{{0}} bitcast(%d)
  %dynamic_slice_fusion = u8[64]{{0}} fusion(%b), kind=kCustom, calls=%dsf
  %g2 = f32[8]{{0}} fusion(%x), kind=kCustom, calls=%gemm_computation, {BWD}
  %m = f32[8]{{0}} fusion(%g2), kind=kLoop, calls=%fused_multiply, metadata={{op_name="jit(f)/transpose(jvp())/mul"}}
  %p = u8[64]{{0}} collective-permute(%dynamic_slice_fusion), source_target_pairs={{{{0,1}}}}, {HOP}
  ROOT %after = u8[8]{{0}} fusion(%p), kind=kLoop, calls=%fused_slice, {CODEC}
}}
"""
  assert mosaic_overlap.hops(hlo) == {
      "hops": 2, "async_hops": 1, "gap_backward_gemms": 1, "gap_other_ops": 1,
      "gap_ops": {"fusion:kCustom": 1, "fusion:kLoop": 1}}
