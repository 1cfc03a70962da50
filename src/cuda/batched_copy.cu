// memscale::cuda — batched device copies: one launch moves many small tensors
// into one staging buffer (or back), so the offload engine makes one transfer
// per layer instead of one per saved tensor. One block per span; 16-byte
// vector copies where source, destination and length allow, bytes otherwise.
#include <memscale/cuda/kernels.hpp>

#include <cstdint>

namespace {

__global__ void batched_copy_kernel(const memscale_copy_span* spans) {
  const memscale_copy_span span = spans[blockIdx.x];
  const auto* src = static_cast<const unsigned char*>(span.src);
  auto* dst = static_cast<unsigned char*>(span.dst);
  const std::int64_t n = span.bytes;
  const bool aligned = ((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst)) & 15u) == 0;
  std::int64_t done = 0;
  if (aligned) {
    const std::int64_t vectors = n / 16;
    const auto* src4 = reinterpret_cast<const uint4*>(src);
    auto* dst4 = reinterpret_cast<uint4*>(dst);
    for (std::int64_t i = threadIdx.x; i < vectors; i += blockDim.x) dst4[i] = src4[i];
    done = vectors * 16;
  }
  for (std::int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

}  // namespace

extern "C" cudaError_t memscale_cuda_batched_copy(const memscale_copy_span* spans, int count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > memscale::cuda::max_spans_per_launch) return cudaErrorInvalidValue;
  batched_copy_kernel<<<count, 256, 0, stream>>>(spans);
  return cudaGetLastError();
}
