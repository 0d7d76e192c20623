"""The HLO readers of the deviceless GPU checks, on hand-written modules.

A ring of 8 makes 7 hops per step: as one loop of 7, as XLA 0.12 emits it
(the first hop peeled off before a loop of 6, with jax 0.12's nested tuple
shape of an asynchronous start), and unrolled twice (a loop of 3 with two
hops inside, plus a peeled one). Every form must read 7.
"""

import gpu_compile_tools as T

_KERNEL = ('custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jit(_dar_call)/'
           'dynamiq_units_decompress_accumulate_recompress_p1/pallas_call"}')


def _module(entry_hops: int, body_hops: int, trips: int) -> str:
  hop = ("  %cp{i} = u8[64]{{0}} collective-permute(%k{i}), channel_id=1, "
         "source_target_pairs={{{{0,1}},{{1,0}}}}\n")
  start = ("  %s{i} = ((u8[64]{{0}}), u8[64]{{0}}) collective-permute-start(%x), channel_id=1, "
           "source_target_pairs={{{{0,1}},{{1,0}}}}\n"
           "  %e{i} = f32[8]{{0}} fusion(%y), kind=kLoop, calls=%fused\n"
           "  %d{i} = u8[64]{{0}} collective-permute-done(%s{i})\n")
  kernel = "  %k{i} = u8[64]{{0}} custom-call(%y), " + _KERNEL.replace("{", "{{").replace(
      "}", "}}") + "\n"
  body = "".join((kernel + hop).format(i=i) for i in range(body_hops))
  entry = "".join((kernel + start).format(i=i + 10) for i in range(entry_hops))
  return f"""HloModule m, is_scheduled=true

FileNames
1 "/x.py"

%fused (p: f32[8]) -> f32[8] {{
  ROOT %n = f32[8]{{0}} negate(%p)
}}

%body (p: (s32[], u8[64])) -> (s32[], u8[64]) {{
{body}  ROOT %t = (s32[], u8[64]{{0}}) tuple(%i, %cp0)
}}

%cond (p: (s32[], u8[64])) -> pred[] {{
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}}

ENTRY %main (a: u8[64]) -> u8[64] {{
{entry}  %w = (s32[], u8[64]{{0}}) while(%t0), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trips}"}}}}
  ROOT %r = u8[64]{{0}} get-tuple-element(%w), index=1
}}
"""


def test_hops_per_step_do_not_depend_on_peeling_or_unrolling():
  for entry_hops, body_hops, trips in ((0, 1, 7), (1, 1, 6), (1, 2, 3)):
    comps = T.parse_hlo(_module(entry_hops, body_hops, trips))
    assert set(comps) == {"fused", "body", "cond", "ENTRY"}
    runs, unknown = T.executions(comps)
    assert runs == {"ENTRY": 1, "body": trips, "cond": trips + 1, "fused": entry_hops}
    assert unknown == []
    assert T.per_step(comps, T.is_payload_hop) == 7, (entry_hops, body_hops, trips)
    launches = T.per_step(comps, lambda i: T.kernel_name(i) is not None)
    assert launches == 7


def test_instructions_kernels_and_async_windows():
  comps = T.parse_hlo(_module(1, 1, 6))
  start, fusion, done = comps["ENTRY"].instructions[1:4]
  assert (start.opcode, start.shape) == ("collective-permute-start",
                                         "((u8[64]{0}), u8[64]{0})")
  assert T.is_payload_hop(start) and not T.is_payload_hop(done)
  assert T.kernel_name(comps["body"].instructions[0]) == (
      "dynamiq_units_decompress_accumulate_recompress_p1")
  assert T.kernel_name(fusion) is None
  [window] = T.async_windows(comps["ENTRY"], "collective-permute")
  assert (window.start, window.done, window.between) == (start, done, (fusion,))
  assert T.async_windows(comps["ENTRY"], "all-reduce") == []


def test_an_unknown_trip_count_is_reported():
  text = _module(0, 1, 7).replace(', backend_config={"known_trip_count":{"n":"7"}}', "")
  comps = T.parse_hlo(text)
  runs, unknown = T.executions(comps)
  assert unknown == ["body"] and runs["body"] == 1


def test_gemms_as_xla_gpu_emits_them():
  text = """HloModule m

%gemm_computation (p0: f32[8,64], p1: f32[64,256]) -> f32[8,256] {
  ROOT %dot.1 = f32[8,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[8]) -> f32[8] {
  ROOT %a = f32[8]{0} add(%p0, %p0)
}

ENTRY %main (a: f32[8,64], b: f32[64,256]) -> f32[8,256] {
  %gemm_fusion_dot.1 = f32[8,256]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_computation
  %cublas = (f32[8,256]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
  %lt = (f32[8,256]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %add = f32[8]{0} fusion(%c), kind=kLoop, calls=%fused_add
  ROOT %k = u8[64]{0} custom-call(%y), custom_call_target="__gpu$xla.gpu.triton"
}
"""
  comps = T.parse_hlo(text)
  gemms = [i.name for i in comps["ENTRY"].instructions if T.is_gemm(i, comps)]
  assert gemms == ["gemm_fusion_dot.1", "cublas", "lt"]


_MOSAIC_PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dynamiq_mosaic_compress_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for dynamiq_mosaic_compress_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 125 registers, used 2 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'dynamiq_mosaic_compress_mosaic_gpu_kernel', 96 bytes spill stores, 96 bytes spill loads
ptxas info    : Function properties for dynamiq_mosaic_compress_mosaic_gpu_kernel
    96 bytes stack frame, 96 bytes spill stores, 96 bytes spill loads
ptxas info    : Used 255 registers, used 2 barriers, 96 bytes cumulative stack size, 1 bytes smem
"""


def test_mosaic_ptxas_output_is_read_by_kernel_name():
  """The Mosaic GPU pipeline's ``ptxas -v`` lines (the layout jax 0.12.0.1 prints): named
  by ``plgpu.kernel``'s ``kernel_name``, the largest figures of two compiles kept."""
  assert T.mosaic_ptxas_report(_MOSAIC_PTXAS) == {
      "dynamiq_mosaic_compress": {"registers": 255, "spill_bytes": 192}}
  assert T.mosaic_ptxas_report("") == {}


def test_a_mosaic_gpu_custom_call_is_a_kernel_named_by_its_op_name():
  mosaic = _module(1, 1, 6).replace(
      _KERNEL, 'custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(f)/jit(_dar)/'
               'dynamiq_mosaic_decompress_accumulate_recompress/mpmd_map"}')
  comps = T.parse_hlo(mosaic)
  assert T.kernel_name(comps["body"].instructions[0]) == (
      "dynamiq_mosaic_decompress_accumulate_recompress")
  assert T.per_step(comps, lambda i: T.kernel_name(i) is not None) == 7
