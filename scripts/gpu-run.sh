#!/usr/bin/env bash
# One call on a GPU machine (no Debian packages, no network; PyTorch, CMake and
# nvcc installed): builds memscale against the CUDA LibTorch inside the PyTorch
# wheel, with range-v3 and Catch2 from third_party/ (scripts/vendor-deps.sh makes
# it on a Debian machine; carry it along), then runs
#   - the kernel tests of memscale::cuda (batched copy; 8-bit quantize,
#     dequantize and the fused AdamW8bit step against host references),
#   - the hidden CUDA tests (offload tiers, batching, the chain's peak on CUDA,
#     the fused 8-bit step against the CPU one, CUDA backward through memscale's
#     engine; the engine-order test alone, in a process of its own),
#   - the whole CPU suite, on LibTorch 2.x at run time,
#   - the GPU benchmark (bandwidth; GPT baseline / checkpoint / + offload; the
#     fused 8-bit AdamW step against LibTorch's AdamW).
# Logs go to $OUT (or ./gpu-out). Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
status=0
step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, remembers a failure
  local name=$1
  shift
  local start=$SECONDS
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '%-22s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$out/summary.txt"
  if ((rc != 0 && status == 0)); then status=$rc; fi
  return $rc
}

prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
{ nvidia-smi; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  >"$out/device.txt" 2>&1
step configure cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DMEMSCALE_THIRD_PARTY_DIR="$PWD/third_party" -DMEMSCALE_CUDA_ARCHITECTURES="${MEMSCALE_CUDA_ARCHITECTURES:-90}" \
  -DMEMSCALE_BUILD_EXAMPLES=ON -DMEMSCALE_BUILD_BENCHMARKS=ON -DMEMSCALE_BUILD_TESTS=ON -DMEMSCALE_UNITY_PROGRAMS=OFF || exit "$status"
step build cmake --build build-gpu -j "$(nproc)" --target memscale_tests memscale_cuda_tests memscale_cuda_adamw8bit_tests \
  memscale_bench_gpu train_gpt || exit "$status"
step kernel_test ./build-gpu/tests/memscale_cuda_tests
step kernel_test_8bit ./build-gpu/tests/memscale_cuda_adamw8bit_tests
# In a process of its own: it leaves LibTorch's base engine in charge of CUDA backwards.
step engine_order ./build-gpu/tests/memscale_tests "[.cuda_engine_order]"
step cuda_tests ./build-gpu/tests/memscale_tests "[.cuda]"
step cpu_suite ./build-gpu/tests/memscale_tests
step bench_gpu ./build-gpu/benchmarks/memscale_bench_gpu --steps "${MEMSCALE_GPU_STEPS:-5}"
step example_cpu ./build-gpu/examples/train_gpt --steps 4
exit "$status"
