// memscale — attachment, applying a plan (execute/attachment.hpp has the class):
// capture_inputs runs the example forward once to learn what each chain
// receives; plan_and_apply and plan_on_first_call (the planning probe's lazy path) run
// commit_plan, which plans, builds every change in one transaction and commits
// it; apply_units turns a chain's units into technique wrappers in Sequential
// slots, call-site runners or a whole-model offload scope. Also the planning
// probe's forward.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <memscale/core/call_sites.hpp>
#include <memscale/core/layer_rules.hpp>
#include <memscale/core/memory_model.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/buffers.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/device/memory_tracker.hpp>
#include <memscale/errors.hpp>
#include <memscale/execute/attachment.hpp>
#include <memscale/execute/attachment_planning.hpp>
#include <memscale/execute/builtin_units.hpp>
#include <memscale/execute/managed_chain.hpp>
#include <memscale/execute/plan_log.hpp>
#include <memscale/observability/metrics.hpp>
#include <memscale/execute/planning_scope.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/concepts.hpp>
#include <memscale/techniques/saved_compaction.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/offload.hpp>

namespace memscale::core {

inline std::vector<torch::Tensor> attachment::capture_inputs(const std::function<void()>& forward) {
  detail::fault_point(detail::pipeline_stage::capture);
  sites_ = sites_state::recording;  // memscale::forward calls of the example forward are recorded
  std::vector<std::shared_ptr<InputCaptureImpl>> probes;
  slot_transaction probes_in_place;  // always rolled back: capture changes nothing
  // What the model's code between two chains holds as the second begins. A
  // chain's end is marked only where its last slot is a layer a static rule
  // covers (Tensor -> Tensor; an LSTM there returns a tuple): after a chain
  // with no mark, the next one's figure is not taken.
  auto clock = std::make_shared<capture_clock>();
  for (auto& chain : chains_) {
    const auto last = chain.originals.size() - 1;
    const bool marks_end = last == 0 || memscale::detail::rule_registry::global().knows(*chain.originals[last].ptr());
    probes.push_back(std::make_shared<InputCaptureImpl>(chain.originals.front(), clock,
                                                        last == 0 ? InputCaptureImpl::end::marked
                                                        : marks_end ? InputCaptureImpl::end::elsewhere
                                                                    : InputCaptureImpl::end::unmarked));
    probes_in_place.replace(*chain.ref.sequential, 0, torch::nn::AnyModule(probes.back()));
    if (last > 0 && marks_end)
      probes_in_place.replace(*chain.ref.sequential, last,
                              torch::nn::AnyModule(std::make_shared<ChainEndCaptureImpl>(chain.originals[last], clock)));
  }
  {
    auto root = root_.lock();
    MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
    torch::NoGradGuard no_grad;
    const auto devices = detail::devices_of(root->parameters());
    detail::rng_fork no_visible_draws(devices);
    detail::isolating_span draws_apart;
    detail::buffer_restore keep_buffers(*root);
    // What the forward holds above what it keeps (the inputs it records): it
    // runs the whole batch, not cut to the room a budget leaves (plan() says so).
    const c10::Device device = devices.empty() ? c10::Device(c10::kCPU) : devices.front();
    std::optional<memory_tracker::reporting_scope> reporting;
    if (device.is_cpu() && !memory_tracker::installed()) reporting.emplace();
    std::optional<memory_tracker::peak_scope> cpu_peak;
    if (device.is_cpu() && (!reporting || reporting->active())) cpu_peak.emplace();
    // CUDA: the device's peak is read, not reset (a caller's peak scope keeps its own); it
    // says nothing where an earlier peak was higher, or where memscale's CUDA support is not built.
    const auto device_peak = [&]() -> std::int64_t {
      try {
        return memory_tracker::peak_bytes(device);
      } catch (const std::exception&) {
        return -1;
      }
    };
    const auto cuda_before = device.is_cuda() ? device_peak() : -1;
    clock->bytes = [device] { return memory_tracker::current_bytes_if(device).value_or(-1); };
    clock->last_end = clock->now();
    try {
      forward();
    } catch (const c10::OutOfMemoryError&) {
      throw;  // the example forward did not fit: not a model memscale cannot attach to
    } catch (const c10::Error& e) {
      throw UnsupportedModelError(
          "memscale: running the example input through the model failed: " +
          std::string(e.what_without_backtrace()) +
          ". memscale runs the model's forward on the example input as given: pass the batch the forward takes "
          "in training (its shape, dtype and device)" +
          (chains_.empty() ? std::string()
                           : std::string(". If the example is right and the error is about the number or type of "
                                         "arguments, a Sequential's first slot does not take one Tensor, and that "
                                         "Sequential cannot be optimized")));
    }
    if (cpu_peak) {
      example_forward_transient_ = cpu_peak->peak() - memory_tracker::current_bytes();
    } else if (cuda_before >= 0) {
      if (const auto peak = device_peak(); peak > cuda_before)
        example_forward_transient_ = peak - memory_tracker::current_bytes(device);
    }
  }
  std::vector<torch::Tensor> inputs;
  for (std::size_t c = 0; c < probes.size(); ++c) {
    // A Sequential first reached inside a memscale::forward call is part of that unit.
    if (probes[c]->inside_call_site()) {
      chains_[c].planned = true;
      chains_[c].inside_call_site = true;
      inputs.emplace_back();
      continue;
    }
    inputs.push_back(probes[c]->captured());
    chains_[c].made_before_bytes = probes[c]->made_before_bytes();
  }
  return inputs;
}

inline void attachment::plan_and_apply(std::vector<torch::Tensor> inputs) {
  const observability::own_work_scope planning;  // profiling's backwards are no training steps
  inputs.resize(chains_.size());
  std::vector<std::size_t> ready;
  for (std::size_t c = 0; c < chains_.size(); ++c)
    if (inputs[c].defined()) ready.push_back(c);
  const bool captured = sites_.load() == sites_state::recording;
  if (captured) {
    for (auto c : add_call_chains(/*lazy=*/false)) {
      ready.push_back(c);
      inputs.push_back(chains_[c].unit_inputs.front());
    }
  }
  // No Sequential and no call site: what needs no unit boundaries, from the example.
  if (captured && chains_.empty() && allows_whole_model_offload() && whole_input_.defined()) {
    add_whole_model_chain();
    ready.push_back(0);
    inputs.push_back(whole_input_);
  }
  if (!captured && chains_.empty())
    report_.notes.emplace_back(
        "no torch::nn::Sequential: the units will be the memscale::forward calls of the first training forward "
        "(recorded then, planned at the next forward). A model with neither gets whole-model offload only when "
        "wrapped with an example input");
  if (captured && chains_.empty())
    throw UnsupportedModelError(
        "memscale: the model (" + root_name() + ") has no unit boundaries (no torch::nn::Sequential, and its "
        "example forward made no memscale::forward call that is a unit: a Tensor in, then arguments that need no "
        "gradient, one Tensor out), and what needs "
        "none cannot apply: " +
        (whole_forward_ ? std::string("offload is disabled (Config::enable_offloading, the Strategy, or "
                                      "memscale's autograd engine is not the default one)")
                        : std::string("its forward does not take and return one Tensor, so it cannot be profiled")) +
        ". Mark the blocks your forward loops over with `x = memscale::forward(*blocks[i], x);` (or keep them "
        "in a torch::nn::Sequential) to get checkpointing, tiling and per-unit offload" +
        [this] {
          const auto root = root_.lock();
          return root ? memscale::detail::builtin_stack_suffix(*root) : std::string();
        }());
  commit_plan(ready, inputs, /*probe_the_others=*/true);
  example_forward_transient_ = -1;  // said by this plan or by none: a later lazy plan has no example forward
  if (captured && sites_.load() == sites_state::recording) sites_ = sites_state::off;  // no call sites
}

inline torch::Tensor attachment::plan_on_first_call(std::size_t c, const torch::Tensor& x,
                                                    torch::nn::AnyModule& displaced) {
  std::lock_guard<std::mutex> planning(plan_mutex_);
  if (!chains_[c].planned) {
    std::vector<torch::Tensor> inputs(chains_.size());
    inputs[c] = x.detach();
    try {
      commit_plan({c}, inputs, /*probe_the_others=*/false, &displaced);
    } catch (...) {
      // Leave the chain as it was before wrap(), then report the failure.
      auto slot0 = chains_[c].ref.sequential->begin();
      if (slot0->ptr().get() != chains_[c].originals.front().ptr().get()) {
        if (displaced.is_empty()) displaced = std::move(*slot0);
        *slot0 = chains_[c].originals.front();
      }
      chains_[c].planned = true;
      throw;
    }
  }
  return chains_[c].ref.sequential->begin()->forward<torch::Tensor>(x);
}

inline void attachment::commit_plan(std::vector<std::size_t> ready, const std::vector<torch::Tensor>& inputs,
                                    bool probe_the_others, torch::nn::AnyModule* displaced) {
  planning_scope planning;
  Report next = report_;
  std::vector<std::vector<unit>> units;
  try {
    if (!ready.empty()) units = plan(ready, inputs, next);
  } catch (...) {
    finer_.reset();  // with its recorded inputs
    coarse_ids_.clear();
    throw;
  }
  finer_.reset();
  coarse_ids_.clear();
  pending_changes changes;
  bool first_change = true;
  for (std::size_t i = 0; i < ready.size(); ++i) {
    // plan() appended the profiles of `ready` last, in order.
    const auto& profile = next.chains[next.chains.size() - ready.size() + i];
    apply_units(ready[i], units[i], profile.supported, changes, first_change);
  }
  for (std::size_t c = 0; probe_the_others && c < chains_.size(); ++c) {
    if (chains_[c].source != chain_source::sequential || chains_[c].planned) continue;
    if (std::find(ready.begin(), ready.end(), c) != ready.end()) continue;
    changes.swaps.replace(*chains_[c].ref.sequential, 0,
                          torch::nn::AnyModule(std::make_shared<PlanningProbeImpl>(weak_from_this(), c,
                                                                                    chains_[c].originals.front())));
    after_first_change(first_change);
  }
  auto sequence = pending_sequence_;  // copies AnyModule handles only
  for (auto& [position, runner] : changes.runners) sequence[position].runner = std::move(runner);
  next.notes.insert(next.notes.end(), pending_notes_.begin(), pending_notes_.end());
  report_order_.reserve(report_order_.size() + ready.size());
  detail::fault_point(detail::pipeline_stage::commit);
  // Nothing below may throw: the slots are swapped, and a caller that saw an
  // exception would restore only some of them.
  changes.swaps.commit(displaced);
  for (auto c : ready) {
    report_order_.push_back(c);  // capacity reserved: cannot throw
    chains_[c].planned = true;
    chains_[c].unit_inputs.clear();  // the recorded activations are not needed any more
    for (auto* slots : {&chains_[c].originals, &chains_[c].group_slots})  // nor the recorded calls' arguments
      for (auto& slot : *slots)
        if (auto bound = slot.is_empty() ? nullptr : std::dynamic_pointer_cast<call_sites::BoundCallImpl>(slot.ptr()))
          bound->forget_recorded();
  }
  if (!pending_sequence_.empty()) {
    sequence_ = std::move(sequence);
    cursor_ = 0;
    diverged_ = false;
    cursor_epoch_ = offload::backwards_started();
    sites_ = sites_state::active;
  }
  pending_sequence_.clear();
  pending_notes_.clear();
  if (changes.whole_scope) whole_scope_ = std::move(changes.whole_scope);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(report_, next);
    observability::log_report(log_, report_);  // noexcept
    if (telemetry_.on()) telemetry_.emit(telemetry::plan_applied(facts_, config_, report_));  // noexcept
  }
}

inline void attachment::apply_units(std::size_t c, const std::vector<unit>& units, bool supported,
                                    pending_changes& changes, bool& first_change) {
  auto& chain = chains_[c];
  if (chain.source == chain_source::whole_model) {
    if (units.empty() || !units.front().offloaded) return;
    // The WholeModel slot registers the model: its parameters and buffers stay.
    changes.whole_scope = std::make_unique<offload_scope>(engine_for_plan(), detail::storages_of(chain.originals),
                                                          whole_group_bytes, root_name());
    after_first_change(first_change);
    return;
  }
  std::vector<torch::nn::AnyModule> target = chain.originals;
  std::vector<std::pair<std::size_t, torch::nn::AnyModule>> group_runners;  // call sites: outer calls run whole
  for (const auto& u : units) {
    if (!u.checkpointed && !u.offloaded) continue;
    // A group of call-site units runs as the outer call that holds them.
    const bool group = chain.is_group(u.first, u.last);
    MEMSCALE_ASSERT(group || u.first == u.last || chain.source != chain_source::call_sites,
                    "a plan spans call-site units that no one outer call holds");
    MEMSCALE_ASSERT(!group || (u.tiles <= 1 && !config_.use_mixed_precision),
                    "a plan tiles a group of call-site units, or runs one under mixed precision");
    std::vector<torch::nn::AnyModule> segment =
        group ? std::vector<torch::nn::AnyModule>{chain.original_of(u.first, u.last)}
              : std::vector<torch::nn::AnyModule>(chain.originals.begin() + u.first,
                                                  chain.originals.begin() + u.last + 1);
    wrap_context context;
    context.replay_random_draws = config_.replay_random_draws;
    context.keep_products = static_cast<std::size_t>(u.first) < chain.keeps_products.size() &&
                            chain.keeps_products[static_cast<std::size_t>(u.first)];
    if (u.checkpointed && u.tiles > 1) {
      MEMSCALE_ASSERT(techniques_.tile, "a plan tiles although the Strategy or Config excludes it");
      context.tiles = u.tiles;
      context.tile_dim = u.tile_dim;
      segment = {techniques_.tile(std::move(segment), context)};
    } else if (u.checkpointed) {
      MEMSCALE_ASSERT(techniques_.checkpoint, "a plan checkpoints although the Strategy excludes it");
      segment = {techniques_.checkpoint(std::move(segment), context)};
    }
    if (u.offloaded) {
      MEMSCALE_ASSERT(techniques_.offload, "a plan offloads although the Strategy or Config excludes it");
      context.offload_engine = engine_for_plan();
      segment = {techniques_.offload(std::move(segment), context)};
    }
    for (auto* wrapper = segment.front().ptr().get(); wrapper != nullptr;) {
      auto* gated = dynamic_cast<detail::gated*>(wrapper);
      if (gated == nullptr) break;
      gated->set_step_gate(gate_);
      // An offloaded checkpoint or tile: the segment inside it too.
      auto* offloaded = dynamic_cast<OffloadSegmentImpl*>(wrapper);
      wrapper = offloaded != nullptr && offloaded->slots().size() == 1 ? offloaded->slots().front().ptr().get() : nullptr;
    }
    if (group) {
      group_runners.emplace_back(chain.position_of(u.first, u.last), std::move(segment.front()));
      continue;
    }
    target[static_cast<std::size_t>(u.first)] = std::move(segment.front());
    for (int k = u.first + 1; k <= u.last; ++k)
      target[static_cast<std::size_t>(k)] = torch::nn::AnyModule(std::make_shared<PassThroughImpl>());
  }
  // The slots the plan leaves in place keep their saved tensors compact where it
  // chose that (not the inner calls of an outer call it runs whole).
  if (supported && !chain.compacts_saved.empty()) {
    std::vector<bool> run_whole(target.size(), false);
    for (const auto& u : units)
      if ((u.checkpointed || u.offloaded) && chain.is_group(u.first, u.last))
        for (int k = u.first; k <= u.last; ++k) run_whole[static_cast<std::size_t>(k)] = true;
    for (std::size_t k = 0; k < target.size() && k < chain.compacts_saved.size(); ++k)
      if (chain.compacts_saved[k] && !run_whole[k] && target[k].ptr() == chain.originals[k].ptr())
        target[k] = torch::nn::AnyModule(std::make_shared<CompactSavedSlotImpl>(
            std::move(target[k]), saved_compaction_of(config_)));
  }
  // A chain whose slots are not all Tensor -> Tensor runs as it is: the
  // autocast wrapper has one Tensor forward.
  if (config_.use_mixed_precision && supported)
    for (auto& slot : target)
      if (!std::dynamic_pointer_cast<PassThroughImpl>(slot.ptr()))
        slot = torch::nn::AnyModule(std::make_shared<AutocastSlotImpl>(std::move(slot)));
  if (chain.source == chain_source::call_sites) {
    for (std::size_t k = 0; k < target.size(); ++k)
      if (target[k].ptr() != chain.originals[k].ptr()) changes.runners.emplace_back(chain.positions[k], target[k]);
    for (auto& runner : group_runners) changes.runners.push_back(std::move(runner));
    return;
  }
  auto& seq = *chain.ref.sequential;
  auto it = seq.begin();
  for (std::size_t k = 0; k < target.size(); ++k, ++it) {
    if (it->ptr() == target[k].ptr()) continue;
    changes.swaps.replace(seq, k, std::move(target[k]));
    after_first_change(first_change);
  }
}

inline torch::Tensor PlanningProbeImpl::forward(torch::Tensor x) {
  // Planning replaces this very slot: the module and the AnyModule holder that
  // called us stay alive (in `displaced`) until we have returned to it.
  auto keep_alive = shared_from_this();
  torch::nn::AnyModule displaced;
  // Plan from a training call: an evaluation or no-grad first call would measure
  // nothing that backward keeps. Until then, the chain runs as it is.
  // Inside a memscale::forward call, a recompute or planning, the chain is part
  // of something being run or measured: it runs as it is.
  if (call_sites::depth() > 0 || detail::recompute_scope::current() != nullptr || planning_on_this_thread())
    return original_.forward<torch::Tensor>(std::move(x));
  auto owner = owner_.lock();
  if (owner && owner->training_call() && torch::GradMode::is_enabled() && !c10::InferenceMode::is_enabled()) {
    const detail::step_scope step(owner->step_gate().get());  // a second thread waits for no plan: refused
    return owner->plan_on_first_call(chain_, x, displaced);
  }
  return original_.forward<torch::Tensor>(std::move(x));
}

}  // namespace memscale::core
