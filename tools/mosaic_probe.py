"""Which constructs DynamiQ's encode kernels need does Mosaic GPU run in interpret mode and lower for H100?

    JAX_PLATFORMS=cpu python tools/mosaic_probe.py     # jax >= 0.12 (GPU interpret mode)

Each line builds one small ``plgpu.kernel`` on a ``[64, 32]`` float32 block
in the WGMMA layout (the decode kernels' layout,
:mod:`pallas_kernels.dynamiq_mosaic`), runs it in GPU interpret mode and
lowers it for an abstract H100 on this host, and prints what each said (the
first line of an error). Nothing is compiled for a GPU or timed.
"""

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from dynamiq_jax.bench import gpu_compile as gc

ROW = plgpu.Layout.WGMMA.reduce(1)
WG = plgpu.Layout.WGMMA

def run(name, body_compute, out_dtype=jnp.float32, out_shape=(64, 32), extra=None):
  def body(x_g, o_g, x_s, o_s, bar):
    plgpu.copy_gmem_to_smem(x_g, x_s, bar); plgpu.barrier_wait(bar)
    x = plgpu.load(x_s, layout=WG)
    o_s[...] = body_compute(x, x_s, o_s)
    plgpu.commit_smem(); plgpu.copy_smem_to_gmem(o_s, o_g); plgpu.wait_smem_to_gmem(0)
  def build(interp):
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                        scratch_types=[plgpu.SMEM((64, 32), jnp.float32), plgpu.SMEM(out_shape, out_dtype), plgpu.Barrier()],
                        interpret=interp)
  x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
  res = []
  try:
    jax.block_until_ready(jax.jit(build(plgpu.InterpretGPUParams()))(x)); res.append("interp ok")
  except Exception as e:
    res.append(f"interp {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
  try:
    with gc.gpu_target():
      jax.jit(build(None)).trace(jax.ShapeDtypeStruct((64, 32), jnp.float32)).lower(lowering_platforms=("cuda",))
    res.append("lowers")
  except Exception as e:
    res.append(f"lower {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
  print(f"{name:<28}", " | ".join(res), flush=True)


print(f"jax {jax.__version__}: construct, GPU interpret mode | lowering for H100")

bc = lambda v: lax.broadcast_in_dim(v, (64, 32), (0,))
col = lambda: plgpu.broadcasted_iota(jnp.int32, (64, 32), 1, layout=WG)
run("max axis1 (half mask)", lambda x, *_: bc(jnp.max(jnp.where(col() < 16, jnp.abs(x), 0.0), axis=1)))
run("sum axis1 u32", lambda x, *_: bc(jnp.sum(lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(1), axis=1).astype(jnp.float32)))
run("log2", lambda x, *_: jnp.log2(jnp.abs(x) + 1.0))
run("floor->int32", lambda x, *_: jnp.floor(x * 10).astype(jnp.int32).astype(jnp.float32))
run("ceil", lambda x, *_: jnp.ceil(x * 10))
run("divide", lambda x, *_: x / (jnp.abs(x) + 1.0))
run("u32 mul/xor/shift", lambda x, *_: ((lax.bitcast_convert_type(x, jnp.uint32) * jnp.uint32(0x9E3779B9)) ^ (lax.bitcast_convert_type(x, jnp.uint32) >> 15)).astype(jnp.float32))
run("u32 -> f32 convert", lambda x, *_: (lax.bitcast_convert_type(x, jnp.uint32) >> 8).astype(jnp.float32))
run("f32 -> bf16 -> f32", lambda x, *_: x.astype(jnp.bfloat16).astype(jnp.float32))
run("scalar smem read+f32 math", lambda x, x_s, o_s: x * (x_s[0, 0] * 2.0 + 1.0))
run("full reduce to scalar", lambda x, *_: x * jnp.max(jnp.abs(x)))
