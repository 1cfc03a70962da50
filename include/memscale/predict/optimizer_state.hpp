// memscale::predict — what an optimizer holds and what its step allocates,
// from its type and options: torch::optim SGD (with or without momentum), Adam,
// AdamW, Adagrad, RMSprop, and memscale::optim::AdamW8bit. The state is sized
// from the options (what each step() keeps per parameter); the step's transient
// bytes are measured on a shadow optimizer of the same type and options over a
// copy of the group's largest parameter (LibTorch's C++ optimizers update one
// parameter at a time, so the largest one bounds the temporaries). The user's
// optimizer is only read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <typeinfo>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

#include <memscale/detail/format.hpp>
#include <memscale/errors.hpp>
#include <memscale/predict/timeline.hpp>
#include <memscale/techniques/optim8bit.hpp>

namespace memscale::predictor {

/// The optimizer types predict() can size, by name.
inline constexpr const char* supported_optimizers =
    "torch::optim::SGD, Adam, AdamW, Adagrad, RMSprop, or memscale::optim::AdamW8bit";

/// How one optimizer sizes: its name, its state bytes for one parameter under a
/// group's options, and a shadow optimizer of the same type and options.
struct optimizer_sizing {
  std::string name;
  std::function<std::int64_t(const torch::Tensor& parameter, const torch::optim::OptimizerOptions& options)>
      state_bytes;
  std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor> parameters,
                                                         const torch::optim::OptimizerOptions& options)>
      shadow;
};

namespace detail {

template <class Optimizer, class Options>
std::unique_ptr<torch::optim::Optimizer> shadow_of(std::vector<torch::Tensor> parameters,
                                                   const torch::optim::OptimizerOptions& options) {
  return std::make_unique<Optimizer>(std::move(parameters), static_cast<const Options&>(options));
}

inline std::int64_t bytes_of(const torch::Tensor& p) { return static_cast<std::int64_t>(p.nbytes()); }

/// AdamWOptions as AdamW8bitOptions (Config::use_8bit_optimizer's optimizer).
inline optim::AdamW8bitOptions as_eight_bit(const torch::optim::OptimizerOptions& options) {
  const auto& o = static_cast<const torch::optim::AdamWOptions&>(options);
  return optim::AdamW8bitOptions(o.lr()).betas(o.betas()).eps(o.eps()).weight_decay(o.weight_decay());
}

}  // namespace detail

/// memscale::optim::AdamW8bit's sizing.
[[nodiscard]] inline optimizer_sizing adamw8bit_sizing() {
  return {"memscale::optim::AdamW8bit",
          [](const torch::Tensor& p, const torch::optim::OptimizerOptions& o) {
            const auto& options = static_cast<const optim::AdamW8bitOptions&>(o);
            return optim::optimizer_state_bytes(p.numel(), p.scalar_type() == torch::kFloat, options.min_8bit_size());
          },
          &detail::shadow_of<optim::AdamW8bit, optim::AdamW8bitOptions>};
}

/// The sizing of `optimizer`'s type. Throws memscale::Error naming the types it
/// knows for any other.
[[nodiscard]] inline optimizer_sizing sizing_of(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  if (dynamic_cast<const optim::AdamW8bit*>(&optimizer) != nullptr) return adamw8bit_sizing();
  if (dynamic_cast<const AdamW*>(&optimizer) != nullptr)
    return {"torch::optim::AdamW",
            [](const torch::Tensor& p, const OptimizerOptions& o) {
              return (static_cast<const AdamWOptions&>(o).amsgrad() ? 3 : 2) * detail::bytes_of(p);
            },
            &detail::shadow_of<AdamW, AdamWOptions>};
  if (dynamic_cast<const Adam*>(&optimizer) != nullptr)
    return {"torch::optim::Adam",
            [](const torch::Tensor& p, const OptimizerOptions& o) {
              return (static_cast<const AdamOptions&>(o).amsgrad() ? 3 : 2) * detail::bytes_of(p);
            },
            &detail::shadow_of<Adam, AdamOptions>};
  if (dynamic_cast<const SGD*>(&optimizer) != nullptr)
    return {"torch::optim::SGD",
            [](const torch::Tensor& p, const OptimizerOptions& o) {
              return static_cast<const SGDOptions&>(o).momentum() != 0.0 ? detail::bytes_of(p) : std::int64_t{0};
            },
            &detail::shadow_of<SGD, SGDOptions>};
  if (dynamic_cast<const Adagrad*>(&optimizer) != nullptr)
    return {"torch::optim::Adagrad",
            [](const torch::Tensor& p, const OptimizerOptions&) { return detail::bytes_of(p); },
            &detail::shadow_of<Adagrad, AdagradOptions>};
  if (dynamic_cast<const RMSprop*>(&optimizer) != nullptr)
    return {"torch::optim::RMSprop",
            [](const torch::Tensor& p, const OptimizerOptions& o) {
              const auto& options = static_cast<const RMSpropOptions&>(o);
              return (1 + (options.momentum() > 0.0 ? 1 : 0) + (options.centered() ? 1 : 0)) * detail::bytes_of(p);
            },
            &detail::shadow_of<RMSprop, RMSpropOptions>};
  throw Error(std::string("memscale::predict(): cannot size this optimizer (") + c10::demangle(typeid(optimizer).name()) +
              "): the types predict() knows are " + supported_optimizers);
}

/// The state `optimizer` holds now for its parameters on `device` that require
/// grad, as its type sizes it: 0 before its first step (it has none yet).
[[nodiscard]] inline std::int64_t held_state_bytes(const torch::optim::Optimizer& optimizer, c10::Device device) {
  if (optimizer.state().empty()) return 0;
  const auto sizing = sizing_of(optimizer);
  std::int64_t bytes = 0;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tensor listed twice has one state
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.defined() && p.requires_grad() && p.device() == device && seen.insert(p.unsafeGetTensorImpl()).second)
        bytes += sizing.state_bytes(p, group.options());
  return bytes;
}

/// What the optimizer holds and allocates on `device`.
struct optimizer_footprint {
  std::string name;
  std::int64_t state_bytes = 0;      ///< kept between steps (moments, momentum buffers, ...)
  std::int64_t transient_bytes = 0;  ///< the most one step() allocates and frees again
};

/// Sizes `optimizer` on `device`: the state of every parameter there that
/// requires grad, and one step's transient bytes measured on a shadow optimizer
/// (two steps over a copy of each group's largest such parameter; the second is
/// the steady state). `as` sizes it as another optimizer type with the same
/// groups (AdamW8bit for Config::use_8bit_optimizer).
[[nodiscard]] inline optimizer_footprint size_optimizer(const torch::optim::Optimizer& optimizer, c10::Device device,
                                                        const optimizer_sizing* as = nullptr,
                                                        const torch::optim::OptimizerOptions* as_options = nullptr) {
  const auto own = sizing_of(optimizer);
  const auto& sizing = as != nullptr ? *as : own;
  optimizer_footprint out;
  out.name = sizing.name;
  std::unordered_set<const c10::TensorImpl*> seen;  // a tensor listed twice has one state
  for (const auto& group : optimizer.param_groups()) {
    const auto& options = as_options != nullptr ? *as_options : group.options();
    torch::Tensor largest;
    for (const auto& p : group.params()) {
      if (!p.defined() || !p.requires_grad() || p.device() != device || !seen.insert(p.unsafeGetTensorImpl()).second)
        continue;
      out.state_bytes += sizing.state_bytes(p, options);
      if (!largest.defined() || p.numel() > largest.numel()) largest = p;
    }
    if (!largest.defined()) continue;
    torch::Tensor copy;
    {
      torch::NoGradGuard no_grad;
      copy = largest.detach().clone();
    }
    copy.requires_grad_(true);
    copy.mutable_grad() = torch::full_like(copy, 1e-3);
    auto shadow = sizing.shadow({copy}, options);
    shadow->step();  // creates the state
    timeline_scope recorder(device);
    shadow->step();
    const auto t = recorder.finish();
    out.transient_bytes = std::max(out.transient_bytes, t.peak() - std::max<std::int64_t>(0, t.end()));
  }
  return out;
}

/// Of what size_optimizer() counted, the state of the parameters among
/// `without_gradient` that the optimizer holds none for yet: a step that gives
/// them no gradient makes none (Adagrad's, made with the optimizer, is held).
[[nodiscard]] inline std::int64_t state_never_made(const torch::optim::Optimizer& optimizer, c10::Device device,
                                                   const std::unordered_set<const c10::TensorImpl*>& without_gradient,
                                                   const optimizer_sizing* as = nullptr,
                                                   const torch::optim::OptimizerOptions* as_options = nullptr) {
  if (without_gradient.empty()) return 0;
  const auto own = sizing_of(optimizer);
  const auto& sizing = as != nullptr ? *as : own;
  std::int64_t bytes = 0;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      if (!p.defined() || !p.requires_grad() || p.device() != device || !seen.insert(p.unsafeGetTensorImpl()).second ||
          without_gradient.count(p.unsafeGetTensorImpl()) == 0 || optimizer.state().count(optim::state_key(p)) > 0)
        continue;
      bytes += sizing.state_bytes(p, as_options != nullptr ? *as_options : group.options());
    }
  return bytes;
}

/// The optimizer the plan steps: `optimizer` as it is (`own`), or under
/// Config::use_8bit_optimizer an AdamW sized as memscale::optim::AdamW8bit
/// with its hyperparameters (what memscale::make_optimizer builds).
struct planned_optimizer_sizing {
  optimizer_footprint footprint;
  std::optional<optimizer_sizing> as;  // AdamW8bit's, or none: the optimizer's own
  std::optional<optim::AdamW8bitOptions> options;
  std::string note;
};
[[nodiscard]] inline planned_optimizer_sizing plan_optimizer(const torch::optim::Optimizer& optimizer,
                                                             c10::Device device, const optimizer_footprint& own,
                                                             bool use_8bit) {
  planned_optimizer_sizing out{own, std::nullopt, std::nullopt, {}};
  if (use_8bit && own.name == "torch::optim::AdamW" && !optimizer.param_groups().empty()) {
    out.as = adamw8bit_sizing();
    out.options = detail::as_eight_bit(optimizer.param_groups().front().options());
    out.footprint = size_optimizer(optimizer, device, &*out.as, &*out.options);
    out.note = "use_8bit_optimizer: the plan's optimizer state is sized as memscale::optim::AdamW8bit with the "
               "AdamW's hyperparameters (what memscale::make_optimizer builds)";
  } else if (use_8bit && own.name != "memscale::optim::AdamW8bit") {
    out.note = "use_8bit_optimizer: only an AdamW is replaced by AdamW8bit; the " + own.name + " is sized as it is";
  }
  return out;
}

/// Takes the parameters among `trainable` that a step gives no gradient (not
/// in `reached`: the forward does not use them) out of the gradient bytes, and
/// their state, and that of the optimizer's tensors not reached (one that is
/// not the model's), where the optimizer holds none yet, out of both footprints.
/// Returns a note saying so (empty: every parameter gets a gradient).
[[nodiscard]] inline std::string drop_idle(const std::vector<torch::Tensor>& trainable,
                                           const std::unordered_set<const c10::TensorImpl*>& reached,
                                           const torch::optim::Optimizer& optimizer, c10::Device device,
                                           std::int64_t& gradient_bytes, optimizer_footprint& own,
                                           planned_optimizer_sizing& planned) {
  std::unordered_set<const c10::TensorImpl*> idle;
  std::int64_t idle_bytes = 0;  // their gradients
  for (const auto& p : trainable)
    if (reached.count(p.unsafeGetTensorImpl()) == 0 && idle.insert(p.unsafeGetTensorImpl()).second)
      idle_bytes += static_cast<std::int64_t>(p.nbytes());
  for (const auto& group : optimizer.param_groups())  // the optimizer's, the model's or not
    for (const auto& p : group.params())
      if (p.defined() && p.requires_grad() && reached.count(p.unsafeGetTensorImpl()) == 0)
        idle.insert(p.unsafeGetTensorImpl());
  if (idle.empty()) return {};
  const auto state = state_never_made(optimizer, device, idle);
  gradient_bytes -= idle_bytes;
  own.state_bytes -= state;
  planned.footprint.state_bytes -=
      planned.as ? state_never_made(optimizer, device, idle, &*planned.as, &*planned.options) : state;
  return std::to_string(idle.size()) + " parameter tensor(s) of the model or the optimizer get no gradient in the "
         "step (the forward does not reach them): no gradient is counted for them (" +
         memscale::detail::format_bytes(idle_bytes) + "), nor optimizer state where the optimizer holds none yet (" +
         memscale::detail::format_bytes(state) + ")";
}

}  // namespace memscale::predictor
