// memscale — attachment, profiling and planning (execute/attachment.hpp has the
// class): plan() profiles the chains that have an input (capture_inputs, in
// attachment_apply.hpp, recorded what each receives), measures the static
// bytes and what the process holds outside the allocator, runs the decision
// engine (and the plan agreement) and merges the result into the Report.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iomanip>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/decision_masks.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/device/hardware.hpp>
#include <memscale/device/process_memory.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/attachment_levels.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/offload/engine.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/optim8bit.hpp>

namespace memscale::core {

inline void attachment::choose_strategy(const std::vector<chain_profile>& profiles,
                                        const std::vector<std::vector<slot_cost>>& costs,
                                        const std::vector<bool>& supported, engine_input& in,
                                        const c10::Device& device, Report& out) {
  const bool call_sites = std::any_of(chains_.begin(), chains_.end(),
                                      [](const managed_chain& c) { return c.source == chain_source::call_sites; });
  const auto context = strategy_context(profiles, costs, supported, in, device.is_cuda(),
                                        caller_config_.memory_budget_gb.has_value(), out.parameter_bytes, call_sites);
  out.strategy = run_stage1(caller_config_, context);
  if (out.strategy.context && chains_.size() > profiles.size())
    out.strategy.reason += " (decided from the " + std::to_string(profiles.size()) + " of " +
                           std::to_string(chains_.size()) +
                           " chains planned first; the chains planned later follow this choice)";
  config_ = out.strategy.effective;
  out.mode = config_.mode;
  in.mode = config_.mode;
  in.checkpointing_allowed = in.checkpointing_allowed && config_.enable_checkpointing;
  in.tiling_allowed = in.tiling_allowed && in.checkpointing_allowed && config_.enable_tiling;
  in.offload_allowed = in.offload_allowed && config_.enable_offloading;
  if (out.strategy.decision_source == DecisionSource::rule_fallback) log_.warn(out.strategy.reason);
  if (telemetry_.on() && out.strategy.decision_source != DecisionSource::user_config)
    telemetry_.emit(telemetry::policy_decided(facts_, out.strategy));
}

/// The optimizer state the plan reserves for parameter `p`: AdamW keeps two
/// moments of its size; AdamW8bit one byte each plus a float per block (small
/// tensors stay 32-bit).
inline std::int64_t optimizer_reserve_bytes(const Config& config, const torch::Tensor& p) {
  return config.use_8bit_optimizer ? optim::optimizer_state_bytes(p.numel(), true)
                                   : 2 * static_cast<std::int64_t>(p.nbytes());
}

/// What the chains `out` planned so far keep from their forwards while a later
/// chain runs (Report::earlier_chains_bytes).
inline std::int64_t earlier_chains_forward_bytes(const Report& out) {
  std::int64_t bytes = 0;
  for (std::size_t c = 0; c < out.chains.size(); ++c)
    bytes += project_chain(out.chains[c].slots, out.plan.units[c]).forward_end;
  return bytes;
}

/// The bytes profiling may hold for one slot under the budget
/// (profile_options::room_bytes): the usable bytes, less what the plan counts
/// against them (the model's parameters, buffers and gradients on the device,
/// the optimizer state it reserves) and the chains' inputs and the units'
/// recorded inputs, and what lives outside the allocator (CPU: where measured;
/// CUDA: the context and other processes' memory). On CUDA, where the device's
/// memory is what runs out, also whatever else the caching allocator holds
/// where that is more (other models, a later lazy plan's activations); on a
/// CPU the budget is the plan's, as its target is: another model in the
/// process does not shrink it. -1 on a CPU without memory_budget_gb: the
/// host's memory is no budget to plan within.
inline std::int64_t attachment::profiling_room(const std::vector<std::size_t>& which,
                                               const std::vector<torch::Tensor>& inputs, const Report& out) const {
  const auto device = inputs[which.front()].device();
  if (device.is_cpu() && !config_.memory_budget_gb) return -1;
  const auto usable = static_cast<std::int64_t>(
      static_cast<double>(memory_budget_bytes(config_.memory_budget_gb, out.hardware, device)) *
      config_.target_gpu_utilization);
  std::int64_t held = 0;
  std::unordered_set<const void*> counted;
  const auto count = [&](const torch::Tensor& t) {
    if (t.defined() && t.device() == device && t.has_storage() &&
        counted.insert(t.storage().unsafeGetStorageImpl()).second)
      held += static_cast<std::int64_t>(t.storage().nbytes());
  };
  if (auto root = root_.lock()) {
    for (const auto& p : root->parameters()) {
      count(p);
      if (p.device() != device || !p.requires_grad()) continue;
      if (!p.grad().defined()) held += static_cast<std::int64_t>(p.nbytes());  // the plan reserves it
      count(p.grad());
      held += optimizer_reserve_bytes(config_, p);
    }
    for (const auto& b : root->buffers()) count(b);
  }
  for (auto c : which) {
    count(inputs[c]);
    for (const auto& t : chains_[c].unit_inputs) count(t);
  }
  if (out.planned)  // a later (lazy) plan: the chains planned earlier keep their forward bytes meanwhile
    held += earlier_chains_forward_bytes(out) + out.outside_units_bytes;
  if (device.is_cpu()) {
    held += std::max<std::int64_t>(0, profile_outside_allocator_bytes());
  } else {
    try {  // the caching allocator's own count
      held = std::max(held, memory_tracker::current_bytes(device));
    } catch (const std::exception&) {
    }
    held += memscale::detail::memory_outside_caching_allocator(device);
  }
  return std::max<std::int64_t>(0, usable - held);
}

inline std::vector<std::vector<unit>> attachment::plan(std::vector<std::size_t>& which,
                                                       const std::vector<torch::Tensor>& inputs, Report& out) {
  const auto device = inputs[which.front()].device();
  bool training = true;
  if (auto root = root_.lock()) training = root->is_training();
  auto options = profile_options_from(config_, training, profile_batch_scale());
  options.room_bytes = profiling_room(which, inputs, out);
  if (options.room_bytes >= 0 && example_forward_transient_ > options.room_bytes)
    out.notes.push_back("the example forward, which records what each unit receives, held " +
                        detail::format_bytes(example_forward_transient_) + " above what it kept, more than the " +
                        detail::format_bytes(options.room_bytes) +
                        " the budget leaves for profiling beside what training keeps: it runs the whole example "
                        "batch without autograd and is not cut to that room (measuring the units keeps to it)");
  example_forward_transient_ = -1;  // said once
  detail::fault_point(detail::pipeline_stage::profile);
  // CPU: what the process holds beyond the allocator, measured over the
  // profiling here unless attach() measures from before the example forward.
  const bool measure_outside = device.is_cpu() && !out.planned && profile_outside_allocator_bytes() < 0;
  std::optional<outside_allocator_probe> own_probe;
  if (measure_outside && outside_probe_ == nullptr) own_probe.emplace();
  std::vector<chain_profile> profiles;
  for (auto c : which) profiles.push_back(profile_of(chains_[c], inputs[c], options));
  adjust_profiles(profiles);
  detail::fault_point(detail::pipeline_stage::plan);

  out.device = device.str();
  out.offload_async = config_.async_offload;
  out.budget_bytes = memory_budget_bytes(config_.memory_budget_gb, out.hardware, device);
  out.usable_bytes = static_cast<std::int64_t>(static_cast<double>(out.budget_bytes) *
                                               config_.target_gpu_utilization);
  if (!out.planned) {
    out.parameter_bytes = out.gradient_bytes = out.buffer_bytes = out.optimizer_reserve_bytes = 0;
    out.outside_allocator_bytes = out.outside_units_bytes = 0;
    if (device.is_cpu()) {
      std::int64_t outside = profile_outside_allocator_bytes();
      if (measure_outside) outside = (own_probe ? *own_probe : *outside_probe_).bytes();
      if (outside >= 0) {
        out.outside_allocator_bytes = outside;
      } else {
        out.notes.push_back("the process's resident peak could not be read (/proc/self, or a LibTorch profiler "
                            "holds the memory-reporting slot): what it holds outside LibTorch's allocator is "
                            "not reserved in the budget");
      }
      if (config_.memory_budget_gb && !process_memory_follows_allocator())
        out.notes.push_back(malloc_retention_advice() +
                            "; until then the process can hold well above the planned peak, and the CPU budget "
                            "does not hold for it");
    } else {  // CUDA: the context and libraries' handles count against the device's memory too
      out.outside_allocator_bytes = memscale::detail::memory_outside_caching_allocator(device);
    }
    if (auto root = root_.lock()) {
      for (const auto& p : root->parameters()) {
        if (p.device() != device) continue;
        out.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
        if (!p.requires_grad()) continue;
        out.gradient_bytes += static_cast<std::int64_t>(p.nbytes());
        out.optimizer_reserve_bytes += optimizer_reserve_bytes(config_, p);
      }
      for (const auto& b : root->buffers())
        if (b.device() == device) out.buffer_bytes += static_cast<std::int64_t>(b.nbytes());
    }
  } else {
    out.earlier_chains_bytes = earlier_chains_forward_bytes(out);
  }

  std::vector<std::vector<slot_cost>> costs;
  std::vector<bool> supported;
  for (const auto& p : profiles) {
    costs.push_back(p.slots);
    supported.push_back(p.supported && p.slots.size() == chains_[which[costs.size() - 1]].originals.size());
  }
  engine_input in;
  in.mode = config_.mode;
  in.checkpointing_allowed = config_.enable_checkpointing && static_cast<bool>(techniques_.checkpoint);
  in.force_optimize = config_.force_optimize;
  in.usable_bytes = out.usable_bytes;
  in.static_bytes = out.static_bytes();
  // config_ is Stage 1's effective copy once it has run: its narrowing holds for
  // every chain planned after the first too.
  in.tiling_allowed = in.checkpointing_allowed && config_.enable_tiling && static_cast<bool>(techniques_.tile);
  in.offload_allowed = config_.enable_offloading && static_cast<bool>(techniques_.offload);
  for (auto c : which) in.segment_limit.push_back(chains_[c].source == chain_source::sequential ? 0 : 1);
  if (chains_[which.front()].source == chain_source::whole_model) {  // the only chain then
    in.checkpointing_allowed = in.tiling_allowed = false;
    // Backward reads each tensor as it needs it (async: the groups fetched ahead too), and async
    // writes keep what waits for the tier alive (up to max_inflight_bytes, at the forward's end).
    const auto o = offload::options_from(config_);
    in.whole_model_held_bytes =
        std::max((1 + (o.async ? o.prefetch_depth : 0)) * whole_group_bytes, o.async ? o.max_inflight_bytes : 0);
  }
  // On CUDA this also finds out whether memscale's engine can run the
  // process's CUDA backwards at all (and hands them back to LibTorch's if not).
  if (in.offload_allowed || device.is_cuda()) {
    // Offload lives on saved-tensor hooks: without them it would save nothing.
    if (const auto why = offload::hooks_unavailable_reason(device); !why.empty() && in.offload_allowed) {
      in.offload_allowed = false;
      const auto note = "offload disabled: " + why + "; the plan uses the other techniques only";
      if (std::find(out.notes.begin(), out.notes.end(), note) == out.notes.end()) out.notes.push_back(note);
      log_.warn(note);
    }
  }
  if (in.offload_allowed) {
    const auto engine_options = offload::options_from(config_);
    const auto tiers = offload_room(
        device, engine_options,
        [&] { return caller_config_.auto_policy || offload_may_engage(costs, supported, in); },
        typical_offload_bytes(costs));
    // Chains planned earlier (lazy planning) already use part of the room.
    std::int64_t used = 0;
    for (std::size_t c = 0; c < out.chains.size() && c < out.plan.units.size(); ++c)
      used += project_chain(out.chains[c].slots, out.plan.units[c]).offloaded_bytes;
    tiers.set_input(in, used);
    // Chains planned later (lazily) keep a rate measured earlier, which the earlier chains' offloads were costed at.
    if (tiers.measured || !out.offload_rate_measured) {
      out.offload_bytes_per_second = tiers.bytes_per_second;
      out.offload_rate_measured = tiers.measured;
    }
    if (tiers.fast_bytes >= 0 && (tiers.spill_measured || !out.offload_spill_rate_measured))
      std::tie(out.offload_fast_bytes, out.offload_spill_bytes_per_second, out.offload_spill_rate_measured) =
          std::tuple(tiers.fast_bytes, tiers.spill_bytes_per_second, tiers.spill_measured);
    in.offload_min_bytes = engine_options.min_bytes;
  }
  if (!out.planned && caller_config_.auto_policy) choose_strategy(profiles, costs, supported, in, device, out);
  auto decided = decide(costs, supported, in);
  if (finer_) consider_finer_level(which, options, profiles, costs, supported, in, decided, out);
  selective_choice selective;
  if (config_.selective_recompute) {
    selective = choose_selective_recompute(costs, supported, in, decided);
    if (!selective.note.empty()) out.notes.push_back(selective.note);
  }
  compaction_choice masks;
  if (saved_compaction_of(config_).any()) {
    masks = choose_saved_compaction(costs, supported, in, decided);
    if (!masks.note.empty()) out.notes.push_back(masks.note);
    if (masks.changed && selective.changed)  // its note told of the plan before compacting
      std::replace(out.notes.begin(), out.notes.end(), selective.note,
                   selective.note + "; the plan taken keeps saved tensors compact (below), with " +
                       std::to_string(units_keeping_products(costs, decided)) +
                       " checkpointed unit(s) keeping their products");
  }
  if (agree_) {  // data parallel: every rank applies rank 0's plan; say where this rank's own differed
    const auto own = decided.units;
    decided = agree_(profiles, std::move(decided));
    if (decided.units != own) {
      const auto note = "data parallel: this rank's own plan (" +
                        std::to_string(count_units(own, &unit::checkpointed)) + " checkpointed, " +
                        std::to_string(count_units(own, &unit::offloaded)) +
                        " offloaded unit(s)) differed from rank 0's (" +
                        std::to_string(count_units(decided.units, &unit::checkpointed)) + " checkpointed, " +
                        std::to_string(count_units(decided.units, &unit::offloaded)) +
                        " offloaded), which every rank applies: its measurements or its Config differ";
      out.notes.push_back(note);
      log_.warn(note);
      // Which units keep their products was chosen for this rank's own plan: on
      // rank 0's, every checkpoint recomputes everything (no more memory than projected).
      if (selective.changed) {
        selective.changed = false;
        for (auto& chain : costs)
          for (auto& s : chain) s.keeps_products = false;
        out.notes.push_back("selective recompute: off on this rank, whose own plan it was chosen for");
      }
      // Saved tensors are kept compact only where rank 0's plan leaves the slot in place.
      if (masks.changed) {
        const auto in_place = detail_masks::left_in_place(costs, decided);
        for (std::size_t c = 0; c < costs.size(); ++c)
          for (std::size_t k = 0; k < costs[c].size(); ++k) {
            auto& s = costs[c][k];
            if (!s.compacts_saved || in_place[c][k]) continue;
            s.compacts_saved = false;
            s.saved_bytes += s.compact_bytes;
          }
      }
    }
  }
  // Each chain planned now takes this plan's choices (none where neither was taken).
  for (std::size_t i = 0; i < which.size() && i < costs.size(); ++i) {
    if (selective.changed || masks.changed) profiles[i].slots = costs[i];
    auto& keeps = chains_[which[i]].keeps_products;
    auto& packs = chains_[which[i]].compacts_saved;
    keeps.clear();
    packs.clear();
    for (const auto& s : costs[i]) {
      keeps.push_back(s.keeps_products);
      packs.push_back(s.compacts_saved);
    }
  }

  // Merge into the report: chains planned earlier stay; indices shift.
  const int offset = static_cast<int>(out.chains.size());
  for (auto& d : decided.decisions) d.chain += offset;
  for (auto& o : decided.overrides) o.chain += offset;
  if (!out.planned) {
    out.plan = decided;
  } else {
    out.plan.pressure = decided.pressure;
    out.plan.baseline_peak = decided.baseline_peak;
    out.plan.planned_peak = decided.planned_peak;
    out.plan.target_bytes = decided.target_bytes;
    out.plan.overall = decided.overall;
    out.plan.units.insert(out.plan.units.end(), decided.units.begin(), decided.units.end());
    out.plan.segment_length.insert(out.plan.segment_length.end(), decided.segment_length.begin(),
                                   decided.segment_length.end());
    out.plan.decisions.insert(out.plan.decisions.end(), decided.decisions.begin(), decided.decisions.end());
    out.plan.overrides.insert(out.plan.overrides.end(), decided.overrides.begin(), decided.overrides.end());
  }
  out.chains.insert(out.chains.end(), profiles.begin(), profiles.end());
  out.planned = true;
  for (const auto& o : decided.overrides) {
    const auto& path = out.chains[static_cast<std::size_t>(o.chain)].path;
    std::ostringstream note;
    note << "chain '" << (path.empty() ? "<root>" : path) << "': the optimal schedule (R11, core/optimal_chain.hpp) "
         << "replaced the greedy rules' segments, recompute " << std::setprecision(3) << o.greedy_seconds * 1e3
         << " -> " << o.optimal_seconds * 1e3 << " ms per step, projected peak " << detail::format_bytes(o.greedy_peak)
         << " -> " << detail::format_bytes(o.optimal_peak)
         << (o.optimal_peak > o.budget ? " (" + detail::format_bytes(o.optimal_peak - o.budget) +
                                             " above the greedy's minimum: within the schedule search's resolution, "
                                             "1/2048 of the chain's room)"
                                       : " (within " + detail::format_bytes(o.budget) + ")");
    out.notes.push_back(note.str());
  }
  // What replaying random masks takes off the plan's recompute (detail/draw_replay.hpp).
  double replay_saved = 0.0;
  int replaying_units = 0;
  for (std::size_t c = 0; c < decided.units.size() && c < profiles.size(); ++c) {
    const std::span<const slot_cost> s(profiles[c].slots);
    for (const auto& u : decided.units[c]) {
      if (!u.checkpointed || u.tiles > 1) continue;
      const int last = s[u.last].backward_from_input ? u.last - 1 : u.last;
      std::int64_t masks = 0;
      for (int k = u.first; k <= u.last; ++k) masks += s[k].replay_kept_bytes;
      if (masks == 0) continue;  // nothing kept: nothing replayed
      for (int k = u.first; k <= last; ++k) replay_saved += std::min(s[k].replay_saved_seconds, s[k].forward_seconds);
      ++replaying_units;
    }
  }
  if (replaying_units > 0) {
    std::ostringstream note;
    note << replaying_units << " checkpointed unit(s) replay the random masks their forwards drew (Dropout's), "
         << "kept a bit an element: their recompute skips " << std::setprecision(3) << replay_saved * 1e3
         << " ms of draws per step, counted in the plan (Config::replay_random_draws)";
    out.notes.push_back(note.str());
  }
  // A plan's cut reaches the process only if freed blocks leave it: say so on CPU
  // whatever the budget, once (with a budget, the note above already did).
  if (device.is_cpu() && decided.planned_peak < decided.baseline_peak && !process_memory_follows_allocator()) {
    const auto advice = malloc_retention_advice();
    const auto said = std::any_of(out.notes.begin(), out.notes.end(),
                                  [&](const std::string& n) { return n.rfind(advice, 0) == 0; });
    if (!said)
      out.notes.push_back(advice + "; until then the plan's cut of " +
                          detail::format_bytes(decided.baseline_peak - decided.planned_peak) +
                          " is LibTorch's allocator's, and the process may hold little less than without it");
  }
  if (light_touch(in, decided.baseline_peak)) {
    const auto note = std::string("force_optimize with nothing pressing: the light touch, the step's growth above the "
                                  "static bytes cut to ") +
                      std::to_string(static_cast<int>(100 * policy_for(in.mode).forced_growth_fraction)) +
                      "% of the baseline's, cheapest memory first (target " +
                      detail::format_bytes(decided.target_bytes) + ")";
    if (std::find(out.notes.begin(), out.notes.end(), note) == out.notes.end()) out.notes.push_back(note);
  } else if (in.force_optimize && in.mode != OptimizationMode::Aggressive &&
             decided.target_bytes == forced_target(in.mode, decided.baseline_peak, in.static_bytes)) {
    out.notes.push_back("force_optimize under pressure: the light touch's target (" +
                        detail::format_bytes(decided.target_bytes) + ") is below the mode's, and the plan aims at "
                        "the lower: a tighter budget never gets a lighter plan");
  }
  if (const auto note = target_note(decided, in.usable_bytes, config_.mode); !note.empty()) out.notes.push_back(note);
  if (in.whole_model_held_bytes > 0 && !decided.units.empty() && !decided.units[0].empty() &&
      decided.units[0][0].offloaded)
    out.notes.emplace_back("whole-model offload: while the guard lives, every tensor autograd saves on this thread "
                           "goes to the tiers, those of any other model trained on it too; calling this model's "
                           "layers through memscale::forward confines the plan to them (and allows checkpointing)");
  return decided.units;
}

}  // namespace memscale::core
