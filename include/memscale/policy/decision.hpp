// memscale — Stage 1's vocabulary: what it sees of a run (StrategyContext), the
// strategies it chooses among (strategy_candidates), what it decides
// (StrategyDecision) and who decided (DecisionSource). Stage 1 picks the mode and
// which techniques are eligible; Stage 2, the rule engine, expands that per
// layer, unchanged. Plain facts: nothing here depends on the profiler.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

#include <memscale/config.hpp>

namespace memscale {

/// Who chose the strategy a guard plans with.
enum class DecisionSource {
  user_config,    ///< Stage 1 skipped (auto_policy off, or no memory limit): the Config as written
  rule,           ///< the rule policy, asked for with Config::policy = PolicyKind::rule
  ml,             ///< the trained policy
  rule_fallback,  ///< the trained policy was unavailable (missing, corrupt, another schema): the rule policy
};

[[nodiscard]] constexpr std::string_view to_string(DecisionSource s) noexcept {
  switch (s) {
    case DecisionSource::user_config: return "user_config";
    case DecisionSource::rule: return "rule";
    case DecisionSource::ml: return "ml";
    case DecisionSource::rule_fallback: return "rule_fallback";
  }
  return "?";
}

enum class DeviceKind { cpu, cuda, other };

/// What Stage 1 sees: computed from the profile, the hardware and the Config
/// before Stage 2 plans (execute/stage1.hpp). Bytes are the planner's projections.
struct StrategyContext {
  /// Bumped whenever features() changes meaning; a trained artifact names the
  /// schema it was fitted on, and another schema is not used.
  static constexpr int schema_version = 1;

  DeviceKind device = DeviceKind::cpu;
  bool budget_given = false;              ///< Config::memory_budget_gb set
  std::int64_t usable_bytes = 0;          ///< budget (or device memory) x target_gpu_utilization
  std::int64_t parameter_bytes = 0;
  std::int64_t static_bytes = 0;          ///< parameters, gradients, optimizer state, buffers, reserve
  std::int64_t baseline_peak_bytes = 0;   ///< the un-optimized step's projected peak
  std::int64_t target_bytes = 0;          ///< Balanced's target: the peak it plans to stay under
  std::int64_t checkpoint_floor_bytes = 0;  ///< the lowest peak Stage 2 reaches checkpointing alone
  std::int64_t offload_floor_bytes = 0;     ///< ... with offload as well (= the above where none is possible)
  double step_seconds = 0.0;              ///< the chains' profiled forward and backward
  double recompute_floor_seconds = 0.0;   ///< the recompute of the checkpoint-floor plan
  double offload_bytes_per_second = 0.0;  ///< to the offload tier (0: no tier)
  std::int64_t batch_size = 0;            ///< the example input's first extent
  int units = 0;                          ///< units over all chains
  int linear_units = 0, conv_units = 0, norm_units = 0, block_units = 0, other_units = 0;  ///< the layer-type mix
  bool call_sites = false;                ///< a chain of memscale::forward call sites (user code between units)

  [[nodiscard]] std::int64_t activation_bytes() const noexcept {
    return baseline_peak_bytes > static_bytes ? baseline_peak_bytes - static_bytes : 0;
  }
  /// The baseline's projected peak over the usable bytes (> 1: it does not fit).
  [[nodiscard]] double pressure() const noexcept {
    return usable_bytes > 0 ? static_cast<double>(baseline_peak_bytes) / static_cast<double>(usable_bytes) : 0.0;
  }

  static constexpr std::size_t feature_count = 16;
  /// The trained policy's inputs: scale-free where it matters (bytes as ratios of
  /// the usable bytes or log2), so a policy fitted on small models reads large ones.
  [[nodiscard]] std::array<double, feature_count> features() const {
    const auto usable = static_cast<double>(usable_bytes > 0 ? usable_bytes : 1);
    const auto share = [&](int n) { return units > 0 ? static_cast<double>(n) / units : 0.0; };
    const auto log2p = [](double v) { return std::log2(1.0 + std::max(0.0, v)); };
    return {pressure(),
            static_cast<double>(static_bytes) / usable,
            static_cast<double>(activation_bytes()) / usable,
            static_cast<double>(checkpoint_floor_bytes) / usable,
            static_cast<double>(offload_floor_bytes) / usable,
            step_seconds > 0 ? recompute_floor_seconds / step_seconds : 0.0,
            // seconds to move the activations to the tier and back, per second of step
            offload_bytes_per_second > 0 && step_seconds > 0
                ? 2.0 * static_cast<double>(activation_bytes()) / offload_bytes_per_second / step_seconds
                : 0.0,
            log2p(static_cast<double>(parameter_bytes) / 1048576.0),
            log2p(static_cast<double>(batch_size)),
            log2p(units),
            share(linear_units),
            share(conv_units),
            share(norm_units),
            share(block_units),
            call_sites ? 1.0 : 0.0,
            device == DeviceKind::cuda ? 1.0 : 0.0};
  }
};

/// One strategy Stage 1 may choose: a mode and the techniques it leaves eligible.
/// Tiling, mixed precision and the 8-bit optimizer change the arithmetic: Stage 1
/// leaves them as the caller set them, and never enables what the caller disabled.
struct StrategyChoice {
  OptimizationMode mode = OptimizationMode::Balanced;
  bool checkpoint = true;
  bool offload = true;
  friend constexpr bool operator==(const StrategyChoice&, const StrategyChoice&) = default;
};

/// The candidates, in the order of a trained policy's classes (its artifact's
/// rows): changing them is a new StrategyContext::schema_version.
inline constexpr std::array<StrategyChoice, 5> strategy_candidates = {{
    {OptimizationMode::Conservative, true, true},
    {OptimizationMode::Balanced, true, false},
    {OptimizationMode::Balanced, true, true},
    {OptimizationMode::Aggressive, true, false},
    {OptimizationMode::Aggressive, true, true},
}};

[[nodiscard]] inline std::string to_string(const StrategyChoice& c) {
  std::string s(to_string(c.mode));
  s += c.checkpoint ? (c.offload ? ", checkpoint + offload" : ", checkpoint only") : (c.offload ? ", offload only" : ", nothing");
  return s;
}

/// The Config a strategy gives: the caller's, with the mode and the techniques
/// Stage 1 chose (each only if the caller enabled it). The caller's is not changed.
[[nodiscard]] inline Config effective_config(const Config& caller, const StrategyChoice& c) {
  Config out = caller;
  out.mode = c.mode;
  out.enable_checkpointing = caller.enable_checkpointing && c.checkpoint;
  out.enable_offloading = caller.enable_offloading && c.offload;
  out.enable_tiling = caller.enable_tiling && out.enable_checkpointing;
  return out;
}

/// What Stage 1 decided, with the Config it planned with beside the caller's.
struct StrategyDecision {
  DecisionSource decision_source = DecisionSource::user_config;
  StrategyChoice choice{};        ///< the strategy chosen (user_config: the caller's own)
  std::string reason;             ///< one line: why this strategy, or why Stage 1 was skipped
  std::optional<double> confidence;  ///< the trained policy's probability of its choice
  std::optional<StrategyContext> context;  ///< what Stage 1 saw (unset where it was skipped before looking)
  Config caller{};                ///< the Config as the caller passed it
  Config effective{};             ///< the Config Stage 2 planned with

  [[nodiscard]] std::string str() const {
    std::ostringstream os;
    const auto techniques = [](const Config& c) {
      std::string s(to_string(c.mode));
      s += c.enable_checkpointing ? ", checkpointing" : ", no checkpointing";
      s += c.enable_offloading ? ", offloading" : ", no offloading";
      s += c.enable_tiling ? ", tiling" : "";
      return s;
    };
    os << "strategy (Stage 1): " << to_string(decision_source) << ": " << reason;
    if (confidence) os << " (confidence " << std::fixed << std::setprecision(2) << *confidence << ")";
    if (decision_source != DecisionSource::user_config)  // otherwise the two are the same
      os << "\n  effective Config: " << techniques(effective) << "; the caller's: " << techniques(caller);
    return os.str();
  }
};

}  // namespace memscale
