// memscale — the optimizer itself: memscale::optim::AdamW8bit (state creation and
// checks, the step, the dispatch to memscale::cuda's fused kernel) and
// make_optimizer(), which picks it or torch::optim::AdamW from Config.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/config.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/device/memory_tracker.hpp>  // MEMSCALE_HAS_CUDA()
#include <memscale/errors.hpp>
#include <memscale/techniques/optim8bit_state.hpp>
#include <memscale/techniques/optim8bit_update.hpp>
#include <memscale/techniques/quantization.hpp>

#if MEMSCALE_HAS_CUDA() && defined(MEMSCALE_WITH_CUDA_KERNELS)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <memscale/cuda/kernels.hpp>
#endif

namespace memscale {
namespace optim {

/// AdamW with 8-bit block-wise quantized moments; a drop-in torch::optim::Optimizer
/// (param groups, zero_grad, torch::save/torch::load). On CUDA parameters it
/// runs memscale::cuda's fused kernel when that target is linked (contiguous
/// float32 parameters), ATen ops otherwise.
class AdamW8bit : public torch::optim::Optimizer {
 public:
  /// A group's own options replace the defaults whole, as in LibTorch 1.13 (no
  /// field-by-field inheritance).
  explicit AdamW8bit(std::vector<torch::optim::OptimizerParamGroup> param_groups, AdamW8bitOptions defaults = {})
      : torch::optim::Optimizer(checked(param_groups, defaults), std::make_unique<AdamW8bitOptions>(defaults)) {
    // The base constructor added one group per element, in order. LibTorch 2.x's
    // add_param_group keeps a group's own options only for its built-in option
    // types and gives any other group (AdamW8bitOptions) a copy of the defaults;
    // put the group's own options back (1.13 cloned them: the same values).
    TORCH_INTERNAL_ASSERT(param_groups_.size() == param_groups.size());
    for (std::size_t i = 0; i < param_groups.size(); ++i) keep_own_options(param_groups_[i], param_groups[i]);
    own_groups_ = param_groups_.size();
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
#if TORCH_VERSION_MAJOR >= 2
    if (param_groups_.size() != own_groups_)
      throw Error("memscale::optim::AdamW8bit: a param group was added through torch::optim::Optimizer::"
                  "add_param_group (a base-class pointer or reference, as make_optimizer returns), which on "
                  "LibTorch 2.x replaces a group's AdamW8bitOptions with the defaults; add it through the "
                  "AdamW8bit itself: static_cast<memscale::optim::AdamW8bit&>(*optimizer).add_param_group(group)");
#endif
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
    // Past the checks, an error (an allocation failure) leaves the parameters
    // updated so far updated, each with its state, as torch::optim's own do.
    for (auto& group : param_groups_) {
      const auto& options = static_cast<const AdamW8bitOptions&>(group.options());
      for (auto& p : group.params())
        if (p.grad().defined()) {
          update(p, options);
          memscale::detail::fault_point(memscale::detail::pipeline_stage::optimizer_step);
        }
    }
    return loss;
  }

  /// Optimizer::add_param_group (not virtual: this one runs when called on an
  /// AdamW8bit), with the group's options checked and kept as given.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
    check_group(param_group);
    torch::optim::Optimizer::add_param_group(param_group);
    keep_own_options(param_groups_.back(), param_group);
    ++own_groups_;
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
  std::size_t own_groups_ = 0;  ///< groups added by this class's constructor and add_param_group

  /// A group's own options, when it has any, must be valid AdamW8bitOptions.
  static void check_group(const torch::optim::OptimizerParamGroup& group) {
    if (!group.has_options()) return;  // it gets the (checked) defaults
    const auto* options = dynamic_cast<const AdamW8bitOptions*>(&group.options());
    if (options == nullptr)
      throw Error("memscale::optim::AdamW8bit: a param group's options must be AdamW8bitOptions");
    options->validate();
  }

  /// Checks `defaults`, then every group's options, before the base class sees them.
  static const std::vector<torch::optim::OptimizerParamGroup>& checked(
      const std::vector<torch::optim::OptimizerParamGroup>& groups, const AdamW8bitOptions& defaults) {
    defaults.validate();
    for (const auto& group : groups) check_group(group);
    return groups;
  }

  /// `added` (the group the base class stored for `given`) gets `given`'s own options.
  static void keep_own_options(torch::optim::OptimizerParamGroup& added,
                               const torch::optim::OptimizerParamGroup& given) {
    if (given.has_options())
      added.set_options(std::make_unique<AdamW8bitOptions>(static_cast<const AdamW8bitOptions&>(given.options())));
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
