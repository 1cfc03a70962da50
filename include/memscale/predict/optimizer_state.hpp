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
#include <string>
#include <typeinfo>
#include <vector>

#include <torch/torch.h>

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
  throw Error(std::string("memscale::predict(): cannot size this optimizer (") + typeid(optimizer).name() +
              "): the types predict() knows are " + supported_optimizers);
}

/// The state `optimizer` holds now for its parameters on `device` that require
/// grad, as its type sizes it: 0 before its first step (it has none yet).
[[nodiscard]] inline std::int64_t held_state_bytes(const torch::optim::Optimizer& optimizer, c10::Device device) {
  if (optimizer.state().empty()) return 0;
  const auto sizing = sizing_of(optimizer);
  std::int64_t bytes = 0;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.defined() && p.requires_grad() && p.device() == device) bytes += sizing.state_bytes(p, group.options());
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
  for (const auto& group : optimizer.param_groups()) {
    const auto& options = as_options != nullptr ? *as_options : group.options();
    torch::Tensor largest;
    for (const auto& p : group.params()) {
      if (!p.defined() || !p.requires_grad() || p.device() != device) continue;
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

}  // namespace memscale::predictor
