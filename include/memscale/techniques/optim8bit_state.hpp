// memscale — AdamW8bit's hyperparameters (AdamW8bitOptions) and per-parameter
// state (AdamW8bitParamState), with the state-size arithmetic the planner uses
// (optimizer_state_bytes) and the key torch::optim::Optimizer files state under.
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

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <memscale/errors.hpp>
#include <memscale/techniques/quantization.hpp>

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

}  // namespace optim
}  // namespace memscale
