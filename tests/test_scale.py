"""The default step's cost against pmean's, compiled for 8 x H100: ``bench.scale --tiny``.

Deterministic figures of the compiled program, no timing (CPU seconds on a
shared machine vary by tens of percent): on the smoke test's transformer
(16.8 M parameters, 17 buckets of 2^20 coordinates, short sequences, so that
the buckets, not the activations, decide the memory):

* **compile cost**: optimized HLO instructions per bucket beyond pmean's step.
  Compile time follows them: XLA's passes visit every instruction, while its
  kernel cache compiles identical kernels once;
* **temporaries** against pmean's, which depend on XLA's scheduler: each
  finished bucket waits for the optimizer as its gathered payloads or, once
  decoded, as its bf16 result (``Codec.result_dtype``), and the scheduler runs
  each bucket's decode kernels early, inside later buckets' collective windows;
* **overlap**: the default places backward GEMMs in collective windows
  (pmean: 1 of 58), and the chain between buckets is what does it: removed
  (the ablation of ``engine.one_after_another``), XLA's combiners merge every
  bucket's guard and gather, and nothing overlaps.

Needs the ``gpu-compile`` extra; skipped, saying why, without it.
"""

from __future__ import annotations

import json

import pytest

import dynamiq_jax as dq
from dynamiq_jax.bench import gpu_compile, scale

pytestmark = pytest.mark.skipif(gpu_compile.missing(need_ptxas=False) is not None,
                                reason=str(gpu_compile.missing(need_ptxas=False)))

INSTRUCTIONS_PER_BUCKET = 600
"""The most optimized HLO instructions one bucket may add to pmean's step (about 420 on
jax 0.12, 450 on jax 0.10.2; a bucket written as ``jnp`` glue took several thousand)."""
TEMP_VS_PMEAN = 0.8
"""The most temporaries the tiny step may hold, as a fraction of pmean's, on every jax
(about 0.2 on jax 0.10.2 and 0.12): what the buckets' payloads and results hold must
stay below what pmean's step holds."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, kernel_cache):
  out = tmp_path_factory.mktemp("scale")
  payload = scale.main(["--tiny", "--out", str(out), "--kernel-cache", kernel_cache])
  with open(out / "scale_tiny.json") as f:
    assert json.load(f)["runs"] == payload["runs"]
  return payload["runs"]["tiny"]


def test_tiny_benchmark_compares_the_same_step(tiny):
  pmean, default = tiny["pmean"], tiny["default"]
  assert pmean["params"] == default["params"] > 0
  assert pmean["backward_gemms"] == default["backward_gemms"] > 0
  assert set(pmean["collectives"]) == {"all-reduce"}
  assert default["collectives"]["collective-permute"] > 0
  # one bucket program per bucket of the layout (all of one size)
  layout = dq.bucket_layout(scale.model_shapes(**scale.TINY), codec=dq.codecs.DynamiQ(),
                            bucket_size=scale.TINY_BUCKET)
  assert default["scopes"]["buckets"] == len(layout) > 4
  assert tiny["ratios"]["cpu_s"] > 0


def test_each_bucket_adds_few_instructions(tiny, record_property):
  pmean, default = tiny["pmean"], tiny["default"]
  per_bucket = (default["instructions"] - pmean["instructions"]) / default["scopes"]["buckets"]
  record_property("instructions_per_bucket", round(per_bucket))
  assert per_bucket <= INSTRUCTIONS_PER_BUCKET, default["scopes"]


def test_temporaries_stay_below_pmeans(tiny, record_property):
  ratio = tiny["default"]["temp_bytes"] / tiny["pmean"]["temp_bytes"]
  record_property("temp_vs_pmean", round(ratio, 3))
  assert ratio <= TEMP_VS_PMEAN


def test_buckets_overlap_only_one_after_another(tiny, record_property, kernel_cache):
  """The default overlaps at least as much as pmean, most of the backward pass; the
  same step with the chain removed (negative control) overlaps nothing."""
  pmean, default = tiny["pmean"], tiny["default"]
  unchained = scale.compile_step({"method": "default", "model": scale.TINY,
                                  "seq": scale.TINY_SEQ, "unchained": True,
                                  "options": {"bucket_size": scale.TINY_BUCKET}},
                                 kernel_cache=kernel_cache)
  counts = [r["backward_gemms_in_windows"] for r in (pmean, default, unchained)]
  record_property("backward_gemms_in_windows", json.dumps(
      dict(zip(("pmean", "default", "unchained"), counts), of=default["backward_gemms"])))
  assert default["backward_gemms_in_windows"] >= pmean["backward_gemms_in_windows"]
  assert default["backward_gemms_in_windows"] >= default["backward_gemms"] // 2
  assert unchained["backward_gemms_in_windows"] < default["backward_gemms"] // 2


@pytest.mark.parametrize("size", ["0", "-4", "100"])
def test_a_bucket_size_the_library_refuses_is_refused_before_compiling(size):
  with pytest.raises(SystemExit, match=f"--bucket-size {size}: bucket_size={size} must be a "
                                       f"positive multiple of 256 for DynamiQ"):
    scale.main(["--sizes", "125m", "--bucket-size", size])


@pytest.mark.parametrize("op_name, category", [
    ("jit(step)/allreduce/bucket3/guard/reduce_max", "bucket/guard"),
    ("jit(step)/allreduce/bucket0/dynamiq/allocate/while", "bucket/allocation"),
    ("jit(step)/allreduce/bucket12/convert_element_type", "bucket/other"),
    ("jit(step)/transpose(jvp(loss_fn))/dot_general", "backward"),
    ("jit(step)/jvp(loss_fn)/dot_general", "forward"),
    ("jit(step)/sgd/mul", "other"),
])
def test_memory_categories_follow_the_named_scopes(op_name, category):
  """--memory's breakdown sorts each value by the scope that made it: a bucket's phase,
  the backward or forward pass, or the rest."""
  assert scale.categorize(op_name, False) == category
  assert scale.categorize(op_name, True) == "argument"


def test_loss_of_bf16_compute_and_remat_is_the_loss_of_float32():
  """--compute bfloat16 and --remat change how the step computes, not what it computes:
  the float32 loss within bf16's rounding, remat's exactly."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  model = {"layers": 2, "d": 128, "f": 256, "vocab": 64}
  shapes = scale.model_shapes(**model)
  keys = iter(jax.random.split(jax.random.key(0), 64))
  params = jax.tree.map(lambda s: 0.05 * jax.random.normal(next(keys), s.shape), shapes)
  tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, model["vocab"])
  full = scale.loss_fn(params, tokens)
  assert float(scale.loss_fn(params, tokens, remat=True)) == float(full)
  np.testing.assert_allclose(scale.loss_fn(params, tokens, compute="bfloat16"), full, rtol=2e-2)
  assert scale.loss_fn(params, tokens, compute="bfloat16") != full


def test_repeated_compiles_report_themedian_run():
  """--repeat k: the ratios come from the run of median CPU seconds (every run's kept)."""
  runs = [{"total_cpu_s": t, "tag": t} for t in (9.0, 7.5, 12.0, 8.0)]
  median = scale.median_run(runs)
  assert median["tag"] == 8.0 and median["total_cpu_s_runs"] == [9.0, 7.5, 12.0, 8.0]
  assert scale.median_run(runs[:3])["tag"] == 9.0
  with pytest.raises(SystemExit, match="--repeat 0"):
    scale.main(["--tiny", "--repeat", "0"])
