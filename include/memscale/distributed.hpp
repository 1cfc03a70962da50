// memscale — data parallel training over c10d (Gloo on CPU, NCCL on CUDA), the
// engine PyTorch's DistributedDataParallel runs on. Every rank applies the same
// plan, rank 0's (memscale::distributed::optimize / wrap), and c10d's Reducer
// all-reduces gradients during backward (memscale::distributed::DataParallel).
// Config::memory_budget_gb is each rank's own budget: every rank holds the whole
// model and its share of the batch, so plan with one rank's example batch.
#pragma once

#include <utility>

#include <torch/torch.h>

#include <memscale/api.hpp>
#include <memscale/config.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/distributed/c10d.hpp>
#include <memscale/distributed/data_parallel.hpp>
#include <memscale/distributed/plan_agreement.hpp>
#include <memscale/distributed/process_group.hpp>
#include <memscale/techniques/strategy.hpp>

namespace memscale::distributed {

/// The techniques `S` and `config` let a rank apply.
template <StrategyType S = DefaultStrategy>
[[nodiscard]] plan_capabilities capabilities_of(const Config& config) {
  const auto set = memscale::detail::techniques_for<S>(config);
  const bool checkpoint = config.enable_checkpointing && static_cast<bool>(set.checkpoint);
  return {checkpoint, static_cast<bool>(set.offload), checkpoint && static_cast<bool>(set.tile),
          config.use_mixed_precision};
}

/// memscale::wrap on every rank of `group`, all applying rank 0's plan; planning
/// waits for each chain's first training forward, which every rank must run.
template <StrategyType S = DefaultStrategy, Model M>
Report wrap(M& model, const Config& config, const process_group& group) {
  return memscale::detail::attach<S>(model, config, nullptr, rank0_plan(group, capabilities_of<S>(config)))->report();
}

/// memscale::wrap(model, example_input, config) on every rank of `group`: each
/// rank profiles its own example batch, and all apply rank 0's plan.
template <StrategyType S = DefaultStrategy, Model M>
Report wrap(M& model, const torch::Tensor& example_input, const Config& config, const process_group& group) {
  return memscale::detail::attach<S>(model, config, &example_input, rank0_plan(group, capabilities_of<S>(config)))
      ->report();
}

/// memscale::optimize on every rank of `group` (planning at the first forward).
template <StrategyType S = DefaultStrategy, Model M>
[[nodiscard]] OptimizationGuard optimize(M& model, const Config& config, const process_group& group) {
  auto attached = memscale::detail::attach<S>(model, config, nullptr, rank0_plan(group, capabilities_of<S>(config)));
  return OptimizationGuard(memscale::detail::root_of(model), std::move(attached));
}

/// memscale::optimize(model, example_input, config) on every rank of `group`;
/// every rank must make this call (it exchanges the plan).
template <StrategyType S = DefaultStrategy, Model M>
[[nodiscard]] OptimizationGuard optimize(M& model, const torch::Tensor& example_input, const Config& config,
                                         const process_group& group) {
  auto attached =
      memscale::detail::attach<S>(model, config, &example_input, rank0_plan(group, capabilities_of<S>(config)));
  return OptimizationGuard(memscale::detail::root_of(model), std::move(attached));
}

}  // namespace memscale::distributed
