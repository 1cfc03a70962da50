// memscale — Stage 2: the deterministic rule engine. From per-slot costs, the
// static bytes and the usable memory it computes the memory pressure, decides
// whether to act (smart skip), picks checkpoint segment boundaries per chain, and
// expands checkpointing segment by segment, best savings per recompute second
// first, until the projected peak fits; then the optimal schedule replaces a
// chain's greedy segments where it recomputes less within the same peak. Every
// decision records the rule behind it.
// Plain data and constexpr functions throughout: tests run it in static_assert.
// Its input and output types are in core/decisions.hpp, its phases in
// core/decision_phases.hpp and core/decision_optimal.hpp (R11); decide() below runs them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>
#include <vector>

#include <memscale/config.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/decision_optimal.hpp>
#include <memscale/core/decision_phases.hpp>
#include <memscale/core/decisions.hpp>
#include <memscale/core/memory_model.hpp>

namespace memscale::core {

/// The rule engine. `supported[c]` false leaves chain c alone.
[[nodiscard]] constexpr engine_plan decide(const std::vector<std::vector<slot_cost>>& chains,
                                           const std::vector<bool>& supported, const engine_input& in) {
  engine_plan plan;
  for (const auto& c : chains) {
    plan.units.push_back(keep_all(c.size()));
    plan.segment_length.push_back(1);
  }
  plan.baseline_peak = project_model_peak(chains, plan.units, in.static_bytes);
  plan.planned_peak = plan.baseline_peak;
  plan.pressure = in.usable_bytes > 0
                      ? static_cast<double>(plan.baseline_peak) / static_cast<double>(in.usable_bytes)
                      : 1e9;
  const auto policy = policy_for(in.mode);
  // force_optimize aims at the lower of the mode's target and the light touch's,
  // so that a tighter budget never gets a lighter plan (where nothing presses,
  // the light touch's is the lower).
  const auto mode_target = static_cast<std::int64_t>(policy.target_fraction * static_cast<double>(in.usable_bytes));
  plan.target_bytes = in.fixed_target > 0 ? in.fixed_target
                     : in.force_optimize
                         ? std::min(mode_target, forced_target(in.mode, plan.baseline_peak, in.static_bytes))
                         : mode_target;

  auto whole_chain_decisions = [&](rule_id rule) {
    for (int c = 0; c < static_cast<int>(chains.size()); ++c)
      if (!chains[c].empty())
        plan.decisions.push_back({c, 0, static_cast<int>(chains[c].size()) - 1, false,
                                  supported[c] ? rule : rule_id::unsupported_chain, 0, 0.0,
                                  plan.baseline_peak, plan.baseline_peak});
  };
  if (!in.checkpointing_allowed && !in.offload_allowed) {
    plan.overall = rule_id::checkpointing_disabled;
    whole_chain_decisions(rule_id::checkpointing_disabled);
    return plan;
  }
  if (!in.force_optimize && plan.pressure < policy.act_at_pressure) {
    plan.overall = rule_id::low_pressure_skip;
    whole_chain_decisions(rule_id::low_pressure_skip);
    return plan;
  }
  if (!in.checkpointing_allowed) {
    whole_chain_decisions(rule_id::checkpointing_disabled);
    plan.overall = rule_id::checkpointing_disabled;
    if (in.whole_model_held_bytes > 0)
      assign_whole_model_offload(chains, in, plan);
    else
      assign_offload(chains, supported, in, plan);
    return plan;
  }

  const auto limit_of = [&](int c) {
    return static_cast<std::size_t>(c) < in.segment_limit.size() ? in.segment_limit[static_cast<std::size_t>(c)] : 0;
  };
  std::vector<detail_engine::candidate> candidates;
  for (int c = 0; c < static_cast<int>(chains.size()); ++c) {
    const auto& s = chains[c];
    if (s.empty()) continue;
    if (!supported[c]) {
      plan.decisions.push_back({c, 0, static_cast<int>(s.size()) - 1, false, rule_id::unsupported_chain, 0,
                                0.0, plan.baseline_peak, plan.baseline_peak});
      continue;
    }
    plan.segment_length[c] = choose_segment_length(s, limit_of(c));
    for (const auto& u : segments_of_length(s, plan.segment_length[c], limit_of(c))) {
      if (!u.checkpointed) continue;
      candidates.push_back(
          {c, u.first, u.last, checkpoint_frees(s, u.first, u.last), checkpoint_recompute_seconds(s, u.first, u.last)});
    }
  }
  std::sort(candidates.begin(), candidates.end(), detail_engine::better);

  // Greedy expansion; a second pass retries runs that gave nothing the first time
  // (the peak may have moved to them once others were checkpointed). A gain
  // under least_gain counts as none.
  const std::int64_t least = least_gain(plan, in);
  std::vector<bool> settled(candidates.size(), false);
  for (int pass = 0; pass < 2; ++pass) {
    const bool last_pass = pass == 1;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      if (settled[i]) continue;
      const auto& cand = candidates[i];
      if (plan.planned_peak <= plan.target_bytes) {
        plan.decisions.push_back({cand.chain, cand.first, cand.last, false, rule_id::keep_fits, cand.frees,
                                  cand.seconds, plan.planned_peak, plan.planned_peak});
        settled[i] = true;
        continue;
      }
      auto trial = plan.units;
      trial[cand.chain] = with_checkpoint(plan.units[cand.chain], cand.first, cand.last);
      const auto peak = project_model_peak(chains, trial, in.static_bytes);
      if (plan.planned_peak - peak >= least) {
        plan.decisions.push_back({cand.chain, cand.first, cand.last, true, rule_id::checkpoint_segment,
                                  cand.frees, cand.seconds, plan.planned_peak, peak});
        plan.units = std::move(trial);
        plan.planned_peak = peak;
        settled[i] = true;
      } else if (last_pass) {
        plan.decisions.push_back({cand.chain, cand.first, cand.last, false, rule_id::keep_no_gain, cand.frees,
                                  cand.seconds, plan.planned_peak, peak});
      }
    }
  }
  // Refinement: still above target, try every run inside the slots left plain,
  // best peak reduction per recompute second first, until it fits or nothing helps.
  for (std::size_t round = 0; plan.planned_peak > plan.target_bytes && round < 4 * candidates.size(); ++round) {
    segment_decision best{};
    double best_score = 0.0;
    std::vector<unit> best_units;
    for (int c = 0; c < static_cast<int>(chains.size()); ++c) {
      if (!supported[c]) continue;
      const auto& s = chains[c];
      for (const auto& u : plan.units[c]) {
        if (u.checkpointed || s[u.first].mutates_input) continue;
        // u is one kept slot; extend over the following kept slots, up to twice the
        // chain's segment length (longer runs recompute more than they free).
        const int longest = std::min(static_cast<int>(s.size()),
                                     u.first + (limit_of(c) > 0 ? limit_of(c) : 2 * plan.segment_length[c]));
        for (int last = u.first; last < longest; ++last) {
          bool all_kept = true;
          for (const auto& v : plan.units[c])
            if (v.first <= last && v.last >= u.first && v.checkpointed) all_kept = false;
          if (!all_kept) break;
          auto trial = plan.units;
          trial[c] = with_checkpoint(plan.units[c], u.first, last);
          const auto peak = project_model_peak(chains, trial, in.static_bytes);
          if (plan.planned_peak - peak < least) continue;
          const double seconds = checkpoint_recompute_seconds(s, u.first, last);
          const double score = static_cast<double>(plan.planned_peak - peak) / (seconds + 1e-12);
          if (score > best_score) {
            best_score = score;
            best = {c, u.first, last, true, rule_id::refine_segment, checkpoint_frees(s, u.first, last), seconds,
                    plan.planned_peak, peak};
            best_units = trial[c];
          }
        }
      }
    }
    if (best_units.empty()) break;
    plan.units[best.chain] = std::move(best_units);
    plan.planned_peak = best.peak_after;
    plan.decisions.push_back(best);
  }
  plan.overall = rule_id::checkpoint_segment;
  // Where no plan reaches the target (Aggressive: the minimum), the greedy's peak
  // is itself a projection at the DP's resolution: an optimal schedule one DP
  // level above it may recompute much less (the benchmark's flat chain: 165 ms
  // against 201, 32 KiB above 156 MiB). It is taken only if, tiled and offloaded
  // as well, its step peak stays within that resolution of the strict plan's (with
  // offload the strict plan's segments may offload more: there it stays).
  //
  // At the minimum, the optimal schedule keeps the greedy's checkpoint peak for
  // less recompute, but its segments may offload less than the greedy's (runs
  // that end at a Linear keep less of their own to move): the greedy's segments,
  // tiled and offloaded as well, stay where that plan peaks lower
  // (better_final_plan; Aggressive on the flat chain once Dropout's recompute
  // was cheap: 188 against 204 MiB).
  const bool at_minimum = plan.target_bytes < plan.planned_peak;
  engine_plan tolerant = plan;  // copied whatever at_minimum: GCC's constant evaluation rejects a conditional copy
  engine_plan lowered = plan;
  engine_plan greedy = plan;
  assign_optimal(chains, supported, in, plan);
  assign_tiling(chains, supported, in, plan);
  assign_offload(chains, supported, in, plan);
  if (at_minimum && !plan.overrides.empty()) {
    assign_tiling(chains, supported, in, greedy);
    assign_offload(chains, supported, in, greedy);
    if (detail_engine::better_final_plan(chains, in, greedy, plan)) plan = std::move(greedy);
  }
  if (at_minimum) {
    assign_optimal(chains, supported, in, tolerant, /*tolerant=*/true);
    if (!tolerant.overrides.empty()) {
      assign_tiling(chains, supported, in, tolerant);
      assign_offload(chains, supported, in, tolerant);
      if (tolerant.planned_peak <= plan.planned_peak + plan.planned_peak / 2048 &&
          recompute_seconds(chains, tolerant.units) < recompute_seconds(chains, plan.units))
        plan = std::move(tolerant);
    }
    // Call sites' groups (segment_groups) checkpointed whole can reach below the
    // greedy's single units: taken where, tiled and offloaded as well, that plan
    // reaches the target and the other does not, or peaks lower, or peaks the
    // same for less recompute and transfer.
    const bool groups = std::any_of(in.segment_groups.begin(), in.segment_groups.end(),
                                    [](const std::vector<int>& ends) { return has_groups(ends); });
    if (groups) assign_optimal(chains, supported, in, lowered, /*tolerant=*/false, /*lower_with_groups=*/true);
    if (groups && !lowered.overrides.empty()) {
      assign_tiling(chains, supported, in, lowered);
      assign_offload(chains, supported, in, lowered);
      if (detail_engine::better_final_plan(chains, in, lowered, plan)) plan = std::move(lowered);
    }
  }
  return plan;
}

/// Whether a plan of these chains could offload: checkpointing and tiling alone
/// leave the projected peak above the target (the offload phase runs), or reach
/// it only by checkpointing something (a tiled unit is checkpointed too). The
/// choices made after the first plan (a finer level of units, selective
/// recompute, compacted saved tensors) plan again with offloading allowed, and
/// may then take a transfer for a recompute: on the benchmark GPT under a
/// budget, 1-2 offloaded units where this plan had none, costed at the nominal
/// 1 GB/s where the disk measured 800 MB/s. Where neither, no plan weighs an
/// offload's transfer rate.
[[nodiscard]] constexpr bool offload_may_engage(const std::vector<std::vector<slot_cost>>& chains,
                                                const std::vector<bool>& supported, engine_input in) {
  in.offload_allowed = false;
  const auto plan = decide(chains, supported, in);
  return plan.overall != rule_id::low_pressure_skip &&
         (plan.planned_peak > plan.target_bytes || count_units(plan.units, &unit::checkpointed) > 0);
}

}  // namespace memscale::core
