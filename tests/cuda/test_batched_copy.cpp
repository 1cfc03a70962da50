// memscale::cuda's batched copy kernel, through its C interface only (no
// LibTorch): links against the target as a user would. With a GPU: gathers
// spans of different sizes and alignments into one staging buffer and scatters
// them back, bit for bit. Without one: the launch must report the missing
// device as an error, never claim success.
#include <memscale/cuda/kernels.hpp>

#include "check.hpp"

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using kernel_test::check;
using kernel_test::failures;

void round_trip() {
  const std::vector<std::int64_t> sizes = {1, 15, 16, 17, 4096, 100003, 0, 64};
  std::vector<std::int64_t> offsets;
  std::int64_t total = 0;
  for (auto s : sizes) {
    offsets.push_back(total);
    total += (s + 63) / 64 * 64;
  }
  std::vector<unsigned char> host(static_cast<std::size_t>(total));
  for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(i * 131u + 7u);
  unsigned char *sources = nullptr, *staging = nullptr, *back = nullptr;
  memscale_copy_span* table = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&sources), total + 1) == cudaSuccess, "cudaMalloc sources");
  check(cudaMalloc(reinterpret_cast<void**>(&staging), total) == cudaSuccess, "cudaMalloc staging");
  check(cudaMalloc(reinterpret_cast<void**>(&back), total + 1) == cudaSuccess, "cudaMalloc back");
  check(cudaMalloc(reinterpret_cast<void**>(&table), sizes.size() * sizeof(memscale_copy_span)) == cudaSuccess, "cudaMalloc table");
  // Sources start one byte in: unaligned spans take the byte path.
  check(cudaMemcpy(sources + 1, host.data(), total, cudaMemcpyHostToDevice) == cudaSuccess, "upload");
  std::vector<memscale_copy_span> gather, scatter;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    gather.push_back({sources + 1 + offsets[i], staging + offsets[i], sizes[i]});
    scatter.push_back({staging + offsets[i], back + 1 + offsets[i], sizes[i]});
  }
  for (auto* spans : {&gather, &scatter}) {
    check(cudaMemcpy(table, spans->data(), spans->size() * sizeof(memscale_copy_span), cudaMemcpyHostToDevice) ==
              cudaSuccess,
          "table upload");
    check(memscale_cuda_batched_copy(table, static_cast<int>(spans->size()), nullptr) == cudaSuccess, "launch");
    check(cudaDeviceSynchronize() == cudaSuccess, "kernel run");
  }
  std::vector<unsigned char> result(static_cast<std::size_t>(total));
  check(cudaMemcpy(result.data(), back + 1, total, cudaMemcpyDeviceToHost) == cudaSuccess, "download");
  for (std::size_t i = 0; i < sizes.size(); ++i)
    check(std::memcmp(result.data() + offsets[i], host.data() + offsets[i], static_cast<std::size_t>(sizes[i])) == 0,
          "span bytes survive gather and scatter");
  cudaFree(sources);
  cudaFree(staging);
  cudaFree(back);
  cudaFree(table);
}

}  // namespace

int main() {
  check(memscale_cuda_batched_copy(nullptr, 0, nullptr) == cudaSuccess, "an empty batch is a no-op");
  check(memscale_cuda_batched_copy(nullptr, memscale::cuda::max_spans_per_launch + 1, nullptr) ==
            cudaErrorInvalidValue,
        "too many spans are refused");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    memscale_copy_span* none = nullptr;
    check(memscale_cuda_batched_copy(none, 1, nullptr) != cudaSuccess, "a launch without a GPU reports an error");
    std::printf("no CUDA device: checked the error paths; the round trip needs a GPU\n");
  } else {
    round_trip();
    std::printf("batched copy round trip on the GPU: %s\n", failures == 0 ? "ok" : "FAILED");
  }
  return failures == 0 ? 0 : 1;
}
