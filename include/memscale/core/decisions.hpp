// memscale — what the rule engine (core/decision_engine.hpp) reads and writes:
// the rule behind each decision, the mode's policy, the engine's input, and the
// plan it returns (units per chain, one decision per run of slots, in order).
// Plain data: tests build and read them in static_assert.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include <memscale/config.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>

namespace memscale::core {

/// Why a run of slots got the treatment it got; printed beside every plan entry.
enum class rule_id : std::uint8_t {
  low_pressure_skip,       ///< pressure below the mode's threshold; nothing applied
  checkpointing_disabled,  ///< Config or Strategy excludes checkpointing
  unsupported_chain,       ///< a slot is not Tensor -> Tensor; chain left alone
  checkpoint_segment,      ///< checkpointed: it lowers the projected peak
  keep_fits,               ///< kept: the projected peak already fits the target
  keep_no_gain,            ///< kept: checkpointing (or offloading) it would not lower the peak by least_gain
  refine_segment,          ///< checkpointed part of a kept run: the uniform segments were not enough
  offload_segment,         ///< offloaded: cheapest transfer per compute second, lowers the peak enough
  offload_no_room,         ///< would lower the peak, but the offload tiers' budget is spent
  tile_segment,            ///< a checkpointed run of row-independent slots runs over chunks
  optimal_schedule,        ///< checkpointed or kept by the optimal schedule, which replaced the greedy's segments
};

[[nodiscard]] constexpr std::string_view to_string(rule_id r) noexcept {
  switch (r) {
    case rule_id::low_pressure_skip: return "R1 low-pressure-skip";
    case rule_id::checkpointing_disabled: return "R2 checkpointing-disabled";
    case rule_id::unsupported_chain: return "R3 unsupported-chain";
    case rule_id::checkpoint_segment: return "R4 checkpoint-segment";
    case rule_id::keep_fits: return "R5 keep-fits";
    case rule_id::keep_no_gain: return "R6 keep-no-gain";
    case rule_id::refine_segment: return "R7 refine-segment";
    case rule_id::offload_segment: return "R8 offload-segment";
    case rule_id::offload_no_room: return "R9 offload-no-room";
    case rule_id::tile_segment: return "R10 tile-segment";
    case rule_id::optimal_schedule: return "R11 optimal-schedule";
  }
  return "?";
}

/// How hard a mode pushes: act when pressure >= act_at_pressure (unless
/// force_optimize), and expand until the projected peak <= target_fraction x usable.
/// With force_optimize where nothing presses (the baseline already under that
/// target), the light touch: expand, cheapest memory first, until the step's
/// growth above the static bytes is at most forced_growth_fraction of the
/// baseline's (forced_target); where something presses, to the lower of the two
/// targets.
struct mode_policy {
  double act_at_pressure;
  double target_fraction;
  double forced_growth_fraction;
};

[[nodiscard]] constexpr mode_policy policy_for(OptimizationMode mode) noexcept {
  switch (mode) {
    case OptimizationMode::Conservative: return {1.0, 1.0, 0.75};  // only when it would not fit
    case OptimizationMode::Balanced: return {0.7, 0.9, 0.5};       // earlier, with a 10% margin
    case OptimizationMode::Aggressive: return {0.0, 0.0, 0.0};     // always; minimize the peak
  }
  return {1.0, 1.0, 0.75};
}

/// The target force_optimize sets where nothing presses: static bytes plus the
/// mode's forced_growth_fraction of the baseline's growth above them.
[[nodiscard]] constexpr std::int64_t forced_target(OptimizationMode mode, std::int64_t baseline_peak,
                                                   std::int64_t static_bytes) noexcept {
  const auto growth = baseline_peak > static_bytes ? baseline_peak - static_bytes : 0;
  return static_bytes + static_cast<std::int64_t>(policy_for(mode).forced_growth_fraction * static_cast<double>(growth));
}

/// Of `bytes` a step offloads on top of `before` bytes it offloads already,
/// those a pool of `fast_bytes` takes (all where fast_bytes < 0: no such limit).
[[nodiscard]] constexpr std::int64_t pool_share(std::int64_t fast_bytes, std::int64_t bytes,
                                                std::int64_t before) noexcept {
  if (fast_bytes < 0) return bytes;
  const auto left = fast_bytes > before ? fast_bytes - before : std::int64_t{0};
  return bytes < left ? bytes : left;
}

struct engine_input {
  OptimizationMode mode = OptimizationMode::Balanced;
  bool checkpointing_allowed = true;  ///< Config::enable_checkpointing and the Strategy
  bool force_optimize = false;
  std::int64_t usable_bytes = 0;      ///< budget (or device memory) x target_gpu_utilization
  std::int64_t static_bytes = 0;      ///< parameters, gradients, optimizer state, buffers
  bool offload_allowed = false;       ///< Config::enable_offloading, the Strategy, and a tier to go to
  std::int64_t offload_budget_bytes = 0;    ///< room in the offload tiers (host cap + disk)
  double offload_bytes_per_second = 1e9;    ///< one-way transfer rate to the offload tier
  /// Of a step's offloaded bytes, those the faster path takes (a CUDA tensor's
  /// pinned pool, AsyncOffloadConfig::pinned_pool_mb); the rest spill through
  /// pageable host memory at offload_spill_bytes_per_second. < 0: no spill, all
  /// at offload_bytes_per_second (the disk tier of CPU tensors).
  std::int64_t offload_fast_bytes = -1;
  double offload_spill_bytes_per_second = 0.0;  ///< one-way rate past offload_fast_bytes
  std::int64_t offload_min_bytes = 0;       ///< the engine keeps smaller saved tensors where they are

  /// Out and back, the seconds to move `bytes` more of a step's offloads, on
  /// top of `before` bytes it offloads already: the offloaded tensors of a step
  /// are all held in the tiers at the forward's end, so the first
  /// offload_fast_bytes of them go at the fast rate and the rest at the spill rate.
  [[nodiscard]] constexpr double offload_transfer_seconds(std::int64_t bytes, std::int64_t before = 0) const {
    const auto rate = [](double r) { return r > 1.0 ? r : 1.0; };
    if (bytes <= 0) return 0.0;
    if (offload_fast_bytes < 0 || !(offload_spill_bytes_per_second > 0.0))
      return 2.0 * static_cast<double>(bytes) / rate(offload_bytes_per_second);
    const auto fast = pool_share(offload_fast_bytes, bytes, before);
    return 2.0 * (static_cast<double>(fast) / rate(offload_bytes_per_second) +
                  static_cast<double>(bytes - fast) / rate(offload_spill_bytes_per_second));
  }
  bool tiling_allowed = false;              ///< Config::enable_tiling and the Strategy
  /// Per chain: the most slots one segment may span (0: any). A chain of call
  /// sites has 1: user code runs between its units, so none can share a segment.
  std::vector<int> segment_limit{};
  /// Per chain, where segment_limit is 1: group_end[i] > i where units i..
  /// group_end[i] are all the inner calls of one outer memscale::forward call,
  /// so that run may be one checkpointed segment (the outer call checkpointed
  /// whole); -1 elsewhere. The optimal-schedule phase (R11) considers such runs
  /// beside single units; the greedy expansion does not. Empty: no groups.
  std::vector<std::vector<int>> segment_groups{};
  /// One chain of one slot that is the whole model (no unit boundaries): of
  /// its saved tensors, which stream to the tiers, the step holds about this
  /// many bytes at once (a prefetch group; with async offload, the groups
  /// fetched ahead and the writes in flight too). A backward node whose saved
  /// tensors exceed a group holds them all: low there. 0: not a whole model.
  std::int64_t whole_model_held_bytes = 0;
  /// > 0: the target, whatever the mode's policy would set. Planning one model
  /// at two unit levels (execute/attachment_levels.hpp) aims both at the
  /// coarser level's target, so that their recompute compares.
  std::int64_t fixed_target = 0;
};

/// Whether a chain's segment_groups (engine_input) hold a group.
[[nodiscard]] constexpr bool has_groups(std::span<const int> group_end) noexcept {
  return std::any_of(group_end.begin(), group_end.end(), [](int g) { return g >= 0; });
}

/// Whether force_optimize finds nothing pressing: the baseline already meets the
/// mode's target, so the engine aims at forced_target instead (the light touch).
[[nodiscard]] constexpr bool light_touch(const engine_input& in, std::int64_t baseline_peak) noexcept {
  return in.force_optimize &&
         baseline_peak <= static_cast<std::int64_t>(policy_for(in.mode).target_fraction *
                                                    static_cast<double>(in.usable_bytes));
}

/// One decision about one run of slots, in the order the engine made it.
struct segment_decision {
  int chain = 0;
  int first = 0;
  int last = 0;
  bool checkpointed = false;
  rule_id rule = rule_id::keep_fits;
  std::int64_t freed_bytes = 0;       ///< forward bytes the run would no longer keep (offload: moves)
  double recompute_seconds = 0.0;     ///< offload: transfer seconds (out and back)
  std::int64_t peak_before = 0;       ///< projected step peak before this decision
  std::int64_t peak_after = 0;        ///< ... and after it
  bool offloaded = false;
  double compute_seconds = 0.0;       ///< offload: the run's forward + backward time the transfer overlaps
  int tiles = 1;                      ///< tile: chunks, along input dimension tile_dim
  int tile_dim = 0;
};

/// A chain whose greedy checkpoint segments the optimal schedule replaced
/// (core/optimal_chain.hpp: less recompute within the same budget).
struct optimal_override {
  int chain = 0;
  double greedy_seconds = 0.0;   ///< the greedy segments' recompute
  double optimal_seconds = 0.0;  ///< ... and the optimal schedule's
  std::int64_t greedy_peak = 0;  ///< projected step peak with the greedy segments
  std::int64_t optimal_peak = 0; ///< ... and with the optimal schedule
  std::int64_t budget = 0;       ///< the step peak the schedule keeps (lowered with groups: below the greedy's)
};

struct engine_plan {
  double pressure = 0.0;
  std::int64_t baseline_peak = 0;
  std::int64_t planned_peak = 0;
  std::int64_t target_bytes = 0;
  rule_id overall = rule_id::keep_fits;
  std::vector<std::vector<unit>> units;   ///< per chain, covering every slot
  std::vector<int> segment_length;        ///< per chain: the candidate segment length
  std::vector<segment_decision> decisions;
  std::vector<optimal_override> overrides;  ///< chains the optimal schedule re-planned
};

/// The offloads `plan` applies (R8's decisions taken), in the order a step
/// stores them: chain, then slot. The pinned pool takes the first ones.
template <class Plan>  // engine_plan, const or not
[[nodiscard]] constexpr auto offloads_in_forward_order(Plan& plan) {
  std::vector<decltype(&plan.decisions.front())> taken;
  for (auto& d : plan.decisions)
    if (d.offloaded && d.rule == rule_id::offload_segment) taken.push_back(&d);
  std::sort(taken.begin(), taken.end(), [](const auto* a, const auto* b) {
    return a->chain != b->chain ? a->chain < b->chain : a->first < b->first;
  });
  return taken;
}

}  // namespace memscale::core
