#!/bin/bash
# What a session with a CUDA GPU runs first (jax >= 0.11 with its CUDA plugin; this
# tree on PYTHONPATH), from the repository root:
#
#     OUT=/tmp/gpu bash tools/gpu_first_run.sh
#
# 1. the kernels on the GPU, bit for bit: tests/test_kernels_on_gpu.py (Triton, Mosaic
#    GPU and the XLA reference on the GPU against the reference on the CPU);
# 2. python -m dynamiq_jax.bench.kernels --gpu (both backends, the reference and the
#    device's copy bandwidth, side by side).
# Everything it prints is also written under $OUT (default docs/results/gpu_run).
# TEST_S / BENCH_S bound each part's seconds; LOG2_SIZES and WIDTHS pick the
# benchmark's chunks.
set -u
OUT=${OUT:-docs/results/gpu_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
JAX_PLATFORMS=cuda,cpu timeout "${TEST_S:-300}" $PY -m pytest -n 0 -q --tb=short -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" tests/test_kernels_on_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
timeout "${BENCH_S:-270}" $PY -m dynamiq_jax.bench.kernels --gpu --out "$OUT" \
  --log2-sizes "${LOG2_SIZES:-20,24,28}" --widths "${WIDTHS:-4,5}" 2>&1 | tee "$OUT/bench.log"
