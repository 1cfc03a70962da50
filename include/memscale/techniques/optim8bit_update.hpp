// memscale — the update rules AdamW8bit runs (internal, memscale::optim::detail):
// torch::optim::AdamW's fp32 update, the 8-bit update in ATen ops (any device)
// and the fused 8-bit loop on the CPU. The CUDA kernel's dispatch lives in the
// optimizer (techniques/optim8bit_adamw.hpp); it shares step_constants().
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <memscale/errors.hpp>
#include <memscale/techniques/optim8bit_state.hpp>
#include <memscale/techniques/quantization.hpp>

namespace memscale {
namespace optim {

namespace detail {
// Internal: the update rules AdamW8bit runs, free functions so tests can compare them.

/// torch::optim::AdamW's update (1.13 and 2.x), op for op.
inline void adamw_update(torch::Tensor& p, const torch::Tensor& grad, torch::Tensor& exp_avg,
                         torch::Tensor& exp_avg_sq, const AdamW8bitOptions& o, double bc1, double bc2) {
  const double beta1 = std::get<0>(o.betas());
  const double beta2 = std::get<1>(o.betas());
  if (o.weight_decay() != 0) p.mul_(1 - o.lr() * o.weight_decay());
  exp_avg.mul_(beta1).add_(grad, 1 - beta1);
  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2);
  const auto denom = (exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(o.eps());
  p.addcdiv_(exp_avg, denom, -(o.lr() / bc1));
}

/// The 8-bit update in ATen ops (any device), a chunk of blocks at a time so
/// that the fp32 moments it materializes stay under 2 x 4 MiB.
inline void quantized_update_aten(torch::Tensor flat, const torch::Tensor& grad, AdamW8bitParamState& s,
                                  const AdamW8bitOptions& o, double bc1, double bc2, const quant_tables& tables) {
  constexpr std::int64_t chunk = quantization_block_size * 4096;
  const auto n = flat.numel();
  for (std::int64_t start = 0; start < n; start += chunk) {
    const auto len = std::min(chunk, n - start);
    const auto first_block = start / quantization_block_size;
    const auto blocks = (len + quantization_block_size - 1) / quantization_block_size;
    auto m_codes = s.exp_avg_codes().narrow(0, start, len);
    auto v_codes = s.exp_avg_sq_codes().narrow(0, start, len);
    auto m_absmax = s.exp_avg_absmax().narrow(0, first_block, blocks);
    auto v_absmax = s.exp_avg_sq_absmax().narrow(0, first_block, blocks);
    auto m = dequantize(m_codes, m_absmax, tables.map[true]);
    auto v = dequantize(v_codes, v_absmax, tables.map[false]);
    auto target = flat.narrow(0, start, len);
    auto work = target.scalar_type() == torch::kFloat ? target : target.to(torch::kFloat);
    adamw_update(work, grad.narrow(0, start, len).to(torch::kFloat), m, v, o, bc1, bc2);
    if (!work.is_same(target)) target.copy_(work);
    quantize_into(m, tables.midpoints[true], m_codes, m_absmax);
    quantize_into(v, tables.midpoints[false], v_codes, v_absmax);
  }
}


/// max that keeps a NaN, as torch::amax does.
inline float nan_max(float a, float b) { return (a > b || std::isnan(a)) ? a : b; }

/// The float constants of one quantized step, each computed in double and
/// rounded once; memscale::cuda's kernel gets the same ones.
struct step_constants_t {
  float beta1, one_minus_beta1, beta2, one_minus_beta2, decay, step_size, bias_correction2_sqrt, eps;
};
inline step_constants_t step_constants(const AdamW8bitOptions& o, double bc1, double bc2) {
  const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
  return {static_cast<float>(beta1),        static_cast<float>(1 - beta1),
          static_cast<float>(beta2),        static_cast<float>(1 - beta2),
          static_cast<float>(1 - o.lr() * o.weight_decay()), static_cast<float>(o.lr() / bc1),
          static_cast<float>(std::sqrt(bc2)), static_cast<float>(o.eps())};
}

/// One pass per block, as memscale::cuda's kernel: dequantize, update, absmax,
/// re-quantize, with the block's fp32 moments on the stack.
template <class Scalar, class Grad>
void quantized_update_loop(Scalar* param, const Grad* grad, AdamW8bitParamState& s, const AdamW8bitOptions& o,
                           double bc1, double bc2, std::int64_t n) {
  const auto& m_map = dynamic_map(true);
  const auto& v_map = dynamic_map(false);
  const auto& m_lookup = lookup(true);
  const auto& v_lookup = lookup(false);
  auto* m_codes = s.exp_avg_codes().data_ptr<std::uint8_t>();
  auto* v_codes = s.exp_avg_sq_codes().data_ptr<std::uint8_t>();
  auto* m_absmax = s.exp_avg_absmax().data_ptr<float>();
  auto* v_absmax = s.exp_avg_sq_absmax().data_ptr<float>();
  const auto c = step_constants(o, bc1, bc2);
  const float b1 = c.beta1, one_minus_b1 = c.one_minus_beta1, b2 = c.beta2, one_minus_b2 = c.one_minus_beta2;
  const float decay = c.decay, step_size = c.step_size, bc2_sqrt = c.bias_correction2_sqrt, eps = c.eps;
  const auto blocks = (n + quantization_block_size - 1) / quantization_block_size;
  at::parallel_for(0, blocks, 16, [&](std::int64_t begin, std::int64_t end) {
    std::array<float, quantization_block_size> m{}, v{};
    for (auto b = begin; b < end; ++b) {
      const auto first = b * quantization_block_size;
      const auto count = std::min(quantization_block_size, n - first);
      float m_max = 0.0f, v_max = 0.0f;
      for (std::int64_t k = 0; k < count; ++k) {
        const auto i = first + k;
        const auto g = static_cast<float>(grad[i]);
        m[k] = b1 * (m_map[m_codes[i]] * m_absmax[b]) + one_minus_b1 * g;
        v[k] = b2 * (v_map[v_codes[i]] * v_absmax[b]) + one_minus_b2 * g * g;
        const float p = static_cast<float>(param[i]) * decay;
        param[i] = static_cast<Scalar>(p - step_size * (m[k] / (std::sqrt(v[k]) / bc2_sqrt + eps)));
        m_max = nan_max(m_max, std::fabs(m[k]));
        v_max = nan_max(v_max, v[k]);
      }
      m_absmax[b] = m_max;
      v_absmax[b] = v_max;
      for (std::int64_t k = 0; k < count; ++k) {
        m_codes[first + k] = nearest_code(m_lookup, m_max > 0.0f ? m[k] / m_max : 0.0f);
        v_codes[first + k] = nearest_code(v_lookup, v_max > 0.0f ? v[k] / v_max : 0.0f);
      }
    }
  });
}

/// The 8-bit update on the CPU: `flat` contiguous, float32, float16 or bfloat16;
/// a float32 gradient is read as it is, any other in the parameter's dtype.
inline void quantized_update_cpu(torch::Tensor flat, const torch::Tensor& grad, AdamW8bitParamState& s,
                                 const AdamW8bitOptions& o, double bc1, double bc2) {
  const auto run = [&](auto* param) {
    using scalar = std::remove_pointer_t<decltype(param)>;
    if (grad.scalar_type() == torch::kFloat) {
      const auto g = grad.contiguous();
      quantized_update_loop(param, g.data_ptr<float>(), s, o, bc1, bc2, flat.numel());
    } else {
      const auto g = grad.to(flat.scalar_type()).contiguous();
      quantized_update_loop(param, g.template data_ptr<scalar>(), s, o, bc1, bc2, flat.numel());
    }
  };
  switch (flat.scalar_type()) {
    case torch::kFloat: run(flat.data_ptr<float>()); break;
    case torch::kHalf: run(flat.data_ptr<c10::Half>()); break;
    case torch::kBFloat16: run(flat.data_ptr<c10::BFloat16>()); break;
    default:
      throw Error(std::string("memscale::optim::AdamW8bit: no 8-bit update for ") + c10::toString(flat.scalar_type()));
  }
}

}  // namespace detail

}  // namespace optim
}  // namespace memscale
