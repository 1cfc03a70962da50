// memscale — selective recompute in the plan (Config::selective_recompute): a
// checkpointed unit may keep its matrix products' outputs from forward to
// backward and recompute only the rest (detail/product_replay.hpp). That frees
// less than recomputing everything, for less recompute, so it pays where the
// products are expensive and their outputs small beside what the unit frees
// (a transformer's MLP on a GPU), and not where the rest dominates. The choice
// is per unit: from the plan that recomputes everything, each checkpointed
// unit in turn, the most recompute saved per byte kept first, is planned again
// keeping its products (the decision engine adds units to make up the room it
// takes), and each is kept where the plan gets better at the same target
// (better_at_target); then every unit keeping them at once. The units'
// choices live in slot_cost::keeps_products, so every projection (the greedy,
// the optimal schedule, the Report) counts them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <memscale/core/decision_engine.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/device/hardware.hpp>

namespace memscale::core {

namespace detail_levels {

/// What a plan adds to a step: its recompute, and its transfers both ways at
/// the tiers' rates (engine_input::offload_transfer_seconds; the engine overlaps
/// them with compute where it can; every plan compared is charged alike).
inline double extra_seconds(const std::vector<std::vector<slot_cost>>& costs, const engine_plan& plan,
                            const engine_input& in) {
  return recompute_seconds(costs, plan.units) + in.offload_transfer_seconds(offloaded_bytes(costs, plan.units));
}

/// Whether a plan changes anything: a unit checkpointed or offloaded.
inline bool acts(const engine_plan& plan) {
  return count_units(plan.units, &unit::checkpointed) + count_units(plan.units, &unit::offloaded) > 0;
}

/// Whether plan `b` beats `a` at a target both were planned for: the one that
/// reaches it; both: the less recompute and transfer (by a margin over the
/// profiling's noise); neither: the lower peak, or the less recompute at peaks
/// within the schedule search's resolution.
inline bool better_at_target(const engine_plan& a, double a_seconds, const engine_plan& b, double b_seconds,
                             std::int64_t target) {
  const bool a_fits = a.planned_peak <= target, b_fits = b.planned_peak <= target;
  const bool cheaper = b_seconds < 0.98 * a_seconds;
  if (a_fits != b_fits) return b_fits;
  if (b_fits) return cheaper;
  const auto resolution = std::max<std::int64_t>(1, a.planned_peak / 2048);
  return b.planned_peak + resolution < a.planned_peak || (b.planned_peak <= a.planned_peak + resolution && cheaper);
}

}  // namespace detail_levels

namespace detail_selective {

/// A run keeps its products or not as a whole (one checkpoint): where the
/// engine made a run of slots some of which keep them, all of them do.
/// Returns whether it changed a slot.
inline bool whole_runs(std::vector<std::vector<slot_cost>>& costs, const engine_plan& plan) {
  bool changed = false;
  for (std::size_t c = 0; c < costs.size() && c < plan.units.size(); ++c)
    for (const auto& u : plan.units[c]) {
      if (!u.checkpointed || u.tiles > 1) continue;
      bool any = false;
      for (int k = u.first; k <= u.last; ++k) any = any || costs[c][static_cast<std::size_t>(k)].keeps_products;
      for (int k = u.first; any && k <= u.last; ++k) {
        auto& s = costs[c][static_cast<std::size_t>(k)];
        changed = changed || !s.keeps_products;
        s.keeps_products = true;
      }
    }
  return changed;
}

/// The runs of several units in chains of call sites (segment_limit 1): outer
/// calls checkpointed whole, whose place in the call sequence the plan being
/// improved has fixed.
inline std::vector<std::pair<std::size_t, unit>> group_runs(const engine_plan& plan, const engine_input& in) {
  std::vector<std::pair<std::size_t, unit>> runs;
  for (std::size_t c = 0; c < plan.units.size(); ++c)
    if (c < in.segment_limit.size() && in.segment_limit[c] == 1)
      for (const auto& u : plan.units[c])
        if (u.checkpointed && u.last > u.first) runs.emplace_back(c, u);
  return runs;
}

struct candidate {
  std::vector<std::vector<slot_cost>> costs;
  engine_plan plan;
  double seconds = 0.0;
};

inline candidate plan_with(std::vector<std::vector<slot_cost>> costs, const std::vector<bool>& supported,
                           const engine_input& in) {
  candidate k;
  k.costs = std::move(costs);
  k.plan = decide(k.costs, supported, in);
  if (whole_runs(k.costs, k.plan)) k.plan.planned_peak = project_model_peak(k.costs, k.plan.units, in.static_bytes);
  k.seconds = detail_levels::extra_seconds(k.costs, k.plan, in);
  return k;
}

}  // namespace detail_selective

/// What choose_selective_recompute chose, for the Report.
struct selective_choice {
  bool changed = false;  ///< some units keep their products
  std::string note;
};

/// Plans `costs` again with units keeping their products (the file comment
/// says how) at `decided`'s target; where that is better, `costs` and `decided`
/// become it. Units whose products are worth nothing (none, or no time) are
/// not tried; nothing is tried in Aggressive mode.
inline selective_choice choose_selective_recompute(std::vector<std::vector<slot_cost>>& costs,
                                                   const std::vector<bool>& supported, const engine_input& in,
                                                   engine_plan& decided) {
  using detail_selective::candidate;
  selective_choice choice;
  // Aggressive plans for the least memory, which every kept product raises:
  // not tried there (and so its plan does not hang on the products' timing).
  if (in.mode == OptimizationMode::Aggressive || !detail_levels::acts(decided) ||
      count_units(decided.units, &unit::checkpointed) == 0)
    return choice;
  auto fixed = in;
  fixed.fixed_target = decided.target_bytes;
  const auto target = decided.target_bytes;
  candidate best{costs, decided, detail_levels::extra_seconds(costs, decided, in)};
  const auto full_peak = best.plan.planned_peak;  // recomputing everything
  const auto full_seconds = best.seconds;

  // Each unit the plan checkpoints, the most products' time per byte kept first.
  struct unit_ref {
    std::size_t chain;
    unit u;
    double per_byte;
  };
  std::vector<unit_ref> order;
  for (std::size_t c = 0; c < costs.size() && c < decided.units.size(); ++c)
    for (const auto& u : decided.units[c]) {
      if (!u.checkpointed || u.tiles > 1) continue;
      double seconds = 0.0;
      std::int64_t bytes = 0;
      for (int k = u.first; k <= u.last; ++k) {
        seconds += costs[c][static_cast<std::size_t>(k)].product_saved_seconds;
        bytes += costs[c][static_cast<std::size_t>(k)].product_kept_bytes;
      }
      if (seconds > 0.0 && bytes > 0) order.push_back({c, u, seconds / static_cast<double>(bytes)});
    }
  if (order.empty()) {
    choice.note = "selective recompute: no checkpointed unit has matrix products whose time was measured; every "
                  "checkpoint recomputes everything (Config::selective_recompute)";
    return choice;
  }
  std::stable_sort(order.begin(), order.end(), [](const unit_ref& a, const unit_ref& b) { return a.per_byte > b.per_byte; });
  const auto groups = detail_selective::group_runs(decided, in);
  const auto consider = [&](const std::vector<std::vector<slot_cost>>& trial_costs) {
    auto trial = detail_selective::plan_with(trial_costs, supported, fixed);
    if (!detail_levels::acts(trial.plan) || detail_selective::group_runs(trial.plan, in) != groups ||
        !detail_levels::better_at_target(best.plan, best.seconds, trial.plan, trial.seconds, target))
      return;
    best = std::move(trial);
  };
  for (const auto& r : order) {
    if (best.costs[r.chain][static_cast<std::size_t>(r.u.first)].keeps_products) continue;  // already
    auto trial = best.costs;
    for (int k = r.u.first; k <= r.u.last; ++k) trial[r.chain][static_cast<std::size_t>(k)].keeps_products = true;
    consider(trial);
  }
  auto every = costs;
  for (auto& chain : every)
    for (auto& s : chain) s.keeps_products = s.product_kept_bytes > 0;
  consider(every);

  int keeping = 0;
  std::int64_t held = 0;  // what the chosen checkpoints keep of their products
  for (std::size_t c = 0; c < best.plan.units.size() && c < costs.size(); ++c)
    for (const auto& u : best.plan.units[c])
      if (u.checkpointed && u.tiles <= 1 && best.costs[c][static_cast<std::size_t>(u.first)].keeps_products) {
        ++keeping;
        held += run_replay_kept_bytes(best.costs[c], u.first, u.last) - run_replay_kept_bytes(costs[c], u.first, u.last);
      }
  choice.changed = keeping > 0;
  std::ostringstream note;
  note << std::fixed << std::setprecision(1) << "selective recompute: ";
  if (choice.changed)
    note << keeping << " checkpointed unit(s) keep their matrix products' outputs (" << detail::format_bytes(held)
         << ") and recompute the rest: projected peak " << detail::format_bytes(best.plan.planned_peak) << ", "
         << best.seconds * 1e3 << " ms of recompute and transfer per step, against "
         << detail::format_bytes(full_peak) << ", " << full_seconds * 1e3
         << " ms recomputing everything";
  else
    note << "every checkpoint recomputes everything: keeping a unit's products was no better at this target ("
         << order.size() << " unit(s) tried; recomputing everything: projected peak "
         << detail::format_bytes(full_peak) << ", " << full_seconds * 1e3 << " ms per step)";
  note << "; target " << detail::format_bytes(target) << " (Config::selective_recompute)";
  choice.note = note.str();
  if (choice.changed) {
    costs = std::move(best.costs);
    decided = std::move(best.plan);
  }
  return choice;
}

}  // namespace memscale::core
