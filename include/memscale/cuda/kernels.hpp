// memscale — the kernels of the compiled target memscale::cuda (src/cuda). They
// take raw pointers, sizes and a cudaStream_t, so the target builds with the
// CUDA Toolkit alone. Linking memscale::cuda defines MEMSCALE_WITH_CUDA_KERNELS;
// the header-only library then calls them for CUDA tensors (the offload
// engine's batched packing), and uses ATen copies otherwise.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

extern "C" {

/// One contiguous run of bytes to copy on the device.
struct memscale_copy_span {
  const void* src;
  void* dst;
  std::int64_t bytes;
};

/// Copies `count` spans in one launch on `stream`. `spans` points to device
/// memory holding the table (for example a device tensor the caller filled).
/// Gathering many small tensors into one staging buffer, and scattering them
/// back, are both batched copies. Returns the launch status.
cudaError_t memscale_cuda_batched_copy(const memscale_copy_span* spans, int count, cudaStream_t stream);

}  // extern "C"

namespace memscale::cuda {

/// The largest span table one launch takes (grid.x is one block per span).
inline constexpr int max_spans_per_launch = 65535;

}  // namespace memscale::cuda
