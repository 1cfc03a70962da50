// memscale — Stage 1 in the pipeline: the StrategyContext of a planning run
// (from the profiles, the static bytes and the engine's input), and
// run_stage1, which asks the policy Config::policy names and derives the
// effective Config Stage 2 plans with. The caller's Config is never changed; a
// trained policy that is unavailable (PolicyFallbackNeeded) falls back to the
// rule policy here and never escapes wrap/optimize.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <memscale/config.hpp>
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/decisions.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/errors.hpp>
#include <memscale/policy/decision.hpp>
#include <memscale/policy/rule_policy.hpp>
#include <memscale/policy/trained_policy.hpp>

namespace memscale::core {

/// A unit's kind for the layer-type mix, from its profiled name ("3 (torch::nn::LinearImpl)").
enum class unit_kind { linear, conv, norm, block, other };

[[nodiscard]] inline unit_kind kind_of_unit(std::string_view name) {
  const auto has = [&](std::string_view s) { return name.find(s) != std::string_view::npos; };
  if (has("Linear") || has("Bilinear")) return unit_kind::linear;
  if (has("Conv")) return unit_kind::conv;
  if (has("Norm")) return unit_kind::norm;
  for (std::string_view p : {"ReLU", "GELU", "SiLU", "Tanh", "Sigmoid", "Softmax", "Dropout", "Pool", "Embedding",
                             "Flatten", "Identity", "ELU", "Mish", "Hardswish"})
    if (has(p)) return unit_kind::other;
  return unit_kind::block;  // a module of the user's own: a block of layers
}

/// What Stage 1 sees of the chains about to be planned: `in` is the engine's input
/// as the caller's Config gives it; the floors are the engine's own plans (Aggressive,
/// checkpointing alone, then with offload where the input allows it).
[[nodiscard]] inline StrategyContext strategy_context(const std::vector<chain_profile>& profiles,
                                                      const std::vector<std::vector<slot_cost>>& costs,
                                                      const std::vector<bool>& supported, const engine_input& in,
                                                      bool cuda, bool budget_given, std::int64_t parameter_bytes,
                                                      bool call_sites) {
  StrategyContext c;
  c.device = cuda ? DeviceKind::cuda : DeviceKind::cpu;
  c.budget_given = budget_given;
  c.usable_bytes = in.usable_bytes;
  c.parameter_bytes = parameter_bytes;
  c.static_bytes = in.static_bytes;
  c.offload_bytes_per_second = in.offload_allowed ? in.offload_bytes_per_second : 0.0;
  c.call_sites = call_sites;
  for (const auto& p : profiles) {
    if (c.batch_size == 0 && !p.input_shape.empty()) c.batch_size = p.input_shape.front();
    for (const auto& name : p.slot_names) {
      ++c.units;
      switch (kind_of_unit(name)) {
        case unit_kind::linear: ++c.linear_units; break;
        case unit_kind::conv: ++c.conv_units; break;
        case unit_kind::norm: ++c.norm_units; break;
        case unit_kind::block: ++c.block_units; break;
        case unit_kind::other: ++c.other_units; break;
      }
    }
    for (const auto& s : p.slots) c.step_seconds += s.forward_seconds + s.backward_seconds;
  }
  auto floor_in = in;
  floor_in.mode = OptimizationMode::Aggressive;
  floor_in.force_optimize = false;
  floor_in.offload_allowed = false;
  const auto checkpointed = decide(costs, supported, floor_in);
  c.baseline_peak_bytes = checkpointed.baseline_peak;
  c.checkpoint_floor_bytes = checkpointed.planned_peak;
  c.recompute_floor_seconds = recompute_seconds(costs, checkpointed.units);
  c.offload_floor_bytes = c.checkpoint_floor_bytes;
  if (in.offload_allowed) {
    floor_in.offload_allowed = true;
    c.offload_floor_bytes = std::min(c.offload_floor_bytes, decide(costs, supported, floor_in).planned_peak);
  }
  c.target_bytes = static_cast<std::int64_t>(policy_for(OptimizationMode::Balanced).target_fraction *
                                             static_cast<double>(in.usable_bytes));
  return c;
}

/// The caller's own strategy, for a decision that keeps the Config as written.
[[nodiscard]] inline StrategyDecision as_written(const Config& caller, std::string reason) {
  StrategyDecision d;
  d.decision_source = DecisionSource::user_config;
  d.choice = {caller.mode, caller.enable_checkpointing, caller.enable_offloading};
  d.reason = std::move(reason);
  d.caller = d.effective = caller;
  return d;
}

/// Stage 1 for a Config with auto_policy: skipped without a memory limit to reason
/// about (a GPU, or memory_budget_gb), otherwise the policy Config::policy names.
[[nodiscard]] inline StrategyDecision run_stage1(const Config& caller, const StrategyContext& c) {
  if (!caller.auto_policy) return as_written(caller, "auto_policy is off: the Config as written");
  if (c.device != DeviceKind::cuda && !c.budget_given)
    return as_written(caller, "no memory limit to reason about (a CPU device and no memory_budget_gb): the Config "
                              "as written");
  StrategyDecision d;
  d.caller = caller;
  d.context = c;
  if (caller.policy == PolicyKind::rule) {
    auto r = policy::rule_policy(c);
    d.decision_source = DecisionSource::rule;
    d.choice = r.choice;
    d.reason = r.reason;
  } else {
    try {
      const auto artifact = [&] {
        if (caller.policy_artifact) return policy::load_artifact(*caller.policy_artifact);
        if (const auto shipped = policy::shipped_artifact()) return policy::parse_artifact(*shipped);
        throw PolicyFallbackNeeded("no trained policy ships with this build and Config::policy_artifact names none");
      }();
      const auto p = policy::predict_strategy(artifact, c);
      d.decision_source = DecisionSource::ml;
      d.choice = p.choice;
      d.confidence = p.confidence;
      d.reason = "the trained policy (dataset " + artifact.dataset + ") chose " + to_string(p.choice);
    } catch (const PolicyFallbackNeeded& e) {
      auto r = policy::rule_policy(c);
      d.decision_source = DecisionSource::rule_fallback;
      d.choice = r.choice;
      d.reason = std::string(e.what()) + "; the rule policy: " + r.reason;
    }
  }
  d.effective = effective_config(caller, d.choice);
  return d;
}

}  // namespace memscale::core
