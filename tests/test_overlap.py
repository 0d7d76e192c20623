"""The all-reduce overlaps with the backward pass in the compiled 8 x H100 program.

Compile-only, no GPU: :mod:`dynamiq_jax.bench.overlap` compiles the
data-parallel step of a 12-layer MLP (2048 x 2048 float32 layers, global
batch 2048) for a compile-only 8 x H100 topology and counts, in the
scheduled entry computation, the backward GEMMs that run inside the
asynchronous window of a collective (between its ``*-start`` and
``*-done``). The default ``compressed_psum()`` must place at least as many
there as ``jax.lax.pmean`` of the bf16 gradients does; one bucket for the
whole gradient (what the library did before it bucketed by leaves) places
none: the negative control.

Needs the ``gpu-compile`` extra, like ``tests/test_gpu_compile.py``; skipped,
saying why, without it.
"""

from __future__ import annotations

import json

import pytest

from dynamiq_jax.bench.gpu_compile import missing
from dynamiq_jax.bench.overlap import compile_step, schedule_counts

MODEL = {"layers": 12, "width": 2048, "batch": 2048}
ONE_BUCKET = 1 << 28  # a quarter of it holds all of the model's 50 M coordinates: one bucket

needs_compiler = pytest.mark.skipif(missing(need_ptxas=False) is not None,
                                    reason=str(missing(need_ptxas=False)))


@pytest.fixture(scope="module")
def pmean():
  return schedule_counts(compile_step({"method": "pmean", **MODEL})[0])


@needs_compiler
def test_default_overlaps_the_backward_pass_at_least_as_much_as_pmean(pmean, record_property):
  hlo, times = compile_step({"method": "dynamiq", **MODEL})
  ours = schedule_counts(hlo)
  record_property("gpu_compile_overlap", json.dumps({
      "pmean": pmean["backward_gemms_in_windows"], "default": ours["backward_gemms_in_windows"],
      "of": ours["backward_gemms"], "buckets": ours["buckets"], "compile_s": times["compile_s"]}))
  print(f"backward GEMMs inside collective windows: pmean {pmean['backward_gemms_in_windows']}, "
        f"compressed_psum() {ours['backward_gemms_in_windows']} (of {ours['backward_gemms']}; "
        f"{ours['buckets']} buckets)")
  assert ours["backward_gemms"] == pmean["backward_gemms"] > 0  # the same model
  assert pmean["backward_gemms_in_windows"] > 0
  assert ours["backward_gemms_in_windows"] >= pmean["backward_gemms_in_windows"]
  assert ours["buckets"] > 1


@needs_compiler
def test_one_bucket_overlaps_nothing(pmean, record_property):
  """Negative control: one bucket waits for the whole gradient, so the check above fails."""
  one = schedule_counts(compile_step(
      {"method": "dynamiq", "options": {"bucket_size": ONE_BUCKET}, **MODEL})[0])
  record_property("gpu_compile_overlap_one_bucket", json.dumps(
      {"pmean": pmean["backward_gemms_in_windows"], "one_bucket": one["backward_gemms_in_windows"]}))
  assert one["buckets"] == 1
  assert one["backward_gemms_in_windows"] < pmean["backward_gemms_in_windows"]


def test_schedule_counts_reads_windows_gemms_and_buckets():
  """The reader on a hand-written schedule: a GEMM inside and one outside a window, and
  one bucket's kernel inside another bucket's window; names with and without ``%`` (jax
  0.10.2, 0.12), a synchronous collective (as XLA 0.12 leaves one that overlaps nothing),
  one inside an asynchronous fusion, and an asynchronous fusion that is no collective's
  window (a backward GEMM inside it does not count)."""
  hlo = """HloModule m

%gemm_fusion_dot.1_computation (p: f32[8]) -> f32[8] {
  ROOT %dot = f32[8]{0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

gemm_fusion_dot.2_computation (p: f32[8]) -> f32[8] {
  ROOT dot = f32[8]{0} dot(p, p), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.3_computation (p: f32[8]) -> f32[8] {
  ROOT %dot = f32[8]{0} dot(%p, %p), lhs_contracting_dims={0}, rhs_contracting_dims={0}
}

%fused_slice (p: f32[8]) -> f32[8] {
  ROOT %n = f32[8]{0} negate(%p)
}

%fused_pmax (p: f32[2]) -> f32[2] {
  ROOT %pmax = f32[2]{0} all-reduce(%p), channel_id=3, to_apply=%max
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %g1 = f32[8]{0} fusion(%a), kind=kCustom, calls=%gemm_fusion_dot.1_computation, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  %ar = f32[3]{0} all-reduce-start(%x), channel_id=1, metadata={op_name="jit(f)/allreduce/bucket0/guard/pmax"}
  %g2 = f32[8]{0} fusion(%a), kind=kCustom, calls=%gemm_fusion_dot.2_computation, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  %k1 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_x, metadata={op_name="jit(f)/allreduce/bucket1/guard/max"}
  %k0 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_y, metadata={op_name="jit(f)/allreduce/bucket0/guard/max"}
  %d = f32[3]{0} all-reduce-done(%ar), metadata={op_name="jit(f)/allreduce/bucket0/guard/pmax"}
  %g3 = f32[8]{0} fusion(%a), kind=kCustom, calls=%gemm_fusion_dot.3_computation, metadata={op_name="jit(f)/jvp()/dot_general"}
  ag = f32[64]{0} all-gather(%g3), channel_id=2, dimensions={0}
  %fs = ((f32[8]{0}), f32[8]{0}) fusion-start(%a), kind=kLoop, calls=%fused_slice
  %g4 = f32[8]{0} fusion(%a), kind=kCustom, calls=%gemm_fusion_dot.2_computation, metadata={op_name="jit(f)/transpose(jvp())/dot_general"}
  %fd = f32[8]{0} fusion-done(%fs)
  %ps = ((f32[2]{0}), f32[2]{0}) fusion-start(%a), kind=kCustom, calls=%fused_pmax, metadata={op_name="jit(f)/allreduce/bucket1/guard/pmax"}
  %pd = f32[2]{0} fusion-done(%ps), metadata={op_name="jit(f)/allreduce/bucket1/guard/pmax"}
  ROOT %cp = u8[64]{0} collective-permute-start(%z), source_target_pairs={{0,1}}
}
"""
  counts = schedule_counts(hlo)
  assert counts["gemms"] == 4 and counts["backward_gemms"] == 3
  assert counts["backward_gemms_in_windows"] == 1
  assert counts["codec_ops"] == 2 and counts["codec_ops_in_other_buckets_windows"] == 1
  assert counts["buckets"] == 2
  assert counts["collectives"] == {"all-gather": 1, "all-reduce": 2, "collective-permute": 1}
