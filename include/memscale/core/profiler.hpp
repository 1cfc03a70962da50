// memscale — profiler: per-slot costs of a chain. Static first (shape
// propagation through core/layer_rules.hpp); a slot no rule covers is measured
// (the empirical fallback): run alone on an input of the propagated shape,
// `warmup_steps` times, measuring with the memory tracker the bytes it keeps for
// backward, its output, its workspace, and its forward and backward time.
// On CPU the bytes come from a memory_tracker::reporting_scope (LibTorch's own
// allocation reports; the CPU allocator stays whatever the program installed),
// or from the counting allocator where the program installed it. Where neither
// sees allocations, a slot's memory is its static estimate, or else what
// autograd saves, and the chain profile says so.
// Slots are measured one at a time, so profiling never needs the step's peak
// (core/slot_measurement.hpp). Twins, slots that are the same computation (a
// transformer's blocks), then get the median of their figures
// (core/twin_slots.hpp), so noise does not pick among them.
// Profiling draws no random numbers that training would see and leaves buffers
// (BatchNorm running statistics) as they were.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <memscale/config.hpp>
#include <memscale/core/graph.hpp>
#include <memscale/core/layer_rules.hpp>
#include <memscale/core/slot_measurement.hpp>
#include <memscale/core/slot_parts.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/core/tile_rules.hpp>
#include <memscale/core/twin_slots.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/draw_replay.hpp>
#include <memscale/detail/modules.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>
#include <memscale/offload/hooks.hpp>

namespace memscale::core {

/// A torch::nn::Sequential of the model, found by find_chains().
struct chain_ref {
  std::string path;  ///< dotted path from the root ("" when the root is the Sequential)
  std::shared_ptr<torch::nn::SequentialImpl> sequential;
};

/// Every Sequential in the tree that is not nested inside another one (a nested
/// Sequential is a slot of its parent chain). Pre-order, which for usual models
/// is execution order.
inline std::vector<chain_ref> find_chains(const std::shared_ptr<torch::nn::Module>& root) {
  std::vector<chain_ref> chains;
  for (const auto& item : root->named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(item.value());
    if (!seq) continue;
    const auto& path = item.key();
    const bool nested = std::any_of(chains.begin(), chains.end(), [&](const chain_ref& outer) {
      return outer.path.empty() || path.rfind(outer.path + ".", 0) == 0;
    });
    if (!nested) chains.push_back({path, seq});
  }
  return chains;
}

}  // namespace memscale::core


namespace memscale::core {

struct profile_options {
  bool use_static = true;
  bool use_empirical = true;
  int passes = 2;  ///< Config::warmup_steps (at least one pass runs)
  bool training = true;
  bool replay_draws = true;  ///< Config::replay_random_draws: a recompute saves its random draws' time
  bool products = true;      ///< Config::selective_recompute: measure each slot's matrix products
  /// Config::pack_saved_masks, recompute_saved_outputs, pack_saved_zeros: count
  /// what keeping each slot's saved tensors compact frees and costs.
  saved_compaction compaction{true, true, true};
  /// The bytes measuring a slot may hold above what lives when it starts (the
  /// room a budget leaves; core/slot_parts.hpp): a slot that would need more is
  /// measured on parts of the batch. Negative: no limit.
  std::int64_t room_bytes = -1;
  /// >= 0 (the offload engine's min_bytes, where Config::enable_offloading):
  /// measure what offloading each measured slot would leave on the device
  /// (slot_cost::offload_kept_bytes). Negative: not measured.
  std::int64_t offload_min_bytes = -1;
};

/// What a compaction scope does under `config`.
inline saved_compaction saved_compaction_of(const Config& config) {
  return {config.pack_saved_masks, config.recompute_saved_outputs, config.pack_saved_zeros};
}

/// `batch_scale`: the profile is measured at batch b for batch b * batch_scale
/// (memscale::predict's calibration): each saved view is as many times smaller,
/// so the census compares it with the engine's min_bytes as many times smaller.
inline profile_options profile_options_from(const Config& config, bool training, double batch_scale = 1.0) {
  // As offload::options_from sets the engine's min_bytes (a threshold past int64's range offloads nothing).
  const double min_bytes = std::min(config.async_config.value_or(AsyncOffloadConfig{}).min_offload_kb * 1024.0 /
                                        (batch_scale > 0.0 ? batch_scale : 1.0),
                                    9.0e18);
  return {config.use_static_profiling, config.use_empirical_fallback, std::max(1, config.warmup_steps), training,
          config.replay_random_draws, config.selective_recompute,
          saved_compaction_of(config), -1,
          config.enable_offloading ? static_cast<std::int64_t>(min_bytes) : -1};
}

/// `rule`'s cost (its bytes from a static rule) with what only running the
/// slot tells: its times, the draws and products a recompute keeps, what
/// compacting its saved tensors frees (at most what it saves) and costs,
/// whether it writes its input, and, with `workspace_seen` (its allocations
/// were, on the kernels the whole input runs), the measured workspace, forward
/// and backward: a rule's (a convolution's, a BatchNorm's) is only a fallback,
/// and a small batch's native convolution holds none.
inline slot_cost with_measured(slot_cost rule, const slot_cost& measured, bool workspace_seen = false) {
  if (workspace_seen) {
    rule.workspace_bytes = measured.workspace_bytes;
    rule.backward_workspace_bytes = measured.backward_workspace_bytes;
  }
  rule.forward_seconds = measured.forward_seconds;
  rule.backward_seconds = measured.backward_seconds;
  rule.replay_saved_seconds = measured.replay_saved_seconds;
  rule.replay_kept_bytes = measured.replay_kept_bytes;
  rule.product_saved_seconds = measured.product_saved_seconds;
  rule.product_kept_bytes = measured.product_kept_bytes;
  rule.returned_product_bytes = measured.returned_product_bytes;
  rule.compact_bytes = std::min(measured.compact_bytes, rule.saved_bytes);
  rule.compact_seconds = measured.compact_seconds;
  rule.compact_transient_bytes = std::min(measured.compact_transient_bytes, rule.compact_bytes);
  rule.mutates_input = measured.mutates_input;
  return rule;
}

/// Profiles the original `slots` of a chain for the given chain input. With
/// `slot_inputs` (one per slot: what each call site received, which need not be
/// the previous slot's output), each slot is profiled on its own input.
/// Throws ProfilingError when a slot can be profiled neither way.
inline chain_profile profile_chain(const std::string& path, std::vector<torch::nn::AnyModule> slots,
                                   const torch::Tensor& chain_input, const profile_options& options,
                                   const std::vector<torch::Tensor>* slot_inputs = nullptr,
                                   std::vector<std::string> names = {}) {
  chain_profile profile;
  profile.path = path;
  profile.input_shape = chain_input.sizes().vec();
  const auto device = chain_input.device();

  detail::rng_fork no_visible_draws({device});
  detail::isolating_span draws_apart;  // nor seen by a span it runs inside
  detail::buffer_restore keep_buffers(slots);
  // Measured once per process, before the allocations profiling watches.
  const auto rates = options.use_static ? detail::measured_compute_rates(device) : detail::compute_rates{};
  // Opened before any tensor profiling makes, so it sees their frees too.
  std::optional<memory_tracker::reporting_scope> reporting;
  if (device.is_cpu() && options.use_empirical && !memory_tracker::installed()) reporting.emplace();
  std::vector<std::string> unmeasured;  // slots whose bytes no allocation source saw
  std::string rule_workspace;           // slots whose workspace is the rule's, not measured
  const auto note_unmeasured = [&] {
    if (unmeasured.empty()) return;
    std::string slots_named;
    for (const auto& name : unmeasured) slots_named += (slots_named.empty() ? "" : ", ") + name;
    const std::string why = reporting && !reporting->active()
                                ? reporting->inactive_reason()
                                : "the CPU allocator in use (set with c10::SetCPUAllocator) does not report "
                                  "allocations to LibTorch's memory profiler";
    const std::string instead = offload::hooks_engine_active()
                                    ? "static rules where one exists, else the tensors autograd saves "
                                      "(workspace unmeasured)"
                                    : "static rules where one exists, else a guess (input and output kept)";
    profile.caveats.push_back("memory of slot(s) " + slots_named + " not measured: " + why + "; their bytes come from " +
                              instead + ". For measured figures, let the allocator delegate to "
                              "c10::GetDefaultCPUAllocator(), or call memscale::memory_tracker::install() (which "
                              "replaces it)");
  };
  auto input_of = [&](std::vector<std::int64_t> shape, c10::ScalarType dtype) {
    return layer_input{std::move(shape), dtype, options.training, device.type()};
  };
  layer_input current = input_of(chain_input.sizes().vec(), chain_input.scalar_type());
  torch::Tensor current_tensor = chain_input;  // real data while we have it

  for (std::size_t k = 0; k < slots.size(); ++k) {
    auto& slot = slots[k];
    profile.slot_names.push_back(k < names.size() ? names[k] : std::to_string(k) + " (" + slot.ptr()->name() + ")");
    if (slot_inputs != nullptr && k < slot_inputs->size() && (*slot_inputs)[k].defined()) {
      current_tensor = (*slot_inputs)[k];
      current = input_of(current_tensor.sizes().vec(), current_tensor.scalar_type());
    }
    // What tiling may do with this slot, from its input's shape; and whether a
    // checkpoint ending at it recomputes it (a plain Linear's, on real floating
    // inputs, does not: CheckpointSegment takes its gradients from its input).
    const auto shape_facts = [&, in = current](slot_cost cost) {
      cost.backward_from_input = detail::plain_linear(*slot.ptr()) != nullptr && c10::isFloatingType(in.dtype);
      cost.row_dims = row_independent_dims(*slot.ptr(), in);
      for (std::size_t d = 0; d < cost.input_extents.size() && d < in.shape.size(); ++d)
        cost.input_extents[d] = in.shape[d];
      if (!options.replay_draws) {  // a recompute draws again, and nothing is kept for it
        cost.replay_saved_seconds = 0.0;
        cost.replay_kept_bytes = 0;
      }
      return cost;
    };
    std::optional<layer_estimate> estimate;
    if (options.use_static) estimate = estimate_layer(*slot.ptr(), current);
    if (estimate) {
      // The rule gives the bytes, and the workspace where that run does not
      // measure it on the whole batch's kernels (with_measured). The times are
      // measured where the slot may be run (use_empirical_fallback), on a part
      // of the batch where it is large:
      // they are what recomputing it costs, which the rates alone model no
      // better than within 2-6x per layer type (a GELU's arithmetic, a
      // Dropout's random draws). Else, and under shape-only dispatch (predict:
      // its operators compute nothing, and its clock counts by the same rates),
      // from the rates.
      auto cost = detail::static_cost(*estimate, current.bytes(), rates);
      std::string note = "static rule; times from measured compute rates";
      bool workspace_seen = false;
      if (options.use_empirical && !detail::shape_only_dispatch()) {
        std::string over_room;
        if (const auto timed = detail::time_static_slot(slot, current, current_tensor, device, *estimate, rates,
                                                        options.passes, reporting ? &*reporting : nullptr,
                                                        options.products, options.compaction, options.room_bytes,
                                                        &over_room)) {
          workspace_seen = timed->workspace_seen;
          cost = with_measured(std::move(cost), timed->cost, timed->workspace_seen);
          note = timed->rows == (current.shape.empty() ? 0 : current.shape[0]) && timed->positions == 0
                     ? "static rule; times measured"
                     : "static rule; times measured on " + std::to_string(timed->rows) + " of " +
                           std::to_string(current.shape[0]) + " rows" +
                           (timed->positions > 0 ? " and " + std::to_string(timed->positions) + " of " +
                                                       std::to_string(current.shape[1]) + " positions"
                                                 : std::string()) +
                           ", scaled by its work";
        } else if (!over_room.empty()) {
          note += " (" + over_room + ")";
          profile.caveats.push_back("slot " + profile.slot_names.back() + " timed by the compute rates: " + over_room);
        }
      }
      // Under shape-only dispatch (predict) every rule's workspace is the rule's: no caveat.
      if (!workspace_seen && estimate->backward_workspace_bytes > 0 && !detail::shape_only_dispatch()) {
        note += "; workspace the rule's";
        rule_workspace += (rule_workspace.empty() ? "" : ", ") + profile.slot_names.back();
      }
      profile.slots.push_back(shape_facts(cost));
      profile.sources.push_back(profile_source::static_rule);
      profile.notes.push_back(std::move(note));
      current = input_of(estimate->output_shape, estimate->output_dtype);
      current_tensor = torch::Tensor();
      continue;
    }
    if (!options.use_empirical) {
      throw ProfilingError("memscale: no static rule covers chain '" + path + "' slot " +
                           profile.slot_names.back() +
                           " and use_empirical_fallback is false; enable it, or add a rule with "
                           "memscale::register_layer_rule<" + slot.ptr()->name() + "Impl>(...)");
    }
    auto input = current_tensor.defined() ? current_tensor : detail::synthetic_input(current, device);
    detail::measured_slot measured;
    std::string parts_note;  // measured on parts of the batch, or whole over the room
    try {
      measured = detail::measure_slot_within(slot, input, options.passes, reporting ? &*reporting : nullptr,
                                             options.products, options.compaction, options.room_bytes, parts_note,
                                             options.offload_min_bytes);
    } catch (const c10::Error& e) {
      profile.supported = false;
      profile.unsupported_reason = "slot " + profile.slot_names.back() + " failed on a tensor of shape " +
                                   c10::str(input.sizes()) + ": " + e.what_without_backtrace();
      note_unmeasured();
      return profile;
    }
    if (!measured.tensor_output) {
      profile.supported = false;
      profile.unsupported_reason = "slot " + profile.slot_names.back() + " does not return a single Tensor";
      note_unmeasured();
      return profile;
    }
    if (measured.bytes == detail::byte_source::allocations) {
      profile.slots.push_back(shape_facts(measured.cost));
      profile.sources.push_back(profile_source::empirical);
      profile.notes.emplace_back(std::string(options.use_static ? "no static rule: measured" : "measured") +
                                 (parts_note.empty() ? "" : "; " + parts_note));
      if (!parts_note.empty()) profile.caveats.push_back("slot " + profile.slot_names.back() + " " + parts_note);
    } else if (auto fallback = estimate_layer(*slot.ptr(), current)) {
      // Only reached with use_static_profiling off: its bytes beat unmeasured ones; the times are measured.
      const auto cost = with_measured(detail::static_cost(*fallback, measured.cost.input_bytes, detail::compute_rates{}),
                                      measured.cost);
      profile.slots.push_back(shape_facts(cost));
      profile.sources.push_back(profile_source::static_rule);
      profile.notes.emplace_back("allocations not seen: static rule for bytes, measured times");
      unmeasured.push_back(profile.slot_names.back());
    } else {
      profile.slots.push_back(shape_facts(measured.cost));
      profile.sources.push_back(profile_source::empirical);
      profile.notes.emplace_back(measured.bytes == detail::byte_source::saved_tensors
                                     ? "allocations not seen: saved bytes from autograd's saved tensors, "
                                       "workspace unmeasured, times measured"
                                     : "allocations not seen and saved-tensor hooks unavailable: input and "
                                       "output assumed kept, times measured");
      unmeasured.push_back(profile.slot_names.back());
    }
    current = input_of(measured.output.sizes().vec(), measured.output.scalar_type());
    current_tensor = measured.output;
  }
  note_unmeasured();
  if (!rule_workspace.empty())
    profile.caveats.push_back("workspace of slot(s) " + rule_workspace + " from the static rules (a convolution's "
                              "backward: its input's and output's bytes, or its weight's; a BatchNorm's: its "
                              "output's; as oneDNN and LibTorch hold them on CPU), not measured on the kernels the "
                              "whole batch runs");
  detail::pool_twins(profile, slots);  // the same computation, the same figures (core/twin_slots.hpp)
  return profile;
}

}  // namespace memscale::core
