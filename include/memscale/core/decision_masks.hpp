// memscale — saved tensors kept compact in the plan (Config::pack_saved_masks,
// recompute_saved_outputs, pack_saved_zeros): the units a plan leaves in place
// may keep their saved masks (a Dropout's scaled noise) a bit an element,
// compute again in backward the outputs whose inputs are saved anyway (a
// LayerNorm's, a GELU's, a Dropout's product), and keep tensors whose rows end
// in +0 (causal softmax) without those tails (techniques/saved_compaction.hpp). That frees
// those bytes at about a pass over them, where checkpointing a unit frees
// everything it keeps for its whole recompute. So the decision engine plans
// again on costs whose saved bytes are less what compacting frees, at the
// target the plan was made for: it may then checkpoint fewer units, or cheaper
// ones, or none. The plan is kept where it gets better at that target
// (better_at_target), counting the compaction's time beside the recompute. The
// slots left in place carry slot_cost::compacts_saved (and their saved bytes
// less their compact_bytes), so every projection and the Report count it;
// checkpointed and offloaded slots keep their saved tensors as they are (their
// recompute and their transfer see them so).
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
#include <memscale/core/decision_selective.hpp>
#include <memscale/core/memory_model.hpp>

namespace memscale::core {

namespace detail_masks {

/// Per chain, per slot: whether the plan leaves it in place (in no checkpointed or offloaded unit).
inline std::vector<std::vector<bool>> left_in_place(const std::vector<std::vector<slot_cost>>& costs,
                                                    const engine_plan& plan) {
  std::vector<std::vector<bool>> kept;
  for (std::size_t c = 0; c < costs.size(); ++c) {
    kept.emplace_back(costs[c].size(), true);
    if (c >= plan.units.size()) continue;
    for (const auto& u : plan.units[c])
      if (u.checkpointed || u.offloaded)
        for (int k = u.first; k <= u.last && k < static_cast<int>(costs[c].size()); ++k)
          kept[c][static_cast<std::size_t>(k)] = false;
  }
  return kept;
}

/// `plain` with every slot's saved tensors kept compact where `in_place` says (all slots where it is empty).
inline std::vector<std::vector<slot_cost>> packed_costs(const std::vector<std::vector<slot_cost>>& plain,
                                                        const std::vector<std::vector<bool>>& in_place = {}) {
  auto costs = plain;
  for (std::size_t c = 0; c < costs.size(); ++c)
    for (std::size_t k = 0; k < costs[c].size(); ++k) {
      auto& s = costs[c][k];
      const bool here = in_place.empty() || in_place[c][k];
      if (!here || s.compact_bytes <= 0) continue;
      s.saved_bytes -= std::min(s.compact_bytes, s.saved_bytes);
      s.compacts_saved = true;
    }
  return costs;
}

/// The step time compacting adds in the slots that do it.
inline double compaction_seconds(const std::vector<std::vector<slot_cost>>& costs) {
  double seconds = 0.0;
  for (const auto& chain : costs)
    for (const auto& s : chain)
      if (s.compacts_saved) seconds += s.compact_seconds;
  return seconds;
}

}  // namespace detail_masks

/// What choose_saved_compaction chose, for the Report.
struct compaction_choice {
  bool changed = false;  ///< the slots left in place keep their saved tensors compact
  std::string note;
};

/// Plans `costs` again with the saved tensors of the slots left in place kept
/// compact (the file comment says how) at `decided`'s target; where that is better,
/// `costs` and `decided` become it. Not tried where the plan applies nothing
/// (nothing presses: the model is left alone) or no slot has anything to compact.
inline compaction_choice choose_saved_compaction(std::vector<std::vector<slot_cost>>& costs, const std::vector<bool>& supported,
                                       const engine_input& in, engine_plan& decided) {
  compaction_choice choice;
  std::int64_t masks = 0;
  for (const auto& chain : costs)
    for (const auto& s : chain) masks += s.compact_bytes;
  if (masks <= 0 || !detail_levels::acts(decided)) return choice;
  auto fixed = in;
  fixed.fixed_target = decided.target_bytes;
  const auto target = decided.target_bytes;
  const double plain_seconds = detail_levels::extra_seconds(costs, decided, in);

  // The engine plans on costs all compacted; only the slots its plan leaves in
  // place keep them so (a checkpoint's recompute and an offload's
  // transfer see them as they are), which can lift the projection: planned
  // again on those costs, up to three times, the best plan at the target stands.
  detail_selective::candidate trial;
  std::vector<std::vector<slot_cost>> chosen;
  double trial_seconds = 0.0;
  auto planning = detail_masks::packed_costs(costs);
  for (int round = 0; round < 3; ++round) {
    auto k = detail_selective::plan_with(std::move(planning), supported, fixed);
    auto honest = detail_masks::packed_costs(costs, detail_masks::left_in_place(costs, k.plan));
    for (std::size_t c = 0; c < honest.size(); ++c)
      for (std::size_t j = 0; j < honest[c].size(); ++j) honest[c][j].keeps_products = k.costs[c][j].keeps_products;
    k.plan.planned_peak = project_model_peak(honest, k.plan.units, in.static_bytes);
    const double seconds = detail_levels::extra_seconds(honest, k.plan, in) +
                           detail_masks::compaction_seconds(honest);
    const bool first = round == 0;
    if (first || detail_levels::better_at_target(trial.plan, trial_seconds, k.plan, seconds, target)) {
      trial = std::move(k);
      chosen = honest;
      trial_seconds = seconds;
    }
    if (trial.plan.planned_peak <= target) break;
    planning = std::move(honest);
  }
  std::int64_t packed = 0;
  int slots = 0;
  for (const auto& chain : chosen)
    for (const auto& s : chain)
      if (s.compacts_saved) {
        packed += s.compact_bytes;
        ++slots;
      }
  const bool reaches = trial.plan.planned_peak <= target;
  const auto groups = detail_selective::group_runs(trial.plan, in).size();
  const auto plain_groups = detail_selective::group_runs(decided, in).size();
  const bool take = slots > 0 && (detail_levels::acts(trial.plan) || reaches) &&
                    detail_levels::better_at_target(decided, plain_seconds, trial.plan, trial_seconds, target);
  std::ostringstream note;
  note << std::fixed << std::setprecision(1) << "saved tensors kept compact: ";
  if (take) {
    note << slots << " slot(s) left in place keep their saved masks as bits, compute again the outputs whose "
         << "inputs they save and drop their saved rows' trailing zeros (" << detail::format_bytes(packed) << " less a step): projected peak "
         << detail::format_bytes(trial.plan.planned_peak) << ", "
         << (trial_seconds - detail_masks::compaction_seconds(chosen)) * 1e3 << " ms of recompute and transfer and "
         << detail_masks::compaction_seconds(chosen) * 1e3 << " ms of compacting per step ("
         << count_units(trial.plan.units, &unit::checkpointed) << " checkpointed unit(s)), against " << detail::format_bytes(decided.planned_peak) << ", "
         << plain_seconds * 1e3 << " ms (" << count_units(decided.units, &unit::checkpointed) << ") keeping them as they are";
    if (groups != plain_groups)
      note << "; outer calls checkpointed whole: " << groups << ", against " << plain_groups
           << " (the call-site note above is the plan without it)";
  } else {
    note << "not taken: the plan that compacts what it leaves in place was no better at this target ("
         << detail::format_bytes(trial.plan.planned_peak) << ", " << trial_seconds * 1e3 << " ms against "
         << detail::format_bytes(decided.planned_peak) << ", " << plain_seconds * 1e3 << " ms)";
  }
  note << "; target " << detail::format_bytes(target) << " (Config::pack_saved_masks, recompute_saved_outputs, pack_saved_zeros)";
  choice.note = note.str();
  if (!take) return choice;
  // An offload decision was weighed on the costs compacted everywhere; the unit
  // it offloads keeps its saved tensors as they are (a Dropout's mask as bytes,
  // not bits): its line says what it moves in the plan taken, the units offloaded
  // again in the decisions' order (so that the lines add up to the plan's bytes).
  auto replay = trial.plan.units;
  for (auto& units : replay)
    for (auto& u : units) u.offloaded = false;
  std::int64_t so_far = 0;  // what the units offloaded again move
  for (auto& d : trial.plan.decisions) {
    if (!d.offloaded || d.rule != rule_id::offload_segment) continue;
    auto& units = replay[static_cast<std::size_t>(d.chain)];
    const auto it = std::find_if(units.begin(), units.end(),
                                 [&d](const unit& u) { return u.first == d.first && u.last == d.last; });
    if (it == units.end()) continue;
    it->offloaded = true;
    const auto now = offloaded_bytes(chosen, replay);
    d.freed_bytes = now - so_far;
    so_far = now;
  }
  cost_offloads_in_forward_order(in, trial.plan);  // each one's transfer, for the bytes it moves now
  trial.plan.baseline_peak = decided.baseline_peak;  // the model as it is, saved tensors and all
  trial.plan.pressure = decided.pressure;
  costs = std::move(chosen);
  decided = std::move(trial.plan);
  choice.changed = true;
  return choice;
}

/// How the Report's note begins where the plan's projected peak exceeds the usable bytes.
inline constexpr const char* unreachable_budget_note = "the budget is out of reach";

/// The note on a plan whose projected peak stays above its target: over the
/// usable bytes (the budget itself is not met) whatever the rule that ended
/// it; within them, where checkpointing (and tiling) stopped short of
/// Balanced's or Conservative's target. Empty elsewhere.
inline std::string target_note(const engine_plan& decided, std::int64_t usable, OptimizationMode mode) {
  const auto peak = detail::format_bytes(decided.planned_peak);
  if (decided.planned_peak > usable)
    return std::string(unreachable_budget_note) + ": the projected peak " + peak + " exceeds the " +
           detail::format_bytes(usable) +
           " usable (the budget, or the device's memory, times target_gpu_utilization), and it is the lowest peak "
           "the " + std::string(to_string(mode)) +
           " rules found with the techniques enabled: the step may run out of memory, or on a CPU hold more than "
           "the budget" +
           (mode == OptimizationMode::Aggressive ? "" : " (Aggressive plans for the least memory)") +
           "; a smaller batch, more techniques or a larger budget would fit";
  const bool tiled = decided.overall == rule_id::tile_segment;
  if ((decided.overall != rule_id::checkpoint_segment && !tiled) || decided.planned_peak <= decided.target_bytes ||
      mode == OptimizationMode::Aggressive)
    return {};
  return "the projected peak " + peak + " stays above the target " + detail::format_bytes(decided.target_bytes) +
         ", within the " + detail::format_bytes(usable) + " usable: " +
         (tiled ? "checkpointing and tiling" : "checkpointing") +
         " alone cannot reach the target; this is the lowest peak the rules found";
}

/// The checkpointed units of `plan` that keep their matrix products as applied
/// (untiled, flagged at their first slot: attachment_apply reads that one).
inline int units_keeping_products(const std::vector<std::vector<slot_cost>>& costs, const engine_plan& plan) {
  int n = 0;
  for (std::size_t c = 0; c < plan.units.size() && c < costs.size(); ++c)
    for (const auto& u : plan.units[c])
      if (u.checkpointed && u.tiles <= 1 && costs[c][static_cast<std::size_t>(u.first)].keeps_products) ++n;
  return n;
}

}  // namespace memscale::core
