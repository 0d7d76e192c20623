#!/bin/bash
# The prepared GPU run (issue #46): everything a session with a CUDA GPU checks, in
# one call of under 9 minutes (its parts' bounds below sum to 525 s; the first H200
# run, docs/results/gpu_run_h200.log, set them), from the repository root (jax >= 0.11 with its CUDA
# plugin; this tree on PYTHONPATH):
#
#     OUT=/tmp/gpu bash tools/gpu_run.sh
#
# Parts, most important first, each bounded in seconds (…_S) so that one that hangs
# or runs long cannot take the others' time; every part writes under $OUT as it goes
# (default docs/results/gpu_run), at most 8 files, none deeper than $OUT/a/b:
#   gpu.txt            the card, driver, clocks, Python and jax;
#   run.log            everything the GPU parts print;
#   main/kernels_gpu.json   python -m dynamiq_jax.bench.kernels --gpu: Triton and the
#                      XLA reference at widths 4 and 5, 2^24 / 2^28 / 2^20, each row
#                      beside the same run's device copy of as many bytes (MAIN_S);
#   sweep/kernels_gpu.json  the Triton kernels at every (block, num_warps) launch of
#                      --sweep, compress and the ring hop, 2^24 and 2^28 (SWEEP_S);
#   mosaic/kernels_gpu.json the Mosaic GPU kernels on planar payloads, 2^24 (about
#                      20 s a row on an H200, compiles included; MOSAIC_S; apart, so that a Mosaic GPU failure costs only its part);
#   (tests) tests/test_kernels_on_gpu.py: every backend on the GPU against the CPU
#                      reference, bit for bit (TEST_S; its result in run.log);
#   codec_cost.json    python -m dynamiq_jax.bench.codec_cost: the 8-rank all-reduce
#                      simulated on the GPU, codec seconds per rank beside the wire, at
#                      2^COST_LOG2 coordinates (COST_S; 2^30 needs more than 110 s);
#   ncu.txt            only with NCU_S > 0: Nsight Compute on one launch of each kernel
#                      (tools/gpu_profile.py): DRAM throughput, issue slots, occupancy,
#                      warp stalls (50 s did not profile one kernel on an H200);
#   suite.log          the whole suite (`pytest`, as CI runs it: simulated CPU devices),
#                      on the host's CPU cores in the background from the start (SUITE_S).
set -u
OUT=${OUT:-docs/results/gpu_run}
mkdir -p "$OUT/main" "$OUT/sweep" "$OUT/mosaic"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
LOG=$OUT/run.log
part() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,clocks.sm,clocks.mem,power.limit --format=csv
  $PY -c "import sys, jax; print('Python', sys.version.split()[0], 'jax', jax.__version__, jax.devices(), jax.devices()[0].device_kind)" 2>&1 | tail -1
  echo "CPU cores: $(nproc)"
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt" | tee -a "$LOG"

# The suite on the CPU cores (its conftest asks for 8 simulated CPU devices; the GPU
# parts below keep the GPU to themselves).
# -p no:benchmark: a GPU image's pytest-benchmark warns under xdist, and the suite
# turns warnings into errors (pyproject's filterwarnings).
(JAX_PLATFORMS=cpu timeout "${SUITE_S:-540}" $PY -m pytest -p no:cacheprovider -p no:benchmark -q \
   -n "${SUITE_WORKERS:-8}" --maxprocesses "${SUITE_WORKERS:-8}" > "$OUT/suite.log" 2>&1;
 echo "suite exit $?" >> "$OUT/suite.log") &
SUITE=$!

bench() {  # bench SECONDS DIR ARGS...
  local s=$1 dir=$2
  shift 2
  timeout "$s" $PY -m dynamiq_jax.bench.kernels --gpu --out "$OUT/$dir" --reps 10 --repeats 3 "$@" \
    2>&1 | tee -a "$LOG" | grep -v "^  " ; echo "exit ${PIPESTATUS[0]}" | tee -a "$LOG"
}
part "kernels: Triton and the XLA reference"
bench "${MAIN_S:-90}" main --impls pallas,xla --log2-sizes 24,28,20 --widths 4,5
part "kernels: Triton launch sweep"
bench "${SWEEP_S:-85}" sweep --widths "" --sweep --sweep-log2-sizes 24,28
part "kernels: Mosaic GPU"
bench "${MOSAIC_S:-90}" mosaic --impls mosaic --log2-sizes 24 --widths 4,5
part "tests/test_kernels_on_gpu.py"
# three processes share the GPU (no preallocation): the tests are bound by compiles
XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=cuda,cpu timeout "${TEST_S:-150}" \
  $PY -m pytest -n 3 --dist load -q --tb=short -p no:cacheprovider -p no:benchmark -rs \
  tests/test_kernels_on_gpu.py 2>&1 | tail -40 | tee -a "$LOG"
part "codec cost"
timeout "${COST_S:-110}" $PY -m dynamiq_jax.bench.codec_cost --out "$OUT" --log2-coords "${COST_LOG2:-28}" 2>&1 | tee -a "$LOG" | tail -30
if [ "${NCU_S:-0}" -gt 0 ]; then
part "ncu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout "$NCU_S" "${NCU:-ncu}" --clock-control none \
  -k regex:dynamiq --launch-count 9 --section SpeedOfLight --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis $PY tools/gpu_profile.py --launch 8x4 > "$OUT/ncu.txt" 2>&1
echo "ncu exit $? ($NCU)" | tee -a "$LOG"
grep -E "dynamiq_|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible" "$OUT/ncu.txt" | head -80
fi
part "waiting for the suite"
wait $SUITE
tail -5 "$OUT/suite.log" | tee -a "$LOG"
part "done"
