// memscale — the telemetry events a wrap sends (observability/telemetry.hpp has
// the schema, the queue and the sinks): built from bucketed facts about the
// model and from the plan, never from a name, a path or a shape.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/observability/config_json.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/observability/telemetry.hpp>
#include <memscale/policy/decision.hpp>

namespace memscale::telemetry {

/// What every event of one wrap says about its model, taken at wrap.
struct model_facts {
  std::string architecture = "other";
  std::string parameter_bucket = "<1M";
  std::string device_class = "cpu";
  std::uint64_t steps_at_wrap = 0;  ///< the process's training steps then (not sent)
};

[[nodiscard]] inline model_facts facts_of(const torch::nn::Module& root) {
  model_facts f;
  f.architecture = architecture_class(root);
  std::int64_t parameters = 0;
  for (const auto& p : root.parameters()) {
    parameters += p.numel();
    f.device_class = p.device().is_cuda() ? "cuda" : p.device().is_cpu() ? "cpu" : "other";
  }
  f.parameter_bucket = parameter_bucket(parameters);
  f.steps_at_wrap = observability::counters().steps();
  return f;
}

/// `outcome`: "ok", or the kind of error wrap threw ("config", "unsupported_model",
/// "correctness", "out_of_memory", "error").
[[nodiscard]] inline nlohmann::json wrap_called(const model_facts& f, const Config& c, const char* outcome) {
  auto e = event("wrap_called", f.device_class);
  e["architecture"] = f.architecture;
  e["parameter_bucket"] = f.parameter_bucket;
  e["mode"] = c.mode;
  e["outcome"] = outcome;
  return e;
}

[[nodiscard]] inline nlohmann::json plan_applied(const model_facts& f, const Config& c, const Report& r) {
  auto e = event("plan_applied", f.device_class);
  e["architecture"] = f.architecture;
  e["parameter_bucket"] = f.parameter_bucket;
  e["mode"] = c.mode;
  auto techniques = nlohmann::json::array();
  if (r.checkpointed_segments() > r.tiled_segments()) techniques.push_back("checkpoint");
  if (r.tiled_segments() > 0) techniques.push_back("tile");
  if (r.offloaded_units() > 0) techniques.push_back("offload");
  if (c.use_mixed_precision) techniques.push_back("mixed_precision");
  if (c.use_8bit_optimizer) techniques.push_back("8bit_optimizer");
  e["techniques"] = std::move(techniques);
  e["pressure_bucket"] = pressure_bucket(r.memory_pressure());
  e["decision_source"] = std::string(to_string(r.strategy.decision_source));
  return e;
}

[[nodiscard]] inline nlohmann::json detach_called(const model_facts& f) {
  auto e = event("detach_called", f.device_class);
  e["steps_bucket"] = count_bucket(static_cast<std::int64_t>(observability::counters().steps() - f.steps_at_wrap));
  return e;
}

[[nodiscard]] inline nlohmann::json policy_decided(const model_facts& f, const StrategyDecision& d) {
  auto e = event("policy_decided", f.device_class);
  e["decision_source"] = std::string(to_string(d.decision_source));
  e["chosen_mode"] = d.choice.mode;
  e["chosen_checkpoint"] = d.choice.checkpoint;
  e["chosen_offload"] = d.choice.offload;
  return e;
}

}  // namespace memscale::telemetry
