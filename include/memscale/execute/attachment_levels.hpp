// memscale — attachment, the level of nested call sites (execute/attachment.hpp
// has the class). A block whose forward calls memscale::forward on its own parts
// (attention, MLP) offers two levels of units: the blocks, or their parts. A
// part can free much memory for little recompute (an MLP: wide activations
// behind two matrix products) where its neighbour frees little for much (an
// attention core on a CPU, where dropout's draws dominate), so which level is
// cheaper depends on the model and the machine. add_call_chains builds both;
// plan() plans both at the same target and keeps the one that gets there with
// less projected recompute and transfer (where neither gets there, the lower
// peak). The finer level can checkpoint a whole block as its parts, one after
// the other: that keeps one input more per part, but recomputes one part at a
// time in backward. Also how any chain is profiled for planning (profile_of,
// adjust_profiles).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/decision_engine.hpp>
#include <memscale/core/decision_selective.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/planning_scope.hpp>

namespace memscale::core {

namespace detail_levels {

/// Bytes a chain keeps once its forward is done, nothing checkpointed.
inline std::int64_t kept_after_forward(const std::vector<slot_cost>& slots) {
  return project_chain(slots, keep_all(slots.size())).forward_end;
}

}  // namespace detail_levels

inline chain_profile attachment::profile_of(const managed_chain& chain, const torch::Tensor& input,
                                            const profile_options& options) const {
  torch::AutoGradMode grad_on(true);  // profiling measures what backward keeps
  auto profile = chain.source == chain_source::call_sites
                     ? profile_chain(chain.ref.path, chain.originals, input, options, &chain.unit_inputs, chain.unit_names)
                     : profile_chain(chain.ref.path, chain.originals, input, options);
  if (!profile.slots.empty()) profile.slots[0].made_before_bytes = chain.made_before_bytes;
  return profile;
}

inline void attachment::adjust_profiles(std::vector<chain_profile>& profiles) const {
  if (const double scale = profile_batch_scale(); scale != 1.0)
    for (auto& p : profiles) scale_profile(p, scale);
  // Under autocast a checkpointed run's closing Linear is recomputed like the
  // rest (its gradients come from its input only in full precision): planned so.
  if (config_.use_mixed_precision)
    for (auto& p : profiles)
      for (auto& slot : p.slots) slot.backward_from_input = false;
}

inline bool attachment::consider_finer_level(std::vector<std::size_t>& which, const profile_options& options,
                                             std::vector<chain_profile>& profiles,
                                             std::vector<std::vector<slot_cost>>& costs, std::vector<bool>& supported,
                                             engine_input& in, engine_plan& decided, Report& out) {
  auto finer = std::move(*finer_);
  finer_.reset();
  const auto coarse_ids = std::move(coarse_ids_);
  coarse_ids_.clear();
  const auto k = coarse_ids.size();
  // The coarser level's chains are the last ones planned here and the last made.
  if (k == 0 || which.size() < k || !std::equal(coarse_ids.begin(), coarse_ids.end(), which.end() - static_cast<std::ptrdiff_t>(k)) ||
      coarse_ids.front() + k != chains_.size())
    return false;
  // Nothing to do at the coarser level: nothing to do more cheaply.
  if (!detail_levels::acts(decided)) return false;
  const auto head = which.size() - k;  // chains planned beside them (Sequentials)
  const auto depth_name = [](int d) { return "depth " + std::to_string(d); };

  std::vector<chain_profile> fine_profiles;
  try {
    for (const auto& chain : finer.chains)
      fine_profiles.push_back(profile_of(chain, chain.unit_inputs.front(), options));
  } catch (const ProfilingError& e) {
    out.notes.push_back("call sites: the calls at " + depth_name(finer.depth) + " were not weighed as units: " +
                        e.what());
    return false;
  } catch (const c10::Error& e) {  // out of memory, or a unit that fails on its input: the coarser plan stands
    out.notes.push_back("call sites: the calls at " + depth_name(finer.depth) + " were not weighed as units: " +
                        e.what_without_backtrace());
    return false;
  }
  adjust_profiles(fine_profiles);

  auto fine_costs = costs;
  auto fine_supported = supported;
  fine_costs.resize(head);
  fine_supported.resize(head);
  for (std::size_t i = 0; i < fine_profiles.size(); ++i) {
    fine_costs.push_back(fine_profiles[i].slots);
    fine_supported.push_back(fine_profiles[i].supported &&
                             fine_profiles[i].slots.size() == finer.chains[i].originals.size());
  }
  // What the outer calls keep beside their inner calls (a norm, a residual
  // add between them) no finer unit frees: fixed, like the parameters.
  std::int64_t coarse_kept = 0, fine_kept = 0;
  for (std::size_t i = head; i < costs.size(); ++i) coarse_kept += detail_levels::kept_after_forward(costs[i]);
  for (std::size_t i = head; i < fine_costs.size(); ++i) fine_kept += detail_levels::kept_after_forward(fine_costs[i]);
  const auto outside = std::max<std::int64_t>(0, coarse_kept - fine_kept);

  auto fine_in = in;
  fine_in.static_bytes += outside;
  fine_in.fixed_target = decided.target_bytes;
  fine_in.segment_limit.resize(head);
  fine_in.segment_limit.insert(fine_in.segment_limit.end(), fine_costs.size() - head, 1);
  // A group of units one outer call holds may be one run: that call checkpointed
  // whole. Not under mixed precision (its runner would autocast the outer call's
  // own code too), nor where the last unit's gradients come from its input alone
  // (projected not recomputed, where the outer call recomputes all of it).
  fine_in.segment_groups.assign(head, {});
  for (std::size_t i = 0; i < finer.chains.size(); ++i) {
    auto& ends = finer.chains[i].group_end;
    const auto& slots = fine_costs[head + i];
    for (auto& end : ends)
      if (end >= 0 && (config_.use_mixed_precision || static_cast<std::size_t>(end) >= slots.size() ||
                       slots[static_cast<std::size_t>(end)].backward_from_input))
        end = -1;
    fine_in.segment_groups.push_back(ends);
  }
  auto fine = decide(fine_costs, fine_supported, fine_in);

  const double coarse_s = detail_levels::extra_seconds(costs, decided, in);
  const double fine_s = detail_levels::extra_seconds(fine_costs, fine, in);
  const bool coarse_fits = decided.planned_peak <= decided.target_bytes;
  const bool fine_fits = fine.planned_peak <= decided.target_bytes;
  // A finer plan that changes nothing "fits" only where the two levels' projections of the same model
  // disagree (a static rule against measured parts): the coarser plan, which acts, stands.
  const bool take = fine.overall != rule_id::low_pressure_skip && fine.overall != rule_id::checkpointing_disabled &&
                    detail_levels::acts(fine) &&
                    detail_levels::better_at_target(decided, coarse_s, fine, fine_s, decided.target_bytes);

  int coarse_units = 0, fine_units = 0;
  for (std::size_t i = head; i < costs.size(); ++i) coarse_units += static_cast<int>(costs[i].size());
  for (std::size_t i = head; i < fine_costs.size(); ++i) fine_units += static_cast<int>(fine_costs[i].size());
  std::ostringstream note;
  const int chosen = take ? finer.depth : level_;
  note << std::fixed << std::setprecision(1) << "call sites: the calls nest; planned at " << depth_name(chosen)
       << " (" << (fine_fits != coarse_fits ? "only it reaches the target"
                   : fine_fits             ? "both reach the target: the less recompute and transfer"
                                           : "neither reaches the target: the lower peak, or the less recompute at equal peaks")
       << "). Target " << detail::format_bytes(decided.target_bytes) << "; the " << coarse_units << " unit(s) at "
       << depth_name(level_) << ": projected peak " << detail::format_bytes(decided.planned_peak) << ", "
       << coarse_s * 1e3 << " ms of recompute and transfer per step; the " << fine_units << " at "
       << depth_name(finer.depth) << ": " << detail::format_bytes(fine.planned_peak) << ", " << fine_s * 1e3
       << " ms (with " << detail::format_bytes(outside) << " the outer calls keep outside the inner ones, fixed)";
  if (!take) {
    out.notes.push_back(note.str());
    return false;
  }

  // The finer level replaces the coarser: its chains (the coarser ones were
  // never applied), its call sequence and notes, and its plan.
  // What profiling the coarser units said (their caveats: units measured on
  // parts of the batch, bytes no allocation source saw) stays said.
  for (std::size_t i = head; i < profiles.size(); ++i)
    for (const auto& caveat : profiles[i].caveats)
      out.notes.push_back("call sites at " + depth_name(level_) + ", profiled before the finer level was taken: " +
                          caveat);
  chains_.resize(coarse_ids.front());
  which.resize(head);
  for (auto& chain : finer.chains) {
    chains_.push_back(std::move(chain));
    which.push_back(chains_.size() - 1);
  }
  profiles.resize(head);
  profiles.insert(profiles.end(), std::make_move_iterator(fine_profiles.begin()),
                  std::make_move_iterator(fine_profiles.end()));
  costs = std::move(fine_costs);
  supported = std::move(fine_supported);
  decided = std::move(fine);
  level_ = finer.depth;
  pending_sequence_ = std::move(finer.sequence);
  const auto whole = keep_outer_calls_run_whole(head, which, decided);
  // What the chosen level was planned with, for choose_selective_recompute to
  // plan it again: only the groups this plan runs whole remain groups.
  in = std::move(fine_in);
  for (std::size_t i = head; i < which.size() && i < in.segment_groups.size(); ++i)
    for (std::size_t k = 0; k < in.segment_groups[i].size(); ++k)
      if (k >= chains_[which[i]].group_end.size() || chains_[which[i]].group_end[k] < 0) in.segment_groups[i][k] = -1;
  outer_level_ = whole.empty() ? -1 : finer.outer_depth;
  const auto coarse_notes = std::min(coarse_note_count_, pending_notes_.size());
  pending_notes_.erase(pending_notes_.begin(), pending_notes_.begin() + static_cast<std::ptrdiff_t>(coarse_notes));
  pending_notes_.insert(pending_notes_.begin(), finer.notes.begin(), finer.notes.end());
  out.outside_units_bytes = outside;
  if (!whole.empty()) {
    note << "; " << whole.size() << " outer call(s) checkpointed whole, their inner calls one run (";
    for (std::size_t k = 0; k < whole.size(); ++k) note << (k ? ", " : "") << path_of(whole[k]);
    note << ")";
  }
  out.notes.push_back(note.str());
  return true;
}

inline std::vector<const torch::nn::Module*> attachment::keep_outer_calls_run_whole(
    std::size_t head, const std::vector<std::size_t>& which, const engine_plan& decided) {
  std::vector<bool> whole(pending_sequence_.size(), false);
  for (std::size_t i = head; i < which.size(); ++i) {
    const auto& chain = chains_[which[i]];
    for (const auto& u : decided.units[i])
      if (chain.is_group(u.first, u.last)) whole[chain.position_of(u.first, u.last)] = true;
  }
  // Only the outer calls a group runs as stay in the sequence; the others run
  // directly, as at the coarser depths, and the positions move up.
  std::vector<std::size_t> moved(pending_sequence_.size(), 0);
  std::vector<planned_call> kept;
  std::vector<const torch::nn::Module*> run_whole;
  for (std::size_t p = 0; p < pending_sequence_.size(); ++p) {
    moved[p] = kept.size();
    if (whole[p]) run_whole.push_back(pending_sequence_[p].module);
    if (pending_sequence_[p].depth == level_ || whole[p]) kept.push_back(std::move(pending_sequence_[p]));
  }
  pending_sequence_ = std::move(kept);
  for (std::size_t i = head; i < which.size(); ++i) {
    auto& chain = chains_[which[i]];
    for (auto& p : chain.positions) p = moved[p];
    for (std::size_t k = 0; k < chain.group_end.size(); ++k) {
      if (chain.group_end[k] < 0) continue;
      if (whole[chain.group_positions[k]]) chain.group_positions[k] = moved[chain.group_positions[k]];
      else chain.group_end[k] = -1;  // not run as one
    }
  }
  return run_whole;
}

}  // namespace memscale::core
