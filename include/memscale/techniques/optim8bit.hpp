// memscale — the 8-bit optimizer technique: AdamW whose two moments are stored
// block-wise quantized to one byte per value (about 2.03 bytes of state per
// parameter instead of fp32 AdamW's 8), as a torch::optim::Optimizer. Config's
// use_8bit_optimizer picks it through make_optimizer(); the planner budgets
// optimizer state with optimizer_state_bytes().
//
// Storage: both moments block-wise 8-bit (techniques/quantization.hpp: blocks
// of 256 values with an fp32 absmax each, bitsandbytes' dynamic tree maps,
// signed for exp_avg and unsigned for exp_avg_sq), except that tensors with
// fewer than min_8bit_size (4096) elements keep fp32 moments and update
// exactly as torch::optim::AdamW does: their state is small, and biases and
// norms are where quantization error hurts most.
// Parameters are float32, float16 or bfloat16; the update runs in fp32 and is
// written back in the parameter's dtype, and moments are fp32 or 8-bit for all.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/memory_tracker.hpp>  // MEMSCALE_HAS_CUDA()
#include <memscale/errors.hpp>
#include <memscale/techniques/quantization.hpp>

#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memscale/cuda/kernels.hpp>
#endif

namespace memscale {
namespace optim {


/// Bytes of AdamW state for a tensor of `numel` elements: fp32 moments (8 per
/// element), or with `eight_bit` and numel >= min_8bit_size, one byte per
/// moment per element plus one fp32 absmax per block per moment.
[[nodiscard]] constexpr std::int64_t optimizer_state_bytes(std::int64_t numel, bool eight_bit,
                                                           std::int64_t min_8bit_size = 4096) noexcept {
  if (!eight_bit || numel < min_8bit_size) return 8 * numel;
  const auto blocks = (numel + quantization_block_size - 1) / quantization_block_size;
  return 2 * numel + 2 * 4 * blocks;
}

/// What the planner assumes per parameter: 8 bytes for fp32 AdamW, 2 + 8/256
/// for AdamW8bit (the fp32 state of small tensors is left out: it is a few
/// percent of a model at most).
[[nodiscard]] constexpr double optimizer_state_bytes_per_parameter(bool eight_bit) noexcept {
  return eight_bit ? 2.0 + 8.0 / static_cast<double>(quantization_block_size) : 8.0;
}


/// The key of torch::optim::Optimizer::state() (any optimizer's): LibTorch 1.13
/// keys it by the parameter's TensorImpl address as a string, 2.x by the address.
using state_key_type =
    typename std::remove_cvref_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <class Key = state_key_type>
[[nodiscard]] Key state_key(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;  // what 1.13's c10::guts::to_string(TensorImpl*) writes
    os << static_cast<const void*>(p.unsafeGetTensorImpl());
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}


/// AdamW8bit's hyperparameters, spelled as torch::optim::AdamWOptions (no amsgrad).
/// Constructible from a learning rate, as torch::optim's serialization requires.
struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  AdamW8bitOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT(google-explicit-constructor): as AdamWOptions
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  /// Tensors with fewer elements keep fp32 moments (bitsandbytes' default threshold).
  TORCH_ARG(std::int64_t, min_8bit_size) = 4096;

 public:
  /// Throws memscale::Error naming the first field outside its valid range
  /// (as a member of `owner`, the type the caller filled in).
  void validate(const std::string& owner = "memscale::optim::AdamW8bitOptions") const {
    const auto fail = [&](const std::string& field, const std::string& valid, double got) {
      std::ostringstream os;
      os << owner << "::" << field << " must be " << valid << ", got " << got;
      throw Error(os.str());
    };
    if (!(std::isfinite(lr()) && lr() >= 0.0)) fail("lr", "a finite number >= 0", lr());
    if (!(std::get<0>(betas()) >= 0.0 && std::get<0>(betas()) < 1.0)) fail("betas[0]", "in [0, 1)", std::get<0>(betas()));
    if (!(std::get<1>(betas()) >= 0.0 && std::get<1>(betas()) < 1.0)) fail("betas[1]", "in [0, 1)", std::get<1>(betas()));
    if (!(std::isfinite(eps()) && eps() >= 0.0)) fail("eps", "a finite number >= 0", eps());
    if (!(std::isfinite(weight_decay()) && weight_decay() >= 0.0))
      fail("weight_decay", "a finite number >= 0", weight_decay());
    if (min_8bit_size() < 0) fail("min_8bit_size", ">= 0 (elements)", static_cast<double>(min_8bit_size()));
  }

  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(min_8bit_size);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(std::int64_t, min_8bit_size);
  }
  [[nodiscard]] double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }

  friend bool operator==(const AdamW8bitOptions& a, const AdamW8bitOptions& b) {
    return a.lr() == b.lr() && a.betas() == b.betas() && a.eps() == b.eps() &&
           a.weight_decay() == b.weight_decay() && a.min_8bit_size() == b.min_8bit_size();
  }
};

/// One parameter's state: the step count and either fp32 moments (exp_avg,
/// exp_avg_sq, shaped like the parameter) or 8-bit ones (flat uint8 codes and
/// one float absmax per block, for each moment). The form is chosen when the
/// state is created and kept, also across save/load.
struct AdamW8bitParamState : public torch::optim::OptimizerCloneableParamState<AdamW8bitParamState> {
  TORCH_ARG(std::int64_t, step) = 0;
  TORCH_ARG(torch::Tensor, exp_avg);
  TORCH_ARG(torch::Tensor, exp_avg_sq);
  TORCH_ARG(torch::Tensor, exp_avg_codes);
  TORCH_ARG(torch::Tensor, exp_avg_absmax);
  TORCH_ARG(torch::Tensor, exp_avg_sq_codes);
  TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);

 public:
  [[nodiscard]] bool quantized() const { return exp_avg_codes().defined(); }

  /// Bytes held by this state's tensors.
  [[nodiscard]] std::int64_t bytes() const {
    std::int64_t total = 0;
    for (const auto* t : {&exp_avg(), &exp_avg_sq(), &exp_avg_codes(), &exp_avg_absmax(), &exp_avg_sq_codes(),
                          &exp_avg_sq_absmax()})
      if (t->defined()) total += static_cast<std::int64_t>(t->nbytes());
    return total;
  }

  // Undefined tensors are skipped on save and left undefined on load.
  void serialize(torch::serialize::OutputArchive& archive) const override {
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_codes);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_absmax);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_codes);
    _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq_absmax);
  }
  void serialize(torch::serialize::InputArchive& archive) override {
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(std::int64_t, step);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_codes);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_absmax);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq_codes);
    _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(torch::Tensor, exp_avg_sq_absmax);
  }
};

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

/// AdamW with 8-bit block-wise quantized moments; a drop-in torch::optim::Optimizer
/// (param groups, zero_grad, torch::save/torch::load). On CUDA parameters it
/// runs memscale::cuda's fused kernel when that target is linked (contiguous
/// float32 parameters), ATen ops otherwise.
class AdamW8bit : public torch::optim::Optimizer {
 public:
  explicit AdamW8bit(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamW8bitOptions defaults = {})
      : torch::optim::Optimizer(std::move(param_groups), checked(std::move(defaults))) {
    for (const auto& group : param_groups_) {
      const auto* options = dynamic_cast<const AdamW8bitOptions*>(&group.options());
      if (options == nullptr)
        throw Error("memscale::optim::AdamW8bit: a param group's options must be AdamW8bitOptions");
      options->validate();
    }
  }
  explicit AdamW8bit(std::vector<torch::Tensor> params, AdamW8bitOptions defaults = {})
      : AdamW8bit(std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup(std::move(params))},
                  std::move(defaults)) {}

  /// One AdamW step for every parameter with a gradient (parameters without one
  /// are skipped, as torch::optim::AdamW does). Checks every gradient first: a
  /// sparse gradient or an unsupported dtype throws before anything changes.
  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    // Everything that can be refused is checked before any parameter changes.
    for (const auto& group : param_groups_) {
      if (dynamic_cast<const AdamW8bitOptions*>(&group.options()) == nullptr)
        throw Error("memscale::optim::AdamW8bit: a param group's options are not AdamW8bitOptions; add groups "
                    "with memscale::optim::AdamW8bitOptions");
      for (const auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        check_parameter(p);
        if (const auto it = state_.find(state_key(p)); it != state_.end() && it->second)
          check_state(p, static_cast<const AdamW8bitParamState&>(*it->second));
      }
    }
    for (auto& group : param_groups_) {
      const auto& options = static_cast<const AdamW8bitOptions&>(group.options());
      for (auto& p : group.params())
        if (p.grad().defined()) update(p, options);
    }
    return loss;
  }

  void save(torch::serialize::OutputArchive& archive) const override {
    torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::serialize<AdamW8bitParamState, AdamW8bitOptions>(archive, *this);
  }

  /// The state of `p`, or nullptr before its first step.
  [[nodiscard]] const AdamW8bitParamState* state_of(const torch::Tensor& p) const {
    const auto it = state_.find(state_key(p));
    return it == state_.end() ? nullptr : static_cast<const AdamW8bitParamState*>(it->second.get());
  }

  /// Bytes of all parameters' state tensors.
  [[nodiscard]] std::int64_t state_bytes() const {
    std::int64_t total = 0;
    for (const auto& item : state_) total += static_cast<const AdamW8bitParamState&>(*item.second).bytes();
    return total;
  }

 private:
  static std::unique_ptr<AdamW8bitOptions> checked(AdamW8bitOptions options) {
    options.validate();
    return std::make_unique<AdamW8bitOptions>(std::move(options));
  }

  static void check_parameter(const torch::Tensor& p) {
    if (p.grad().is_sparse())
      throw Error("memscale::optim::AdamW8bit: sparse gradients are not supported (parameter of shape " +
                  c10::str(p.sizes()) + "); use dense gradients");
    const auto dtype = p.scalar_type();
    if (dtype != torch::kFloat && dtype != torch::kHalf && dtype != torch::kBFloat16)
      throw Error(std::string("memscale::optim::AdamW8bit: parameters must be float32, float16 or bfloat16, got ") +
                  c10::toString(dtype));
  }

  AdamW8bitParamState& state_for(const torch::Tensor& p, const AdamW8bitOptions& options) {
    auto& slot = state_[state_key(p)];
    if (!slot) {
      auto state = std::make_unique<AdamW8bitParamState>();
      const auto n = p.numel();
      const auto fp32 = p.options().dtype(torch::kFloat);
      if (n < options.min_8bit_size()) {
        state->exp_avg(torch::zeros_like(p, fp32, torch::MemoryFormat::Preserve));
        state->exp_avg_sq(torch::zeros_like(p, fp32, torch::MemoryFormat::Preserve));
      } else {
        const auto blocks = (n + quantization_block_size - 1) / quantization_block_size;
        const auto bytes = p.options().dtype(torch::kByte);
        state->exp_avg_codes(torch::full({n}, zero_code(true), bytes));
        state->exp_avg_absmax(torch::zeros({blocks}, fp32));
        state->exp_avg_sq_codes(torch::full({n}, zero_code(false), bytes));
        state->exp_avg_sq_absmax(torch::zeros({blocks}, fp32));
      }
      slot = std::move(state);
    }
    auto& state = static_cast<AdamW8bitParamState&>(*slot);
    check_state(p, state);
    return state;
  }

  /// A loaded state must fit its parameter.
  static void check_state(const torch::Tensor& p, const AdamW8bitParamState& s) {
    const auto n = p.numel();
    const auto blocks = (n + quantization_block_size - 1) / quantization_block_size;
    const auto flat = [&](const torch::Tensor& t, std::int64_t numel) {
      return t.defined() && t.numel() == numel && t.device() == p.device() && t.is_contiguous();
    };
    const auto like_p = [&](const torch::Tensor& t) {
      return t.defined() && t.sizes() == p.sizes() && t.device() == p.device();
    };
    const bool ok = s.quantized() ? flat(s.exp_avg_codes(), n) && flat(s.exp_avg_sq_codes(), n) &&
                                        flat(s.exp_avg_absmax(), blocks) && flat(s.exp_avg_sq_absmax(), blocks)
                                  : like_p(s.exp_avg()) && like_p(s.exp_avg_sq());
    if (!ok)
      throw Error("memscale::optim::AdamW8bit: the state of a parameter of shape " + c10::str(p.sizes()) + " on " +
                  p.device().str() + " does not fit it (a state loaded for other parameters, or another device?)");
  }

  void update(torch::Tensor& p, const AdamW8bitOptions& options) {
    auto& state = state_for(p, options);
    state.step(state.step() + 1);
    const double beta1 = std::get<0>(options.betas());
    const double beta2 = std::get<1>(options.betas());
    const double bias_correction1 = 1 - std::pow(beta1, state.step());
    const double bias_correction2 = 1 - std::pow(beta2, state.step());
    if (!state.quantized()) {
      fp32_update(p, state, options, bias_correction1, bias_correction2);
      return;
    }
    if (fused_cuda_update(p, state, options, bias_correction1, bias_correction2)) return;
    quantized_update(p, state, options, bias_correction1, bias_correction2);
  }

  /// torch::optim::AdamW's update, op for op (bit-identical for float32 parameters).
  static void fp32_update(torch::Tensor& p, AdamW8bitParamState& s, const AdamW8bitOptions& o, double bc1,
                          double bc2) {
    const bool in_place = p.scalar_type() == torch::kFloat;
    auto work = in_place ? p : p.to(torch::kFloat);
    detail::adamw_update(work, p.grad().to(torch::kFloat), s.exp_avg(), s.exp_avg_sq(), o, bc1, bc2);
    if (!in_place) p.copy_(work);
  }

  /// The 8-bit update without the CUDA kernel: a fused loop on the CPU, ATen
  /// ops elsewhere; on a contiguous copy for a non-contiguous parameter.
  void quantized_update(torch::Tensor& p, AdamW8bitParamState& s, const AdamW8bitOptions& o, double bc1,
                        double bc2) {
    const bool direct = p.is_contiguous();
    auto flat = direct ? p.view({-1}) : p.contiguous().view({-1});
    if (p.is_cpu()) detail::quantized_update_cpu(flat, p.grad().reshape({-1}), s, o, bc1, bc2);
    else detail::quantized_update_aten(flat, p.grad().reshape({-1}), s, o, bc1, bc2, tables_for(p.device()));
    if (!direct) p.copy_(flat.view_as(p));
  }

  /// memscale::cuda's fused step for contiguous float32 CUDA parameters; false
  /// when it does not apply or could not launch (nothing ran then).
  bool fused_cuda_update(torch::Tensor& p, AdamW8bitParamState& s, const AdamW8bitOptions& o, double bc1,
                         double bc2) {
#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
    static_assert(memscale::cuda::quantization_block_size == quantization_block_size);
    if (!p.is_cuda() || p.scalar_type() != torch::kFloat || !p.is_contiguous()) return false;
    c10::cuda::CUDAGuard on_device(p.device());
    const auto grad = p.grad().to(torch::kFloat).contiguous();
    const auto& tables = tables_for(p.device());
    const auto c = detail::step_constants(o, bc1, bc2);
    const memscale_adamw8bit_hyperparameters hyper{c.beta1,     c.one_minus_beta1, c.beta2,
                                                   c.one_minus_beta2, c.decay,     c.step_size,
                                                   c.bias_correction2_sqrt, c.eps};
    const auto status = memscale_cuda_adamw8bit_step(
        p.data_ptr<float>(), grad.data_ptr<float>(), s.exp_avg_codes().data_ptr<std::uint8_t>(),
        s.exp_avg_absmax().data_ptr<float>(), s.exp_avg_sq_codes().data_ptr<std::uint8_t>(),
        s.exp_avg_sq_absmax().data_ptr<float>(), tables.map[true].data_ptr<float>(),
        tables.map[false].data_ptr<float>(), p.numel(), hyper,
        c10::cuda::getCurrentCUDAStream(p.device().index()).stream());
    if (status != cudaSuccess) {
      cudaGetLastError();  // a launch error: nothing ran, the ATen path takes over
      return false;
    }
    return true;
#else
    (void)p;
    (void)s;
    (void)o;
    (void)bc1;
    (void)bc2;
    return false;
#endif
  }

  /// Quantization tables on `device`, copied there once.
  const detail::quant_tables& tables_for(c10::Device device) {
    for (const auto& [where, tables] : device_tables_)
      if (where == device) return tables;
    device_tables_.emplace_back(device, detail::tables_on(device));
    return device_tables_.back().second;
  }

  std::vector<std::pair<c10::Device, detail::quant_tables>> device_tables_;
};

}  // namespace optim

/// Hyperparameters shared by both optimizers make_optimizer() builds.
struct optimizer_options {
  double lr = 1e-3;
  std::tuple<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

/// The optimizer Config asks for: memscale::optim::AdamW8bit when
/// config.use_8bit_optimizer, torch::optim::AdamW otherwise, with the same
/// hyperparameters. Throws memscale::Error for hyperparameters out of range.
[[nodiscard]] inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& config,
                                                                             std::vector<torch::Tensor> params,
                                                                             const optimizer_options& options = {}) {
  auto eight_bit = optim::AdamW8bitOptions(options.lr).betas(options.betas).eps(options.eps).weight_decay(
      options.weight_decay);
  eight_bit.validate("memscale::optimizer_options");
  if (config.use_8bit_optimizer) return std::make_unique<optim::AdamW8bit>(std::move(params), eight_bit);
  return std::make_unique<torch::optim::AdamW>(
      std::move(params),
      torch::optim::AdamWOptions(options.lr).betas(options.betas).eps(options.eps).weight_decay(options.weight_decay));
}

}  // namespace memscale
