// memscale — the public entry points: wrap, optimize (an RAII guard), detach,
// is_optimized. They accept a torch::nn::ModuleHolder (torch::nn::Sequential, a
// TORCH_MODULE type) or a std::shared_ptr to a torch::nn::Module.
#pragma once

#include <memory>
#include <optional>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/execute/attach.hpp>
#include <memscale/execute/registry.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/strategy.hpp>

namespace memscale {

/// Attaches memscale to `model` without a scope. Planning happens at each chain's
/// first forward call. Throws (leaving the model as it was) on bad input.
template <StrategyType S = DefaultStrategy, Model M>
Report wrap(M& model, const Config& config = {}) {
  return detail::attach<S>(model, config, nullptr)->report();
}

/// Attaches memscale and plans now, from one forward pass of `example_input`
/// (run without gradients; it draws no random numbers that training would see
/// and leaves the model's buffers as they were).
template <StrategyType S = DefaultStrategy, Model M>
Report wrap(M& model, const torch::Tensor& example_input, const Config& config = {}) {
  return detail::attach<S>(model, config, &example_input)->report();
}

/// Restores the model exactly as it was before wrap(). Returns false (and does
/// nothing) when memscale does not manage it. Never throws.
template <Model M>
bool detach(M& model) noexcept {
  std::shared_ptr<torch::nn::Module> root;
  try {
    root = detail::root_of(model);
  } catch (...) {
    return false;
  }
  return root && core::detach(root.get());
}

/// Whether memscale currently manages `model`.
template <Model M>
[[nodiscard]] bool is_optimized(const M& model) {
  auto root = detail::root_of(model);
  return root && core::registry::global().find(root.get()) != nullptr;
}

/// The offload engine's statistics for a model memscale manages (nullopt when
/// it does not, or when its plan offloads nothing).
template <Model M>
[[nodiscard]] std::optional<offload::engine_stats> offload_stats(const M& model) {
  auto root = detail::root_of(model);
  auto attached = root ? core::registry::global().find(root.get()) : nullptr;
  auto engine = attached ? attached->offload_engine() : nullptr;
  if (!engine) return std::nullopt;
  return engine->stats();
}

/// wrap() for the lifetime of the returned guard.
template <StrategyType S = DefaultStrategy, Model M>
[[nodiscard]] OptimizationGuard optimize(M& model, const Config& config = {}) {
  auto attached = detail::attach<S>(model, config, nullptr);
  return OptimizationGuard(detail::root_of(model), std::move(attached));
}

/// wrap(model, example_input, config) for the lifetime of the returned guard.
template <StrategyType S = DefaultStrategy, Model M>
[[nodiscard]] OptimizationGuard optimize(M& model, const torch::Tensor& example_input, const Config& config = {}) {
  auto attached = detail::attach<S>(model, config, &example_input);
  return OptimizationGuard(detail::root_of(model), std::move(attached));
}

}  // namespace memscale
