// memscale::cuda — block-wise 8-bit quantization and the fused AdamW8bit step.
// One thread block per quantization block of 256 values, one thread per value:
// the block's absmax is a block reduction, and the 256-entry quantization maps
// sit in shared memory, so quantizing is a binary search over their midpoints.
// The rounding rule (nearest entry, ties to the lower one) and the update's
// float arithmetic (same constants, same order, no FMA contraction: see
// src/cuda/CMakeLists.txt) match the CPU path of memscale::optim::AdamW8bit.
#include <memscale/cuda/kernels.hpp>

#include <cstdint>

namespace {

constexpr int block_size = memscale::cuda::quantization_block_size;
constexpr int map_size = 256;
constexpr int warps = block_size / 32;
static_assert(block_size % 32 == 0 && block_size >= map_size, "one thread loads one map entry");

/// The largest grid.x: ceil(count / block_size) blocks must fit.
constexpr std::int64_t max_blocks = 2147483647;

/// max that keeps a NaN (fmaxf would drop it): a NaN moment poisons its block's
/// absmax, as it poisons the parameter in fp32 AdamW, instead of vanishing.
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

/// Block-wide max of two values at once; every thread gets both results.
__device__ __forceinline__ float2 block_max2(float2 value) {
  __shared__ float2 partial[warps];
  for (int offset = 16; offset > 0; offset /= 2) {
    value.x = nan_max(value.x, __shfl_xor_sync(0xffffffffu, value.x, offset));
    value.y = nan_max(value.y, __shfl_xor_sync(0xffffffffu, value.y, offset));
  }
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  if (lane == 0) partial[warp] = value;
  __syncthreads();
  float2 result = partial[0];
  for (int w = 1; w < warps; ++w) {
    result.x = nan_max(result.x, partial[w].x);
    result.y = nan_max(result.y, partial[w].y);
  }
  return result;
}

/// Index of the map entry nearest to `x` (ties to the lower index): the number
/// of midpoints (map[k] + map[k + 1]) / 2 that are < x.
__device__ __forceinline__ unsigned char nearest_code(const float* map, float x) {
  int lo = 0;
  int hi = map_size - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    const float boundary = (map[mid] + map[mid + 1]) * 0.5f;
    if (boundary < x) lo = mid + 1;
    else hi = mid;
  }
  return static_cast<unsigned char>(lo);
}

__device__ __forceinline__ float normalized(float x, float absmax) { return absmax > 0.0f ? x / absmax : 0.0f; }

__global__ void quantize_kernel(const float* values, const float* quant_map, unsigned char* codes, float* absmax,
                                std::int64_t count) {
  __shared__ float map[map_size];
  map[threadIdx.x] = quant_map[threadIdx.x];
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * block_size + threadIdx.x;
  const float x = i < count ? values[i] : 0.0f;
  const float block_absmax = block_max2(make_float2(fabsf(x), 0.0f)).x;  // also publishes `map`
  if (threadIdx.x == 0) absmax[blockIdx.x] = block_absmax;
  if (i < count) codes[i] = nearest_code(map, normalized(x, block_absmax));
}

__global__ void dequantize_kernel(const unsigned char* codes, const float* absmax, const float* quant_map,
                                  float* values, std::int64_t count) {
  __shared__ float map[map_size];
  map[threadIdx.x] = quant_map[threadIdx.x];
  __syncthreads();
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * block_size + threadIdx.x;
  if (i < count) values[i] = map[codes[i]] * absmax[blockIdx.x];
}

__global__ void adamw8bit_kernel(float* params, const float* grads, unsigned char* m_codes, float* m_absmax,
                                 unsigned char* v_codes, float* v_absmax, const float* m_quant_map,
                                 const float* v_quant_map, std::int64_t count,
                                 memscale_adamw8bit_hyperparameters h) {
  __shared__ float m_map[map_size];
  __shared__ float v_map[map_size];
  m_map[threadIdx.x] = m_quant_map[threadIdx.x];
  v_map[threadIdx.x] = v_quant_map[threadIdx.x];
  __syncthreads();
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * block_size + threadIdx.x;
  const bool live = i < count;
  float m = 0.0f;
  float v = 0.0f;
  if (live) {
    const float g = grads[i];
    m = m_map[m_codes[i]] * m_absmax[blockIdx.x];
    v = v_map[v_codes[i]] * v_absmax[blockIdx.x];
    m = h.beta1 * m + h.one_minus_beta1 * g;
    v = h.beta2 * v + h.one_minus_beta2 * g * g;
    const float p = params[i] * h.decay;
    params[i] = p - h.step_size * (m / (sqrtf(v) / h.bias_correction2_sqrt + h.eps));
  }
  // Every thread has read its block's old absmax above; the reduction's barrier
  // orders those reads before thread 0 overwrites them.
  const float2 absmax = block_max2(make_float2(fabsf(m), v));
  if (threadIdx.x == 0) {
    m_absmax[blockIdx.x] = absmax.x;
    v_absmax[blockIdx.x] = absmax.y;
  }
  if (live) {
    m_codes[i] = nearest_code(m_map, normalized(m, absmax.x));
    v_codes[i] = nearest_code(v_map, normalized(v, absmax.y));
  }
}

/// Launches `kernel` with one thread block per quantization block of `count`
/// values, after the checks every entry point shares.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), std::int64_t count, bool pointers_set, cudaStream_t stream,
                   Args... args) {
  if (count == 0) return cudaSuccess;
  const std::int64_t blocks = (count + block_size - 1) / block_size;
  if (count < 0 || blocks > max_blocks || !pointers_set) return cudaErrorInvalidValue;
  kernel<<<static_cast<unsigned int>(blocks), block_size, 0, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t memscale_cuda_quantize_blockwise(const float* values, const float* quant_map,
                                                        unsigned char* codes, float* absmax, std::int64_t count,
                                                        cudaStream_t stream) {
  return launch(quantize_kernel, count, values && quant_map && codes && absmax, stream, values, quant_map, codes,
                absmax, count);
}

extern "C" cudaError_t memscale_cuda_dequantize_blockwise(const unsigned char* codes, const float* absmax,
                                                          const float* quant_map, float* values, std::int64_t count,
                                                          cudaStream_t stream) {
  return launch(dequantize_kernel, count, codes && absmax && quant_map && values, stream, codes, absmax, quant_map,
                values, count);
}

extern "C" cudaError_t memscale_cuda_adamw8bit_step(float* params, const float* grads, unsigned char* exp_avg_codes,
                                                    float* exp_avg_absmax, unsigned char* exp_avg_sq_codes,
                                                    float* exp_avg_sq_absmax, const float* exp_avg_map,
                                                    const float* exp_avg_sq_map, std::int64_t count,
                                                    memscale_adamw8bit_hyperparameters hyper, cudaStream_t stream) {
  const bool pointers_set = params && grads && exp_avg_codes && exp_avg_absmax && exp_avg_sq_codes &&
                            exp_avg_sq_absmax && exp_avg_map && exp_avg_sq_map;
  return launch(adamw8bit_kernel, count, pointers_set, stream, params, grads, exp_avg_codes, exp_avg_absmax,
                exp_avg_sq_codes, exp_avg_sq_absmax, exp_avg_map, exp_avg_sq_map, count, hyper);
}
