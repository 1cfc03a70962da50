// memscale — executor, part 3: the Executor. It swaps forward slots of each torch::nn::Sequential chain
// for technique wrappers and puts the originals back on detach. The chain's
// registered children never change, so parameters(), named_parameters(), state
// dicts and optimizers see the same tensors under the same names. An attachment
// is registered against the model's root module so detach() can find it. Every
// step either completes or is rolled back: a throwing wrap leaves the model as it was.
// Threads: wrap/detach/is_optimized may be called from any thread, but not while
// the model runs a forward elsewhere; without an example input, the first
// training forward plans and swaps slots, so make it from one thread.
#pragma once

#include <algorithm>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <memscale/config.hpp>
#include <memscale/core/decision_engine.hpp>
#include <memscale/core/hardware.hpp>
#include <memscale/core/plan.hpp>
#include <memscale/core/profiler.hpp>
#include <memscale/core/registry.hpp>
#include <memscale/core/slots.hpp>
#include <memscale/detail/assert.hpp>
#include <memscale/detail/fault_injection.hpp>
#include <memscale/detail/rng.hpp>
#include <memscale/errors.hpp>
#include <memscale/observability/log.hpp>
#include <memscale/offload/engine.hpp>
#include <memscale/offload/hooks.hpp>
#include <memscale/techniques/checkpoint.hpp>
#include <memscale/techniques/mixed_precision.hpp>
#include <memscale/techniques/offload.hpp>
#include <memscale/techniques/optim8bit.hpp>
#include <memscale/techniques/tile.hpp>

namespace memscale::core {

/// What the Strategy and the Config allow: the Strategy's way to wrap a run of
/// slots per technique (empty when the Strategy or the Config excludes it).
struct technique_set {
  using wrap_fn = std::function<torch::nn::AnyModule(std::vector<torch::nn::AnyModule>, const wrap_context&)>;
  wrap_fn checkpoint;
  wrap_fn offload;
  wrap_fn tile;
};

/// Nominal one-way rates the planner assumes for an offload transfer (the
/// engine's statistics report what a step really took).
inline constexpr double nominal_host_link_bytes_per_second = 16e9;  // pinned PCIe copies
inline constexpr double nominal_disk_bytes_per_second = 1e9;        // a local SSD

class attachment;

/// Slot 0 of a chain whose plan waits for its first input (wrap without an example).
class PlanningProbeImpl : public torch::nn::Module {
 public:
  PlanningProbeImpl(std::weak_ptr<attachment> owner, std::size_t chain, torch::nn::AnyModule original)
      : torch::nn::Module("memscale::PlanningProbe"),
        owner_(std::move(owner)),
        chain_(chain),
        original_(std::move(original)) {}
  torch::Tensor forward(torch::Tensor x);

 private:
  std::weak_ptr<attachment> owner_;
  std::size_t chain_;
  torch::nn::AnyModule original_;
};

/// Whether a slot holds one of memscale's wrappers.
inline bool is_memscale_slot(const torch::nn::AnyModule& slot) {
  const auto& p = slot.ptr();
  return std::dynamic_pointer_cast<CheckpointSegmentImpl>(p) || std::dynamic_pointer_cast<OffloadSegmentImpl>(p) ||
         std::dynamic_pointer_cast<TileSegmentImpl>(p) ||
         std::dynamic_pointer_cast<PassThroughImpl>(p) || std::dynamic_pointer_cast<AutocastSlotImpl>(p) ||
         std::dynamic_pointer_cast<PlanningProbeImpl>(p) || std::dynamic_pointer_cast<InputCaptureImpl>(p);
}

struct managed_chain {
  chain_ref ref;
  std::vector<torch::nn::AnyModule> originals;
  bool planned = false;
};

class attachment : public std::enable_shared_from_this<attachment> {
 public:
  attachment(const std::shared_ptr<torch::nn::Module>& root, std::vector<chain_ref> chains, Config config,
             technique_set techniques)
      : root_(root), config_(std::move(config)), techniques_(techniques) {
    for (auto& ref : chains) {
      managed_chain chain{std::move(ref), {}, false};
      for (const auto& slot : *chain.ref.sequential) chain.originals.push_back(slot);
      chains_.push_back(std::move(chain));
    }
    report_.mode = config_.mode;
    report_.hardware = detect_hardware();
    add_technique_notes();
  }

  [[nodiscard]] Report report() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return report_;
  }

  /// The offload engine, once a plan offloaded something (else null).
  [[nodiscard]] std::shared_ptr<offload::engine> offload_engine() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_;
  }

  /// Runs `forward` once (no grad, no visible RNG draws, buffers restored) to learn
  /// what each chain receives. Chains the forward never reaches get no input.
  std::vector<torch::Tensor> capture_inputs(const std::function<void()>& forward) {
    detail::fault_point(detail::pipeline_stage::capture);
    std::vector<std::shared_ptr<InputCaptureImpl>> probes;
    slot_transaction probes_in_place;  // always rolled back: capture changes nothing
    for (auto& chain : chains_) {
      probes.push_back(std::make_shared<InputCaptureImpl>(chain.originals.front()));
      probes_in_place.replace(*chain.ref.sequential, 0, torch::nn::AnyModule(probes.back()));
    }
    {
      auto root = root_.lock();
      MEMSCALE_ASSERT(root != nullptr, "the model outlived its wrap() call");
      torch::NoGradGuard no_grad;
      detail::rng_fork no_visible_draws(detail::devices_of(root->parameters()));
      detail::buffer_restore keep_buffers(*root);
      try {
        forward();
      } catch (const c10::Error& e) {
        throw UnsupportedModelError(
            "memscale: running the example input through the model failed: " +
            std::string(e.what_without_backtrace()) +
            ". memscale needs each Sequential's first slot to take one Tensor; if the error is about the "
            "number or type of arguments, that Sequential cannot be optimized");
      }
    }
    std::vector<torch::Tensor> inputs;
    for (const auto& probe : probes) inputs.push_back(probe->captured());
    return inputs;
  }

  /// Profiles, plans and applies the chains with a defined input; the others get
  /// a planning probe. Nothing changes in the model unless all of it succeeds.
  void plan_and_apply(const std::vector<torch::Tensor>& inputs) {
    std::vector<std::size_t> ready;
    for (std::size_t c = 0; c < chains_.size(); ++c)
      if (c < inputs.size() && inputs[c].defined()) ready.push_back(c);
    commit_plan(ready, inputs, /*probe_the_others=*/true);
  }

  /// Called by a chain's planning probe on its first training input. The probe
  /// runs inside slot 0's AnyModule holder, which planning replaces: the holder
  /// moves to `displaced` and lives until this call (and the probe's) returns.
  torch::Tensor plan_on_first_call(std::size_t c, const torch::Tensor& x, torch::nn::AnyModule& displaced) {
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

  /// Whether the model is in training mode (planning waits for a training call).
  [[nodiscard]] bool training_call() const {
    auto root = root_.lock();
    return root && root->is_training();
  }

  /// Puts every original slot back. Never throws.
  void restore() noexcept {
    std::lock_guard<std::mutex> planning(plan_mutex_);
    for (auto& chain : chains_) {
      auto it = chain.ref.sequential->begin();
      for (std::size_t k = 0; k < chain.originals.size(); ++k, ++it) *it = chain.originals[k];
    }
  }

 private:
  static constexpr double gib = 1024.0 * 1024.0 * 1024.0;

  void add_technique_notes() {
    if (techniques_.tile && !config_.enable_checkpointing)
      report_.notes.emplace_back("enable_tiling: tiling chunks checkpointed runs, and enable_checkpointing is off, "
                                 "so nothing is tiled");
    else if (techniques_.tile)
      report_.notes.emplace_back("enable_tiling (experimental): checkpointed runs of row-independent layers may run "
                                 "over chunks (rule R10); gradients then equal the untiled ones up to summation "
                                 "order");
    if (config_.use_mixed_precision)
      report_.notes.emplace_back(
          "use_mixed_precision: the layers of the optimized chains run their forward under autocast (bfloat16 "
          "on CPU, float16 on CUDA; scale float16 losses with memscale::amp::loss_scaler); backward, the "
          "optimizer step and code outside the chains do not. To autocast the rest of the forward and the "
          "loss too, open a memscale::autocast_scope around them. The plan was profiled in full precision" +
          std::string(TORCH_VERSION_MAJOR < 2 ? ". LibTorch 1.13: CPU LayerNorm refuses a bfloat16 input with "
                                                "float32 weights under autocast (fixed in 2.x)"
                                              : ""));
    if (config_.use_8bit_optimizer)
      report_.notes.emplace_back("use_8bit_optimizer: build the optimizer with memscale::make_optimizer(config, "
                                 "params, options) to get memscale::optim::AdamW8bit (about 2.03 bytes of state per "
                                 "parameter instead of AdamW's 8); the plan budgets that state");
    if (config_.auto_policy)
      report_.notes.emplace_back("auto_policy: the Stage 1 policy is not implemented in this release; the "
                                 "Config is used as given");
    if (config_.observability_port)
      report_.notes.emplace_back("observability_port: the metrics endpoint is not implemented in this release");
    if (config_.verify_correctness)
      report_.notes.emplace_back("verify_correctness: not implemented in this release");
  }

  /// Plans chains `ready`, applies the plan (and probes on the other chains when
  /// asked) in one transaction, then publishes the report.
  void commit_plan(const std::vector<std::size_t>& ready, const std::vector<torch::Tensor>& inputs,
                   bool probe_the_others, torch::nn::AnyModule* displaced = nullptr) {
    Report next = report_;
    std::vector<std::vector<unit>> units;
    if (!ready.empty()) units = plan(ready, inputs, next);
    slot_transaction swaps;
    bool first_change = true;
    for (std::size_t i = 0; i < ready.size(); ++i) {
      // plan() appended the profiles of `ready` last, in order.
      const auto& profile = next.chains[next.chains.size() - ready.size() + i];
      apply_units(ready[i], units[i], profile.supported, swaps, first_change);
    }
    for (std::size_t c = 0; probe_the_others && c < chains_.size(); ++c) {
      if (std::find(ready.begin(), ready.end(), c) != ready.end()) continue;
      swaps.replace(*chains_[c].ref.sequential, 0,
                    torch::nn::AnyModule(std::make_shared<PlanningProbeImpl>(weak_from_this(), c,
                                                                              chains_[c].originals.front())));
      after_first_change(first_change);
    }
    detail::fault_point(detail::pipeline_stage::commit);
    // Nothing below may throw: the slots are swapped, and a caller that saw an
    // exception would restore only some of them.
    swaps.commit(displaced);
    for (auto c : ready) chains_[c].planned = true;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::swap(report_, next);
      observability::log_report(config_, report_);  // noexcept
    }
  }

  void after_first_change(bool& first_change) {
    if (first_change) {
      first_change = false;
      detail::fault_point(detail::pipeline_stage::apply);  // a failure mid-way, after one slot changed
    }
  }

  /// Profiles chains `which` (inputs indexed by chain) and runs the engine; fills `out`.
  std::vector<std::vector<unit>> plan(const std::vector<std::size_t>& which,
                                      const std::vector<torch::Tensor>& inputs, Report& out) {
    const auto device = inputs[which.front()].device();
    bool training = true;
    if (auto root = root_.lock()) training = root->is_training();
    const auto options = profile_options_from(config_, training);
    detail::fault_point(detail::pipeline_stage::profile);
    std::vector<chain_profile> profiles;
    {
      torch::AutoGradMode grad_on(true);  // profiling measures what backward keeps
      for (auto c : which)
        profiles.push_back(profile_chain(chains_[c].ref.path, chains_[c].originals, inputs[c], options));
    }
    detail::fault_point(detail::pipeline_stage::plan);

    out.device = device.str();
    const auto& hw = out.hardware;
    std::int64_t device_bytes = hw.host_total_bytes;
    if (device.is_cuda())
      for (const auto& g : hw.gpus)
        if (g.index == (device.has_index() ? device.index() : 0)) device_bytes = g.total_bytes;
    out.budget_bytes = config_.memory_budget_gb ? static_cast<std::int64_t>(*config_.memory_budget_gb * gib)
                                                : device_bytes;
    out.usable_bytes = static_cast<std::int64_t>(static_cast<double>(out.budget_bytes) *
                                                 config_.target_gpu_utilization);
    if (!out.planned) {
      out.parameter_bytes = out.gradient_bytes = out.buffer_bytes = out.optimizer_reserve_bytes = 0;
      if (auto root = root_.lock()) {
        for (const auto& p : root->parameters()) {
          if (p.device() != device) continue;
          out.parameter_bytes += static_cast<std::int64_t>(p.nbytes());
          if (!p.requires_grad()) continue;
          out.gradient_bytes += static_cast<std::int64_t>(p.nbytes());
          // AdamW keeps two moments of the parameter's size; AdamW8bit one byte each
          // plus a float per block (small tensors stay 32-bit).
          out.optimizer_reserve_bytes += config_.use_8bit_optimizer
                                             ? optim::optimizer_state_bytes(p.numel(), true)
                                             : 2 * static_cast<std::int64_t>(p.nbytes());
        }
        for (const auto& b : root->buffers())
          if (b.device() == device) out.buffer_bytes += static_cast<std::int64_t>(b.nbytes());
      }
    } else {
      // Chains planned earlier keep their forward bytes while this one runs.
      out.earlier_chains_bytes = 0;
      for (std::size_t c = 0; c < out.chains.size(); ++c)
        out.earlier_chains_bytes += project_chain(out.chains[c].slots, out.plan.units[c]).forward_end;
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
    in.tiling_allowed = in.checkpointing_allowed && static_cast<bool>(techniques_.tile);
    in.offload_allowed = static_cast<bool>(techniques_.offload);
    // On CUDA this also finds out whether memscale's engine can run the
    // process's CUDA backwards at all (and hands them back to LibTorch's if not).
    if (in.offload_allowed || device.is_cuda()) {
      // Offload lives on saved-tensor hooks: without them it would save nothing.
      if (const auto why = offload::hooks_unavailable_reason(device); !why.empty() && in.offload_allowed) {
        in.offload_allowed = false;
        const auto note = "offload disabled: " + why + "; the plan uses the other techniques only";
        if (std::find(out.notes.begin(), out.notes.end(), note) == out.notes.end()) out.notes.push_back(note);
        if (config_.enable_logging) std::clog << "[memscale] warning: " << note << "\n";
      }
    }
    if (in.offload_allowed) {
      const auto engine_options = offload::options_from(config_);
      const auto tiers = offload_room(device, engine_options);
      // Chains planned earlier (lazy planning) already use part of the room.
      std::int64_t used = 0;
      for (std::size_t c = 0; c < out.chains.size() && c < out.plan.units.size(); ++c)
        used += project_chain(out.chains[c].slots, out.plan.units[c]).offloaded_bytes;
      in.offload_budget_bytes = std::max<std::int64_t>(0, tiers.first - used);
      in.offload_bytes_per_second = tiers.second;
      in.offload_min_bytes = engine_options.min_bytes;
    }
    auto decided = decide(costs, supported, in);

    // Merge into the report: chains planned earlier stay; indices shift.
    const int offset = static_cast<int>(out.chains.size());
    for (auto& d : decided.decisions) d.chain += offset;
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
    }
    out.chains.insert(out.chains.end(), profiles.begin(), profiles.end());
    out.planned = true;
    if ((decided.overall == rule_id::checkpoint_segment || decided.overall == rule_id::tile_segment) &&
        decided.planned_peak > decided.target_bytes && config_.mode != OptimizationMode::Aggressive)
      out.notes.push_back("the projected peak " + detail::format_bytes(decided.planned_peak) +
                          " stays above the target " + detail::format_bytes(decided.target_bytes) + ": " +
                          (decided.overall == rule_id::tile_segment ? "checkpointing and tiling" : "checkpointing") +
                          " alone cannot meet this budget; this is the lowest peak the rules found");
    return decided.units;
  }

  /// Room in the offload tiers for tensors on `device` (the engine's caps, see
  /// offload::options_from), and the transfer rate to the tier they reach first:
  /// host tiers then disk for CUDA, disk only for CPU tensors.
  static std::pair<std::int64_t, double> offload_room(const c10::Device& device, const offload::engine_options& o) {
    const std::int64_t disk = o.disk_bytes.value_or(0);
    if (!device.is_cuda()) return {disk, nominal_disk_bytes_per_second};
    const std::int64_t host = o.host_bytes.value_or(0);
    return {host + disk, host > 0 ? nominal_host_link_bytes_per_second : nominal_disk_bytes_per_second};
  }

  /// The engine offloaded units share; created at the first plan that offloads.
  std::shared_ptr<offload::engine> engine_for_plan() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!engine_) engine_ = std::make_shared<offload::engine>(offload::options_from(config_));
    return engine_;
  }

  /// Replaces chain c's slots as `units` say (originals where a unit is kept).
  void apply_units(std::size_t c, const std::vector<unit>& units, bool supported, slot_transaction& swaps,
                   bool& first_change) {
    auto& chain = chains_[c];
    auto& seq = *chain.ref.sequential;
    std::vector<torch::nn::AnyModule> target = chain.originals;
    for (const auto& u : units) {
      if (!u.checkpointed && !u.offloaded) continue;
      std::vector<torch::nn::AnyModule> segment(chain.originals.begin() + u.first,
                                                chain.originals.begin() + u.last + 1);
      wrap_context context;
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
      target[static_cast<std::size_t>(u.first)] = std::move(segment.front());
      for (int k = u.first + 1; k <= u.last; ++k)
        target[static_cast<std::size_t>(k)] = torch::nn::AnyModule(std::make_shared<PassThroughImpl>());
    }
    // A chain whose slots are not all Tensor -> Tensor runs as it is: the
    // autocast wrapper has one Tensor forward.
    if (config_.use_mixed_precision && supported)
      for (auto& slot : target)
        if (!std::dynamic_pointer_cast<PassThroughImpl>(slot.ptr()))
          slot = torch::nn::AnyModule(std::make_shared<AutocastSlotImpl>(std::move(slot)));
    auto it = seq.begin();
    for (std::size_t k = 0; k < target.size(); ++k, ++it) {
      if (it->ptr() == target[k].ptr()) continue;
      swaps.replace(seq, k, std::move(target[k]));
      after_first_change(first_change);
    }
  }

  std::weak_ptr<torch::nn::Module> root_;
  Config config_;
  technique_set techniques_;
  std::vector<managed_chain> chains_;
  std::shared_ptr<offload::engine> engine_;  // guarded by mutex_
  mutable std::mutex mutex_;  // guards report_ and engine_
  std::mutex plan_mutex_;     // serializes lazy planning and restore
  Report report_;
};

inline torch::Tensor PlanningProbeImpl::forward(torch::Tensor x) {
  // Planning replaces this very slot: the module and the AnyModule holder that
  // called us stay alive (in `displaced`) until we have returned to it.
  auto keep_alive = shared_from_this();
  torch::nn::AnyModule displaced;
  // Plan from a training call: an evaluation or no-grad first call would measure
  // nothing that backward keeps. Until then, the chain runs as it is.
  auto owner = owner_.lock();
  if (owner && owner->training_call() && torch::GradMode::is_enabled() && !c10::InferenceMode::is_enabled())
    return owner->plan_on_first_call(chain_, x, displaced);
  return original_.forward<torch::Tensor>(std::move(x));
}

/// The pipeline behind wrap(): validate, find chains, (capture), profile, plan,
/// apply, register. `forward`: runs the example input through the model, or empty.
inline std::shared_ptr<attachment> attach(const std::shared_ptr<torch::nn::Module>& root, const Config& config,
                                          technique_set techniques, const std::function<void()>& forward) {
  config.validate();
  if (!root) throw UnsupportedModelError("memscale: the model is empty (a null module holder)");
  if (registry::global().find(root.get()))
    throw AlreadyOptimizedError("memscale: this model is already optimized; call memscale::detach(model) "
                                "before wrapping it again");
  auto chains = find_chains(root);
  if (chains.empty())
    throw UnsupportedModelError(
        "memscale: the model (" + root->name() +
        ") contains no torch::nn::Sequential, so memscale has no layer slots to optimize. Put the "
        "repeated layers in a torch::nn::Sequential member (for example a Sequential of transformer "
        "blocks registered with register_module), or call memscale::checkpoint(fn, inputs, params) "
        "from a custom forward");
  for (const auto& chain : chains)
    for (const auto& slot : *chain.sequential)
      if (is_memscale_slot(slot))
        throw AlreadyOptimizedError("memscale: Sequential '" + (chain.path.empty() ? root->name() : chain.path) +
                                    "' is already managed by memscale (through another model that contains "
                                    "it); detach that model first");
  auto attached = std::make_shared<attachment>(root, std::move(chains), config, techniques);
  std::vector<torch::Tensor> inputs;
  if (forward) inputs = attached->capture_inputs(forward);
  attached->plan_and_apply(inputs);
  try {
    registry::global().add(root, attached);
  } catch (...) {
    attached->restore();
    throw;
  }
  return attached;
}

/// Undoes attach(); false when memscale does not manage `root` (or, with
/// `only`, when what manages it is another attachment). Never throws.
inline bool detach(const torch::nn::Module* root, const attachment* only = nullptr) noexcept {
  std::shared_ptr<attachment> found;
  try {
    found = registry::global().remove(root, only);
  } catch (...) {
    return false;
  }
  if (!found) return false;
  found->restore();
  return true;
}

}  // namespace memscale::core
