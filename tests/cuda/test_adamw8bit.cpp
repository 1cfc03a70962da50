// memscale::cuda's 8-bit kernels (block-wise quantize, dequantize, the fused
// AdamW8bit step), through their C interface only (no LibTorch). With a GPU:
// each kernel against a host reference on data with a partial last block, an
// all-zero block and magnitudes over many decades, bit for bit (the fused step
// runs the CPU path's float arithmetic, built without FMA contraction).
// Without one: argument errors and the missing device are reported, never success.
#include <memscale/cuda/kernels.hpp>

#include "check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

using kernel_test::check;
using kernel_test::failures;

constexpr int block = memscale::cuda::quantization_block_size;

/// A sorted 256-entry map like bitsandbytes' dynamic map (the kernels take any sorted map).
std::vector<float> dynamic_map(bool is_signed) {
  std::vector<double> values = {0.0, 1.0};
  for (int i = 0; i < 7; ++i) {
    const int intervals = is_signed ? 1 << i : 2 << i;
    for (int k = 0; k < intervals; ++k) {
      const double mean = 0.1 + 0.9 * (k + 0.5) / intervals;
      values.push_back(std::pow(10.0, i - 6) * mean);
      if (is_signed) values.push_back(-std::pow(10.0, i - 6) * mean);
    }
  }
  std::sort(values.begin(), values.end());
  return {values.begin(), values.end()};
}

/// Nearest entry, ties to the lower one: the number of midpoints below x.
unsigned char nearest(const std::vector<float>& map, float x) {
  unsigned char code = 0;
  for (std::size_t k = 0; k + 1 < map.size(); ++k)
    if ((map[k] + map[k + 1]) * 0.5f < x) code = static_cast<unsigned char>(k + 1);
  return code;
}

struct quantized {
  std::vector<unsigned char> codes;
  std::vector<float> absmax;
};

quantized quantize(const std::vector<float>& x, const std::vector<float>& map) {
  quantized q{std::vector<unsigned char>(x.size()), std::vector<float>((x.size() + block - 1) / block, 0.0f)};
  for (std::size_t i = 0; i < x.size(); ++i) q.absmax[i / block] = std::max(q.absmax[i / block], std::fabs(x[i]));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float a = q.absmax[i / block];
    q.codes[i] = nearest(map, a > 0.0f ? x[i] / a : 0.0f);
  }
  return q;
}

float dequantized(const quantized& q, const std::vector<float>& map, std::size_t i) {
  return map[q.codes[i]] * q.absmax[i / block];
}

/// Device buffers for one vector each; freed at scope end.
template <class T>
struct device_vector {
  T* data = nullptr;
  std::size_t size = 0;
  explicit device_vector(const std::vector<T>& host) : size(host.size()) {
    check(cudaMalloc(reinterpret_cast<void**>(&data), std::max<std::size_t>(size, 1) * sizeof(T)) == cudaSuccess,
          "cudaMalloc");
    check(cudaMemcpy(data, host.data(), size * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess, "upload");
  }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;
  ~device_vector() { cudaFree(data); }
  std::vector<T> download() const {
    std::vector<T> host(size);
    check(cudaMemcpy(host.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess, "download");
    return host;
  }
};

std::vector<float> test_values(std::size_t n, bool nonnegative, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng) * std::exp(3.0f * normal(rng));
  for (std::size_t i = block; i < std::min(n, std::size_t{2 * block}); ++i) x[i] = 0.0f;  // an all-zero block
  if (nonnegative)
    for (auto& v : x) v = std::fabs(v);
  return x;
}

void quantize_round_trip() {
  const std::size_t n = 7 * block + 101;
  for (bool is_signed : {true, false}) {
    const auto map = dynamic_map(is_signed);
    const auto x = test_values(n, !is_signed, 1);
    const auto expected = quantize(x, map);
    device_vector<float> values{x}, device_map{map}, absmax{std::vector<float>(expected.absmax.size())};
    device_vector<unsigned char> codes{std::vector<unsigned char>(n)};
    check(memscale_cuda_quantize_blockwise(values.data, device_map.data, codes.data, absmax.data,
                                           static_cast<std::int64_t>(n), nullptr) == cudaSuccess,
          "quantize launch");
    check(cudaDeviceSynchronize() == cudaSuccess, "quantize run");
    check(codes.download() == expected.codes, "quantize: codes equal the host reference");
    check(absmax.download() == expected.absmax, "quantize: absmax equals the host reference");
    device_vector<float> back{std::vector<float>(n)};
    check(memscale_cuda_dequantize_blockwise(codes.data, absmax.data, device_map.data, back.data,
                                             static_cast<std::int64_t>(n), nullptr) == cudaSuccess,
          "dequantize launch");
    check(cudaDeviceSynchronize() == cudaSuccess, "dequantize run");
    const auto result = back.download();
    bool exact = true;
    for (std::size_t i = 0; i < n; ++i) exact = exact && result[i] == dequantized(expected, map, i);
    check(exact, "dequantize: values equal map[code] * absmax");
  }
}

void fused_step() {
  const std::size_t n = 9 * block + 13;
  const auto m_map = dynamic_map(true);
  const auto v_map = dynamic_map(false);
  auto params = test_values(n, false, 2);
  for (auto& p : params) p = std::tanh(p);
  auto m = quantize(test_values(n, false, 3), m_map);
  auto v = quantize(test_values(n, true, 4), v_map);
  const auto grads = test_values(n, false, 5);
  device_vector<float> d_params(params), d_grads(grads), d_m_map(m_map), d_v_map(v_map), d_m_absmax(m.absmax),
      d_v_absmax(v.absmax);
  device_vector<unsigned char> d_m_codes(m.codes), d_v_codes(v.codes);
  const int step = 3;
  // As memscale::optim::AdamW8bit computes them: in double, rounded once.
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, weight_decay = 0.01;
  const memscale_adamw8bit_hyperparameters h{static_cast<float>(beta1),
                                             static_cast<float>(1 - beta1),
                                             static_cast<float>(beta2),
                                             static_cast<float>(1 - beta2),
                                             static_cast<float>(1 - lr * weight_decay),
                                             static_cast<float>(lr / (1 - std::pow(beta1, step))),
                                             static_cast<float>(std::sqrt(1 - std::pow(beta2, step))),
                                             1e-8f};
  check(memscale_cuda_adamw8bit_step(d_params.data, d_grads.data, d_m_codes.data, d_m_absmax.data, d_v_codes.data,
                                     d_v_absmax.data, d_m_map.data, d_v_map.data, static_cast<std::int64_t>(n), h,
                                     nullptr) == cudaSuccess,
        "step launch");
  check(cudaDeviceSynchronize() == cudaSuccess, "step run");
  // Host reference: the same float arithmetic, so everything must match bit for bit.
  std::vector<float> m_new(n), v_new(n);
  bool params_close = true;
  const auto result = d_params.download();
  for (std::size_t i = 0; i < n; ++i) {
    // The kernel's float arithmetic, in the same order (it is built without FMA).
    const float g = grads[i];
    const float mi = h.beta1 * dequantized(m, m_map, i) + h.one_minus_beta1 * g;
    const float vi = h.beta2 * dequantized(v, v_map, i) + h.one_minus_beta2 * g * g;
    m_new[i] = mi;
    v_new[i] = vi;
    const float p = params[i] * h.decay - h.step_size * (mi / (std::sqrt(vi) / h.bias_correction2_sqrt + h.eps));
    params_close = params_close && result[i] == p;
  }
  check(params_close, "step: parameters equal the host reference bit for bit");
  const auto m_expected = quantize(m_new, m_map);
  const auto v_expected = quantize(v_new, v_map);
  check(d_m_codes.download() == m_expected.codes, "step: exp_avg codes equal the host reference");
  check(d_v_codes.download() == v_expected.codes, "step: exp_avg_sq codes equal the host reference");
  check(d_m_absmax.download() == m_expected.absmax, "step: exp_avg absmax equals the host reference");
  check(d_v_absmax.download() == v_expected.absmax, "step: exp_avg_sq absmax equals the host reference");
}

}  // namespace

int main() {
  const memscale_adamw8bit_hyperparameters h{0.9f, 0.1f, 0.999f, 0.001f, 1.0f, 0.01f, 0.03f, 1e-8f};
  check(memscale_cuda_quantize_blockwise(nullptr, nullptr, nullptr, nullptr, 0, nullptr) == cudaSuccess,
        "quantizing nothing is a no-op");
  check(memscale_cuda_dequantize_blockwise(nullptr, nullptr, nullptr, nullptr, 0, nullptr) == cudaSuccess,
        "dequantizing nothing is a no-op");
  check(memscale_cuda_adamw8bit_step(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, h,
                                     nullptr) == cudaSuccess,
        "a step over nothing is a no-op");
  check(memscale_cuda_quantize_blockwise(nullptr, nullptr, nullptr, nullptr, 10, nullptr) == cudaErrorInvalidValue,
        "null pointers are refused");
  check(memscale_cuda_adamw8bit_step(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 10, h,
                                     nullptr) == cudaErrorInvalidValue,
        "null pointers are refused by the step");
  float* fake = reinterpret_cast<float*>(std::uintptr_t{256});
  auto* fake_codes = reinterpret_cast<unsigned char*>(fake);
  check(memscale_cuda_dequantize_blockwise(fake_codes, fake, fake, fake, -1, nullptr) == cudaErrorInvalidValue,
        "a negative count is refused");
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    check(memscale_cuda_quantize_blockwise(fake, fake, fake_codes, fake, 10, nullptr) != cudaSuccess,
          "a launch without a GPU reports an error");
    check(memscale_cuda_adamw8bit_step(fake, fake, fake_codes, fake, fake_codes, fake, fake, fake, 10, h, nullptr) !=
              cudaSuccess,
          "a step without a GPU reports an error");
    std::printf("no CUDA device: checked the error paths; the kernel checks need a GPU\n");
  } else {
    quantize_round_trip();
    fused_step();
    std::printf("8-bit quantize, dequantize and fused AdamW step on the GPU: %s\n", failures == 0 ? "ok" : "FAILED");
  }
  return failures == 0 ? 0 : 1;
}
