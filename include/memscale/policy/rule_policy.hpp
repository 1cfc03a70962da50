// memscale — the rule policy: Stage 1 by explainable thresholds on the planner's
// own projections. It is what DecisionSource::rule and rule_fallback use.
#pragma once

#include <string>
#include <utility>

#include <memscale/config.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/policy/decision.hpp>

namespace memscale::policy {

/// A choice and the one line that explains it.
struct ruled {
  StrategyChoice choice;
  std::string reason;
};

/// The least that fits, in this order:
/// - the baseline within Balanced's target: Conservative (Stage 2 then changes nothing);
/// - checkpointing alone reaches the target: Balanced with checkpointing only (it stops
///   at the target, the least recompute that fits, and moves nothing);
/// - offload as well reaches it: Balanced with both;
/// - neither: Aggressive with both, the lowest peak memscale reaches (it may still not fit).
[[nodiscard]] inline ruled rule_policy(const StrategyContext& c) {
  using memscale::detail::format_bytes;
  const auto target = format_bytes(c.target_bytes);
  if (c.baseline_peak_bytes <= c.target_bytes)
    return {{OptimizationMode::Conservative, true, true},
            "the step's projected peak " + format_bytes(c.baseline_peak_bytes) + " is within the target " + target +
                ": nothing to do"};
  if (c.checkpoint_floor_bytes <= c.target_bytes)
    return {{OptimizationMode::Balanced, true, false},
            "the baseline's " + format_bytes(c.baseline_peak_bytes) + " exceeds the target " + target +
                " and checkpointing alone reaches " + format_bytes(c.checkpoint_floor_bytes) +
                ": Balanced, checkpointing only, no transfers"};
  if (c.offload_floor_bytes <= c.target_bytes)
    return {{OptimizationMode::Balanced, true, true},
            "checkpointing alone stops at " + format_bytes(c.checkpoint_floor_bytes) + ", above the target " +
                target + "; with offload " + format_bytes(c.offload_floor_bytes) + ": Balanced with both"};
  return {{OptimizationMode::Aggressive, true, true},
          "even with offload the lowest projected peak is " + format_bytes(c.offload_floor_bytes) +
              ", above the target " + target + ": Aggressive, the lowest peak memscale reaches"};
}

}  // namespace memscale::policy
