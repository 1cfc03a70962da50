// memscale — the rule engine's optimal-schedule phase (R11): the optimal
// segmentation (core/optimal_chain.hpp) in place of the greedy's where it
// recomputes less at the peak the plan keeps, or, with call sites' groups,
// where it reaches lower; and how decide() compares two complete plans.
// constexpr, like the engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <memscale/core/decision_phases.hpp>
#include <memscale/core/decisions.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/optimal_chain.hpp>

namespace memscale::core {

namespace detail_engine {

/// Whether plan `a` beats `b` once both are complete: it reaches the target and
/// `b` does not; or, neither reaching it, it peaks lower (by more than 1/2048);
/// or, at the same peak or both within the target, it costs less recompute and
/// offload transfer.
[[nodiscard]] constexpr bool better_final_plan(const std::vector<std::vector<slot_cost>>& chains,
                                               const engine_input& in, const engine_plan& a, const engine_plan& b) {
  const bool a_fits = a.planned_peak <= a.target_bytes, b_fits = b.planned_peak <= b.target_bytes;
  if (a_fits != b_fits) return a_fits;
  const auto resolution = b.planned_peak / 2048;
  if (!a_fits && a.planned_peak + resolution < b.planned_peak) return true;
  if (!a_fits && a.planned_peak > b.planned_peak + resolution) return false;
  const auto cost = [&](const engine_plan& p) {
    return recompute_seconds(chains, p.units) + in.offload_transfer_seconds(offloaded_bytes(chains, p.units));
  };
  return cost(a) < cost(b);
}

}  // namespace detail_engine

/// Optimal-schedule phase, after the greedy expansion and its refinement: per
/// supported chain, the optimal segmentation (core/optimal_chain.hpp) within the
/// step peak the plan must keep (the target, or the greedy's own peak where it
/// could not reach the target) replaces the greedy's segments when it recomputes
/// less; the chain's decisions then read R11 and plan.overrides records the
/// greedy's figures beside the optimum's. The DP rounds live bytes up once per
/// unit: it is asked with that rounding as slack first and, should its plan then
/// overshoot, without. `tolerant` (decide() tries it where the peak to keep is
/// the greedy's own, Aggressive's minimum): a schedule within one of the DP's
/// levels (1/2048 of the chain's room) above that peak counts as keeping it.
/// Earlier chains are final when a later one is re-planned. `lower_with_groups`
/// (decide() tries it where the greedy stopped above the target): in a chain of
/// call sites with groups (engine_input::segment_groups), the schedule that
/// reaches the lowest peak, down to the target, whatever its recompute.
constexpr void assign_optimal(const std::vector<std::vector<slot_cost>>& chains, const std::vector<bool>& supported,
                              const engine_input& in, engine_plan& plan, bool tolerant = false,
                              bool lower_with_groups = false) {
  auto budget = std::max(plan.target_bytes, plan.planned_peak);
  for (int c = 0; c < static_cast<int>(chains.size()); ++c) {
    const auto& s = chains[c];
    const int n = static_cast<int>(s.size());
    const double greedy_seconds = recompute_seconds(s, plan.units[c]);
    const int limit = static_cast<std::size_t>(c) < in.segment_limit.size() ? in.segment_limit[c] : 0;
    const std::span<const int> groups = static_cast<std::size_t>(c) < in.segment_groups.size()
                                            ? std::span<const int>(in.segment_groups[static_cast<std::size_t>(c)])
                                            : std::span<const int>();
    // Whole groups can free what no single unit does (the tensor between two
    // parts): where the greedy stopped above the target, they may lower the peak.
    const bool lower = lower_with_groups && plan.planned_peak > plan.target_bytes && has_groups(groups);
    if (!supported[c] || n == 0 || (greedy_seconds <= 0.0 && !lower)) continue;
    std::int64_t room = budget - in.static_bytes;
    for (int e = 0; e < c; ++e) room -= project_chain(chains[e], plan.units[e]).forward_end;
    if (room <= 0) continue;
    const int buckets = static_cast<int>(std::min<std::int64_t>(room, 2048));
    const std::int64_t tolerance = tolerant ? room / buckets : 0;
    std::vector<unit> best;
    double best_seconds = greedy_seconds * (1.0 - 1e-9);
    std::int64_t best_peak = 0;
    std::int64_t kept = budget;  // the peak the chosen schedule keeps
    if (lower) {
      // The lowest model peak a schedule reaches, down to the target: the least
      // budget (searched by halving, to 1/2048 of the peak) where the DP's plan,
      // in place of this chain's, keeps the model within it.
      const auto at = [&](std::int64_t model_budget) -> std::optional<std::pair<optimal_plan, std::int64_t>> {
        const auto chain_room = room - (budget - model_budget);
        if (chain_room <= 0) return std::nullopt;
        auto dp = optimal_segmentation(s, chain_room, static_cast<int>(std::min<std::int64_t>(chain_room, 2048)),
                                       limit, groups);
        if (!dp.feasible) return std::nullopt;
        auto trial = plan.units;
        trial[c] = dp.units;
        const auto peak = project_model_peak(chains, trial, in.static_bytes);
        if (peak > model_budget) return std::nullopt;
        return std::pair{std::move(dp), peak};
      };
      const auto resolution = std::max<std::int64_t>(1, plan.planned_peak / 2048);
      auto found = at(plan.target_bytes);
      std::int64_t found_budget = plan.target_bytes;
      if (!found) {
        std::int64_t lo = plan.target_bytes, hi = plan.planned_peak - resolution;  // lo fails
        std::optional<std::pair<optimal_plan, std::int64_t>> at_hi;
        if (hi > lo) at_hi = at(hi);
        if (at_hi) {
          while (hi - lo > resolution) {
            const auto mid = lo + (hi - lo) / 2;
            if (auto m = at(mid)) {
              hi = mid;
              at_hi = std::move(m);
            } else {
              lo = mid;
            }
          }
          found = std::move(at_hi);
          found_budget = hi;
        }
      }
      if (found && found->second + resolution < plan.planned_peak) {
        best = found->first.units;
        best_seconds = found->first.recompute_seconds;
        best_peak = found->second;
        kept = found_budget;
      }
    }
    auto consider = [&](std::int64_t dp_budget) {
      const auto dp = optimal_segmentation(s, dp_budget, buckets, limit, groups);
      if (!dp.feasible || dp.recompute_seconds >= best_seconds) return;
      auto trial = plan.units;
      trial[c] = dp.units;
      const auto peak = project_model_peak(chains, trial, in.static_bytes);
      if (peak > budget + tolerance) return;
      best = dp.units;
      best_seconds = dp.recompute_seconds;
      best_peak = peak;
    };
    if (best.empty() && buckets < room && buckets > n + 1)
      consider(room + tolerance + ((room + tolerance) * (n + 1) + buckets - n - 2) / (buckets - n - 1));
    if (best.empty()) consider(room + tolerance);
    if (best.empty()) continue;

    plan.overrides.push_back({c, greedy_seconds, best_seconds, plan.planned_peak, best_peak, kept});
    std::erase_if(plan.decisions, [c](const segment_decision& d) { return d.chain == c; });
    // The schedule's units in chain order, each checkpoint applied in turn.
    auto units = plan.units;
    units[c] = keep_all(s.size());
    auto peak = project_model_peak(chains, units, in.static_bytes);
    for (std::size_t i = 0; i < best.size(); ++i) {
      const auto& u = best[i];
      if (!u.checkpointed) {
        std::size_t j = i;
        while (j + 1 < best.size() && !best[j + 1].checkpointed) ++j;  // one line per kept run
        plan.decisions.push_back({c, u.first, best[j].last, false, rule_id::optimal_schedule, 0, 0.0, peak, peak});
        i = j;
        continue;
      }
      units[c] = with_checkpoint(units[c], u.first, u.last);
      const auto after = project_model_peak(chains, units, in.static_bytes);
      plan.decisions.push_back({c, u.first, u.last, true, rule_id::optimal_schedule,
                                checkpoint_frees(s, u.first, u.last), checkpoint_recompute_seconds(s, u.first, u.last), peak,
                                after});
      peak = after;
    }
    plan.units[c] = std::move(best);
    plan.planned_peak = best_peak;
    // A lowered peak holds for the chains after this one too.
    if (kept < budget) budget = std::max(plan.target_bytes, plan.planned_peak);
  }
}

}  // namespace memscale::core
