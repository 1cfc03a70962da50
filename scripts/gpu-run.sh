#!/usr/bin/env bash
# One call on a GPU machine (no Debian packages, no network; PyTorch, CMake and
# nvcc installed): builds memscale against the CUDA LibTorch inside the PyTorch
# wheel, with range-v3 and Catch2 from third_party/ (scripts/vendor-deps.sh makes
# it on a Debian machine; carry it along), then runs
#   - the kernel tests of memscale::cuda (batched copy; 8-bit quantize,
#     dequantize and the fused AdamW8bit step against host references),
#   - the hidden CUDA tests (offload tiers, batching, the chain's peak on CUDA,
#     the fused 8-bit step against the CPU one, CUDA backward through memscale's
#     engine; the memory tracker, predict, verify_correctness, autotune, mixed
#     precision and tiling on CUDA; predict's calibration timelines at small, near
#     and full batches, written to $OUT/cuda_calibration_study.json for study on a
#     CPU; the engine-order test alone, in a process of its own),
#   - the OOM predictor against measured steps on the GPU (memscale_bench_predict
#     --device cuda: peak reserved bytes plus the context), and its largest batch
#     under a budget trained, with one batch more (--max-batch),
#   - the GPU benchmark (bandwidth; GPT baseline / checkpoint / + offload; the
#     fused 8-bit AdamW step against LibTorch's AdamW),
#   - autotune's CPU cases on the wheel's LibTorch (a backtrace where they fail).
# Device time is short: only the test files with CUDA cases are compiled, and
# each step has a time limit. MEMSCALE_GPU_CPU_SUITE=1 compiles every test file
# and runs the whole CPU suite on LibTorch 2.x too (minutes more).
# MEMSCALE_GPU_PREDICT_ONLY=1, for a change to predict() alone: builds only
# memscale_bench_predict (152 s on the H200) and runs its two tables, each
# prediction printed (models: MEMSCALE_GPU_PREDICT_MODELS, default gpt,gpt-large).
# Output goes to $OUT (or ./gpu-out): summary.txt, device.txt, steps.log (every step's output) and the
# calibration study. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
status=0
# Every step's output goes to one file, $out/steps.log, as it runs: the device tool returns at most 8 files,
# and what a step wrote before a time limit stopped the call comes back too.
step() {  # step NAME LIMIT_S COMMAND...: runs it, its output appended to $out/steps.log, remembers a failure
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  printf '\n=== %s (limit %ss): %s\n' "$name" "$limit" "$*" >>"$out/steps.log"
  timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$out/steps.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$out/summary.txt"
  if ((rc != 0 && status == 0)); then status=$rc; fi
  return $rc
}

prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
{ nvidia-smi; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  >"$out/device.txt" 2>&1
cpu_suite=${MEMSCALE_GPU_CPU_SUITE:-0}
predict_only=${MEMSCALE_GPU_PREDICT_ONLY:-0}
tests_regex='/test_(optim8bit|autotune|[a-z_]*_cuda)\.cpp$'
[[ $cpu_suite == 1 ]] && tests_regex=''
# The GPU image's own spdlog (1.12) does not compile against its fmt (12): the vendored one is used.
step configure 120 cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DMEMSCALE_THIRD_PARTY_DIR="$PWD/third_party" -DMEMSCALE_CUDA_ARCHITECTURES="${MEMSCALE_CUDA_ARCHITECTURES:-90}" \
  -DMEMSCALE_BUILD_EXAMPLES=ON -DMEMSCALE_BUILD_BENCHMARKS=ON -DMEMSCALE_BUILD_TESTS=ON -DMEMSCALE_UNITY_PROGRAMS=OFF \
  -DMEMSCALE_TEST_SOURCES_REGEX="$tests_regex" -DCMAKE_DISABLE_FIND_PACKAGE_spdlog=ON || exit "$status"
# The predictor's table on MODELS (MEMSCALE_GPU_PREDICT_MODELS names others), then max_batch_size trained at a
# budget, and one batch more: the GPT (with and without the plan) and the two CNNs whose cuDNN workspaces change
# with the batch (predict measures them at the example's batch only).
predictor_tables() {  # predictor_tables LIMIT_S MODELS
  step bench_predict "${MEMSCALE_GPU_PREDICT_LIMIT:-$1}" ./build-gpu/benchmarks/memscale_bench_predict --device cuda \
    --models "${MEMSCALE_GPU_PREDICT_MODELS:-$2}"
  step bench_predict_max_batch "${MEMSCALE_GPU_MAX_BATCH_LIMIT:-120}" ./build-gpu/benchmarks/memscale_bench_predict \
    --device cuda --max-batch --models "${MEMSCALE_GPU_MAX_BATCH_MODELS:-gpt,resnet-bottleneck,cnn-deep}"
}
if [[ $predict_only == 1 ]]; then
  step build 300 cmake --build build-gpu -j "$(nproc)" --target memscale_bench_predict || exit "$status"
  export MEMSCALE_BENCH_SHOW=1
  predictor_tables 120 gpt,gpt-large
  exit "$status"
fi
step build 600 cmake --build build-gpu -j "$(nproc)" --target memscale_tests memscale_cuda_tests \
  memscale_cuda_adamw8bit_tests memscale_bench_predict memscale_bench_gpu || exit "$status"
step kernel_test 60 ./build-gpu/tests/memscale_cuda_tests
step kernel_test_8bit 60 ./build-gpu/tests/memscale_cuda_adamw8bit_tests
# In a process of its own: it leaves LibTorch's base engine in charge of CUDA backwards.
step engine_order 60 ./build-gpu/tests/memscale_tests "[.cuda_engine_order]"
# MEMSCALE_GPU_OUT: where the calibration study writes its timelines (cuda_calibration_study.json).
step cuda_tests "${MEMSCALE_GPU_TESTS_LIMIT:-240}" env MEMSCALE_GPU_OUT="$out" \
  ./build-gpu/tests/memscale_tests "[.cuda]" --durations yes
# The models whose GPU figures RESULTS.md has: the eight took 86-88 s on the H200 (2026-11-30).
predictor_tables 240 gpt,resnet,resnet-bottleneck,mlp,gpt-wide,cnn-deep,mlp-bn,gpt-large
step bench_gpu "${MEMSCALE_GPU_BENCH_LIMIT:-180}" ./build-gpu/benchmarks/memscale_bench_gpu \
  --steps "${MEMSCALE_GPU_STEPS:-5}"
# autotune's CPU cases on LibTorch 2.x's wheel: the first run (2026-11-28) crashed (SIGSEGV) while training
# with the winner under the tracker's hard limit (test_autotune.cpp); where it fails, a backtrace with cuda-gdb
# (the image has no gdb; cuda-gdb debugs host code too).
if ! step cpu_autotune 90 ./build-gpu/tests/memscale_tests "[autotune]"; then
  step cpu_autotune_backtrace 120 cuda-gdb -q -batch -ex run -ex bt -ex 'thread apply all bt 8' \
    --args ./build-gpu/tests/memscale_tests "autotune's winner fits a budget the baseline does not*"
fi
if [[ $cpu_suite == 1 ]]; then
  step cpu_suite 900 ./build-gpu/tests/memscale_tests
fi
exit "$status"
