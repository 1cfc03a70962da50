// memscale — the kernels of the compiled target memscale::cuda (src/cuda). They
// take raw pointers, sizes and a cudaStream_t, so the target builds with the
// CUDA Toolkit alone. Linking memscale::cuda defines MEMSCALE_WITH_CUDA_KERNELS;
// the header-only library then calls them for CUDA tensors (the offload
// engine's batched packing, AdamW8bit's fused step), and uses ATen ops otherwise.
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

// --- block-wise 8-bit quantization (memscale::optim::AdamW8bit) --------------------
// A tensor of `count` floats is cut into blocks of memscale::cuda::quantization_block_size
// values (the last one may be partial). Each block stores one float absmax
// (max |x| over the block) and one byte per value: the index of the entry of a
// sorted 256-entry quantization map (device memory, values in [-1, 1]) nearest
// to x / absmax; a tie goes to the lower index, an all-zero block stores
// absmax 0. Dequantized, a value is map[code] * absmax. Every pointer is
// device memory; a call with count 0 is a no-op, one with a null pointer or a
// negative count returns cudaErrorInvalidValue. Calls return the launch status.

/// Quantizes `count` floats into `codes` (count bytes) and `absmax`
/// (ceil(count / block size) floats).
cudaError_t memscale_cuda_quantize_blockwise(const float* values, const float* quant_map, unsigned char* codes,
                                             float* absmax, std::int64_t count, cudaStream_t stream);

/// The inverse: `values[i] = quant_map[codes[i]] * absmax[i / block size]`.
cudaError_t memscale_cuda_dequantize_blockwise(const unsigned char* codes, const float* absmax,
                                               const float* quant_map, float* values, std::int64_t count,
                                               cudaStream_t stream);

/// The constants of one AdamW step, each computed by the caller in double and
/// rounded once to float, exactly as the CPU path of memscale::optim::AdamW8bit
/// computes them, so both run the same float arithmetic:
/// decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^step),
/// bias_correction2_sqrt = sqrt(1 - beta2^step).
struct memscale_adamw8bit_hyperparameters {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float decay;
  float step_size;
  float bias_correction2_sqrt;
  float eps;
};

/// One fused AdamW step on `count` float parameters whose moments are stored
/// block-wise quantized: exp_avg with `exp_avg_map` (signed), exp_avg_sq with
/// `exp_avg_sq_map` (unsigned). Per block, in one pass: dequantize both
/// moments, m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2,
/// p = p * decay - step_size * (m / (sqrt(v) / bias_correction2_sqrt + eps)),
/// then re-quantize m and v with fresh block absmax values. `grads` is read only.
/// Built without FMA contraction, so it rounds as the CPU path does.
cudaError_t memscale_cuda_adamw8bit_step(float* params, const float* grads, unsigned char* exp_avg_codes,
                                         float* exp_avg_absmax, unsigned char* exp_avg_sq_codes,
                                         float* exp_avg_sq_absmax, const float* exp_avg_map,
                                         const float* exp_avg_sq_map, std::int64_t count,
                                         memscale_adamw8bit_hyperparameters hyper, cudaStream_t stream);

}  // extern "C"

namespace memscale::cuda {

/// The largest span table one launch takes (grid.x is one block per span).
inline constexpr int max_spans_per_launch = 65535;

/// Values per quantization block of the 8-bit kernels (one thread block each).
inline constexpr int quantization_block_size = 256;

}  // namespace memscale::cuda
